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
                                  [--private-redis]

Every request is a real HTTP request on loopback (safetensors body, JSON answer), so client and
api costs are in every figure. With every process on one small machine the rate is bounded by
the CPU time a request costs in all of them together, so the throughput table also gives CPU
milliseconds per request in each process (the clients, the api, the worker, redis-server: user +
system time from ``/proc`` before and after the timed phase, divided by the requests done); unlike
the rates these do not move much with other load on the machine. Redis's share is only ours with
``--private-redis`` (a ``redis-server`` of its own on a free port, no persistence); otherwise it
is the local server's, which other clients of that server inflate. Needs Redis at
PSGRAD_REDIS_URL (default the local one) unless ``--private-redis``; its keys go under a fresh
prefix, deleted at the end. A shared 2-core machine: read the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
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
PATH = "/per-sample-grads"


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
TICK = os.sysconf("SC_CLK_TCK")


class RawClient:
    """One keep-alive HTTP/1.1 connection doing the least a client can: its request's bytes are
    made once, the answer is read by its Content-Length.

    The clients share the 2 cores with the api, Redis and the worker: httpx spent about 1.6 ms
    of CPU per request here, as much as the worker's whole share, so it would measure the
    client as much as the server. ``--client httpx`` runs the same requests through httpx.
    """

    def __init__(self, base: str, path: str, data: bytes) -> None:
        url = httpx.URL(base)
        self.host, self.port = url.host, url.port or 80
        head = (f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in HEADERS.items())
                + f"Content-Length: {len(data)}\r\n\r\n")
        self.request = head.encode() + data
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> dict[str, Any]:
        """Send the request; the JSON answer (raises on any status but 200)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        assert self.reader is not None
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        fields = dict(line.split(": ", 1) for line in lines if line)
        size = {k.lower(): v for k, v in fields.items()}.get("content-length")
        if size is None:
            raise RuntimeError(f"no Content-Length in the answer: {head!r}")
        answer = await self.reader.readexactly(int(size))
        if status_line.split(" ", 2)[1] != "200":
            raise RuntimeError(f"{status_line}: {answer[:300]!r}")
        return dict(json.loads(answer))

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()


def poster(base: str, data: bytes, kind: str, http: httpx.AsyncClient
           ) -> Callable[[], Awaitable[dict[str, Any]]]:
    """One client's way to send its request: a :class:`RawClient`, or httpx."""
    if kind == "raw":
        return RawClient(base, PATH, data).post

    async def post() -> dict[str, Any]:
        r = await http.post(PATH, content=data, headers=HEADERS)
        r.raise_for_status()
        return dict(r.json())

    return post


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far, all its threads (0 when unknown)."""
    if pid is None:
        return 0.0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def redis_pid(url: str) -> int | None:
    """redis-server's pid when it runs on this machine (its CPU is then measurable)."""
    import redis

    client = redis.Redis.from_url(url)
    try:
        host = client.connection_pool.connection_kwargs.get("host", "localhost")
        if host not in ("localhost", "127.0.0.1", "::1"):
            return None
        return int(client.info("server")["process_id"])
    finally:
        client.close()


def private_redis(aof_dir: str | None = None, socket_dir: str | None = None
                  ) -> tuple[subprocess.Popen[bytes], str]:
    """A ``redis-server`` of this benchmark's own on a free port: no persistence, or with
    ``aof_dir`` an append-only file there (``appendfsync everysec``), as docker-compose.yml runs
    Redis. With ``socket_dir`` it also listens on a Unix socket there, and its URL names that."""
    port = free_port()
    persist = ["--appendonly", "yes", "--dir", aof_dir] if aof_dir else ["--appendonly", "no"]
    sock = f"{socket_dir}/redis-{port}.sock" if socket_dir else None
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                             "--save", "", *persist,
                             *(["--unixsocket", sock, "--unixsocketperm", "700"] if sock else [])],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"unix://{sock}?db=0" if sock else f"redis://127.0.0.1:{port}/0"
    wait_redis(url)
    return proc, url


def wait_redis(url: str, timeout: float = 30.0) -> None:
    """Return once the Redis at ``url`` answers a ping (a server just started)."""
    import redis

    until = time.monotonic() + timeout
    while True:
        try:
            redis.Redis.from_url(url).ping()
            return
        except redis.ConnectionError:
            if time.monotonic() > until:
                raise
            time.sleep(0.05)


CPU_OF = ("clients", "api", "worker", "redis")


async def throughput(base: str, seconds: float, pids: dict[str, int | None], kind: str
                     ) -> tuple[float, float, dict[str, float]]:
    """Requests per second of CLIENTS closed-loop clients, the mean jobs per engine call, and
    the CPU milliseconds per request of each process in ``pids`` (None: not measurable).
    """
    bodies = [body(i) for i in range(CLIENTS)]
    done = 0
    batch_jobs: list[int] = []
    until = time.monotonic() + seconds

    async def client(post: Callable[[], Awaitable[dict[str, Any]]]) -> None:
        nonlocal done
        while time.monotonic() < until:
            answer = await post()
            done += 1
            batch_jobs.append(answer["meta"]["batch_jobs"])

    limits = httpx.Limits(max_connections=CLIENTS + 4)
    async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as http:
        posts = [poster(base, data, kind, http) for data in bodies]
        await asyncio.gather(*(post() for post in posts))  # warm up, connections open
        before = {name: cpu_s(pid) for name, pid in pids.items()}
        started = time.monotonic()
        await asyncio.gather(*(client(post) for post in posts))
        elapsed = time.monotonic() - started
        after = {name: cpu_s(pid) for name, pid in pids.items()}
        for post in posts:
            if isinstance(getattr(post, "__self__", None), RawClient):
                await post.__self__.close()  # type: ignore[attr-defined]
    cpu = {name: (after[name] - before[name]) * 1e3 / max(done, 1) for name in pids}
    return done / elapsed, statistics.mean(batch_jobs), cpu


async def latency(base: str, n: int, kind: str) -> tuple[float, float]:
    """p50 and p99 of one client's one-sample requests, one at a time."""
    times = []
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        post = poster(base, body(0), kind, http)
        for _ in range(5):
            await post()
        for _ in range(n):
            start = time.perf_counter()
            await post()
            times.append(time.perf_counter() - start)
        if isinstance(getattr(post, "__self__", None), RawClient):
            await post.__self__.close()  # type: ignore[attr-defined]
    return statistics.median(times), float(np.percentile(times, 99))


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--latency-requests", type=int, default=200)
    parser.add_argument("--private-redis", action="store_true",
                        help="run a redis-server of its own (its CPU is then only this run's)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="the worker's PSGRAD_TORCH_THREADS (0: torch's own choice)")
    parser.add_argument("--client", choices=("raw", "httpx"), default="raw",
                        help="how the clients send (raw: HTTP/1.1 on asyncio streams)")
    args = parser.parse_args()
    import redis

    own_redis, url = private_redis() if args.private_redis else (None, URL)
    prefix = f"psgrad-bench-{uuid.uuid4().hex[:8]}"
    redis_settings = {"redis_url": url, "redis_prefix": prefix, "device": "cpu"}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    api = serve(port, **redis_settings)
    rates: dict[str, list[float]] = {"batched": [], "unbatched": []}
    per_call: dict[str, list[float]] = {"batched": [], "unbatched": []}
    cpu: dict[str, list[dict[str, float]]] = {"batched": [], "unbatched": []}
    lat: dict[str, tuple[float, float]] = {}
    try:
        for _ in range(args.rounds):
            for mode, delay in (("batched", 5), ("unbatched", 0)):
                worker = start(["worker", "--device", "cpu"], batch_max_delay_ms=delay,
                               torch_threads=args.torch_threads, **redis_settings)
                try:
                    await ready(base)
                    pids = {"clients": os.getpid(), "api": api.pid, "worker": worker.pid,
                            "redis": redis_pid(url)}
                    rate, jobs, used = await throughput(base, args.seconds, pids, args.client)
                    rates[mode].append(rate)
                    per_call[mode].append(jobs)
                    cpu[mode].append(used)
                    if mode == "batched" and "redis" not in lat:
                        lat["redis"] = await latency(base, args.latency_requests, args.client)
                finally:
                    stop(worker)
                print(f"  {mode:<9} {rate:7.1f} req/s, {jobs:4.1f} jobs per engine call, CPU ms "
                      "per request: " + ", ".join(f"{k} {v:.2f}" for k, v in used.items()),
                      flush=True)
    finally:
        stop(api)
        client = redis.Redis.from_url(url)
        doomed = list(client.scan_iter(match=f"{prefix}:*"))
        if doomed:
            client.delete(*doomed)
        client.close()
        if own_redis is not None:
            stop(own_redis)
    port = free_port()
    embedded = serve(port, workers=1, device="cpu")
    try:
        await ready(f"http://127.0.0.1:{port}")
        lat["embedded"] = await latency(f"http://127.0.0.1:{port}", args.latency_requests,
                                        args.client)
    finally:
        stop(embedded)

    on, off = statistics.median(rates["batched"]), statistics.median(rates["unbatched"])
    print(f"\nthroughput, {CLIENTS} clients x mlp B={BATCH} norms, one worker, "
          f"{args.rounds} x {args.seconds:g} s per mode (medians; CPU ms per request of each "
          f"process, {'a private' if own_redis else 'the shared'} redis-server):\n")
    print("| mode | req/s | jobs per call | " + " | ".join(f"{k} CPU ms" for k in CPU_OF)
          + " | total CPU ms |")
    print("|---|---:|---:|" + "---:|" * (len(CPU_OF) + 1))
    for mode, label in (("batched", "batching (5 ms window)"), ("unbatched", "one job per call")):
        used = {k: statistics.median(c[k] for c in cpu[mode]) for k in CPU_OF}
        print(f"| {label} | {statistics.median(rates[mode]):.1f} | "
              f"{statistics.median(per_call[mode]):.1f} | "
              + " | ".join(f"{used[k]:.2f}" for k in CPU_OF) + f" | {sum(used.values()):.2f} |")
    print(f"\nratio: {on / off:.2f}x (goal: >= 2x)")
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
