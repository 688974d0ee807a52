"""The deadline does not count the time a worker spends planning a model (a cold start).

Planning is held open by an event here, so each test knows it outlasts the deadline without
timing anything: the request still answers (within ``PSGRAD_PLANNING_GRACE_S``), and answers
504 where no grace is given. Redis records the same (tests/integration/test_redis_broker.py).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from service.engine import Batch, Options
from service.fast_stats import _plan
from tests.support.api import app_of, open_client
from tests.support.reference import assert_close, reference

BODY = {"model": "mlp", "outputs": ["norms"], "targets": [0, 1, 2]}


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Planning waits for this event (set it to let the plan be made)."""
    gate = threading.Event()
    made = _plan._plan

    def slow(*args: Any) -> Any:
        assert gate.wait(60), "the test never let planning end"
        return made(*args)

    monkeypatch.setattr(_plan, "_plan", slow)
    _plan.PLANS.clear()
    yield gate
    gate.set()


async def test_planning_past_the_deadline_still_answers(held: threading.Event) -> None:
    inputs = torch.randn(3, 784)
    async with open_client(request_timeout_s=2.0) as client:
        app_of(client).state.psgrad.registry.get("mlp")  # loaded: the job's first step plans
        sent = asyncio.create_task(client.post(
            "/per-sample-grads", json={**BODY, "inputs": inputs.tolist()}))
        await asyncio.sleep(4.0)  # the deadline passed while the worker plans
        assert not sent.done()
        held.set()
        r = await sent
        assert r.status_code == 200, r.text
        assert r.json()["meta"]["route"] == "fast_stats"
        model = app_of(client).state.psgrad.registry.get("mlp")
    batch = Batch(inputs=inputs, targets=torch.tensor([0, 1, 2]))
    opts = Options(loss="cross_entropy", outputs=("norms",), params=tuple(model.params))
    want = reference(model, batch, opts, [3])[0]["norms"]
    assert_close(torch.tensor(r.json()["norms"]), want)


async def test_without_a_grace_planning_counts(held: threading.Event) -> None:
    async with open_client(request_timeout_s=2.0, planning_grace_s=0.0) as client:
        app_of(client).state.psgrad.registry.get("mlp")
        r = await client.post("/per-sample-grads",
                              json={**BODY, "inputs": torch.randn(3, 784).tolist()})
        held.set()
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"


async def test_a_jobs_planning_shows_while_it_runs(held: threading.Event) -> None:
    async with open_client() as client:
        job = (await client.post("/jobs", json={**BODY, "inputs": torch.randn(3, 784).tolist()}
                                 )).json()["job_id"]
        for _ in range(200):
            view = (await client.get(f"/jobs/{job}")).json()
            if view["planning_s"] > 0.2:
                break
            await asyncio.sleep(0.05)
        assert view["status"] == "running" and view["planning_s"] > 0.2
        held.set()
        for _ in range(600):
            view = (await client.get(f"/jobs/{job}")).json()
            if view["status"] != "running":
                break
            await asyncio.sleep(0.05)
    assert view["status"] == "succeeded" and view["planning_s"] > 0.2
