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
sample, under ``dot``, ``cosine`` and ``trak`` (the default lambda, ``trace(Phi^T Phi) / k``
with no row counting for more than all the others together).
``kfac`` and ``ekfac`` precondition each test gradient by the K-FAC or EK-FAC Fisher
(:mod:`service.curvature`, fitted over the training samples at its default damping, a tenth of
the mean eigenvalue) and score it against the training gradients, through the stores (each
store of ``--dims`` and one of full gradients, its factors fitted over the training samples:
the preconditioned test gradient sketched as the store's rows are), and in process with the
service's modules: exact, and at each k of ``--dims`` either as the stores do (``query
preconditioned``: the preconditioned test gradient against the training gradients' sketches;
the same figures as the stores', a check of the served path) or with both sides whitened by
``(F + damping I)^-1/2`` before sketching (``both sides whitened``: rows sketched after the
fit; the stores do not serve this); and exact with Kronfluence's damping rule, a tenth of each
layer's own mean eigenvalue (``damping per layer``; the service takes one for all of ``F``),
and exact on the true Fisher (``true Fisher``: fitted at labels drawn from the model's
predictions, four per training sample, as Kronfluence samples them; the service fits the
empirical Fisher, at the samples' own labels).
A subset's predicted margin is the sum of its samples' scores; LDS is the mean over test
samples of the Spearman correlation of predicted and actual margins across the subsets. Also
printed: each LDS less exact ``trak``'s, with the standard error of that difference over the
test samples (paired: both scored on the same test samples and retrained models), and the
top-1% overlap of each score matrix with exact TracIn's (per test sample, averaged).

``--dattri K`` adds dattri's TracIn and TRAK (dense projections at K) and EK-FAC on the same
model, subsets and margins (dattri is not a dependency: ``pip install --no-deps --target
/tmp/dattri dattri`` and run with ``PYTHONPATH=/tmp/dattri``).

``--kronfluence`` adds Kronfluence's EK-FAC and K-FAC (its defaults: the true Fisher of sampled
labels, damping a tenth of the mean eigenvalue; the query's measurement is its loss, as psgrad's)
on the same model (``pip install --no-deps --target /tmp/kron kronfluence einops einconv`` and
``PYTHONPATH=/tmp/kron``).

``--overlap-only`` trains the one model and prints only sketched TracIn's top-1% overlap with
exact TracIn, at each k of ``--dims``: mean, min and max over ``--sketch-seeds`` seeds, for
psgrad's sketch kinds (the service's ``projection`` output), a dense and an orthogonal Gaussian
projection of the exact gradients (numpy), and a reference allocation from shapes alone (the
small parameters exact, the largest count-sketched), which is no default: it gains only where
the small parameters hold much of the gradient's energy (see :func:`exact_small_layers`).

    python benchmarks/lds.py --overlap-only [--sketch-seeds 5] [--dims 1024,4096] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import httpx
import numpy as np
import torch
from scipy.stats import spearmanr
from sklearn.datasets import load_digits

import psgrad
from models.mlp import mlp_layers
from psgrad._contract import PROJECTION_KINDS
from service import curvature
from service.api import create_app
from service.config import Settings
from service.registry import LoadedModel, load_model
from service.stores.query import Largest, default_lambda
from service.strategies.projection import Projection

SIZES = [64, 64, 10]
TRUE_FISHER_DRAWS = 4  # labels drawn from the model per training sample for the true Fisher


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


def correlations(scores: np.ndarray, masks: np.ndarray, actual: np.ndarray) -> np.ndarray:
    """Each test sample's Spearman correlation of predicted and actual margins (``[test]``;
    their mean is the LDS): scores [test, train], masks [models, train], actual [models,
    test]."""
    predicted = masks.astype(np.float64) @ scores.T  # [models, test]
    return np.array([spearmanr(predicted[:, j], actual[:, j]).statistic
                     for j in range(scores.shape[0])])


def paired(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """The LDS of ``a`` less that of ``b`` (per-test correlations of the same test samples),
    and the standard error of that difference over the test samples."""
    d = (a - b)[~np.isnan(a - b)]
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d)))


def top_overlap(a: np.ndarray, b: np.ndarray, frac: float = 0.01) -> float:
    n = max(1, round(frac * a.shape[1]))
    top = [len(set(np.argsort(-a[i])[:n]) & set(np.argsort(-b[i])[:n])) / n
           for i in range(len(a))]
    return float(np.mean(top))


@contextlib.asynccontextmanager
async def served(net: torch.nn.Module) -> AsyncIterator[psgrad.AsyncClient]:
    """A client of the embedded app (in this process, its data in a temporary folder) with
    ``net`` registered as model ``lds``."""
    with tempfile.TemporaryDirectory(prefix="psgrad-lds-") as data_dir:
        settings = Settings(data_dir=data_dir, device="cpu", redis_url=None, api_keys="",
                            admin_keys="", batch_max_delay_ms=0)
        app = create_app(settings)
        async with app.router.lifespan_context(app), psgrad.AsyncClient(
                base_url="http://lds", transport=httpx.ASGITransport(app=app), timeout=600) as c:
            await c.models.register("lds", architecture="mlp", config={"sizes": SIZES})
            await c.models.upload_weights("lds", {k: v.detach().numpy()
                                                  for k, v in net.state_dict().items()})
            yield c


async def grads(c: psgrad.AsyncClient, xs: np.ndarray, ys: np.ndarray) -> dict[str, np.ndarray]:
    """Each parameter's per-sample gradients, flattened: {name: [B, size]} in float64."""
    r = await c.per_sample_grads("lds", xs, ys, outputs=["grads"])
    return {name: np.asarray(g).reshape(len(xs), -1).astype(np.float64)
            for name, g in r.grads.items()}


def flat(g: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate(list(g.values()), 1)


async def scores_of(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, tx: np.ndarray,
                    ty: np.ndarray, dims: list[int]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    async with served(net) as c:
        g_test, g_train = flat(await grads(c, tx, ty)), flat(await grads(c, x, y))
        out["exact dot"] = g_test @ g_train.T
        size = np.linalg.norm(g_test, axis=1)[:, None] * np.linalg.norm(g_train, axis=1)
        out["exact cosine"] = out["exact dot"] / size
        out["exact trak"] = trak(g_train, g_test)  # the stores' default lambda
        ids = np.arange(len(x))
        for dim in [*dims, None]:
            store = await c.stores.create(f"k{dim or 'full'}", "lds", projection_dim=dim)
            await store.add(x, y, ids=ids, batch_size=512)
            await store.fit_factors(x, y, batch_size=512)
            kept = f"k={dim}" if dim else "store of full gradients,"
            for score in ("dot", "cosine", "trak", "kfac", "ekfac") if dim else ("kfac", "ekfac"):
                found = await store.query(tx, ty, k=len(x), score=score)
                full = np.empty((len(tx), len(x)))
                np.put_along_axis(full, found.ids.astype(np.int64), found.scores, 1)
                out[f"{kept} {score}"] = full
    return out


def curvature_scores(model: LoadedModel, x: np.ndarray, y: np.ndarray, tx: np.ndarray,
                     ty: np.ndarray, dims: list[int], baselines: bool = False
                     ) -> dict[str, np.ndarray]:
    """``kfac`` and ``ekfac``: each test gradient preconditioned by the Fisher fitted over the
    training samples (at its default damping, and exact at Kronfluence's damping per layer),
    against the training gradients; exact and sketched at each k of ``dims`` (the stores'
    projection, seed 0); and exact, fitted on the true Fisher instead of the empirical one
    (:data:`TRUE_FISHER_DRAWS` labels per training sample drawn from the model's predictions,
    as Kronfluence samples them; the service fits at the samples' own labels). ``baselines``
    adds exact ``dot`` and ``trak`` (the stores' default lambda) from the same gradients."""
    params = list(model.params)

    def fields(a: np.ndarray, b: np.ndarray) -> dict[str, torch.Tensor]:
        inputs = torch.from_numpy(a)
        return {"inputs": inputs.double() if inputs.is_floating_point() else inputs,
                "targets": torch.from_numpy(b).long()}

    train = fields(x, y)
    fitted = curvature.fit(model, "cross_entropy", 1.0, params, [train])
    with torch.no_grad():
        probs = torch.softmax(model.module(train["inputs"]).double(), 1)
    drawn = torch.multinomial(probs, TRUE_FISHER_DRAWS, replacement=True,
                              generator=torch.Generator().manual_seed(0))
    true_fisher = curvature.fit(model, "cross_entropy", 1.0, params, [fields(
        np.concatenate([x] * TRUE_FISHER_DRAWS), drawn.T.reshape(-1).numpy())])

    def grads(a: np.ndarray, b: np.ndarray) -> dict[str, torch.Tensor]:
        rows = list(curvature.captured(model, "cross_entropy", 1.0, fitted.layers, params,
                                       fields(a, b)))
        return {k: torch.stack([r.grads[k] for r in rows]) for k in params}

    def flat(g: dict[str, torch.Tensor]) -> np.ndarray:  # in the model's order, whatever g's
        return torch.cat([g[k].reshape(len(g[k]), -1) for k in params], 1).numpy()

    g_train, g_test = grads(x, y), grads(tx, ty)
    out = {}
    if baselines:
        phi, q = flat(g_train), flat(g_test)
        out["exact dot"] = q @ phi.T
        out["exact trak"] = trak(phi, q)
    for kind in curvature.KINDS:
        damping = fitted.default_damping(kind)
        pre = fitted.precondition(g_test, damping, kind)
        out[f"exact {kind}"] = flat(pre) @ flat(g_train).T
        out[f"exact {kind}, damping per layer"] = flat(per_layer(fitted, g_test, kind)) @ flat(
            g_train).T
        out[f"exact {kind}, true Fisher"] = flat(true_fisher.precondition(
            g_test, true_fisher.default_damping(kind), kind)) @ flat(g_train).T
        half_test, half_train = (fitted.precondition(g, damping, kind, power=0.5)
                                 for g in (g_test, g_train))
        for dim in dims:
            proj = Projection(dim, 0)

            def sketch(g: dict[str, torch.Tensor], proj: Projection = proj) -> np.ndarray:
                return sum(proj.project(k, v) for k, v in g.items()).numpy()  # type: ignore[union-attr]

            out[f"k={dim} {kind}, query preconditioned"] = sketch(pre) @ sketch(g_train).T
            out[f"k={dim} {kind}, both sides whitened"] = (sketch(half_test)
                                                          @ sketch(half_train).T)
    return out


def per_layer(fitted: curvature.Curvature, g: dict[str, torch.Tensor], kind: curvature.Kind
              ) -> dict[str, torch.Tensor]:
    """``g`` preconditioned as Kronfluence does: each layer (and each other parameter) damped by
    a tenth of its own mean eigenvalue, where psgrad takes one damping from all of ``F``."""
    parts = [replace(fitted, layers={k: v}, diagonal={}) for k, v in fitted.layers.items()]
    parts += [replace(fitted, layers={}, diagonal={k: v}) for k, v in fitted.diagonal.items()]
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        out.update(part.precondition(g, part.default_damping(kind), kind))
    return out


def trak(phi: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Exact TRAK scores ``q (Phi^T Phi + lambda I)^-1 Phi^T`` at the stores' default lambda."""
    gram = phi.T @ phi
    power = np.einsum("ij,ij->i", phi, phi)
    top = int(np.argmax(power))
    lam = default_lambda(len(gram), Largest(float(power[top]), float(np.delete(power, top).sum())))
    scores: np.ndarray = np.linalg.solve(gram + lam * np.eye(len(gram)), q.T).T @ phi.T
    return scores


def kronfluence_scores(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, tx: np.ndarray,
                       ty: np.ndarray) -> dict[str, np.ndarray]:
    """Kronfluence's EK-FAC and K-FAC pairwise scores, at its defaults, on the same model."""
    import copy

    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments
    from kronfluence.task import Task
    from torch.utils.data import TensorDataset

    class Classify(Task):  # type: ignore[misc]
        def compute_train_loss(self, batch: Any, model: torch.nn.Module,
                               sample: bool = False) -> torch.Tensor:
            xb, yb = batch
            logits = model(xb)
            if sample:  # the true Fisher: labels drawn from the model
                with torch.no_grad():
                    yb = torch.multinomial(torch.softmax(logits, 1), 1).flatten()
            return torch.nn.functional.cross_entropy(logits, yb, reduction="sum")

        def compute_measurement(self, batch: Any, model: torch.nn.Module) -> torch.Tensor:
            return self.compute_train_loss(batch, model)

    train = TensorDataset(torch.from_numpy(x), torch.from_numpy(y).long())
    test = TensorDataset(torch.from_numpy(tx), torch.from_numpy(ty).long())
    out = {}
    with tempfile.TemporaryDirectory(prefix="psgrad-kron-") as folder:
        for strategy in ("ekfac", "kfac"):
            task = Classify()
            analyzer = Analyzer(analysis_name=strategy, model=prepare_model(copy.deepcopy(net),
                                                                            task),
                                task=task, cpu=True, output_dir=folder, disable_tqdm=True)
            analyzer.fit_all_factors(factors_name=strategy, dataset=train,
                                     per_device_batch_size=len(x),
                                     factor_args=FactorArguments(strategy=strategy))
            analyzer.compute_pairwise_scores(scores_name=strategy, factors_name=strategy,
                                             query_dataset=test, train_dataset=train,
                                             per_device_query_batch_size=len(tx),
                                             per_device_train_batch_size=len(x))
            scores = analyzer.load_pairwise_scores(strategy)["all_modules"]
            out[f"Kronfluence {strategy.upper().replace('KFAC', 'K-FAC')}"] = (
                scores.double().numpy())
    return out


# Data-oblivious projections of the exact gradients for --overlap-only: each a [P, k] matrix
# drawn from (sizes of the parameters, k, a generator); the scores are (G_test P)(G_train P)^T.

def dense(sizes: list[int], dim: int, rng: np.random.Generator) -> np.ndarray:
    """A dense Gaussian projection, TRAK's and dattri's."""
    return rng.standard_normal((sum(sizes), dim)) / np.sqrt(dim)


def orthogonal(sizes: list[int], dim: int, rng: np.random.Generator) -> np.ndarray:
    """k orthonormal columns (QR of a Gaussian matrix), scaled to keep norms on average."""
    q = np.linalg.qr(rng.standard_normal((sum(sizes), dim)))[0]
    return q * np.sqrt(sum(sizes) / q.shape[1])


def exact_small_layers(sizes: list[int], dim: int, rng: np.random.Generator) -> np.ndarray:
    """Every parameter but the largest copied exactly, the largest count-sketched (balanced
    buckets, random signs) into the columns left: an allocation from shapes alone, a reference
    for what reallocating k can do, not a candidate default (it wins only where the small
    parameters hold much of the gradient's energy)."""
    big = int(np.argmax(sizes))
    ends = np.cumsum([0, *sizes])
    rest = np.arange(ends[big], ends[big + 1])
    exact = np.setdiff1d(np.arange(ends[-1]), rest)
    buckets = dim - len(exact)
    if buckets < 1:
        raise SystemExit(f"k = {dim} does not hold the {len(exact)} small parameters' entries")
    p = np.zeros((ends[-1], dim))
    p[exact, np.arange(len(exact))] = 1.0
    bucket = rng.permutation(-(-len(rest) // buckets) * buckets)[:len(rest)] % buckets
    p[rest, len(exact) + bucket] = rng.choice([-1.0, 1.0], len(rest))
    return p


PROJECTIONS = {"dense Gaussian (numpy)": dense, "orthogonal Gaussian (numpy)": orthogonal,
               "reference: exact small layers (numpy)": exact_small_layers}


async def overlaps(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, tx: np.ndarray,
                   ty: np.ndarray, dims: list[int],
                   seeds: int) -> dict[tuple[int, str], list[float]]:
    """The top-1% overlap with exact TracIn of sketched TracIn (``dot`` of sketches), per (k,
    method), one value per sketch seed: psgrad's kinds made by the service (the ``projection``
    output), and :data:`PROJECTIONS` of the exact gradients."""
    found: dict[tuple[int, str], list[float]] = {}
    async with served(net) as c:

        async def sketch(xs: np.ndarray, ys: np.ndarray, dim: int, seed: int,
                         kind: str) -> np.ndarray:
            r = await c.per_sample_grads("lds", xs, ys, outputs=["projection"],
                                         projection_dim=dim, projection_seed=seed,
                                         projection_kind=kind)
            return np.asarray(r.projection, np.float64)

        by_param = await grads(c, x, y)
        sizes = [g.shape[1] for g in by_param.values()]
        g_test, g_train = flat(await grads(c, tx, ty)), flat(by_param)
        exact = g_test @ g_train.T
        for dim in dims:
            for seed in range(seeds):
                for kind in PROJECTION_KINDS:
                    test, train = (await sketch(tx, ty, dim, seed, kind),
                                   await sketch(x, y, dim, seed, kind))
                    found.setdefault((dim, f"psgrad {kind}"), []).append(
                        top_overlap(test @ train.T, exact))
                for name, draw in PROJECTIONS.items():
                    p = draw(sizes, dim, np.random.default_rng(seed))
                    found.setdefault((dim, name), []).append(
                        top_overlap((g_test @ p) @ (g_train @ p).T, exact))
    return found


def dattri_scores(net: torch.nn.Module, x: np.ndarray, y: np.ndarray, tx: np.ndarray,
                  ty: np.ndarray, dim: int) -> dict[str, np.ndarray]:
    """dattri's TracIn (the loss's gradients) and TRAK (the margin's, regularization 0, its
    default), both with dattri's dense projection at ``dim``, and its EK-FAC influence (every
    linear layer, its default damping 0), on the same model."""
    from dattri.algorithm.influence_function import IFAttributorEKFAC
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

    def batch_loss(params: dict[str, torch.Tensor], data: tuple[torch.Tensor, ...]
                   ) -> torch.Tensor:  # EK-FAC fits its covariances over batches
        xb, yb = data
        return torch.nn.functional.cross_entropy(torch.func.functional_call(net, params, xb), yb)

    ekfac = IFAttributorEKFAC(task=AttributionTask(loss_func=batch_loss, model=net,
                                                   checkpoints=net.state_dict()), device="cpu")
    ekfac.cache(loader(x, y))  # its default damping, 0
    out["dattri EK-FAC"] = ekfac.attribute(loader(x, y), loader(tx, ty)).T.detach().numpy()
    return out


def print_overlaps(found: dict[tuple[int, str], list[float]], args: argparse.Namespace,
                   seconds: float) -> None:
    print(f"\ndata and training seed {args.seed}, {args.train} training and {args.test} test "
          f"samples, sketch seeds 0-{args.sketch_seeds - 1}, {seconds:.0f} s\n")
    print("| k | sketch | top-1% overlap with exact TracIn, mean | min | max |\n"
          "|---|---|---|---|---|")
    for (dim, name), v in found.items():
        print(f"| {dim} | {name} | {np.mean(v):.3f} | {min(v):.3f} | {max(v):.3f} |")
    print("\nreference: every parameter but the largest copied exactly, the largest "
          "count-sketched into the columns left; chosen from shapes alone, it gains only where "
          "the small parameters hold much of the gradient's energy, so it is not a default.")


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
    ap.add_argument("--kronfluence", action="store_true",
                    help="also Kronfluence's EK-FAC and K-FAC (installed with --no-deps, e.g. "
                    "PYTHONPATH=/tmp/kron)")
    ap.add_argument("--overlap-only", action="store_true",
                    help="no retrained models: only the top-1%% overlap with exact TracIn of "
                    "sketches (psgrad's kinds, dense and orthogonal Gaussian, a reference "
                    "allocation) over --sketch-seeds seeds")
    ap.add_argument("--sketch-seeds", type=int, default=5, metavar="N",
                    help="--overlap-only: sketch seeds 0 to N-1 (default 5)")
    args = ap.parse_args()
    x, y, tx, ty = data(args.train, args.test, args.seed)
    dims = [int(d) for d in args.dims.split(",") if d]
    t = time.perf_counter()
    net = train(x, y, args.epochs, args.seed)
    if args.overlap_only:
        print_overlaps(asyncio.run(overlaps(net, x, y, tx, ty, dims, args.sketch_seeds)),
                       args, time.perf_counter() - t)
        return
    masks, actual = retrained(train, x, y, tx, ty, args)
    print(f"trained {args.models + 1} models in {time.perf_counter() - t:.0f} s; test accuracy "
          f"{(margins(net, tx, ty) > 0).mean():.2f}")
    found = asyncio.run(scores_of(net, x, y, tx, ty, dims))
    found.update(curvature_scores(load_model(
        "lds", "mlp", {"sizes": SIZES}, {k: v.detach() for k, v in net.state_dict().items()},
        device=torch.device("cpu"), dtype=torch.float64), x, y, tx, ty, dims))
    if args.kronfluence:
        found.update(kronfluence_scores(net, x, y, tx, ty))
    if args.dattri:
        found.update(dattri_scores(net, x, y, tx, ty, args.dattri))
    print_table(found, masks, actual)


def retrained(train: Callable[[np.ndarray, np.ndarray, int, int], torch.nn.Module],
              x: np.ndarray, y: np.ndarray, tx: np.ndarray, ty: np.ndarray,
              args: argparse.Namespace) -> tuple[np.ndarray, np.ndarray]:
    """``--models`` random halves of the training samples (masks ``[models, train]``) and the
    margins on the test samples of a model trained on each (``[models, test]``)."""
    rng = np.random.default_rng(args.seed + 1)
    masks = np.zeros((args.models, len(x)), bool)
    actual = np.empty((args.models, len(tx)))
    for m in range(args.models):
        masks[m, rng.choice(len(x), len(x) // 2, replace=False)] = True
        actual[m] = margins(train(x[masks[m]], y[masks[m]], args.epochs, args.seed), tx, ty)
    return masks, actual


def print_table(found: dict[str, np.ndarray], masks: np.ndarray, actual: np.ndarray) -> None:
    """Each score's LDS, its difference from exact ``trak``'s with the standard error of that
    difference over the test samples (paired: the same test samples and retrained models, so
    a difference within about two of them is not one these test samples tell apart), and its
    top-1% overlap with exact TracIn's, as a Markdown table."""
    exact = found["exact dot"]
    base = correlations(found["exact trak"], masks, actual)
    print("\n| scores | LDS | LDS - exact trak (s.e.) | top-1% overlap with exact TracIn |"
          "\n|---|---|---|---|")
    for name, s in found.items():
        rho = correlations(s, masks, actual)
        diff, se = paired(rho, base)
        print(f"| {name} | {np.nanmean(rho):.3f} | {diff:+.3f} ({se:.3f}) | "
              f"{top_overlap(s, exact):.2f} |")


if __name__ == "__main__":
    main()
