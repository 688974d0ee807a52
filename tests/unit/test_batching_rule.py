"""The batching rule: a job that finds the worker idle runs at once; only jobs that queued while
the worker was busy wait for company, and never longer than the window in all.

No timed assertion can flake here: the window is 60 s and the bounds are seconds, or the rule
is checked on :func:`service.jobs.batch_until` itself.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np

from service.broker.embedded import EmbeddedBroker
from service.jobs import Job, batch_until, new_job_id
from tests.support.api import settings

WINDOW_S = 60.0  # a window no test could sit out: any wait for it would time the test out


def _job(*, age_s: float = 0.0) -> Job:
    fields: dict[str, Any] = {"model": "mlp", "inputs": np.zeros((1, 4), np.float32)}
    now = time.time()
    return Job(new_job_id(), fields, deadline=now + 60, enqueued_at=now - age_s)


def test_an_idle_worker_never_waits_the_window() -> None:
    assert batch_until(False, time.time(), WINDOW_S) <= time.monotonic()
    assert batch_until(True, time.time(), 0.0) <= time.monotonic()


def test_jobs_queued_while_busy_wait_at_most_the_window_in_all() -> None:
    now, mono = time.time(), time.monotonic()  # the window runs on the monotonic clock
    assert batch_until(True, now - 10.0, 5.0) <= time.monotonic()  # waited long enough already
    until = batch_until(True, now - 1.0, 5.0)
    assert mono + 3.9 <= until <= time.monotonic() + 4.0 + 1e-3
    assert batch_until(True, now + 100.0, 5.0) <= time.monotonic() + 5.0  # a clock ahead


async def test_a_lone_job_is_taken_at_once_by_an_idle_worker() -> None:
    broker = EmbeddedBroker(settings())
    await broker.start()
    taken: list[list[Job]] = []
    took = threading.Event()

    def take() -> None:
        taken.append(broker.take(64, 512, WINDOW_S, block_s=30.0))
        took.set()

    thread = threading.Thread(target=take)
    thread.start()
    await asyncio.sleep(0.2)  # the worker is idle, blocked in take
    job = _job()
    await broker.submit(job)
    assert await asyncio.to_thread(took.wait, 20.0), "an idle worker sat out the window"
    thread.join()
    assert [j.id for j in taken[0]] == [job.id]
    await broker.close()


async def test_jobs_queued_while_busy_are_batched_together() -> None:
    broker = EmbeddedBroker(settings())
    await broker.start()
    jobs = [_job(age_s=WINDOW_S) for _ in range(3)]  # queued while the worker computed
    for job in jobs:
        await broker.submit(job)
    got = await asyncio.wait_for(asyncio.to_thread(broker.take, 64, 512, WINDOW_S, 1.0), 20.0)
    assert [j.id for j in got] == [j.id for j in jobs]
    await broker.close()
