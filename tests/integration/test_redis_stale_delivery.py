"""A delivery whose job was taken over (its worker was cut off past the visibility timeout, then
came back) can no longer change the job: not answer it, not fail it, not queue it again, not
acknowledge the entry its new owner holds. The owner's answer is the one kept. Real Redis,
both worker sides driven by hand (the multi-host test shows the same across namespaces)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis

from service.broker.redis import keyspace
from service.broker.redis.api import RedisBroker
from service.broker.redis.worker import RedisJobSource
from service.config import Settings
from service.jobs import Job, JobStatus, new_job_id
from tests.support.redis import prefix_on, redis_or_skip, result_of

ERROR = {"error": {"code": "internal_error", "message": "the stale worker's error",
                   "details": {}}}


@pytest.fixture
def settings() -> Iterator[Settings]:
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        yield Settings(redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix,
                       visibility_timeout_s=0.5, max_attempts=3, result_ttl_s=30,
                       heartbeat_s=0.2)
    client.close()


def take_one(source: RedisJobSource) -> Job:
    [taken] = source.take(max_jobs=1, max_samples=1000, max_delay_s=0.05, block_s=0.5)
    return taken


async def started_on(broker: RedisBroker, source: RedisJobSource) -> Job:
    """A small job submitted, then taken and started by ``source``."""
    await broker.submit(Job(id=new_job_id(), fields={
        "model": "linear-value", "loss": "td0",
        "inputs": np.arange(6, dtype=np.float32).reshape(2, 3)}, deadline=time.time() + 60))
    mine = take_one(source)
    source.started([mine])
    return mine


def queue(settings: Settings) -> dict[str, Any]:
    stream = keyspace.job_stream(settings.redis_prefix)
    with redis.Redis.from_url(settings.redis_url or "") as r:
        pending = r.xpending_range(stream, keyspace.STREAM_GROUP, "-", "+", 10)
        return {"entries": int(r.xlen(stream)),
                "pending": sorted((p["consumer"].decode(), p["message_id"].decode())
                                  for p in pending)}


@pytest.mark.parametrize("late", ["fail", "retry", "succeed"])
async def test_a_delivery_taken_over_cannot_change_its_job(settings: Settings, late: str) -> None:
    broker = RedisBroker(settings)
    stale, owner = RedisJobSource(settings, name="stale"), RedisJobSource(settings, name="owner")
    try:
        mine = await started_on(broker, stale)
        time.sleep(settings.visibility_timeout_s + 0.2)  # the stale worker is cut off
        theirs = take_one(owner)
        owner.started([theirs])
        assert theirs.attempts == mine.attempts + 1
        held = queue(settings)
        assert held["entries"] == 1 and [c for c, _ in held["pending"]] == ["owner"]

        # the stale worker comes back and ends its delivery its own way
        if late == "succeed":
            stale.succeed(mine, {"norms": np.full(2, 666.0, dtype=np.float32)})
        else:
            stale.fail(mine, ERROR, retry=late == "retry")
        state = await broker.state(mine.id)
        assert state.status is JobStatus.RUNNING, state
        assert queue(settings) == held  # nothing queued again, the owner's entry untouched

        owner.succeed(theirs, {"norms": np.ones(2, dtype=np.float32)})
        state = await broker.state(mine.id)
        assert state.status is JobStatus.SUCCEEDED and state.error is None
        result = await result_of(state)
        assert result is not None
        np.testing.assert_array_equal(np.asarray(result["norms"]), [1.0, 1.0])
        assert queue(settings) == {"entries": 0, "pending": []}
    finally:
        stale.close()
        owner.close()
        await broker.close()


async def test_an_end_that_failed_is_retried_when_another_thread_sees_redis_back(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker's end fails in a Redis blip while its heartbeat's thread finds Redis back: the
    end is tried again and stored (it once took the other thread's success for its own and
    failed the whole group on the empty results)."""
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w")
    try:
        mine = await started_on(broker, source)
        call, tries = source._call, []

        def blip() -> None:
            raise redis.ConnectionError("a blip")

        def first_fails(fn: Any, *args: Any, **kwargs: Any) -> Any:
            tries.append(fn)
            if len(tries) > 1:
                return call(fn, *args, **kwargs)
            out = call(blip)
            source._failing_since = None  # the heartbeat's call went through meanwhile
            return out

        monkeypatch.setattr(source, "_call", first_fails)
        source.succeed(mine, {"norms": np.ones(2, dtype=np.float32)})
        assert len(tries) == 2
        state = await broker.state(mine.id)
        assert state.status is JobStatus.SUCCEEDED, state
        result = await result_of(state)
        assert result is not None
        np.testing.assert_array_equal(np.asarray(result["norms"]), [1.0, 1.0])
    finally:
        source.close()
        await broker.close()
