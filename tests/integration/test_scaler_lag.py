"""What KEDA's redis-streams scaler reads (deploy/kubernetes/base/keda.yaml) follows the queue.

The scaler's ``lagCount`` mode reads ``XINFO GROUPS <stream>`` and takes the group's ``lag``:
entries added to the stream that the group has not delivered yet. Before any worker made the
group (a fresh deployment scaled to zero), it reads the stream's length; with no stream, 0
(KEDA v2.20.2, pkg/scalers/redis_streams_scaler.go). Here, against a real Redis and the real
broker, that figure is the number of jobs queued and not yet taken, through takes, answers,
retries and cancels, so a queued job always wakes a worker and a drained queue lets them go.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import redis

from service.broker.redis import keyspace
from service.broker.redis.api import RedisBroker
from service.broker.redis.worker import RedisJobSource
from service.config import Settings
from service.jobs import Job, new_job_id
from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip


def keda_lag(r: redis.Redis, stream: str, group: str) -> int:
    """KEDA's lag reading, step for step."""
    try:
        groups = r.xinfo_groups(stream)
    except redis.ResponseError as exc:
        if "no such key" in str(exc):
            return 0
        raise
    for g in groups:
        name = g["name"].decode() if isinstance(g["name"], bytes) else g["name"]
        if name == group:
            assert g["lag"] is not None, "Redis could not tell the lag: KEDA would read 0"
            return int(g["lag"])
    return int(r.xlen(stream))


@pytest.fixture
def settings() -> Iterator[Settings]:
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        yield Settings(redis_url=SHARED_URL, redis_prefix=prefix, visibility_timeout_s=30,
                       heartbeat_s=0.2)
    client.close()


def job() -> Job:
    return Job(id=new_job_id(), fields={"model": "mlp", "inputs": np.zeros((1, 4), np.float32)},
               deadline=2e9)


async def test_the_lag_the_scaler_reads_is_the_jobs_waiting_for_a_worker(
        settings: Settings) -> None:
    r = redis.Redis.from_url(SHARED_URL)
    stream, group = keyspace.job_stream(settings.redis_prefix), keyspace.STREAM_GROUP
    broker = RedisBroker(settings)
    try:
        assert keda_lag(r, stream, group) == 0  # nothing ever queued
        jobs = [job() for _ in range(6)]
        for j in jobs:
            await broker.submit(j)
        assert keda_lag(r, stream, group) == 6  # no worker yet: the stream's length
        source = RedisJobSource(settings, name="w1")
        try:
            taken = source.take(2, 100, 0.0, 1.0)  # its first read makes the group
            assert len(taken) == 2 and keda_lag(r, stream, group) == 4
            source.started(taken)
            source.succeed(taken[0], {"norms": np.ones(1, np.float32)})
            source.fail(taken[1], {"error": {"code": "internal_error", "message": "x"}},
                        retry=True)  # queued again: waiting for a worker again
            assert keda_lag(r, stream, group) == 5
            await broker.cancel(jobs[5].id)  # canceled while queued: still in the stream
            more = source.take(10, 100, 0.0, 1.0)
            assert keda_lag(r, stream, group) == 0
            assert len(more) == 4  # the canceled one was only acknowledged
            source.started(more)
            for t in more:
                source.succeed(t, {"norms": np.ones(1, np.float32)})
            for j in (job(), job()):
                await broker.submit(j)
            assert keda_lag(r, stream, group) == 2
        finally:
            source.close()
    finally:
        await broker.close()
        r.close()
