"""The MindSpore per-sample-gradients tutorial's linear value function V(s) = theta . s."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from models.base import ModelFamily, TensorSpec, register_model
from psgrad._errors import InvalidModelSpec


class LinearValue(nn.Module):
    def __init__(self, dim: int, bias: bool) -> None:
        super().__init__()
        self.theta = nn.Parameter(torch.randn(dim) * 0.1)
        self.bias = nn.Parameter(torch.zeros(())) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        v = x @ self.theta
        return v + self.bias if self.bias is not None else v


@register_model
class LinearValueFamily(ModelFamily):
    name = "linear-value"
    default_config: ClassVar[dict[str, Any]] = {"dim": 3, "bias": False}
    default_loss = "td0"
    losses = ("td0", "mse")

    def build(self, config: dict[str, Any]) -> nn.Module:
        if not isinstance(config["dim"], int) or config["dim"] < 1:
            raise InvalidModelSpec(f"dim must be a positive integer; got {config['dim']!r}")
        return LinearValue(config["dim"], bool(config["bias"]))

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        return TensorSpec((config["dim"],))
