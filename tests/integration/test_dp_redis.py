"""DP runs in distributed mode, against a real Redis: the Lua step counter, the budget (409)
through the api and a worker, a restart, and a redelivered job that never counts twice."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from psgrad._errors import PrivacyBudgetExhausted, UnknownDPRun
from service.api import create_app
from service.broker.redis.api import RedisBroker
from service.broker.redis.worker import RedisJobSource
from service.config import Settings
from service.dp import runs
from service.dp.runs import DPRun, RedisRunStore
from service.jobs import Job, JobStatus
from service.registry import ModelRegistry
from service.storage import open_storage
from service.worker import loop
from service.worker.loop import Worker
from tests.support.api import keyed_steps_answer_their_first_try
from tests.support.redis import OwnRedis, quick_settings, result_of, worker_loop

settings = pytest.fixture(quick_settings)


def record(max_steps: int) -> DPRun:
    return DPRun(id=runs.new_run_id(), model="mlp", clip_norm=1.0, noise_multiplier=2.0,
                 sample_rate=0.04, expected_batch_size=8.0, delta=1e-5, max_epsilon=0.45,
                 max_steps=max_steps, accountant="rdp")


def test_redis_counter_counts_a_job_once_and_survives_a_restart(settings: Settings) -> None:
    store = RedisRunStore(redis.Redis.from_url(settings.redis_url or ""), settings.redis_prefix)
    run = record(max_steps=2)
    store.create(run)
    assert store.count(run.id, "a") == (run, 1)
    assert store.count(run.id, "a") == (run, 1)
    assert store.count(run.id, "b")[1] == 2
    with pytest.raises(PrivacyBudgetExhausted):
        store.count(run.id, "c")
    store.close()
    again = RedisRunStore(redis.Redis.from_url(settings.redis_url or ""), settings.redis_prefix)
    assert again.get(run.id) == (run, 2) and again.ids() == [run.id]
    # made again under its id (the same Idempotency-Key): the first run stays, steps and all
    assert again.create(dataclasses.replace(run, clip_norm=2.0)) == run
    assert again.get(run.id) == (run, 2)
    with pytest.raises(PrivacyBudgetExhausted):
        again.count(run.id, "d")
    assert again.delete(run.id) and again.get(run.id) is None
    again.close()


def _fields(run_id: str) -> dict[str, Any]:
    x = np.zeros((2, 784), dtype=np.float32)
    return {"model": "mlp", "inputs": x, "targets": np.array([0, 1]),
            "outputs": ["clipped_mean"], "dp_run": run_id}


@contextlib.asynccontextmanager
async def redelivered(settings: Settings, *, released: bool
                      ) -> AsyncIterator[tuple[Any, DPRun, Any]]:
    """A DP step's job that a first worker counted (and, ``released``, began to store the
    answer of) before it died, taken and processed by another worker: the run store, the run
    and the job's final state."""
    run = record(max_steps=5)
    storage = open_storage(settings)
    storage.runs.create(run)
    broker = RedisBroker(settings)
    source = RedisJobSource(settings, name="w-dp")
    try:
        job = Job(id="redelivered-job", fields=_fields(run.id), deadline=time.time() + 60)
        await broker.submit(job)
        storage.runs.count(run.id, job.id)  # the first worker's count
        if released:
            assert storage.runs.released(run.id, job.id)
        taken = source.take(max_jobs=1, max_samples=100, max_delay_s=0.0, block_s=2.0)
        Worker(source, ModelRegistry(), settings, storage=open_storage(settings)).process(taken)
        yield storage.runs, run, await broker.wait(job.id, 10)
    finally:
        source.close()
        storage.close()
        await broker.close()


async def test_a_redelivered_job_is_counted_once(settings: Settings) -> None:
    """A worker counted the job's step and died before storing its answer; the job comes back
    to another worker, which releases the answer without counting a second step."""
    async with redelivered(settings, released=False) as (runs, run, state):
        assert state.status is JobStatus.SUCCEEDED, state.error
        result = await result_of(state)
        assert result is not None and result["dp"]["steps"] == 1
        assert runs.get(run.id) == (run, 1)


async def test_a_job_redelivered_after_its_answer_began_to_go_out_releases_none(
        settings: Settings) -> None:
    """A worker counted the step and began to store its answer (the api relays its pieces as
    they land), then died; the job comes back to another worker, which fails it with a 409
    rather than release a second noisy answer (before: a second, independent draw, the step
    counted once)."""
    async with redelivered(settings, released=True) as (runs, run, state):
        assert state.status is JobStatus.FAILED and state.error is not None
        assert state.error["error"]["code"] == "conflict", state.error
        assert "never releases a second answer" in state.error["error"]["message"]
        assert runs.get(run.id) == (run, 1)
        assert runs.delete(run.id)
        with pytest.raises(UnknownDPRun):
            runs.released(run.id, "redelivered-job")


RUN = {"model": "mlp", "clip_norm": 1.0, "noise_multiplier": 2.0, "sample_rate": 0.04,
       "expected_batch_size": 8, "delta": 1e-5, "max_epsilon": 0.45}
STEP = {"model": "mlp", "inputs": np.zeros((2, 784)).tolist(), "targets": [0, 1],
        "outputs": ["clipped_mean"]}


@contextlib.asynccontextmanager
async def api(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    """An api on ``settings``'s Redis, its lifespan run, and its client."""
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60) as c:
        yield c


async def test_budget_409_through_the_api_and_a_worker(settings: Settings) -> None:
    with worker_loop(settings, "w-api"):
        async with api(settings) as c:
            run = (await c.post("/dp-runs", json=RUN)).json()
            step = {**STEP, "dp_run": run["id"]}
            for i in range(run["max_steps"]):
                r = await c.post("/per-sample-grads", json=step)
                assert r.status_code == 200 and r.json()["dp"]["steps"] == i + 1, r.text
            r = await c.post("/per-sample-grads", json=step)
            assert r.status_code == 409 and r.json()["error"]["code"] == "privacy_budget_exhausted"
        async with api(settings) as c:  # a restarted api reads the same run from Redis
            view = (await c.get(f"/dp-runs/{run['id']}")).json()
            assert view["steps"] == run["max_steps"] and view["steps_left"] == 0
            assert (await c.post("/per-sample-grads", json=step)).status_code == 409


async def test_a_keyed_step_sent_again_answers_its_first_try(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the api and a worker on Redis: the tries of a key wait on one job (two at once,
    the step slowed so that both block on its end, hand that end on to each other) and read its
    answer, kept, not consumed by the first."""
    real = loop.count_dp_step

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(loop, "count_dp_step", slow)
    with worker_loop(settings, "w-keyed"):
        async with api(settings) as c:
            await keyed_steps_answer_their_first_try(c, RUN, STEP)


async def test_a_dp_step_during_a_redis_outage_is_a_503(tmp_path: Path) -> None:
    """A DP step, and the DP routes, while Redis is down: 503 with Retry-After, as every route
    that queues answers (not 500 internal_error), then served again once Redis is back."""
    own = OwnRedis(tmp_path)
    own.start()
    settings = Settings(redis_url=own.url, redis_prefix="dp-outage", redis_timeout_s=0.5,
                        device="cpu")
    app = create_app(settings)
    try:
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://psgrad.test") as c:
            r = await c.post("/dp-runs", json={
                "model": "mlp", "clip_norm": 1.0, "noise_multiplier": 2.0,
                "expected_batch_size": 8, "dataset_size": 200, "delta": 1e-5,
                "max_epsilon": 2.0})
            assert r.status_code == 201, r.text
            run_id = r.json()["id"]
            own.kill()
            step = {**_fields(run_id), "inputs": np.zeros((2, 784)).tolist(),
                    "targets": [0, 1]}
            for answer in (await c.post("/per-sample-grads", json=step),
                           await c.get(f"/dp-runs/{run_id}"), await c.get("/dp-runs")):
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "overloaded"
                assert answer.headers["retry-after"] == "2"
                # what Redis said names its address: the operator's log has it, no client
                port = own.url.rsplit(":", 1)[-1].split("/")[0]
                assert port not in answer.text and "127.0.0.1" not in answer.text, answer.text
    finally:
        own.kill()
