"""The job contract: what a job is, and the two sides of the queue that moves it.

The api is written against :class:`Broker` (enqueue, wait, inspect, cancel) and the worker loop
(:mod:`service.worker.loop`) against :class:`JobSource` (take, report each job's end). Two brokers
implement them, in :mod:`service.broker`: the embedded one (an in-process queue, both sides in
one object, served by the app's own worker threads) and the Redis one (Redis Streams with a
consumer group, served by ``psgrad worker`` processes on any number of hosts). Brokers only move
jobs; who runs the loop is decided by whoever starts the process. Nothing here imports the api,
the brokers or the worker.

A job carries its request as the wire dict of :mod:`psgrad._wire` (JSON values and numpy
arrays, never pickled); a result is the same kind of dict (the response fields), an error is the
JSON error body of a :class:`psgrad.PsgradError`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

import numpy as np

from psgrad._answer_reader import AnswerReader
from psgrad._errors import DeadlineExceeded, Overloaded, TooLarge
from psgrad._types import JobStatus as JobStatus  # one status enum, server and client
from psgrad._wire import RESPONSE_KEY
from service.tenants import DEFAULT_TENANT, Quotas, key_reused, keyed_id

__all__ = [
    "SMALLER_ANSWER",
    "Answer",
    "AnswerLost",
    "Broker",
    "Job",
    "JobSource",
    "JobState",
    "JobStatus",
    "answer_too_large",
    "batch_until",
    "new_job_id",
    "read_answer",
]


def new_job_id() -> str:
    return uuid.uuid4().hex


def keyed_job_id(tenant: str, key: str) -> str:
    """The id of ``tenant``'s job sent with the ``Idempotency-Key`` ``key``
    (:func:`service.tenants.keyed_id`), shaped as :func:`new_job_id`'s."""
    return keyed_id(tenant, key, 32)


def request_digest(fields: dict[str, Any]) -> str:
    """A digest of a decoded request: a keyed job's, which a try of the same key must match.
    Every field by name, a tensor by its dtype, shape and bytes, any other value as canonical
    JSON (not the safetensors form, whose metadata comes out in any order)."""
    digest = hashlib.sha256()

    def add(value: Any) -> None:
        if isinstance(value, np.ndarray):
            digest.update(f"{value.dtype.str}{list(value.shape)}".encode())
            digest.update(np.ascontiguousarray(value).reshape(-1).view(np.uint8).data)
        elif isinstance(value, dict):
            for name in sorted(value):
                digest.update(json.dumps(str(name)).encode())
                add(value[name])
            digest.update(b"}")
        else:
            digest.update(json.dumps(value, sort_keys=True).encode())

    add(fields)
    return digest.hexdigest()


def replayed(job: Job, digest: str | None) -> bool:
    """A keyed ``job`` whose id the broker holds already, with that job's ``digest``: False, the
    same request sent again (a try whose answer was lost); else a 422, since the key was sent
    with another request."""
    if digest != job.digest:
        raise key_reused("job", job.id)
    return False


@dataclass
class Job:
    """One request in the queue."""

    id: str
    fields: dict[str, Any]  # the decoded request: JSON values and numpy arrays
    deadline: float  # epoch seconds; a job whose deadline passed is not computed
    enqueued_at: float = field(default_factory=time.time)
    attempts: int = 1
    tenant: str = DEFAULT_TENANT  # who made it (service.tenants); only they (or an admin) see it
    # the deadline on the worker's monotonic clock, set by the source that hands the job over
    # (embedded: at submit; Redis: against Redis's TIME): a step of this host's wall clock
    # never expires a job, nor keeps an expired one alive (docs/operations.md)
    expires: float | None = field(default=None, compare=False)
    # a keyed job's request digest (request_digest): its key's other tries must match it
    digest: str | None = None

    def overdue_s(self) -> float:
        """Seconds past the deadline (negative: time left): on the monotonic clock where a
        source set :attr:`expires`, else on this host's wall clock."""
        if self.expires is None:
            return time.time() - self.deadline
        return time.monotonic() - self.expires

    @cached_property
    def size(self) -> int:
        """Samples in the job (the first dimension of ``inputs``; 1 if it has none)."""
        shape = getattr(self.fields.get("inputs"), "shape", None)
        return int(shape[0]) if shape else 1


class Answer(Protocol):
    """A result that arrives in pieces (Redis): the safetensors file of the response fields.

    The header comes first (every size is known before the data); :meth:`pieces` yields the
    bytes as they land and raises :class:`AnswerLost` when the attempt writing them stops, so a
    half answer is never served as whole.
    """

    size: int  # bytes of the whole file

    def pieces(self, *, consume: bool = False) -> AsyncIterator[bytes | memoryview]:
        """``consume``: each piece leaves the store once read (an answer read once, then
        forgotten: the store reuses that memory for the pieces still to come)."""


async def read_answer(answer: Answer, *, consume: bool = False) -> dict[str, Any]:
    """The answer's fields, each tensor filled in place as its pieces land (no whole copy)."""
    reader = AnswerReader(RESPONSE_KEY)
    async for piece in answer.pieces(consume=consume):
        reader.feed(piece)
    return reader.fields()


class AnswerLost(Overloaded):
    """The worker writing an answer stopped mid-answer (died, or the job was canceled or taken
    over); the job itself is retried by the queue."""

    def __init__(self, job_id: str) -> None:
        super().__init__(f"the worker answering job {job_id} stopped mid-answer; the job is "
                         "retried: retry the request", retry_after=1.0, job_id=job_id)


@dataclass
class JobState:
    """What ``GET /jobs/{id}`` shows: the status and, once done, the result or the error.

    A result is either whole in memory (``result``, the embedded broker) or an :class:`Answer`
    read in pieces (``answer``, Redis), which a running job already has while it is written.
    """

    id: str
    status: JobStatus
    result: dict[str, Any] | None = None  # the response fields (numpy arrays + JSON values)
    error: dict[str, Any] | None = None  # the JSON error body
    enqueued_at: float | None = None
    finished_at: float | None = None
    answer: Answer | None = None
    tenant: str = DEFAULT_TENANT
    planning_s: float = 0.0  # the worker's planning for this job so far: not counted as waiting
    digest: str | None = None  # a keyed job's (Job.digest)


class Broker(Protocol):
    """The api's side: enqueue, wait, inspect, cancel."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def submit(self, job: Job, quotas: Quotas | None = None) -> bool:
        """Enqueue in its tenant's queue (True); raises :class:`psgrad.Overloaded` when the
        queue is full or unreachable, :class:`psgrad.RateLimited` past one of the tenant's
        ``quotas`` (:mod:`service.broker.quotas`; None: the server's defaults and weight 1). A
        keyed job (``digest`` set) whose id is held already is not queued again: False where
        it is the same request (:func:`replayed`), else a 422."""

    async def wait(self, job_id: str, timeout: float, *, fresh: bool = False) -> JobState:
        """Block until the job is done or ``timeout`` passes (then returns its current state);
        ``fresh``: the caller submitted the job just now and is its only waiter (a broker may
        skip a first look, and need not wake another waiter)."""

    async def state(self, job_id: str) -> JobState:
        """Raises :class:`psgrad.UnknownJob` for an unknown or expired job."""

    async def cancel(self, job_id: str) -> JobState:
        """Queued or running jobs become ``canceled`` (a running job's result is dropped)."""

    async def forget(self, job_id: str) -> None:
        """Drop a job's state and result now (the sync route, once it has the answer of a
        job sent without an ``Idempotency-Key``)."""

    async def queue_depth(self) -> int: ...

    async def ready(self, *, need_worker: bool = True) -> bool:
        """The broker answers and, where workers report to it (Redis heartbeats) and
        ``need_worker``, one is alive.

        In-process workers do not report to the broker: the app asks their pool as well.
        """

    async def worker_snapshots(self) -> list[dict[str, Any]]:
        """The status (:mod:`service.worker.recorder`) each worker published through the broker,
        with ``alive``; in-process workers publish none (the app asks their pool)."""


class JobSource(Protocol):
    """The worker loop's side: take a batch of jobs, then end each one exactly one way.

    Every job taken ends through one of :meth:`succeed`, :meth:`fail` or
    :meth:`acknowledge_canceled`, which each acknowledge it (a Redis job leaves the pending
    list). ``max_value_bytes`` is the largest encoded result the source can store (None: no
    limit of its own, as both sources now); the loop refuses, before computing, a job whose
    answer would not fit.
    """

    @property
    def max_value_bytes(self) -> int | None: ...

    def take(self, max_jobs: int, max_samples: int, max_delay_s: float,
             block_s: float) -> list[Job]:
        """Wait up to ``block_s`` for a first job and return it with whatever is queued with it.

        The batching rule (:func:`batch_until`): a job that finds the worker idle (nothing was
        queued when ``take`` was called) runs at once; jobs that queued while the worker was
        busy are gathered with those that arrive until the oldest has waited ``max_delay_s``.
        """

    def waiting_tenants(self) -> set[str]:
        """The tenants with jobs queued now (the worker lets them in between two chunks of a
        running job, :meth:`service.worker.loop.Worker._computed`)."""
        ...

    def started(self, jobs: list[Job]) -> list[Job]:
        """Mark jobs running (and keep their claim fresh on long batches); returns those to
        compute, leaving out the ones canceled meanwhile (the loop acknowledges them)."""

    def succeed(self, job: Job, result: dict[str, Any]) -> None:
        """Store the result and acknowledge; a job canceled meanwhile stays ``canceled``."""

    def succeed_all(self, done: Sequence[tuple[Job, dict[str, Any]]]) -> None:
        """:meth:`succeed` for each job of an engine call, together (Redis: small answers and
        every end in one round trip)."""

    def fail(self, job: Job, error: dict[str, Any], *, retry: bool) -> None:
        """Store the error and acknowledge; with ``retry`` a transient failure may be delivered
        again. A job canceled meanwhile stays ``canceled``."""

    def acknowledge_canceled(self, job: Job) -> None:
        """Acknowledge a job the loop skips because it was canceled: nothing is stored, its
        state stays ``canceled``, and it is never delivered again."""

    def planning(self, jobs: Sequence[Job], since: float | None, spent_s: float = 0.0) -> None:
        """The worker plans these jobs' model (``since``: epoch seconds it began), or has done so
        (``since`` None) for ``spent_s`` seconds: the api's wait (:attr:`JobState.planning_s`)
        does not count that time against a job's deadline. Best effort: never raises."""


def batch_until(busy: bool, oldest_enqueued_at: float, max_delay_s: float) -> float:
    """Until when (``time.monotonic()``) ``take`` gathers more jobs for a batch.

    A lone request must not pay the batching window: when the worker was idle (``busy`` False,
    the queue empty when it asked) the batch goes at once. Jobs that queued while the worker was
    busy wait for company only until the oldest has waited ``max_delay_s`` in all: the window
    bounds a job's wait, it is never a fixed delay added to every request.
    """
    now = time.monotonic()
    if not busy or max_delay_s <= 0:
        return now
    # the oldest's wait so far, from two wall clocks (the enqueuer's, this host's), bounded to
    # [0, max_delay_s]; the window then runs on the monotonic clock, so a step of the wall
    # clock mid-window never holds a batch back (a step back of an hour held it an hour)
    left = min(max_delay_s, max(0.0, oldest_enqueued_at + max_delay_s - time.time()))
    return now + left


SMALLER_ANSWER = ("ask for summary outputs (norms, layer_norms, mean, variance, clipped_mean, dot) "
                  "instead of full per-sample grads, select fewer 'params', or send smaller "
                  "batches (psgrad.Client splits a large batch for you)")


def missed_deadline(job_id: str, waited_s: float, *, retaken: bool = False) -> DeadlineExceeded:
    """The failure of a job whose deadline passed before a worker could start it, after
    ``waited_s`` seconds in the queue; ``retaken``: a worker took it before and stopped."""
    return DeadlineExceeded(
        f"job {job_id} waited {waited_s:.1f} s in the queue and its deadline passed before a "
        + ("worker could start it again (the worker that took it first stopped)" if retaken
           else "worker could start it")
        + "; it was not computed: send it again when a worker serves the queue (GET /readyz), "
        "or as POST /jobs, whose jobs wait up to PSGRAD_JOB_TIMEOUT_S",
        waited_s=round(waited_s, 3))


def answer_too_large(size: int, limit: int, what: str, setting: str) -> TooLarge:
    """The 413 for an answer of ``size`` bytes over ``limit``; ``what`` says whose limit,
    ``setting`` how to raise it."""
    return TooLarge(f"the answer would be {size} bytes; {what} is {limit} bytes: {SMALLER_ANSWER}"
                    f"; or {setting}", limit=limit, size=size)
