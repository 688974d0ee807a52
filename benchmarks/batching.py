"""Cross-request batching through Redis, and the latency of a lone one-sample request.

1. Throughput: one ``psgrad worker`` behind a ``psgrad serve`` that enqueues to Redis; 32
   concurrent clients each send the zoo ``mlp`` one sample (outputs ``norms``) back to back for
   a fixed time. The worker runs with batching (``PSGRAD_BATCH_MAX_DELAY_MS=5``) and without
   (``0``: one job per engine call), in alternating rounds; requests per second, medians over
   rounds. Goal: batching >= 2x.
2. Latency at low load: one client, one request at a time, through the Redis path (api process
   + worker process) and through the embedded broker (``psgrad serve`` alone, worker thread in
   the api process), both with the default window (5 ms: a job that finds the worker idle must
   not wait it); p50 and p99, and the difference of the medians.

    python benchmarks/batching.py [--seconds 10] [--rounds 2] [--latency-requests 40]

Every request is a real HTTP request on loopback (safetensors body, JSON answer), so client and
api costs are in every figure. Needs Redis at PSGRAD_REDIS_URL (default the local one); its keys
go under a fresh prefix, deleted at the end. A shared 2-core machine: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import httpx
import numpy as np

from psgrad._wire import fields_to_safetensors

URL = os.environ.get("PSGRAD_REDIS_URL", "redis://127.0.0.1:6379/0")
PSGRAD = str(Path(sys.executable).with_name("psgrad"))
CLIENTS = 32
BATCH = 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env(**settings: Any) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("PSGRAD_")}
    base.update({f"PSGRAD_{k.upper()}": str(v) for k, v in settings.items()})
    base["PSGRAD_REQUEST_TIMEOUT_S"] = "300"
    return base


def start(args: list[str], **settings: Any) -> subprocess.Popen[bytes]:
    return subprocess.Popen([PSGRAD, *args], env=env(**settings), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)


def serve(port: int, **settings: Any) -> subprocess.Popen[bytes]:
    return start(["serve", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                  "warning"], **settings)


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_ready(base: str, timeout: float = 120.0) -> None:
    asyncio.run(ready(base, timeout))


async def ready(base: str, timeout: float = 120.0) -> None:
    until = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=base) as client:
        while time.monotonic() < until:
            try:
                if (await client.get("/readyz")).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{base} not ready")


def body(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return fields_to_safetensors({
        "model": "mlp", "outputs": ["norms"],
        "inputs": rng.standard_normal((BATCH, 784)).astype(np.float32),
        "targets": rng.integers(0, 10, BATCH)}, "request")


HEADERS = {"Content-Type": "application/x-safetensors", "Accept": "application/json"}


async def throughput(base: str, seconds: float) -> tuple[float, float]:
    """Requests per second of CLIENTS closed-loop clients, and the mean jobs per engine call."""
    bodies = [body(i) for i in range(CLIENTS)]
    done = 0
    batch_jobs: list[int] = []
    until = time.monotonic() + seconds

    async def client(i: int, http: httpx.AsyncClient) -> None:
        nonlocal done
        while time.monotonic() < until:
            r = await http.post("/per-sample-grads", content=bodies[i], headers=HEADERS)
            r.raise_for_status()
            done += 1
            batch_jobs.append(r.json()["meta"]["batch_jobs"])

    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as http:
        await http.post("/per-sample-grads", content=bodies[0], headers=HEADERS)  # warm up
        started = time.monotonic()
        await asyncio.gather(*(client(i, http) for i in range(CLIENTS)))
        elapsed = time.monotonic() - started
    return done / elapsed, statistics.mean(batch_jobs)


async def latency(base: str, n: int) -> tuple[float, float]:
    """p50 and p99 of one client's one-sample requests, one at a time."""
    data = body(0)
    times = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        for _ in range(5):
            (await http.post("/per-sample-grads", content=data, headers=HEADERS)).raise_for_status()
        for _ in range(n):
            start = time.perf_counter()
            (await http.post("/per-sample-grads", content=data, headers=HEADERS)).raise_for_status()
            times.append(time.perf_counter() - start)
    return statistics.median(times), float(np.percentile(times, 99))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-requests", type=int, default=200)
    args = parser.parse_args()
    import redis

    prefix = f"psgrad-bench-{uuid.uuid4().hex[:8]}"
    redis_settings = {"redis_url": URL, "redis_prefix": prefix, "device": "cpu"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = serve(port, **redis_settings)
    rates: dict[str, list[float]] = {"batched": [], "unbatched": []}
    per_call: dict[str, list[float]] = {"batched": [], "unbatched": []}
    lat: dict[str, tuple[float, float]] = {}
    try:
        for _ in range(args.rounds):
            for mode, delay in (("batched", 5), ("unbatched", 0)):
                worker = start(["worker", "--device", "cpu"], batch_max_delay_ms=delay,
                               **redis_settings)
                try:
                    await ready(base)
                    rate, jobs = await throughput(base, args.seconds)
                    rates[mode].append(rate)
                    per_call[mode].append(jobs)
                    if mode == "batched" and "redis" not in lat:
                        lat["redis"] = await latency(base, args.latency_requests)
                finally:
                    stop(worker)
                print(f"  {mode:<9} {rate:7.1f} req/s, {jobs:4.1f} jobs per engine call",
                      flush=True)
    finally:
        stop(api)
        client = redis.Redis.from_url(URL)
        doomed = list(client.scan_iter(match=f"{prefix}:*"))
        if doomed:
            client.delete(*doomed)
        client.close()
    port = free_port()
    embedded = serve(port, workers=1, device="cpu")
    try:
        await ready(f"http://127.0.0.1:{port}")
        lat["embedded"] = await latency(f"http://127.0.0.1:{port}", args.latency_requests)
    finally:
        stop(embedded)

    on, off = statistics.median(rates["batched"]), statistics.median(rates["unbatched"])
    print(f"\nthroughput, {CLIENTS} clients x mlp B={BATCH} norms, one worker, "
          f"{args.rounds} x {args.seconds:g} s per mode:")
    print(f"  with cross-request batching: {on:7.1f} req/s "
          f"({statistics.median(per_call['batched']):.1f} jobs per engine call)")
    print(f"  without (one job per call):  {off:7.1f} req/s")
    print(f"  ratio: {on / off:.2f}x (goal: >= 2x)")
    print(f"\nlatency of a one-sample request, one client, {args.latency_requests} requests, "
          "default window (5 ms):")
    for name, label in (("redis", "Redis path (api + worker process)"),
                        ("embedded", "embedded broker (one process)")):
        p50, p99 = lat[name]
        print(f"  {label:<34} p50 {p50 * 1e3:6.2f} ms   p99 {p99 * 1e3:6.2f} ms")
    added = lat["redis"][0] - lat["embedded"][0]
    print(f"  added by Redis (p50): {added * 1e3:+.2f} ms")


if __name__ == "__main__":
    asyncio.run(main())
