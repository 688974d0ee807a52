"""Real-size models: psgrad's statistics against a plain training step and the in-process peers.

    python benchmarks/realsize.py [--models gpt2,bert,resnet18] [--seq 64[,256,...]]
                                  [--batch N[,M,...]] [--rounds 3] [--outputs norms,...]
                                  [--peers opacus-ghost | --no-peers] [--device cuda]

``--outputs projection,projection-kronecker`` times sketches (k = 4096) of each projection
kind instead of the statistics.

Three models with random weights from their configurations (no hub download): GPT-2 small
(``GPT2LMHeadModel(GPT2Config())``, 124M, ``next_token`` loss, default B=4), BERT-base
(``BertForSequenceClassification(BertConfig(num_labels=2))``, 109M, default B=8) and ResNet-18 at
224x224 (torchvision's layout written out below, BatchNorm in eval with running statistics moved
off 0 and 1, default B=16). Token models get ``--seq`` positions (default 64), a quarter of the
samples padded on the right, with eager attention (transformers' ``scaled_dot_product_attention``
has no vmap rule on the CPU). The psgrad methods run the way the server does: the model exported
with ``torch.export`` (sequence length dynamic up to 512), registered through psgrad's own loader
(the child process, with limits raised to fit), and each request parsed and computed by
``service.engine.compute`` in this process.

Every (output, method) runs once per round, rounds interleaved; the time ratio is the median over
rounds of the ratio to ``plain`` of the same round: one batched forward and backward of the mean
loss on the original module, a training step without the optimizer. ``plain-graph`` is the same
step on psgrad's loaded graph (the floor of psgrad's own path). Methods:

- ``psgrad``: ``engine.compute`` with fast statistics (``meta.route`` is shown: ``vmap`` means
  the fast path declined);
- ``psgrad-graphs`` (``--device cuda`` only): the same with ``PSGRAD_CUDA_GRAPHS`` on, replaying
  the call's CUDA graph (``service/graphs.py``; eager where the call cannot be captured);
- ``vmap``: ``functional_call`` + ``vmap(grad)`` on the original module, statistics from the
  per-sample gradients;
- ``opacus``: Opacus ``GradSampleModule`` hooks, statistics from ``grad_sample``;
- ``opacus-ghost``: Opacus ghost clipping (norms; the clipped mean by a second backward).

``--batch`` and ``--seq`` take lists: each model is exported and registered once, then timed at
every batch size and sequence length. ``--device cuda`` runs every method on the GPU, in float32
(TF32 off, as psgrad's workers run), each call timed to the end of its kernels, peak memory from
``torch.cuda.max_memory_allocated`` (the call's peak above what was allocated before it).
``--autocast bfloat16`` runs every method's forward and backward under ``torch.autocast`` in
bfloat16 (psgrad by the request's ``autocast`` field), the plain step too, and notes how far
psgrad's norms are from its float32 norms; ``--autocast off,bfloat16`` times each case both ways.
``--dtype bfloat16`` makes the models themselves bfloat16 (parameters, buffers and ResNet-18's
images, exported and registered so, the requests' floats sent as float32 holding bfloat16
values), every method with them.

Peak memory on the CPU: the resident-set high-water mark of one call after a warm one, minus the
resident set before it (glibc's mmap threshold is lowered as it starts, so freed blocks leave the
resident set), for every method in this process. That threshold makes every block over 64 KiB
fresh memory, page faults and all, for the timed calls too; ``--default-malloc`` times under glibc's
own settings instead, and ``--kept-malloc`` with freed memory kept in the process, as psgrad's
server processes run (``PSGRAD_KEEP_FREED_MEMORY``); neither measures memory (freed blocks stay
resident).
Peers that would hold every per-sample gradient past ``--max-gib`` are skipped and say so. Our
machine's two cores are shared with other work: ratios are the figures to read, and they move by
about 0.1 between runs.

Needs ``transformers`` and, for the peers, ``opacus`` (``pip install --no-deps``: without it pip
replaces torch).
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

if "THP_MEM_ALLOC_ENABLE" not in os.environ:  # before torch allocates anything
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from psgrad._arrays import to_numpy  # a bfloat16 tensor as float32 holding its values
from service import engine
from service.config import Settings
from service.process_env import keep_freed_memory
from service.registration import register_exported
from service.registry import LoadedModel, ModelRegistry, set_tf32
from service.strategies.base import Batch
from service.validate import ParsedRequest, parse_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: from the root
from tests.support.realsize import ResNet18, export, hf, padded_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_methods import from_grads, ghost_clipping  # statistics from per-sample grads
from fast_stats import interleave, ratio, steady_peak  # rounds interleaved; median ratios

OUTPUTS = ("norms", "clipped_mean", "variance", "cosine_mean", "dots")
SKETCH_DIM = 4096  # k of --outputs projection and projection-kronecker (not in the default run)
PEER_OUTPUTS = ("norms", "clipped_mean")  # the peers' cost is their per-sample gradients
BATCH = {"gpt2": 4, "bert": 8, "resnet18": 16}
CLIP = 1.0
REFERENCES = 2  # M, the gradient references of ``dots``
MAX_LENGTH = 512

Fn = Callable[[], Any]


@dataclass
class Case:
    """A model, its batch, and how its per-sample losses are formed."""

    name: str
    module: nn.Module  # the original module, eval mode
    inputs: dict[str, torch.Tensor]  # by input name, in the module's order
    targets: torch.Tensor
    loss: str  # psgrad's loss name
    mask: torch.Tensor | None = None

    @property
    def size(self) -> int:
        return int(next(iter(self.inputs.values())).shape[0])

    def losses(self, module: nn.Module, data: dict[str, torch.Tensor] | None = None
               ) -> torch.Tensor:
        """Per-sample losses ``[B]`` of ``module`` on the batch (or on ``data``, a slice)."""
        data = data or self.data
        out = module(*(data[k] for k in self.inputs))
        if self.loss == "cross_entropy":
            return F.cross_entropy(out, data["targets"], reduction="none")
        keep = data["mask"][:, 1:].to(out.dtype)  # next_token: scores at t against id t + 1
        # one row of scores per position, as a training step writes it (and psgrad's loss);
        # the [B, V, T] layout of ``transpose(1, 2)`` took twice as long for GPT-2's vocabulary
        each = F.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]),
                               data["targets"][:, 1:].reshape(-1), reduction="none")
        each = each.view(keep.shape)
        return (each * keep).sum(1) / keep.sum(1).clamp(min=1)

    @property
    def data(self) -> dict[str, torch.Tensor]:
        extra = {"mask": self.mask} if self.mask is not None else {}
        return {**self.inputs, "targets": self.targets, **extra}

    def to(self, device: torch.device) -> Case:
        """The same case with its module and tensors on ``device``."""
        mask = None if self.mask is None else self.mask.to(device)
        return Case(self.name, self.module.to(device),
                    {k: v.to(device) for k, v in self.inputs.items()},
                    self.targets.to(device), self.loss, mask)


def make_case(name: str, batch: int, seq: int, dtype: torch.dtype = torch.float32) -> Case:
    """The model with seeded random weights and a seeded batch, in ``dtype``."""
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    if name == "resnet18":
        x = torch.randn(batch, 3, 224, 224, generator=gen).to(dtype)
        return Case(name, ResNet18().eval().to(dtype), {"x": x},
                    torch.randint(0, 1000, (batch,), generator=gen), "cross_entropy")
    if name not in ("gpt2", "bert"):
        raise SystemExit(f"unknown model {name!r}; known: gpt2, bert, resnet18")
    module = hf(name, **({"num_labels": 2} if name == "bert" else {})).to(dtype)
    config: Any = module.get_submodule("model").config
    vocab = int(config.vocab_size)
    ids, mask = padded_tokens(batch, seq, vocab, gen)
    inputs = {"input_ids": ids, "attention_mask": mask}
    if name == "gpt2":
        return Case(name, module, inputs, ids, "next_token", mask)
    return Case(name, module, inputs, torch.randint(0, 2, (batch,), generator=gen),
                "cross_entropy")


def raised(**given: Any) -> Settings:
    """Settings with the limits raised to fit the models (the benchmarks measure compute, not
    limits), no model folder, and ``given``."""
    return Settings(**{"model_dir": None, "max_parameters": 1 << 30,
                       "max_model_activations": 1 << 34, "max_weight_bytes": 4 << 30,
                       "export_memory_mb": 1 << 15, "export_cpu_s": 1200,
                       "export_timeout_s": 1800, **given})


def register(case: Case, device: torch.device | None = None
             ) -> tuple[ModelRegistry, LoadedModel]:
    """Exported at a batch of one (sequence length dynamic) and registered by psgrad's loader
    on ``device`` (``case`` on the CPU)."""
    data = export(case.module, tuple(v[:1] for v in case.inputs.values()), MAX_LENGTH)
    device = device or torch.device("cpu")
    registry = ModelRegistry(device)
    settings = raised(redis_url=None, device=device.type)
    model = register_exported(registry, case.name, data, settings, default_loss=case.loss,
                              losses=[])
    return registry, model


def request(registry: ModelRegistry, case: Case, output: str, autocast: str = "off"
            ) -> ParsedRequest:
    fields: dict[str, Any] = {
        "model": case.name, "outputs": [output], "targets": case.targets.cpu().numpy(),
        "inputs": {k: to_numpy(v, k) for k, v in case.inputs.items()}, "clip_norm": CLIP,
        "autocast": autocast}
    if case.mask is not None:
        fields["mask"] = case.mask.cpu().numpy()
    if output.startswith("projection"):  # projection (the default kind), projection-kronecker
        fields.update(outputs=["projection"], projection_dim=SKETCH_DIM)
        if output != "projection":
            fields["projection_kind"] = output.removeprefix("projection-")
    if output == "dots":
        model = registry.get(case.name)
        gen = torch.Generator().manual_seed(2)
        fields["reference"] = {
            k: to_numpy(torch.randn((REFERENCES, *v.shape), generator=gen).to(v.dtype), k)
            for k, v in model.params.items()}
    return parse_request(fields, registry)


def psgrad(registry: ModelRegistry, case: Case, output: str, autocast: str = "off",
           cuda_graphs: bool = False) -> Fn:
    """One request's ``engine.compute``, its tensors on the model's device before the call, as
    the plain step's batch is: the call's time and peak memory are the statistic's, not the
    copy's (``dots``' M=2 references are two copies of the model, moved in each call before:
    on the H200 most of `dots`' time and the largest of its peaks)."""
    parsed = request(registry, case, output, autocast)
    batch = on_device(parsed.batch, parsed.model.device)
    return lambda: engine.compute(parsed.model, batch, parsed.opts, cuda_graphs=cuda_graphs)[0]


def on_device(batch: Batch, device: torch.device) -> Batch:
    """``batch`` with every tensor on ``device``."""
    def moved(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.to(device)
        return {k: v.to(device) for k, v in value.items()} if isinstance(value, dict) else value

    return replace(batch, **{f.name: moved(getattr(batch, f.name)) for f in fields(batch)})


def under_autocast(fn: Fn, device: torch.device) -> Fn:
    """``fn`` with its forward and backward under bfloat16 autocast, as a mixed-precision step."""
    def run() -> Any:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            return fn()

    return run


def plain(case: Case) -> Fn:
    """One batched forward and backward of the mean loss (a training step's work)."""
    params = [p for p in case.module.parameters() if p.requires_grad]
    return lambda: torch.autograd.grad(case.losses(case.module).mean(), params)


def plain_graph(case: Case, model: LoadedModel) -> Fn:
    """The same step on psgrad's loaded graph (what its fast path runs forward and backward)."""
    graph = model.module

    def run() -> Any:
        params = {k: v.detach().requires_grad_() for k, v in model.params.items()}

        class Bound(nn.Module):
            def forward(self, *xs: torch.Tensor) -> torch.Tensor:
                return functional_call(graph, (params, model.buffers), xs)

        return torch.autograd.grad(case.losses(Bound()).mean(), list(params.values()))

    return run


def _trainable(case: Case) -> nn.Module:
    """A trainable copy in training mode (Opacus records activations only then), with dropout
    off and BatchNorm on its running statistics, so that it computes what the eval module does."""
    module = copy.deepcopy(case.module).requires_grad_(True).train()
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
    return module


def vmap_peer(case: Case, output: str) -> Fn:
    """``functional_call`` + ``vmap(grad(loss))`` over the samples, on the original module."""
    module = case.module
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = {k: v.detach() for k, v in module.named_buffers()}

    class Bound(nn.Module):
        def __init__(self, p: dict[str, torch.Tensor]) -> None:
            super().__init__()
            self.p = p

        def forward(self, *xs: torch.Tensor) -> torch.Tensor:
            return functional_call(module, (self.p, buffers), xs)

    def loss(p: dict[str, torch.Tensor], sample: dict[str, torch.Tensor]) -> torch.Tensor:
        return case.losses(Bound(p), {k: v.unsqueeze(0) for k, v in sample.items()})[0]

    fn = vmap(grad(loss), in_dims=(None, 0))
    return lambda: from_grads(output, fn(params, case.data), CLIP)


def opacus_peer(case: Case, output: str) -> Fn:
    from opacus import GradSampleModule

    module = _trainable(case)
    names = [n for n, _ in module.named_parameters()]
    gsm = GradSampleModule(module, loss_reduction="sum")
    params = list(module.parameters())

    def run() -> Any:
        gsm.zero_grad(set_to_none=True)
        case.losses(gsm).sum().backward()
        grads = {}
        for n, p in zip(names, params, strict=True):
            grads[n], p.grad_sample = p.grad_sample, None  # type: ignore[attr-defined]
        return from_grads(output, grads, CLIP)

    return run


class _Ids(nn.Module):
    """BERT with its token type and position ids given (as by default) as tensors of their own,
    one row per sample: Opacus' ghost norm of an embedding views its ids and takes their first
    dimension for the batch, and BERT's defaults are views of buffers, broadcast
    (``view size is not compatible with input tensor's size and stride``) or of one row."""

    def __init__(self, logits: nn.Module) -> None:
        super().__init__()
        self.bert = logits.get_submodule("model")

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        positions = positions.expand_as(input_ids).contiguous()
        return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=torch.zeros_like(input_ids),
                         position_ids=positions).logits


def ghost_peer(case: Case, output: str) -> Fn:
    module = _trainable(case)
    return ghost_clipping(_Ids(module) if case.name == "bert" else module, case.losses,
                          output, CLIP)


PEERS: dict[str, Callable[[Case, str], Fn]] = {
    "vmap": vmap_peer, "opacus": opacus_peer, "opacus-ghost": ghost_peer}


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return text if len(text) <= 100 else text[:97] + "..."


def _norms(answer: Any) -> np.ndarray | None:
    value = answer.get("norms") if isinstance(answer, dict) else None
    return None if value is None else to_numpy(torch.as_tensor(value), "norms")


def methods(case: Case, registry: ModelRegistry, model: LoadedModel, outputs: list[str],
            peers: Sequence[str], max_gib: float, autocast: str = "off"
            ) -> tuple[dict[tuple[str, str], Fn], dict[str, str]]:
    """Every (output, method) that runs, and why the others do not (first call checked)."""
    device = model.device
    mixed = (lambda fn: under_autocast(fn, device)) if autocast != "off" else (lambda fn: fn)
    fns: dict[tuple[str, str], Fn] = {("step", "plain"): mixed(plain(case)),
                                      ("step", "plain-graph"): mixed(plain_graph(case, model))}
    notes: dict[str, str] = {}
    want = None
    for output in outputs:
        fn = psgrad(registry, case, output, autocast)
        start = time.perf_counter()
        try:
            answer = fn()
        except Exception as exc:  # reported in the table (the traceback on stderr), not timed
            traceback.print_exc()
            notes[f"{output} psgrad"] = f"fails: {_short(exc)}"
            continue
        fns[(output, "psgrad")] = fn
        print(f"  psgrad {output}: first call {time.perf_counter() - start:.1f} s", flush=True)
        notes[f"{output} psgrad"] = answer["meta"].get("route", "?")
        if device.type == "cuda":  # PSGRAD_CUDA_GRAPHS: the second call captures (graphs.py)
            graphed = psgrad(registry, case, output, autocast, cuda_graphs=True)
            graphed(), graphed()
            fns[(output, "psgrad-graphs")] = graphed
        want = _norms(answer) if output == "norms" else want
        if output == "norms" and autocast != "off" and want is not None:
            full = _norms(psgrad(registry, case, output)())
            assert full is not None
            diff = float(np.max(np.abs(want - full) / full))
            notes[f"{output} psgrad"] += f"; norms vs float32's: max relative diff {diff:.1e}"
    held = case.size * sum(p.numel() for p in model.params.values()) * 4 / 2**30
    for name in peers:
        factory = PEERS[name]
        for output in PEER_OUTPUTS:
            if output not in outputs:
                continue
            if name != "opacus-ghost" and held > max_gib:
                notes[f"{output} {name}"] = (f"skipped: {held:.1f} GiB of per-sample gradients "
                                             f"past --max-gib {max_gib}")
                continue
            try:
                fn = mixed(factory(case, output))
                got = fn()
            except Exception as exc:  # the library refuses this model: reported, not timed
                notes[f"{output} {name}"] = f"fails: {_short(exc)}"
                continue
            fns[(output, name)] = fn
            norms = _norms(got)
            if norms is not None and want is not None:
                diff = float(np.max(np.abs(norms - want) / (1 + want)))
                notes[f"{output} {name}"] = f"norms vs psgrad: max relative diff {diff:.1e}"
    return fns, notes


def synced(fns: dict[tuple[str, str], Fn]) -> dict[tuple[str, str], Fn]:
    """Each call timed to the end of its kernels (CUDA runs them after the call returns)."""
    def wait(fn: Fn) -> Fn:
        return lambda: (fn(), torch.cuda.synchronize())[0]

    return {key: wait(fn) for key, fn in fns.items()}


def cuda_peak(fn: Fn) -> int:
    """The GPU memory one call after a warm one allocates at its peak, above what was allocated
    before it."""
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def run_model(name: str, args: argparse.Namespace) -> list[str]:
    """Every batch size and sequence length of ``name`` on one registration."""
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch.split(",")] if args.batch else [BATCH[name]]
    seqs = [0] if name == "resnet18" else [int(t) for t in args.seq.split(",")]
    start = time.perf_counter()
    dtype = getattr(torch, args.dtype)
    registry, model = register(make_case(name, 1, seqs[0] or 2, dtype), device)
    print(f"{name}: exported and registered in {time.perf_counter() - start:.0f} s", flush=True)
    rows = []
    for batch in batches:
        for seq in seqs:
            case = make_case(name, batch, seq, dtype).to(device)
            for autocast in args.autocast.split(","):
                new = run_case(case, registry, model, seq, autocast, args)
                print("\n".join(new), flush=True)
                rows += new
    return rows


def run_case(case: Case, registry: ModelRegistry, model: LoadedModel, seq: int, autocast: str,
             args: argparse.Namespace) -> list[str]:
    name, batch = case.name, case.size
    print(f"{name} B={batch}{f' T={seq}' if seq else ''} autocast {autocast}:", flush=True)
    outputs = args.outputs.split(",")
    fns, notes = methods(case, registry, model, outputs, args.peers, args.max_gib, autocast)
    cuda = args.device == "cuda"
    if cuda:
        fns = synced(fns)
    print(f"  {len(fns)} methods run; timing {args.rounds} rounds", flush=True)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    times = interleave(fns, args.rounds, clock)
    base = ("step", "plain")
    print("  x plain: " + ", ".join(f"{output} {method} {ratio(times, (output, method), base):.2f}"
                                    for output, method in fns), flush=True)  # before the peaks
    measure = cuda_peak if cuda else steady_peak
    peaks = {key: measure(fn) for key, fn in fns.items()} if args.memory else {}
    length = str(seq) if seq else ""
    name += " bfloat16" if model.dtype == torch.bfloat16 else ""
    name += " bf16 autocast" if autocast != "off" else ""
    rows = []
    for key in fns:
        output, method = key
        t = statistics.median(times[key])
        mem = ""
        if peaks:
            mem = f"{peaks[key] / 2**20:.0f} | {peaks[key] / max(1, peaks[base]):.2f}"
        note = notes.get(f"{output} {method}", "")
        if method == "psgrad":
            note = f"route {note}"
        rows.append(f"| {name} | {batch} | {length} | {output} | {method} | {t * 1e3:.0f} | "
                    f"{ratio(times, key, base):.2f} | {mem or ' | '} | {note} |")
    for label, note in notes.items():
        output, method = label.split(" ", 1)
        if (output, method) not in fns:
            rows.append(f"| {name} | {batch} | {length} | {output} | {method} | n/a | | | | "
                        f"{note} |")
    return rows


LOWERED = 65536  # bytes: glibc's mmap threshold, so that freed blocks leave the resident set
M_MMAP_THRESHOLD = -3  # mallopt's parameter (glibc's malloc.h)


def set_allocator(args: argparse.Namespace) -> None:
    """glibc's mmap threshold lowered to :data:`LOWERED` (peak memory can be read), freed
    memory kept as psgrad's server processes keep it (``--kept-malloc``), or glibc's own
    settings (``--default-malloc``)."""
    if args.kept_malloc:
        keep_freed_memory()  # a restart in place, with glibc's tunables
    elif not args.default_malloc and platform.libc_ver()[0] == "glibc":
        mallopt = ctypes.CDLL(None).mallopt
        mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        mallopt(M_MMAP_THRESHOLD, LOWERED)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gpt2,bert,resnet18")
    parser.add_argument("--seq", default="64",
                        help="sequence lengths of the token models, comma-separated")
    parser.add_argument("--batch", default="",
                        help="batch sizes, comma-separated (default: gpt2 4, bert 8, "
                             "resnet18 16)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--outputs", default=",".join(OUTPUTS))
    parser.add_argument("--peers", default=",".join(PEERS),
                        help=f"the peers to run, comma-separated (of {', '.join(PEERS)})")
    parser.add_argument("--no-peers", dest="peers", action="store_const", const="",
                        help="psgrad and the plain steps only")
    parser.add_argument("--no-memory", dest="memory", action="store_false",
                        help="skip the peak-memory calls (two more calls per method)")
    parser.add_argument("--default-malloc", action="store_true",
                        help="time under glibc's default allocator, not with the lowered mmap "
                             "threshold (no peak memory)")
    parser.add_argument("--kept-malloc", action="store_true",
                        help="time with freed memory kept, as psgrad's server processes run "
                             "(PSGRAD_KEEP_FREED_MEMORY; no peak memory)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads (default: torch's; 1 on a busy shared machine)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="cpu: this process's CPU time (with --threads 1, the work alone)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: every method on the GPU, float32 (TF32 off)")
    parser.add_argument("--autocast", default="off",
                        help="off, bfloat16 or both (off,bfloat16): bfloat16 runs every "
                             "method's forward and backward under autocast")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="the models' own dtype (bfloat16: parameters, buffers, images)")
    parser.add_argument("--max-gib", type=float, default=3.0,
                        help="skip peers whose per-sample gradients would take more than this")
    args = parser.parse_args()
    args.peers = [name for name in args.peers.split(",") if name]
    if not set(args.peers) <= set(PEERS):
        raise SystemExit(f"--peers takes {', '.join(PEERS)}")
    set_allocator(args)  # before the models are made
    args.memory = args.memory and (args.device == "cuda"
                                   or not (args.default_malloc or args.kept_malloc))
    if args.threads:
        torch.set_num_threads(args.threads)
    if not all(2 <= int(t) <= MAX_LENGTH for t in args.seq.split(",")):
        raise SystemExit(f"--seq must be within 2..{MAX_LENGTH}")
    if not set(args.autocast.split(",")) <= {"off", "bfloat16"}:
        raise SystemExit("--autocast takes off, bfloat16 or off,bfloat16")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    set_tf32(False)  # float32 on CUDA, as psgrad's workers run (CPUs ignore it)
    malloc = ("kept (PSGRAD_KEEP_FREED_MEMORY)" if args.kept_malloc
              else "glibc's default" if args.default_malloc else f"{LOWERED}")
    on = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"torch {torch.__version__} on {on}, {torch.get_num_threads()} threads, "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}, "
          f"mmap threshold {malloc}, {args.clock} clock, autocast {args.autocast}, "
          f"medians of "
          f"{args.rounds} interleaved rounds; x plain = median per-round ratio to one plain "
          "forward+backward; peak = extra "
          f"{'GPU' if args.device == 'cuda' else 'resident'} memory of one warm call\n", flush=True)
    rows = ["| model | B | T | output | method | ms | x plain | peak MiB | x plain | notes |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        rows += run_model(name, args)
        print("\n".join(rows), flush=True)


if __name__ == "__main__":
    main()
