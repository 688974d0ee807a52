"""Exported programs on fast statistics: the batch of one made generic at registration, the aten
calls captured by the layer families, every statistic equal to the per-sample loop on the
original module; a program whose batch cannot be made generic stays on the vmap route."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from service import engine
from service.export.batch import BATCH_NAME
from service.registration import register_exported
from service.registry import LoadedModel, ModelRegistry
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

