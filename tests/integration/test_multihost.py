"""Distributed mode across "hosts": network namespaces on one machine (``pytest -m multihost``).

One host runs redis-server (append-only file, fsync always), one ``psgrad serve``, two run a
``psgrad worker`` each; they reach one another by address over a bridge
(:mod:`tests.support.netlab`), and the test reaches the api and Redis from the machine's own
namespace. Each scenario has jobs in flight when the fault strikes, and every answer is held to
the per-sample loop (batch of one, ``torch.autograd.grad``):

- a worker host killed (every process in it): its jobs are taken over by the other host;
- a worker host cut off from Redis for longer than the visibility timeout, then reconnected:
  each job is answered once, by the host that owns it, and the stale worker's late writes
  change nothing;
- the Redis host killed and restarted on its append-only file: nothing is lost;
- latency and loss on every link (``tc netem``, skipped where the kernel lacks it): requests
  still succeed within their deadline.

Skipped, saying why, where network namespaces cannot be made (not root, no ``ip``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis

from service.api.body import decode_json_body
from service.broker.redis import keyspace
from service.broker.redis.api import RedisBroker
from service.broker.redis.common import text
from service.config import Settings
from service.registry import ModelRegistry
from service.validate import parse_request
from tests.support.cluster import PSGRAD, env_of, mixed_request, settings_for
from tests.support.netlab import Host, Lab, namespaces_or_skip
from tests.support.reference import TOL, reference

pytestmark = pytest.mark.multihost

KEY = "multihost-key"
REDIS_PORT, API_PORT = 6379, 8000


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry()


@dataclass
class MultiHost:
    lab: Lab
    redis_host: Host
    api_host: Host
    workers: list[Host]
    settings: Settings
    logs: Path
    client: httpx.AsyncClient
    broker: RedisBroker

    @property
    def env(self) -> dict[str, str]:
        return env_of(self.settings)

    def start_redis(self) -> None:
        data = self.logs / "redis"
        data.mkdir(exist_ok=True)
        self.redis_host.start(
            ["redis-server", "--bind", self.redis_host.addr, "--port", str(REDIS_PORT),
             "--protected-mode", "no", "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(data)], self.env, self.logs / "redis.log")
        with redis.Redis(host=self.redis_host.addr, port=REDIS_PORT, socket_timeout=1) as r:
            until = time.monotonic() + 30
            while True:
                try:
                    r.ping()
                    return
                except redis.RedisError:
                    assert time.monotonic() < until, self.dump()
                    time.sleep(0.1)

    def start_worker(self, host: Host) -> None:
        host.start([PSGRAD, "worker", "--device", "cpu"], self.env,
                   self.logs / f"{host.name}.log")

    def worker_pid(self, host: Host) -> int:
        return host.procs[-1].pid  # `ip netns exec` execs the command: the same process

    async def live(self, n: int, timeout: float = 120.0) -> None:
        until = time.monotonic() + timeout
        while await self.broker.live_workers() != n:
            assert time.monotonic() < until, f"not {n} live workers\n{self.dump()}"
            await asyncio.sleep(0.2)

    def job_hash(self, job_id: str) -> dict[str, str]:
        return self.job_hashes([job_id])[0]

    def job_hashes(self, ids: list[str]) -> list[dict[str, str]]:
        with redis.Redis(host=self.redis_host.addr, port=REDIS_PORT, socket_timeout=5) as r:
            pipe = r.pipeline(transaction=False)
            for job_id in ids:
                pipe.hgetall(keyspace.job_state(self.settings.redis_prefix, job_id))
            return [{text(k): text(v) for k, v in raw.items()} for raw in pipe.execute()]

    def queue_left(self) -> tuple[int, int]:
        """(entries in the job stream, deliveries pending in its group)."""
        stream = keyspace.job_stream(self.settings.redis_prefix)
        with redis.Redis(host=self.redis_host.addr, port=REDIS_PORT, socket_timeout=5) as r:
            return int(r.xlen(stream)), int(r.xpending(stream, keyspace.STREAM_GROUP)["pending"])

    def dump(self) -> str:
        return "\n".join(f"--- {p.name}\n" + p.read_text(errors="replace")[-2500:]
                         for p in sorted(self.logs.glob("*.log")))


@contextlib.asynccontextmanager
async def multihost(tmp_path: Path, n_workers: int = 2, **overrides: Any
                    ) -> AsyncIterator[MultiHost]:
    namespaces_or_skip()
    with Lab() as lab:
        redis_host, api_host = lab.add("redis"), lab.add("api")
        workers = [lab.add(f"worker{i}") for i in range(n_workers)]
        settings = settings_for(
            f"redis://{redis_host.addr}:{REDIS_PORT}/0", f"mh-{uuid.uuid4().hex[:8]}",
            api_keys=KEY, worker_redis_grace_s=300.0, fast_stats=False, result_ttl_s=900,
            request_timeout_s=120.0, **overrides)
        broker = RedisBroker(settings)
        async with httpx.AsyncClient(base_url=f"http://{api_host.addr}:{API_PORT}", timeout=150,
                                     headers={"Authorization": f"Bearer {KEY}"}) as client:
            m = MultiHost(lab, redis_host, api_host, workers, settings, tmp_path, client, broker)
            try:
                m.start_redis()
                api_host.start([PSGRAD, "serve", "--host", api_host.addr, "--port",
                                str(API_PORT), "--log-level", "warning"], m.env,
                               tmp_path / "api.log")
                for host in workers:
                    m.start_worker(host)
                await _until_up(m)
                yield m
            finally:
                await broker.close()


async def _until_up(m: MultiHost) -> None:
    until = time.monotonic() + 180
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if (await m.client.get("/healthz")).status_code == 200:
                break
        assert time.monotonic() < until, m.dump()
        await asyncio.sleep(0.2)
    await m.live(len(m.workers))


# --- requests, and the loop their answers are held to -------------------------------------


def heavy_request(i: int) -> dict[str, Any]:
    """The tutorial CNN on the vmap path: a batch lasts long enough to be caught running."""
    rng = np.random.default_rng(100 + i)
    return {"model": "simple-cnn", "outputs": ["norms", "losses"],
            "inputs": rng.standard_normal((16, 1, 28, 28)).round(3).tolist(),
            "targets": rng.integers(0, 10, 16).tolist()}


def against_loop(answer: dict[str, Any], request: dict[str, Any], registry: ModelRegistry
                 ) -> None:
    """Every output of ``answer`` equals the per-sample loop's on ``request`` alone."""
    parsed = parse_request(decode_json_body(request, max_elements=1 << 24), registry)
    want = reference(parsed.model, parsed.batch, parsed.opts, [parsed.batch.size])[0]
    assert answer["batch_size"] == parsed.batch.size
    for name in parsed.opts.outputs:
        ref = want[name]
        pairs = ([(answer[name][k], ref[k]) for k in ref] if isinstance(ref, dict)
                 else [(answer[name], ref)])
        if isinstance(ref, dict):
            assert set(answer[name]) == set(ref), name
        for got, expected in pairs:
            np.testing.assert_allclose(np.asarray(got, dtype=np.float64),
                                       expected.detach().numpy(), rtol=TOL["rtol"],
                                       atol=TOL["atol"], err_msg=name)


async def submit(m: MultiHost, requests: list[dict[str, Any]]) -> list[str]:
    ids = []
    for r in requests:
        created = await m.client.post("/jobs", json=r)
        assert created.status_code == 202, created.text
        ids.append(created.json()["job_id"])
    return ids


async def finished(m: MultiHost, job_id: str, timeout: float = 180.0) -> dict[str, Any]:
    until = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            r = await m.client.get(f"/jobs/{job_id}")
            if r.status_code == 200 and r.json()["status"] in ("succeeded", "failed", "canceled"):
                return r.json()
        assert time.monotonic() < until, f"job {job_id} unfinished\n{m.dump()}"
        await asyncio.sleep(0.1)


async def running_on(m: MultiHost, ids: list[str], host: Host | None,
                     timeout: float = 120.0) -> None:
    """Wait until a job is running in ``host``'s worker (any worker's: None)."""
    mark = f"-{m.worker_pid(host)}-" if host is not None else "-"
    until = time.monotonic() + timeout
    while not any(mark in h.get("worker", "") and h.get("status") == "running"
                  for h in m.job_hashes(ids)):
        assert time.monotonic() < until, f"no job running on {host}\n{m.dump()}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def caught_running(m: MultiHost, host: Host, other: Host, requests: list[dict[str, Any]]
                         ) -> AsyncIterator[list[str]]:
    """``requests`` submitted while ``other``'s processes are paused, so that ``host``'s worker
    surely holds jobs: the body strikes once one runs there; ``other`` resumes after it."""
    other.signal_all(signal.SIGSTOP)
    try:
        ids = await submit(m, requests)
        await running_on(m, ids, host)
        yield ids
    finally:
        other.signal_all(signal.SIGCONT)


async def all_answered(m: MultiHost, ids: list[str], requests: list[dict[str, Any]],
                       registry: ModelRegistry) -> list[dict[str, Any]]:
    views = [await finished(m, j) for j in ids]
    assert [v["status"] for v in views] == ["succeeded"] * len(ids), (views, m.dump())
    for request, view in zip(requests, views, strict=True):
        against_loop(view["result"], request, registry)
    return views


# --- the scenarios -----------------------------------------------------------------------------


async def test_a_worker_host_killed_its_jobs_are_taken_over(tmp_path: Path,
                                                            registry: ModelRegistry) -> None:
    async with multihost(tmp_path) as m:
        victim, survivor = m.workers
        requests = [heavy_request(i) for i in range(2)] + [mixed_request(i) for i in range(10)]
        async with caught_running(m, victim, survivor, requests) as ids:
            victim.kill_all()
        await all_answered(m, ids, requests, registry)
        hashes = m.job_hashes(ids)
        assert any(int(h["attempts"]) > 1 for h in hashes), "no job was taken over"
        survivor_mark = f"-{m.worker_pid(survivor)}-"
        assert all(survivor_mark in h["worker"] for h in hashes if int(h["attempts"]) > 1)
        assert m.queue_left() == (0, 0)  # every job acknowledged once, nothing left to deliver
        await m.live(1)


async def test_a_worker_host_cut_off_then_back_its_late_answers_are_ignored(
        tmp_path: Path, registry: ModelRegistry) -> None:
    async with multihost(tmp_path) as m:
        stale, survivor = m.workers
        requests = [heavy_request(i) for i in range(2)] + [mixed_request(i) for i in range(8)]
        async with caught_running(m, stale, survivor, requests) as ids:
            # paused mid-job, and cut off: it cannot finish before the cut, nor write after it
            stale.signal_all(signal.SIGSTOP)
            stale.link(up=False)
            cut = time.monotonic()
        first = await all_answered(m, ids, requests, registry)
        owners = {j: m.job_hash(j)["worker"] for j in ids}
        stale_mark = f"-{m.worker_pid(stale)}-"
        taken = [j for j in ids if int(m.job_hash(j)["attempts"]) > 1]
        assert taken and not any(stale_mark in owners[j] for j in taken)
        # it runs on, still cut off (its heartbeat lapses), past the visibility timeout ...
        stale.signal_all(signal.SIGCONT)
        await asyncio.sleep(max(1.0, cut + 3 * m.settings.visibility_timeout_s - time.monotonic()))
        assert await m.broker.live_workers() == 1
        # ... then is reconnected: its answer arrives late, and is dropped
        stale.link(up=True)
        await m.live(2)
        log = m.logs / f"{stale.name}.log"
        until = time.monotonic() + 120
        while "taken over by a later delivery" not in log.read_text(errors="replace"):
            assert time.monotonic() < until, f"no late answer from {stale.name}\n{m.dump()}"
            await asyncio.sleep(0.2)
        assert stale.procs[-1].poll() is None, m.dump()
        again = [await finished(m, j) for j in ids]
        assert again == first  # each job answered once: the late answer changed nothing
        assert {j: m.job_hash(j)["worker"] for j in ids} == owners
        assert m.queue_left() == (0, 0)
        # and the reconnected host serves again
        more = [mixed_request(50 + i) for i in range(6)]
        await all_answered(m, await submit(m, more), more, registry)


async def test_the_redis_host_restarted_on_its_append_only_file_loses_nothing(
        tmp_path: Path, registry: ModelRegistry) -> None:
    async with multihost(tmp_path) as m:
        requests = [heavy_request(i) for i in range(2)] + [mixed_request(i) for i in range(10)]
        ids = await submit(m, requests)
        await running_on(m, ids, None)
        m.redis_host.kill_all()  # kill -9: whatever it acknowledged is in its file
        await asyncio.sleep(1.0)
        m.start_redis()
        await all_answered(m, ids, requests, registry)
        assert m.queue_left() == (0, 0)
        await m.live(2)


async def test_latency_and_loss_on_every_link(tmp_path: Path, registry: ModelRegistry) -> None:
    async with multihost(tmp_path) as m:
        hosts = [m.redis_host, m.api_host, *m.workers]
        if not all(h.netem("delay 20ms 5ms loss 1%") for h in hosts):
            pytest.skip("this kernel has no tc netem (sch_netem): latency and loss not tested")
        requests = [mixed_request(i) for i in range(16)]
        started = time.monotonic()
        answers = await asyncio.gather(*(m.client.post("/per-sample-grads", json=r)
                                         for r in requests))
        # the api answers 504 past PSGRAD_REQUEST_TIMEOUT_S: every request made its deadline
        assert time.monotonic() - started < m.settings.request_timeout_s
        for request, r in zip(requests, answers, strict=True):
            assert r.status_code == 200, r.text
            against_loop(r.json(), request, registry)
