"""Full per-sample gradients: the tutorial's vmap(grad), BackPACK and psgrad's engine, interleaved.

    python benchmarks/grads.py [--cases simple-cnn:256,mlp:1024] [--rounds 7] [--threads N]
                               [--device cuda]

The ``grads`` output only, in one process, for compare.py's cases (the same seeded data and
method code, from ``compare_methods``): each method is prepared and called once, then timed in
rounds that interleave the methods so that they share the machine's load alike. After each call
the process hands freed memory back (``malloc_trim``, untimed), so every call pays its own page
faults, as in compare.py. Prints each method's median, its time divided by vmap's and by
BackPACK's in the same round (the medians of those ratios, which a shared machine's changing
load moves less than the times) and its median user CPU time (all threads; what the load moves
least, though threads that spin waiting for each other count too; the system time of the page
faults, which swings the most on a shared virtual machine, is left out). compare.py is the full
comparison (peak memory, agreement with the per-sample loop, every method and output); this is
the quick check of the grads path, and with ``versus.py --head-script`` an A/B of it against
another revision.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import resource
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compare_methods as cm

from service.registry import set_tf32

CASES = "simple-cnn:64,simple-cnn:256,mlp:256,mlp:1024,tiny-transformer:64,value-mlp:4096"
METHODS = ("vmap", "backpack", "psgrad-engine")


def _user() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def _trim() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def bench(case: cm.Case, rounds: int, device: torch.device
          ) -> list[tuple[str, str, float, float, float | None, float]]:
    """(case, method, median ms, median ratio to vmap and to BackPACK (None where BackPACK
    does not apply), median user CPU ms) for each method that applies; on CUDA each call is
    timed to the end of its kernels."""
    s = cm.setup(case, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    calls = {}
    for method in METHODS:
        fn = cm.IN_PROCESS[method](s, "grads", 1.0)
        # the first call warms (plans, per-sample functions); one that raises does not apply
        if not isinstance(fn, cm.NotApplicable) and not isinstance(cm.first_call(fn),
                                                                   cm.NotApplicable):
            calls[method] = fn
        _trim()
    times: dict[str, list[float]] = {m: [] for m in calls}
    user: dict[str, list[float]] = {m: [] for m in calls}
    for _ in range(rounds):
        for method, fn in calls.items():
            start, start_user = time.perf_counter(), _user()
            fn()
            sync()
            times[method].append(time.perf_counter() - start)
            user[method].append(_user() - start_user)
            _trim()
    rows = []
    for method, ts in times.items():
        to_backpack = paired(ts, times["backpack"]) if "backpack" in times else None
        rows.append((case.label, method, 1000 * statistics.median(ts),
                     paired(ts, times["vmap"]), to_backpack,
                     1000 * statistics.median(user[method])))
    return rows


def paired(ts: list[float], others: list[float]) -> float:
    """The median of the per-round ratios: what a shared machine's changing load moves least."""
    return statistics.median(t / o for t, o in zip(ts, others, strict=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=CASES, help="arch:batch,... (compare.py's cases)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per case")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = parser.parse_args()
    warnings.simplefilter("ignore")  # library deprecation chatter
    if args.threads:
        torch.set_num_threads(args.threads)
    set_tf32(False)  # float32 on CUDA for every method, as psgrad's workers run
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}, {args.rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f}, device {args.device}"
          + (f" ({torch.cuda.get_device_name()})" if args.device == "cuda" else "") + "\n",
          file=sys.stderr)
    print("| case | method | median ms | ÷ vmap | ÷ BackPACK | user ms |\n"
          "|---|---|---:|---:|---:|---:|")
    for text in args.cases.split(","):
        arch, batch = text.split(":")
        for case, method, ms, *ratios, cpu_ms in bench(cm.Case(arch, int(batch)), args.rounds,
                                                       torch.device(args.device)):
            cells = " | ".join("" if r is None else f"{r:.2f}" for r in ratios)
            print(f"| {case} | {method} | {ms:.1f} | {cells} | {cpu_ms:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
