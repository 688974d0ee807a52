"""Operations and peak memory per call: psgrad's statistics against a plain step, counted.

    python benchmarks/launches.py [--models gpt2,bert,resnet18] [--batch 4] [--seq 64]

At small batches on a GPU every call is bound by the host that launches its kernels (a plain
step of BERT-base at B=4 took 35 ms on an H200 for 1529 aten operations), so a statistic's time
there follows the number of operations it runs, whatever the GPU. This counts them on any
machine: the top-level aten operations of one warm call under ``torch.profiler`` (``ops``), and
those of them that compute, not only view or allocate (``compute``: what launches a kernel), for
one plain forward and backward (:func:`realsize.plain`) and for each statistic through
``engine.compute``, twice: with the pieces of per-sample gradients sized for a CPU's cache, and
sized as on an accelerator (:func:`tests.support.accelerator.sized_as_on_an_accelerator`:
pieces of a quarter of the memory budget, the whole layer where it fits, a mean's squared norm
over its parameters as one fused norm, convolutions' per-sample weight gradients with the batch
folded into groups, the CPU's fused numba loops off). The counts are the same on every run.
On the CPU's sizing the fused loops (``service/fast_stats/_kernels.py``) run outside aten and are
not counted. (Before 2026-11-29's evening the
plain step's eval-mode ``dropout`` and ``detach_`` counted as computing: GPT-2's 862, not 801,
BERT-base's 707, not 669.)

``peak`` is the most bytes that the call's tensors held at once above those held before it (the
profiler's allocation and free events, summed in order): what ``torch.cuda.max_memory_allocated``
reads on a GPU, here on any machine and without the allocator's caching or the kernel's pages.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realsize  # first: it turns on transparent huge pages before torch loads
import torch
from torch.profiler import ProfilerActivity, profile

from tests.support.accelerator import sized_as_on_an_accelerator

# what views, aliases or allocates, and launches no kernel on a GPU by itself (``dropout`` in
# eval mode answers its input; in training mode it calls what draws the mask, and counts)
NO_KERNEL = frozenset({
    "alias", "as_strided", "broadcast_tensors", "chunk", "contiguous", "detach", "detach_",
    "dropout", "empty",
    "empty_like", "empty_strided", "expand", "expand_as", "flatten", "lift_fresh", "narrow",
    "new_empty", "permute", "reshape", "resolve_conj", "resolve_neg", "select", "slice", "split",
    "squeeze", "t", "to", "transpose", "unbind", "unflatten", "unsqueeze", "view", "view_as",
    "_reshape_alias", "_unsafe_view",
})


def count(fn: Callable[[], Any]) -> tuple[int, int, int, collections.Counter[str]]:
    """One warm call's top-level aten operations, how many of them compute (they, or an
    operation they call, do more than view or allocate: a ``to`` or ``reshape`` that copies
    counts), its peak bytes (:func:`peak`) and the count of each operation."""
    fn()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    ops: collections.Counter[str] = collections.Counter()
    computing = 0
    for event in prof.events():
        parent = event.cpu_parent
        if event.name.startswith("aten::") and (
                parent is None or not parent.name.startswith("aten::")):
            ops[event.name.removeprefix("aten::")] += 1
            computing += _computes(event)
    return sum(ops.values()), computing, peak(prof), ops


def peak(prof: profile) -> int:
    """The most bytes held at once above the start, from the profile's allocations and frees
    in the order they happened."""
    results = prof.profiler.kineto_results if prof.profiler is not None else None
    assert results is not None, "read after the profile has run"
    events = sorted((e.start_ns(), e.nbytes())  # type: ignore[attr-defined]
                    for e in results.events() if e.name() == "[memory]")
    held = most = 0
    for _, nbytes in events:
        held += nbytes
        most = max(most, held)
    return most


def _computes(event: Any) -> bool:
    """Whether ``event`` or an operation below it does more than view or allocate."""
    return (event.name.removeprefix("aten::") not in NO_KERNEL
            or any(_computes(child) for child in event.cpu_children))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2,bert,resnet18")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--outputs", default=",".join(realsize.OUTPUTS))
    parser.add_argument("--top", type=int, default=0,
                        help="also list each call's N most frequent operations")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}; one warm call each, top-level aten operations "
          f"(compute: those that launch a kernel); B={args.batch}, T={args.seq}\n")
    print("| model | output | pieces sized for | ops | x plain | compute | x plain "
          "| peak MiB | x plain |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        registry, _ = realsize.register(realsize.make_case(name, 1, args.seq))
        case = realsize.make_case(name, args.batch, args.seq)
        base_ops, base_compute, base_peak, ops = count(realsize.plain(case))
        print(f"| {name} | plain step | | {base_ops} | 1.00 | {base_compute} | 1.00 | "
              f"{base_peak / 2**20:.0f} | 1.00 |")
        tops = {"plain": ops}
        for output in args.outputs.split(","):
            fn = realsize.psgrad(registry, case, output)
            for where in ("cpu", "accelerator"):
                with sized_as_on_an_accelerator() if where == "accelerator" else nullcontext():
                    n, computing, most, ops = count(fn)
                tops[f"{output}, {where}"] = ops
                print(f"| {name} | {output} | {where} | {n} | {n / base_ops:.2f} | "
                      f"{computing} | {computing / base_compute:.2f} | {most / 2**20:.0f} | "
                      f"{most / base_peak:.2f} |", flush=True)
        for label, ops in tops.items() if args.top else ():
            print(f"  {name} {label}: " + ", ".join(
                f"{op} {n}" for op, n in ops.most_common(args.top)))


if __name__ == "__main__":
    main()
