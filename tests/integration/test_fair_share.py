"""Tenants in the queue, in both modes: a job's tenant travels with it, tenants are served in
weighted fair order (a lone request is not starved behind another tenant's backlog), batches
still mix tenants, quotas refuse with 429, and a worker that dies loses no tenant's job.

The worker side is driven by hand (``take`` with the loop's arguments), so each test checks an
order, never a timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from psgrad._errors import RateLimited, TooLarge
from service.broker.embedded import EmbeddedBroker
from service.broker.redis import keyspace
from service.broker.redis.worker import RedisJobSource
from service.config import Settings
from service.jobs import Job, JobStatus, new_job_id
from service.tenants import DEFAULT_TENANT, Quotas
from tests.support.api import TD0, open_client
from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip
from tests.support.redis import queue as redis_queue


def job(tenant: str = DEFAULT_TENANT, n: int = 2) -> Job:
    fields: dict[str, Any] = {"model": "linear-value", "loss": "td0",
                              "inputs": np.zeros((n, 3), dtype=np.float32)}
    return Job(id=new_job_id(), fields=fields, deadline=time.time() + 60, tenant=tenant)


@pytest.fixture
def shared() -> Iterator[redis.Redis]:
    client = redis_or_skip()
    yield client
    client.close()


@pytest.fixture
def overrides() -> dict[str, Any]:
    """Settings of the queue fixture beyond its own (a test parametrizes this)."""
    return {}


@pytest.fixture(params=["embedded", "redis"])
async def queue(request: pytest.FixtureRequest, overrides: dict[str, Any]
                ) -> AsyncIterator[tuple[Any, Any]]:
    """(api side, worker side) of one broker in each mode."""
    if request.param == "embedded":
        broker = EmbeddedBroker(Settings(**overrides))
        await broker.start()
        yield broker, broker
        await broker.close()
        return
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        settings = Settings(redis_url=SHARED_URL, redis_prefix=prefix, heartbeat_s=0.2,
                            visibility_timeout_s=0.5, **overrides)
        async with redis_queue(settings) as sides:
            yield sides
    client.close()


def take(source: Any, room: int = 1000) -> list[Job]:
    """One batch as the worker loop takes it: jobs that fit in ``room`` samples."""
    return list(source.take(max_jobs=100, max_samples=room, max_delay_s=0.0, block_s=1.0))


async def taken(source: Any, room: int = 1000) -> list[Job]:
    return await asyncio.to_thread(take, source, room)


async def test_tenant_travels_with_the_job(queue: tuple[Any, Any]) -> None:
    api, source = queue
    mine, other = job("acme"), job()
    await api.submit(mine)
    await api.submit(other)
    assert (await api.state(mine.id)).tenant == "acme"
    assert (await api.state(other.id)).tenant == DEFAULT_TENANT
    got = await taken(source)
    assert {(j.id, j.tenant) for j in got} == {(mine.id, "acme"), (other.id, DEFAULT_TENANT)}
    canceled = await api.cancel(mine.id)
    assert canceled.status is JobStatus.CANCELED and canceled.tenant == "acme"


async def test_a_job_stored_before_tenants_is_the_default_tenants(shared: redis.Redis) -> None:
    with prefix_on(shared) as prefix:
        async with redis_queue(Settings(redis_url=SHARED_URL, redis_prefix=prefix)) as (api,
                                                                                       source):
            old = job("acme")
            await api.submit(old)
            shared.hdel(keyspace.job_state(prefix, old.id), "tenant")  # as an older api wrote it
            assert (await api.state(old.id)).tenant == DEFAULT_TENANT
            (got,) = await asyncio.to_thread(take, source)
            assert got.id == old.id and got.tenant == DEFAULT_TENANT
            # an entry an older api queued (the job itself in the stream) is taken as it is
            older = job()
            await api.submit(older)
            (ticket,) = shared.xrevrange(keyspace.job_stream(prefix), count=1)
            shared.xdel(keyspace.job_stream(prefix), ticket[0])
            shared.delete(keyspace.tenant_queue(prefix, DEFAULT_TENANT),
                          keyspace.fair_active(prefix))
            shared.xadd(keyspace.job_stream(prefix), {"id": older.id, "n": "2"})
            (got,) = await asyncio.to_thread(take, source)
            assert got.id == older.id


async def test_a_lone_request_goes_next_not_after_the_backlog(queue: tuple[Any, Any]) -> None:
    api, source = queue
    backlog = [job("a", n=4) for _ in range(6)]
    for j in backlog:
        await api.submit(j)
    assert [j.id for j in await taken(source, room=4)] == [backlog[0].id]  # a's first runs
    lone = job("b", n=1)
    await api.submit(lone)
    # next: b's one job, alone (a's next does not fit beside it), then a's backlog goes on
    assert [j.id for j in await taken(source, room=4)] == [lone.id]
    assert [j.id for j in await taken(source, room=4)] == [backlog[1].id]
    # b comes back later: again served next
    again = job("b", n=1)
    await api.submit(again)
    assert [j.id for j in await taken(source, room=4)] == [again.id]


async def test_a_request_queued_behind_a_backlog_is_second_at_most(
        queue: tuple[Any, Any]) -> None:
    api, source = queue
    for _ in range(5):
        await api.submit(job("a", n=4))
    lone = job("b", n=4)
    await api.submit(lone)
    order = [j.tenant for _ in range(3) for j in await taken(source, room=4)]
    assert "b" in order[:2] and order.count("b") == 1


async def test_weights_share_the_workers(queue: tuple[Any, Any]) -> None:
    api, source = queue
    for _ in range(10):
        await api.submit(job("heavy", n=2), Quotas(weight=3.0))
        await api.submit(job("light", n=2))
    order = [j.tenant for _ in range(8) for j in await taken(source, room=2)]
    assert order.count("heavy") == 6 and order.count("light") == 2, order
    rest = [j.tenant for _ in range(12) for j in await taken(source, room=2)]
    assert rest.count("heavy") == 4 and rest.count("light") == 8  # each queue drains


async def test_a_batch_still_mixes_tenants(queue: tuple[Any, Any]) -> None:
    api, source = queue
    jobs = [job(t, n=1) for t in ("a", "b", "a", "b", "c")]
    for j in jobs:
        await api.submit(j)
    got = await taken(source, room=100)
    assert sorted(j.id for j in got) == sorted(j.id for j in jobs)


async def test_a_dead_worker_loses_no_tenants_job(shared: redis.Redis) -> None:
    with prefix_on(shared) as prefix:
        settings = Settings(redis_url=SHARED_URL, redis_prefix=prefix, heartbeat_s=0.1,
                            visibility_timeout_s=0.4, max_attempts=3)
        async with redis_queue(settings) as (api, source):
            jobs = [job(t, n=1) for t in ("a", "b", "a", "b")]
            for j in jobs:
                await api.submit(j)
            dying = RedisJobSource(settings, name="dying")
            first = await asyncio.to_thread(take, dying, 2)  # two jobs, then it dies
            assert len(first) == 2
            dying.close(deregister=False)  # no ack, no claim kept fresh
            await asyncio.sleep(0.6)
            rest = await asyncio.to_thread(take, source)
            rest += await asyncio.to_thread(take, source)
            assert sorted(j.id for j in rest) == sorted(j.id for j in jobs)
            retried = {j.id: j.attempts for j in rest}
            assert all(retried[j.id] == 2 for j in first)
            # a transient failure goes back first in its tenant's queue, with a new ticket
            again = next(j for j in rest if j.tenant == "a")
            source.fail(again, {"error": {"code": "internal_error", "message": "x"}}, retry=True)
            (redo,) = await asyncio.to_thread(take, source)
            assert redo.id == again.id and redo.attempts == retried[again.id] + 1
            done = [redo if j.id == redo.id else j for j in rest]
            source.succeed_all([(j, {"losses": np.zeros(1, np.float32)}) for j in done])
            for j in jobs:
                assert (await api.state(j.id)).status is JobStatus.SUCCEEDED
            assert await api.queue_depth() == 0
            for t in ("a", "b"):
                assert shared.zcard(keyspace.tenant_jobs(prefix, t)) == 0
            assert shared.hlen(keyspace.job_tickets(prefix)) == 0
            info = {g["name"].decode(): g for g in
                    shared.xinfo_groups(keyspace.job_stream(prefix))}[keyspace.STREAM_GROUP]
            assert info["pending"] == 0 and info["lag"] == 0


async def test_tickets_and_queues_mend_after_a_loss(shared: redis.Redis) -> None:
    """A queued job whose ticket was lost (Redis data lost) is still taken; a ticket with no job
    behind it is dropped, not handed out."""
    with prefix_on(shared) as prefix:
        async with redis_queue(Settings(redis_url=SHARED_URL, redis_prefix=prefix)) as (api,
                                                                                       source):
            await api.start()
            stream = keyspace.job_stream(prefix)
            lost = job("a")
            await api.submit(lost)
            shared.xtrim(stream, maxlen=0)  # its ticket is gone
            (got,) = await asyncio.to_thread(take, source)
            assert got.id == lost.id
            shared.xadd(stream, {"t": "a"})  # a ticket no job stands behind
            assert await asyncio.to_thread(take, source) == []
            groups = {g["name"].decode(): g for g in shared.xinfo_groups(stream)}
            assert groups[keyspace.STREAM_GROUP]["lag"] == 0
            assert groups[keyspace.STREAM_GROUP]["pending"] == 1  # the job taken, not the stray


async def test_the_group_lag_counts_the_jobs_queued(shared: redis.Redis) -> None:
    """What an autoscaler reads (KEDA's redis-streams scaler, lagCount): jobs not yet taken."""
    with prefix_on(shared) as prefix:
        async with redis_queue(Settings(redis_url=SHARED_URL, redis_prefix=prefix)) as (api,
                                                                                       source):
            await api.start()  # creates the group: no worker has yet
            for t in ("a", "a", "b", "a", "b"):
                await api.submit(job(t, n=2))

            def group() -> dict[str, Any]:
                groups = shared.xinfo_groups(keyspace.job_stream(prefix))
                return {g["name"].decode(): g for g in groups}[keyspace.STREAM_GROUP]

            assert group()["lag"] == 5 and group()["pending"] == 0
            await asyncio.to_thread(take, source, 4)  # two jobs
            assert group()["lag"] == 3 and group()["pending"] == 2


@pytest.mark.parametrize("overrides", [{"tenant_max_jobs": 2}])
async def test_concurrent_jobs_quota(queue: tuple[Any, Any]) -> None:
    api, _ = queue
    held = [job("a"), job("a")]
    for j in held:
        await api.submit(j)
    with pytest.raises(RateLimited) as refused:
        await api.submit(job("a"))
    assert "concurrent_jobs = 2" in refused.value.message
    assert "PSGRAD_TENANT_MAX_JOBS" in refused.value.message
    assert refused.value.status == 429 and refused.value.retry_after >= 1
    await api.submit(job("b"))  # another tenant's own count
    await api.submit(job("a"), Quotas(concurrent_jobs=3))  # its own quota wins
    await api.cancel(held[0].id)  # a job that ends no longer counts
    await api.submit(job("a"), Quotas(concurrent_jobs=3))


@pytest.mark.parametrize("overrides", [{"tenant_max_jobs": 1}])
async def test_a_job_forgotten_before_it_ended_no_longer_counts(queue: tuple[Any, Any]
                                                                ) -> None:
    """The api forgets a job once its answer is relayed, and also when the client hung up
    while the worker still wrote it: that job, not ended, left its tenant's count in Redis
    mode until the result TTL (a 429 for an hour, nothing queued or running)."""
    api, source = queue
    first = job("a")
    await api.submit(first)
    assert [j.id for j in await taken(source)] == [first.id]  # running
    with pytest.raises(RateLimited):
        await api.submit(job("a"))
    await api.forget(first.id)
    await api.submit(job("a"))


async def test_queued_samples_quota(queue: tuple[Any, Any]) -> None:
    api, _ = queue
    quotas = Quotas(queued_samples=5)
    await api.submit(job("a", n=3), quotas)
    with pytest.raises(RateLimited) as refused:
        await api.submit(job("a", n=3), quotas)
    assert "queued_samples = 5" in refused.value.message
    assert "3 samples queued or running, this request adds 3" in refused.value.message
    await api.submit(job("a", n=2), quotas)
    with pytest.raises(TooLarge) as alone:  # never admissible: 413, not a retry
        await api.submit(job("a", n=6), quotas)
    assert "queued_samples" in alone.value.message and alone.value.status == 413
    assert "psgrad.Client splits a large batch" in alone.value.message
    step = job("a", n=6)  # a DP run's step is never split: the SDK would not help
    step.fields["dp_run"] = "dp-" + "0" * 24
    with pytest.raises(TooLarge) as alone:
        await api.submit(step, quotas)
    assert "a lower sample_rate: a step's batch is never split" in alone.value.message
    assert "splits a large batch" not in alone.value.message


async def test_requests_per_s_quota(queue: tuple[Any, Any]) -> None:
    api, _ = queue
    quotas = Quotas(requests_per_s=2.0)  # a bucket of two
    await api.submit(job("a"), quotas)
    await api.submit(job("a"), quotas)
    with pytest.raises(RateLimited) as refused:
        await api.submit(job("a"), quotas)
    assert "requests_per_s = 2" in refused.value.message
    assert 0 < refused.value.retry_after <= 0.5
    await api.submit(job("b"), quotas)  # another tenant's bucket
    await asyncio.sleep(refused.value.retry_after + 0.05)
    await api.submit(job("a"), quotas)


@pytest.mark.parametrize("mode", ["embedded", "redis"])
async def test_past_a_quota_the_api_answers_429_with_retry_after(mode: str) -> None:
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        if mode == "redis":
            where = {"redis_url": SHARED_URL,
                     "redis_prefix": stack.enter_context(prefix_on(redis_or_skip()))}
        async with open_client(tenant_requests_per_s=0.01, api_keys="a:key-a,b:key-b",
                               **where) as client:
            body = {**TD0, "outputs": ["norms"]}
            a, b = ({"Authorization": f"Bearer key-{t}"} for t in "ab")
            first = await client.post("/jobs", json=body, headers=a)
            assert first.status_code == 202, first.text
            second = await client.post("/jobs", json=body, headers=a)
            assert second.status_code == 429
            assert int(second.headers["Retry-After"]) >= 1
            error = second.json()["error"]
            assert error["code"] == "rate_limited"
            assert error["details"]["quota"] == "requests_per_s"
            assert "tenant 'a' is over its quota requests_per_s = 0.01" in error["message"]
            other = await client.post("/jobs", json=body, headers=b)  # b's own bucket
            assert other.status_code == 202, other.text
