"""A worker whose wall clock jumps (an NTP step, a VM resumed, a clock set by hand), an hour
forward or back, while the api's does not: the worker's modules read a clock stepped by
``STEP_S`` and everything else the real one.

A deadline is set by the api's clock and compared by the worker against Redis's ``TIME`` (in
Redis mode) or converted at submit into the process's monotonic clock (embedded), never
against the worker's wall clock: a worker an hour ahead does not fail live jobs as expired,
one an hour behind does not compute expired ones, and a step back in the middle of a batching
window does not hold the batch an hour. Heartbeats and claims live on Redis's TTLs and idle
times, which the worker's clock does not touch (docs/operations.md, "A clock that jumps").
"""

from __future__ import annotations

import asyncio
import threading
import time
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from service.broker.embedded import EmbeddedBroker
from service.config import Settings
from service.jobs import Job, JobStatus, new_job_id
from service.registry import ModelRegistry
from service.storage import open_storage
from service.worker.loop import Worker
from tests.support.api import settings as embedded_settings
from tests.support.redis import queue, quick_settings

STEP_S = 3600.0
# the modules a worker reads its clock in; the api's (service.broker.redis.api, the routes)
# keep the real one
WORKER_MODULES = ("service.worker.loop", "service.jobs", "service.broker.embedded",
                  "service.broker.redis.worker", "service.broker.redis.intake")
_real_time = time.time


class SteppedClock(ModuleType):
    """``time`` whose wall clock reads ``offset`` seconds off, after ``after`` reads of it."""

    def __init__(self, offset: float, after: int = 0) -> None:
        super().__init__("time")
        self.offset, self.after, self.reads = offset, after, 0

    def time(self) -> float:
        self.reads += 1
        return _real_time() + (self.offset if self.reads > self.after else 0.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def step_worker_clock(monkeypatch: pytest.MonkeyPatch, clock: SteppedClock) -> None:
    import importlib

    for name in WORKER_MODULES:
        monkeypatch.setattr(importlib.import_module(name), "time", clock)


settings = pytest.fixture(quick_settings)


def norms_job(deadline_in_s: float) -> Job:
    fields = {"model": "mlp", "inputs": np.zeros((2, 784), np.float32), "targets": np.array([0, 1]),
              "outputs": ["norms"]}
    return Job(new_job_id(), fields, deadline=_real_time() + deadline_in_s)


@pytest.mark.parametrize("step", [STEP_S, -STEP_S], ids=["ahead", "behind"])
async def test_a_worker_whose_clock_jumps_keeps_deadlines_by_redis_time(
        settings: Settings, monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    async with queue(settings) as (broker, source):
        live, late = norms_job(60.0), norms_job(0.3)
        await broker.submit(live)
        await broker.submit(late)
        await asyncio.sleep(0.6)  # ``late``'s deadline passes (the api's clock and Redis's)
        step_worker_clock(monkeypatch, SteppedClock(step))
        worker = Worker(source, ModelRegistry(), settings, storage=open_storage(settings))
        taken = source.take(max_jobs=4, max_samples=100, max_delay_s=0.0, block_s=2.0)
        worker.process(taken)
        source.beat()  # the heartbeat is a key with a TTL: the worker's clock does not age it

        state = await broker.wait(live.id, 10)
        assert state.status is JobStatus.SUCCEEDED, state.error  # ahead: not failed as expired
        state = await broker.wait(late.id, 10)
        assert state.status is JobStatus.FAILED, state.status  # behind: not computed
        assert state.error is not None and state.error["error"]["code"] == "deadline_exceeded"
        assert await broker.live_workers() == 1


@pytest.mark.parametrize("step", [STEP_S, -STEP_S], ids=["ahead", "behind"])
async def test_an_embedded_worker_whose_clock_jumps_keeps_deadlines_monotonic(
        monkeypatch: pytest.MonkeyPatch, step: float) -> None:
    s = embedded_settings(batch_max_delay_ms=1.0)
    broker = EmbeddedBroker(s)
    await broker.start()
    live, late = norms_job(60.0), norms_job(0.3)
    await broker.submit(live)
    await broker.submit(late)
    await asyncio.sleep(0.6)
    step_worker_clock(monkeypatch, SteppedClock(step))  # after submit: the host's clock steps
    worker = Worker(broker, ModelRegistry(), s, storage=open_storage(s))
    worker.process(broker.take(4, 100, 0.0, 1.0))
    assert (await broker.state(live.id)).status is JobStatus.SUCCEEDED
    state = await broker.state(late.id)
    assert state.status is JobStatus.FAILED and state.error is not None
    assert state.error["error"]["code"] == "deadline_exceeded"
    await broker.close()


async def test_a_clock_stepped_back_mid_window_does_not_hold_the_batch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    broker = EmbeddedBroker(embedded_settings())
    await broker.start()
    await broker.submit(norms_job(60.0))  # queued while the worker was busy: it waits for company
    step_worker_clock(monkeypatch, SteppedClock(-STEP_S, after=1))  # once the window is set
    taken: list[list[Job]] = []
    thread = threading.Thread(target=lambda: taken.append(broker.take(64, 512, 0.2, 1.0)),
                              daemon=True)
    thread.start()
    await asyncio.to_thread(thread.join, 10.0)
    assert not thread.is_alive(), "a step back of the clock held the batch past its window"
    assert len(taken[0]) == 1
    await broker.close()
