"""The api's overhead: simple-cnn B=64 over HTTP on loopback against the engine in process, a
parameter-shaped summary (clipped_mean, 1.2 million floats) as JSON against safetensors, and 16
concurrent clients with B=4 each, dynamic batching on against off.

Two ``psgrad serve`` processes run side by side (batching off: ``PSGRAD_BATCH_MAX_DELAY_MS=0``,
used for the single-client rows too; batching on: 5 ms), the rounds interleave, and the client's
own decoding is part of each HTTP time (what a user waits for). Medians over the repeats and
ratios from one run: the machine is shared, compare ratios rather than times.

    python benchmarks/api.py [--repeats 5] [--json-repeats 2]
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
from collections.abc import Callable
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import httpx
import numpy as np
import orjson

from psgrad._wire import (
    REQUEST_KEY,
    RESPONSE_KEY,
    fields_from_safetensors,
    fields_to_json,
    fields_to_safetensors,
)
from service import engine
from service.registry import ModelRegistry
from service.validate import parse_request

SAFETENSORS = "application/x-safetensors"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(delay_ms: float) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    env = {
        **os.environ,
        "PSGRAD_BATCH_MAX_DELAY_MS": str(delay_ms),
        "PSGRAD_WORKERS": "1",
        "PSGRAD_REQUEST_TIMEOUT_S": "900",
    }
    env.pop("PSGRAD_REDIS_URL", None)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("psgrad serve did not start")


def request(batch: int, outputs: list[str], seed: int = 0, **extra: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {
        "model": "simple-cnn",
        "outputs": outputs,
        "inputs": rng.random((batch, 1, 28, 28), dtype=np.float32),
        "targets": rng.integers(0, 10, batch),
        **extra,
    }


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def in_process(registry: ModelRegistry, fields: dict[str, Any]) -> Callable[[], Any]:
    def run() -> Any:  # parse (tensor conversion) + engine, as the worker does
        parsed = parse_request(fields, registry)
        out = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]
        return {
            k: ({p: t.detach().numpy() for p, t in v.items()} if isinstance(v, dict) and k != "meta"
                else v)
            for k, v in out.items()
        }

    return run


def over_http(client: httpx.Client, fields: dict[str, Any], *, binary: bool) -> Callable[[], Any]:
    if binary:
        body = fields_to_safetensors(fields, REQUEST_KEY)
        headers = {"content-type": SAFETENSORS, "accept": SAFETENSORS}
    else:
        body = json.dumps(fields_to_json(fields)).encode()
        headers = {"content-type": "application/json"}

    def run() -> Any:
        r = client.post("/per-sample-grads", content=body, headers=headers)
        r.raise_for_status()
        if binary:
            return fields_from_safetensors(r.content, RESPONSE_KEY)
        doc = orjson.loads(r.content)  # a JSON user parses (fast) and makes arrays too
        return {
            k: (
                {p: np.asarray(t, np.float32) for p, t in v.items()}
                if isinstance(v, dict) and k not in ("timing", "meta")
                else v
            )
            for k, v in doc.items()
        }

    return run


async def concurrent_round(url: str, bodies: list[bytes]) -> tuple[float, list[int]]:
    headers = {"content-type": SAFETENSORS, "accept": SAFETENSORS}
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        answers = await asyncio.gather(
            *[client.post("/per-sample-grads", content=b, headers=headers) for b in bodies]
        )
        wall = (time.perf_counter() - start) * 1000
    jobs = []
    for r in answers:
        r.raise_for_status()
        jobs.append(fields_from_safetensors(r.content, RESPONSE_KEY)["meta"]["batch_jobs"])
    return wall, jobs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--json-repeats", type=int, default=2, help="repeats of the ~1 GB JSON grads answer (slow)"
    )
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--client-batch", type=int, default=4)
    args = parser.parse_args()

    off, off_url = start_server(0)
    on, on_url = start_server(5)
    try:
        registry = ModelRegistry()
        norms, grads = request(64, ["norms"]), request(64, ["grads"])
        clipped = request(64, ["clipped_mean"], clip_norm=1.0)
        client = httpx.Client(base_url=off_url, timeout=900)
        cases: dict[str, Callable[[], Any]] = {
            "engine in process, norms": in_process(registry, norms),
            "HTTP norms, safetensors": over_http(client, norms, binary=True),
            "HTTP norms, JSON lists": over_http(client, norms, binary=False),
            "engine in process, grads": in_process(registry, grads),
            "HTTP grads, safetensors": over_http(client, grads, binary=True),
            "HTTP grads, JSON lists": over_http(client, grads, binary=False),
            "engine in process, clipped_mean": in_process(registry, clipped),
            "HTTP clipped_mean, safetensors": over_http(client, clipped, binary=True),
            "HTTP clipped_mean, JSON lists": over_http(client, clipped, binary=False),
        }
        sizes = {
            "norms": len(
                client.post(
                    "/per-sample-grads",
                    content=json.dumps(fields_to_json(norms)).encode(),
                    headers={"content-type": "application/json"},
                ).content
            )
        }
        times: dict[str, list[float]] = {name: [] for name in cases}
        for fn in cases.values():  # warm-up: compile caches, first-touch memory
            fn()
        for rep in range(args.repeats):
            for name, fn in cases.items():
                if "JSON lists" in name and "grads" in name and rep >= args.json_repeats:
                    continue
                times[name].append(timed(fn))
        st_grads = client.post(
            "/per-sample-grads",
            content=fields_to_safetensors(grads, REQUEST_KEY),
            headers={"content-type": SAFETENSORS, "accept": SAFETENSORS},
        )
        sizes["grads"] = len(st_grads.content)
        sizes["clipped_mean"] = len(
            client.post(
                "/per-sample-grads",
                content=json.dumps(fields_to_json(clipped)).encode(),
                headers={"content-type": "application/json"},
            ).content
        )
        client.close()

        bodies = [
            fields_to_safetensors(request(args.client_batch, ["norms"], seed=i), REQUEST_KEY)
            for i in range(args.clients)
        ]
        rounds: dict[str, list[float]] = {"batching on": [], "batching off": []}
        merged: dict[str, list[int]] = {"batching on": [], "batching off": []}
        for url in (on_url, off_url):
            asyncio.run(concurrent_round(url, bodies))  # warm-up
        for _ in range(args.repeats):
            for label, url in (("batching on", on_url), ("batching off", off_url)):
                wall, jobs = asyncio.run(concurrent_round(url, bodies))
                rounds[label].append(wall)
                merged[label].extend(jobs)
    finally:
        for proc in (on, off):
            proc.terminate()
            proc.wait(30)

    med = {name: statistics.median(v) for name, v in times.items()}
    print(
        f"simple-cnn, B=64, medians of {args.repeats} (JSON grads: {args.json_repeats}); "
        f"answers: norms {sizes['norms']} B JSON, grads {sizes['grads'] / 2**20:.0f} MiB "
        f"safetensors, clipped_mean {sizes['clipped_mean'] / 2**20:.0f} MiB JSON"
    )
    print("| case | median ms | vs engine in process |")
    print("|---|---:|---:|")
    for name, value in med.items():
        kind = next(k for k in ("norms", "grads", "clipped_mean") if k in name)
        base = med[f"engine in process, {kind}"]
        print(f"| {name} | {value:.1f} | {value / base:.2f}x |")
    ratio = med["HTTP grads, JSON lists"] / med["HTTP grads, safetensors"]
    print(f"\nJSON lists / safetensors for grads: {ratio:.1f}x")
    ratio = med["HTTP clipped_mean, JSON lists"] / med["HTTP clipped_mean, safetensors"]
    print(f"JSON lists / safetensors for clipped_mean (1.2M floats): {ratio:.2f}x")
    n = args.clients * args.client_batch
    print(
        f"\n{args.clients} concurrent clients x B={args.client_batch} (norms, safetensors), "
        f"medians of {args.repeats} rounds"
    )
    print("| mode | round ms | samples/s | jobs per engine call (job-weighted mean) |")
    print("|---|---:|---:|---:|")
    for label, walls in rounds.items():
        m = statistics.median(walls)
        print(f"| {label} | {m:.1f} | {n / m * 1000:.0f} | {statistics.mean(merged[label]):.1f} |")
    speedup = statistics.median(rounds["batching off"]) / statistics.median(rounds["batching on"])
    print(f"\nbatching on is {speedup:.2f}x faster per round")


if __name__ == "__main__":
    main()
