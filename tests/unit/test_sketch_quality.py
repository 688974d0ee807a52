"""TensorSketch, the default projection kind: as accurate as a dense Gaussian projection on the
zoo's per-sample gradients, unbiased, and one linear map however a strategy evaluates it.
The figure and the dense reference: :mod:`tests.support.sketches`.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from service import engine
from service.engine import Batch, Options
from service.registry import LoadedModel, load_model
from service.strategies import tensorsketch
from service.strategies.projection import KRONECKER, Projection
from tests.support.batches import SMALL_TRANSFORMER, make_batch
from tests.support.reference import assert_close, per_sample_loop
from tests.support.sketches import (
    dense_worst,
    in_fresh_processes,
    service_sketches,
    worst_pair,
    zoo_gradients,
)

CPU = torch.device("cpu")
ZOO = ["mlp", "simple-cnn", "tiny-transformer"]  # their default (zoo) configurations
SAMPLES = 24
_CACHE: dict[str, Any] = {}


def zoo(arch: str) -> tuple[LoadedModel, Batch, torch.Tensor]:
    """The model, a batch of 24 and its per-sample gradients (the loop), kept for the module."""
    if arch not in _CACHE:
        _CACHE[arch] = zoo_gradients(arch, SAMPLES)
    return _CACHE[arch]  # type: ignore[no-any-return]


def sketches(model: LoadedModel, batch: Batch, proj: Projection) -> torch.Tensor:
    return service_sketches(model, batch, proj)


@pytest.mark.parametrize("k", [1024, 2048])
@pytest.mark.parametrize("arch", ZOO)
def test_worst_pair_within_twice_a_dense_projections(arch: str, k: int) -> None:
    """On every seed, TensorSketch's worst pair is within 2x the median of a dense Gaussian
    projection's worst pair at the same k; Kronecker sketches are not (the figure discriminates)."""
    model, batch, flat = zoo(arch)
    gram = flat @ flat.t()
    dense = sorted(dense_worst(gram, k, seed) for seed in range(8))
    bound = 2 * (dense[3] + dense[4]) / 2
    ours = [worst_pair(sketches(model, batch, Projection(k, seed)), gram) for seed in range(4)]
    assert max(ours) <= bound, (ours, dense)
    kron = [worst_pair(sketches(model, batch, Projection(k, seed, KRONECKER)), gram)
            for seed in range(4)]
    assert max(kron) > bound, (kron, dense)


def test_unbiased_over_seeds() -> None:
    """The mean over 200 seeds of every pair's ``<Pa, Pb>`` is ``<a, b>`` within 5 standard
    errors (estimated from the same seeds), at a small k where each seed's error is large."""
    model = load_model("mlp", "mlp", {"sizes": [20, 16, 4]}, device=CPU)
    batch = make_batch(model, 10, 3, reference=False)
    loop = per_sample_loop(model.module, {"inputs": batch.inputs, "targets": batch.targets},
                           "cross_entropy")
    flat = torch.cat([g.reshape(10, -1).double() for g in loop.grads.values()], 1)
    exact = flat @ flat.t()
    errors = torch.stack([
        (s @ s.t() - exact) for s in (sketches(model, batch, Projection(32, seed))
                                      for seed in range(200))])
    mean, se = errors.mean(0), errors.std(0) / math.sqrt(len(errors))
    assert (mean.abs() <= 5 * se).all(), (mean / se).abs().max()
    assert (errors.std(0) > 0.05 * exact.diagonal().mean()).any()  # not exact by accident
    biased = errors + 0.2 * exact  # what a sketch scaled by 1.1 would give: the check sees it
    assert not (biased.mean(0).abs() <= 5 * se).all()


@pytest.mark.parametrize("fft", [True, False], ids=["convolved", "built"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize(("p", "d"), [(40, 150), (150, 40), (20, 50)],
                         ids=["long-columns", "long-rows", "short"])
def test_both_evaluations_of_a_layer_are_one_sketch(monkeypatch: pytest.MonkeyPatch,
                                                    fft: bool, groups: int, p: int,
                                                    d: int) -> None:
    """Whichever way a layer's ``sum_t g_t a_t^T`` is sketched (FFTs of count sketches per
    position, or the gradient built and scattered), the sketch is that of the gradient, over
    sides longer than k (several entries per bucket, the other side in groups) and shorter."""
    monkeypatch.setattr(tensorsketch, "fft_is_cheaper", lambda *_: fft)
    gen = torch.Generator().manual_seed(groups)
    n, t = 3, 7
    a = torch.randn(n, groups, t, d, generator=gen, dtype=torch.float64)
    g = torch.randn(n, groups, t, p, generator=gen, dtype=torch.float64)
    shape = (groups * p, d)
    grads = (g.transpose(-1, -2) @ a).reshape(n, *shape)
    proj = Projection(64, 12)
    want = proj.project("w", grads)
    assert_close(proj.project_outer("w", shape, a, g), want, atol=1e-10, rtol=1e-10)
    rows, cols = proj.sides("w", shape, grads)
    m = groups * p
    long, short = (rows, cols) if m > d else (cols, rows)
    r = min(tensorsketch.GROUPS, m, d) if max(m, d) > 64 else 1
    assert rows.r == cols.r == r and long.copies == r and short.copies == 1
    sizes = torch.bincount(short.group, minlength=r)
    assert len(sizes) == r and int(sizes.max() - sizes.min()) <= 1  # balanced groups
    for side, size in ((rows, m), (cols, d)):  # at most k entries: one a bucket
        for bucket in side.bucket:
            assert int(torch.bincount(bucket, minlength=64).max()) == math.ceil(size / 64)


@pytest.mark.parametrize("arch", ["tiny-transformer", "simple-cnn"])
def test_sketches_do_not_depend_on_batch_or_strategy(arch: str) -> None:
    """A sample's sketch is the same in a batch of 12, alone, and on the vmap path."""
    config = SMALL_TRANSFORMER if arch == "tiny-transformer" else {}
    model = load_model(arch, arch, config, device=CPU)
    batch = make_batch(model, 12, 5, reference=False)
    opts = Options(model.default_loss, ("projection",), tuple(model.params),
                   projection=Projection(512, 21))
    [whole] = engine.compute(model, batch, opts)
    [vmap] = engine.compute(model, batch, opts, fast_stats=False)
    assert_close(vmap["projection"], whole["projection"], atol=1e-5, rtol=1e-4)
    for i in (0, 7):
        one = Batch(inputs=batch.inputs[i : i + 1], targets=batch.targets[i : i + 1])  # type: ignore[index]
        [alone] = engine.compute(model, one, opts)
        assert_close(alone["projection"][0], whole["projection"][i], atol=1e-5, rtol=1e-4)


_CHILD = """
import json, torch
from service.strategies.projection import Projection
from service.registry import load_model
from tests.support.batches import SMALL_TRANSFORMER, make_batch
from tests.support.sketches import service_sketches
out = []
for arch, config in (("tiny-transformer", SMALL_TRANSFORMER), ("mlp", {})):
    model = load_model(arch, arch, config, device=torch.device("cpu"))
    batch = make_batch(model, 6, 8, reference=False)
    out.append(service_sketches(model, batch, Projection(96, 17)).tolist())
print(json.dumps(out))
"""


def test_sketches_of_sequences_are_the_same_in_another_process() -> None:
    """An embedding's rows and attention's built chunks (the small transformer), and dense
    layers' FFTs (the zoo mlp): the same sketches in two fresh processes as here (the tables
    come from the CPU generator alone)."""
    runs = in_fresh_processes(_CHILD)
    assert runs[0] == runs[1]
    for (arch, config), got in zip((("tiny-transformer", SMALL_TRANSFORMER), ("mlp", {})),
                                   runs[0], strict=True):
        model = load_model(arch, arch, config, device=CPU)
        batch = make_batch(model, 6, 8, reference=False)
        assert service_sketches(model, batch, Projection(96, 17)).tolist() == got
