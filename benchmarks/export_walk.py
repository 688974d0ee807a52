"""The node walk that runs exported programs against the code torch.fx generates for the same graph.

    python benchmarks/export_walk.py [--rounds 5] [--models tiny-resnet,tiny-gpt2,resnet,gpt2]

psgrad runs a loaded program with :class:`service.export.interpreter.ExportedModule`, which
walks the checked graph node by node instead of ``exec``ing Python source generated from it
(what ``torch.fx.GraphModule`` does). This measures what that costs, on the models of
``benchmarks/export.py`` and two smaller ones from the tests (read in-process by
``read_program``, so no child process): for each,
``walk`` (``ExportedModule``) and ``fx`` (a ``GraphModule`` built here from the same graph and
tensors) time

- ``forward``: one sample, no gradient (where the walk's Python cost shows most), the mean
  of ``REPEAT`` calls;
- ``grads``: per-sample gradients of the batch, ``functional_call`` + ``vmap(grad)``.

One torch thread, and the clock is this process's CPU time (``time.process_time``), so that a
machine shared with other jobs slows both methods alike without adding its wait to either.
Rounds interleaved, medians, ``walk / fx`` the median of per-round ratios. Needs
``transformers`` for gpt2 and bert (installed with ``--no-deps``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.func import functional_call, grad, vmap

from service.export import ExportLimits, materialise, read_program

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export import Case, make_case, pt2  # the models and archives of benchmarks/export.py
from fast_stats import interleave, ratio  # rounds interleaved; median per-round ratios

REPEAT = 20  # forwards per timed call: one is too short to time on a shared machine


def load(name: str) -> tuple[Case, bytes]:
    """A model of ``benchmarks/export.py`` (resnet, gpt2, bert), or a test's smaller one
    (tiny-resnet: 3x8x8; tiny-gpt2: n_embd=64, T=8), whose ops are cheap enough for the walk
    to show."""
    if not name.startswith("tiny-"):
        case = make_case(name)
        return case, pt2(case)
    from tests.support.export import CASES, exported, exported_hf, token_batch

    if name == "tiny-resnet":
        module, data = exported("resnet")
        x, y = CASES["resnet"].example(8), CASES["resnet"].target(8)
        return Case(module, {"x": x}, y, "cross_entropy"), data
    module, data = exported_hf("gpt2")
    ids, mask = token_batch(8, 8)
    return Case(module, {"input_ids": ids, "attention_mask": mask}, ids, "next_token"), data


def per_sample(module: nn.Module, case: Case, params: dict[str, torch.Tensor],
               buffers: dict[str, torch.Tensor]) -> Callable[[], Any]:
    def one(p: dict[str, torch.Tensor], *sample: torch.Tensor) -> torch.Tensor:
        *inputs, y = sample
        out = functional_call(module, (p, buffers), tuple(x.unsqueeze(0) for x in inputs))
        if case.loss == "next_token":
            return F.cross_entropy(out[0, :-1], y[1:])
        return F.cross_entropy(out, y.reshape(1))

    fn = vmap(grad(one), in_dims=(None, *[0] * (len(case.inputs) + 1)))
    return lambda: fn(params, *case.inputs.values(), case.targets)


def time_model(name: str, rounds: int) -> tuple[dict[tuple[str, str], list[float]], int, int]:
    case, data = load(name)
    loaded = read_program(data, ExportLimits())
    walk = materialise(loaded, torch.device("cpu"))
    generated = fx.GraphModule(walk, walk.graph)  # the same graph and tensors, as fx's code
    params = {k: loaded.tensors[k] for k in loaded.params}
    buffers = {k: v for k, v in loaded.tensors.items() if k not in params}
    one = tuple(v[:1] for v in case.inputs.values())
    fns: dict[tuple[str, str], Callable[[], Any]] = {}
    for method, module in (("walk", walk), ("fx", generated)):
        fns[("forward", method)] = lambda m=module: [m(*one) for _ in range(REPEAT)]
        fns[("grads", method)] = per_sample(module, case, params, buffers)
    with torch.no_grad():
        torch.testing.assert_close(walk(*one), generated(*one), rtol=0, atol=0)
    a, b = fns[("grads", "walk")](), fns[("grads", "fx")]()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)
    return interleave(fns, rounds, time.process_time), len(walk.walk.steps), case.size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="tiny-resnet,tiny-gpt2,resnet,gpt2")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, CPU time, medians of {args.rounds} "
          "interleaved rounds\n")
    rows = ["| model | nodes | what | walk ms | fx ms | walk / fx | (walk - fx) / nodes, us |",
            "|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        times, nodes, size = time_model(name, args.rounds)
        for what in ("forward", "grads"):
            scale = REPEAT if what == "forward" else 1
            walk, gen = (statistics.median(times[(what, m)]) / scale for m in ("walk", "fx"))
            label = "forward, 1 sample" if what == "forward" else f"grads, B={size}"
            rows.append(f"| {name} | {nodes} | {label} | {walk * 1e3:.2f} | {gen * 1e3:.2f} | "
                        f"{ratio(times, (what, 'walk'), (what, 'fx')):.3f} | "
                        f"{(walk - gen) / nodes * 1e6:.2f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
