"""Recurrent layers: psgrad's hand-unrolled cells under vmap vs the stock layers' routes.

The stock ``nn.GRU``/``nn.RNN`` cannot go through ``vmap(grad)`` in torch 2.13, so they take the
per-sample loop; ``nn.LSTM`` goes through vmap's slow fallback. ``models.recurrent`` unrolls the
same equations with the same parameters so that vmap batches them. Same process, same round,
medians of repeated runs, ratios printed (the machine is shared: compare ratios, not times).

    python benchmarks/recurrent.py [--batch 64] [--steps 16] [--repeats 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import warnings

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch
from torch import nn

from models.base import ModelFamily, TensorSpec, register_model
from service import engine
from service.registry import LoadedModel, load_model

FEATURES, HIDDEN = 16, 32


def _stock(cls: type[nn.RNNBase]) -> type[nn.Module]:
    class First(cls):  # type: ignore[valid-type,misc]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x)[0][:, -1]

    return First


def _family(kind: str, stock: bool, steps: int) -> str:
    name = f"bench-{kind.lower()}-{'stock' if stock else 'unrolled'}"

    class Family(ModelFamily):
        def build(self, config: dict) -> nn.Module:
            if stock:
                rnn = _stock(getattr(nn, kind))(FEATURES, HIDDEN, batch_first=True)
                return nn.Sequential(rnn, nn.Linear(HIDDEN, 4))
            from models.sequential import SequentialFamily

            spec = SequentialFamily().config({
                "layers": [{"type": kind, "args": [FEATURES, HIDDEN]},
                           {"type": "SelectStep", "kwargs": {"index": -1}},
                           {"type": "Linear", "args": [HIDDEN, 4]}],
                "input": {"shape": [steps, FEATURES]}})
            return SequentialFamily().build(spec)

        def input_spec(self, config: dict) -> TensorSpec:
            return TensorSpec((steps, FEATURES))

    Family.name = name
    register_model(Family)
    return name


def _time(models: list[LoadedModel], batch: engine.Batch, repeats: int) -> list[float]:
    """Median ms per model, the models interleaved in every round so load hits both alike."""
    runs = []
    for model in models:
        opts = engine.Options(loss="cross_entropy", outputs=("norms",),
                              params=tuple(model.params))
        engine.compute(model, batch, opts)  # warm-up
        runs.append((model, opts))
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats):
        for i, (model, opts) in enumerate(runs):
            start = time.perf_counter()
            engine.compute(model, batch, opts)
            times[i].append(time.perf_counter() - start)
    return [statistics.median(t) * 1000 for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    gen = torch.Generator().manual_seed(0)
    batch = engine.Batch(inputs=torch.randn(args.batch, args.steps, FEATURES, generator=gen),
                         targets=torch.randint(0, 4, (args.batch,), generator=gen))
    print(f"torch {torch.__version__}, B={args.batch}, T={args.steps}, features={FEATURES}, "
          f"hidden={HIDDEN}, medians of {args.repeats}")
    for kind in ("RNN", "GRU", "LSTM"):
        stock = load_model("s", _family(kind, True, args.steps))
        if kind == "LSTM":
            stock.route = "vmap"  # torch batches LSTM through a slow fallback; measure that
        unrolled = load_model("u", _family(kind, False, args.steps))
        t_stock, t_unrolled = _time([stock, unrolled], batch, args.repeats)
        print(f"{kind:5s} stock ({stock.route}) {t_stock:8.1f} ms   unrolled ({unrolled.route}) "
              f"{t_unrolled:8.1f} ms   ratio {t_stock / t_unrolled:5.2f}x")


if __name__ == "__main__":
    main()
