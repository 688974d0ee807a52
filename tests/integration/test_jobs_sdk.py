"""A job through the SDK over real HTTP, under the ``Idempotency-Key`` the client gives each
submit: sent again after a lost answer and queued once; the key sent again with another body
is refused; each tenant's keys are its own."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

import psgrad
from service.api import create_app
from service.api.routes import grads as grads_route
from tests.support.api import open_client, serving, settings


def _samples_computed(url: str) -> float:
    line = next(x for x in httpx.get(f"{url}/metrics").text.splitlines()
                if x.startswith("psgrad_samples_total "))
    return float(line.split()[1])


def test_a_job_whose_answer_is_lost_is_queued_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The first try is slowed past the client's timeout (1 s against 0.5 s) before it
    queues the job; the client sends it again under the same key, and both tries name one
    job, computed once. (Before keys the client raised, not sending a job again.)"""
    real, tries = grads_route.request_digest, []

    def first_slow(fields: dict[str, Any]) -> str:
        tries.append(1)
        if len(tries) == 1:
            time.sleep(1.0)
        return real(fields)

    monkeypatch.setattr(grads_route, "request_digest", first_slow)
    x = np.random.default_rng(0).standard_normal((3, 8)).astype(np.float32)
    y = np.zeros(3, np.float32)
    app = create_app(settings(data_dir=str(tmp_path / "data")))
    with serving(app) as url, psgrad.Client(url, timeout=httpx.Timeout(0.5, connect=5.0),
                                            max_retries=3) as hasty:
        job = hasty.submit("value-mlp", x, y, outputs=["norms"], loss="mse")
        with psgrad.Client(url) as client:
            norms = client.job(job.id).result(timeout=60).norms
            direct = client.per_sample_grads("value-mlp", x, y, outputs=["norms"],
                                             loss="mse").norms
        np.testing.assert_allclose(norms, direct, rtol=1e-6)
        time.sleep(2)  # every try sent has reached the broker by now
        assert len(tries) >= 2 and _samples_computed(url) == 6  # the job's 3, then direct's


async def test_a_key_names_one_request_of_one_tenant() -> None:
    body = {"model": "value-mlp", "inputs": [[0.5] * 8], "targets": [1.0], "outputs": ["norms"],
            "loss": "mse"}
    keys = {"api_keys": "alice:alice-key,bob:bob-key"}
    async with open_client(workers=0, **keys) as c:
        def sent(tenant: str, key: str) -> dict[str, str]:
            return {"authorization": f"Bearer {tenant}-key", "Idempotency-Key": key}

        first = await c.post("/jobs", json=body, headers=sent("alice", "k1"))
        again = await c.post("/jobs", json=body, headers=sent("alice", "k1"))
        assert first.status_code == again.status_code == 202, again.text
        assert again.json() == first.json() == {"job_id": first.json()["job_id"],
                                                "status": "queued"}
        other = await c.post("/jobs", json={**body, "targets": [2.0]},
                             headers=sent("alice", "k1"))
        assert other.status_code == 422, other.text
        assert "Idempotency-Key" in other.json()["error"]["message"]
        bob = await c.post("/jobs", json=body, headers=sent("bob", "k1"))
        assert bob.status_code == 202 and bob.json()["job_id"] != first.json()["job_id"]
        plain = [(await c.post("/jobs", json=body, headers={"authorization": "Bearer alice-key"}
                               )).json()["job_id"] for _ in range(2)]
        assert len({*plain, first.json()["job_id"]}) == 3  # no key: a job each
        bad = await c.post("/jobs", json=body, headers=sent("alice", "x" * 129))
        assert bad.status_code == 422 and "Idempotency-Key" in bad.text, bad.text
