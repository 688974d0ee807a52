"""The model zoo as a plug-in registry, and the loaded-model cache of :class:`ModelRegistry`."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from models import ZOO, get_family
from models.mlp import mlp_layers
from psgrad._errors import InvalidModelSpec, UnknownModel
from service import registration
from service.registry import ModelRegistry, weights_digest
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
