"""The model zoo as a plug-in registry, and the loaded-model cache of :class:`ModelRegistry`."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from models import ZOO, get_family
from models.mlp import mlp_layers
from psgrad._errors import InvalidModelSpec, ShapeMismatch, UnknownModel
from service import registration
from service.registry import ModelRegistry, load_state, weights_digest
from tests.support.layers import LIMITS, MLP

CPU = torch.device("cpu")


def test_an_unknown_architecture_names_every_family() -> None:
    with pytest.raises(UnknownModel) as info:
        get_family("resnet")
    known = sorted(ZOO)
    assert info.value.message == f"unknown architecture 'resnet'; known: {', '.join(known)}"
    assert info.value.details["known"] == known
    assert "mlp" in ZOO and ZOO.get("resnet") is None


def test_an_unknown_activation_names_every_activation() -> None:
    with pytest.raises(InvalidModelSpec, match=r"unknown activation 'swish'; known: gelu, relu"):
        mlp_layers([2, 3], "swish")
    with pytest.raises(InvalidModelSpec, match=r"activation must be a string naming one of gelu"):
        mlp_layers([2, 3], ["relu"])  # type: ignore[arg-type]  # a config's JSON, unchecked


def test_a_family_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered twice"):
        ZOO.add("mlp", get_family("mlp"))
    assert ZOO.pop("no-such-family", None) is None


def test_models_are_built_once_and_the_cache_is_bounded() -> None:
    registry = ModelRegistry(CPU, cache_size=2)
    first = registry.get("linear-value")
    assert registry.get("linear-value") is first
    assert registry.get(f"linear-value@{first.version}") is not first  # its own key, same numbers
    registry.get("value-mlp")  # a third key: the oldest is dropped
    assert registry.get("linear-value") is not first


def test_forget_drops_every_cached_version_of_one_id_only() -> None:
    registry = ModelRegistry(CPU)
    one = registration.register(registry, "one", MLP, LIMITS)
    other = registration.register(registry, "other", MLP, LIMITS)
    assert registry.get("one") is one and registry.get("other") is other
    registry.forget("one")
    again = registry.get("one")
    assert again is not one and again.version == one.version
    assert registry.get("other") is other


def test_a_version_is_the_digest_of_the_config_and_every_weight_byte() -> None:
    """Stored versions are named by it: any other bytes hashed would orphan every stored one."""
    state = {"w": torch.arange(12.0).reshape(3, 4).t(), "step": torch.tensor(3),
             "half": torch.linspace(-1, 1, 5).bfloat16(), "none": torch.zeros(0, 2),
             "mask": torch.tensor([True, False])}
    h = hashlib.sha256(json.dumps(["mlp", {"k": 1}], sort_keys=True).encode())
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(bytes(t.reshape(-1).view(torch.uint8).tolist()))
    assert weights_digest("mlp", {"k": 1}, state) == h.hexdigest()[:16]
    state["w"][0, 0] += 1
    assert weights_digest("mlp", {"k": 1}, state) != h.hexdigest()[:16]


def _on_meta() -> torch.nn.Module:
    with torch.device("meta"):
        module = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    return module.to(torch.float64)


def test_a_state_moves_into_a_module_on_meta_as_copies_in_its_dtypes() -> None:
    """An exported program is built on the meta device and its stored state moved in: each
    tensor a copy in the module's dtype, in its own place; the dict emptied as it goes where
    the caller says it was parsed for this load alone."""
    state = {k: torch.rand(v.shape) + 0.5 if v.is_floating_point() else torch.tensor(7)
             for k, v in _on_meta().state_dict().items()}
    want, sent = {k: v.clone() for k, v in state.items()}, dict(state)
    kept = _on_meta()
    load_state(kept, state)
    assert state.keys() == sent.keys() and all(state[k] is sent[k] for k in sent)  # as it was
    module = _on_meta()
    load_state(module, state, consume=True)
    assert state == {}
    got = module.state_dict()
    for loaded in (kept.state_dict(), got):
        assert not any(t.is_meta for t in loaded.values())
        for name, value in want.items():
            torch.testing.assert_close(loaded[name], value.to(loaded[name].dtype), msg=name)
    assert got["0.weight"].dtype == torch.float64 and got["1.num_batches_tracked"].item() == 7
    assert all(got[k].data_ptr() != sent[k].data_ptr() for k in sent)  # none shares a place
    assert isinstance(module[0].weight, torch.nn.Parameter)
    assert "running_mean" in module[1]._buffers and "1.running_mean" in got  # still persistent
    out = module.eval()(torch.ones(4, 3, dtype=torch.float64))
    assert out.shape == (4, 2) and out.isfinite().all()


def test_a_wrong_shape_is_refused_before_any_tensor_moves() -> None:
    state = {k: torch.zeros(v.shape) for k, v in _on_meta().state_dict().items()}
    state["1.running_var"] = torch.zeros(3)
    with pytest.raises(ShapeMismatch, match=r"'1\.running_var' has shape \[3\]"):
        load_state(_on_meta(), state, consume=True)
    assert len(state) == len(_on_meta().state_dict())
