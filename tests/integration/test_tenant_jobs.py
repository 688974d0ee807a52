"""A job's tenant travels with it through both brokers: the api's state and cancel show it, the
worker's job carries it, and a job stored before tenants existed belongs to the default tenant."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import redis

from service import keys
from service.broker.embedded import EmbeddedBroker
from service.config import Settings
from service.jobs import Job, JobStatus, new_job_id
from service.tenants import DEFAULT_TENANT
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


@pytest.fixture(params=["embedded", "redis"])
async def queue(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Any, Any]]:
    """(api side, worker side) of one broker in each mode."""
    if request.param == "embedded":
        broker = EmbeddedBroker(Settings())
        await broker.start()
        yield broker, broker
        await broker.close()
        return
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        settings = Settings(redis_url=SHARED_URL, redis_prefix=prefix, heartbeat_s=0.2)
        async with redis_queue(settings) as sides:
            yield sides
    client.close()


def take(source: Any) -> list[Job]:
    return list(source.take(max_jobs=10, max_samples=1000, max_delay_s=0.0, block_s=1.0))


async def test_tenant_travels_with_the_job(queue: tuple[Any, Any]) -> None:
    api, source = queue
    mine, other = job("acme"), job()
    await api.submit(mine)
    await api.submit(other)
    assert (await api.state(mine.id)).tenant == "acme"
    assert (await api.state(other.id)).tenant == DEFAULT_TENANT
    taken = await asyncio.to_thread(take, source)
    assert {(j.id, j.tenant) for j in taken} == {(mine.id, "acme"), (other.id, DEFAULT_TENANT)}
    canceled = await api.cancel(mine.id)
    assert canceled.status is JobStatus.CANCELED and canceled.tenant == "acme"


async def test_a_job_stored_before_tenants_is_the_default_tenants(shared: redis.Redis) -> None:
    with prefix_on(shared) as prefix:
        async with redis_queue(Settings(redis_url=SHARED_URL, redis_prefix=prefix)) as (api,
                                                                                       source):
            old = job("acme")
            await api.submit(old)
            shared.hdel(keys.job_state(prefix, old.id), "tenant")  # as an older api wrote it
            assert (await api.state(old.id)).tenant == DEFAULT_TENANT
            (taken,) = await asyncio.to_thread(take, source)
            assert taken.id == old.id and taken.tenant == DEFAULT_TENANT
