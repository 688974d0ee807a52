"""Exported programs on fast statistics: the batch of one made generic at registration, the aten
calls captured by the layer families, every statistic equal to the per-sample loop on the
original module; a program whose batch cannot be made generic stays on the vmap route."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from service import curvature, engine
from service.export.batch import BATCH_NAME
from service.registration import register_exported
from service.registry import LoadedModel, ModelRegistry
from service.stores import factors
from service.stores.files import StoreFiles
from service.stores.locks import ThreadLocks
from service.stores.spec import EXACT, StoreSpec
from service.strategies.projection import Projection
from service.validate import parse_request
from tests.support.api import settings
from tests.support.export import CASES, exported, exported_hf, token_batch
from tests.support.reference import assert_close, per_sample_loop, summarize, tolerance

pytest.importorskip("transformers")

OUTPUTS = ["grads", "norms", "losses", "clipped_mean", "mean", "variance", "layer_norms",
           "cosine_mean"]
N = 4


def _case(name: str) -> tuple[nn.Module, bytes, str, dict[str, Any]]:
    """The original module, its archive, its loss and a batch (a padded one for the LMs)."""
    if name == "resnet":
        module, data = exported(name)
        return module, data, "cross_entropy", {"inputs": CASES[name].example(N),
                                               "targets": CASES[name].target(N)}
    module, data = exported_hf(name)
    ids, mask = token_batch(N, 9)  # exported at length 8
    batch: dict[str, Any] = {"inputs": {"input_ids": ids, "attention_mask": mask}}
    if name == "gpt2":
        return module, data, "next_token", {**batch, "targets": ids, "mask": mask}
    return module, data, "cross_entropy", {**batch, "targets": torch.tensor([0, 2, 1, 1])}


@pytest.fixture(scope="module")
def registry() -> ModelRegistry:
    registry = ModelRegistry(torch.device("cpu"))
    for name in ("resnet", "gpt2", "bert"):
        _, data, loss, _ = _case(name)
        register_exported(registry, name, data, settings(), default_loss=loss, losses=[])
    return registry


def _fields(batch: dict[str, Any]) -> dict[str, Any]:
    def arrays(v: Any) -> Any:
        return {k: t.numpy() for k, t in v.items()} if isinstance(v, dict) else v.numpy()

    return {k: arrays(v) for k, v in batch.items()}


def _compute(registry: ModelRegistry, name: str, batch: dict[str, Any], outputs: list[str],
             **extra: Any) -> dict[str, Any]:
    parsed = parse_request({"model": name, "outputs": outputs, **_fields(batch), **extra},
                           registry)
    [out] = engine.compute(parsed.model, parsed.batch, parsed.opts)
    return out


@pytest.mark.parametrize("name", ["resnet", "gpt2", "bert"])
def test_the_three_models_are_batched_and_their_rewrites_are_identities_at_one(
        registry: ModelRegistry, name: str) -> None:
    module = _case(name)[0]
    model = registry.get(name)
    assert model.batched and model.describe()["config"]["batched"] is True
    nodes = model.config["program"]["graph_module"]["graph"]["nodes"]
    added = [n for n in nodes if BATCH_NAME in str(n["outputs"])]
    if name == "resnet":  # batch-generic as exported: stored as it came
        assert not added
        return
    # the rewrite adds the batch (sym_size of the first input) and expands shared indices
    assert {n["target"] for n in added} == {"torch.ops.aten.sym_size.int",
                                            "torch.ops.aten.expand.default"}
    ids, mask = token_batch(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(model.module(ids, mask), module(ids, mask), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("name", ["resnet", "gpt2", "bert"])
def test_fast_statistics_equal_the_loop_on_the_original_module(registry: ModelRegistry,
                                                               name: str) -> None:
    module, _, loss, batch = _case(name)
    got = _compute(registry, name, batch, OUTPUTS, clip_norm=0.5)
    meta = got["meta"]
    assert meta["route"] == "fast_stats"
    # every parameter by its layer's own rule: no whole-model replay (method "vmap")
    assert "vmap" not in meta["method"].values(), meta["method"]
    if name == "resnet":  # BatchNorm (eval) in closed form, not replayed op by op
        assert {k for k, v in meta["method"].items() if v == "batch_norm"} == \
            {k for k in meta["method"] if k.startswith("bn.") or ".b1." in k or ".b2." in k}
    if name == "gpt2":  # Conv1D, exported as view(-1, d) + addmm: the linear family's
        assert meta["method"]["model.transformer.h.0.attn.c_attn.weight"] == "linear"
        assert meta["method"]["model.transformer.wpe.weight"] == "embedding"  # indices lifted
    if name == "bert":
        assert meta["method"]["model.bert.embeddings.position_embeddings.weight"] == "embedding"
        assert meta["method"]["model.bert.embeddings.token_type_embeddings.weight"] == \
            "embedding"
    [want] = summarize(per_sample_loop(module, batch, loss), [N], clip_norm=0.5)
    for output in OUTPUTS:
        value = got[output]
        assert not any(t.requires_grad for t in (value.values() if isinstance(value, dict)
                                                 else [value])), output
        assert_close(value, want[output], f"{name} {output}", **tolerance(output))


@pytest.mark.parametrize("name", ["resnet", "gpt2", "bert"])
def test_projection_by_fast_statistics_is_the_projected_loop(registry: ModelRegistry,
                                                             name: str) -> None:
    module, _, loss, batch = _case(name)
    got = _compute(registry, name, batch, ["projection"], projection_dim=64, projection_seed=3)
    assert got["meta"]["route"] == "fast_stats"
    loop = per_sample_loop(module, batch, loss)
    proj = Projection(64, 3)
    want = sum(proj.project(k, g.double()) for k, g in loop.grads.items())
    assert isinstance(want, torch.Tensor)
    assert_close(got["projection"], want)


# the linear layers of one transformer block, by their names in the exported program
BLOCK_LAYERS = {
    "gpt2": [f"model.transformer.h.{i}.{m}.weight" for i in (0, 1)
             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")],
    "bert": [f"model.bert.encoder.layer.{i}.{m}.weight" for i in (0, 1)
             for m in ("attention.self.query", "attention.self.key", "attention.self.value",
                       "attention.output.dense", "intermediate.dense", "output.dense")]
    + ["model.bert.pooler.dense.weight", "model.classifier.weight"],
}


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_kfac_covers_an_exported_graphs_linear_layers(registry: ModelRegistry, name: str,
                                                      tmp_path: Path) -> None:
    """K-FAC's layers in an exported program: BERT's ``aten.linear`` and GPT-2's Conv1D
    (``aten.addmm``, its weight ``[in, out]``: transposed, its bias a row), with their biases;
    EK-FAC's eigenvalues are the second moments of the loop's gradients (on the original
    module) in their bases, and preconditioning a transposed layer is the dense solve. The
    head tied to the embedding stays on the diagonal. A store's factors file gives the same
    curvature back."""
    module, _, loss, batch = _case(name)
    model = registry.get(name)
    parsed = parse_request({"model": name, "outputs": ["grads"], **_fields(batch)}, registry)
    params = list(model.params)
    curv = curvature.fit(model, loss, 1.0, params, [parsed.batch.samples()])
    assert sorted(curv.layers) == sorted(BLOCK_LAYERS[name])
    for layer in curv.layers.values():
        assert layer.transposed is (name == "gpt2")
        assert layer.bias == layer.weight.removesuffix("weight") + "bias"
    assert "model.transformer.wte.weight" in curv.diagonal or name == "bert"
    loop = {k: v.double() for k, v in per_sample_loop(module, batch, loss).grads.items()}
    for weight, layer in curv.layers.items():
        rotated = curv.bases[weight].rotate(curvature.joined(loop, layer))
        assert_close(curv.corrected[weight], rotated.square().mean(0), weight)
    # the smallest layer: its dense F is [out * (in + 1)]^2
    first = min(curv.layers.values(), key=lambda layer: model.params[layer.weight].numel())
    basis = curv.bases[first.weight]
    q = torch.kron(basis.q_grads, basis.q_inputs)
    dense = q @ torch.diag(curv.corrected[first.weight].flatten()) @ q.T
    g = curvature.joined(loop, first).flatten(1)
    damping = curv.default_damping("ekfac")
    want = torch.linalg.solve(dense + damping * torch.eye(len(dense), dtype=dense.dtype), g.T).T
    got = curv.precondition(loop, damping, "ekfac")
    assert_close(curvature.joined(got, first).flatten(1), want, first.weight)
    # a store's factors file keeps no layer's orientation: its widths tell it again
    store = StoreFiles(str(tmp_path), ThreadLocks())
    spec = StoreSpec(id="s", model=name, loss=loss, params=tuple(params), projection_dim=1,
                     projection_seed=0, projection_kind=EXACT, dtype="float32",
                     shapes={k: list(v.shape) for k, v in model.params.items()})
    store.create("s", spec)
    means = curvature.factor_means(model, loss, 1.0, params, parsed.batch.samples())
    answer = {**dict(zip(("kfac_inputs", "kfac_grads", "kfac_tokens"), means, strict=True)),
              "batch_size": len(next(iter(loop.values()))),
              "mean": {k: v.mean(0).numpy() for k, v in loop.items()},
              "variance": {k: v.var(0, correction=0).numpy() for k, v in loop.items()}}
    rows = torch.cat([loop[k].flatten(1) for k in params], 1).numpy()
    factors.add(store, [("s", spec, answer)], 1 << 30)
    factors.add_eigenvalues(store, [("s", spec, rows)], "s", 1 << 30)
    kept = factors.curvature_of(store, "s", spec, "s")
    assert kept.layers == curv.layers
    for weight in curv.layers:
        assert_close(kept.corrected[weight], curv.corrected[weight], weight)
    for name, diagonal in curv.diagonal.items():
        assert_close(kept.diagonal[name], diagonal, name)


class FlattensTheBatch(nn.Module):
    """Flattens the whole input, batch included: right at a batch of one only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(-1)).unsqueeze(0)


class MixesTheBatch(nn.Module):
    """Runs at any batch, but scales each sample by the batch's sum: right at one only."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * x.sum(0, keepdim=True))


class TwoInputs(nn.Module):
    """Two inputs and a weight read through ``w.t()``: no family has it, the whole model is
    replayed for it, with both inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 12) * 0.3)
        self.fc = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.tanh(x @ self.w.t()) * m)


def _register(module: nn.Module, example: tuple[torch.Tensor, ...]
              ) -> tuple[ModelRegistry, LoadedModel]:
    buf = io.BytesIO()
    torch.export.save(torch.export.export(module.eval(), example), buf)
    registry = ModelRegistry(torch.device("cpu"))
    model = register_exported(registry, "hand-built", buf.getvalue(), settings(),
                              default_loss="cross_entropy", losses=[])
    return registry, model


@pytest.mark.parametrize("make", [FlattensTheBatch, MixesTheBatch])
def test_a_program_that_cannot_serve_a_batch_stays_on_the_vmap_route(make: type[nn.Module]
                                                                      ) -> None:
    torch.manual_seed(0)
    module = make()
    x, y = torch.randn(N, 12), torch.tensor([0, 1, 2, 1])
    registry, model = _register(module, (x[:1],))
    assert not model.batched  # FlattensTheBatch fails at a batch on meta, the other in numbers
    parsed = parse_request({"model": model.id, "inputs": x.numpy(), "targets": y.numpy(),
                            "outputs": ["grads", "norms"]}, registry)
    [got] = engine.compute(parsed.model, parsed.batch, parsed.opts)
    assert got["meta"]["route"] != "fast_stats"  # fast statistics declined: the vmap route answered
    [want] = summarize(per_sample_loop(module, {"inputs": x, "targets": y}, "cross_entropy"),
                       [N])
    assert_close(got["grads"], want["grads"])
    assert_close(got["norms"], want["norms"])


def test_a_weight_no_family_reads_replays_the_whole_model_with_every_input() -> None:
    torch.manual_seed(0)
    module = TwoInputs()
    x, m, y = torch.randn(N, 12), (torch.rand(N, 12) > 0.3).float(), torch.tensor([0, 1, 2, 1])
    registry, model = _register(module, (x[:1], m[:1]))
    assert model.batched
    parsed = parse_request({"model": model.id, "inputs": {"x": x.numpy(), "m": m.numpy()},
                            "targets": y.numpy(), "outputs": ["grads", "norms"]}, registry)
    [got] = engine.compute(parsed.model, parsed.batch, parsed.opts)
    assert got["meta"]["route"] == "fast_stats"
    assert got["meta"]["method"] == {"w": "vmap", "fc.weight": "linear", "fc.bias": "linear"}
    [want] = summarize(per_sample_loop(module, {"inputs": {"x": x, "m": m}, "targets": y},
                                       "cross_entropy"), [N])
    assert_close(got["grads"], want["grads"])
    np.testing.assert_allclose(got["norms"], want["norms"].numpy(), atol=3e-3, rtol=1e-5)

