"""How a worker takes jobs: in fair order across tenants with a ticket each
(:data:`~service.broker.redis.lua.PICK_LUA`), tickets taken over from dead workers, and the batching
window, with the tickets it holds (buffered or in a batch)."""

from __future__ import annotations

import threading
import time
from typing import Any

import redis
from redis.exceptions import ResponseError

from service.broker.redis import keyspace
from service.broker.redis.common import text, text_hash, texts
from service.broker.redis.lua import PICK_LUA
from service.config import Settings
from service.jobs import batch_until

Entry = tuple[str, str, int]  # ticket (stream entry id), job id, samples
GATHER_POLL_S = 0.001  # how often a batch being gathered looks for newcomers


def _entry_time(entry_id: str) -> float:
    """When an entry was added (epoch seconds): its id starts with Redis's clock in ms."""
    ms, _, _ = entry_id.partition("-")
    return int(ms) / 1000.0 if ms.isdigit() else time.time()


class StreamIntake:
    """One worker's taking of jobs in the consumer group, as consumer ``name``.

    :meth:`gather` returns a batch of entries within the limits; tickets taken over from a dead
    worker beyond them stay buffered for the next call. Every ticket read stays held (its claim
    refreshed by the heartbeat, never claimed back by this worker) until :meth:`release`.
    """

    def __init__(self, r: redis.Redis, settings: Settings, queue: keyspace.QueueKeys,
                 name: str) -> None:
        self.r, self.settings, self.stream, self.name = r, settings, queue.stream, name
        self._held: set[str] = set()  # entry ids this worker holds (buffered or in a batch)
        self._buffer: list[Entry] = []  # read but over the batch limits: next take starts here
        self._lock = threading.Lock()  # the heartbeat's thread reads the held ids
        self._group_ready = False
        self._autoclaim_at = 0.0
        self._pick = r.register_script(PICK_LUA)
        self._pick_keys = [queue.stream, queue.fair_active, queue.fair_passes, queue.fair_weights,
                           queue.fair_vtime, queue.tickets]
        self._queue_base = queue.tenant_queue_base
        self._tickets = queue.tickets

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
        full = False
        if not got:  # what queued while this worker was busy
            got, full, last = self._take(max_jobs, max_samples, first=True)
            busy = bool(got)
            if not got and self._wait(last, block_s):
                got, full, _ = self._take(max_jobs, max_samples, first=True)
        else:
            busy = True
        if got:
            until = batch_until(busy, _entry_time(got[0][0]), max_delay_s)
            while (not full and len(got) < max_jobs
                   and (room := max_samples - sum(e[2] for e in got)) > 0
                   and (left := until - time.monotonic()) > 0):
                # Poll rather than BLOCK for the few ms left: Redis times a blocked read out
                # at its next cron tick (up to 100 ms at the default hz 10), not after the ms
                # asked for, so each window that ended without a newcomer stalled the batch.
                more, full, _ = self._take(max_jobs - len(got), room, first=False)
                if more:
                    got += more
                elif not full:
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
            self.r.xgroup_create(self.stream, keyspace.STREAM_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._group_ready = True

    def _take(self, max_jobs: int, room: int, *, first: bool) -> tuple[list[Entry], bool, str]:
        """Jobs in fair order while they fit in ``room`` samples (``first``: the first whatever
        its size), each with its ticket; whether the next did not fit; the stream's last id."""
        try:
            reply: Any = self._pick(keys=self._pick_keys,
                                    args=[keyspace.STREAM_GROUP, self.name, self._queue_base,
                                          max_jobs, room, int(first)])
        except ResponseError as exc:
            if "NOGROUP" not in str(exc):
                raise
            self._group_ready = False  # Redis lost its data (restart without persistence)
            self._ensure_group()
            return [], False, "0-0"
        last, full, *taken = texts(reply)
        return [_bound(eid, element) for eid, element in zip(taken[::2], taken[1::2],
                                                             strict=True)], full == "1", last

    def _wait(self, last: str, block_s: float) -> bool:
        """Block up to ``block_s`` until a ticket newer than ``last`` arrives (a job queued),
        and at most half the control connection's socket timeout (PSGRAD_REDIS_TIMEOUT_S), so
        that a wait ends before its read times out."""
        block_s = min(block_s, self.settings.redis_timeout_s / 2)
        reply: Any = self.r.xread({self.stream: last}, count=1, block=max(1, int(block_s * 1000)))
        return bool(reply)

    def _autoclaim(self, count: int) -> list[Entry]:
        """Jobs pending longer than the visibility timeout (their worker died): ours now."""
        now = time.monotonic()
        vis = self.settings.visibility_timeout_s
        if now < self._autoclaim_at:
            return []
        self._autoclaim_at = now + max(0.05, min(1.0, vis / 2))
        reply: Any = self.r.xautoclaim(self.stream, keyspace.STREAM_GROUP, self.name,
                                       int(vis * 1000), "0-0", count=count)
        held = set(self.held())
        found = [(text(eid), text_hash(f))
                 for eid, f in reply[1] if f and text(eid) not in held]
        if not found:
            return []
        bound = self.r.hmget(self._tickets, [eid for eid, _ in found])
        entries, stale = [], []
        for (eid, fields), element in zip(found, bound, strict=True):
            if "id" in fields:  # an older api's entry: the job itself
                entries.append((eid, fields["id"], int(fields.get("n", "1"))))
            elif element:
                entries.append(_bound(eid, text(element)))
            else:  # a ticket no job was taken with (cannot happen: taken in one script)
                stale.append(eid)
        if stale:
            self.r.xack(self.stream, keyspace.STREAM_GROUP, *stale)
            self.r.xdel(self.stream, *stale)
        return entries


def _bound(eid: str, element: str) -> Entry:
    """A ticket and the job it was taken with (``"<n> <job id>"``)."""
    n, _, job_id = element.partition(" ")
    return eid, job_id, int(n)
