"""Plans shared through a real Redis by real processes: the second never probes.

Each "worker" is its own Python process that loads a zoo model, opens the plan store a worker
opens (:func:`service.storage.make_plan_store`, Redis mode) and answers one ``norms`` request
through the engine; it prints what its store did and the norms, held here to the per-sample loop.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch

from service import redis_keys
from service.engine import Batch, Options
from service.registry import load_model
from tests.support.cluster import cluster
from tests.support.redis import ROOT, SHARED_URL, prefix_on, redis_or_skip
from tests.support.reference import assert_close, reference

WORKER = """
import json, sys
import torch
from service import engine
from service.config import Settings
from service.engine import Batch, Options
from service.registry import load_model
from service.storage import make_plan_store

url, prefix, secret = sys.argv[1:4]
plans = make_plan_store(Settings(redis_url=url, redis_prefix=prefix, compile_secret=secret))
model = load_model("simple-cnn", "simple-cnn", None, device=torch.device("cpu"))
gen = torch.Generator().manual_seed(0)
batch = Batch(inputs=torch.randn(5, 1, 28, 28, generator=gen),
              targets=torch.randint(0, 10, (5,), generator=gen))
opts = Options(loss="nll", outputs=("norms",), params=tuple(model.params))
out = engine.compute(model, batch, opts, plans=plans)[0]
stats = plans.stats
print(json.dumps({"probes": stats.probes, "loaded": stats.loaded, "checks": stats.checks,
                  "ignored": stats.ignored, "route": out["meta"]["route"],
                  "norms": out["norms"].tolist()}))
"""


@pytest.fixture
def prefix() -> Iterator[str]:
    with prefix_on(redis_or_skip()) as p:
        yield p


def worker(prefix: str, secret: str = "") -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", WORKER, SHARED_URL, prefix, secret], cwd=ROOT,
                         capture_output=True, text=True, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def want_norms() -> torch.Tensor:
    model = load_model("simple-cnn", "simple-cnn", None, device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    batch = Batch(inputs=torch.randn(5, 1, 28, 28, generator=gen),
                  targets=torch.randint(0, 10, (5,), generator=gen))
    opts = Options(loss="nll", outputs=("norms",), params=tuple(model.params))
    norms: torch.Tensor = reference(model, batch, opts, [5])[0]["norms"]
    return norms


@pytest.mark.parametrize("secret", ["", "shared-secret"])
def test_a_second_worker_process_loads_the_first_ones_plan(prefix: str, secret: str) -> None:
    want = want_norms()
    first = worker(prefix, secret)
    second = worker(prefix, secret)
    assert (first["probes"], first["loaded"]) == (1, 0)
    # signed: taken as it is; unsigned: checked once before use; never probed again
    assert (second["probes"], second["loaded"], second["checks"]) == (0, 1, 0 if secret else 1)
    for done in (first, second):
        assert done["route"] == "fast_stats"
        assert_close(torch.tensor(done["norms"]), want)


def test_corrupt_foreign_and_tampered_entries_in_redis_change_no_answer(prefix: str) -> None:
    want = want_norms()
    worker(prefix, "shared-secret")
    client = redis.Redis.from_url(SHARED_URL)
    (key,) = client.scan_iter(match=redis_keys.plan(prefix, "*"))
    good = json.loads(client.get(key) or b"")
    # changed, its seal left as it was: "no plan", or conv1's weight on the whole-model replay
    tampered = [{**good, "unsupported": "the model does not return one tensor"},
                {**good, "classes": {k: [["", ["conv1.weight"]]] for k in good["classes"]}}]
    foreign = {**good, "key": {**good["key"], "structure": "someone-else"}}
    for damaged in (b"{broken", *(json.dumps(e).encode() for e in (foreign, *tampered))):
        client.set(key, damaged)
        again = worker(prefix, "shared-secret")
        assert (again["ignored"], again["probes"], again["loaded"]) == (1, 1, 0)
        assert_close(torch.tensor(again["norms"]), want)


async def test_a_registration_warm_up_through_real_workers(prefix: str, tmp_path: Path) -> None:
    """Redis mode: a worker process computes the registration's warm-up; a worker started after
    it warms the same shape from the shared plan before its heartbeat (so /readyz) appears, and
    before its own port's /readyz answers 200."""
    spec = {"architecture": "sequential", "input": {"shape": [4]},
            "layers": [{"type": "Linear", "args": [4, 8]}, {"type": "Tanh"},
                       {"type": "Linear", "args": [8, 3]}]}
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1, admin_keys="admin") as c:
        r = await c.client.put("/models/tiny?warmup=4,6", json=spec)
        assert r.status_code == 200, r.text
        for _ in range(1200):
            doc = (await c.client.get("/models/tiny")).json()
            if doc["warmup"]["status"] != "running":
                break
            await asyncio.sleep(0.05)
        assert doc["warmup"]["status"] == "succeeded", (doc["warmup"], c.dump())
        assert all(s["job"] for s in doc["warmup"]["shapes"])
        c.start_worker()
        ready, port = None, f"http://127.0.0.1:{c.metrics_ports[1]}/readyz"
        async with httpx.AsyncClient(timeout=5) as http:
            for _ in range(1200):
                try:
                    ready = await http.get(port)
                except httpx.TransportError:  # not listening yet
                    ready = None
                if ready is not None and ready.status_code == 200:
                    log = (tmp_path / "worker-1.log").read_text()  # as it was at the first 200
                    break
                assert ready is None or ready.json() == {"ready": False}, ready.text
                await asyncio.sleep(0.05)
        assert ready is not None and ready.json() == {"ready": True}, c.dump()
        assert log.count("warmed up tiny@") == 2, log
        await c.live(2)  # its heartbeat: written once both shapes were warmed, not before
