"""``verify`` in Redis mode: the report through the answer's pieces (JSON and safetensors), a
real ``psgrad worker`` verifying every job under ``PSGRAD_VERIFY_FRACTION=1`` and counting it on
its metrics port, and a wrong answer (injected into an in-process worker loop over the same
Redis: a fault must live in the process that computes) failing its job as
``verification_failed``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from psgrad._wire import RESPONSE_KEY, SAFETENSORS, fields_from_safetensors
from service.api.app import create_app
from service.broker.redis.api import RedisBroker
from service.config import Settings
from service.verify import choose
from service.worker.events import Events
from service.worker.series import WorkerMetrics
from tests.support import faults
from tests.support.api import safetensors_body
from tests.support.cluster import cluster, job_done, settings_for
from tests.support.redis import SHARED_URL, metric, prefix_on, redis_or_skip, worker_loop


@pytest.fixture
def prefix() -> Iterator[str]:
    client = redis_or_skip()
    with prefix_on(client) as p:
        yield p
    client.close()


def doc(n: int, seed: int = 0, **extra: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"model": "value-mlp", "loss": "td0", "gamma": 0.9,
            "outputs": ["grads", "updates", "td_errors", "norms", "clipped_mean"],
            "clip_norm": 1.0,
            "inputs": rng.standard_normal((n, 8)).astype(np.float32).round(3).tolist(),
            "next_inputs": rng.standard_normal((n, 8)).astype(np.float32).round(3).tolist(),
            "rewards": rng.standard_normal(n).astype(np.float32).round(3).tolist(), **extra}


@contextlib.asynccontextmanager
async def in_process_worker(settings: Settings) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                        WorkerMetrics]]:
    """The api on a RedisBroker, and one worker loop in a thread of this process."""
    app = create_app(settings, RedisBroker(settings))
    metrics = WorkerMetrics()
    with worker_loop(settings, "verify-test", Events(metrics.on_event), block_s=0.1):
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://psgrad.test",
                timeout=60) as client:
            yield client, metrics


async def test_a_wrong_answer_fails_its_job_through_redis(prefix: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(SHARED_URL, prefix, batch_max_delay_ms=0.0)
    async with in_process_worker(settings) as (client, metrics):
        right = await client.post("/per-sample-grads", json=doc(5, verify=3, verify_seed=1))
        faults.wrong_output(monkeypatch, "updates", row=2)
        wrong = await client.post("/per-sample-grads", json=doc(5, verify=5))
        wrong_st = await client.post(
            "/per-sample-grads", content=safetensors_body(doc(5, verify=5)),
            headers={"content-type": SAFETENSORS, "accept": SAFETENSORS})
        job = (await client.post("/jobs", json=doc(4, verify=4))).json()["job_id"]
        view = await job_done(client, job)
    assert right.status_code == 200, right.text
    assert right.json()["meta"]["verify"]["samples"] == choose(5, 3, 1)
    for r in (wrong, wrong_st):
        assert r.status_code == 500
        error = r.json()["error"]
        assert error["code"] == "verification_failed", error
        assert error["details"]["sample"] == 2 and error["details"]["output"].startswith("updates/")
    assert view["status"] == "failed" and view["error"]["code"] == "verification_failed"
    page = metrics.registry
    assert page.get_sample_value("psgrad_verified_jobs_total") == 4
    assert page.get_sample_value("psgrad_verification_failures_total") == 3


async def test_a_worker_process_verifies_every_job_under_the_fraction(tmp_path: Path,
                                                                      prefix: str) -> None:
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1, verify_fraction=1.0,
                       verify_samples=2) as c:
        r = await c.client.post("/per-sample-grads", json=doc(6, verify_seed=4))
        st = await c.client.post("/per-sample-grads", content=safetensors_body(doc(3, seed=1)),
                                 headers={"content-type": SAFETENSORS, "accept": SAFETENSORS})
        asked = await c.client.post("/per-sample-grads", json=doc(4, seed=2, verify=4))
        page = httpx.get(f"http://127.0.0.1:{c.metrics_ports[0]}/metrics").text
    assert r.status_code == 200, r.text
    report = r.json()["meta"]["verify"]
    assert report["source"] == "fraction" and report["samples"] == choose(6, 2, 4)
    assert list(report["checked"]) == doc(1)["outputs"] and report["max_abs_diff"] <= 3e-3
    assert st.status_code == 200
    from_st = fields_from_safetensors(st.content, RESPONSE_KEY)["meta"]["verify"]
    assert from_st["source"] == "fraction" and len(from_st["samples"]) == 2
    assert asked.json()["meta"]["verify"]["samples"] == [0, 1, 2, 3]
    assert metric(page, "psgrad_verified_jobs_total") == 3
    assert metric(page, "psgrad_verified_samples_total") == 2 + 2 + 4
    assert metric(page, "psgrad_verification_failures_total") == 0
