"""Embeddings from (token id, gradient row) pairs; never a dense vocab x dim tensor per sample.

Sample i's gradient has one row per distinct token it contains, the sum of the output gradient
rows at that token's positions (none for ``padding_idx``). Rows are summed per (sample, token)
with one ``unique`` + ``index_add``; norms, dot products and weighted sums follow from them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from service.fast_stats._core import (
    Capture,
    Materialised,
    Need,
    Pass1,
    Pass2,
    Tensors,
    Use,
    cat,
    register_op,
)
from service.fast_stats._sources import SourceContext, register_source
from service.fast_stats.linear import bind


class EmbeddingSource(Materialised):
    method = "embedding"

    def __init__(self, name: str, uses: list[Use], ctx: SourceContext) -> None:
        super().__init__([name], {name: ctx.shapes[name]}, ctx.batch, ctx.budget)
        self.vocab, self.dim = ctx.shapes[name]
        batch = ctx.batch
        tokens = [u.a.reshape(batch, -1) for u in uses]
        rows = [u.grad_bf().reshape(batch, -1, self.dim) for u in uses]
        self.tokens = cat(tokens, 1)
        g = cat(rows, 1)
        padding = uses[0].info["key"]
        if padding is not None:
            g = g * (self.tokens != padding).unsqueeze(-1).to(g.dtype)
        self.g = g
        self._rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each (sample, token) pair once: its sample, its token and its gradient row."""
        if self._rows is None:
            keys = (
                torch.arange(self.batch, device=self.tokens.device).unsqueeze(1) * self.vocab
                + self.tokens
            ).reshape(-1)
            uniq, inverse = torch.unique(keys, return_inverse=True)
            summed = self.g.new_zeros((uniq.numel(), self.dim))
            summed.index_add_(0, inverse, self.g.reshape(-1, self.dim))
            self._rows = (uniq // self.vocab, uniq % self.vocab, summed)
        return self._rows

    def grads(self, lo: int, hi: int) -> Tensors:
        n = hi - lo
        dense = self.g.new_zeros((n * self.vocab, self.dim))
        local = torch.arange(n, device=self.g.device).unsqueeze(1) * self.vocab
        dense.index_add_(
            0, (local + self.tokens[lo:hi]).reshape(-1), self.g[lo:hi].reshape(-1, self.dim)
        )
        return {self.names[0]: dense.view(n, self.vocab, self.dim)}

    def _dots(self, ref: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return (self.g[lo:hi] * ref.to(self.g.dtype)[self.tokens[lo:hi]]).sum((1, 2))

    def _wsum(self, c: torch.Tensor | None, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        g = self.g[lo:hi].to(dtype)
        if c is not None:
            g = g * c.to(dtype).reshape(-1, 1, 1)
        out = g.new_zeros((self.vocab, self.dim))
        return out.index_add_(0, self.tokens[lo:hi].reshape(-1), g.reshape(-1, self.dim))

    def pass1(self, need: Need, keep: bool = True) -> dict[str, Pass1]:
        out = Pass1()
        if need.sq:
            sample, _, summed = self.rows()
            out.sq = self.g.new_zeros(self.batch).index_add_(0, sample, summed.pow(2).sum(1))
        if need.reference is not None:
            out.dot = self._dots(need.reference[self.names[0]], 0, self.batch)
        if need.sums:
            out.sums = [self._wsum(None, a, b, need.sums_dtype) for a, b in need.bounds]
        if need.sqsums:
            sample, token, summed = self.rows()
            sq = summed.to(torch.float64).pow(2)
            out.sqsums = []
            for a, b in need.bounds:
                pick = (sample >= a) & (sample < b)
                total = sq.new_zeros((self.vocab, self.dim))
                out.sqsums.append(total.index_add_(0, token[pick], sq[pick]))
        return {self.names[0]: out}

    def pass2(
        self, clip: torch.Tensor | None, means: list[Tensors] | None, bounds: list[tuple[int, int]]
    ) -> dict[str, Pass2]:
        out = Pass2()
        name = self.names[0]
        if clip is not None:
            out.clipped = [self._wsum(clip[a:b], a, b, clip.dtype) for a, b in bounds]
        if means is not None:
            out.cos = torch.cat(
                [self._dots(means[s][name], a, b) for s, (a, b) in enumerate(bounds)]
            )
        return {name: out}


@register_source("embedding")
def embedding_source(name: str, role: str, uses: list[Use], ctx: SourceContext) -> Materialised:
    return EmbeddingSource(name, uses, ctx)


@register_op(F.embedding)
def capture_embedding(
    cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], found: dict[int, str]
) -> tuple[Any, list[Use]] | None:
    x, w, padding, max_norm, _, by_freq, sparse = bind(
        args,
        kwargs,
        ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"),
    )
    if (
        max_norm is not None
        or by_freq
        or sparse
        or id(x) in found
        or not cap.is_batched(x)
        or x.is_floating_point()
        or not isinstance(w, torch.Tensor)
        or id(w) not in found
    ):
        return None
    if padding is not None and padding < 0:
        padding += w.shape[0]
    out = func(*args, **kwargs)
    return out, [
        Use("embedding", func, {found[id(w)]: "weight"}, out=out, a=x, info={"key": padding})
    ]
