"""RedisBroker (api side) and RedisJobSource (worker side) against a real Redis, in one process.

The worker side is driven by hand here, so each rule of the queue is checked on its own:
results stored once and acknowledged, redelivery after the visibility timeout, poison jobs,
deadlines, cancel, expiry, backpressure, and a Redis outage answered with 503 then recovered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from psgrad._errors import Overloaded, TooLarge, UnknownJob
from service.broker.redis import keyspace
from service.broker.redis.api import RedisBroker
from service.broker.redis.worker import RedisJobSource, Taken
from service.config import Settings
from service.jobs import Job, JobStatus, new_job_id
from service.registry import ModelRegistry
from service.storage import open_storage
from service.worker.events import Events
from service.worker.loop import Worker
from service.worker.series import WorkerMetrics
from tests.support.redis import (
    OwnRedis,
    prefix_on,
    queue,
    redis_or_skip,
    result_of,
    wait_for,
)


@pytest.fixture
def shared() -> Iterator[redis.Redis]:
    client = redis_or_skip()
    yield client
    client.close()


@contextlib.asynccontextmanager
async def own_queue(tmp_path: Path, prefix: str, *options: str
                    ) -> AsyncIterator[tuple[str, RedisBroker, RedisJobSource]]:
    """Both sides of the queue on a private redis-server started with ``options``."""
    own = OwnRedis(tmp_path, *options)
    own.start()
    settings = Settings(redis_url=own.url, redis_prefix=prefix, heartbeat_s=0.2)
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w")
    try:
        yield own.url, broker, source
    finally:
        source.close()
        await broker.close()
        own.kill()


@pytest.fixture
def settings(shared: redis.Redis) -> Iterator[Settings]:
    with prefix_on(shared) as prefix:
        yield Settings(redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix,
                       visibility_timeout_s=0.5, max_attempts=2, result_ttl_s=30,
                       max_queue_depth=5, heartbeat_s=0.2)


def job(n: int = 2, *, deadline_in: float = 60.0) -> Job:
    fields: dict[str, Any] = {"model": "linear-value", "loss": "td0",
                              "inputs": np.arange(3 * n, dtype=np.float32).reshape(n, 3),
                              "weights": {"w": np.ones(3, dtype=np.float32)}}
    return Job(id=new_job_id(), fields=fields, deadline=time.time() + deadline_in)


def take_all(source: RedisJobSource, want: int = 10) -> list[Job]:
    return source.take(max_jobs=want, max_samples=1000, max_delay_s=0.05, block_s=0.5)


async def test_submit_take_succeed_wait(settings: Settings) -> None:
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w1")
    try:
        jobs = [job(n) for n in (1, 2, 3)]
        for j in jobs:
            await broker.submit(j)
        assert await broker.queue_depth() == 3
        assert (await broker.state(jobs[0].id)).status is JobStatus.QUEUED
        taken = await asyncio.to_thread(take_all, source)
        assert [t.id for t in taken] == [j.id for j in jobs]
        assert taken[2].size == 3 and taken[0].attempts == 1
        np.testing.assert_array_equal(taken[1].fields["inputs"], jobs[1].fields["inputs"])
        assert taken[1].fields["weights"]["w"].tolist() == [1.0, 1.0, 1.0]
        source.started(taken)
        assert (await broker.state(jobs[0].id)).status is JobStatus.RUNNING

        waiter = asyncio.create_task(broker.wait(jobs[0].id, timeout=10))
        waiter2 = asyncio.create_task(broker.wait(jobs[0].id, timeout=10))
        await asyncio.sleep(0.2)
        assert not waiter.done()
        result = {"losses": np.array([1.5], dtype=np.float32), "timing": {"compute_ms": 1.0}}
        source.succeed(taken[0], result)
        for w in (waiter, waiter2):  # both waiters wake: the token is handed on
            state = await asyncio.wait_for(w, 5)
            assert state.status is JobStatus.SUCCEEDED
            result_read = await result_of(state)
            assert result_read is not None
            assert result_read["losses"].tolist() == [1.5]
            assert result_read["timing"] == {"compute_ms": 1.0}
        # a redelivered copy cannot answer again, differently
        source._taken[taken[0].id] = Taken("0-1", keyspace.job_keys(settings.redis_prefix,
                                                                      taken[0].id))
        source.succeed(taken[0], {"losses": np.array([9.0], dtype=np.float32)})
        again = await result_of(await broker.state(jobs[0].id))
        assert again is not None and again["losses"].tolist() == [1.5]

        source.fail(taken[1], {"error": {"code": "invalid_input", "message": "no"}},
                    retry=False)
        failed = await broker.wait(taken[1].id, timeout=1)
        assert failed.status is JobStatus.FAILED
        assert failed.error == {"error": {"code": "invalid_input", "message": "no"}}
        source.succeed(taken[2], {"losses": np.zeros(3, dtype=np.float32)})
        # acknowledged and deleted: nothing pending, the stream is empty
        assert await broker.queue_depth() == 0
        assert source.r.xpending(source.stream, keyspace.STREAM_GROUP)["pending"] == 0
        # payloads are dropped once a job ends
        assert source.r.exists(keyspace.job_payload(settings.redis_prefix, jobs[0].id)) == 0
    finally:
        source.close()
        await broker.close()


async def test_dead_worker_jobs_are_redelivered_then_poison(settings: Settings) -> None:
    broker = RedisBroker(settings)
    dead = RedisJobSource(settings, name="dead")
    alive = RedisJobSource(settings, name="alive")
    try:
        j = job()
        await broker.submit(j)
        assert [t.id for t in take_all(dead)] == [j.id]  # then "dies": never acks
        assert take_all(alive) == []  # not yet: the claim is fresh
        time.sleep(settings.visibility_timeout_s + 0.1)
        again = take_all(alive)
        assert [t.id for t in again] == [j.id] and again[0].attempts == 2
        # alive dies too: max_attempts=2 is exhausted, so the third delivery ends it failed
        time.sleep(settings.visibility_timeout_s + 0.1)
        third = RedisJobSource(settings, name="third")
        assert take_all(third) == []
        third.close()
        state = await broker.wait(j.id, timeout=2)
        assert state.status is JobStatus.FAILED
        assert state.error is not None and state.error["error"]["code"] == "job_failed"
        assert "delivered 2 times" in state.error["error"]["message"]
        assert await broker.queue_depth() == 0
    finally:
        dead.close()
        alive.close()
        await broker.close()


async def test_claims_stay_fresh_while_a_batch_runs(settings: Settings) -> None:
    broker = RedisBroker(settings)
    busy = RedisJobSource(settings, name="busy")
    other = RedisJobSource(settings, name="other")
    busy.start()  # the keeper refreshes the claim of held jobs
    try:
        j = job()
        await broker.submit(j)
        taken = take_all(busy)
        busy.started(taken)
        time.sleep(3 * settings.visibility_timeout_s)  # a long batch
        assert take_all(other) == []
        busy.succeed(taken[0], {"norms": np.ones(2, dtype=np.float32)})
        assert (await broker.state(j.id)).status is JobStatus.SUCCEEDED
        assert await broker.ready()  # the keeper's heartbeat
    finally:
        busy.close()
        other.close()
        await broker.close()
    assert not await _ready_after_close(settings)


async def _ready_after_close(settings: Settings) -> bool:
    broker = RedisBroker(settings)
    try:
        return await broker.ready()
    finally:
        await broker.close()


async def test_canceled_job_is_acknowledged_and_stays_canceled(
    settings: Settings, shared: redis.Redis
) -> None:
    """Canceled after a worker took it, before it started: the loop acknowledges the stream
    entry (not pending, never redelivered) and stores nothing over ``canceled``."""
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w")
    stream = keyspace.job_stream(settings.redis_prefix)
    try:
        j = job()
        await broker.submit(j)
        taken = take_all(source)
        assert [t.id for t in taken] == [j.id]
        assert shared.xpending(stream, keyspace.STREAM_GROUP)["pending"] == 1
        assert (await broker.cancel(j.id)).status is JobStatus.CANCELED
        metrics = WorkerMetrics()
        work = Worker(source, ModelRegistry(), settings, Events(metrics.on_event),
                      storage=open_storage(settings))
        await asyncio.to_thread(work.process, taken)
        assert metrics.registry.get_sample_value("psgrad_jobs_total", {"status": "canceled"}) == 1
        assert shared.xpending(stream, keyspace.STREAM_GROUP)["pending"] == 0
        assert shared.xlen(stream) == 0
        state = await broker.state(j.id)
        assert state.status is JobStatus.CANCELED and state.error is None
        time.sleep(settings.visibility_timeout_s + 0.2)
        assert take_all(source) == []  # acknowledged: no other worker takes it over
    finally:
        source.close()
        await broker.close()


async def test_a_job_canceled_while_running_drops_its_end_as_info(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """A job canceled while its worker computes it (``DELETE /jobs/{id}``, a synchronous
    request's 504): the worker's end is dropped, logged at INFO as a job that ended meanwhile,
    not as a takeover by a later delivery (a WARNING, which it was, on every 504)."""
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w")
    try:
        j = job()
        await broker.submit(j)
        taken = take_all(source)
        assert [t.id for t in source.started(taken)] == [j.id]
        assert (await broker.cancel(j.id)).status is JobStatus.CANCELED
        with caplog.at_level(logging.INFO, logger="service.broker.redis.worker"):
            source.succeed(taken[0], {"norms": np.ones(2, dtype=np.float32)})
        said = [(r.levelno, r.getMessage()) for r in caplog.records if "dropped" in r.getMessage()]
        assert said == [(logging.INFO, f"jobs {j.id}: ended meanwhile (canceled, deleted or "
                                       "expired); this delivery's end is dropped")]
        assert (await broker.state(j.id)).status is JobStatus.CANCELED
    finally:
        source.close()
        await broker.close()


async def test_retry_poison_deadline_cancel(settings: Settings) -> None:
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w")
    try:
        poison, late, canceled, fine = job(), job(deadline_in=0.2), job(), job()
        for j in (poison, late, canceled, fine):
            await broker.submit(j)
        assert (await broker.cancel(canceled.id)).status is JobStatus.CANCELED
        time.sleep(0.3)
        taken = take_all(source)
        assert [t.id for t in taken] == [poison.id, fine.id]  # late and canceled not handed out
        late_state = await broker.state(late.id)
        assert late_state.status is JobStatus.FAILED and late_state.error is not None
        assert late_state.error["error"]["code"] == "deadline_exceeded"
        assert (await broker.state(canceled.id)).status is JobStatus.CANCELED

        err = {"error": {"code": "internal_error", "message": "boom", "details": {}}}
        source.fail(taken[0], err, retry=True)  # transient: delivered again at once
        assert (await broker.state(poison.id)).status is JobStatus.QUEUED
        retaken = take_all(source)
        assert [t.id for t in retaken] == [poison.id] and retaken[0].attempts == 2
        source.fail(retaken[0], err, retry=True)  # attempts exhausted: ends failed with it
        final = await broker.state(poison.id)
        assert final.status is JobStatus.FAILED and final.error == err

        # cancel while running: the result is dropped, the job stays canceled
        assert source.started([taken[1]]) == [taken[1]]
        assert (await broker.cancel(fine.id)).status is JobStatus.CANCELED
        assert source.started([taken[1]]) == []  # canceled: the loop does not compute it
        source.succeed(taken[1], {"norms": np.ones(2, dtype=np.float32)})
        assert (await broker.state(fine.id)).status is JobStatus.CANCELED
        assert await broker.queue_depth() == 0
        with pytest.raises(UnknownJob):
            await broker.cancel("nope")
    finally:
        source.close()
        await broker.close()


async def test_full_queue_and_expiry(settings: Settings) -> None:
    broker = RedisBroker(settings.model_copy(update={"result_ttl_s": 1}))
    source = RedisJobSource(settings.model_copy(update={"result_ttl_s": 1}), name="w")
    try:
        jobs = [job() for _ in range(settings.max_queue_depth)]
        for j in jobs:
            await broker.submit(j)
        with pytest.raises(Overloaded) as info:
            await broker.submit(job())
        assert info.value.retry_after > 0
        taken = take_all(source, want=1)
        source.succeed(taken[0], {"norms": np.ones(2, dtype=np.float32)})
        await broker.submit(job())  # room again
        assert (await broker.state(jobs[0].id)).status is JobStatus.SUCCEEDED
        time.sleep(2.2)
        with pytest.raises(UnknownJob):
            await broker.state(jobs[0].id)
    finally:
        source.close()
        await broker.close()


async def test_redis_outage_gives_503_then_recovers(tmp_path: Path) -> None:
    own = OwnRedis(tmp_path)
    own.start()
    settings = Settings(redis_url=own.url, redis_prefix="outage", redis_timeout_s=0.5,
                        heartbeat_s=0.2)
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w")
    try:
        await broker.submit(job())
        own.kill()
        for call in (broker.submit(job()), broker.state("x"), broker.queue_depth(),
                     broker.wait("x", 1.0), broker.cancel("x")):
            started = time.monotonic()
            with pytest.raises(Overloaded):
                await call
            assert time.monotonic() - started < 5  # an answer, not a hang
        assert not await broker.ready()
        assert take_all(source) == []
        assert source.unreachable_for() > 0
        own.start()  # empty: the restarted server lost everything (no persistence)
        j = job()
        await broker.submit(j)
        source.beat()
        assert await broker.ready()
        taken = take_all(source)  # the consumer group is recreated from the stream's start
        assert [t.id for t in taken] == [j.id]
        assert source.unreachable_for() == 0
        source.succeed(taken[0], {"norms": np.ones(2, dtype=np.float32)})
        assert (await broker.wait(j.id, 2)).status is JobStatus.SUCCEEDED
    finally:
        source.close()
        await broker.close()
        own.kill()


async def test_a_stalled_redis_gives_503_in_seconds_then_recovers(tmp_path: Path) -> None:
    """Issue 53's third rerun: with Redis paused (SIGSTOP: connections open, no replies) a
    store append and POST /per-sample-grads answered 503 only after 60 s, the bulk clients'
    PSGRAD_REDIS_TRANSFER_TIMEOUT_S that a payload of hundreds of MB may need. A submit now
    waits PSGRAD_REDIS_TIMEOUT_S plus its bytes at 8 MiB/s; once Redis resumes it is served."""
    own = OwnRedis(tmp_path)
    own.start()
    settings = Settings(redis_url=own.url, redis_prefix="stall", redis_timeout_s=0.5,
                        redis_transfer_timeout_s=60.0, heartbeat_s=0.2)
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w")
    try:
        await broker.submit(job())
        assert own.proc is not None
        own.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            with pytest.raises(Overloaded):
                await broker.submit(job())
            assert time.monotonic() - started < 5  # 0.5 s and its bytes: an answer, not 60 s
        finally:
            own.proc.send_signal(signal.SIGCONT)
        j = job()
        await broker.submit(j)
        assert j.id in [t.id for t in take_all(source)]
    finally:
        source.close()
        await broker.close()
        own.kill()


def test_a_worker_notices_a_stalled_redis_in_seconds_and_leaves_in_seconds(
        tmp_path: Path) -> None:
    """With Redis paused (connections open, no replies), a worker's heartbeat, its take and
    its leaving each fail after PSGRAD_REDIS_TIMEOUT_S, not the transfer timeout (60 s) that
    payloads may need: ``psgrad worker`` exits PSGRAD_WORKER_REDIS_GRACE_S after Redis stopped
    answering (it took about 3 minutes with the 30 s grace). Resumed, it is served again."""
    own = OwnRedis(tmp_path)
    own.start()
    settings = Settings(redis_url=own.url, redis_prefix="stall", redis_timeout_s=0.5,
                        redis_transfer_timeout_s=60.0, heartbeat_s=0.2)
    source = RedisJobSource(settings, name="w")
    try:
        source.start()
        assert take_all(source) == [] and source.unreachable_for() == 0
        assert own.proc is not None
        own.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert take_all(source) == []  # Redis down: nothing, after its timeout
            wait_for(lambda: source.unreachable_for() > 0, 5, "the stall to be noticed")
            assert time.monotonic() - started < 5
        finally:
            own.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: source.unreachable_for() == 0, 5, "Redis to be back")
        own.proc.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            source.close()
            assert time.monotonic() - started < 10  # keeper, heartbeat key, name: seconds
        finally:
            own.proc.send_signal(signal.SIGCONT)
    finally:
        source.close(deregister=False)
        own.kill()


async def test_an_api_started_before_redis_learns_its_value_limit(tmp_path: Path) -> None:
    """An api started while Redis is down learns Redis's proto-max-bulk-len (2 MiB here) once
    Redis answers, and again when Redis refuses a payload (its limit lowered to 1 MiB since):
    a request past it is a 413 that names the limit, not a 503 "retry shortly" or a 500
    ("invalid bulk length"), and the connection Redis cut is not handed to the next request."""
    own = OwnRedis(tmp_path, "--proto-max-bulk-len", "2mb")
    broker = RedisBroker(Settings(redis_url=own.url, redis_prefix="late", redis_timeout_s=0.5))
    try:
        await broker.start()  # Redis is not up: the api starts all the same, and says so
        own.start()
        fits = job(120_000)  # 1.4 MB of inputs
        assert await broker.submit(fits) and (await broker.state(fits.id)).status is \
            JobStatus.QUEUED
        with redis.Redis.from_url(own.url) as admin:
            admin.config_set("proto-max-bulk-len", "1mb")
        for _ in range(2):  # the same refusal each time
            with pytest.raises(TooLarge) as caught:
                await broker.submit(job(120_000))  # 1.4 MB of inputs
            assert "at most 1048576 bytes in one value" in caught.value.message
            after = job()
            assert await broker.submit(after)
            assert (await broker.state(after.id)).status is JobStatus.QUEUED
    finally:
        await broker.close()
        own.kill()


async def test_a_result_over_the_value_limit_travels_in_pieces(tmp_path: Path) -> None:
    """Results have no single-value cap: a result larger than proto-max-bulk-len (1 MiB here)
    is stored as pieces that each fit, and read back whole; requests keep the limit."""
    limited = own_queue(tmp_path, "bulk", "--proto-max-bulk-len", "1mb")
    async with limited as (url, broker, source):
        await broker.start()
        assert broker.max_value_bytes == 1 << 20 and source.max_value_bytes is None
        assert source.piece_bytes <= 1 << 19
        big, fits = job(), job()
        for j in (big, fits):
            await broker.submit(j)
        taken = {t.id: t for t in take_all(source)}
        source.started(list(taken.values()))
        grads = np.arange(900_000, dtype=np.float32)  # 3.6 MB
        source.succeed(taken[big.id], {"grads": grads, "norms": np.ones(3, np.float32)})
        source.succeed(taken[fits.id], {"grads": np.ones(200_000, dtype=np.float32)})
        state = await broker.wait(big.id, 5)
        assert state.status is JobStatus.SUCCEEDED and state.answer is not None
        assert state.answer.size > 3_600_000
        read = await result_of(state)
        assert read is not None
        np.testing.assert_array_equal(read["grads"], grads)
        entries = redis.Redis.from_url(url).xrange(keyspace.job_pieces("bulk", big.id, 1))
        assert len(entries) >= 7 and all(len(f[b"d"]) <= 1 << 19 for _, f in entries)
        done = await result_of(await broker.wait(fits.id, 5))
        assert done is not None
        np.testing.assert_array_equal(done["grads"], np.ones(200_000, dtype=np.float32))


async def test_an_idle_worker_takes_a_lone_job_without_waiting_the_window(
        settings: Settings) -> None:
    broker = RedisBroker(settings)
    source = RedisJobSource(settings)
    try:
        source.take(1, 1, 0.0, 0.01)  # the consumer group exists: the job below is read

        async def submit_later() -> Job:
            await asyncio.sleep(0.3)  # the worker is idle, blocked in XREADGROUP
            j = job(1)
            await broker.submit(j)
            return j

        window_s = 60.0  # no test sits this out: waiting for it would time the test out
        taken, submitted = await asyncio.wait_for(asyncio.gather(
            asyncio.to_thread(source.take, 64, 512, window_s, 20.0), submit_later()), 20.0)
        assert [t.id for t in taken] == [submitted.id]
    finally:
        source.close()
        await broker.close()


async def test_a_gathered_batch_ends_with_its_window_not_at_a_redis_timer_tick(
        tmp_path: Path) -> None:
    """Jobs queued while the worker was busy wait for company only the window (20 ms here).

    Redis times a blocked read out at its next cron tick (every second at ``hz 1``, every
    100 ms by default), not after the ms asked for: a gather that blocked in Redis for the
    window's last ms sat out the tick instead (a lone client's one-sample requests waited
    up to 100 ms). Five batches: a blocking gather would wait out a tick in each (up to 1 s).
    """
    async with own_queue(tmp_path, "tick", "--hz", "1") as (_, broker, source):
        source.take(1, 1, 0.0, 0.01)  # the consumer group exists
        for _ in range(5):
            queued = job(1)
            await broker.submit(queued)  # queued while the worker was busy: it may wait 20 ms
            started = time.monotonic()
            taken = await asyncio.to_thread(source.take, 64, 512, 0.02, 5.0)
            assert time.monotonic() - started < 0.5
            assert [t.id for t in taken] == [queued.id]
            source.succeed(taken[0], {"norms": np.ones(1, np.float32)})


async def test_planning_time_is_recorded_and_keeps_the_state(
        settings: Settings, shared: redis.Redis) -> None:
    """A worker's planning shows in the job's state (while it runs, and summed after) and the
    state outlives the deadline by as much; a job not running records nothing. Planning whose
    worker died counts no more (it grew without end, and a request's wait with it, up to
    PSGRAD_PLANNING_GRACE_S: 903 s for a 3 s deadline), nor once another worker takes the job
    or it ends."""
    async with queue(settings) as (broker, source):
        running, queued = job(deadline_in=5.0), job()
        for j in (running, queued):
            await broker.submit(j)
        taken = await asyncio.to_thread(take_all, source, 1)
        assert [t.id for t in taken] == [running.id]
        source.started(taken)
        source.beat()  # the worker lives
        state_key = keyspace.job_state(settings.redis_prefix, running.id)
        ttl = shared.ttl(state_key)
        source.planning([taken[0], queued], time.time() - 2.0)
        assert 2.0 <= (await broker.state(running.id)).planning_s < 10.0
        assert (await broker.state(queued.id)).planning_s == 0.0
        source.planning([taken[0], queued], None, 40.0)
        assert (await broker.state(running.id)).planning_s == 40.0
        assert shared.ttl(state_key) >= ttl + 39
        source.planning([taken[0]], time.time() - 1.0)
        assert 41.0 <= (await broker.state(running.id)).planning_s < 50.0
        assert (await broker.state(queued.id)).planning_s == 0.0
        shared.delete(keyspace.worker_heartbeat(settings.redis_prefix, source.name))
        assert (await broker.state(running.id)).planning_s == 40.0  # died planning
        source.beat()
        source.started(taken)  # delivered again: the dead attempt's planning is dropped
        assert shared.hget(state_key, "planning_since") is None
        source.planning([taken[0]], time.time() - 1.0)
        source.succeed(taken[0], {"norms": np.ones(1, np.float32)})
        assert shared.hget(state_key, "planning_since") is None
        assert (await broker.state(running.id)).planning_s == 40.0


async def test_a_warming_worker_is_not_ready(settings: Settings) -> None:
    """A worker's heartbeat, which /readyz reads, waits for the end of its warm-up."""
    async with queue(settings) as (broker, source):
        warmed = False
        source.ready = lambda: warmed
        source.beat()
        assert await broker.live_workers() == 0 and not await broker.ready()
        assert await broker.ready(need_worker=False)
        warmed = True
        source.beat()
        assert await broker.live_workers() == 1 and await broker.ready()


async def test_a_pool_at_its_cap_is_not_called_redis_down(
        settings: Settings, caplog: pytest.LogCaptureFixture) -> None:
    """Every connection of the api's pool in use (a burst past its room): the 503 says it is
    this api's limit (it said "the job queue (Redis) is unavailable (MaxConnectionsError)",
    which sent an operator to a healthy Redis)."""
    broker = RedisBroker(settings)
    pool = broker.r.connection_pool
    try:
        pool.max_connections = 1
        held = await pool.get_connection()  # the one connection, in use
        with pytest.raises(Overloaded) as refused:
            await broker.state(new_job_id())
        assert refused.value.message == ("this api has more requests in flight than "
                                         "connections to its job queue; retry shortly")
        assert "every connection of this api to Redis is in use" in caplog.text
        await pool.release(held)
    finally:
        await broker.close()
