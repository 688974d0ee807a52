"""Fast statistics' per-sample pieces at each height, against the weight-gradient GEMM.

    python benchmarks/pieces.py [--batch 32] [--seq 64] [--heights 64:4,128:8] [--rounds 3]
                                [--shapes 768x768,768x3072,3072x768] [--loops fused,eager]
                                [--dtype float32]

A linear layer's ``variance``, ``dots`` (M=2) and the norms-and-dots-with-the-sum of
``cosine_mean`` over T positions build every sample's ``G_i^T A_i`` a piece at a time
(:meth:`service.fast_stats._outer.OuterSource.pieces`): a piece holds at least
``TUNING.min_rows`` output rows, then as many samples as ``TUNING.piece_bytes`` holds. For
BERT-base's three layer shapes (768x768, 768->3072, 3072->768; ``--shapes`` takes others as
``dxp``: ResNet-18's 7x7 layers, unfolded, are ``4608x512`` at ``--seq 49``) with random inputs
and output gradients, this prints
the GFLOP/s of the batched matmul alone at each height, and each statistic's time over the layers
divided by the weight-gradient GEMM's (one ``G^T A`` over every row: what a plain step pays for
these layers' weights). One torch thread, this process's CPU time, the best of ``--rounds``.
A height is ``rows:MiB``. ``--loops``: the passes over each piece by the CPU's fused loops
(``service/fast_stats/_kernels.py``), by torch's eager operations, or both side by side.
``--dtype bfloat16`` (or float16): the inputs, output gradients and pieces in that dtype, which
the loops take a slab at a time in float32.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from service.fast_stats import TUNING
from service.fast_stats._budget import Budget
from service.fast_stats._source import SourceContext
from service.fast_stats.families.linear import LinearSource

SHAPES = ((768, 768), (768, 3072), (3072, 768))  # (d, p): BERT-base's linear layers


def layer(a: torch.Tensor, g: torch.Tensor) -> LinearSource:
    """psgrad's source for one linear layer's inputs ``[B, T, d]`` and output gradients
    ``[B, T, p]``, as a captured call gives them."""
    batch, p, d = a.shape[0], g.shape[-1], a.shape[-1]
    ctx = SourceContext(batch=batch, budget=Budget(1 << 30), shapes={"weight": torch.Size((p, d))},
                        params={}, buffers={}, dtype=a.dtype, device=a.device,
                        activation_numel=0)
    return LinearSource("weight", a, g, ctx)


def build(source: LinearSource) -> None:
    """The pieces' batched matmuls alone."""
    for _ in source.pieces(0, source.batch):
        pass


def cpu(fn: Callable[[], object], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--heights", default="64:4,128:8,256:16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shapes", default=",".join(f"{d}x{p}" for d, p in SHAPES),
                        help="layers as d x p (inputs x outputs), comma-separated")
    parser.add_argument("--loops", default="fused,eager",
                        help="the passes over a piece: fused (numba's loops), eager, or both")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    b, t = args.batch, args.seq
    layers = [layer(torch.randn(b, t, d).to(dtype), torch.randn(b, t, p).to(dtype))
              for d, p in shapes]
    refs = [torch.randn(2, p, d).to(dtype) for d, p in shapes]
    flops = sum(2 * b * t * d * p for d, p in shapes)
    gemm = cpu(lambda: [x.g.reshape(-1, x.p).t() @ x.a.reshape(-1, x.d) for x in layers],
               args.rounds)
    print(f"torch {torch.__version__}, 1 thread, {args.dtype}, B={b} T={t}, layers "
          f"{', '.join(f'{d}->{p}' for d, p in shapes)}; weight-gradient GEMM "
          f"{flops / gemm / 1e9:.0f} GFLOP/s ({gemm * 1e3:.0f} ms)")
    print("| rows | MiB | loops | build GFLOP/s | variance x GEMM | dots x GEMM | cosine x GEMM |")
    print("|---|---|---|---|---|---|---|")
    for height in args.heights.split(","):
        rows, mib = (int(v) for v in height.split(":"))
        TUNING.min_rows, TUNING.piece_bytes = rows, mib << 20
        for loops in args.loops.split(","):
            TUNING.fused = loops == "fused"
            times = [cpu(lambda f=f: [f(x, r) for x, r in zip(layers, refs, strict=True)],
                         args.rounds)
                     for f in (lambda x, r: build(x), lambda x, r: x.moments(0, b),
                               lambda x, r: x.dots(r), lambda x, r: x._sq_and_cos(0, b))]
            print(f"| {rows} | {mib} | {loops} | {flops / times[0] / 1e9:.0f} | "
                  f"{times[1] / gemm:.2f} | {times[2] / gemm:.2f} | {times[3] / gemm:.2f} |")


if __name__ == "__main__":
    main()
