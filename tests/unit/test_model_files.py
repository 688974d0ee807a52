"""A model directory's versions loaded by a new process: the weights file mapped where it lies,
not read whole, and a version whose weights went reported as deleted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from psgrad import UnknownModel
from service import registration
from service.model_store import FileModelStore
from service.registry import ModelRegistry
from tests.support.layers import LIMITS, MLP

WEIGHTS = {"0.weight": [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]], "0.bias": [0.5, -1.0]}


def _registry(folder: Path) -> ModelRegistry:
    return ModelRegistry(device=torch.device("cpu"), store=FileModelStore(folder))


def test_a_new_process_maps_the_weights_file(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The version a new registry loads has the registered weights, bit for bit, from the
    version's safetensors file; the store is asked for the spec alone."""
    version = registration.register(_registry(tmp_path), "m", {**MLP, "weights": WEIGHTS},
                                    LIMITS).version
    store = FileModelStore(tmp_path)
    asked: list[bool] = []
    get = store.get

    def spying(model_id: str, v: str, *, weights: bool = True) -> Any:
        asked.append(weights)
        return get(model_id, v, weights=weights)

    monkeypatch.setattr(store, "get", spying)
    assert store.weights_file("m", version) == tmp_path / "m" / f"{version}.safetensors"
    model = ModelRegistry(device=torch.device("cpu"), store=store).get("m")
    assert model.version == version and asked == [False]
    for name, value in WEIGHTS.items():
        assert torch.equal(model.params[name], torch.tensor(value))
    assert get("m", version, weights=False).weights == b""  # type: ignore[union-attr]


def test_a_version_without_its_weights_file_is_deleted(tmp_path: Path) -> None:
    version = registration.register(_registry(tmp_path), "m", MLP, LIMITS).version
    (tmp_path / "m" / f"{version}.safetensors").unlink()
    store = FileModelStore(tmp_path)
    assert store.weights_file("m", version) is None and store.get("m", version) is None
    with pytest.raises(UnknownModel, match="was deleted"):
        ModelRegistry(device=torch.device("cpu"), store=store).get(f"m@{version}")
