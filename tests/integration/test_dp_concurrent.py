"""A DP run's budget is exact under concurrent steps, in both modes: 30 steps sent at once to a
run with fewer steps left, and exactly ``max_steps`` are answered (each counted once, with
its own step number), every other one 409, and the run shows ``max_steps`` steps after."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.support.api import open_client
from tests.support.cluster import cluster
from tests.support.redis import SHARED_URL, fresh_prefix

prefix = pytest.fixture(fresh_prefix)
RUN = {"model": "mlp", "clip_norm": 1.0, "noise_multiplier": 2.0, "expected_batch_size": 8,
       "dataset_size": 200, "delta": 1e-5, "max_epsilon": 0.45}


async def thirty_steps_at_once(c: httpx.AsyncClient) -> None:
    run = (await c.post("/dp-runs", json=RUN)).json()
    n = run["max_steps"]
    assert 0 < n < 30
    shape = (await c.get("/models/mlp")).json()["input"]["shape"]
    step = {"model": "mlp", "inputs": [[0.0] * shape[0]] * 2, "targets": [0, 1],
            "outputs": ["clipped_mean"], "dp_run": run["id"]}
    answers = await asyncio.gather(*(c.post("/per-sample-grads", json=step) for _ in range(30)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [200] * n + [409] * (30 - n), [r.text for r in answers if r.status_code
                                                   not in (200, 409)]
    counted = sorted(r.json()["dp"]["steps"] for r in answers if r.status_code == 200)
    assert counted == list(range(1, n + 1))  # each step its own number: none counted twice
    assert all(r.json()["error"]["code"] == "privacy_budget_exhausted"
               for r in answers if r.status_code == 409)
    view = (await c.get(f"/dp-runs/{run['id']}")).json()
    assert view["steps"] == n and view["steps_left"] == 0
    assert view["epsilon_spent"] <= view["max_epsilon"]


async def test_embedded_budget_is_exact_under_30_concurrent_steps() -> None:
    async with open_client(workers=2) as c:
        await thirty_steps_at_once(c)


async def test_redis_budget_is_exact_under_30_concurrent_steps(tmp_path: Path,
                                                               prefix: str) -> None:
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=2) as c:
        await thirty_steps_at_once(c.client)
