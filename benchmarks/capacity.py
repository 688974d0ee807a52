"""Capacity of one worker: the engine's time per request for the zoo models, and what it gives.

For each zoo model and a few request shapes, in this process on ``--device`` (one worker's
engine: parse, compute, the answer's arrays; no HTTP, no Redis), the median over ``--repeats``
calls after two warm-up calls. Printed per case: milliseconds per request, requests per second
of one busy worker (1 / time), samples per second, and (``--load``) the workers that a load of
that many requests per second of the case needs at 70 % busy. docs/kubernetes.md explains how to
read it (batching merges small requests, so a worker answers more small requests per second
than 1 / time; the api and Redis add their own CPU per request).

    python benchmarks/capacity.py [--device cpu] [--repeats 5] [--load 50] [--threads 1]

On a CPU the figures are a CPU's: label them so. Our 2-core machines are shared: read them as
orders of magnitude, and rerun on the host you size.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import numpy as np
import torch

from service import engine
from service.answer_fields import to_wire
from service.registry import ModelRegistry, resolve_device
from service.validate import parse_request

BUSY = 0.7  # the share of a worker's time a sizing plans to use


def cases() -> list[tuple[str, dict[str, Any]]]:
    rng = np.random.default_rng(0)

    def image(b: int, outputs: list[str]) -> dict[str, Any]:
        return {"model": "simple-cnn", "outputs": outputs,
                "inputs": rng.random((b, 1, 28, 28), dtype=np.float32),
                "targets": rng.integers(0, 10, b)}

    def mlp(b: int, outputs: list[str]) -> dict[str, Any]:
        return {"model": "mlp", "outputs": outputs,
                "inputs": rng.standard_normal((b, 784)).astype(np.float32),
                "targets": rng.integers(0, 10, b)}

    def tokens(b: int) -> dict[str, Any]:
        return {"model": "tiny-transformer", "outputs": ["norms"],
                "inputs": rng.integers(0, 1000, (b, 32)), "targets": rng.integers(0, 4, b)}

    def td0(model: str, dim: int, b: int) -> dict[str, Any]:
        return {"model": model, "loss": "td0", "outputs": ["updates", "td_errors"],
                "inputs": rng.standard_normal((b, dim)).astype(np.float32),
                "next_inputs": rng.standard_normal((b, dim)).astype(np.float32),
                "rewards": rng.standard_normal(b).astype(np.float32)}

    return [
        ("simple-cnn norms B=1", image(1, ["norms"])),
        ("simple-cnn norms B=32", image(32, ["norms"])),
        ("simple-cnn grads B=8", image(8, ["grads"])),
        ("mlp norms B=1", mlp(1, ["norms"])),
        ("mlp norms B=64", mlp(64, ["norms"])),
        ("mlp grads B=16", mlp(16, ["grads"])),
        ("tiny-transformer norms B=16", tokens(16)),
        ("linear-value td0 B=64", td0("linear-value", 3, 64)),
        ("value-mlp td0 B=64", td0("value-mlp", 8, 64)),
    ]


def timed(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--load", type=float, default=50.0,
                        help="requests per second to size the workers for")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (PSGRAD_TORCH_THREADS; 0: torch's choice)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    registry = ModelRegistry(resolve_device(args.device))
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"one worker's engine on {args.device} ({name}), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads; median of {args.repeats}; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'case':<30}{'ms/request':>11}{'requests/s':>12}{'samples/s':>11}"
          f"{f'workers for {args.load:g}/s':>20}")
    for label, request in cases():
        def run(request: dict[str, Any] = request) -> Any:
            parsed = parse_request(request, registry)
            out = engine.compute(parsed.model, parsed.batch, parsed.opts)[0]
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            return {k: to_wire(v) for k, v in out.items() if k != "meta"}

        seconds = timed(run, args.repeats)
        batch = len(request["inputs"])
        need = math.ceil(args.load * seconds / BUSY)
        print(f"{label:<30}{seconds * 1e3:>11.1f}{1 / seconds:>12.0f}{batch / seconds:>11.0f}"
              f"{need:>20}")


if __name__ == "__main__":
    main()
