"""Per-sample gradients small enough to hold whole: biases, norms' affine parameters, additions.

A family that can write a parameter's per-sample gradient cheaply (``[B, *shape]``) hands it to
:class:`Dense`; small ones of one dtype are then computed together as one :class:`DenseGroup`.
A selected parameter the forward pass never reads is a :class:`Zero`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from service.fast_stats._budget import Budget
from service.fast_stats._records import Pass1, Pass1Need, Pass2
from service.fast_stats._source import Materialised, Source, SourceContext, cat, merge
from service.strategies.base import Bounds, Tensors, dots_with, squared_norms, total
from service.strategies.projection import Projection


class Dense(Materialised):
    """Per-sample gradients held whole, ``[B, *shape]``."""

    def __init__(self, name: str, grads: torch.Tensor, budget: Budget, method: str) -> None:
        super().__init__(
            [name], {name: grads.shape[1:]}, grads.shape[0], budget, grads.element_size()
        )
        self.method = method
        self.full = grads

    def chunk_size(self) -> int:
        return self.batch

    def grads(self, lo: int, hi: int) -> Tensors:
        return {self.names[0]: self.full[lo:hi]}


def dense_sum(name: str, parts: Sequence[torch.Tensor], ctx: SourceContext, method: str) -> Dense:
    """Parameter ``name``'s per-sample gradients as the sum of ``parts`` (``[B, ...]`` each)."""
    return Dense(name, total(parts).reshape(ctx.batch, *ctx.shapes[name]), ctx.budget, method)


class Zero(Dense):
    """A selected parameter the forward pass never reads: every per-sample gradient is zero."""

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        batch: int,
        dtype: torch.dtype,
        device: torch.device,
        budget: Budget,
    ) -> None:
        zeros = torch.zeros((1, *shape), dtype=dtype, device=device).expand(batch, *shape)
        super().__init__(name, zeros, budget, "unused")

    def answer(self) -> Tensors:
        return {self.names[0]: self.full.contiguous()}  # an answer owns its memory

    def project(self, projection: Projection, out: torch.Tensor) -> None:
        """A zero gradient adds nothing to a sketch."""


class DenseGroup(Source):
    """Small per-sample gradients (biases, norms' affine parameters) as one source: one plain
    op per statistic and parameter, none of :class:`Materialised`'s chunking around it (on a
    small model that overhead was a fifth of a ``clipped_mean`` call). Nothing is copied."""

    SMALL = 1 << 14  # elements per sample of a member

    def __init__(self, parts: Sequence[Dense]) -> None:
        names = [p.names[0] for p in parts]
        super().__init__(names, {k: p.shapes[k] for k, p in zip(names, parts, strict=True)},
                         parts[0].batch, parts[0].budget)
        self.methods = {k: p.method for k, p in zip(names, parts, strict=True)}
        self.flat = {k: p.full.reshape(self.batch, -1) for k, p in zip(names, parts, strict=True)}

    def method_of(self, name: str) -> str:
        return self.methods[name]

    def form(self, name: str) -> str:
        return self.methods[name]

    def grads(self, lo: int, hi: int) -> Tensors:
        return {k: f[lo:hi].reshape(hi - lo, *self.shapes[k]) for k, f in self.flat.items()}

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        out = {}
        for k, f in self.flat.items():
            shape = self.shapes[k]
            out[k] = Pass1(
                sq=squared_norms(f) if need.sq else None,
                dot=(f @ need.reference[k].reshape(-1).to(f.dtype)
                     if need.reference is not None else None),
                dots=(dots_with(f, need.references[k])
                      if need.references is not None else None),
                sums=(tuple(f[x:y].sum(0, dtype=need.sums_dtype).reshape(shape)
                            for x, y in need.bounds) if need.sums else None),
                m2=(tuple(merge(None, f[x:y].to(torch.float64)).m2.reshape(shape)
                          for x, y in need.bounds) if need.m2 else None),  # small: exact
            )
        return out

    def pass2(
        self, clip: torch.Tensor | None, means: Sequence[Tensors] | None, bounds: Bounds
    ) -> dict[str, Pass2]:
        out = {}
        for k, f in self.flat.items():
            out[k] = Pass2(
                clipped=(tuple((clip[x:y].to(f.dtype) @ f[x:y]).reshape(self.shapes[k])
                               for x, y in bounds) if clip is not None else None),
                cos=(cat([f[x:y] @ means[s][k].reshape(-1).to(f.dtype)
                          for s, (x, y) in enumerate(bounds)]) if means is not None else None),
            )
        return out


def grouped(sources: Sequence[Source]) -> list[Source]:
    """The sources, with small :class:`Dense` ones of one dtype merged into a
    :class:`DenseGroup`."""
    small: dict[tuple[torch.dtype, torch.device], list[Dense]] = {}
    rest: list[Source] = []
    for s in sources:
        if type(s) is Dense and s.numel <= DenseGroup.SMALL:
            small.setdefault((s.full.dtype, s.full.device), []).append(s)
        else:
            rest.append(s)
    for members in small.values():
        rest.extend([DenseGroup(members)] if len(members) > 1 else members)
    return rest
