"""Models exported with ``torch.export``, their archives, and tools to craft hostile ones.

The references are the original ``nn.Module`` objects, differentiated one sample at a time with
``torch.autograd.grad``: the obviously correct slow path that the loaded graphs are held to.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from itertools import pairwise
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

TOL = {"atol": 3e-3, "rtol": 1e-5}


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(4 * 3 * 3, 3)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(F.relu(self.conv(x)))
        return self.fc(self.drop(h.flatten(1)))


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b1 = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.b2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.bn = nn.BatchNorm2d(6)
        self.blocks = nn.Sequential(Block(6), Block(6))
        self.fc = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class TinyGPT(nn.Module):
    """Causal self-attention, GELU MLP, layer norms and an output head tied to the embedding."""

    def __init__(self, vocab: int = 17, dim: int = 16, heads: int = 2, length: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Parameter(torch.randn(length, dim) * 0.1)
        self.ln1, self.ln2, self.ln_f = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 32), nn.GELU(approximate="tanh"),
                                 nn.Dropout(0.1), nn.Linear(32, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.heads = heads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, t = ids.shape
        h = self.wte(ids) + self.wpe[:t]
        q, k, v = self.qkv(self.ln1(h)).split(h.shape[-1], dim=-1)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool, device=ids.device))
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        h = h + self.proj((att @ v).transpose(1, 2).reshape(b, t, -1))
        h = h + self.mlp(self.ln2(h))
        return self.head(self.ln_f(h))


@dataclass
class ExportCase:
    name: str
    make: Callable[[], nn.Module]
    example: Callable[[int], torch.Tensor]  # a batch of n samples
    loss: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # (out, x, y)
    target: Callable[[int], torch.Tensor]
    dynamic: dict[int, Any] | None = None


def _class_loss(out: torch.Tensor, _x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y.reshape(1))


def _token_loss(out: torch.Tensor, ids: torch.Tensor, _y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out[0, :-1], ids.reshape(-1)[1:])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


CASES = {
    "cnn": ExportCase("cnn", SmallCNN, lambda n: torch.randn(n, 1, 8, 8, generator=_gen(1)),
                      _class_loss, lambda n: torch.randint(0, 3, (n,), generator=_gen(2))),
    "resnet": ExportCase("resnet", ResNet, lambda n: torch.randn(n, 3, 8, 8, generator=_gen(1)),
                         _class_loss, lambda n: torch.randint(0, 4, (n,), generator=_gen(2))),
    "gpt": ExportCase("gpt", TinyGPT, lambda n: torch.randint(0, 17, (n, 7), generator=_gen(1)),
                      _token_loss, lambda n: torch.zeros(n)),
}


@cache
def exported(name: str) -> tuple[nn.Module, bytes]:
    """The case's module (eval, seeded weights, BatchNorm statistics moved off 0/1) and archive."""
    case = CASES[name]
    torch.manual_seed(0)
    module = case.make()
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
    module.eval()
    ep = torch.export.export(module, (case.example(1),))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return module, buf.getvalue()


def entries(data: bytes) -> dict[str, bytes]:
    """Every entry of an archive by its name below the root folder."""
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {i.filename.partition("/")[2]: zf.read(i) for i in zf.infolist()}


def rewrite(data: bytes, changes: dict[str, bytes | None],
            compression: int = zipfile.ZIP_STORED) -> bytes:
    """``data`` with entries replaced, added (bytes) or removed (None), names below the root."""
    current = entries(data)
    current.update({k: v for k, v in changes.items() if v is not None})
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as zf:
        for name, blob in current.items():
            if changes.get(name, b"") is not None:
                zf.writestr(f"archive/{name}", blob)
    return out.getvalue()


def program(data: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(entries(data)["models/model.json"])
    return doc


def with_program(data: bytes, doc: dict[str, Any]) -> bytes:
    return rewrite(data, {"models/model.json": json.dumps(doc).encode()})


def deep(data: bytes, n: int, after: str = "relu") -> bytes:
    """``data`` with a chain of ``n`` more relu nodes after the node ``after``.

    A legitimate program (every op allowed, the output unchanged) whose checking costs CPU in
    proportion to ``n``: parsing, building and the dry run all walk every node.
    """
    doc = program(data)
    nodes = doc["graph_module"]["graph"]["nodes"]
    at = next(i for i, node in enumerate(nodes) if node["name"] == after)
    names = [after, *(f"deep{k}" for k in range(1, n + 1))]
    chain = [{"target": "torch.ops.aten.relu.default", "name": out, "metadata": {},
              "inputs": [{"name": "self", "arg": {"as_tensor": {"name": src}}, "kind": 1}],
              "outputs": [{"as_tensor": {"name": out}}]}
             for src, out in pairwise(names)]
    for node in nodes[at + 1:]:
        for arg in node["inputs"]:
            if arg["arg"].get("as_tensor", {}).get("name") == after:
                arg["arg"]["as_tensor"]["name"] = names[-1]
    nodes[at + 1:at + 1] = chain
    return with_program(data, doc)


# ----------------------------------------------------------------------------- transformers


class Logits(nn.Module):
    """A Hugging Face model as a function of (input_ids, attention_mask) -> logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


VOCAB = 50


def hf_model(name: str) -> nn.Module:
    """A 2-layer GPT-2 LM or BERT classifier from transformers' configs, random init."""
    import transformers as tf

    torch.manual_seed(0)
    small = {"vocab_size": VOCAB, "attn_implementation": "eager"}
    if name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=32,
                                                 bos_token_id=0, eos_token_id=0, **small))
    else:
        model = tf.BertForSequenceClassification(tf.BertConfig(
            num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=32, num_labels=3, **small))
    return Logits(model).eval()


@cache
def exported_hf(name: str) -> tuple[nn.Module, bytes]:
    """The model and its archive, exported at length 8 with a dynamic length in [2, 32]."""
    module = hf_model(name)
    length = torch.export.Dim("length", min=2, max=32)
    ids, mask = token_batch(1, 8)
    ep = torch.export.export(module, (ids, mask), dynamic_shapes=({1: length}, {1: length}))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return module, buf.getvalue()


def token_batch(n: int, length: int, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask padded on the right (sample i keeps length - i tokens)."""
    ids = torch.randint(1, VOCAB, (n, length), generator=_gen(seed))
    mask = torch.ones(n, length, dtype=torch.int64)
    for i in range(n):
        mask[i, max(2, length - i):] = 0
    return ids * mask, mask
