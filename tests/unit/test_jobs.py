"""The job contract in embedded mode: the app's lifespan runs the worker pool, and a job canceled
before the loop computes it is acknowledged, not failed."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
import torch

from service.api import create_app
from service.api.body import decode_json_body
from service.broker.embedded import EmbeddedBroker
from service.jobs import Job, JobStatus, new_job_id
from service.registry import ModelRegistry
from service.storage import open_storage
from service.worker import loop
from service.worker.events import Events
from service.worker.loop import Worker
from service.worker.series import WorkerMetrics
from tests.support.api import TD0, settings, until_ready


def _workers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("psgrad-worker-")]


async def test_lifespan_starts_and_stops_the_worker_pool() -> None:
    app = create_app(settings(workers=2))
    state = app.state.psgrad
    assert isinstance(state.broker, EmbeddedBroker) and state.workers is not None
    others = set(_workers())  # any other test's, not ours
    transport = httpx.ASGITransport(app=app)  # runs no lifespan: the test enters it by hand
    async with httpx.AsyncClient(transport=transport, base_url="http://psgrad.test") as client:
        before = await client.get("/readyz")
        assert before.status_code == 503 and before.json()["ready"] is False
        async with app.router.lifespan_context(app):
            during = await until_ready(client)
            assert during.status_code == 200 and during.json()["ready"] is True
            ours = [t for t in _workers() if t not in others]
            assert len(ours) == 2 and state.workers.alive()
            answer = await client.post("/per-sample-grads", json={**TD0, "outputs": ["norms"]})
            assert answer.status_code == 200, answer.text
        assert not state.workers.alive()
        assert not any(t.is_alive() for t in ours)  # joined, not left running
        after = await client.get("/readyz")
        assert after.status_code == 503 and after.json()["ready"] is False


async def test_redis_mode_app_runs_no_workers() -> None:
    app = create_app(settings(redis_url="redis://127.0.0.1:1/0"), registry=ModelRegistry())
    state = app.state.psgrad
    try:
        assert state.workers is None  # psgrad worker processes serve the Redis queue
    finally:
        await state.broker.close()


async def test_canceled_job_is_acknowledged_and_stays_canceled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = settings(workers=0)
    broker = EmbeddedBroker(s)
    await broker.start()
    job = Job(new_job_id(), decode_json_body(TD0, max_elements=100), time.time() + 60)
    await broker.submit(job)
    taken = broker.take(10, 100, 0.0, 0.0)
    assert [j.id for j in taken] == [job.id]
    await broker.cancel(job.id)  # canceled while still queued (taken, not started)

    acknowledged: list[str] = []
    acknowledge = broker.acknowledge_canceled

    def spy(j: Job) -> None:
        acknowledged.append(j.id)
        acknowledge(j)

    def no_fail(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a canceled job is acknowledged, not failed")

    monkeypatch.setattr(broker, "fail", no_fail)
    monkeypatch.setattr(broker, "acknowledge_canceled", spy)
    metrics = WorkerMetrics()
    work = Worker(broker, ModelRegistry(), s, Events(metrics.on_event), storage=open_storage(s))
    await asyncio.to_thread(work.process, taken)
    state = await broker.state(job.id)
    await broker.close()
    assert acknowledged == [job.id]
    assert metrics.registry.get_sample_value("psgrad_jobs_total", {"status": "canceled"}) == 1
    assert metrics.registry.get_sample_value("psgrad_jobs_total", {"status": "failed"}) is None
    assert state.status is JobStatus.CANCELED and state.error is None and state.result is None


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_only_a_cpu_worker_warms_the_cpu_s_compiled_loops(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The numba loops run on CPU tensors alone: a worker on an accelerator does not compile
    (or read back) them as it starts. Its registry only names the device here: run returns
    before it loads anything."""
    warmed: list[bool] = []
    monkeypatch.setattr(loop, "warm_kernels", lambda: warmed.append(True))
    stop = threading.Event()
    stop.set()  # run warms up, then returns before taking anything
    s = settings(workers=0)
    work = Worker(EmbeddedBroker(s), ModelRegistry(torch.device(device)), s,
                  storage=open_storage(s))
    work.run(stop)
    assert warmed == ([True] if device == "cpu" else []) and work.warmed.is_set()


@pytest.mark.parametrize("allowed", [False, True])
def test_a_worker_lets_cuda_use_tf32_only_when_asked(allowed: bool) -> None:
    """PSGRAD_ALLOW_TF32 (off by default): a worker sets torch's two TF32 switches as told before
    its first job, so CUDA answers are float32's unless an operator trades digits for speed."""
    assert settings().allow_tf32 is False
    was = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = not allowed
    stop = threading.Event()
    stop.set()  # run sets up, then returns before taking anything
    try:
        s = settings(workers=0, allow_tf32=allowed)
        Worker(EmbeddedBroker(s), ModelRegistry(), s, storage=open_storage(s)).run(stop)
        assert torch.backends.cudnn.allow_tf32 is allowed
        assert torch.backends.cuda.matmul.allow_tf32 is allowed
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = was
