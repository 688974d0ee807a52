"""Per-sample gradients small enough to hold whole: biases, norms' affine parameters, additions.

A family that can write a parameter's per-sample gradient cheaply (``[B, *shape]``) hands it to
:class:`Dense`; small ones of one dtype are then computed together as one :class:`DenseGroup`.
A selected parameter the forward pass never reads is a :class:`Zero`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeGuard

import torch

from service.fast_stats._budget import Budget
from service.fast_stats._records import Pass1, Pass1Need, Pass2
from service.fast_stats._source import Materialised, Source, SourceContext, cat, merge
from service.strategies.base import Bounds, Tensors, squared_norms, total
from service.strategies.projection import Projection


class Dense(Materialised):
    """Per-sample gradients held whole, ``[B, *shape]``."""

    def __init__(self, name: str, grads: torch.Tensor, budget: Budget, method: str,
                 form: str | None = None) -> None:
        super().__init__(
            [name], {name: grads.shape[1:]}, grads.shape[0], budget, grads.element_size()
        )
        self.method = method
        self._form = form or method
        self.full = grads

    def form(self, name: str) -> str:
        return self._form

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

    def answer(self, rows: int | None = None) -> Tensors:
        return {self.names[0]: self.full[:rows].contiguous()}  # an answer owns its memory

    def project(self, projection: Projection, out: torch.Tensor) -> None:
        """A zero gradient adds nothing to a sketch."""


class DenseGroup(Source):
    """Small per-sample gradients (biases, norms' affine parameters) as one source, members of
    one size stacked ``[B, K, n]``: each statistic is one operation per size, not one per
    parameter (BERT-base's 124 biases and norms' parameters come in three sizes; on a GPU each
    operation is a kernel launch, and at small batches the launches are the cost). The stacks
    are one copy of what is small."""

    SMALL = 1 << 14  # elements per sample of a member

    def __init__(self, parts: Sequence[Dense]) -> None:
        names = [p.names[0] for p in parts]
        super().__init__(names, {k: p.shapes[k] for k, p in zip(names, parts, strict=True)},
                         parts[0].batch, parts[0].budget)
        self.how = {k: v for p in parts for k, v in p.described().items()}
        sizes: dict[int, list[Dense]] = {}
        for p in parts:
            sizes.setdefault(p.numel, []).append(p)
        self.stacks = [([p.names[0] for p in same],
                        torch.stack([p.full.reshape(self.batch, -1) for p in same], 1))
                       for same in sizes.values()]

    def method_of(self, name: str) -> str:
        return self.how[name][0]

    def form(self, name: str) -> str:
        return self.how[name][1]

    def grads(self, lo: int, hi: int) -> Tensors:
        return {k: s[lo:hi, j].reshape(hi - lo, *self.shapes[k])
                for names, s in self.stacks for j, k in enumerate(names)}

    def answer(self, rows: int | None = None) -> Tensors:
        return {k: g.contiguous()
                for k, g in self.grads(0, self.batch if rows is None else rows).items()}

    def _split(self, values: torch.Tensor, names: Sequence[str]) -> Tensors:
        """``values`` ``[K, n]``, one row per member, as each member's tensor in its shape."""
        return {k: values[j].view(self.shapes[k]) for j, k in enumerate(names)}

    def _stacked(self, tensors: Tensors, names: Sequence[str], dtype: torch.dtype, *,
                 many: bool = False) -> torch.Tensor:
        """The members' ``tensors`` (a reference, means) stacked as their gradients are,
        ``[K, n]`` (``many``: M of each, ``[M, *shape]``, as ``[M, K, n]``)."""
        return torch.stack([(tensors[k].reshape(len(tensors[k]), -1) if many
                             else tensors[k].reshape(-1)).to(dtype) for k in names], -2)

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        out: dict[str, Pass1] = {}
        for names, s in self.stacks:
            batch, count = s.shape[:2]
            sq = (squared_norms(s.reshape(batch * count, -1)).view(batch, count)
                  if need.sq else None)
            dot = (torch.einsum("bkn,kn->bk", s, self._stacked(need.reference, names, s.dtype))
                   if need.reference is not None else None)
            dots = (torch.einsum("bkn,mkn->bkm", s, self._stacked(
                need.references, names, s.dtype, many=True))
                if need.references is not None else None)
            sums = ([self._split(s[x:y].sum(0, dtype=need.sums_dtype), names)
                     for x, y in need.bounds] if need.sums else None)
            m2 = ([self._split(merge(None, s[x:y].to(torch.float64)).m2.to(need.sums_dtype),
                               names)  # small: exact, then in the model's dtype at once
                   for x, y in need.bounds] if need.m2 else None)
            for j, k in enumerate(names):
                out[k] = Pass1(
                    sq=sq[:, j] if sq is not None else None,
                    dot=dot[:, j] if dot is not None else None,
                    dots=dots[:, j] if dots is not None else None,
                    sums=tuple(seg[k] for seg in sums) if sums is not None else None,
                    m2=tuple(seg[k] for seg in m2) if m2 is not None else None,
                )
        return out

    def pass2(
        self, clip: torch.Tensor | None, means: Sequence[Tensors] | None, bounds: Bounds
    ) -> dict[str, Pass2]:
        out: dict[str, Pass2] = {}
        for names, s in self.stacks:
            clipped = ([self._split(torch.einsum("b,bkn->kn", clip[x:y].to(s.dtype), s[x:y]),
                                    names) for x, y in bounds] if clip is not None else None)
            cos = (cat([torch.einsum("bkn,kn->bk", s[x:y], self._stacked(means[i], names,
                                                                          s.dtype))
                        for i, (x, y) in enumerate(bounds)]) if means is not None else None)
            for j, k in enumerate(names):
                out[k] = Pass2(
                    clipped=tuple(seg[k] for seg in clipped) if clipped is not None else None,
                    cos=cos[:, j] if cos is not None else None,
                )
        return out


def groupable(source: Source) -> TypeGuard[Dense]:
    """Whether :func:`grouped` merges ``source`` with others of its dtype."""
    return type(source) is Dense and source.numel <= DenseGroup.SMALL


def grouped(sources: Sequence[Source]) -> list[Source]:
    """The sources, with small :class:`Dense` ones of one dtype merged into a
    :class:`DenseGroup`."""
    small: dict[tuple[torch.dtype, torch.device], list[Dense]] = {}
    rest: list[Source] = []
    for s in sources:
        if groupable(s):
            small.setdefault((s.full.dtype, s.full.device), []).append(s)
        else:
            rest.append(s)
    for members in small.values():
        rest.extend([DenseGroup(members)] if len(members) > 1 else members)
    return rest
