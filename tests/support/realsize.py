"""The real-size benchmark's architectures, sized by their configurations: GPT-2 (its output
layer tied to the token embedding), a BERT classifier and ResNet-18. Full size in
``benchmarks/realsize.py``; two layers, narrow widths and short sequences in the tests."""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tests.support.export import Logits

SMALL: dict[str, dict[str, Any]] = {
    "gpt2": {"n_layer": 2, "n_embd": 32, "n_head": 2, "n_positions": 32, "vocab_size": 61,
             "bos_token_id": 0, "eos_token_id": 0},
    "bert": {"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2,
             "intermediate_size": 64, "max_position_embeddings": 32, "vocab_size": 61},
}


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                            nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's ``resnet18()`` layout (11.7M parameters at ``width=64``), without
    torchvision; BatchNorm's running statistics moved off 0 and 1, as after training."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for scale, stride in ((1, 1), (2, 2), (4, 2), (8, 2)):
            cout = width * scale
            layers.append(nn.Sequential(BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)))
            cin = cout
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, classes)
        for m in self.modules():
            if isinstance(m, nn.BatchNorm2d):
                assert m.running_mean is not None and m.running_var is not None
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def hf(name: str, **config: Any) -> nn.Module:
    """GPT-2 (``GPT2LMHeadModel``) or a BERT classifier (``BertForSequenceClassification``)
    from ``config`` with random weights, eager attention, as ``(ids, mask) -> logits``."""
    import transformers as tf

    config = {"attn_implementation": "eager", **config}
    if name == "gpt2":
        model: nn.Module = tf.GPT2LMHeadModel(tf.GPT2Config(**config))
    else:
        model = tf.BertForSequenceClassification(tf.BertConfig(**config))
    return Logits(model).eval()


def export(module: nn.Module, example: tuple[torch.Tensor, ...], max_length: int) -> bytes:
    """The module exported at a batch of one, the sequence length dynamic (several inputs)."""
    dynamic = None
    if len(example) > 1:
        length = torch.export.Dim("length", min=2, max=max_length)
        dynamic = tuple({1: length} for _ in example)
    buf = io.BytesIO()
    torch.export.save(torch.export.export(module, example, dynamic_shapes=dynamic), buf)
    return buf.getvalue()


def padded_tokens(n: int, length: int, vocab: int, gen: torch.Generator
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and an attention mask, every fourth sample (from the first) padded on the right."""
    ids = torch.randint(1, vocab, (n, length), generator=gen)
    mask = torch.ones(n, length, dtype=torch.int64)
    for i in range(0, n, 4):
        mask[i, length - max(1, length // 4):] = 0
    return ids * mask, mask
