"""The contract between the engine and its strategies: what a strategy is given, what it gives.

A strategy gets a prepared :class:`Call` (the model, the options, every tensor already on the
model's device, the segment bounds of the jobs in the batch, and the :class:`Need` derived from
the requested outputs by :mod:`service.outputs`) and answers a :class:`Result`: each sample's loss
and auxiliary value, and one immutable :class:`ParamStats` per selected parameter holding exactly
the primitives the need asks for. It never assembles outputs: :func:`service.outputs.assemble`
turns the same records into the answer whichever strategy filled them, so each output is
defined once.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any, Protocol

import torch

from psgrad._contract import SAMPLE_FIELDS
from service.strategies.projection import Projection

if TYPE_CHECKING:
    from service.registry import LoadedModel

Tensors = dict[str, torch.Tensor]
Bounds = tuple[tuple[int, int], ...]  # [start, stop) of each segment (one per job)
NAMED_INPUT = "inputs/"  # prefix of a sample's further named inputs (models that take several)


@dataclass(frozen=True)
class Options:
    """What to compute: the non-tensor part of a request. Hashable: it is part of the group key."""

    loss: str
    outputs: tuple[str, ...]
    params: tuple[str, ...]  # the selected parameters, in the module's order
    clip_norm: float | None = None
    noise_multiplier: float = 0.0
    seed: int | None = None
    gamma: float = 1.0
    # DP runs (service.dp): the noisy clipped sum is divided by ``divisor`` (the run's expected
    # batch size, Opacus's convention) instead of the segment's size; the clip factor is
    # C / (|g| + norm_offset) (Opacus: 1e-6); ``secure_noise`` draws the noise from the OS CSPRNG.
    divisor: float | None = None
    norm_offset: float = 0.0
    secure_noise: bool = False
    projection: Projection | None = None  # projection_dim and projection_seed, when asked
    reference_count: int = 0  # M, the references ``dots`` and ``influence`` answer against
    reference_sketches: bool = False  # ... given as [M, k] sketches, not gradients
    autocast: str = "off"  # "bfloat16": the model's forward and backward under torch.autocast

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype ``autocast`` runs the forward and backward in (None: 'off')."""
        return None if self.autocast == "off" else getattr(torch, self.autocast)

    def precision(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """What the model's forward and backward run under: ``torch.autocast`` in bfloat16
        when the request asks for it. Nothing else of a call runs under it: the statistics
        are formed in the model's dtype from what the forward and backward leave."""
        dtype = self.autocast_dtype
        return contextlib.nullcontext() if dtype is None else torch.autocast(device.type,
                                                                                dtype=dtype)


@dataclass
class Batch:
    """The tensors of a request, already validated, with the batch dimension first.

    The per-sample fields (the contract's ``per_sample``) are sliced and joined by name; one the
    engine does not read yet has no attribute here and is carried by nobody."""

    inputs: torch.Tensor
    targets: torch.Tensor | None = None
    next_inputs: torch.Tensor | None = None
    rewards: torch.Tensor | None = None
    dones: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # token losses: which positions count
    weights: Tensors = field(default_factory=dict)
    reference: Tensors = field(default_factory=dict)
    # the inputs after the first, by name, for models that take several (``inputs`` is the first)
    named: Tensors = field(default_factory=dict)
    references: Tensors = field(default_factory=dict)  # {param: [M, *shape]}, for ``dots``
    sketches: torch.Tensor | None = None  # [M, k] reference sketches, for ``dots``

    @cached_property
    def size(self) -> int:
        return int(self.inputs.shape[0])

    def samples(self) -> Tensors:
        own = {k: v for k in SAMPLE_FIELDS if (v := getattr(self, k, None)) is not None}
        return own | {NAMED_INPUT + k: v for k, v in self.named.items()} if self.named else own

    def rows(self, start: int, stop: int) -> Batch:
        """Samples ``[start, stop)`` of the batch, with its weights and references."""
        own = {k: v[start:stop] for k in SAMPLE_FIELDS if (v := getattr(self, k, None)) is not None}
        return replace(self, **own, named={k: v[start:stop] for k, v in self.named.items()})

    @classmethod
    def joined(cls, batches: Sequence[Batch]) -> Batch:
        """One batch of several that share weights, references and shapes: their samples one
        after another (a merged call of several jobs)."""
        first = batches[0]
        if len(batches) == 1:
            return first
        own: dict[str, Any] = {k: torch.cat([getattr(b, k) for b in batches])
               for k in SAMPLE_FIELDS if getattr(first, k, None) is not None}
        named = {k: torch.cat([b.named[k] for b in batches]) for k in first.named}
        return replace(first, **own, named=named)


@dataclass(frozen=True)
class Need:
    """The primitives an answer needs of every selected parameter (the union over its outputs).

    Attributes:
        grads: every per-sample gradient, ``[B, *shape]``.
        sq: each sample's squared gradient norm, ``[B]``.
        dot: each sample's dot product with the request's ``reference``, ``[B]``.
        mean: each segment's mean gradient.
        m2: each segment's sum of squared deviations from its mean (variance = m2 / n).
        clipped: each segment's sum of gradients scaled by :func:`clip_factors` (needs ``sq``).
        cos: each sample's dot product with its segment's mean gradient (needs ``mean``, ``sq``).
        proj: each sample's sketch ``[B, k]`` under the call's projection
            (:mod:`service.strategies.projection`), over all selected parameters: the sum of
            their parts, so only the sum is kept (``Result.sketch``).
        dots: each sample's dot products with the call's M ``references``, ``[B, M]``.
    """

    grads: bool = False
    sq: bool = False
    dot: bool = False
    mean: bool = False
    m2: bool = False
    clipped: bool = False
    cos: bool = False
    proj: bool = False
    dots: bool = False

    def __or__(self, other: Need) -> Need:
        return Need(**{k: getattr(self, k) or getattr(other, k) for k in _NEED_FIELDS})


_NEED_FIELDS = ("grads", "sq", "dot", "mean", "m2", "clipped", "cos", "proj", "dots")


@dataclass(frozen=True)
class ParamStats:
    """One selected parameter's primitives; a field is None when the need did not ask for it.

    Per-segment fields are tuples with one tensor per segment, in the parameter's shape.
    """

    grads: torch.Tensor | None = None  # [B, *shape], one buffer
    sq: torch.Tensor | None = None
    dot: torch.Tensor | None = None
    mean: tuple[torch.Tensor, ...] | None = None
    m2: tuple[torch.Tensor, ...] | None = None
    clipped: tuple[torch.Tensor, ...] | None = None
    cos: torch.Tensor | None = None
    dots: torch.Tensor | None = None  # [B, M]: this parameter's part of each dot product


@dataclass(frozen=True)
class Result:
    """What a strategy answers: per-sample losses and aux values (``td0``: the TD errors), the
    records of the selected parameters in the call's order, and how they were computed."""

    losses: torch.Tensor
    aux: torch.Tensor
    params: dict[str, ParamStats]
    meta: dict[str, Any]
    sketch: torch.Tensor | None = None  # [B, k] with ``proj``: each sample's whole sketch


@dataclass(frozen=True)
class Call:
    """One engine call, prepared: every tensor is on the model's device, in the model's dtype
    (parameters, per-call weights, reference) or as sent (samples)."""

    model: LoadedModel
    opts: Options
    params: Tensors  # every parameter's value for this call (per-call weights applied)
    samples: Tensors
    reference: Tensors
    bounds: Bounds
    need: Need
    budget_bytes: int = 1 << 30
    compiled: Any = None  # service.compile_cache.CompiledFunctions, for the vmap strategy
    plans: Any = None  # service.fast_stats.SharedPlans: fast statistics' plans, shared
    # told True as the call begins planning its model (not batch work: the deadline excludes
    # it) and False once the plan is made
    planning: Callable[[bool], None] | None = None
    references: Tensors = field(default_factory=dict)  # {param: [M, *shape]} for ``dots``
    sketches: torch.Tensor | None = None  # [M, k] reference sketches for ``dots``

    @property
    def size(self) -> int:
        return int(self.samples["inputs"].shape[0])

    @property
    def selected(self) -> tuple[str, ...]:
        return self.opts.params


class Strategy(Protocol):
    """A way to fill the records of a call."""

    name: str

    def run(self, call: Call) -> Result | None:
        """The records of ``call``, or None to decline (the engine then tries the next one)."""


def bounds_of(segments: Sequence[int]) -> Bounds:
    """``[start, stop)`` of consecutive segments of the given sizes."""
    return tuple(itertools.pairwise(itertools.accumulate(segments, initial=0)))


def clip_factors(clip_norm: float | None, norms: torch.Tensor,
                 norm_offset: float = 0.0) -> torch.Tensor:
    """DP-SGD's per-sample scale ``min(1, C / (|g_i| + norm_offset))`` (1 for a zero gradient).

    ``norm_offset`` 0 clips exactly to C; Opacus adds 1e-6 to every norm (DP runs may ask for it).
    """
    return ((clip_norm or 0.0) / (norms + norm_offset)).clamp(max=1.0).nan_to_num(1.0)


NORM_BLOCK = 4096  # elements per partial sum of :func:`squared_norms`


def tree_reduces(device: torch.device) -> bool:
    """Whether ``device``'s reductions add in a tree (a GPU's), so that one norm of a long row
    keeps float32's digits; a CPU's ``vector_norm`` adds a whole row in one accumulator."""
    return device.type != "cpu"


def squared_norms(rows: torch.Tensor) -> torch.Tensor:
    """``[n]`` squared norms of ``rows`` ``[n, ...]``, flattened. On a CPU each row's norm is
    taken in blocks of :data:`NORM_BLOCK` elements, their squares summed: torch's CPU
    ``vector_norm`` adds a whole row's squares in one float32 accumulator (relative error 8e-5 at
    2.4 M elements, 5e-3 at GPT-2's 38.6 M-element embedding), and ``pow(2).sum()`` holds a
    squared copy of the rows (6x the time of this on that embedding, in fresh memory). Where
    reductions add in a tree (:func:`tree_reduces`), one norm per row: two operations, not
    three to five (each a launch on a GPU)."""
    flat = rows.reshape(len(rows), -1) if rows.numel() else rows.new_zeros(len(rows), 0)
    n, p = flat.shape
    head = p - p % NORM_BLOCK
    if head == 0 or tree_reduces(flat.device):
        return torch.linalg.vector_norm(flat, dim=1).square()
    blocks = flat[:, :head].reshape(n, head // NORM_BLOCK, NORM_BLOCK)  # a view of each row
    sq = torch.linalg.vector_norm(blocks, dim=2).square().sum(1)
    if head < p:
        sq = sq + torch.linalg.vector_norm(flat[:, head:], dim=1).square()
    return sq


def squared_norm_each(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The squared norm of each of ``tensors``, ``[len(tensors)]`` (a mean gradient's, parameter
    by parameter). Where reductions add in a tree (:func:`tree_reduces`) one fused norm of them
    all: one launch serves every parameter. On a CPU, whose ``vector_norm`` adds a whole tensor
    in one accumulator, each in blocks (:func:`squared_norms`)."""
    if tree_reduces(tensors[0].device):
        return torch.stack(torch._foreach_norm(list(tensors))).square()
    return torch.stack([squared_norms(t.reshape(1, -1))[0] for t in tensors])


def squared_norm_sum(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of the squared norms of ``tensors``, 0-d (:func:`squared_norm_each`)."""
    return squared_norm_each(tensors).sum()


def dots_with(rows: torch.Tensor, refs: torch.Tensor) -> torch.Tensor:
    """``[n, M]`` dot products of each of ``rows`` ``[n, ...]`` with each of ``refs``
    ``[M, ...]``, flattened, as ``refs @ rows^T``: with the thin side on the left the CPU's GEMM
    ran twice as fast (M=2 against pieces of BERT-base's gradients) as ``rows @ refs^T``, which
    in bfloat16 on a Xeon with AMX (torch 2.13's oneDNN) kills the process with SIGFPE at 393 K
    elements a row."""
    flat = rows.reshape(len(rows), -1)
    return (refs.reshape(len(refs), -1).to(flat.dtype) @ flat.t()).t().contiguous()


def keep_rows(kept: Tensors, size: int, start: int, stop: int, grads: Tensors) -> None:
    """Rows [start, stop) of per-sample gradients, kept in ``kept`` as one ``[size, ...]`` buffer
    per parameter: a chunk that is the whole batch is kept as it is, others are copied into the
    buffer as they come (never a list of chunks concatenated at the end: that holds the answer
    twice, and fresh memory costs page faults)."""
    for k, g in grads.items():
        if start == 0 and stop == size:
            kept[k] = g
            continue
        if k not in kept:
            kept[k] = g.new_empty((size, *g.shape[1:]))
        kept[k][start:stop].copy_(g)


def divide_(values: Tensors, divisor: float) -> Tensors:
    """``values`` divided by ``divisor`` in place, in one operation over all of them (on a GPU
    one launch, not one per parameter)."""
    if values:
        torch._foreach_div_(list(values.values()), divisor)
    return values


STACK_ELEMENTS = 1 << 20  # :func:`total` stacks parts up to this many elements in all


def total(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum of same-shaped tensors: small ones (every parameter's per-sample squared norms)
    stacked and summed in two operations, not one addition per part (BERT-base's 201 would be
    201 kernel launches on a GPU); large ones added in turn, without a stacked copy."""
    if len(parts) > 2 and len(parts) * parts[0].numel() <= STACK_ELEMENTS:
        return torch.stack(list(parts)).sum(0)
    out = parts[0]
    for p in parts[1:]:
        out = out + p
    return out
