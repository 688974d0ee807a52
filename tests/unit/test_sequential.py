"""The ``sequential`` family and the registration checks, without the HTTP layer."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from models.sequential import LAYERS
from psgrad._errors import (
    BadRequest,
    BatchCoupling,
    Conflict,
    DtypeMismatch,
    InvalidModelSpec,
    NonFinite,
    ShapeMismatch,
    TooLarge,
    UnknownModel,
)
from service import engine, registration
from service.model_store import FileModelStore, MemoryModelStore
from service.registry import ModelRegistry
from service.validate import parse_request
from tests.support.layers import CASES, LIMITS, MLP, Case, perturbed, reference_model
from tests.support.reference import TOL, per_sample_loop


@pytest.fixture
def registry() -> ModelRegistry:
    return ModelRegistry(device=torch.device("cpu"), store=MemoryModelStore())


def test_every_allowed_type_has_a_case() -> None:
    covered = {layer["type"] for case in CASES for layer in case.layers}
    assert covered == set(LAYERS)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_grads_match_the_per_sample_loop(case: Case, registry: ModelRegistry) -> None:
    registration.register(registry, case.name, case.spec(), LIMITS)
    _, raw = registration.export_weights(registry, case.name)
    state = perturbed(st_load(raw))
    model = registration.replace_weights(registry, case.name, st_save(state), LIMITS)
    assert model.route == "vmap"  # recurrent layers too: they are unrolled
    x, y = case.batch()
    parsed = parse_request({"model": case.name, "inputs": x.numpy(), "targets": y.numpy(),
                            "outputs": ["grads", "norms"]}, registry)
    [out] = engine.compute(parsed.model, parsed.batch, parsed.opts)
    loop = per_sample_loop(reference_model(case, state), {"inputs": x, "targets": y}, case.loss)
    grads, norms = loop.grads, loop.norms
    assert list(out["grads"]) == list(grads)
    for name, g in grads.items():
        torch.testing.assert_close(out["grads"][name], g, **TOL)
    torch.testing.assert_close(out["norms"], norms, **TOL)


def test_new_weights_reuse_the_transformed_function(registry: ModelRegistry) -> None:
    first = registration.register(registry, "m", MLP, LIMITS)
    state = perturbed({**first.params, **first.buffers})
    second = registration.replace_weights(registry, "m", st_save(state), LIMITS)
    assert second.version != first.version
    assert engine.per_sample_fn(first, "cross_entropy", 1.0) is engine.per_sample_fn(
        second, "cross_entropy", 1.0)


@pytest.mark.parametrize(("layers", "match"), [
    ([{"type": "Lambda", "args": []}], "not allowed; allowed: Linear, Bilinear"),
    ([{"type": "Linear", "args": [4, "os.system"]}], "'out_features' must be a number"),
    ([{"type": "Linear", "args": [4, 2], "kwargs": {"device": "cuda"}}], "unknown argument"),
    ([{"type": "Linear", "args": [4, {"x": 1}]}], "must be a number"),
    ([{"type": "Linear", "args": [4, 2, True, 1]}], "at most 3 positional"),
    ([{"type": "Linear", "args": [4, -2]}], "cannot be built"),
    ([{"type": "Linear", "args": [4, 2**70]}], r"cannot be built from these arguments: [^\n]*$"),
    ([{"type": "Linear", "args": [4, 2], "extra": 1}], "unknown keys"),
    ([{"type": "GRU", "args": [4, 2], "kwargs": {"batch_first": False}}], "batch_first"),
    ([{"type": "TransformerEncoderLayer", "args": [4, 2],
       "kwargs": {"activation": "torch.nn.functional.relu"}}], "must be one of relu, gelu"),
    ([{"type": "Bilinear", "args": [4, 3, 2]}], "must be equal"),
    ([{"type": "Softmax"}], "dim is required"),
    ([{"type": "Linear", "args": [5, 2]}], r"layer 0 \(Linear\): fails on its input"),
    ([{"type": "Linear", "args": [4, 4]}, {"type": "Conv2d", "args": [1, 1, 3]}],
     r"layer 1 \(Conv2d\)"),
    ([{"type": "Linear", "args": [4, 2]}, {"type": "Mean", "kwargs": {"dim": 0}}],
     r"layer 1 \(Mean\).*batch dimension"),
    ([{"type": "GRU", "args": [4, 2]}], r"layer 0 \(GRU\): 2000 steps"),
    ([{"type": "Linear", "args": [4, 2]}, {"type": "SelectStep", "kwargs": {"index": 5}}],
     r"layer 1 \(SelectStep\).*out of bounds"),
    ([], "non-empty list"),
])
def test_bad_specs_are_refused_naming_the_layer(layers: list, match: str,
                                                registry: ModelRegistry) -> None:
    shape = [2000, 4] if layers and layers[0]["type"] == "GRU" else [4]
    with pytest.raises(InvalidModelSpec, match=match) as info:
        registration.register(registry, "bad", {**MLP, "layers": layers,
                                                "input": {"shape": shape}}, LIMITS)
    assert info.value.status == 422
    assert registry.store.ids() == []


@pytest.mark.parametrize("sent, said", [(5, "got 5$"), ("5", "got '5'$"), (None, "got None$")])
def test_an_unknown_architecture_is_refused_showing_what_was_sent(
        sent: object, said: str, registry: ModelRegistry) -> None:
    with pytest.raises(InvalidModelSpec, match="'architecture' must be one of .*mlp.*" + said):
        registration.register(registry, "bad", {**MLP, "architecture": sent}, LIMITS)


def test_mean_over_several_dims(registry: ModelRegistry) -> None:
    spec = {**MLP, "layers": [{"type": "Mean", "kwargs": {"dim": [1, 2]}},
                              {"type": "Linear", "args": [2, 2]}], "input": {"shape": [4, 3, 2]}}
    model = registration.register(registry, "mean", spec, LIMITS)
    x = torch.randn(2, 4, 3, 2)
    torch.testing.assert_close(model.module(x), model.module[1](x.mean((1, 2))))


def test_batch_statistics_are_refused(registry: ModelRegistry) -> None:
    spec = {**MLP, "layers": [{"type": "InstanceNorm1d", "args": [1],
                               "kwargs": {"track_running_stats": True, "momentum": 0.5}},
                              {"type": "Flatten"}, {"type": "Linear", "args": [4, 2]}],
            "input": {"shape": [1, 4]}}
    registration.register(registry, "in", spec, LIMITS)  # eval: running stats, no update
    spec = {**MLP, "layers": [{"type": "Linear", "args": [4, 2]},
                              {"type": "BatchNorm1d", "args": [2],
                               "kwargs": {"track_running_stats": False}}]}
    with pytest.raises(InvalidModelSpec, match="unknown argument 'track_running_stats'"):
        registration.register(registry, "bn", spec, LIMITS)


def test_coupling_layers_are_refused_by_the_dry_run(registry: ModelRegistry) -> None:
    # Softmax over the batch dimension mixes samples: the dry run catches it
    spec = {**MLP, "layers": [{"type": "Linear", "args": [4, 2]},
                              {"type": "Softmax", "kwargs": {"dim": 0}}]}
    with pytest.raises(BatchCoupling):
        registration.register(registry, "sm", spec, LIMITS)


@pytest.mark.parametrize(("spec", "match"), [
    ({**MLP, "layers": [{"type": "Identity"}] * 9 + MLP["layers"]}, "9 layers|10 layers"),
    ({**MLP, "layers": [{"type": "Linear", "args": [4, 100_000]}]}, "parameters"),
    ({**MLP, "layers": [{"type": "Linear", "args": [4, 10**9]}, {"type": "Linear",
                                                                  "args": [10**9, 2]}]},
     "parameters"),
    ({**MLP, "layers": [{"type": "ConvTranspose2d", "args": [1, 1, 1], "kwargs": {"stride": 500}},
                        {"type": "Flatten"}, {"type": "Linear", "args": [1, 2]}],
      "input": {"shape": [1, 4, 4]}}, "activation elements"),
    ({"architecture": "mlp", "config": {"sizes": [4, 10**6, 2]}}, "parameters"),
    ({**MLP, "layers": [{"type": "TransformerEncoderLayer", "args": [2, 1, 2]}],
      "input": {"shape": [400, 2]}}, r"activation elements by layer 0 \(Transformer"),
])
def test_limits(spec: dict, match: str, registry: ModelRegistry) -> None:
    with pytest.raises(TooLarge, match=match) as info:
        registration.register(registry, "big", spec, LIMITS)
    assert info.value.status == 413


@pytest.mark.parametrize("bad", ["", "Upper", "-lead", ".hidden", "a/b", "../etc", "a@b",
                                 "x" * 65, "sp ace", "é"])
def test_bad_ids_are_refused(bad: str, registry: ModelRegistry) -> None:
    with pytest.raises(BadRequest, match="invalid model id"):
        registration.register(registry, bad, MLP, LIMITS)


def test_zoo_names_cannot_be_registered_or_deleted(registry: ModelRegistry) -> None:
    with pytest.raises(Conflict):
        registration.register(registry, "mlp", MLP, LIMITS)
    with pytest.raises(Conflict):
        registration.delete(registry, "mlp")
    with pytest.raises(UnknownModel):  # 'sequential' needs a spec: not served by its name
        registry.get("sequential")


def test_bad_weights(registry: ModelRegistry) -> None:
    model = registration.register(registry, "m", MLP, LIMITS)
    good = {k: v.clone() for k, v in model.params.items()}
    cases = [
        ({**good, "extra": torch.zeros(1)}, ShapeMismatch, "unknown \\['extra'\\]"),
        ({"0.weight": good["0.weight"]}, ShapeMismatch, "missing \\['0.bias'\\]"),
        ({**good, "0.bias": torch.zeros(3)}, ShapeMismatch, "shape \\[3\\]"),
        ({**good, "0.bias": torch.zeros(2, dtype=torch.float64)}, DtypeMismatch, "float64"),
        ({**good, "0.bias": torch.tensor([1.0, float("nan")])}, NonFinite, "NaN"),
        ({**good, "0.bias": torch.tensor([1.0, float("inf")])}, NonFinite, "infinity"),
    ]
    for state, error, match in cases:
        with pytest.raises(error, match=match):
            registration.replace_weights(registry, "m", st_save(state), LIMITS)
    assert registry.store.versions("m") == [model.version]


@pytest.mark.parametrize("body", [
    pickle.dumps({"0.weight": np.zeros((2, 4))}),
    b"PK\x03\x04" + b"\x00" * 64,  # a torch.save zip archive
    b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ",
    b"short",
])
def test_non_safetensors_bodies_are_refused(body: bytes, registry: ModelRegistry) -> None:
    registration.register(registry, "m", MLP, LIMITS)
    with pytest.raises(BadRequest):
        registration.replace_weights(registry, "m", body, LIMITS)


def test_inline_json_weights_and_versions(registry: ModelRegistry) -> None:
    w = {"0.weight": [[1, 0, 0, 0], [0, 1, 0, 0]], "0.bias": [0.5, -0.5]}
    first = registration.register(registry, "m", {**MLP, "weights": w}, LIMITS)
    assert first.params["0.weight"].dtype == torch.float32
    assert first.params["0.bias"].tolist() == [0.5, -0.5]
    second = registration.register(registry, "m", MLP, LIMITS)  # seeded initial weights
    assert registry.get("m").version == second.version
    assert registry.get(f"m@{first.version}").params["0.bias"].tolist() == [0.5, -0.5]
    assert registry.describe("m")["versions"] == [first.version, second.version]
    registration.delete(registry, f"m@{second.version}")
    assert registry.get("m").version == first.version
    with pytest.raises(UnknownModel, match="no version"):
        registry.get(f"m@{second.version}")


def test_file_store_survives_a_restart(tmp_path: object) -> None:
    first = ModelRegistry(device=torch.device("cpu"), store=FileModelStore(str(tmp_path)))
    model = registration.register(first, "m", MLP, LIMITS)
    again = ModelRegistry(device=torch.device("cpu"), store=FileModelStore(str(tmp_path)))
    assert again.get("m").version == model.version
    torch.testing.assert_close(again.get("m").params, model.params, rtol=0, atol=0)


@pytest.mark.parametrize("ref", ["..", "../etc", "a/../b", "x@../..", "M", ".", "_"])
def test_unsafe_refs_never_reach_the_file_store(ref: str, tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "outside.json").write_text('{"created": 1}')
    registry = ModelRegistry(device=torch.device("cpu"), store=FileModelStore(tmp_path / "store"))
    with pytest.raises(UnknownModel):
        registry.get(ref)
    assert registry.store.versions("..") == [] and registry.store.doc("..", "outside") is None
