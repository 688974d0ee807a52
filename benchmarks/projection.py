"""Sketches (``projection``, k = 1024) against materialise-then-project, full per-sample
gradients and a plain forward+backward.

    python benchmarks/projection.py [--rounds 5] [--models simple-cnn,tiny-transformer] [--k 1024]
                                    [--threads N] [--clock wall|cpu]

For ``simple-cnn`` at B=256 and ``tiny-transformer`` at B=64, interleaved in each round:

- ``floor``: one plain batched forward+backward (the parameters' batch gradients);
- ``pass``: the fast path's own forward and backward (to the captured layers' outputs) with no
  sketch: what ``projection`` cannot go below, since every sketch needs those gradients;
- ``projection``: sketches on the fast path, of the default kind (TensorSketch: Linear and
  Embedding weights sketched from their inputs and output gradients by count sketches and FFTs,
  layers with many positions and a small matrix, such as convolutions, from their per-sample
  gradients built a chunk of samples at a time and scattered into the k buckets);
- ``kronecker``: the same with ``projection_kind`` ``kronecker`` (two small GEMMs and a batched
  one per layer, no per-sample gradient; less accurate);
- ``materialise``: materialise-then-project, the ``vmap`` path: every per-sample gradient (a
  chunk at a time, as the engine sizes them), then projected with the same matrices;
- ``fast-materialise``: the fast path's per-sample gradients (``grads``: one batched matmul per
  layer), then the same matrices: materialising as cheaply as this service can;
- ``dense-materialise``: materialise-then-project as TRAK and dattri do it: the ``vmap``
  path's per-sample gradients, flattened, times one dense Gaussian ``[P, k]`` matrix over all
  parameters (drawn once, on the warm-up call, and kept: the baseline at its cheapest; TRAK's
  CPU projector draws its blocks again on every call). A different projection from the
  service's, with the same guarantee for dense entries;
- ``grads``: the per-sample gradients themselves (``vmap``).

Times are medians over the rounds; ``x floor`` is the median of the per-round ratios (each
compares runs made moments apart, which our shared machine needs) with their range over the
rounds beside it: a median time need not be the median ratio times the median floor when the
load changes between rounds. Peak memory is the resident-set high-water mark of one warm call in
a fresh subprocess, as in ``benchmarks/fast_stats.py``. ``--clock cpu`` times the process's
CPU time instead of the wall clock: with ``--threads 1``, the work without the waits for a core
that a loaded machine adds (most at every parallel op). Prints the load average and a Markdown
table, whether the goals are met (within 2x of the floor, at least 5x faster than
materialise-then-project, with the same matrices and with a dense one) and the most the
same-matrices goal allows: materialise-then-project over ``pass``. The dense baseline's peak
memory leaves out its kept matrix (``4 P k`` bytes: 4.9 GB for simple-cnn at k = 1024).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import torch
from fast_stats import interleave, setup, steady_peak
from fast_stats import method as plain_method

from service import engine
from service.engine import Batch, Options
from service.fast_stats._plan import plan_for
from service.fast_stats._run import Setup, forward_backward
from service.registry import LoadedModel
from service.strategies.projection import KRONECKER, Projection

CASES = {"simple-cnn": 256, "tiny-transformer": 64}
METHODS = ("floor", "pass", "projection", "kronecker", "materialise", "fast-materialise",
           "dense-materialise", "grads")


def method(model: LoadedModel, batch: Batch, name: str, k: int) -> Callable[[], Any]:
    if name == "floor":
        fn = plain_method(model, batch, "floor", "norms")
        assert fn is not None
        return fn
    projection = Projection(k, 0, KRONECKER) if name == "kronecker" else Projection(k, 0)
    opts = Options(loss=model.default_loss, outputs=("projection",), params=tuple(model.params),
                   projection=projection)
    if name == "pass":
        return lambda: _pass(model, batch, opts)
    if name in ("grads", "fast-materialise"):
        grads = Options(loss=model.default_loss, outputs=("grads",), params=tuple(model.params))
        fast = name == "fast-materialise"

        def materialised() -> Any:
            [got] = engine.compute(model, batch, grads, fast_stats=fast)
            if not fast:
                return got
            out = torch.zeros(batch.size, k)
            projection.project_many(got["grads"], out)
            return out

        return materialised
    if name == "dense-materialise":
        return _dense_materialise(model, batch, k)
    fast = name in ("projection", "kronecker")
    return lambda: engine.compute(model, batch, opts, fast_stats=fast)


def _dense_materialise(model: LoadedModel, batch: Batch, k: int) -> Callable[[], Any]:
    """Per-sample gradients (vmap), then each parameter's flattened gradient times its rows of
    one dense Gaussian ``[P, k] / sqrt(k)``, summed into ``[B, k]``."""
    grads = Options(loss=model.default_loss, outputs=("grads",), params=tuple(model.params))
    gen = torch.Generator().manual_seed(0)
    dense: dict[str, torch.Tensor] = {}

    def run() -> Any:
        [got] = engine.compute(model, batch, grads, fast_stats=False)
        out = torch.zeros(batch.size, k)
        for name, g in got["grads"].items():
            flat = g.reshape(batch.size, -1)
            if name not in dense:  # the first (untimed) call draws the matrix
                dense[name] = torch.randn(flat.shape[1], k, generator=gen) / k ** 0.5
            out.addmm_(flat, dense[name])
        return out

    return run


def _pass(model: LoadedModel, batch: Batch, opts: Options) -> Any:
    """The fast path's forward and backward, as ``projection`` runs them, and nothing else."""
    call = engine.prepare(model, batch, opts, [batch.size])
    pass_setup = Setup(model, call.params, call.samples, opts.loss, opts.gamma, call.selected)
    plan = plan_for(pass_setup)
    assert plan is not None, "this model takes the fast path"
    return forward_backward(pass_setup, plan)


def ratios(times: dict[str, list[float]], key: str, base: str) -> list[float]:
    return [a / b for a, b in zip(times[key], times[base], strict=True)]


def peak_child(arch: str, name: str, k: int) -> None:
    model, batch = setup(arch)
    print(json.dumps(steady_peak(method(model, batch, name, k))))


def peak(arch: str, name: str, k: int, threads: int) -> int:
    env = {**os.environ, "THP_MEM_ALLOC_ENABLE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"}
    done = subprocess.run([sys.executable, __file__, "--threads", str(threads), "--child", arch,
                           name, str(k)], capture_output=True, text=True, env=env, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1]))


def load() -> str:
    return "load average " + ", ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--methods", default=",".join(METHODS),
                        help="a subset of " + ",".join(METHODS) + " (floor always runs)")
    parser.add_argument("--k", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: the process's CPU time (with --threads 1, the work itself, "
                        "without the waits for a core on a loaded machine)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child:
        peak_child(args.child[0], args.child[1], int(args.child[2]))
        return
    methods = ["floor", *(m for m in METHODS if m != "floor" and m in args.methods.split(","))]
    print(f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} cores, "
          f"{args.clock} clock, "
          f"k={args.k}, medians of {args.rounds} interleaved rounds; x floor = median per-round "
          f"ratio (range over the rounds)\n")
    print("| model | B | method | time ms | x floor | range | peak MiB |")
    print("|---|---|---|---|---|---|---|")
    goals, bounds, notes = [], [], []
    for arch in args.models.split(","):
        model, batch = setup(arch)
        before = load()
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        times = interleave({m: method(model, batch, m, args.k) for m in methods}, args.rounds,
                           clock)
        notes.append(f"{arch}: {before} before, {load()} after")
        for m in methods:
            r = ratios(times, m, "floor")
            print(f"| {arch} | {CASES[arch]} | {m} | {statistics.median(times[m]) * 1e3:.1f} | "
                  f"{statistics.median(r):.2f} | {min(r):.2f}-{max(r):.2f} | "
                  f"{peak(arch, m, args.k, args.threads) / 2**20:.1f} |")
        if "projection" in times:
            within = statistics.median(ratios(times, "projection", "floor"))
            goals.append((f"{arch}: projection within 2x of the floor", within, within <= 2))
        if "kronecker" in times:
            within = statistics.median(ratios(times, "kronecker", "floor"))
            goals.append((f"{arch}: kronecker within 2x of the floor", within, within <= 2))
        if "projection" in times and "materialise" in times:
            faster = statistics.median(ratios(times, "materialise", "projection"))
            goals.append((f"{arch}: projection >= 5x faster than materialise-then-project "
                          "with the same matrices", faster, faster >= 5))
        if "projection" in times and "dense-materialise" in times:
            faster = statistics.median(ratios(times, "dense-materialise", "projection"))
            goals.append((f"{arch}: projection >= 5x faster than materialise-then-project "
                          "with a dense projection (TRAK's, dattri's)", faster, faster >= 5))
        if "pass" in times and "materialise" in times:
            bound = statistics.median(ratios(times, "materialise", "pass"))
            bounds.append(f"{arch}: materialise-then-project / pass = {bound:.2f}, the most "
                          f"any sketch needing the output gradients could gain over it")
    print("\n| goal | ratio | met |\n|---|---|---|")
    for text, value, met in goals:
        print(f"| {text} | {value:.2f} | {'yes' if met else 'NO'} |")
    print("\n" + "\n".join(bounds + notes))
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    if busy and args.clock == "wall":
        print(f"\nmore runnable threads than {os.cpu_count()} cores: wall-clock times include "
              "the waits for a core, more of them the more parallel ops a method runs; "
              "--threads 1 --clock cpu measures the work alone")


if __name__ == "__main__":
    main()
