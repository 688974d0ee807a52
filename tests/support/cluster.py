"""Distributed mode on loopback: the api (``create_app`` with a RedisBroker) and real ``psgrad
worker`` processes sharing a real Redis, and the in-process reference their answers are held to.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import redis

from service import engine
from service.api.app import create_app
from service.api.body import decode_json_body
from service.broker.redis import keyspace
from service.broker.redis.api import RedisBroker
from service.broker.redis.common import text_hash
from service.config import Settings
from service.validate import parse_request
from tests.support.client import free_port
from tests.support.redis import (
    wait_for,
)

PSGRAD = str(Path(sys.executable).with_name("psgrad"))
TOL = {"rtol": 1e-4, "atol": 1e-5}


def settings_for(url: str, prefix: str, **overrides: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": url, "redis_prefix": prefix, "device": "cpu", "heartbeat_s": 0.3,
        "visibility_timeout_s": 2.0, "batch_max_delay_ms": 5.0, "batch_max_samples": 16,
        "result_ttl_s": 60, "request_timeout_s": 90.0, "worker_redis_grace_s": 60.0,
        # 3 s, not 1: a hundred concurrent requests open as many connections, and on a loaded
        # 2-core host a connect alone took over a second (503 overloaded: the drain test failed)
        "redis_timeout_s": 3.0,
    }
    return Settings(**{**base, **overrides})


def env_of(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSGRAD_")}
    for name, value in settings.model_dump().items():
        if value is not None and not isinstance(value, (dict, list)):
            env[f"PSGRAD_{name.upper()}"] = str(value)
    env.update(THP_MEM_ALLOC_ENABLE="1", OMP_NUM_THREADS="1")
    return env


@dataclass
class Cluster:
    settings: Settings
    client: httpx.AsyncClient
    broker: RedisBroker
    logs: Path
    workers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    metrics_ports: list[int] = field(default_factory=list)

    def start_worker(self) -> subprocess.Popen[bytes]:
        log = open(self.logs / f"worker-{len(self.workers)}.log", "wb")  # noqa: SIM115
        self.metrics_ports.append(free_port())
        env = {**env_of(self.settings), "PSGRAD_WORKER_METRICS_PORT": str(self.metrics_ports[-1])}
        proc = subprocess.Popen([PSGRAD, "worker", "--device", "cpu"], env=env,
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.workers.append(proc)
        return proc

    async def live(self, n: int, timeout: float = 60.0) -> None:
        until = time.monotonic() + timeout
        while await self.broker.live_workers() < n:
            for w in self.workers:
                assert w.poll() in (None, 0, -9, 1), self.dump()
            assert time.monotonic() < until, f"{n} workers not alive\n{self.dump()}"
            await asyncio.sleep(0.1)

    def dump(self) -> str:
        return "\n".join(p.read_text(errors="replace")[-3000:] for p in self.logs.glob("*.log"))

    def stop_all(self) -> list[int | None]:
        codes = []
        for w in self.workers:
            if w.poll() is None:
                w.send_signal(signal.SIGTERM)
            try:
                codes.append(w.wait(30))
            except subprocess.TimeoutExpired:
                w.kill()
                codes.append(w.wait())
        return codes

    def job_hash(self, job_id: str) -> dict[str, str]:
        with redis.Redis.from_url(self.settings.redis_url or "") as r:
            raw = r.hgetall(keyspace.job_state(self.settings.redis_prefix, job_id))
            return text_hash(raw)

    def xlen(self) -> int:
        with redis.Redis.from_url(self.settings.redis_url or "") as r:
            return int(r.xlen(keyspace.job_stream(self.settings.redis_prefix)))


@contextlib.asynccontextmanager
async def cluster(tmp_path: Path, url: str, prefix: str, n_workers: int = 2,
                  **overrides: Any) -> AsyncIterator[Cluster]:
    # gradient stores and reference sets: files the api and its workers share, the test's own
    settings = settings_for(url, prefix, **{"data_dir": str(tmp_path / "data"), **overrides})
    broker = RedisBroker(settings)
    app = create_app(settings, broker)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://psgrad.test", timeout=120,
        headers={"Authorization": "Bearer admin"},  # used when a test sets admin_keys
    ) as client:
        c = Cluster(settings, client, broker, tmp_path)
        try:
            for _ in range(n_workers):
                c.start_worker()
            await c.live(n_workers)
            yield c
        finally:
            c.stop_all()


# --- requests and their in-process reference ------------------------------------------------


def mixed_request(i: int) -> dict[str, Any]:
    rng = np.random.default_rng(i)
    b = int(rng.integers(1, 6))

    def f(*shape: int) -> list[Any]:
        return rng.standard_normal(shape).astype(np.float32).round(3).tolist()

    kind = i % 5
    if kind == 0:
        return {"model": "linear-value", "loss": "td0", "inputs": f(b, 3), "next_inputs": f(b, 3),
                "rewards": f(b), "gamma": 0.9, "outputs": ["grads", "updates", "td_errors"]}
    if kind == 1:  # per-call weights: its own group
        return {"model": "linear-value", "loss": "td0", "inputs": f(b, 3), "next_inputs": f(b, 3),
                "rewards": f(b), "weights": {"theta": f(3)}, "outputs": ["grads", "norms"]}
    if kind == 2:
        return {"model": "value-mlp", "loss": "td0", "inputs": f(b, 8), "next_inputs": f(b, 8),
                "rewards": f(b), "outputs": ["norms", "mean", "variance"]}
    if kind == 3:
        return {"model": "value-mlp", "loss": "mse", "inputs": f(b, 8), "targets": f(b),
                "outputs": ["grads", "losses", "cosine_mean"]}
    return {"model": "mlp", "inputs": f(b, 784), "targets": rng.integers(0, 10, b).tolist(),
            "outputs": ["norms", "losses"]}


def check_answer(body: dict[str, Any], request: dict[str, Any], registry: Any) -> None:
    """The service's answer equals engine.compute on this request alone."""
    parsed = parse_request(decode_json_body(request, max_elements=1 << 24), registry)
    want = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]
    assert body["batch_size"] == parsed.batch.size
    for name in parsed.opts.outputs:
        got, ref = body[name], want[name]
        if isinstance(ref, dict):
            assert set(got) == set(ref), name
            for k in ref:
                np.testing.assert_allclose(np.asarray(got[k]), ref[k].detach().numpy(), **TOL,
                                           err_msg=f"{name}/{k}")
        else:
            np.testing.assert_allclose(np.asarray(got), ref.detach().numpy(), **TOL, err_msg=name)


async def post_all(client: httpx.AsyncClient, requests: list[dict[str, Any]]
                   ) -> list[httpx.Response]:
    return list(await asyncio.gather(*(client.post("/per-sample-grads", json=r)
                                       for r in requests)))


async def job_done(client: httpx.AsyncClient, job_id: str, timeout: float = 60.0
                   ) -> dict[str, Any]:
    until = time.monotonic() + timeout
    while True:
        view: dict[str, Any] = (await client.get(f"/jobs/{job_id}")).json()
        if view["status"] in ("succeeded", "failed", "canceled"):
            return view
        assert time.monotonic() < until, view
        await asyncio.sleep(0.05)


async def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    await asyncio.to_thread(wait_for, predicate, timeout, what)


# --- the tests --------------------------------------------------------------------------------
