"""The PyTorch per-sample-gradients tutorial's CNN, exactly as the tutorial writes it."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from models.base import ModelFamily, TensorSpec, register_model


class SimpleCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return F.log_softmax(self.fc2(x), dim=1)


@register_model
class SimpleCNNFamily(ModelFamily):
    name = "simple-cnn"
    default_config: ClassVar[dict[str, Any]] = {}
    default_loss = "nll"
    losses = ("nll", "margin")

    def build(self, config: dict[str, Any]) -> nn.Module:
        return SimpleCNN()

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        return TensorSpec((1, 28, 28))
