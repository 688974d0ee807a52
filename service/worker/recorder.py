"""What one worker loop is doing, for the status page (``GET /status``): kept cheap, read rarely.

Each worker loop has one :class:`WorkerStatus`, a subscriber of its events
(:mod:`service.worker.events`): when a batch starts and ends, how each job ended, and the per-sample
gradient norms the engine computed anyway (any call whose outputs need squared norms: ``norms``,
``layer_norms``, ``clipped_mean``, ``cosine_mean``, unprojected ``self_influence``; never
computed for it). All of
it is a handful of counters, a bounded deque and fixed-size rings, touched once per batch or job,
never per sample; one lock per worker, shared only with the reader of :meth:`snapshot` (the page,
about once a second).

Norm histograms are kept per model and, for the tenants' own views of the page, per tenant and
model (a merged batch's norms are split by job, each job's slice counted for its tenant).

:meth:`snapshot` is a plain JSON-ready dict: in embedded mode the api reads it from the worker
threads (:meth:`service.worker.loop.WorkerPool.snapshots`), in Redis mode each ``psgrad worker``
publishes it with its heartbeat and the api aggregates every worker's
(:mod:`service.api.status_data`).
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from service.worker.events import BatchEnded, BatchStarted, JobEnded, WorkerEvent

__all__ = [
    "NORM_EDGES",
    "WINDOW_S",
    "Recent",
    "TimeRing",
    "WorkerStatus",
    "percentiles",
]

WINDOW_S = 300  # "recent": queue waits, latencies and norm histograms cover the last 5 minutes
RATE_S = 10  # samples/s: the samples of the batches finished in the last 10 s
# Norm histogram buckets: log-spaced, 8 per decade from 1e-6 to 1e6; bucket 0 holds norms below
# the first edge (zeros too), the last one norms at or above the last edge (and inf/NaN).
PER_DECADE = 8
NORM_EDGES: tuple[float, ...] = tuple(10.0 ** (e / PER_DECADE) for e in range(-48, 49))
_EDGES = np.asarray(NORM_EDGES)
MAX_MODELS = 32  # histograms kept per worker; the least recently updated model goes first
MAX_TENANT_HISTOGRAMS = 256  # (tenant, model) histograms kept per worker, the same way


def percentiles(values: Sequence[float], qs: Iterable[float] = (50, 99)) -> dict[str, Any]:
    """``{"count", "p50", "p99"}`` by nearest rank; null percentiles when there is no value."""
    ordered = sorted(values)
    out: dict[str, Any] = {"count": len(ordered)}
    for q in qs:
        rank = max(1, math.ceil(q / 100 * len(ordered)))
        out[f"p{q:g}"] = ordered[rank - 1] if ordered else None
    return out


class Recent:
    """The last ``maxlen`` values of something, with when they happened (a deque: O(1) append)."""

    def __init__(self, maxlen: int = 512) -> None:
        self._items: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, value: float, now: float | None = None) -> None:
        self._items.append((time.time() if now is None else now, value))

    def values(self, window_s: float = WINDOW_S, now: float | None = None) -> list[float]:
        """The values of the last ``window_s`` seconds, oldest first."""
        since = (time.time() if now is None else now) - window_s
        return [v for t, v in list(self._items) if t >= since]


class TimeRing:
    """Sums over a sliding window, in ``slots`` slices of ``slice_s`` seconds (fixed memory).

    A slot is reused when its slice comes round again, so what is older than the window drops out
    without any sweeping. Values are numbers or numpy arrays of one shape.
    """

    def __init__(self, slots: int, slice_s: float) -> None:
        self.slots, self.slice_s = slots, slice_s
        self._slice: list[int] = [-1] * slots
        self._value: list[Any] = [0] * slots

    def add(self, value: Any, now: float | None = None) -> None:
        s = int((time.time() if now is None else now) // self.slice_s)
        i = s % self.slots
        if self._slice[i] != s:
            self._slice[i], self._value[i] = s, value
        else:
            self._value[i] = self._value[i] + value

    def total(self, now: float | None = None, zero: Any = 0) -> Any:
        s = int((time.time() if now is None else now) // self.slice_s)
        pairs = zip(self._slice, self._value, strict=True)
        return sum((v for sl, v in pairs if s - self.slots < sl <= s), zero)


def norm_counts(norms: torch.Tensor) -> np.ndarray:
    """Counts of ``norms`` per :data:`NORM_EDGES` bucket (``len(NORM_EDGES) + 1`` of them)."""
    values = norms.detach().reshape(-1).to("cpu", torch.float64).numpy()
    idx = np.searchsorted(_EDGES, values, side="right")  # NaN sorts last: the last bucket
    return np.bincount(idx, minlength=len(_EDGES) + 1)


class WorkerStatus:
    """One worker loop's counters, the batch in hand, recent queue waits and norm histograms."""

    def __init__(self, name: str, device: str) -> None:
        self.name, self.device = name, device
        self.host, self.pid, self.started_at = socket.gethostname(), os.getpid(), time.time()
        self._lock = threading.Lock()
        self.jobs: dict[str, int] = {"succeeded": 0, "failed": 0, "canceled": 0}
        self.samples_done = 0
        self._rate = TimeRing(RATE_S, 1.0)
        self._waits = Recent()
        self._batch: dict[str, Any] | None = None
        self._norms: dict[str, TimeRing] = {}  # model ref -> bucket counts, in 30 s slices
        self._tenant_norms: dict[tuple[str, str], TimeRing] = {}  # (tenant, model) -> the same

    def on_event(self, event: WorkerEvent) -> None:
        """A subscriber of :class:`service.worker.events.Events`: the batch in hand, the counters,
        the queue waits and the norms the engine computed anyway."""
        match event:
            case BatchStarted():
                batch = {"jobs": event.jobs, "samples": event.samples, "model": event.model,
                         "since": time.time(), "tenants": sorted(set(event.tenants))}
                self._batch = batch  # one reference swap: readers see the old batch or the new
            case BatchEnded():
                self._batch = None
                if event.compute_s is None:  # failed: its jobs run alone or fail
                    return
                with self._lock:
                    self.samples_done += event.samples
                    self._rate.add(event.samples)
                for norms in event.norms:  # each job's norms count for its tenant too
                    self._observe_norms(event.model, norms, event.owners)
            case JobEnded():
                with self._lock:
                    self.jobs[event.status] = self.jobs.get(event.status, 0) + 1
                    self._waits.add(round(event.queue_s * 1000, 3))

    def _observe_norms(self, model: str, norms: torch.Tensor,
                       owners: Sequence[tuple[str, int]]) -> None:
        """Fold one engine call's per-sample norms into ``model``'s recent histogram, and each
        job's slice into its tenant's (``owners``: each job's tenant and samples, in batch
        order; norms of another length count for the model only)."""
        counts = norm_counts(norms)
        flat = norms.detach().reshape(-1)
        mine: dict[str, np.ndarray] = {}
        if owners and sum(n for _, n in owners) == flat.numel():
            at = 0
            for tenant, n in owners:
                part = norm_counts(flat[at : at + n])
                mine[tenant] = mine[tenant] + part if tenant in mine else part
                at += n
        with self._lock:
            _fold(self._norms, model, counts, MAX_MODELS)
            for tenant, part in mine.items():
                _fold(self._tenant_norms, (tenant, model), part, MAX_TENANT_HISTOGRAMS)

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """This worker now, as JSON values (published as is with a Redis heartbeat)."""
        now = time.time() if now is None else now
        zero = np.zeros(len(NORM_EDGES) + 1, dtype=np.int64)
        with self._lock:
            norms = {m: r.total(now, zero) for m, r in self._norms.items()}
            by_tenant = {k: r.total(now, zero) for k, r in self._tenant_norms.items()}
            doc = {
                "id": self.name,
                "host": self.host,
                "device": self.device,
                "pid": self.pid,
                "started_at": self.started_at,
                "time": now,
                "jobs_done": self.jobs.get("succeeded", 0),
                "jobs_failed": self.jobs.get("failed", 0),
                "jobs_canceled": self.jobs.get("canceled", 0),
                "samples_done": self.samples_done,
                "samples_per_s": round(self._rate.total(now) / RATE_S, 3),
                "queue_wait_ms": self._waits.values(WINDOW_S, now),
            }
        doc["batch"] = self._batch
        doc["norms"] = {m: c.tolist() for m, c in norms.items() if c.any()}
        tenant_norms: dict[str, dict[str, list[int]]] = {}
        for (tenant, model), c in by_tenant.items():
            if c.any():
                tenant_norms.setdefault(tenant, {})[model] = c.tolist()
        doc["tenant_norms"] = tenant_norms
        return doc

    def snapshot_json(self) -> str:
        return json.dumps(self.snapshot(), separators=(",", ":"))


def _fold(rings: dict[Any, TimeRing], key: Any, counts: np.ndarray, most: int) -> None:
    """Add ``counts`` to ``key``'s ring; past ``most`` rings the least recently updated goes."""
    ring = rings.pop(key, None)  # re-inserted last: most recently updated
    if ring is None:
        ring = TimeRing(10, WINDOW_S / 10)
        if len(rings) >= most:
            rings.pop(next(iter(rings)))
    ring.add(counts)
    rings[key] = ring
