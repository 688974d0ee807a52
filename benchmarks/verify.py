"""What ``verify`` costs: the worker's verification against the engine call it checks.

    python benchmarks/verify.py [--rounds 5] [--threads 1]

For each case (model, batch, output) the engine call and the verification of its answer with
``k`` samples (:func:`service.verify.check`, as the worker runs it: the per-sample autograd loop
on ``k`` samples, and for statistics one more engine call on them) run interleaved in this
process, on ``--threads`` torch threads. Both are timed in CPU seconds of this process (on a
shared, oversubscribed machine the wall clock mostly measures the wait for a core); medians over
rounds, and the verification's cost as a fraction of the engine call's (median of per-round
ratios). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import torch

from service import engine
from service.config import Settings
from service.engine import Options
from service.registry import load_model
from service.validate import ParsedRequest
from service.verify import Plan, check

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: from the root
from tests.support.batches import make_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_stats import interleave, ratio  # rounds interleaved; median per-round ratios

CASES = [  # (model, config, batch size, output, k)
    ("simple-cnn", {}, 64, "norms", 1),
    ("simple-cnn", {}, 64, "norms", 8),
    ("simple-cnn", {}, 64, "grads", 1),
    ("simple-cnn", {}, 64, "clipped_mean", 1),
    ("mlp", {}, 256, "norms", 1),
    ("mlp", {}, 256, "clipped_mean", 1),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = Settings()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{args.rounds} interleaved rounds, CPU ms\n")
    print("| model | B | output | k | engine ms | verify ms | verify / engine |")
    print("|---|---|---|---|---|---|---|")
    for arch, config, n, output, k in CASES:
        model = load_model(arch, arch, config, device=torch.device("cpu"))
        batch = make_batch(model, n, 0, reference=False)
        opts = Options(model.default_loss, (output,), tuple(model.params), clip_norm=1.0)
        parsed = ParsedRequest(model, opts, batch)
        answer: dict[str, Any] = engine.compute(model, batch, opts)[0]
        how = Plan(k, 0, "request")
        times = interleave({
            "engine": lambda: engine.compute(model, batch, opts),  # noqa: B023
            "verify": lambda: check(parsed, answer, how, settings=settings),  # noqa: B023
        }, args.rounds, clock=time.process_time)
        ms = {key: statistics.median(v) * 1000 for key, v in times.items()}
        print(f"| {arch} | {n} | {output} | {k} | {ms['engine']:.1f} | {ms['verify']:.1f} | "
              f"{ratio(times, 'verify', 'engine'):.2f} |")  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
