"""A Redis queue that no worker serves (workers scaled to zero, or down): a synchronous
request's 504 says so, and a job queued with ``POST /jobs`` waits for the first worker up to
``PSGRAD_JOB_TIMEOUT_S``, not ``PSGRAD_REQUEST_TIMEOUT_S`` (real Redis, own key prefix)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service.config import Settings
from tests.support.api import finished_job, open_client
from tests.support.redis import SHARED_URL, fresh_prefix, worker_loop

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
