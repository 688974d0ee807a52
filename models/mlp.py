"""Multi-layer perceptrons: a classifier and a value network for TD(0)."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from typing import Any, ClassVar

import torch
from torch import nn

from models.base import ModelFamily, TensorSpec, register_model
from psgrad._errors import InvalidModelSpec
from service.plugins import Registry

ACTIVATIONS: Registry[str, type[nn.Module]] = Registry("activation", InvalidModelSpec)
for _name, _layer in [("relu", nn.ReLU), ("tanh", nn.Tanh), ("gelu", nn.GELU), ("silu", nn.SiLU),
                      ("sigmoid", nn.Sigmoid)]:
    ACTIVATIONS.add(_name, _layer)


def mlp_layers(sizes: list[int], activation: str) -> nn.Sequential:
    """``fc1, act1, fc2, ...``: Linear layers between ``sizes``, no activation after the last."""
    if len(sizes) < 2 or not all(isinstance(s, int) and s > 0 for s in sizes):
        raise InvalidModelSpec(f"sizes must list at least two positive integers; got {sizes}")
    if not isinstance(activation, str):
        raise InvalidModelSpec(f"activation must be a string naming one of "
                               f"{', '.join(ACTIVATIONS.names())}; got {activation!r}")
    make = ACTIVATIONS[activation]  # checked before any layer is built
    layers: OrderedDict[str, nn.Module] = OrderedDict()
    for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes), start=1):
        layers[f"fc{i}"] = nn.Linear(n_in, n_out)
        if i < len(sizes) - 1:
            layers[f"act{i}"] = make()
    return nn.Sequential(layers)


@register_model
class MLPFamily(ModelFamily):
    name = "mlp"
    default_config: ClassVar[dict[str, Any]] = {"sizes": [784, 512, 512, 10], "activation": "relu"}
    default_loss = "cross_entropy"
    losses = ("cross_entropy", "mse", "margin")

    def build(self, config: dict[str, Any]) -> nn.Module:
        return mlp_layers(config["sizes"], config["activation"])

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        return TensorSpec((config["sizes"][0],))


class ValueMLP(nn.Module):
    """V(s): an MLP with one output, squeezed to one scalar per state."""

    def __init__(self, sizes: list[int], activation: str) -> None:
        super().__init__()
        self.net = mlp_layers([*sizes, 1], activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).squeeze(-1)


@register_model
class ValueMLPFamily(ModelFamily):
    name = "value-mlp"
    default_config: ClassVar[dict[str, Any]] = {"sizes": [8, 64, 64], "activation": "tanh"}
    default_loss = "td0"
    losses = ("td0", "mse")

    def build(self, config: dict[str, Any]) -> nn.Module:
        return ValueMLP(config["sizes"], config["activation"])

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        return TensorSpec((config["sizes"][0],))
