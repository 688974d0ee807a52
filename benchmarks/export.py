"""Exported models: the vmap route on the loaded graph, the per-sample loop, fast statistics.

    python benchmarks/export.py [--rounds 5] [--models resnet,gpt2,bert]

Three models are exported with ``torch.export`` and registered through psgrad's own loader
(the child process, the strict graph builder): a ResNet-style CNN with BatchNorm in eval mode
(B=32, 3x32x32), a tiny GPT-2 (transformers' ``GPT2Config(n_layer=2, n_embd=64)``, eager
attention, vocabulary 1000, next-token loss over a padded batch with its mask; B=16, T=32) and a
BERT-style classifier (``BertForSequenceClassification``, 2 layers of 64; B=16, T=32). For each
output (``grads``, ``norms``) it times:

- ``loop``: the per-sample loop on the original module (batch of one, ``autograd.grad``);
- ``vmap``: ``engine.compute`` on the loaded graph with fast statistics off;
- ``fast``: ``engine.compute`` with fast statistics on, when they serve the call
  (``meta.route == "fast_stats"``; otherwise "declines": the call took the vmap route).

Every method runs once per round, rounds interleaved; times are medians and ratios the median
of per-round ratios (our machine is shared; with two threads on busy cores the wall times are
dominated by threads waiting for each other, so docs/benchmarks-export.md takes one thread:
``OMP_NUM_THREADS=1``). Before timing, each method's norms are checked
against the loop's. Needs ``transformers`` (``pip install --no-deps transformers`` plus its small
dependencies: without ``--no-deps`` pip replaces torch).
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")  # before torch allocates anything

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from service import engine
from service.config import Settings
from service.registration import register_exported
from service.registry import ModelRegistry
from service.validate import parse_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: from the root
from tests.support.export import Logits  # (input_ids, attention_mask) -> logits

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fast_stats import interleave, ratio  # rounds interleaved; median per-round ratios

OUTPUTS = ("grads", "norms")
METHODS = ("loop", "vmap", "fast")
VOCAB, LENGTH = 1000, 32


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.b2(self.c2(F.relu(self.b1(self.c1(x))))))


class ResNet(nn.Module):
    def __init__(self, c: int = 16, classes: int = 10) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.blocks = nn.Sequential(Block(c), nn.MaxPool2d(2), Block(c), nn.MaxPool2d(2))
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(F.relu(self.bn(self.stem(x))))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


@dataclass
class Case:
    module: nn.Module
    inputs: dict[str, torch.Tensor]  # the batch, by input name
    targets: torch.Tensor
    loss: str  # psgrad's loss name
    mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return len(next(iter(self.inputs.values())))


def _tokens(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and a mask padded on the right: sample i keeps between T/2 and T tokens."""
    ids = torch.randint(1, VOCAB, (n, LENGTH), generator=gen)
    mask = torch.ones(n, LENGTH, dtype=torch.int64)
    for i in range(n):
        mask[i, LENGTH - (i * LENGTH // (2 * n)):] = 0
    return ids * mask, mask


def make_case(name: str) -> Case:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "resnet":
        module = ResNet()
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):  # statistics as after training, not 0 and 1
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
        x = torch.randn(32, 3, 32, 32, generator=gen)
        return Case(module.eval(), {"x": x}, torch.randint(0, 10, (32,), generator=gen),
                    "cross_entropy")
    import transformers as tf

    small = {"vocab_size": VOCAB, "attn_implementation": "eager"}
    ids, mask = _tokens(16, gen)
    if name == "gpt2":
        lm = tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=64,
                                              bos_token_id=0, eos_token_id=0, **small))
        return Case(Logits(lm).eval(), {"input_ids": ids, "attention_mask": mask}, ids,
                    "next_token", mask)
    bert = tf.BertForSequenceClassification(tf.BertConfig(
        num_hidden_layers=2, hidden_size=64, num_attention_heads=2, intermediate_size=256,
        max_position_embeddings=64, num_labels=3, **small))
    return Case(Logits(bert).eval(), {"input_ids": ids, "attention_mask": mask},
                torch.randint(0, 3, (16,), generator=gen), "cross_entropy")


def pt2(case: Case) -> bytes:
    """The case's module exported at a batch of one (the sequence length dynamic) and saved."""
    example = tuple(v[:1] for v in case.inputs.values())
    dynamic = None
    if len(example) > 1:
        length = torch.export.Dim("length", min=2, max=64)
        dynamic = tuple({1: length} for _ in example)
    ep = torch.export.export(case.module, example, dynamic_shapes=dynamic)
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    return buf.getvalue()


def loop(case: Case) -> Callable[[], dict[str, Any]]:
    """Per-sample gradients and norms by the loop on the original module (tied weights once)."""
    module = case.module
    params = [p for p in module.parameters() if p.requires_grad]

    def loss(i: int) -> torch.Tensor:
        out = module(*(v[i:i + 1] for v in case.inputs.values()))
        if case.loss == "cross_entropy":
            return F.cross_entropy(out, case.targets[i:i + 1])
        assert case.mask is not None  # next_token: scores [:-1] against ids [1:], masked
        keep = case.mask[i, 1:].to(out.dtype)
        picked = F.cross_entropy(out[0, :-1], case.targets[i, 1:], reduction="none")
        return (picked * keep).sum() / keep.sum()

    def run() -> dict[str, Any]:
        grads = [torch.autograd.grad(loss(i), params) for i in range(case.size)]
        stacked = [torch.stack(g) for g in zip(*grads, strict=True)]
        sq = sum(g.flatten(1).pow(2).sum(1) for g in stacked)
        return {"grads": stacked, "norms": torch.as_tensor(sq).sqrt()}

    return run


def served(registry: ModelRegistry, name: str, case: Case, output: str,
           fast: bool) -> Callable[[], dict[str, Any]]:
    fields: dict[str, Any] = {
        "model": name, "outputs": [output], "targets": case.targets.numpy(),
        "inputs": {k: v.numpy() for k, v in case.inputs.items()}}
    if case.mask is not None:
        fields["mask"] = case.mask.numpy()
    parsed = parse_request(fields, registry)
    return lambda: engine.compute(parsed.model, parsed.batch, parsed.opts, fast_stats=fast)[0]


def time_model(name: str, rounds: int) -> tuple[Case, dict[tuple[str, str], list[float]],
                                                dict[str, str]]:
    """Seconds per (output, method) and round, and what the fast path did with each output."""
    case = make_case(name)
    registry = ModelRegistry(torch.device("cpu"))
    settings = Settings(redis_url=None, model_dir=None, device="cpu")
    register_exported(registry, name, pt2(case), settings, default_loss=case.loss, losses=[])
    want = loop(case)()["norms"]
    fns: dict[tuple[str, str], Callable[[], Any]] = {}
    paths: dict[str, str] = {}
    for output in OUTPUTS:
        fns[(output, "loop")] = loop(case)
        fns[(output, "vmap")] = served(registry, name, case, output, fast=False)
        fast = served(registry, name, case, output, fast=True)
        paths[output] = fast()["meta"].get("route", "vmap")
        if paths[output] == "fast_stats":
            fns[(output, "fast")] = fast
    check = {"vmap": served(registry, name, case, "norms", fast=False)(),
             "fast": served(registry, name, case, "norms", fast=True)()}
    for method, answer in check.items():
        got = np.asarray(answer["norms"])
        diff = float(np.max(np.abs(got - want.numpy()) / (1 + want.numpy())))
        print(f"{name}: {method} norms vs the loop: max relative diff {diff:.1e}")
        assert diff < 3e-3, (name, method, diff)
    return case, interleave(fns, rounds), paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="resnet,gpt2,bert")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}, medians of "
          f"{args.rounds} interleaved rounds; x loop = median per-round ratio to the loop\n")
    rows = ["| model | B | output | method | time ms | x loop |", "|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        case, times, paths = time_model(name, args.rounds)
        for output in OUTPUTS:
            for method in METHODS:
                key = (output, method)
                if key not in times:
                    rows.append(f"| {name} | {case.size} | {output} | {method} | declines "
                                f"(path {paths[output]}) | |")
                    continue
                rows.append(f"| {name} | {case.size} | {output} | {method} | "
                            f"{statistics.median(times[key]) * 1e3:.1f} | "
                            f"{ratio(times, key, (output, 'loop')):.2f} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
