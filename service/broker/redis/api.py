"""The api's side of the Redis broker (asyncio): submit, wait, read, cancel, look.

The life of a job and which module holds each step: :mod:`service.broker.redis`. While Redis is
unreachable the api answers :class:`psgrad.Overloaded` (503) and recovers by itself: every call
opens a fresh connection when the pooled one is broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar, cast

import redis.asyncio as aioredis
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    MaxConnectionsError,
    RedisError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)

from psgrad._errors import InternalError, Overloaded, PsgradError, TooLarge, UnknownJob
from psgrad._wire import fields_to_safetensors
from service.broker.quotas import limits, refusal, too_large_for_quota
from service.broker.redis import keyspace
from service.broker.redis.common import (
    DEFAULT_MAX_VALUE_BYTES,
    RETRY_AFTER_DOWN_S,
    redis_unavailable,
    text,
    text_hash,
    texts,
    value_limit,
)
from service.broker.redis.lua import CANCEL_LUA, FORGET_LUA, SUBMIT_LUA
from service.broker.redis.reader import RedisAnswer
from service.config import Settings
from service.connections import connection_kwargs
from service.jobs import Answer, Job, JobState, JobStatus, replayed
from service.tenants import DEFAULT_TENANT, Quotas

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRY_AFTER_FULL_S = 1.0  # Retry-After while the queue is full
# The slowest a payload may travel to Redis before the queue counts as stalled: a submit waits
# PSGRAD_REDIS_TIMEOUT_S plus its bytes at this rate (at most PSGRAD_REDIS_TRANSFER_TIMEOUT_S)
MIN_TRANSFER_BYTES_PER_S = 8 << 20

def overloaded_from(exc: BaseException) -> Overloaded:
    """The 503 of a queue that cannot answer now. What Redis said (its address among it) goes
    to the log, not to the client. Every connection of this api's pools in use is this api's
    limit, not Redis down: said as such."""
    if isinstance(exc, MaxConnectionsError):
        log.warning("every connection of this api to Redis is in use (%s): a burst of more "
                    "requests at once than its pools hold (max(PSGRAD_MAX_QUEUE_DEPTH, 100))",
                    exc)
        return Overloaded("this api has more requests in flight than connections to its job "
                          "queue; retry shortly", retry_after=RETRY_AFTER_DOWN_S)
    log.warning("the job queue (Redis) is unavailable: %s: %s", type(exc).__name__, exc)
    return Overloaded(
        f"the job queue (Redis) is unavailable ({type(exc).__name__}); retry shortly",
        retry_after=RETRY_AFTER_DOWN_S,
    )


def encode_payload(job: Job) -> tuple[bytes, int]:
    """The request as safetensors bytes, and its number of samples (for the batcher)."""
    inputs: Any = job.fields.get("inputs")
    n = int(inputs.shape[0]) if getattr(inputs, "ndim", 0) else 1
    return fields_to_safetensors(job.fields, "request"), n


def decode_state(job_id: str, h: Mapping[str, str], answer: Answer | None) -> JobState:
    """The state hash (and its readable answer, see :class:`RedisAnswer`) as a :class:`JobState`."""
    status = JobStatus(h["status"])
    state = JobState(
        id=job_id, status=status,
        enqueued_at=float(h["enqueued_at"]) if "enqueued_at" in h else None,
        finished_at=float(h["finished_at"]) if "finished_at" in h else None,
        answer=answer, tenant=h.get("tenant", DEFAULT_TENANT),  # none: made before tenants
    )
    if "error" in h:
        state.error = json.loads(h["error"])
    state.planning_s = float(h.get("planned_s", 0.0))
    if "planning_since" in h:  # its worker plans now (RedisBroker._state)
        state.planning_s += max(0.0, time.time() - float(h["planning_since"]))
    if status is JobStatus.SUCCEEDED and answer is None:  # expired a moment before its state
        raise UnknownJob(f"job '{job_id}' has expired", id=job_id)
    return state


def _status_doc(raw: Any) -> dict[str, Any]:
    """A published worker status, or ``{}`` when absent or unreadable (never an error)."""
    if not raw:
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


class RedisBroker:
    """The api's side of the Redis broker (asyncio). Holds no state a restart would lose."""

    def __init__(self, settings: Settings) -> None:
        if not settings.redis_url:
            raise InternalError("RedisBroker needs PSGRAD_REDIS_URL")
        self.settings = settings
        self.prefix = settings.redis_prefix
        self.queue = keyspace.queue_keys(self.prefix)
        # Pools open connections as concurrent requests need them and keep them: room for
        # every request the queue admits at once (redis-py's default cap, 100, answered the
        # 101st of a burst with a 503); a waiting request holds one BLPOP connection, queued
        # or computing, hence twice as many of those
        room = max(settings.max_queue_depth, 100)
        kwargs = {**connection_kwargs(settings), "max_connections": room}
        self.r = aioredis.Redis.from_url(settings.redis_url, **kwargs)
        self.bulk = aioredis.Redis.from_url(
            settings.redis_url, **connection_kwargs(settings, bulk=True), max_connections=room)
        self.max_value_bytes = DEFAULT_MAX_VALUE_BYTES
        self._learnt = False  # max_value_bytes read from Redis (at start, or once it answers)
        # BLPOP blocks longer than any socket timeout: its own pool, bounded by asyncio instead
        self.blocking = aioredis.Redis.from_url(
            settings.redis_url, **{**kwargs, "socket_timeout": None, "max_connections": 2 * room})
        # large answers' pieces and the requests' payloads: in a Redis of their own where one
        # is configured (written once, read once: kept out of the queue's append-only file)
        self.pieces, self.pieces_blocking, self.pieces_bulk = self.r, self.blocking, self.bulk
        if settings.answer_redis_url:
            self.pieces = aioredis.Redis.from_url(settings.answer_redis_url, **kwargs)
            self.pieces_blocking = aioredis.Redis.from_url(
                settings.answer_redis_url,
                **{**kwargs, "socket_timeout": None, "max_connections": 2 * room})
            self.pieces_bulk = aioredis.Redis.from_url(
                settings.answer_redis_url, **connection_kwargs(settings, bulk=True),
                max_connections=room)
        self._submit = self.bulk.register_script(SUBMIT_LUA)
        self._cancel = self.r.register_script(CANCEL_LUA)
        self._forget = self.r.register_script(FORGET_LUA)

    def _clients(self) -> list[aioredis.Redis]:
        return list({id(c): c for c in (self.r, self.bulk, self.blocking, self.pieces,
                                         self.pieces_blocking, self.pieces_bulk)}.values())

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run ``op``; Redis errors become :class:`psgrad.Overloaded` (503) or a 500.

        Pooled connections opened before a Redis restart are dead; the first command on one
        fails with "Connection closed". Then the idle pooled connections are dropped and the
        command runs once more on a fresh one, so the api recovers at its first request.
        """
        for attempt in (0, 1):
            try:
                return await op()
            except (RedisConnectionError, RedisTimeoutError, asyncio.TimeoutError) as exc:
                if attempt or not isinstance(exc, RedisConnectionError):
                    raise self._translate(exc) from exc
                for client in self._clients():
                    await client.connection_pool.disconnect(inuse_connections=False)
            except RedisError as exc:
                if "Protocol error" in str(exc):  # Redis cut that connection: none kept
                    for client in self._clients():
                        await client.connection_pool.disconnect(inuse_connections=False)
                raise self._translate(exc) from exc
        raise AssertionError("unreachable")

    async def start(self) -> None:
        try:
            await self._learn()
        except Overloaded as exc:  # the api still starts; it answers 503 until Redis is back
            log.warning("Redis is not reachable at start-up: %s", exc.message)

    async def _learn(self) -> None:
        """What the api reads from Redis once it answers (at start, else at the first submit
        that reaches it): the longest value it takes, and the workers' consumer group."""
        try:
            config = await self._call(lambda: self.r.config_get("proto-max-bulk-len"))
            self.max_value_bytes = value_limit(config)
        except InternalError:  # CONFIG disabled: the default
            pass
        self._learnt = True
        # The consumer group exists before any worker does (workers create it too): its lag,
        # the jobs queued, is what an autoscaler reads to start the first worker.
        stream = self.queue.stream
        try:
            await self._call(lambda: self.r.xgroup_create(stream, keyspace.STREAM_GROUP, id="0",
                                                          mkstream=True))
        except (InternalError, Overloaded) as exc:
            if "BUSYGROUP" not in exc.message:
                log.warning("could not create the workers' consumer group: %s", exc.message)

    async def close(self) -> None:
        for client in self._clients():
            await client.aclose()

    def _fits(self, payload: bytes) -> None:
        """A 413 for a payload past the longest value Redis takes."""
        if len(payload) > self.max_value_bytes:
            raise TooLarge(
                f"the request takes {len(payload)} bytes in the job queue; Redis keeps at most "
                f"{self.max_value_bytes} bytes in one value: send smaller batches (psgrad.Client "
                "splits a large batch for you), or raise Redis's proto-max-bulk-len (now "
                f"{self.max_value_bytes})",
                limit=self.max_value_bytes, size=len(payload))

    async def submit(self, job: Job, quotas: Quotas | None = None) -> bool:
        payload, n = encode_payload(job)
        if not self._learnt:
            await self._learn()
        self._fits(payload)
        lim = limits(quotas, self.settings)
        if lim.queued_samples is not None and n > lim.queued_samples:
            raise too_large_for_quota(job.tenant, n, lim.queued_samples,
                                      dp_step=isinstance(job.fields.get("dp_run"), str))
        p, t, q = self.prefix, job.tenant, self.queue
        keys = keyspace.job_keys(p, job.id)
        tenant_queue, tenant_jobs, tenant_rate = (keyspace.tenant_queue(p, t),
                                                  keyspace.tenant_jobs(p, t),
                                                  keyspace.tenant_rate(p, t))
        ttl = keyspace.job_ttl_s(job.deadline - time.time(), self.settings.result_ttl_s)
        apart = self.pieces_bulk is not self.bulk
        # a stalled Redis (a paused host, a full network buffer) answers 503 in seconds, not
        # after the bulk clients' transfer timeout that a payload of hundreds of MB may need
        within = min(self.settings.redis_transfer_timeout_s,
                     self.settings.redis_timeout_s + len(payload) / MIN_TRANSFER_BYTES_PER_S)
        if apart and job.digest is not None:  # a keyed job held: its payload is in place
            held = await self._call(lambda: self.r.hget(keys.state, "digest"))
            if held is not None:
                return replayed(job, text(held))
        refused = ""
        try:
            if apart:  # first: a worker reads the payload once it finds the job in the stream
                await self._call(lambda: asyncio.wait_for(
                    self.pieces_bulk.set(keys.payload, payload, ex=ttl), within))
            reply = await self._call(lambda: asyncio.wait_for(self._submit(
                keys=[q.stream, keys.state, keys.payload, tenant_queue, q.fair_active,
                      q.fair_passes, q.fair_weights, q.fair_vtime, tenant_jobs, tenant_rate],
                args=[self.settings.max_queue_depth, ttl, b"" if apart else payload, job.id, n,
                      repr(job.enqueued_at), repr(job.deadline), t, repr(lim.weight),
                      lim.concurrent_jobs or 0, lim.queued_samples or 0,
                      lim.requests_per_s or 0, repr(lim.burst), job.digest or ""],
            ), within))
            refused, *detail = texts(reply)
        except (InternalError, Overloaded):  # a 413 where Redis's limit was lowered since read
            with contextlib.suppress(PsgradError):
                await self._learn()
            self._fits(payload)
            raise
        finally:
            if apart and refused not in ("ok", "held"):  # no job names it (else it expires)
                with contextlib.suppress(PsgradError):
                    await self._delete([], [keys.payload])
        if refused == "ok":
            return True
        if refused == "held":
            return replayed(job, detail[0])
        if refused == "depth":
            raise Overloaded(
                f"the job queue is full ({self.settings.max_queue_depth} jobs); retry shortly",
                retry_after=RETRY_AFTER_FULL_S, limit=self.settings.max_queue_depth,
            )
        raise refusal(t, lim, refused, float(detail[0]), n)

    async def wait(self, job_id: str, timeout: float, *, fresh: bool = False) -> JobState:
        """BLPOP on the job's notify list, then its state. ``fresh``: the job was submitted
        just now, so its end cannot have been announced long enough ago for the announcement
        to have expired: block at once, without reading the state first (one round trip less).
        """
        keys = keyspace.job_keys(self.prefix, job_id)
        if not fresh or timeout <= 0:
            state = await self._state(keys)
            if state.status.done or state.answer is not None or timeout <= 0:
                return state
        popped = await self._call(lambda: asyncio.wait_for(
            self.blocking.blpop([keys.notify], timeout=max(timeout, 0.01)), timeout + 5.0))
        # hand the token on (any other waiter of this job wakes too) with the state's read; a
        # fresh job's only waiter is the one that submitted it
        return await self._state(keys, hand_on=popped is not None and not fresh)

    async def state(self, job_id: str) -> JobState:
        return await self._state(keyspace.job_keys(self.prefix, job_id))

    async def _state(self, keys: keyspace.JobKeys, *, hand_on: bool = False) -> JobState:
        async def read() -> list[Any]:
            async with self.r.pipeline(transaction=False) as pipe:
                if hand_on:
                    pipe.rpush(keys.notify, b"done")
                    pipe.expire(keys.notify, keyspace.NOTIFY_TTL_S)
                pipe.hgetall(keys.state)
                pipe.xrange(keys.answer, count=1)  # its header, if any
                return cast("list[Any]", await pipe.execute())

        *_, raw, first = await self._call(read)
        if not raw:
            raise UnknownJob(f"unknown job '{keys.id}' (never submitted, or its result expired "
                             f"after {self.settings.result_ttl_s} s)", id=keys.id)
        h = text_hash(raw)
        if "planning_since" in h and (h.get("status") != JobStatus.RUNNING.value
                                      or not await self._alive(h.get("worker"))):
            del h["planning_since"]  # the job ended, or its worker died planning
        return decode_state(keys.id, h, RedisAnswer.found(self.blocking, self.pieces_blocking,
                                                          keys, h, first))

    async def _alive(self, worker: str | None) -> bool:
        """Whether ``worker``'s heartbeat is current."""
        key = keyspace.worker_heartbeat(self.prefix, worker or "")
        return worker is not None and bool(await self._call(lambda: self.r.exists(key)))

    async def cancel(self, job_id: str) -> JobState:
        keys = keyspace.job_keys(self.prefix, job_id)
        bulk = keyspace.job_bulk_keys(self.prefix, job_id, self.settings.max_attempts)
        found = await self._call(lambda: self._cancel(
            keys=[keys.state, keys.notify, keys.payload, keys.answer],
            args=[repr(time.time()), self.settings.result_ttl_s, keyspace.NOTIFY_TTL_S,
                  self.queue.tenant_jobs_base, job_id],
        ))
        if not found:
            raise UnknownJob(f"unknown job '{job_id}'", id=job_id)
        if text(found) in (JobStatus.QUEUED.value, JobStatus.RUNNING.value):
            await self._delete([], bulk)  # later pieces re-create nothing
        return await self._state(keys)

    async def forget(self, job_id: str) -> None:
        keys = keyspace.job_keys(self.prefix, job_id)
        bulk = keyspace.job_bulk_keys(self.prefix, job_id, self.settings.max_attempts)
        try:
            await self._call(lambda: self._forget(
                keys=[keys.state, keys.answer, keys.notify],
                args=[self.queue.tenant_jobs_base, job_id]))
            await self._delete([], bulk)
        except Overloaded as exc:  # the keys expire by themselves
            log.warning("could not drop job %s now: %s", job_id, exc.message)

    async def _delete(self, queue_keys: list[str], piece_keys: list[str]) -> None:
        """Delete keys of the queue's Redis and of the answers' (one command where they are
        the same Redis)."""
        if self.pieces is self.r:
            await self._call(lambda: self.r.delete(*queue_keys, *piece_keys))
            return
        if queue_keys:
            await self._call(lambda: self.r.delete(*queue_keys))
        await self._call(lambda: self.pieces.delete(*piece_keys))

    async def queue_depth(self) -> int:
        return int(await self._call(lambda: self.r.xlen(self.queue.stream)))

    async def ready(self, *, need_worker: bool = True) -> bool:
        try:
            if self.pieces is not self.r:  # answers could not be written nor read without it
                await self._call(self.pieces.ping)
            if not need_worker:  # jobs can be queued: workers may be scaled to zero for now
                return bool(await self._call(self.r.ping))
            return await self.live_workers() > 0
        except (Overloaded, InternalError):
            return False

    async def live_workers(self) -> int:
        """Workers whose heartbeat has not expired."""
        return sum(1 for w in await self._workers(with_status=False) if w["alive"])

    async def worker_snapshots(self) -> list[dict[str, Any]]:
        """Every worker's last published status (:mod:`service.worker.recorder`), with ``alive``: a
        dead worker's stays until its status key expires (``keyspace.WORKER_STATUS_TTL_S``)."""
        return await self._workers(with_status=True)

    async def _workers(self, *, with_status: bool) -> list[dict[str, Any]]:
        """``{**status, "id", "alive"}`` per known worker (the status only ``with_status``);
        names whose heartbeat and status both expired are pruned from the set."""
        p = self.prefix
        names = sorted(text(n) for n in
                       await self._call(lambda: self.r.smembers(keyspace.worker_names(p))))
        if not names:
            return []

        async def read() -> list[Any]:
            async with self.r.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.exists(keyspace.worker_heartbeat(p, name))
                    if with_status:
                        pipe.get(keyspace.worker_status(p, name))
                    else:
                        pipe.exists(keyspace.worker_status(p, name))
                return cast("list[Any]", await pipe.execute())

        replies = await self._call(read)
        found, dead = [], []
        for name, alive, status in zip(names, replies[::2], replies[1::2], strict=True):
            if not alive and not status:
                dead.append(name)
                continue
            doc = _status_doc(status) if with_status else {}
            found.append({**doc, "id": name, "alive": bool(alive)})
        if dead:
            await self._call(lambda: self.r.srem(keyspace.worker_names(p), *dead))
        return found

    @staticmethod
    def _translate(exc: BaseException) -> PsgradError:
        if isinstance(exc, asyncio.TimeoutError) or redis_unavailable(exc):
            return overloaded_from(exc)
        return InternalError(f"Redis refused a command: {str(exc)[:200]}")
