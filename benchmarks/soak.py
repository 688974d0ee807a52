"""Soak: psgrad in compose's Redis layout under a steady request rate, and what its queue Redis
writes to disk.

Starts, on loopback only, the two Redis servers with the arguments docker-compose.yml gives them
(the queue's with its append-only file, in a temporary folder; the answers' without persistence),
one ``psgrad serve`` and ``--workers`` CPU ``psgrad worker`` processes with compose's worker
environment, then sends requests at ``--rate`` per second (open loop, at most ``--in-flight`` at
once) for ``--seconds`` (at most an hour) from a mix of zoo requests, every answer checked for
its shape. Every second it reads the queue Redis's ``INFO``; at the end it prints:

- requests done, failed, the rate reached, and the latency percentiles;
- the bytes the queue Redis appended to its append-only file per request and per second;
- its append-only file rewrites (``aof_rewrites``), RDB snapshots (``rdb_saves``) and forks
  (``total_forks``) during the run, per hour, and the rewrites per hour that the append rate
  gives at Redis's ``auto-aof-rewrite-min-size`` (a run shorter than one rewrite interval still
  predicts the rate);
- the keys and memory left in both Redis servers when the run has drained (a leak shows here).

    python benchmarks/soak.py [--seconds 120] [--rate 37] [--workers 2] [--in-flight 64]
                              [--mix mixed|small|payloads] [--compose docker-compose.yml]

The processes share this machine's cores: on a small host the rate reached is below the asked
rate once the workers are saturated; the bytes per request do not depend on it.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import httpx
import numpy as np
import redis
import yaml
from batching import free_port, serve, start, stop, wait_ready, wait_redis

from psgrad._wire import fields_to_safetensors

ROOT = Path(__file__).resolve().parents[1]
MAX_SECONDS = 3600
HEADERS = {"Content-Type": "application/x-safetensors", "Accept": "application/json"}


Case = tuple[str, bytes, dict[str, tuple[int, ...]]]  # name, body, {output: shape wanted}


def requests(mix: str, seed: int = 0) -> list[Case]:
    """(name, safetensors body, {output: expected shape}) of the mix's requests."""
    rng = np.random.default_rng(seed)

    def mlp(batch: int, outputs: list[str]) -> bytes:
        return fields_to_safetensors({
            "model": "mlp", "outputs": outputs,
            "inputs": rng.standard_normal((batch, 784)).astype(np.float32),
            "targets": rng.integers(0, 10, batch)}, "request")

    def cnn(batch: int) -> bytes:
        return fields_to_safetensors({
            "model": "simple-cnn", "outputs": ["norms"],
            "inputs": rng.standard_normal((batch, 1, 28, 28)).astype(np.float32),
            "targets": rng.integers(0, 10, batch)}, "request")

    td0 = fields_to_safetensors({
        "model": "linear-value", "loss": "td0", "outputs": ["td_errors"],
        "inputs": rng.standard_normal((8, 3)).astype(np.float32),
        "next_inputs": rng.standard_normal((8, 3)).astype(np.float32),
        "rewards": rng.standard_normal(8).astype(np.float32)}, "request")
    small: list[Case] = [("mlp-norms-1", mlp(1, ["norms"]), {"norms": (1,)}),
             ("td0-8", td0, {"td_errors": (8,)})]
    payloads: list[Case] = [("mlp-norms-64", mlp(64, ["norms"]), {"norms": (64,)}),
                ("cnn-norms-32", cnn(32), {"norms": (32,)})]
    if mix == "small":
        return small
    if mix == "payloads":
        return payloads
    return [*small, *payloads]


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def shape_of(value: Any) -> tuple[int, ...]:
    return tuple(np.asarray(value).shape)


class Probe:
    """The queue Redis's INFO, read every second: appended bytes, rewrites, snapshots, forks."""

    def __init__(self, url: str) -> None:
        self.r = redis.Redis.from_url(url)
        self.first = self.info()
        self.last = self.first
        self.appended = 0

    def info(self) -> dict[str, Any]:
        return {**self.r.info("persistence"), **self.r.info("stats")}

    def sample(self) -> None:
        now = self.info()
        grown = int(now["aof_current_size"]) - int(self.last["aof_current_size"])
        if now["aof_rewrites"] == self.last["aof_rewrites"] and grown > 0:
            self.appended += grown
        elif grown > 0:  # a rewrite ended: what was appended since is above its new base
            self.appended += int(now["aof_current_size"]) - int(now["aof_base_size"])
        self.last = now

    def count(self, field: str) -> int:
        return int(self.last[field]) - int(self.first[field])


async def drive(base: str, mix: list[Case],
                rate: float, seconds: float, in_flight: int, probe: Probe
                ) -> tuple[list[float], dict[str, int]]:
    """Open loop at ``rate``: latencies of the answers that passed, failures by kind."""
    latencies: list[float] = []
    failures: dict[str, int] = {}
    slots = asyncio.Semaphore(in_flight)
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)

    async with httpx.AsyncClient(base_url=base, timeout=120, limits=limits) as http:

        async def one(i: int) -> None:
            name, data, want = mix[i % len(mix)]
            t0 = time.perf_counter()
            try:
                r = await http.post("/per-sample-grads", content=data, headers=HEADERS)
                if r.status_code != 200:
                    kind = f"{name}: HTTP {r.status_code} {r.text[:120]}"
                else:
                    body = r.json()
                    bad = {k: shape_of(body.get(k)) for k, s in want.items()
                           if shape_of(body.get(k)) != s}
                    kind = f"{name}: wrong shapes {bad}" if bad else ""
            except httpx.HTTPError as exc:
                kind = f"{name}: {type(exc).__name__}"
            finally:
                slots.release()
            if kind:
                failures[kind] = failures.get(kind, 0) + 1
            else:
                latencies.append(time.perf_counter() - t0)

        tasks: set[asyncio.Task[None]] = set()
        t0 = time.monotonic()
        next_probe = t0 + 1.0
        i = 0
        while (now := time.monotonic()) < t0 + seconds:
            if now >= next_probe:
                probe.sample()
                next_probe += 1.0
            due = t0 + i / rate
            if now < due:
                await asyncio.sleep(min(due - now, max(0.0, next_probe - now)))
                continue
            await slots.acquire()
            task = asyncio.create_task(one(i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            i += 1
        while tasks:
            await asyncio.sleep(0.2)
            probe.sample()
    return latencies, failures


def compose_redis(compose: Path) -> dict[str, list[str]]:
    """The commands docker-compose.yml runs its two Redis servers with."""
    services = yaml.safe_load(compose.read_text())["services"]
    return {name: [str(a) for a in services[name]["command"]]
            for name in ("redis", "redis-answers")}


def start_redis(command: list[str], folder: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``command`` on a free loopback port in ``folder`` (a Unix socket moved there too)."""
    port = free_port()
    args = list(command)
    if "--unixsocket" in args:
        args[args.index("--unixsocket") + 1] = str(folder / "redis.sock")
    proc = subprocess.Popen([*args, "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(folder)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    wait_redis(url)
    return proc, url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=37.0, help="requests per second asked")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--mix", choices=["mixed", "small", "payloads"], default="mixed")
    parser.add_argument("--compose", type=Path, default=ROOT / "docker-compose.yml")
    args = parser.parse_args()
    if not 0 < args.seconds <= MAX_SECONDS:
        parser.error(f"--seconds must be in (0, {MAX_SECONDS}]")
    commands = compose_redis(args.compose)
    mix = requests(args.mix)
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="psgrad-soak-") as tmp:
        try:
            urls = {}
            for name, command in commands.items():
                folder = Path(tmp) / name
                folder.mkdir()
                proc, urls[name] = start_redis(command, folder)
                procs.append(proc)
            settings = {"redis_url": urls["redis"], "answer_redis_url": urls["redis-answers"],
                        "redis_prefix": "soak"}
            port = free_port()
            procs.append(serve(port, **settings))
            for _ in range(args.workers):
                procs.append(start(["worker", "--device", "cpu"], **settings))
            base = f"http://127.0.0.1:{port}"
            wait_ready(base)
            # one round of the mix first: models loaded, functions built, before the counting
            asyncio.run(drive(base, mix, 50.0, len(mix) / 50.0, 8, Probe(urls["redis"])))
            probe = Probe(urls["redis"])
            config = {text(k): text(v)
                      for k, v in probe.r.config_get("auto-aof-rewrite-*").items()}
            t0 = time.monotonic()
            latencies, failures = asyncio.run(
                drive(base, mix, args.rate, args.seconds, args.in_flight, probe))
            elapsed = time.monotonic() - t0
            report(args, probe, config, latencies, failures, elapsed, urls)
        finally:
            for proc in reversed(procs):
                stop(proc)


def report(args: argparse.Namespace, probe: Probe, config: dict[str, str],
           latencies: list[float], failures: dict[str, int], elapsed: float,
           urls: dict[str, str]) -> None:
    done = len(latencies)
    hours = elapsed / 3600
    min_size = int(config["auto-aof-rewrite-min-size"])
    per_s = probe.appended / elapsed
    print(f"soak: {elapsed:.0f} s, mix {args.mix}, {args.workers} CPU worker(s), "
          f"asked {args.rate:g}/s, queue Redis as {args.compose.name} runs it")
    print(f"  requests: {done} answered and checked, {sum(failures.values())} failed, "
          f"{done / elapsed:.1f}/s")
    for kind, n in sorted(failures.items()):
        print(f"    {n} x {kind}")
    if latencies:
        q = statistics.quantiles(latencies, n=100) if done > 1 else latencies * 99
        print(f"  latency: p50 {q[49] * 1e3:.0f} ms, p99 {q[98] * 1e3:.0f} ms")
    print(f"  queue Redis append-only file: {probe.appended / 1e6:.1f} MB appended, "
          f"{probe.appended / max(done, 1) / 1e3:.1f} kB per request, {per_s / 1e3:.0f} kB/s")
    for field in ("aof_rewrites", "rdb_saves", "total_forks"):
        n = probe.count(field)
        print(f"  {field}: {n} ({n / hours:.0f} per hour)")
    at_asked = probe.appended / max(done, 1) * args.rate
    print(f"  rewrites per hour at auto-aof-rewrite-min-size {min_size / 2**20:.0f} MiB "
          f"(percentage {config['auto-aof-rewrite-percentage']}), predicted: "
          f"{per_s * 3600 / min_size:.1f} at the rate reached, "
          f"{at_asked * 3600 / min_size:.1f} at the asked {args.rate:g}/s")
    for name, url in urls.items():
        r = redis.Redis.from_url(url)
        time.sleep(0.5)
        print(f"  {name} after the run: {r.dbsize()} keys, "
              f"{int(r.info('memory')['used_memory']) / 2**20:.1f} MiB used")


if __name__ == "__main__":
    main()
