"""The worker's side of the Redis broker: take jobs from the stream, store results, acknowledge.

At-least-once: a job stays in the consumer group's pending list until :meth:`succeed` or
:meth:`fail` has stored its end (one Lua script stores and acknowledges together), or
:meth:`acknowledge_canceled` has acknowledged it (a canceled job's end is already stored). A
worker that dies leaves its jobs pending; after ``PSGRAD_VISIBILITY_TIMEOUT_S`` another worker
takes them over with ``XAUTOCLAIM``. A live worker keeps the claim on jobs it holds fresh
(``XCLAIM ... JUSTID`` from its keeper thread), so a long batch is not taken from it. Every
delivery counts an attempt; a job delivered more than ``PSGRAD_MAX_ATTEMPTS`` times ends
``failed`` with its last error (a poison job never blocks the queue).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import redis
from redis.exceptions import RedisError

from psgrad._errors import BadRequest, JobFailed, PsgradError
from psgrad._wire import RESPONSE_KEY, fields_from_safetensors, parts_size, safetensors_parts
from service.broker.redis import keyspace
from service.broker.redis.common import (
    DEFAULT_MAX_VALUE_BYTES,
    redis_unavailable,
    text,
    text_hash,
    value_limit,
)
from service.broker.redis.intake import Entry, StreamIntake
from service.broker.redis.lua import ATTEMPT_LUA, FINISH_LUA, PLANNING_LUA, RETRY_LUA, START_LUA
from service.broker.redis.writer import AnswerWriter
from service.config import Settings
from service.connections import connection_kwargs
from service.jobs import Job, JobStatus, missed_deadline
from service.tenants import DEFAULT_TENANT

log = logging.getLogger(__name__)

def script_in(pipe: Any, lua: str, keys_: list[str], args: list[Any]) -> None:
    """Queue a script on a pipeline as EVAL of its text (Redis caches it by its hash).

    redis-py sends a pipeline holding registered scripts after a ``SCRIPT EXISTS`` of its
    own, one round trip more each time; the text of these scripts is a few hundred bytes.
    """
    pipe.eval(lua, len(keys_), *keys_, *args)


class Taken(NamedTuple):
    """A job held by this worker: its stream entry's id (the ticket its end acknowledges) and
    its keys, named once when it is taken."""

    ticket: str
    keys: keyspace.JobKeys


def _completed(fn: Any, /, **kwargs: Any) -> bool:
    """True once ``fn(**kwargs)`` has returned, whatever it returns (:meth:`RedisJobSource._call`
    answers None when Redis failed)."""
    fn(**kwargs)
    return True


def consumer_name(device: str = "cpu") -> str:
    """Unique per process: host, pid, device and a random tail (pids repeat in containers)."""
    return f"{socket.gethostname()}-{os.getpid()}-{device}-{uuid.uuid4().hex[:6]}"


class RedisJobSource:
    """A :class:`service.jobs.JobSource` over the Redis stream, for one worker process.

    Call :meth:`start` to begin the heartbeat and claim keeper, :meth:`close` at the end.
    :meth:`unreachable_for` tells the worker process how long Redis has been failing.
    """

    def __init__(self, settings: Settings, *, name: str | None = None) -> None:
        if not settings.redis_url:
            raise ValueError("RedisJobSource needs PSGRAD_REDIS_URL")
        self.settings = settings
        self.prefix = settings.redis_prefix
        self.name = name or consumer_name(settings.device)
        self.queue = keyspace.queue_keys(self.prefix)
        self.stream = self.queue.stream
        # bulk: the worker reads payloads and stores results (hundreds of MB take seconds)
        self.r = redis.Redis.from_url(settings.redis_url,
                                      **connection_kwargs(settings, bulk=True))
        # control: the heartbeat, the queue's tickets, handing jobs back, leaving; small
        # replies on short timeouts, so a Redis that stops answering is noticed in seconds
        # (PSGRAD_REDIS_TIMEOUT_S) and the worker exits after PSGRAD_WORKER_REDIS_GRACE_S, not
        # after a transfer's timeout per call
        self.c = redis.Redis.from_url(settings.redis_url, **connection_kwargs(settings))
        # large answers' pieces and the requests' payloads: in a Redis of their own where one
        # is configured
        self.pr = (redis.Redis.from_url(settings.answer_redis_url,
                                        **connection_kwargs(settings, bulk=True))
                   if settings.answer_redis_url else self.r)
        # answers travel in pieces (no cap of one value); each piece fits in one value
        self.max_value_bytes: int | None = None
        self.piece_bytes = min(keyspace.ANSWER_PIECE_BYTES, self._value_limit(self.pr) // 2)
        self._retry = self.r.register_script(RETRY_LUA)
        self.intake = StreamIntake(self.c, settings, self.queue, self.name)
        self._taken: dict[str, Taken] = {}  # job id -> its ticket and keys, while held here
        self._failing_since: float | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        # the worker's status as JSON (service.worker.recorder), published with every heartbeat
        self.status: Callable[[], str] | None = None
        # whether the worker is ready (its warm-up ended): no heartbeat, so no /readyz, before
        self.ready: Callable[[], bool] = lambda: True

    # --- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        self._keeper = threading.Thread(target=self._keep, name="psgrad-keeper", daemon=True)
        self._keeper.start()

    def close(self, *, deregister: bool = True) -> None:
        self._stop.set()
        if self._keeper is not None:
            self._keeper.join(timeout=5)
        if deregister:
            try:
                self.c.delete(keyspace.worker_heartbeat(self.prefix, self.name),
                              keyspace.worker_status(self.prefix, self.name))
                self.c.srem(keyspace.worker_names(self.prefix), self.name)
            except RedisError:
                pass
        self.c.close()
        self.r.close()
        self.pr.close()

    def requeue_buffered(self) -> None:
        """Hand back jobs read but not started (on shutdown): queued again at once, not after
        the visibility timeout. Their delivery was not counted as an attempt."""
        for entry_id, job_id, _ in self.intake.take_buffered():
            self._call(self._retry, **self._retry_args(self._keys(job_id), entry_id, ""),
                       client=self.c)
            self.intake.release([entry_id])

    def unreachable_for(self) -> float:
        """Seconds since Redis last failed a call with none succeeding since; 0 when fine."""
        since = self._failing_since
        return 0.0 if since is None else time.monotonic() - since

    def beat(self) -> None:
        """Write the heartbeat that ``/readyz`` reads (and the status ``/status`` reads), and
        refresh the claim on held jobs."""
        ttl = keyspace.heartbeat_ttl_s(self.settings.heartbeat_s)
        held: list[Any] = self.intake.held()
        pipe = self.c.pipeline(transaction=False)
        if self.ready():
            pipe.set(keyspace.worker_heartbeat(self.prefix, self.name), repr(time.time()), ex=ttl)
        pipe.sadd(keyspace.worker_names(self.prefix), self.name)
        status = self._status()
        if status is not None:
            pipe.set(keyspace.worker_status(self.prefix, self.name), status,
                     ex=keyspace.WORKER_STATUS_TTL_S)
        if held:
            pipe.xclaim(self.stream, keyspace.STREAM_GROUP, self.name, 0, held, justid=True)
        pipe.execute()

    def _status(self) -> str | None:
        """The status to publish; a failure to make it never stops the heartbeat."""
        if self.status is None:
            return None
        try:
            return self.status()
        except Exception:
            log.exception("the worker's status could not be written; the heartbeat goes on")
            return None

    def _keep(self) -> None:
        period = max(0.05, min(self.settings.heartbeat_s,
                               self.settings.visibility_timeout_s / 3))
        while not self._stop.is_set():
            self._call(self.beat)
            self._stop.wait(period)

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run one Redis operation, recording whether Redis answers; None when it did not."""
        try:
            out = fn(*args, **kwargs)
        except RedisError as exc:
            if not redis_unavailable(exc):
                raise
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                log.warning("Redis unavailable: %s", exc)
            return None
        if self._failing_since is not None:
            log.warning("Redis is back")
        self._failing_since = None
        return out

    # --- JobSource -------------------------------------------------------------------------

    def waiting_tenants(self) -> set[str]:
        """The tenants whose queues hold jobs (the fair scheduler's active set); none while
        Redis does not answer."""
        found = self._call(lambda: self.c.zrange(self.queue.fair_active, 0, -1))
        return {text(t) for t in found or ()}

    def take(self, max_jobs: int, max_samples: int, max_delay_s: float,
             block_s: float) -> list[Job]:
        entries = self._call(self.intake.gather, max_jobs, max_samples, max_delay_s, block_s)
        if entries is None:
            self._stop.wait(min(block_s, 0.5))  # Redis down: do not spin
            return []
        jobs = self._call(self._load, entries)
        if jobs is None:  # entries stay pending here and are taken over after the timeout
            self.intake.release([e[0] for e in entries])
            return []
        return jobs

    def started(self, jobs: list[Job]) -> list[Job]:
        """Mark the batch running in one round trip; the jobs canceled (or ended) meanwhile are
        left out. If Redis does not answer, all of them run (their ends are retried)."""
        now = repr(time.time())
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            script_in(pipe, START_LUA, [self._keys(job.id).state], [now, self.name])
        statuses = self._call(pipe.execute)
        if statuses is None:
            return list(jobs)
        live = (JobStatus.QUEUED.value, JobStatus.RUNNING.value)
        return [job for job, st in zip(jobs, statuses, strict=True)
                if st is not None and text(st) in live]

    def succeed(self, job: Job, result: dict[str, Any]) -> None:
        self.succeed_all([(job, result)])

    def succeed_all(self, done: Sequence[tuple[Job, dict[str, Any]]]) -> None:
        """Write each answer, then mark them whole (the end script, one round trip for all).

        An answer of at most ``ANSWER_INLINE_BYTES`` goes whole with its end script; a larger
        one is written in pieces first (:class:`AnswerWriter`).
        """
        ends: list[tuple[Job, bytes]] = []
        for job, result in done:
            head, *data = safetensors_parts(result, RESPONSE_KEY)
            if parts_size([head, *data]) <= keyspace.ANSWER_INLINE_BYTES:
                ends.append((job, b"".join([head, *data])))
                continue
            ttl = keyspace.job_ttl_s(-job.overdue_s(), self.settings.result_ttl_s)
            writer = AnswerWriter(self.r, self.pr, self._keys(job.id), job.attempts, ttl_s=ttl,
                                  result_ttl_s=self.settings.result_ttl_s,
                                  piece_bytes=self.piece_bytes)
            if self._call(writer.write_parts, head, data) is None:
                log.error("job %s: Redis failed while its answer was written; it stays pending "
                          "and is redone after the visibility timeout", job.id)
                continue
            # not written (no longer ours): the end script only acknowledges, or leaves it to
            # the delivery that owns it now
            ends.append((job, b""))
        if ends and not self._end_entries(
                [(job.id, JobStatus.SUCCEEDED, "", job.attempts, answer) for job, answer in ends]):
            log.error("jobs %s: could not store their ends; they stay pending and are redone "
                      "after the visibility timeout", ", ".join(job.id for job, _ in ends))

    def fail(self, job: Job, error: dict[str, Any], *, retry: bool) -> None:
        body = json.dumps(error)
        taken = self._taken.get(job.id)
        if retry and job.attempts < self.settings.max_attempts and taken is not None:
            ok = self._persist(self._retry, **self._retry_args(taken.keys, taken.ticket, body,
                                                               job.attempts))
            if ok:
                self._forget(job.id)
            return
        self._end(job, JobStatus.FAILED, body)

    def acknowledge_canceled(self, job: Job) -> None:
        self._end(job, JobStatus.CANCELED, "")  # the script stores nothing over 'canceled'

    def planning(self, jobs: Sequence[Job], since: float | None, spent_s: float = 0.0) -> None:
        pipe = self.r.pipeline(transaction=False)
        for job in jobs:
            script_in(pipe, PLANNING_LUA, [self._keys(job.id).state],
                      ["" if since is None else repr(since), repr(spent_s)])
        self._call(pipe.execute)  # unanswered: the wait counts the planning, as before

    # --- internals -------------------------------------------------------------------------

    def _keys(self, job_id: str) -> keyspace.JobKeys:
        """A job's keys: those named when it was taken, while it is held here."""
        taken = self._taken.get(job_id)
        return taken.keys if taken is not None else keyspace.job_keys(self.prefix, job_id)

    def _retry_args(self, keys: keyspace.JobKeys, entry_id: str, error: str,
                    attempt: int | None = None) -> dict[str, list[Any]]:
        """The retry script's keys and arguments: the job goes first in its tenant's queue.
        ``attempt``: the delivery's, so that a stale one changes nothing (None: not counted)."""
        q = self.queue
        return {"keys": [keys.state, q.stream, q.tickets,
                         q.fair_active, q.fair_passes, q.fair_vtime],
                "args": [keyspace.STREAM_GROUP, entry_id, error, keys.id,
                         q.tenant_queue_base, DEFAULT_TENANT,
                         "" if attempt is None else attempt]}

    @staticmethod
    def _value_limit(r: redis.Redis) -> int:
        try:
            return value_limit(r.config_get("proto-max-bulk-len"))
        except RedisError:  # CONFIG disabled, or Redis not up yet: the default
            return DEFAULT_MAX_VALUE_BYTES

    def _load(self, entries: list[Entry]) -> list[Job]:
        """Count the attempt, read state and payload; end poison, expired and canceled jobs."""
        keys = [keyspace.job_keys(self.prefix, job_id) for _, job_id, _ in entries]
        payload_keys = [k.payload for k in keys]
        pipe = self.r.pipeline(transaction=False)
        pipe.time()  # deadlines are read against Redis's clock, never this host's
        for k in keys:
            script_in(pipe, ATTEMPT_LUA, [k.state], [])  # with the state
        if self.pr is self.r:
            pipe.mget(payload_keys)
            (seconds, micros), *counted, payloads = pipe.execute()
        else:  # the payloads are in the answers' Redis
            (seconds, micros), *counted = pipe.execute()
            payloads = self.pr.mget(payload_keys)
        jobs: list[Job] = []
        now, read_at = int(seconds) + int(micros) / 1e6, time.monotonic()
        for entry, k, (attempts, raw), payload in zip(entries, keys, counted, payloads,
                                                      strict=True):
            job_id = entry[1]
            state = text_hash(raw)
            self._taken[job_id] = Taken(entry[0], k)
            status = state.get("status")
            if status not in (JobStatus.QUEUED.value, JobStatus.RUNNING.value):
                self._end_entry(job_id, JobStatus.CANCELED, "")  # ended already: ack only
                continue
            if not payload:
                gone = JobFailed("the job's request is gone (it expired before a worker could "
                                 "take it, or was lost with a restart of the answers' Redis): "
                                 "send it again")
                self._end_entry(job_id, JobStatus.FAILED, json.dumps(gone.to_dict()))
                continue
            if int(attempts) > self.settings.max_attempts:
                self._end_entry(job_id, JobStatus.FAILED, self._poison(state, attempts))
                continue
            deadline = float(state.get("deadline", "inf"))
            if deadline < now:  # in the queue since it was queued (waited_s: Redis's clock)
                err = missed_deadline(job_id, now - float(state.get("enqueued_at", deadline)),
                                      retaken=int(attempts) > 1)
                self._end_entry(job_id, JobStatus.FAILED, json.dumps(err.to_dict()))
                continue
            try:
                fields = fields_from_safetensors(payload, "request")
            except PsgradError as exc:
                bad = BadRequest(f"the stored request cannot be decoded: {exc.message}")
                self._end_entry(job_id, JobStatus.FAILED, json.dumps(bad.to_dict()))
                continue
            jobs.append(Job(id=job_id, fields=fields, deadline=deadline,
                            enqueued_at=float(state.get("enqueued_at", now)),
                            attempts=int(attempts),
                            tenant=state.get("tenant", DEFAULT_TENANT),
                            expires=read_at + (deadline - now)))
        return jobs

    def _poison(self, state: dict[str, str], attempts: int) -> str:
        if "last_error" in state:
            return state["last_error"]
        err = JobFailed(
            f"the job was delivered {int(attempts) - 1} times and never finished (its worker "
            f"died or stalled each time; PSGRAD_MAX_ATTEMPTS={self.settings.max_attempts}); "
            "it is not retried", attempts=int(attempts) - 1,
        )
        return json.dumps(err.to_dict())

    def _end(self, job: Job, status: JobStatus, error: str) -> None:
        if self._end_entry(job.id, status, error, job.attempts):
            return
        log.error("job %s: could not store its end; it stays pending and is redone after "
                  "the visibility timeout", job.id)

    def _end_entry(self, job_id: str, status: JobStatus, error: str, attempt: int = 0) -> bool:
        return self._end_entries([(job_id, status, error, attempt, b"")])

    def _end_entries(self, ends: list[tuple[str, JobStatus, str, int, bytes]]) -> bool:
        """The end script of each (job id, status, error, attempt, inline answer), pipelined:
        one round trip, retried as a whole through a short Redis blip (each end is idempotent).
        """
        now = repr(time.time())
        q = self.queue
        keys = {job_id: self._keys(job_id) for job_id, *_ in ends}

        stored: list[Any] = []

        def store() -> Any:  # a fresh pipeline each try: one that ran is empty
            pipe = self.r.pipeline(transaction=False)
            for job_id, status, error, attempt, answer in ends:
                taken, k = self._taken.get(job_id), keys[job_id]
                script_in(pipe, FINISH_LUA,
                          [k.state, k.answer, k.notify, q.stream, k.payload, q.tickets],
                          [keyspace.STREAM_GROUP, taken.ticket if taken else "", status.value,
                           attempt, error, now, self.settings.result_ttl_s,
                           keyspace.NOTIFY_TTL_S, answer, job_id, q.tenant_jobs_base])
            stored[:] = pipe.execute()

        ok = self._persist(store)
        if ok:
            for job_id, *_ in ends:
                self._forget(job_id)
            for code, what, say in ((-1, "taken over by a later delivery", log.warning),
                                    (0, "ended meanwhile (canceled, deleted or expired)",
                                     log.info)):
                dropped = [end[0] for end, done in zip(ends, stored, strict=True)
                           if done == code and end[3] and end[1] is not JobStatus.CANCELED]
                if dropped:
                    say("jobs %s: %s; this delivery's end is dropped", ", ".join(dropped), what)
            # payloads in the answers' Redis: the end script dropped only the queue's copy
            ended = [keys[end[0]].payload for end, done in zip(ends, stored, strict=True)
                     if done == 1]
            if ended and self.pr is not self.r:
                self._call(self.pr.delete, *ended)  # else they expire with their TTL
        return ok

    def _persist(self, store: Any, **kwargs: Any) -> bool:
        """Store an end, retrying through a short Redis blip (the result is worth keeping).
        Each try counts by its own outcome: the heartbeat's thread may see Redis back between
        a failed try and this check (read as this try's success, it once left the ends'
        results empty and failed the worker's group)."""
        until = time.monotonic() + max(self.settings.redis_timeout_s * 3, 5.0)
        while True:
            if self._call(_completed, store, **kwargs):
                return True
            if time.monotonic() > until or self._stop.is_set():
                return False
            time.sleep(0.2)

    def _forget(self, job_id: str) -> None:
        taken = self._taken.pop(job_id, None)
        if taken is not None:
            self.intake.release([taken.ticket])
