"""Sketches (``projection``, k = 1024) against materialise-then-project, full per-sample
gradients and a plain forward+backward.

    python benchmarks/projection.py [--rounds 5] [--models simple-cnn,tiny-transformer] [--k 1024]

For ``simple-cnn`` at B=256 and ``tiny-transformer`` at B=64: ``projection`` on the fast path
(Kronecker sketches of Linear, Conv and Embedding weights from their inputs and output gradients,
no per-sample gradient), ``projection`` through ``vmap`` (every per-sample gradient materialised a
chunk at a time, then projected with the same matrices), ``grads`` (the per-sample gradients
themselves) and the floor (one batched forward+backward). Times are medians of interleaved
rounds and ratios medians of per-round ratios; peak memory is the resident-set high-water mark
of one warm call in a fresh subprocess, as in ``benchmarks/fast_stats.py``. Prints a Markdown
table and whether the goals are met: within 2x of the floor, at least 5x faster than
materialise-then-project.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import torch
from fast_stats import interleave, ratio, setup, steady_peak
from fast_stats import method as plain_method

from service import engine
from service.engine import Batch, Options
from service.registry import LoadedModel
from service.strategies.projection import Projection

CASES = {"simple-cnn": 256, "tiny-transformer": 64}
METHODS = ("floor", "projection", "materialise", "grads")


def method(model: LoadedModel, batch: Batch, name: str, k: int) -> Callable[[], Any]:
    if name == "floor":
        fn = plain_method(model, batch, "floor", "norms")
        assert fn is not None
        return fn
    output = "grads" if name == "grads" else "projection"
    opts = Options(loss=model.default_loss, outputs=(output,), params=tuple(model.params),
                   projection=Projection(k, 0))
    fast = name == "projection"
    return lambda: engine.compute(model, batch, opts, fast_stats=fast)


def time_all(arch: str, rounds: int, k: int) -> dict[str, list[float]]:
    model, batch = setup(arch)
    return interleave({m: method(model, batch, m, k) for m in METHODS}, rounds)


def peak_child(arch: str, name: str, k: int) -> None:
    model, batch = setup(arch)
    print(json.dumps(steady_peak(method(model, batch, name, k))))


def peak(arch: str, name: str, k: int) -> int:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, __file__, "--child", arch, name, str(k)],
                          capture_output=True, text=True, env=env, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        peak_child(args.child[0], args.child[1], int(args.child[2]))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, k={args.k}, "
          f"medians of {args.rounds} interleaved rounds; x floor = median per-round ratio\n")
    print("| model | B | method | time ms | x floor | peak MiB |")
    print("|---|---|---|---|---|---|")
    goals = []
    for arch in args.models.split(","):
        times = time_all(arch, args.rounds, args.k)
        for m in METHODS:
            print(f"| {arch} | {CASES[arch]} | {m} | {statistics.median(times[m]) * 1e3:.1f} | "
                  f"{ratio(times, m, 'floor'):.2f} | {peak(arch, m, args.k) / 2**20:.1f} |")  # type: ignore[arg-type]
        within = ratio(times, "projection", "floor")  # type: ignore[arg-type]
        faster = ratio(times, "materialise", "projection")  # type: ignore[arg-type]
        goals += [(f"{arch}: projection within 2x of the floor", within, within <= 2),
                  (f"{arch}: projection >= 5x faster than materialise-then-project", faster,
                   faster >= 5)]
    print("\n| goal | ratio | met |\n|---|---|---|")
    for text, value, met in goals:
        print(f"| {text} | {value:.2f} | {'yes' if met else 'NO'} |")


if __name__ == "__main__":
    main()
