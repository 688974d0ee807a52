"""Embeddings from (token id, gradient row) pairs; never a dense vocab x dim tensor per sample.

Sample i's gradient has one row per distinct token it contains, the sum of the output gradient
rows at that token's positions (none for ``padding_idx``). Rows are summed per (sample, token)
with one ``unique`` + ``index_add``; norms, dot products and weighted sums follow from them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.fast_stats._capture import Capture, bind
from service.fast_stats._family import Captured, Family, register_family
from service.fast_stats._records import Pass1, Pass1Need, Pass2, Use
from service.fast_stats._source import Materialised, Source, SourceContext, cat, m2_of
from service.strategies.base import Bounds, Tensors
from service.strategies.projection import Projection

_NAMES = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
_ATEN = torch.ops.aten.embedding.default  # exported graphs: the weight first, no max_norm
_ATEN_NAMES = ("weight", "indices", "padding_idx", "scale_grad_by_freq", "sparse")


@dataclass(frozen=True)
class TokenInput:
    tokens: torch.Tensor  # [B, ...] token ids
    padding_idx: int | None  # non-negative

    @property
    def key(self) -> Hashable:
        return self.padding_idx


class EmbeddingSource(Materialised):
    method = "embedding"

    def __init__(
        self, name: str, inputs: Sequence[TokenInput], grads: Sequence[torch.Tensor],
        ctx: SourceContext,
    ) -> None:
        super().__init__([name], {name: ctx.shapes[name]}, ctx.batch, ctx.budget)
        self.vocab, self.dim = ctx.shapes[name]
        batch = ctx.batch
        self.tokens = cat([p.tokens.reshape(batch, -1) for p in inputs], 1)
        g = cat([x.reshape(batch, -1, self.dim) for x in grads], 1)
        padding = inputs[0].padding_idx
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
        dense = self.g.new_zeros((hi - lo, self.vocab, self.dim))
        return {self.names[0]: self.add_rows(dense, lo, hi)}

    def add_rows(self, dense: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Rows [lo, hi)'s gradients added into ``dense`` ``[hi - lo, vocab, dim]`` (contiguous),
        and it returned: a tied weight's other part written first, no table of zeros."""
        n = hi - lo
        local = torch.arange(n, device=self.g.device).unsqueeze(1) * self.vocab
        dense.view(n * self.vocab, self.dim).index_add_(
            0, (local + self.tokens[lo:hi]).reshape(-1),
            self.g[lo:hi].reshape(-1, self.dim).to(dense.dtype))
        return dense

    def answer(self, rows: int | None = None) -> Tensors:
        # one index_add into zeros: no chunk to copy
        return self.grads(0, self.batch if rows is None else rows)

    def project(self, projection: Projection, out: torch.Tensor) -> None:
        """Sketches from the (token, gradient row) pairs: no dense table per sample."""
        name = self.names[0]
        projection.project_rows(name, self.shapes[name], self.tokens, self.g, out)

    def _dots(self, ref: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        return (self.g[lo:hi] * ref.to(self.g.dtype)[self.tokens[lo:hi]]).sum((1, 2))

    def _many(self, refs: torch.Tensor) -> torch.Tensor:
        """Each sample's dot products with M references ``[M, vocab, dim]``: ``[B, M]``, from
        the reference rows at the sample's tokens."""
        rows = refs.to(self.g.dtype)[:, self.tokens]  # [M, B, S, dim]
        return torch.einsum("bsd,mbsd->bm", self.g, rows)

    def wsum(self, c: torch.Tensor | None, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        return self.add_to(self.g.new_zeros((self.vocab, self.dim), dtype=dtype), c, lo, hi)

    def add_to(self, out: torch.Tensor, c: torch.Tensor | None, lo: int, hi: int
               ) -> torch.Tensor:
        """``out`` (``vocab x dim``) with ``sum_i c_i grad_i`` over rows [lo, hi) added in
        place (``c`` of length hi - lo, or all ones)."""
        g = self.g[lo:hi].to(out.dtype)
        if c is not None:
            g = g * c.to(out.dtype).reshape(-1, 1, 1)
        return out.index_add_(0, self.tokens[lo:hi].reshape(-1), g.reshape(-1, self.dim))

    def _sq(self) -> torch.Tensor:
        sample, _, summed = self.rows()
        return self.g.new_zeros(self.batch).index_add_(0, sample, summed.pow(2).sum(1))

    def _m2(self, bounds: Bounds) -> tuple[torch.Tensor, ...]:
        """Each segment's sum of squared deviations, from its (sample, token) rows in float64
        over the tokens it contains (zero elsewhere), written once into the dense table."""
        sample, token, summed = self.rows()
        out = []
        for a, b in bounds:
            pick = (sample >= a) & (sample < b)
            used, at = torch.unique(token[pick], return_inverse=True)
            rows = summed[pick].to(torch.float64)
            sums = rows.new_zeros((used.numel(), self.dim)).index_add_(0, at, rows)
            sqsums = torch.zeros_like(sums).index_add_(0, at, rows.square())
            m2 = self.g.new_zeros((self.vocab, self.dim))
            out.append(m2.index_copy_(0, used, m2_of(sums, sqsums, b - a).to(m2.dtype)))
        return tuple(out)

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        """The first pass; with ``cos``, each sample's dot with its segment's mean too, read off
        the segment's sum at the sample's tokens (no second pass: a second pass would copy
        the ``vocab x dim`` sum for the mean, BERT-base's cosine at B=4 T=64 spent 7% of a
        step on that copy)."""
        ref = need.reference[self.names[0]] if need.reference is not None else None
        sums = (tuple(self.wsum(None, a, b, need.sums_dtype) for a, b in need.bounds)
                if need.sums or need.cos else None)
        return {self.names[0]: Pass1(
            sq=self._sq() if need.sq else None,
            dot=self._dots(ref, 0, self.batch) if ref is not None else None,
            dots=self._many(need.references[self.names[0]])
            if need.references is not None else None,
            sums=sums,
            m2=self._m2(need.bounds) if need.m2 else None,
            cos=torch.cat([self._dots(total, a, b) / (b - a)
                           for total, (a, b) in zip(sums, need.bounds, strict=True)])
            if need.cos and sums is not None else None,
        )}

    def pass2(
        self, clip: torch.Tensor | None, means: Sequence[Tensors] | None, bounds: Bounds
    ) -> dict[str, Pass2]:
        name = self.names[0]
        return {name: Pass2(
            clipped=tuple(self.wsum(clip[a:b], a, b, clip.dtype) for a, b in bounds)
            if clip is not None else None,
            cos=torch.cat([self._dots(means[s][name], a, b) for s, (a, b) in enumerate(bounds)])
            if means is not None else None,
        )}


@register_family(F.embedding, _ATEN)
class Embedding(Family[TokenInput]):
    method = "embedding"

    def source(self, name: str, role: str, uses: Sequence[Use], ctx: SourceContext) -> Source:
        return EmbeddingSource(name, [self.payload(u) for u in uses], [u.grad for u in uses], ctx)

    def capture(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        if func is _ATEN:
            w, x, padding, by_freq, sparse = bind(args, kwargs, _ATEN_NAMES)
            max_norm = None
            padding = None if padding is None or padding < 0 else padding  # aten's -1: none
        else:
            x, w, padding, max_norm, _, by_freq, sparse = bind(args, kwargs, _NAMES)
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
        return out, [self.use(func, {found[id(w)]: "weight"}, TokenInput(x, padding), out)]
