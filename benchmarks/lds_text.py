"""Attribution quality on text: the LDS of a small character language model.

    python benchmarks/lds_text.py [--models 50] [--train 1500] [--test 100] [--epochs 300]
                                  [--dims 1024,4096] [--seed 0] [--kronfluence] [--exported]

The corpus is Python's own documentation as the interpreter ships it (``pydoc_data.topics``,
about 465,000 characters; nothing is downloaded): lowercased, its 47 most frequent characters
kept and every other one mapped to one more symbol. A sample is a window of 8 characters and
its target the character that follows. The model is a zoo ``sequential`` network, Bengio et
al.'s neural language model at character scale: ``Embedding(48, 8)``, ``Flatten``,
``Linear(64, 48)``, ``Tanh``, ``Linear(48, 48)`` (5,856 parameters, so stores of full gradients
hold it). It is trained on ``--train`` windows and again on ``--models`` random halves of them
(full-batch Adam, ``--epochs`` steps, seeded); each retrained model's margins on ``--test``
held-out windows are the truth, as in ``benchmarks/lds.py``, whose LDS, overlap and scores this
script reuses: exact ``dot`` and ``trak`` (the stores' default lambda), K-FAC and EK-FAC exact
and sketched at each k of ``--dims`` (the embedding gets its diagonal Fisher), exact on the
true Fisher (labels drawn from the model, as ``benchmarks/lds.py`` says), and with
``--kronfluence`` Kronfluence's EK-FAC and K-FAC on the same model. ``--exported`` adds exact
K-FAC and EK-FAC of the same trained model exported (``torch.export``) and registered as a
program, whose layers the curvature finds in its graph (``aten.linear``) instead of its modules.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import time
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import pydoc_data.topics

import numpy as np
import torch
from lds import curvature_scores, kronfluence_scores, print_table, retrained  # beside it

from service.config import Settings
from service.registration import register_exported
from service.registry import LoadedModel, ModelRegistry, load_model

WINDOW, SYMBOLS, WIDTH, HIDDEN = 8, 48, 8, 48
CONFIG: dict[str, Any] = {
    "input": {"shape": [WINDOW], "dtype": "int64", "high": SYMBOLS},
    "layers": [
        {"type": "Embedding", "args": [SYMBOLS, WIDTH]},
        {"type": "Flatten"},
        {"type": "Linear", "args": [WINDOW * WIDTH, HIDDEN]},
        {"type": "Tanh"},
        {"type": "Linear", "args": [HIDDEN, SYMBOLS]},
    ],
}


def corpus() -> np.ndarray:
    """The documentation's characters as symbols 0 .. SYMBOLS - 1 (the last: any other)."""
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    text = text.lower()
    kept = [c for c, _ in collections.Counter(text).most_common(SYMBOLS - 1)]
    code = {c: i for i, c in enumerate(kept)}
    return np.array([code.get(c, SYMBOLS - 1) for c in text], dtype=np.int64)


def data(n_train: int, n_test: int, seed: int) -> tuple[np.ndarray, ...]:
    symbols = corpus()
    starts = np.random.default_rng(seed).choice(len(symbols) - WINDOW, n_train + n_test,
                                                replace=False)
    x = np.stack([symbols[s:s + WINDOW] for s in starts])
    y = symbols[starts + WINDOW]
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def build() -> torch.nn.Module:
    module = load_model("lm", "sequential", CONFIG, device=torch.device("cpu")).module
    return module.requires_grad_(True)


def train(x: np.ndarray, y: np.ndarray, epochs: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = build()
    for p in net.parameters():  # a fresh draw per seed (the zoo's own init is fixed)
        torch.nn.init.normal_(p, std=0.3)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xt), yt).backward()
        opt.step()
    return net.eval()


def exported(net: torch.nn.Module, example: np.ndarray) -> LoadedModel:
    """``net`` exported and registered as a program (``PUT /models/{id}`` with a ``.pt2``)."""
    buf = io.BytesIO()
    torch.export.save(torch.export.export(net.eval(), (torch.from_numpy(example),)), buf)
    registry = ModelRegistry(torch.device("cpu"))
    return register_exported(registry, "lm-program", buf.getvalue(), Settings(device="cpu"),
                             default_loss="cross_entropy", losses=[])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--train", type=int, default=1500)
    ap.add_argument("--test", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=300)
    ap.add_argument("--dims", default="1024,4096")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--exported", action="store_true",
                    help="also the exact scores of the trained model as an exported program")
    ap.add_argument("--kronfluence", action="store_true",
                    help="also Kronfluence's EK-FAC and K-FAC (installed with --no-deps, e.g. "
                    "PYTHONPATH=/tmp/kron)")
    args = ap.parse_args()
    x, y, tx, ty = data(args.train, args.test, args.seed)
    dims = [int(d) for d in args.dims.split(",") if d]
    t = time.perf_counter()
    net = train(x, y, args.epochs, args.seed)
    masks, actual = retrained(train, x, y, tx, ty, args)
    with torch.no_grad():
        hits = (net(torch.from_numpy(tx)).argmax(1).numpy() == ty).mean()
    print(f"trained {args.models + 1} models in {time.perf_counter() - t:.0f} s; next-character "
          f"accuracy on the test windows {hits:.2f}")
    model = load_model("lm", "sequential", CONFIG,
                       {k: v.detach() for k, v in net.state_dict().items()},
                       device=torch.device("cpu"), dtype=torch.float64)
    found = curvature_scores(model, x, y, tx, ty, dims, baselines=True)
    if args.exported:
        program = exported(net, x[:1])
        found.update({f"exported program, {k}": v for k, v in
                      curvature_scores(program, x, y, tx, ty, []).items()})
    if args.kronfluence:
        found.update(kronfluence_scores(net, x, y, tx, ty))
    print_table(found, masks, actual)


if __name__ == "__main__":
    main()
