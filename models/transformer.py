"""A small transformer classifier over integer tokens."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from models.base import ModelFamily, TensorSpec, register_model


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, seq_len: int, d_model: int, nhead: int, dim_ff: int,
                 layers: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.encoder = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, nhead, dim_ff, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos
        for layer in self.encoder:
            x = layer(x)
        return self.head(x.mean(dim=1))


@register_model
class TinyTransformerFamily(ModelFamily):
    name = "tiny-transformer"
    default_config: ClassVar[dict[str, Any]] = {
        "vocab": 1000, "seq_len": 32, "d_model": 64, "nhead": 4, "dim_ff": 128, "layers": 2,
        "classes": 4,
    }
    default_loss = "cross_entropy"
    losses = ("cross_entropy", "margin")

    def build(self, config: dict[str, Any]) -> nn.Module:
        return TinyTransformer(**config)

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        return TensorSpec((config["seq_len"],), "int64", high=config["vocab"])
