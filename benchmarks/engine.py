"""Engine speed: the per-sample loop, the engine, and the batched floor, side by side.

For the PyTorch tutorial's CNN (``simple-cnn``, B=64) and the default ``mlp`` (784-512-512-10,
B=256) on the local device (CUDA when available), four ways to get gradients of the same batch:

- ``loop``: the per-sample loop (batch of one, ``torch.autograd.grad``), the tutorial's baseline;
- ``engine grads``: :func:`service.engine.compute` with ``outputs=("grads",)`` (vmap(grad));
- ``engine norms``: the same call asking only for ``norms`` (fast statistics when the model
  allows them, the default), and ``engine norms (vmap)`` with ``fast_stats=False``;
- ``floor``: one plain batched forward + backward of the mean loss (the mean gradient only): the
  floor that per-sample work cannot beat by much.

Methods run interleaved, round after round, after a warm-up, so they share the machine's load;
the table gives medians and ratios from the same run. ``THP_MEM_ALLOC_ENABLE=1`` (transparent
huge pages for CPU tensors) is set before torch is imported, as workers run; ``--no-thp`` runs
without it for comparison (docs/benchmarks-engine.md gives both).

    python benchmarks/engine.py [--repeats 15] [--no-thp] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

CASES = (("simple-cnn", 64), ("mlp", 256))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds per method")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--no-thp", action="store_true",
                        help="run without THP_MEM_ALLOC_ENABLE=1 (to compare)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (default: torch's own choice)")
    args = parser.parse_args(argv)
    # Before torch is imported: the allocator reads it once.
    os.environ["THP_MEM_ALLOC_ENABLE"] = "0" if args.no_thp else "1"
    import torch

    from service.registry import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)

    device = resolve_device("auto")
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"THP_MEM_ALLOC_ENABLE={os.environ['THP_MEM_ALLOC_ENABLE']}, "
          f"{args.repeats} rounds (medians)\n", file=sys.stderr)
    rows = []
    for name, size in CASES:
        rows.extend(bench(name, size, device, args.repeats, args.warmup))
    print(table(rows))
    return 0


def bench(name: str, size: int, device: Any, repeats: int, warmup: int
          ) -> list[dict[str, Any]]:
    import torch
    import torch.nn.functional as F

    from service import engine
    from service.engine import Batch, Options
    from service.registry import load_model

    model = load_model(name, name, device=device)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((size, *model.input.shape), generator=gen).to(device)
    y = torch.randint(0, model.output_shape[-1], (size,), generator=gen).to(device)
    batch = Batch(inputs=x, targets=y)
    loss_fn = F.nll_loss if model.default_loss == "nll" else F.cross_entropy
    every = tuple(model.params)
    module = model.module
    params = [p.detach().clone().requires_grad_(True) for p in model.params.values()]
    named = dict(zip(model.params, params, strict=True))

    def forward(inputs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.func.functional_call(module, (named, model.buffers), (inputs,))
        return out

    def loop() -> Any:
        return [torch.autograd.grad(loss_fn(forward(x[i : i + 1]), y[i : i + 1]), params)
                for i in range(size)]

    def floor() -> Any:
        return torch.autograd.grad(loss_fn(forward(x), y), params)

    def call(outputs: tuple[str, ...], fast: bool = True) -> Callable[[], Any]:
        opts = Options(loss=model.default_loss, outputs=outputs, params=every)
        return lambda: engine.compute(model, batch, opts, fast_stats=fast)

    methods: dict[str, Callable[[], Any]] = {
        "loop": loop,
        "engine grads": call(("grads",)),
        "engine norms": call(("norms",)),
        "engine norms (vmap)": call(("norms",), fast=False),
        "floor": floor,
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    for round_ in range(warmup + repeats):
        for label, fn in methods.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if round_ >= warmup:
                times[label].append(time.perf_counter() - start)
            del result
    medians = {k: statistics.median(v) for k, v in times.items()}
    label = f"{name} B={size}"
    return [{"case": label, "method": k, "ms": 1000 * t, "floor": t / medians["floor"],
             "loop": medians["loop"] / t} for k, t in medians.items()]


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | method | median ms | x floor | speed-up vs loop |",
             "|---|---|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['method']} | {r['ms']:.1f} | {r['floor']:.2f} | "
              f"{r['loop']:.2f} |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
