"""The digits mislabel task of ``examples/find_mislabelled.py`` with dattri's TracIn, in process.

dattri is not a dependency: install it beside torch without letting pip touch torch, e.g.
``pip install --no-deps --target /tmp/dattri dattri`` and run with ``PYTHONPATH=/tmp/dattri``.
Same data, same trained weights; self-influence (``self_attribute``) and the summed influence on
the validation set (``attribute``), exact (no projector: dattri's ``layer_name=None`` with
``proj_dim`` at the gradient size is not offered, so projections only) at each k.

    python benchmarks/dattri_digits.py [--train 1400 --val 397]
"""

from __future__ import annotations

import argparse
import importlib.util
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

spec = importlib.util.spec_from_file_location(
    "find_mislabelled", Path(__file__).parents[1] / "examples" / "find_mislabelled.py")
assert spec is not None and spec.loader is not None
example: Any = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def main() -> None:
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.task import AttributionTask

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--train", type=int, default=800)
    parser.add_argument("--val", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--dims", default="256,1024,4096")
    args = parser.parse_args()
    x_train, y_train, x_val, y_val, flipped = example.digits_data(args.train, args.val)
    weights = {k: torch.tensor(v) for k, v in example.train(x_train, y_train,
                                                            args.epochs).items()}
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    net.load_state_dict({k.replace("fc1", "0").replace("fc2", "2"): v
                         for k, v in weights.items()})

    def loss(params: dict[str, torch.Tensor], data: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = data
        out = torch.func.functional_call(net, params, x.unsqueeze(0))
        return nn.functional.cross_entropy(out, y.unsqueeze(0))

    task = AttributionTask(loss_func=loss, model=net, checkpoints=net.state_dict())
    train = DataLoader(TensorDataset(torch.tensor(x_train), torch.tensor(y_train)),
                       batch_size=64, shuffle=False)
    val = DataLoader(TensorDataset(torch.tensor(x_val), torch.tensor(y_val)), batch_size=64,
                     shuffle=False)
    n = len(flipped)
    print(f"dattri TracIn, digits {args.train}/{args.val}, {n} flipped")
    for k in [int(d) for d in args.dims.split(",")]:
        attributor = TracInAttributor(task=task, weight_list=torch.ones(1),
                                      normalized_grad=False,
                                      projector_kwargs={"proj_dim": k, "device": "cpu"})
        start = time.perf_counter()
        self_inf = attributor.self_attribute(train).numpy()
        val_inf = attributor.attribute(train, val).sum(1).numpy()
        seconds = time.perf_counter() - start
        print(f"k={k:>5}  P@{n} self {example.precision(self_inf, flipped, largest=True):.3f}"
              f"  P@{n} val {example.precision(val_inf, flipped, largest=False):.3f}"
              f"  {seconds:.2f} s")


if __name__ == "__main__":
    main()
