"""Freed memory kept or handed back: one worker's run of calls under each allocator setting.

For each model, a sequence of calls of several outputs and shapes (each twice: a new shape's
first call, then the same again) runs in a fresh process per setting of
``PSGRAD_KEEP_FREED_MEMORY``, applied as a worker process applies it as it starts, the calls in
a thread as a worker's loop runs them. It prints, side by side, each call's seconds, the
resident memory after it and the process's peak, then the totals (``service/process_env.py``;
docs/operations.md, "Memory a process keeps").

    python benchmarks/allocator.py --models bert --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# (batch, length, output): a worker's day in miniature, from small to large and back
CALLS = [(4, 64, "norms"), (4, 64, "variance"), (8, 128, "norms"), (2, 64, "grads"),
         (4, 256, "cosine_mean"), (32, 64, "norms"), (32, 64, "variance"), (4, 64, "norms"),
         (2, 32, "grads"), (16, 128, "variance"), (4, 64, "norms")]
GIB = 1 << 30


def resident() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / GIB


def child(args: argparse.Namespace) -> None:
    """One fresh process: every call's seconds and memory, printed as one JSON line."""
    from service.process_env import configure

    configure()  # as a worker process does first (PSGRAD_KEEP_FREED_MEMORY)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import realsize as rs

    from service import engine
    from service.fast_stats import warm_kernels
    from service.registration import register_exported
    from service.registry import ModelRegistry
    from service.strategies import per_sample

    settings = rs.raised(redis_url=None, data_dir=args.data_dir, device="cpu")
    rows: list[dict[str, Any]] = []

    def work() -> None:
        per_sample.warm_up()
        warm_kernels()
        registry = ModelRegistry(torch.device("cpu"))
        case = rs.make_case(args.model, 4, 64)
        register_exported(registry, case.name, Path(args.pt2).read_bytes(), settings,
                          default_loss=case.loss, losses=[])
        for batch, seq, output in CALLS:
            parsed = rs.request(registry, rs.make_case(args.model, batch, seq), output)
            call = rs.on_device(parsed.batch, torch.device("cpu"))
            times = []
            for _ in range(2):
                start = time.perf_counter()
                engine.compute(parsed.model, call, parsed.opts)
                times.append(time.perf_counter() - start)
            rows.append({"call": f"{batch}x{seq} {output}", "first_s": times[0],
                         "again_s": times[1], "resident_gib": resident(),
                         "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                         * 1024 / GIB})

    thread = threading.Thread(target=work)  # as a worker's loop runs its calls
    thread.start()
    thread.join()
    print(json.dumps(rows), flush=True)


def run_child(model: str, pt2: Path, keep: bool, work: Path,
              args: argparse.Namespace) -> list[dict[str, Any]]:
    data = work / f"data-{keep}"
    cmd = [sys.executable, __file__, "--child", "--model", model, "--pt2", str(pt2),
           "--data-dir", str(data), "--threads", str(args.threads)]
    env = {**os.environ, "PSGRAD_KEEP_FREED_MEMORY": str(keep).lower()}
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT, env=env)
    shutil.rmtree(data, ignore_errors=True)
    if done.returncode != 0:
        raise SystemExit(f"{model}: the child failed\n{done.stderr[-3000:]}")
    rows: list[dict[str, Any]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def compare(args: argparse.Namespace) -> None:
    """Each model exported once, run under each setting, printed side by side."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import realsize as rs

    work = Path(tempfile.mkdtemp(prefix="psgrad-allocator-"))
    print("# each call: first and again (s), resident memory after it and the peak so far "
          "(GiB); glibc's own settings | freed memory kept")
    try:
        for name in args.models.split(","):
            case = rs.make_case(name, 4, 64)
            pt2 = work / f"{name}.pt2"
            pt2.write_bytes(rs.export(case.module, tuple(v[:1] for v in case.inputs.values()),
                                      rs.MAX_LENGTH))
            glibc, kept = (run_child(name, pt2, keep, work, args) for keep in (False, True))
            print(f"\n{name}")
            for a, b in zip(glibc, kept, strict=True):
                print(f"  {a['call']:18s} {a['first_s']:6.2f} {a['again_s']:6.2f} "
                      f"{a['resident_gib']:5.2f} {a['peak_gib']:5.2f}  | {b['first_s']:6.2f} "
                      f"{b['again_s']:6.2f} {b['resident_gib']:5.2f} {b['peak_gib']:5.2f}")
            totals = [sum(r["first_s"] + r["again_s"] for r in rows) for rows in (glibc, kept)]
            print(f"  {'total':18s} {totals[0]:6.1f} s, peak {glibc[-1]['peak_gib']:.2f} GiB"
                  f"  | {totals[1]:6.1f} s, peak {kept[-1]['peak_gib']:.2f} GiB  "
                  f"({totals[1] / totals[0]:.2f}x the time)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="bert")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--pt2", help=argparse.SUPPRESS)
    parser.add_argument("--data-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    (child if args.child else compare)(args)


if __name__ == "__main__":
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    main()
