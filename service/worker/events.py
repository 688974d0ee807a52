"""What the worker loop reports: one stream of events, read by every subscriber.

The loop (:class:`service.worker.loop.Worker`) emits each event once, into the :class:`Events` it
was handed where it was assembled; the Prometheus series
(:meth:`service.worker.series.WorkerMetrics.on_event`) and the status page's recorder
(:meth:`service.worker.recorder.WorkerStatus.on_event`) are two subscribers of the same stream.
Events are small frozen records, emitted once per batch or job, never per sample, on the loop's
own thread.

In embedded mode the api's worker threads share one metrics subscriber and each has its own
status recorder; a ``psgrad worker`` process has one of each, and its status travels to the api
through Redis with its heartbeat.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "BatchEnded",
    "BatchStarted",
    "Events",
    "JobEnded",
    "JobVerified",
    "Subscriber",
    "WorkerEvent",
]

log = logging.getLogger("psgrad.worker")


@dataclass(frozen=True, slots=True)
class BatchStarted:
    """An engine call starts on ``jobs`` merged jobs of one model (``tenants``: each job's)."""

    model: str
    jobs: int
    samples: int
    tenants: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class BatchEnded:
    """The engine call ended: ``compute_s`` is None when it failed (its jobs then run alone or
    fail). ``norms`` are the per-sample gradient norms the call computed anyway (none unless its
    outputs needed squared norms), ``owners`` each job's tenant and samples in batch order."""

    model: str
    jobs: int
    samples: int
    compute_s: float | None
    norms: tuple[torch.Tensor, ...] = ()
    owners: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class JobEnded:
    """A job left the worker: ``status`` is ``succeeded``, ``failed`` or ``canceled``;
    ``queue_s`` the time it waited before its engine call (or before it ended, if none ran)."""

    status: str
    queue_s: float


@dataclass(frozen=True, slots=True)
class JobVerified:
    """A job's answer was checked against the per-sample loop (:mod:`service.verify`)."""

    samples: int
    seconds: float
    failed: bool


WorkerEvent = BatchStarted | BatchEnded | JobEnded | JobVerified
Subscriber = Callable[[WorkerEvent], None]


class Events:
    """The loop's sink: every event goes to each subscriber in turn.

    A subscriber that raises is logged and skipped: what the loop reports never fails a job.
    """

    def __init__(self, *subscribers: Subscriber) -> None:
        self.subscribers: tuple[Subscriber, ...] = subscribers

    def emit(self, event: WorkerEvent) -> None:
        for subscriber in self.subscribers:
            try:
                subscriber(event)
            except Exception:
                log.exception("a subscriber failed on %s; the worker goes on",
                              type(event).__name__)
