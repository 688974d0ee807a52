"""How a worker reads jobs from the Redis stream: new entries, entries taken over from dead
workers, and the batching window, with the entries it holds (buffered or in a batch)."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis
from redis.exceptions import ResponseError

from service import keys
from service.broker.redis import text
from service.config import Settings
from service.jobs import batch_until

Entry = tuple[str, str, int]  # stream entry id, job id, samples
GATHER_POLL_S = 0.001  # how often a batch being gathered looks for newcomers


def _entry_time(entry_id: str) -> float:
    """When an entry was added (epoch seconds): its id starts with Redis's clock in ms."""
    ms, _, _ = entry_id.partition("-")
    return int(ms) / 1000.0 if ms.isdigit() else time.time()


class StreamIntake:
    """One worker's reading of the job stream in the consumer group, as consumer ``name``.

    :meth:`gather` returns a batch of entries within the limits and keeps the rest buffered for
    the next call; every entry read stays held (its claim refreshed by the heartbeat, never
    claimed back by this worker) until :meth:`release`.
    """

    def __init__(self, r: redis.Redis, settings: Settings, stream: str, name: str) -> None:
        self.r, self.settings, self.stream, self.name = r, settings, stream, name
        self._held: set[str] = set()  # entry ids this worker holds (buffered or in a batch)
        self._buffer: list[Entry] = []  # read but over the batch limits: next take starts here
        self._lock = threading.Lock()  # the heartbeat's thread reads the held ids
        self._group_ready = False
        self._autoclaim_at = 0.0

    def held(self) -> list[str]:
        with self._lock:
            return list(self._held)

    def release(self, entry_ids: list[str]) -> None:
        with self._lock:
            self._held.difference_update(entry_ids)

    def take_buffered(self) -> list[Entry]:
        """The entries read but not handed out (still held until released)."""
        buffered, self._buffer = self._buffer, []
        return buffered

    def gather(self, max_jobs: int, max_samples: int, max_delay_s: float,
               block_s: float) -> list[Entry]:
        self._ensure_group()
        got = self._buffer
        self._buffer = []
        got += self._autoclaim(max_jobs)
        if not got:
            got = self._read(max_jobs, None)  # what queued while this worker was busy
        busy = bool(got)
        if not got:
            got = self._read(max_jobs, int(block_s * 1000))
        if got:
            until = batch_until(busy, _entry_time(got[0][0]), max_delay_s)
            while (len(got) < max_jobs and sum(e[2] for e in got) < max_samples
                   and (left := until - time.time()) > 0):
                # Poll rather than BLOCK for the few ms left: Redis times a blocked read out
                # at its next cron tick (up to 100 ms at the default hz 10), not after the ms
                # asked for, so each window that ended without a newcomer stalled the batch.
                more = self._read(max_jobs - len(got), None)
                if more:
                    got += more
                else:
                    time.sleep(min(left, GATHER_POLL_S))
        batch: list[Entry] = []
        samples = 0
        for i, entry in enumerate(got):  # at least one job, however large
            if batch and (len(batch) >= max_jobs or samples + entry[2] > max_samples):
                self._buffer = got[i:]
                break
            batch.append(entry)
            samples += entry[2]
        with self._lock:
            self._held.update(e[0] for e in got)
        return batch

    def _ensure_group(self) -> None:
        if self._group_ready:
            return
        try:  # from id 0: jobs queued before any worker existed are read too
            self.r.xgroup_create(self.stream, keys.STREAM_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _read(self, count: int, block_ms: int | None) -> list[Entry]:
        """New entries; ``block_ms`` None: only those already there (no wait)."""
        block = None if block_ms is None else max(1, block_ms)
        try:
            reply: Any = self.r.xreadgroup(keys.STREAM_GROUP, self.name, {self.stream: ">"},
                                           count=count, block=block)
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False  # Redis lost its data (restart without persistence)
            self._ensure_group()
            return []
        return [_entry(eid, f) for _, msgs in reply or [] for eid, f in msgs if f]

    def _autoclaim(self, count: int) -> list[Entry]:
        """Jobs pending longer than the visibility timeout (their worker died): ours now."""
        now = time.monotonic()
        vis = self.settings.visibility_timeout_s
        if now < self._autoclaim_at:
            return []
        self._autoclaim_at = now + max(0.05, min(1.0, vis / 2))
        reply: Any = self.r.xautoclaim(self.stream, keys.STREAM_GROUP, self.name,
                                       int(vis * 1000), "0-0", count=count)
        held = set(self.held())
        return [_entry(eid, f) for eid, f in reply[1] if f and text(eid) not in held]


def _entry(eid: Any, fields: dict[Any, Any]) -> Entry:
    f = {text(k): text(v) for k, v in fields.items()}
    return text(eid), f.get("id", ""), int(f.get("n", "1"))
