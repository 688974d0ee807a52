"""A Redis restarted with its data kept (append-only file) while a synchronous request waits
for its job: the request rides the outage out and answers 200, the job's answer, where it
answered 503 (and its job, computed after, reached nobody)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from service.config import Settings
from tests.support.api import open_client
from tests.support.redis import OwnRedis, worker_loop
from tests.support.status import hold_compute

DOC = {"model": "mlp", "inputs": [[0.1] * 784, [0.2] * 784], "targets": [1, 2],
       "outputs": ["norms"]}


async def test_a_waiting_request_rides_out_a_redis_restart(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    own = OwnRedis(tmp_path, "--appendonly", "yes", "--appendfsync", "always")
    own.start()
    fields = {"redis_url": own.url, "redis_prefix": "restart", "device": "cpu",
              "batch_max_delay_ms": 1.0, "heartbeat_s": 0.2, "redis_timeout_s": 0.5,
              "request_timeout_s": 60.0, "data_dir": str(tmp_path / "data")}
    try:
        async with open_client(**fields) as c:
            with worker_loop(Settings(**fields), "w"):
                before = await c.post("/per-sample-grads", json=DOC)
                assert before.status_code == 200, before.text
                started, release = hold_compute(monkeypatch)
                waiting = asyncio.create_task(c.post("/per-sample-grads", json=DOC))
                assert await asyncio.to_thread(started.wait, 30)
                own.kill()  # SIGKILL: the append-only file has every write
                await asyncio.sleep(1.0)  # the api's wait meets a closed connection
                own.start()
                release.set()
                answer = await asyncio.wait_for(waiting, 60)
        assert answer.status_code == 200, answer.text
        np.testing.assert_array_equal(answer.json()["norms"], before.json()["norms"])
    finally:
        own.kill()
