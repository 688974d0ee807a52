"""Attribution quality of gradient stores on digits: the linear datamodeling score (LDS).

    python benchmarks/lds.py [--models 50] [--train 1300] [--test 100] [--epochs 40]
                             [--dims 1024,4096] [--seed 0]

The zoo ``mlp`` [64, 64, 10] is trained on ``--train`` samples of scikit-learn's digits
(standardised), and again on ``--models`` random halves of them (the same recipe: full-batch
Adam, ``--epochs`` steps, seeded); each retrained model's margins on ``--test`` held-out samples
(TRAK's output function, ``log p / (1 - p)`` of the correct class) are the truth. Each method
scores every (test, train) pair from the model trained on all samples, through the service
(the embedded app in process): exact scores from full per-sample gradients of the loss
(``dot``: TracIn; ``cosine``; ``trak`` with the stores' default lambda rule on the full
gradients' Gram matrix), and stores at each k of ``--dims`` queried with ``k`` = every
sample, under ``dot``, ``cosine`` and ``trak`` (the default lambda, ``trace(Phi^T Phi) / k``).
A subset's predicted margin is the sum of its samples' scores; LDS is the mean over test
samples of the Spearman correlation of predicted and actual margins across the subsets. Also
printed: the top-1% overlap of each score matrix with exact TracIn's (per test sample, averaged).

``--dattri K`` adds dattri's TracIn and TRAK (dense projections at K) on the same model, subsets
and margins (dattri is not a dependency: ``pip install --no-deps --target /tmp/dattri dattri``
and run with ``PYTHONPATH=/tmp/dattri``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import httpx
import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.datasets import load_digits

import psgrad
from models.mlp import mlp_layers
from service.api import create_app
from service.config import Settings

SIZES = [64, 64, 10]


def data(n_train: int, n_test: int, seed: int) -> tuple[np.ndarray, ...]:
    x, y = load_digits(return_X_y=True)
    x = ((x - x.mean(0)) / (x.std(0) + 1e-6)).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    tr, te = order[:n_train], order[n_train:n_train + n_test]
    return x[tr], y[tr], x[te], y[te]


def train(x: np.ndarray, y: np.ndarray, epochs: int, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    net = mlp_layers(SIZES, "relu")
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, weight_decay=1e-4)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y).long()
    for _ in range(epochs):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(xt), yt).backward()
        opt.step()
    return net.eval()


def margins(net: torch.nn.Module, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        logp = torch.log_softmax(net(torch.from_numpy(x)), 1)
        right = logp[torch.arange(len(y)), torch.from_numpy(y).long()]
        return (right - torch.log1p(-right.exp().clamp(max=1 - 1e-7))).numpy()


def lds(scores: np.ndarray, masks: np.ndarray, actual: np.ndarray) -> float:
    """scores [test, train], masks [models, train], actual [models, test]."""
    predicted = masks.astype(np.float64) @ scores.T  # [models, test]
    rho = [spearmanr(predicted[:, j], actual[:, j]).statistic for j in range(scores.shape[0])]
    return float(np.nanmean(rho))


def top_overlap(a: np.ndarray, b: np.ndarray, frac: float = 0.01) -> float:
    n = max(1, round(frac * a.shape[1]))
    top = [len(set(np.argsort(-a[i])[:n]) & set(np.argsort(-b[i])[:n])) / n
           for i in range(len(a))]
    return float(np.mean(top))


async def scores_of(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, tx: np.ndarray,
                    ty: np.ndarray, dims: list[int]) -> dict[str, np.ndarray]:
    data_dir = tempfile.TemporaryDirectory(prefix="psgrad-lds-")  # removed when done
    settings = Settings(data_dir=data_dir.name, device="cpu", redis_url=None, api_keys="",
                        admin_keys="", batch_max_delay_ms=0)
    app = create_app(settings)
    out: dict[str, np.ndarray] = {}
    async with app.router.lifespan_context(app), psgrad.AsyncClient(
            base_url="http://lds", transport=httpx.ASGITransport(app=app), timeout=600) as c:
        await c.models.register("lds", architecture="mlp", config={"sizes": SIZES})
        await c.models.upload_weights("lds", {k: v.detach().numpy()
                                              for k, v in net.state_dict().items()})

        async def grads(xs: np.ndarray, ys: np.ndarray) -> np.ndarray:
            r = await c.per_sample_grads("lds", xs, ys, outputs=["grads"])
            return np.concatenate([np.asarray(g).reshape(len(xs), -1)
                                   for g in r.grads.values()], 1).astype(np.float64)

        g_test, g_train = await grads(tx, ty), await grads(x, y)
        out["exact dot"] = g_test @ g_train.T
        size = np.linalg.norm(g_test, axis=1)[:, None] * np.linalg.norm(g_train, axis=1)
        out["exact cosine"] = out["exact dot"] / size
        gram = g_train.T @ g_train  # the stores' default lambda, on the full gradients
        lam = np.trace(gram) / len(gram)
        out["exact trak"] = np.linalg.solve(gram + lam * np.eye(len(gram)), g_test.T).T @ g_train.T
        ids = np.arange(len(x))
        for dim in dims:
            store = await c.stores.create(f"k{dim}", "lds", projection_dim=dim)
            await store.add(x, y, ids=ids, batch_size=512)
            for score in ("dot", "cosine", "trak"):
                found = await store.query(tx, ty, k=len(x), score=score)
                full = np.empty((len(tx), len(x)))
                np.put_along_axis(full, found.ids.astype(np.int64), found.scores, 1)
                out[f"k={dim} {score}"] = full
    return out


def dattri_scores(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, tx: np.ndarray,
                  ty: np.ndarray, dim: int) -> dict[str, np.ndarray]:
    """dattri's TracIn (the loss's gradients) and TRAK (the margin's, regularization 0, its
    default), both with dattri's dense projection at ``dim``, on the same model."""
    from dattri.algorithm.tracin import TracInAttributor
    from dattri.algorithm.trak import TRAKAttributor
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader, TensorDataset

    def loss(params: dict[str, torch.Tensor], data: tuple[torch.Tensor, ...]) -> torch.Tensor:
        xi, yi = data
        out = torch.func.functional_call(net, params, xi.unsqueeze(0))
        return torch.nn.functional.cross_entropy(out, yi.unsqueeze(0))

    def margin(params: dict[str, torch.Tensor], data: tuple[torch.Tensor, ...]) -> torch.Tensor:
        p = torch.exp(-loss(params, data))
        return torch.log(p) - torch.log(1 - p)

    def prob(params: dict[str, torch.Tensor], data: tuple[torch.Tensor, ...]) -> torch.Tensor:
        return torch.exp(-loss(params, data))

    def loader(a: np.ndarray, b: np.ndarray) -> DataLoader[Any]:
        return DataLoader(TensorDataset(torch.tensor(a), torch.tensor(b).long()), batch_size=64,
                          shuffle=False)

    proj = {"proj_dim": dim, "device": "cpu"}
    tracin = TracInAttributor(task=AttributionTask(loss_func=loss, model=net,
                                                   checkpoints=net.state_dict()),
                              weight_list=torch.ones(1), normalized_grad=False,
                              projector_kwargs=dict(proj))
    out = {f"dattri TracIn k={dim}": tracin.attribute(loader(x, y), loader(tx, ty)).T.numpy()}
    trak = TRAKAttributor(task=AttributionTask(loss_func=margin, model=net,
                                               checkpoints=net.state_dict()),
                          correct_probability_func=prob, projector_kwargs=dict(proj))
    trak.cache(loader(x, y))
    out[f"dattri TRAK k={dim}"] = trak.attribute(loader(tx, ty)).T.numpy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", type=int, default=50)
    ap.add_argument("--train", type=int, default=1300)
    ap.add_argument("--test", type=int, default=100)
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--dims", default="1024,4096")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dattri", type=int, default=0, metavar="K",
                    help="also dattri's TracIn and TRAK at this k (dattri installed with "
                    "--no-deps, e.g. PYTHONPATH=/tmp/dattri)")
    args = ap.parse_args()
    x, y, tx, ty = data(args.train, args.test, args.seed)
    t = time.perf_counter()
    net = train(x, y, args.epochs, args.seed)
    rng = np.random.default_rng(args.seed + 1)
    masks = np.zeros((args.models, len(x)), bool)
    actual = np.empty((args.models, len(tx)))
    for m in range(args.models):
        masks[m, rng.choice(len(x), len(x) // 2, replace=False)] = True
        actual[m] = margins(train(x[masks[m]], y[masks[m]], args.epochs, args.seed), tx, ty)
    print(f"trained {args.models + 1} models in {time.perf_counter() - t:.0f} s; test accuracy "
          f"{(margins(net, tx, ty) > 0).mean():.2f}")
    found = asyncio.run(scores_of(net, x, y, tx, ty, [int(d) for d in args.dims.split(",")]))
    if args.dattri:
        found.update(dattri_scores(net, x, y, tx, ty, args.dattri))
    exact = found["exact dot"]
    print("\n| scores | LDS | top-1% overlap with exact TracIn |\n|---|---|---|")
    for name, s in found.items():
        print(f"| {name} | {lds(s, masks, actual):.3f} | {top_overlap(s, exact):.2f} |")


if __name__ == "__main__":
    main()
