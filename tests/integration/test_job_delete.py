"""``DELETE /jobs/{id}`` answers what it did, in both brokers: ``canceled`` (a queued or running
job, still readable), or ``removed`` (a finished job, gone with its result), also when the job
finishes between the route's look at it and its cancel."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import numpy as np
import pytest

from service.api import create_app
from service.broker.redis.worker import RedisJobSource
from service.jobs import Job
from tests.support.api import TD0, app_of, open_client, settings
from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip

RESULT = {"model": "linear-value@x", "batch_size": 1, "norms": np.array([1.5], np.float32)}


@pytest.fixture(params=["embedded", "redis"])
async def service(request: pytest.FixtureRequest) -> AsyncIterator[tuple[httpx.AsyncClient,
                                                                          Any]]:
    """The api with no worker of its own, and the worker side of its queue to end jobs by hand."""
    if request.param == "embedded":
        async with open_client(workers=0) as c:
            yield c, app_of(c).state.psgrad.broker
        return
    shared = redis_or_skip()
    with prefix_on(shared) as prefix:
        s = settings(redis_url=SHARED_URL, redis_prefix=prefix, heartbeat_s=0.2)
        app = create_app(s)
        source = RedisJobSource(s, name="w")
        try:
            async with app.router.lifespan_context(app), httpx.AsyncClient(
                    transport=httpx.ASGITransport(app=app), base_url="http://psgrad.test",
                    timeout=60) as c:
                c.app = app  # type: ignore[attr-defined]
                yield c, source
        finally:
            source.close()
    shared.close()


def take(source: Any) -> list[Job]:
    until = time.monotonic() + 10
    while time.monotonic() < until:
        jobs = list(source.take(max_jobs=10, max_samples=1000, max_delay_s=0.0, block_s=0.5))
        if jobs:
            return source.started(jobs)  # type: ignore[no-any-return]
    raise AssertionError("no job came")


async def queued(c: httpx.AsyncClient) -> str:
    r = await c.post("/jobs", json=TD0)
    assert r.status_code == 202, r.text
    return str(r.json()["job_id"])


async def test_a_queued_or_running_job_is_canceled_and_stays_readable(
        service: tuple[httpx.AsyncClient, Any]) -> None:
    c, source = service
    waiting = await queued(c)
    r = await c.delete(f"/jobs/{waiting}")
    assert r.status_code == 200 and r.json()["deleted"] == "canceled"
    assert r.json()["status"] == "canceled" and r.json()["finished_at"] is not None
    assert (await c.get(f"/jobs/{waiting}")).json()["status"] == "canceled"
    running = await queued(c)
    (job,) = await asyncio.to_thread(take, source)
    assert job.id == running and (await c.get(f"/jobs/{running}")).json()["status"] == "running"
    r = await c.delete(f"/jobs/{running}")
    assert (r.json()["status"], r.json()["deleted"]) == ("canceled", "canceled")
    await asyncio.to_thread(source.succeed, job, RESULT)  # its late answer is not kept
    assert (await c.get(f"/jobs/{running}")).json()["status"] == "canceled"
    r = await c.delete(f"/jobs/{running}")  # a second DELETE removes the canceled job
    assert (r.json()["status"], r.json()["deleted"]) == ("canceled", "removed")
    assert (await c.get(f"/jobs/{running}")).status_code == 404


async def test_a_finished_job_is_removed(service: tuple[httpx.AsyncClient, Any]) -> None:
    c, source = service
    done = await queued(c)
    (job,) = await asyncio.to_thread(take, source)
    await asyncio.to_thread(source.succeed, job, RESULT)
    r = await c.delete(f"/jobs/{done}")
    assert r.status_code == 200
    assert (r.json()["status"], r.json()["deleted"]) == ("succeeded", "removed")
    assert (await c.get(f"/jobs/{done}")).status_code == 404
    assert (await c.delete(f"/jobs/{done}")).status_code == 404


@pytest.mark.parametrize("end", ["succeed", "fail"])
async def test_a_job_finishing_during_the_delete_is_removed_and_says_so(
        service: tuple[httpx.AsyncClient, Any], monkeypatch: pytest.MonkeyPatch,
        end: str) -> None:
    """The job is running when the route looks, and finishes before the route's cancel reaches
    the broker: the answer is its real end, removed, never a "canceled" job left in place."""
    c, source = service
    job_id = await queued(c)
    (job,) = await asyncio.to_thread(take, source)
    broker = app_of(c).state.psgrad.broker
    real_cancel = broker.cancel

    async def finishing_first(jid: str) -> Any:
        if end == "succeed":
            await asyncio.to_thread(source.succeed, job, RESULT)
        else:
            error = {"error": {"code": "invalid_input", "message": "bad", "details": {}}}
            await asyncio.to_thread(source.fail, job, error, retry=False)
        return await real_cancel(jid)

    monkeypatch.setattr(broker, "cancel", finishing_first)
    r = await c.delete(f"/jobs/{job_id}")
    assert r.status_code == 200, r.text
    status = "succeeded" if end == "succeed" else "failed"
    assert (r.json()["status"], r.json()["deleted"]) == (status, "removed")
    if end == "fail":
        assert r.json()["error"]["code"] == "invalid_input"
    assert (await c.get(f"/jobs/{job_id}")).status_code == 404
