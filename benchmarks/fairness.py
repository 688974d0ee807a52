"""Fair share across tenants: a lone tenant's requests behind another tenant's backlog.

One worker; tenant A queues ``--backlog`` jobs (POST /jobs) of ``PSGRAD_BATCH_MAX_SAMPLES``
samples each (so no two merge into one batch), then tenant B sends ``--requests`` small requests
one after the other (POST /per-sample-grads, one sample). With the queue served in fair order
B's request waits at most for the A job running when it arrives, and with A's jobs cut in
chunks of ``--chunk`` samples (``PSGRAD_FAIR_CHUNK_SAMPLES``; 0: whole jobs) for one chunk of
it, so the goal is

    B's 90th percentile  <=  3 x (one A chunk's time + B's own time)

where one A chunk's time is the median of the A jobs' compute times (their answers' ``timing``)
times ``chunk / samples``, and B's own time is B's median latency on the idle server, measured
first. A FIFO queue makes B wait for the whole backlog instead, whole jobs for a whole A job.
Runs the Redis mode (``psgrad serve`` + one ``psgrad worker``) and the embedded mode (``psgrad
serve``, one worker thread) in turn and prints both.

    python benchmarks/fairness.py [--backlog 20] [--requests 10] [--samples 512]
                                  [--chunk 64] [--model mlp]

Two keys name the tenants (``PSGRAD_API_KEYS=a:...,b:...``). Needs Redis at PSGRAD_REDIS_URL
(default the local one); its keys go under a fresh prefix, deleted at the end. A shared 2-core
machine: read the ratio, not the seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import URL, free_port, ready, serve, start, stop

from psgrad._wire import fields_to_safetensors

KEYS = {"a": "fairness-key-a", "b": "fairness-key-b"}
HEADERS = {"Content-Type": "application/x-safetensors", "Accept": "application/json"}
SHAPES = {"simple-cnn": (1, 28, 28), "mlp": (784,)}


def body(model: str, n: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return fields_to_safetensors({
        "model": model, "outputs": ["norms"],
        "inputs": rng.standard_normal((n, *SHAPES[model])).astype(np.float32),
        "targets": rng.integers(0, 10, n)}, "request")


def auth(tenant: str) -> dict[str, str]:
    return {**HEADERS, "Authorization": f"Bearer {KEYS[tenant]}"}


async def one(client: httpx.AsyncClient, data: bytes) -> float:
    """Seconds for one sync request of tenant B."""
    began = time.perf_counter()
    r = await client.post("/per-sample-grads", content=data, headers=auth("b"))
    r.raise_for_status()
    return time.perf_counter() - began


async def run(base: str, args: argparse.Namespace) -> dict[str, float]:
    small = body(args.model, 1, 0)
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await ready(base)
        for _ in range(2):  # warm both sizes up: the first call of a shape pays its set-up
            await one(client, small)
            r = await client.post("/per-sample-grads", content=body(args.model, args.samples, 1),
                                  headers=auth("a"))
            r.raise_for_status()
        own = statistics.median([await one(client, small) for _ in range(3)])
        ids = []
        for i in range(args.backlog):
            r = await client.post("/jobs", content=body(args.model, args.samples, 10 + i),
                                  headers=auth("a"))
            r.raise_for_status()
            ids.append(r.json()["job_id"])
        await asyncio.sleep(0.2)  # the first A job is running
        b = [await one(client, small) for _ in range(args.requests)]
        compute = []
        for job_id in ids:
            while True:
                doc = (await client.get(f"/jobs/{job_id}", headers=auth("a"))).json()
                if doc["status"] in ("succeeded", "failed", "canceled"):
                    break
                await asyncio.sleep(0.2)
            if doc["status"] == "succeeded":
                compute.append(doc["result"]["timing"]["compute_ms"] / 1000)
    a_job = statistics.median(compute) if compute else float("nan")
    share = min(1.0, args.chunk / args.samples) if args.chunk > 0 else 1.0
    return {"a_job": a_job, "a_chunk": a_job * share, "b_own": own, "b_slowest": max(b),
            "b_p90": statistics.quantiles(b, n=10, method="inclusive")[-1],
            "b_median": statistics.median(b), "goal": 3 * (a_job * share + own),
            "a_done": len(compute)}


def show(mode: str, r: dict[str, float]) -> None:
    met = "met" if r["b_p90"] <= r["goal"] else "NOT met"
    print(f"{mode:9s} one A job {r['a_job']:.2f} s (a chunk {r['a_chunk']:.2f} s), B alone "
          f"{r['b_own']:.3f} s | B behind the backlog: p90 {r['b_p90']:.2f} s, slowest "
          f"{r['b_slowest']:.2f} s, median {r['b_median']:.2f} s | goal 3x(A chunk + B alone) = "
          f"{r['goal']:.2f} s: {met} (ratio {r['b_p90'] / (r['a_chunk'] + r['b_own']):.2f}x; "
          f"A jobs done {r['a_done']:.0f})")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backlog", type=int, default=20)
    parser.add_argument("--requests", type=int, default=10)
    parser.add_argument("--samples", type=int, default=512,
                        help="samples of each A job, and PSGRAD_BATCH_MAX_SAMPLES")
    parser.add_argument("--chunk", type=int, default=64,
                        help="PSGRAD_FAIR_CHUNK_SAMPLES (0: every job whole)")
    parser.add_argument("--model", default="mlp", choices=sorted(SHAPES))
    parser.add_argument("--modes", default="redis,embedded")
    args = parser.parse_args()
    common = {"api_keys": ",".join(f"{t}:{k}" for t, k in KEYS.items()), "device": "cpu",
              "batch_max_samples": args.samples, "max_queue_depth": 1000,
              "fair_chunk_samples": args.chunk}
    for mode in args.modes.split(","):
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        if mode == "redis":
            import redis

            prefix = f"psgrad-fair-{uuid.uuid4().hex[:8]}"
            settings = {**common, "redis_url": URL, "redis_prefix": prefix}
            procs = [serve(port, **settings), start(["worker", "--device", "cpu"], **settings)]
            try:
                show(mode, await run(base, args))
            finally:
                for proc in procs:
                    stop(proc)
                client = redis.Redis.from_url(URL)
                doomed = list(client.scan_iter(match=f"{prefix}:*", count=1000))
                if doomed:
                    client.delete(*doomed)
        else:
            proc = serve(port, workers=1, **common)
            try:
                show(mode, await run(base, args))
            finally:
                stop(proc)


if __name__ == "__main__":
    asyncio.run(main())
