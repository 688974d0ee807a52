"""Sketches (``projection``), ``dots``, ``influence`` and ``self_influence`` against the per-sample
loop, the structured projections against the dense formula for the same matrices, the JL bound,
and sketches that do not depend on the batch, the strategy or the process."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch

from psgrad._errors import BadRequest, InvalidInput, NotFound, ShapeMismatch
from service import engine
from service.api.body import decode_json_body, held_to_contract
from service.engine import Batch, Options
from service.registry import LoadedModel, ModelRegistry, load_model
from service.strategies.projection import KINDS, KRONECKER, Projection, kind_of
from service.validate import parse_request
from service.validate.attribution import ReferenceSet
from tests.support.batches import SMALL_TRANSFORMER, make_batch
from tests.support.reference import assert_close, attribution, per_sample_loop
from tests.support.sketches import in_fresh_processes

CPU = torch.device("cpu")
CASES = [
    ("simple-cnn", {}, "nll"),
    ("mlp", {"sizes": [6, 5, 3]}, "cross_entropy"),
    ("tiny-transformer", SMALL_TRANSFORMER, "cross_entropy"),
]
_MODELS: dict[str, LoadedModel] = {}


def model_for(arch: str, config: dict[str, Any]) -> LoadedModel:
    key = f"{arch}{sorted(config.items())}"
    if key not in _MODELS:
        _MODELS[key] = load_model(arch, arch, config, device=CPU)
    return _MODELS[key]


def batch_for(model: LoadedModel, n: int, seed: int) -> Batch:
    return make_batch(model, n, seed, reference=False)


def loop_sketches(model: LoadedModel, batch: Batch, proj: Projection, loss: str
                  ) -> torch.Tensor:
    loop = per_sample_loop(model.module, {"inputs": batch.inputs, "targets": batch.targets}, loss)
    return sum(proj.project(k, g.double()) for k, g in loop.grads.items())  # type: ignore[return-value]


# ----------------------------------------------------------------------------- the definition


def test_kronecker_sketch_is_the_kronecker_product_of_its_factors() -> None:
    proj = Projection(12, 5, KRONECKER)
    grads = torch.randn(3, 4, 7, dtype=torch.float64)
    p_out, p_in = proj.kronecker("w", (4, 7), grads)
    assert p_out.shape == (3, 4) and p_in.shape == (4, 7)  # 12 = 3 x 4
    want = grads.reshape(3, -1) @ torch.kron(p_out, p_in).t()
    assert_close(proj.project("w", grads), want, atol=1e-12, rtol=1e-12)


def test_dense_sketch_is_one_matrix_built_block_by_block() -> None:
    """Kronecker sketches' biases: a dense matrix; TensorSketch's: a count sketch, whose inner
    products are exact while the parameter has at most k entries (one a bucket)."""
    proj = Projection(8192, 1, KRONECKER)
    g = torch.randn(2, 300, dtype=torch.float64)
    counted = Projection(8192, 1).project("b", g)
    assert_close(counted @ counted.t(), g @ g.t(), atol=1e-10, rtol=1e-10)
    assert int((counted != 0).sum()) == 2 * 300
    blocks = list(proj.dense_blocks("b", (300,), g))
    assert len(blocks) > 1  # 4 MiB blocks of 8192 rows: 128 columns each
    matrix = torch.cat([b for _, _, b in blocks], 1)
    assert matrix.shape == (8192, 300)
    assert_close(proj.project("b", g), g @ matrix.t(), atol=1e-10, rtol=1e-10)
    assert kind_of((300,)) == "tensorsketch" and kind_of((3, 4, 5)) == "tensorsketch"
    assert kind_of(()) == "dense"
    assert kind_of((300,), KRONECKER) == "dense" and kind_of((3, 4, 5), KRONECKER) == KRONECKER


def test_small_dense_sketches_side_by_side_equal_one_by_one() -> None:
    """``project_many`` puts small dense parameters' matrices side by side (one GEMM per 16 MiB
    of matrix) and adds every sketch into one buffer: the same matrices as one parameter at a
    time, with the runs split where the cap falls and larger or Kronecker ones on their own."""
    proj = Projection(8192, 4, KRONECKER)  # 16 MiB of 8192-row float32 columns: runs of 512
    gen = torch.Generator().manual_seed(0)
    shapes = {"a": (300,), "b": (3, 4), "c": (200,), "d": (100,), "e": (700,), "f": (5,)}
    grads = {k: torch.randn(3, *s, generator=gen, dtype=torch.float64) for k, s in shapes.items()}
    out = torch.ones(3, 8192, dtype=torch.float64)
    proj.project_many(grads, out)
    want = 1 + sum(proj.project(k, g) for k, g in grads.items())
    assert_close(out, want, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("groups", [1, 3])
def test_outer_form_equals_the_dense_formula(groups: int, kind: str) -> None:
    """``sum_t (P_out g_t) (x) (P_in a_t)`` per group, or the TensorSketch's convolutions of
    count sketches, == P applied to ``G^T A`` materialised."""
    n, t, d, p = 4, 5, 6, 2
    proj = Projection(64, 9, kind)
    a = torch.randn(n, groups, t, d, dtype=torch.float64)
    g = torch.randn(n, groups, t, p, dtype=torch.float64)
    shape = (groups * p, d // 2, 2)  # a convolution's [out, in/groups, kernel]
    grads = (g.transpose(-1, -2) @ a).reshape(n, *shape)
    assert_close(proj.project_outer("conv.weight", shape, a, g),
                 proj.project("conv.weight", grads), atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize(("vocab", "dim"), [(9, 4), (100, 12)])  # a vocabulary past k: groups
@pytest.mark.parametrize("kind", KINDS)
def test_row_form_equals_the_dense_formula(kind: str, vocab: int, dim: int) -> None:
    n, t = 3, 6
    proj = Projection(32, 2, kind)
    tokens = torch.randint(0, vocab, (n, t), generator=torch.Generator().manual_seed(0))
    g = torch.randn(n, t, dim, dtype=torch.float64)
    grads = torch.zeros(n, vocab, dim, dtype=torch.float64)
    for i in range(n):
        grads[i].index_add_(0, tokens[i], g[i])
    assert_close(proj.project_rows("embed.weight", (vocab, dim), tokens, g),
                 proj.project("embed.weight", grads), atol=1e-10, rtol=1e-10)


# ----------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fast", [True, False], ids=["fast_stats", "vmap"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_projection_is_the_projected_per_sample_loop(case: tuple[Any, ...], fast: bool,
                                                      kind: str) -> None:
    arch, config, loss = case
    model = model_for(arch, config)
    batch = batch_for(model, 5, 0)
    proj = Projection(64, 3, kind)
    opts = Options(loss, ("projection", "self_influence"), tuple(model.params), projection=proj)
    [got] = engine.compute(model, batch, opts, fast_stats=fast)
    want = loop_sketches(model, batch, proj, loss)
    assert got["projection"].shape == (5, 64)
    assert_close(got["projection"], want)
    assert_close(got["self_influence"], want.pow(2).sum(1), atol=1e-3, rtol=1e-4)
    assert got["meta"]["projection"] == {k: kind_of(v.shape, kind)
                                         for k, v in model.params.items()}
    assert got["meta"]["projection_kind"] == kind
    if fast:
        assert got["meta"].get("route") == "fast_stats"


def test_linear_conv_and_embedding_sketches_take_the_fast_path() -> None:
    """The fast path sketches these layers from their inputs and output gradients (TensorSketch
    builds a small layer's per-sample gradients over many positions a chunk at a time)."""
    for arch, config, _ in CASES:
        model = model_for(arch, config)
        opts = Options(CASES[0][2] if arch == "simple-cnn" else "cross_entropy", ("projection",),
                       tuple(model.params), projection=Projection(16))
        [got] = engine.compute(model, batch_for(model, 3, 1), opts)
        assert got["meta"]["route"] == "fast_stats"


def test_sketches_do_not_depend_on_batch_size_or_strategy() -> None:
    model = model_for("simple-cnn", {})
    batch = batch_for(model, 64, 7)
    opts = Options("nll", ("projection",), tuple(model.params), projection=Projection(256, 11))
    [whole] = engine.compute(model, batch, opts)
    for i in range(0, 64, 9):
        one = Batch(inputs=batch.inputs[i : i + 1], targets=batch.targets[i : i + 1])  # type: ignore[index]
        for fast in (True, False):
            [alone] = engine.compute(model, one, opts, fast_stats=fast)
            assert_close(alone["projection"][0], whole["projection"][i], atol=1e-5, rtol=1e-4)


_CHILD = """
import json, torch
from service import engine
from service.engine import Batch, Options
from service.registry import load_model
from service.strategies.projection import Projection
model = load_model("mlp", "mlp", {"sizes": [6, 5, 3]}, device=torch.device("cpu"))
gen = torch.Generator().manual_seed(4)
batch = Batch(inputs=torch.randn(8, 6, generator=gen), targets=torch.arange(8) % 3)
opts = Options("cross_entropy", ("projection",), tuple(model.params),
               projection=Projection(128, 99))
print(json.dumps(engine.compute(model, batch, opts)[0]["projection"].tolist()))
"""


def test_matrices_evicted_from_a_small_cache_are_drawn_again_the_same(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache of drawn matrices is bounded in bytes; what it evicts is drawn again from its
    seed, so sketches do not depend on what the cache held."""
    from service.lru import LockedLRU
    from service.strategies import projection as module

    model = model_for("simple-cnn", {})
    batch = batch_for(model, 8, 3)
    opts = Options("nll", ("projection",), tuple(model.params), projection=Projection(512, 5))
    module._FACTORS.clear()
    module._SIDES.clear()
    [roomy] = engine.compute(model, batch, opts)
    small = LockedLRU[tuple[object, ...], torch.Tensor](
        256, budget=64 << 10, weigh=lambda t: t.element_size() * t.nelement())
    sides = LockedLRU[tuple[object, ...], Any](2, budget=1, weigh=module._SIDES.weigh)
    monkeypatch.setattr(module, "_FACTORS", small)
    monkeypatch.setattr(module, "_SIDES", sides)
    for _ in range(2):
        [tight] = engine.compute(model, batch, opts)
        assert torch.equal(tight["projection"], roomy["projection"])
        assert small.weight <= 64 << 10 or len(small) == 1
        assert len(sides) <= 1


def test_sketches_are_the_same_in_another_process() -> None:
    runs = in_fresh_processes(_CHILD)
    assert runs[0] == runs[1]
    here = model_for("mlp", {"sizes": [6, 5, 3]})
    gen = torch.Generator().manual_seed(4)
    batch = Batch(inputs=torch.randn(8, 6, generator=gen), targets=torch.arange(8) % 3)
    opts = Options("cross_entropy", ("projection",), tuple(here.params),
                   projection=Projection(128, 99))
    [got] = engine.compute(here, batch, opts)
    assert got["projection"].tolist() == runs[0]


@pytest.mark.parametrize("k", [256, 1024, 4096])
def test_projected_inner_products_within_the_jl_bound(k: int) -> None:
    """``(<Pg, Ph> - <g, h>) / (|g| |h|)`` has variance at most ``(1 + 2/k_out)(1 + 2/k_in) - 1``
    for a Kronecker sketch (``2/k`` for a dense one): its RMS over pairs and seeds stays under
    that standard deviation, no pair is 6 of them off, and its mean over seeds is unbiased.
    (TensorSketch's figures: ``tests/unit/test_sketch_quality.py``.)"""
    model = model_for("mlp", {"sizes": [20, 16, 4]})
    batch = batch_for(model, 24, 3)
    loop = per_sample_loop(model.module, {"inputs": batch.inputs, "targets": batch.targets},
                           "cross_entropy")
    g = torch.cat([v.reshape(24, -1).double() for v in loop.grads.values()], 1)
    norms = g.norm(dim=1)
    exact = g @ g.t()
    seeds = 6
    k_out, k_in = Projection(k).split
    std = math.sqrt((1 + 2 / k_out) * (1 + 2 / k_in) - 1)
    errors = []
    for seed in range(seeds):
        proj = Projection(k, seed, KRONECKER)
        s = sum(proj.project(name, v.double()) for name, v in loop.grads.items())
        errors.append((s @ s.t() - exact) / torch.outer(norms, norms))  # type: ignore[union-attr]
    z = torch.stack(errors)
    assert z.pow(2).mean().sqrt() <= std
    assert z.abs().max() <= 6 * std
    assert z.mean(0).abs().max() <= 4 * std / math.sqrt(seeds)


# ----------------------------------------------------------------------------- dots, influence


@pytest.mark.parametrize("fast", [True, False], ids=["fast_stats", "vmap"])
def test_dots_against_gradient_references_are_exact(fast: bool) -> None:
    model = model_for("tiny-transformer", SMALL_TRANSFORMER)
    batch = batch_for(model, 6, 2)
    gen = torch.Generator().manual_seed(1)
    batch.references = {k: torch.randn(3, *v.shape, generator=gen)
                        for k, v in model.params.items()}
    opts = Options("cross_entropy", ("dots", "self_influence"), tuple(model.params),
                   reference_count=3)
    [got] = engine.compute(model, batch, opts, [6], fast_stats=fast)
    loop = per_sample_loop(model.module, {"inputs": batch.inputs, "targets": batch.targets},
                           "cross_entropy")
    want = attribution(loop, batch.references)
    assert_close(got["dots"], want["dots"])
    assert_close(got["self_influence"], want["self_influence"], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("fast", [True, False], ids=["fast_stats", "vmap"])
def test_dots_against_sketches_are_the_sketches_dots(fast: bool) -> None:
    model = model_for("simple-cnn", {})
    batch = batch_for(model, 4, 5)
    proj = Projection(512, 8)
    batch.sketches = torch.randn(7, 512, generator=torch.Generator().manual_seed(2))
    opts = Options("nll", ("dots", "projection"), tuple(model.params), projection=proj,
                   reference_count=7, reference_sketches=True)
    [a, b] = engine.compute(model, batch, opts, [1, 3], fast_stats=fast)
    want = loop_sketches(model, batch, proj, "nll") @ batch.sketches.double().t()
    assert_close(torch.cat([a["dots"], b["dots"]]), want, atol=1e-3, rtol=1e-4)


# ----------------------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    return ModelRegistry(CPU)


def parse(registry: ModelRegistry, body: dict[str, Any], **kw: Any) -> Any:
    arrays = {k: v for k, v in body.items() if isinstance(v, (np.ndarray, dict))}
    fields = decode_json_body({k: v for k, v in body.items() if k not in arrays},
                              max_elements=1 << 22)
    held_to_contract(fields)  # the door's checks, as every route runs them first
    return parse_request({**fields, **arrays}, registry, **kw)


def body(n: int = 2, **extra: Any) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    return {"model": "mlp", "inputs": rng.normal(size=(n, 784)).astype(np.float32),
            "targets": list(range(n)), **extra}


@pytest.mark.parametrize(("extra", "error", "words"), [
    ({"outputs": ["projection"]}, InvalidInput, "projection_dim"),
    ({"outputs": ["projection"], "projection_dim": 0}, InvalidInput, "8192"),
    ({"outputs": ["projection"], "projection_dim": 9000}, InvalidInput, "8192"),
    ({"outputs": ["projection"], "projection_dim": 2.5}, BadRequest, "8192"),
    ({"outputs": ["projection"], "projection_dim": 8, "projection_seed": -1}, InvalidInput,
     "2**63"),
    ({"projection_seed": 3}, InvalidInput, "projection_dim"),
    ({"projection_kind": "kronecker"}, InvalidInput, "projection_dim"),
    ({"outputs": ["projection"], "projection_dim": 8, "projection_kind": "gaussian"},
     InvalidInput, "one of tensorsketch, kronecker"),
    ({"outputs": ["dots"]}, InvalidInput, "reference"),
    ({"outputs": ["dots"], "reference_sketches": np.zeros((2, 8), np.float32)}, InvalidInput,
     "projection_dim"),
    ({"outputs": ["dots"], "projection_dim": 16,
      "reference_sketches": np.zeros((2, 8), np.float32)}, ShapeMismatch, "[M, 16]"),
    ({"outputs": ["dots", "dot"]}, InvalidInput, "one of"),
    ({"outputs": ["influence"]}, InvalidInput, "reference_set"),
    ({"outputs": ["influence"], "reference_set": "nope"}, NotFound, "PUT /reference-sets/nope"),
    ({"outputs": ["norms"], "reference_set": "x"}, InvalidInput, "influence"),
])
def test_refusals_say_what_to_send(registry: ModelRegistry, extra: dict[str, Any],
                                   error: type[Exception], words: str) -> None:
    with pytest.raises(error) as info:
        parse(registry, body(**extra), reference_sets={})  # no set is kept
    assert type(info.value) is error and words in str(info.value), repr(info.value)


def test_gradient_references_of_every_parameter_with_one_m(registry: ModelRegistry) -> None:
    model = registry.get("mlp")
    refs = {k: np.zeros((3, *v.shape), np.float32) for k, v in model.params.items()}
    parsed = parse(registry, body(outputs=["dots"], reference=refs))
    assert parsed.opts.reference_count == 3 and set(parsed.batch.references) == set(refs)
    one = {k: np.zeros(tuple(v.shape), np.float32) for k, v in model.params.items()}
    assert parse(registry, body(outputs=["dots"], reference=one)).opts.reference_count == 1
    refs["fc1.bias"] = np.zeros((2, *model.params["fc1.bias"].shape), np.float32)
    with pytest.raises(ShapeMismatch, match="same M"):
        parse(registry, body(outputs=["dots"], reference=refs))
    bad = {**one, "fc1.bias": np.zeros((3, 7), np.float32)}
    with pytest.raises(ShapeMismatch, match=r"fc1\.bias"):
        parse(registry, body(outputs=["dots"], reference=bad))


def test_influence_takes_the_projection_of_its_set(registry: ModelRegistry) -> None:
    model = registry.get("mlp")
    shapes = {k: list(v.shape) for k, v in model.params.items()}
    store = {"s": ReferenceSet("s", model.ref, tuple(model.params), shapes,
                               Projection(32, 5, KRONECKER),
                               {"sketches": np.ones((4, 32), np.float32)})}
    parsed = parse(registry, body(outputs=["influence"], reference_set="s"), reference_sets=store)
    assert parsed.opts.projection == Projection(32, 5, KRONECKER)
    same = {"projection_dim": 32, "projection_seed": 5}
    with pytest.raises(InvalidInput, match="projection_kind 'kronecker'"):  # kinds never mix
        parse(registry, body(outputs=["influence"], reference_set="s", **same),
              reference_sets=store)
    parsed = parse(registry, body(outputs=["influence"], reference_set="s",
                                  projection_kind=KRONECKER, **same), reference_sets=store)
    assert parsed.opts.projection == Projection(32, 5, KRONECKER)
    assert parsed.opts.reference_count == 4 and parsed.opts.reference_sketches
    with pytest.raises(InvalidInput, match="projection"):
        parse(registry, body(outputs=["influence"], reference_set="s", projection_dim=64),
              reference_sets=store)
    with pytest.raises(InvalidInput, match="params"):
        parse(registry, body(outputs=["influence"], reference_set="s", params=["fc1.weight"]),
              reference_sets=store)

