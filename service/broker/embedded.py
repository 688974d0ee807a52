"""The embedded broker: an in-process queue (the default, no Redis needed).

One object is both sides of the job contract: the api calls its async :class:`Broker` methods on
the event loop, and the app's worker threads (:class:`service.worker.loop.WorkerPool`, started
by the app's lifespan) call its :class:`JobSource` methods. It moves jobs and nothing else: it
starts no thread and knows no model. All state is behind one condition variable; a finished job
wakes its waiter on the event loop with ``call_soon_threadsafe``. Finished jobs are kept for
``PSGRAD_RESULT_TTL_S`` (the sync route forgets its job as soon as it has the answer).

Jobs wait in a :class:`service.broker.fair_queue.FairQueue` (one queue per tenant, served by
weighted fair order) and each tenant's quotas are checked at submit
(:mod:`service.broker.quotas`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Sequence
from typing import Any

from psgrad._errors import Overloaded, UnknownJob
from service.broker.fair_queue import FairQueue
from service.broker.quotas import TenantUsage, limits
from service.config import Settings
from service.jobs import Job, JobState, JobStatus, batch_until, replayed
from service.tenants import Quotas

__all__ = ["EmbeddedBroker"]


class EmbeddedBroker:
    """In-process queue; :meth:`close` wakes every thread waiting in :meth:`take`."""

    max_value_bytes: int | None = None  # results stay in memory: PSGRAD_MAX_RESULT_BYTES alone

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._cond = threading.Condition()
        self._queue = FairQueue()
        self._usage = TenantUsage()
        self._held: dict[str, tuple[str, int]] = {}  # job id -> (tenant, samples), until it ends
        self._states: dict[str, JobState] = {}
        self._planning: dict[str, float] = {}  # job id -> when its worker began planning
        self._waiters: dict[str, asyncio.Event] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = threading.Event()
        self._purged_at = 0.0

    # --- Broker (the api's side, on the event loop) ---

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closed.clear()

    async def close(self) -> None:
        """Wake the takers (they get no more jobs) and cancel the jobs still queued."""
        with self._cond:
            self._closed.set()
            self._cond.notify_all()
            for job in self._queue:
                self._finish_locked(job.id, JobStatus.CANCELED, error=None)
            self._queue.clear()

    async def submit(self, job: Job, quotas: Quotas | None = None) -> bool:
        limit = self.settings.max_queue_depth
        lim = limits(quotas, self.settings)
        with self._cond:
            self._purge_locked()
            held = self._states.get(job.id) if job.digest is not None else None
            if held is not None:
                return replayed(job, held.digest)
            depth = len(self._queue)
            if depth >= limit:
                raise Overloaded(
                    f"the queue is full ({limit} jobs waiting): retry after a moment",
                    retry_after=1.0,
                    queue_depth=depth,
                )
            self._usage.admit(job.tenant, job.size, lim,
                              dp_step=isinstance(job.fields.get("dp_run"), str))
            self._held[job.id] = (job.tenant, job.size)
            self._states[job.id] = JobState(job.id, JobStatus.QUEUED, enqueued_at=job.enqueued_at,
                                            tenant=job.tenant, digest=job.digest)
            self._waiters[job.id] = asyncio.Event()
            # the deadline on this process's monotonic clock: a step of the wall clock while
            # the job queues neither expires it nor keeps it alive
            job.expires = time.monotonic() + (job.deadline - time.time())
            self._queue.push(job, lim.weight)
            self._cond.notify()
        return True

    async def wait(self, job_id: str, timeout: float, *, fresh: bool = False) -> JobState:
        state = await self.state(job_id)
        event = self._waiters.get(job_id)
        if not state.status.done and event is not None and timeout > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(event.wait(), timeout)
        return await self.state(job_id)

    async def state(self, job_id: str) -> JobState:
        with self._cond:
            self._purge_locked()
            state = self._states.get(job_id)
            if state is None:
                raise UnknownJob(
                    f"unknown job '{job_id}': it never existed, or it finished more than "
                    f"{self.settings.result_ttl_s} s ago and its result expired",
                    job_id=job_id,
                )
            since = self._planning.get(job_id)
            now = time.time()
            return dataclasses.replace(
                state, planning_s=state.planning_s + (0.0 if since is None else now - since))

    async def cancel(self, job_id: str) -> JobState:
        with self._cond:
            state = self._states.get(job_id)
            if state is None:
                raise UnknownJob(f"unknown job '{job_id}'", job_id=job_id)
            if not state.status.done:
                self._queue.remove(job_id)
                self._finish_locked(job_id, JobStatus.CANCELED, error=None)
        return await self.state(job_id)

    async def forget(self, job_id: str) -> None:
        with self._cond:
            self._release_locked(job_id)
            self._states.pop(job_id, None)
            self._waiters.pop(job_id, None)
            self._planning.pop(job_id, None)

    async def queue_depth(self) -> int:
        return len(self._queue)

    async def ready(self, *, need_worker: bool = True) -> bool:
        """Started and not closed; whether a worker serves the queue is the pool's to say."""
        return self._loop is not None and not self._closed.is_set()

    async def worker_snapshots(self) -> list[dict[str, Any]]:
        """None: the worker threads report to their pool, not to the queue."""
        return []

    # --- JobSource (the worker threads' side) ---

    def waiting_tenants(self) -> set[str]:
        with self._cond:
            return self._queue.tenants()

    def take(
        self, max_jobs: int, max_samples: int, max_delay_s: float, block_s: float
    ) -> list[Job]:
        with self._cond:
            busy = bool(self._queue)  # these queued while this worker was computing
            end = time.monotonic() + block_s
            while not self._queue:
                remaining = end - time.monotonic()
                if self._closed.is_set() or remaining <= 0:
                    return []
                self._cond.wait(remaining)
            if self._closed.is_set():
                return []
            first = self._queue.pop()
            assert first is not None  # the queue is not empty
            jobs, samples = [first], first.size
            until = batch_until(busy, first.enqueued_at, max_delay_s)
            while len(jobs) < max_jobs and samples < max_samples and not self._closed.is_set():
                if self._queue:  # the next in fair order, if it fits; else the batch is full
                    job = self._queue.pop(max_samples - samples)
                    if job is None:
                        break
                    jobs.append(job)
                    samples += job.size
                    continue
                remaining = until - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            return jobs

    def started(self, jobs: list[Job]) -> list[Job]:
        running = []
        with self._cond:
            for job in jobs:
                state = self._states.get(job.id)
                if state is None or state.status.done:  # canceled (or forgotten) meanwhile
                    continue
                state.status = JobStatus.RUNNING
                running.append(job)
        return running

    def succeed(self, job: Job, result: dict[str, Any]) -> None:
        self.succeed_all([(job, result)])

    def succeed_all(self, done: Sequence[tuple[Job, dict[str, Any]]]) -> None:
        with self._cond:
            for job, result in done:
                self._finish_locked(job.id, JobStatus.SUCCEEDED, result=result)

    def fail(self, job: Job, error: dict[str, Any], *, retry: bool) -> None:
        with self._cond:  # in process there is nobody else to retry: fail at once
            self._finish_locked(job.id, JobStatus.FAILED, error=error)

    def acknowledge_canceled(self, job: Job) -> None:
        """Nothing to do: the job left the queue when it was taken and its state is final."""

    def planning(self, jobs: Sequence[Job], since: float | None, spent_s: float = 0.0) -> None:
        with self._cond:
            for job in jobs:
                state = self._states.get(job.id)
                if since is not None:
                    self._planning[job.id] = since
                elif self._planning.pop(job.id, None) is not None and state is not None:
                    state.planning_s += spent_s

    # --- internals (call with the lock held) ---

    def _finish_locked(
        self,
        job_id: str,
        status: JobStatus,
        *,
        result: dict[str, Any] | None = None,
        error: dict[str, Any] | None = None,
    ) -> None:
        state = self._states.get(job_id)
        if state is None or state.status.done:  # canceled (or forgotten) meanwhile: keep that
            return
        self._release_locked(job_id)
        self._planning.pop(job_id, None)
        state.status, state.result, state.error = status, result, error
        state.finished_at = time.time()
        event = self._waiters.get(job_id)
        if event is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                self._loop.call_soon_threadsafe(event.set)

    def _release_locked(self, job_id: str) -> None:
        """The job no longer counts towards its tenant's quotas."""
        held = self._held.pop(job_id, None)
        if held is not None:
            self._usage.release(*held)

    def _purge_locked(self) -> None:
        now = time.time()
        if now - self._purged_at < min(1.0, self.settings.result_ttl_s / 2):
            return
        self._purged_at = now
        cutoff = now - self.settings.result_ttl_s
        for job_id in [
            k
            for k, s in self._states.items()
            if s.finished_at is not None and s.finished_at < cutoff
        ]:
            del self._states[job_id]
            self._waiters.pop(job_id, None)
