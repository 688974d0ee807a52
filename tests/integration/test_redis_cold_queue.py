"""Cold starts in Redis mode. A queue that no worker serves (workers scaled to zero, or down):
a synchronous request's 504 says so, and a job queued with ``POST /jobs`` waits for the first
worker up to ``PSGRAD_JOB_TIMEOUT_S``, not ``PSGRAD_REQUEST_TIMEOUT_S`` (real Redis, own key
prefix). A worker whose Redis does not answer as it starts warms the registered models up once
it does."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.broker.redis.worker import RedisJobSource
from service.config import Settings
from service.registration import Limits, register
from service.registry import make_registry
from service.storage import open_storage
from service.worker.loop import Worker
from tests.support.api import finished_job, open_client
from tests.support.redis import SHARED_URL, OwnRedis, fresh_prefix, wait_for, worker_loop

prefix = pytest.fixture(fresh_prefix)
DOC = {"model": "mlp", "inputs": [[0.1] * 784, [0.2] * 784], "targets": [1, 2],
       "outputs": ["norms"]}


def fields_of(tmp_path: Path, prefix: str, **more: Any) -> dict[str, Any]:
    return {"redis_url": SHARED_URL, "redis_prefix": prefix, "device": "cpu",
            "batch_max_delay_ms": 1.0, "heartbeat_s": 0.2, "request_timeout_s": 0.5,
            "data_dir": str(tmp_path), **more}


async def queued_then_served(c: httpx.AsyncClient, fields: dict[str, Any]
                             ) -> tuple[dict[str, Any], httpx.Response]:
    """A job queued with no worker, then, 1 s later, a worker started: the job once it ended,
    and a synchronous request's answer while the worker serves."""
    created = await c.post("/jobs", json=DOC)
    assert created.status_code == 202, created.text
    await asyncio.sleep(1.0)  # twice the request timeout, and no worker yet
    with worker_loop(Settings(**fields), "late"):
        return (await finished_job(c, created.json()["job_id"]),
                await c.post("/per-sample-grads", json=DOC))


async def test_a_job_waits_for_the_first_worker_past_the_request_timeout(
        tmp_path: Path, prefix: str) -> None:
    fields = fields_of(tmp_path, prefix, job_timeout_s=60.0)
    async with open_client(**fields) as c:
        r = await c.post("/per-sample-grads", json=DOC)
        assert r.status_code == 504, r.text
        message = r.json()["error"]["message"]
        assert "no worker serves the queue now (GET /readyz)" in message, message
        assert "up to 60 s, PSGRAD_JOB_TIMEOUT_S" in message, message
        job, now = await queued_then_served(c, fields)
    assert job["status"] == "succeeded", job
    assert now.status_code == 200, now.text
    np.testing.assert_array_equal(job["result"]["norms"], now.json()["norms"])


async def test_a_job_past_its_deadline_says_how_long_it_waited(
        tmp_path: Path, prefix: str) -> None:
    """``waited_s`` is its time in the queue (it was the time past the deadline)."""
    fields = fields_of(tmp_path, prefix, job_timeout_s=0.3)
    async with open_client(**fields) as c:
        job, _ = await queued_then_served(c, fields)
    assert job["status"] == "failed" and job["error"]["code"] == "deadline_exceeded", job
    assert job["error"]["details"]["waited_s"] >= 1.0, job
    assert "PSGRAD_JOB_TIMEOUT_S" in job["error"]["message"], job


TINY = {"architecture": "sequential", "input": {"shape": [4]},
        "layers": [{"type": "Linear", "args": [4, 3]}]}


def test_a_worker_started_while_redis_stalls_warms_up_once_it_answers(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The registered warm-ups are listed again each second while the model store does not
    answer (they were skipped for good: the worker reported ready without them)."""
    own = OwnRedis(tmp_path)
    own.start()
    settings = Settings(redis_url=own.url, redis_prefix="cold", device="cpu",
                        redis_timeout_s=0.3, heartbeat_s=0.2, warmup_timeout_s=60.0)
    storage = open_storage(settings)
    registry = make_registry(settings, storage.models)
    model = register(registry, "tiny", TINY, Limits.from_settings(settings))
    storage.models.set_warmup("tiny", model.version, {"shapes": [
        {"batch_size": 2, "length": None, "job": None, "status": "succeeded", "error": None}]})
    source = RedisJobSource(settings, name="cold")
    work = Worker(source, registry, settings, storage=storage)
    stop = threading.Event()
    loop = threading.Thread(target=work.run, args=(stop,), daemon=True)
    assert own.proc is not None
    try:
        with caplog.at_level(logging.INFO, logger="psgrad.worker"):
            own.proc.send_signal(signal.SIGSTOP)
            try:
                work.plan_warmup()
                loop.start()
                wait_for(lambda: "listing the models to warm up failed" in caplog.text, 30,
                         "the listing to fail")
                assert not work.warmed.is_set()
            finally:
                own.proc.send_signal(signal.SIGCONT)
            wait_for(work.warmed.is_set, 30, "the warm-up")
        assert f"warmed up tiny@{model.version} at (2, None)" in caplog.text, caplog.text
    finally:
        stop.set()
        loop.join(30)
        source.close()
        storage.close()
        own.kill()
