"""The records the fast-statistics stages hand each other, all immutable.

A :class:`Use` is one call of a torch function that read a tracked parameter in the batched
forward pass: which family captured it (None for an op no family claims), the parameter's role
in the call, the family's own typed payload (what it needs of the forward pass), and after the
backward pass the gradient ``g`` of the call's output. A :class:`Signature` is what a later call
must repeat of it for the plan made by the probe to hold. :class:`Pass1Need`, :class:`Pass1` and
:class:`Pass2` are what a source is asked for and answers in its two passes.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from service.strategies.base import Bounds, Tensors

if TYPE_CHECKING:
    from service.fast_stats._family import Family


class Unsupported(Exception):
    """The fast path cannot serve this call; the engine falls back to ``vmap``."""


class Payload(Protocol):
    """What a capture keeps of one call; ``key`` is the part a later call must repeat."""

    @property
    def key(self) -> Hashable: ...


@dataclass(frozen=True)
class DirectCall:
    """An op no family claims that runs sample by sample (batch first in and out): its
    per-sample parameter gradient is the op's own vjp, replayed per sample.

    ``pattern`` has one letter per argument: ``p`` a tracked parameter, ``b`` batched, ``c`` a
    constant, ``-`` not a tensor; ``names`` the tracked parameter at each argument.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    pattern: str
    names: tuple[str | None, ...]

    @property
    def key(self) -> Hashable:
        return self.pattern


@dataclass(frozen=True)
class OpaqueCall:
    """An op that reads a parameter in a way nothing here replays (``w.t()``, a list of
    tensors): its parameters fall back to a module replay. ``?`` marks the arguments at fault."""

    pattern: str

    @property
    def key(self) -> Hashable:
        return self.pattern


@dataclass(frozen=True)
class Signature:
    """How one use read its parameters: the probe's plan holds while a call repeats these."""

    kind: type
    func: Any
    roles: tuple[tuple[str, str], ...]
    key: Hashable


@dataclass(frozen=True)
class Output:
    """Where a captured call's output sits in the autograd graph (None: it needs no gradient),
    and what its gradient looks like. The backward pass needs no more of it, so the output itself
    is not held: a batch norm's, read by nothing the backward pass saves (the ReLU after it
    keeps its own), went as soon as the next op had run in a training step, and ResNet-18 held
    all of them to the backward pass (+34% of a step's peak memory). Taken when the call runs,
    the edge is the call's own even if a later op writes the output in place."""

    edge: GradientEdge | None
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, out: torch.Tensor) -> Output:
        edge = get_gradient_edge(out) if out.requires_grad else None
        return cls(edge, out.shape, out.dtype, out.device)


@dataclass(frozen=True)
class Use:
    """One read of tracked parameters by one torch function call in the forward pass.

    The record that leaves :func:`~service.fast_stats._run.forward_backward` has ``out=None``
    and ``g`` set.
    """

    family: Family[Any] | None  # None: a DirectCall or an OpaqueCall
    func: Any
    roles: dict[str, str]  # parameter name -> its role in the call ("weight", "bias", "arg1")
    payload: Payload
    out: Output | None = None
    g: torch.Tensor | None = None  # the gradient of the summed losses at the output
    stack: tuple[str, ...] = ()  # module names being executed (probe only)

    @property
    def signature(self) -> Signature:
        return Signature(type(self.payload), self.func, tuple(sorted(self.roles.items())),
                         self.payload.key)

    @property
    def opaque(self) -> bool:
        return isinstance(self.payload, OpaqueCall)

    @property
    def grad(self) -> torch.Tensor:
        assert self.g is not None, "read before the backward pass"
        return self.g


@dataclass(frozen=True)
class ModuleCall:
    """One call ``module(x)`` of a replayed module: its inputs (several for a whole model
    that takes several, batch first) and its output's gradient."""

    xs: tuple[torch.Tensor, ...]
    g: torch.Tensor | None = None


@dataclass(frozen=True)
class Pass1Need:
    """What the first pass over the per-sample gradients must produce."""

    sq: bool = False
    reference: Tensors | None = None  # dot products with these, when set
    references: Tensors | None = None  # {param: [M, *shape]}: M dot products each, when set
    sums: bool = False
    m2: bool = False  # each segment's sum of squared deviations from its mean (variance)
    cos: bool = False  # each sample's dot with its segment's mean, where a source can
    bounds: Bounds = ()
    sums_dtype: torch.dtype = torch.float32

    @property
    def any(self) -> bool:
        """Whether the pass has anything to compute (a call may want sketches alone)."""
        return (self.sq or self.reference is not None or self.references is not None or self.sums
                or self.m2)


@dataclass(frozen=True)
class Pass1:
    sq: torch.Tensor | None = None  # [B] squared norm of each sample's gradient
    dot: torch.Tensor | None = None  # [B] dot product with the reference
    dots: torch.Tensor | None = None  # [B, M] dot products with the M references
    sums: tuple[torch.Tensor, ...] | None = None  # per segment: sum of the per-sample gradients
    # per segment: sum of squared deviations from the segment's mean (variance = m2 / n)
    m2: tuple[torch.Tensor, ...] | None = None
    cos: torch.Tensor | None = None  # [B] dot with the segment's mean (or the second pass's)
    averaged: bool = False  # ``sums`` holds each segment's mean already (not a sum to divide)


@dataclass(frozen=True)
class Pass2:
    clipped: tuple[torch.Tensor, ...] | None = None  # per segment: sum_i c_i grad_i
    cos: torch.Tensor | None = None  # [B] dot of each sample's gradient with its segment mean
