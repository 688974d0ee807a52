"""Per-sample statistics of a training run, sent to psgrad beside the training loop.

A :class:`Monitor` takes a training step's batch (every ``every`` steps), copies it, and puts it
on a bounded queue; one background thread hands each to a child process at the lowest CPU
priority (:mod:`psgrad.integrations._sender`), which sends it as one request (``POST
/per-sample-grads``) and answers the statistics, which the thread logs. Training waits on
nothing but the copy: when the queue is full (the server is slow or down, or the child finds
no idle CPU) the step's batch is dropped and counted, never waited for. Requests rather than
jobs: a job's answer is polled, and the polls cost CPU (``benchmarks/callback.py``: sampling
every 10 steps from a thread, 1.12x the loop's time with jobs against 1.01-1.05x with
requests).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from psgrad._client import Client
from psgrad._noise_scale import NoiseScale
from psgrad._types import GradsResult
from psgrad.integrations._sender import Child

__all__ = ["Background", "Monitor"]

LOG = logging.getLogger("psgrad.integrations")
Log = Callable[[int, dict[str, Any]], None]
PREFIX = "psgrad/"


def _log(step: int, record: dict[str, Any]) -> None:
    LOG.info("step %d: %s", step, ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else
                                            f"{k} {v}" for k, v in record.items()))


class Background:
    """Every ``every``-th step's batch, copied onto a bounded queue and sent by one background
    thread (:meth:`_send`, a subclass's; :meth:`_stop` ends what it started); the counts of
    what was sent, answered, failed and dropped. ``max_pending`` batches wait at most: a step
    that finds the queue full is dropped, never waited for; a failed send is counted, its kind
    logged once."""

    name = "psgrad monitor"

    def __init__(self, client: Client, *, every: int, max_pending: int) -> None:
        if every < 1 or max_pending < 1:
            raise ValueError(f"every and max_pending must be at least 1; got {every}, "
                             f"{max_pending}")
        self.client, self.every = client, every
        self.sent = self.answered = self.failed = self.dropped = 0
        self._errors: set[str] = set()
        self._queue: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue(max_pending)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _put(self, step: int, batch: dict[str, Any]) -> bool:
        """Queue a copy of ``batch`` (arrays and tensors copied: the loop may change them); a
        batch that finds the queue full is dropped before it is copied."""
        if self._closing.is_set():
            return False
        try:
            if self._queue.full():
                raise queue.Full
            self._queue.put_nowait((step, {k: _copy(v) for k, v in batch.items()}))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                LOG.warning("%s: step %d dropped, %d batches still waiting for the server; "
                            "later drops are counted", self.name, step, self._queue.maxsize)
            return False
        return True

    def close(self, timeout: float = 30.0) -> dict[str, int]:
        """Wait up to ``timeout`` seconds for the batches queued, then stop; what was not sent
        by then is dropped. Logs and answers the counts."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        self._closing.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
            self.dropped += 1
            self._queue.task_done()
        self._stop()
        self._thread.join(max(0.0, deadline - time.monotonic()) + 0.1)
        counts = {"sent": self.sent, "answered": self.answered, "failed": self.failed,
                  "dropped": self.dropped}
        LOG.info("%s closed: %s", self.name, ", ".join(f"{k} {v}" for k, v in counts.items()))
        return counts

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                step, batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            self.sent += 1
            try:
                self._send(step, batch)
            except Exception as exc:  # a monitor never stops the training
                self.failed += 1
                kind = getattr(exc, "kind", type(exc).__name__)
                if kind not in self._errors:
                    self._errors.add(kind)
                    LOG.warning("%s: step %d not answered (%s: %s); later failures of this kind "
                                "are counted", self.name, step, kind, exc)
            else:
                self.answered += 1
            finally:
                self._queue.task_done()

    def _send(self, step: int, batch: dict[str, Any]) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        """Called by :meth:`close` once the queue is empty, before the thread is joined."""


class Monitor(Background):
    """Send every ``every``-th step's batch to psgrad and log what comes back.

        monitor = Monitor(client, "my-model", outputs=["norms", "gns"], every=10)
        for step, (x, y) in enumerate(loader):
            ...                                   # the training step
            monitor.observe(step, x, y, weights=dict(model.named_parameters()))
        monitor.close()

    Each answer becomes one record (``log(step, record)``; by default a line on the
    ``psgrad.integrations`` logger): ``psgrad/norm_mean`` and ``psgrad/norm_max`` and
    ``psgrad/outliers`` (the batch's samples whose norm is more than ``outlier_z`` standard
    deviations above the batch's mean, as indices into ``ids`` when given) with ``norms``;
    ``psgrad/loss_mean`` with ``losses``; ``psgrad/gns`` (this batch's) and ``psgrad/gns_ema``
    (:class:`psgrad.NoiseScale` over the run) with ``gns``. ``options`` are those of
    :meth:`psgrad.Client.per_sample_grads` (``loss``, ``params``, ...).

    ``max_pending`` batches wait at most; a step that finds the queue full is dropped
    (``dropped``), as is one the server fails (``failed``, the error logged once per kind).
    :meth:`close` waits for the queue up to its timeout and logs what was sent, answered and
    dropped.

    The requests are sent by a child process at the lowest CPU priority, so that their work
    (the HTTP client's, about 4 ms a request) runs on what the training leaves idle; where
    every core is busy, fewer steps are answered rather than the steps made slower.
    ``process=False`` sends from the monitor's thread in this process instead: for a client
    with its own transport (an in-process app), which a child cannot copy.
    """

    def __init__(self, client: Client, model: str, *, outputs: Sequence[str] = ("norms", "gns"),
                 every: int = 1, max_pending: int = 2, outlier_z: float = 3.0,
                 beta: float = 0.99, log: Log | None = None, process: bool = True,
                 **options: Any) -> None:
        self.model, self.outputs, self.options = model, list(outputs), options
        self.outlier_z = outlier_z
        self.log = log or _log
        self.noise_scale = NoiseScale(beta)
        self.records: list[dict[str, Any]] = []
        super().__init__(client, every=every, max_pending=max_pending)  # checks its arguments
        try:  # the child only once they are good: a refused monitor leaves no process behind
            self._sender: Client | Child = Child(client) if process else client
        except BaseException:
            self._closing.set()  # nor a thread
            raise

    def observe(self, step: int, inputs: Any, targets: Any = None, *,
                ids: Sequence[Any] | None = None, **fields: Any) -> bool:
        """Queue this step's batch if the step is one to sample (``step % every == 0``):
        ``inputs``, ``targets`` and per-call ``fields`` (``mask``, ``weights``, ...) are copied
        now, so the training loop may change them after. Answers whether it was queued."""
        if step % self.every:
            return False
        return self._put(step, {"inputs": inputs, "targets": targets, "ids": ids, **fields})

    def latest(self) -> dict[str, Any]:
        """The last record, or an empty dict."""
        return dict(self.records[-1]) if self.records else {}

    def _send(self, step: int, batch: dict[str, Any]) -> None:
        ids = batch.pop("ids")
        inputs, targets = batch.pop("inputs"), batch.pop("targets")
        result = self._sender.per_sample_grads(self.model, inputs, targets,
                                               outputs=self.outputs, **self.options, **batch)
        record = self._record(step, result, ids)
        self.records.append(record)
        self.log(step, record)

    def _stop(self) -> None:
        if isinstance(self._sender, Child):
            self._sender.close()

    def _record(self, step: int, result: GradsResult | Mapping[str, Any],
                ids: Sequence[Any] | None
                ) -> dict[str, Any]:
        record: dict[str, Any] = {"step": step}
        if "norms" in result:
            norms = np.asarray(result["norms"], dtype=np.float64)
            record[PREFIX + "norm_mean"] = float(norms.mean())
            record[PREFIX + "norm_max"] = float(norms.max())
            record[PREFIX + "outliers"] = [ids[i] if ids is not None else i
                                           for i in outliers(norms, self.outlier_z)]
        if "losses" in result:
            record[PREFIX + "loss_mean"] = float(np.mean(result["losses"]))
        if "gns" in result:
            record[PREFIX + "gns"] = float(result["gns"])
            record[PREFIX + "gns_ema"] = self.noise_scale.update(result)
        return record


def outliers(norms: np.ndarray, z: float) -> list[int]:
    """The samples whose norm is more than ``z`` standard deviations above the batch's mean
    (none of fewer than 3 samples, or where every norm is the same)."""
    if len(norms) < 3:
        return []
    std = float(norms.std())
    if not math.isfinite(std) or std == 0.0:
        return []
    return [int(i) for i in np.nonzero((norms - norms.mean()) / std > z)[0]]


def _copy(value: Any) -> Any:
    """A copy the training loop cannot change: torch tensors detached to the CPU, arrays copied,
    mappings of them copied entry by entry."""
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        return value.detach().to("cpu", copy=True)
    if isinstance(value, np.ndarray):
        return value.copy()
    return value
