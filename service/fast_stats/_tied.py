"""Tied weights: one parameter read by several uses of different kinds (GPT-2's token embedding,
read again as its output layer), each use a part of every per-sample gradient.

Dot products with references add part by part; sums and clipped sums are the output layer's
with the embedding's rows added in place; each sample's dot with the mean is the parts' added,
or the mean of its pairwise products with the segment's samples where those cost less
(:meth:`Tied.pairs`); the squared norm of the sum needs the parts' cross terms too. For an
embedding ``E_i`` (rows ``e_s`` at the sample's tokens ``tok_s``) tied to a weight
``L_i = G_i^T A_i`` read at T positions, ``<L_i, E_i> = sum_s sum_t G_i[t, tok_s] <a_t, e_s>``:
the output gradient's columns at the sample's own tokens against a ``[T, S]`` product, never
the ``vocab x dim`` gradient. So the 50257 x 768 matrix of GPT-2 costs what its two layers cost
apart, once. ``variance`` (element-wise squares of the sum) builds the output layer's
per-sample gradients a slice of rows at a time and adds the embedding's rows that fall in it
(:meth:`~._outer.OuterSource.with_moments`). Other combinations materialise the sum a chunk at
a time (:class:`~._source.Summed`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from service.fast_stats._budget import Budget
from service.fast_stats._outer import OuterSource
from service.fast_stats._records import Pass1, Pass1Need, Pass2
from service.fast_stats._source import Source, Summed, cat
from service.fast_stats.families.embedding import EmbeddingSource
from service.strategies.base import Bounds, Tensors


class Tied(Summed):
    """An embedding and an outer-product weight (``[vocab, dim]`` both) sharing one parameter:
    statistics from the parts and their cross term, the sum never built for them."""

    def __init__(self, name: str, emb: EmbeddingSource, outer: OuterSource, shape: torch.Size,
                 batch: int, budget: Budget) -> None:
        super().__init__(name, (emb, outer), shape, batch, budget)
        self.emb, self.outer = emb, outer
        outer.whole = False  # its dot with the mean is with the tied parameter's mean

    def form(self, name: str) -> str:
        return f"tied:{self.emb.form(name)}+{self.outer.form(name)}"

    def grads(self, lo: int, hi: int) -> Tensors:
        """The output layer's rows, the embedding's added in place: one table per sample, not
        three (GPT-2 small's ``wte`` is 154 MB a sample)."""
        name = self.names[0]
        return {name: self.emb.add_rows(self.outer.grads(lo, hi)[name].contiguous(), lo, hi)}

    def answer(self, rows: int | None = None) -> Tensors:
        """The output layer's answer, the embedding's rows added into it."""
        n = self.batch if rows is None else rows
        name = self.names[0]
        return {name: self.emb.add_rows(self.outer.answer(n)[name], 0, n)}

    def cross(self) -> torch.Tensor:
        """``<L_i, E_i>`` of every sample ``[B]``, a block of samples at a time."""
        out = []
        for x, y, a, g in self.outer.blocks(0, self.batch):
            a, g = a[:, 0], g[:, 0]  # [n, T, d], [n, T, p]: one group
            tokens, rows = self.emb.tokens[x:y], self.emb.g[x:y]  # [n, S], [n, S, d]
            picked = g.gather(2, tokens.unsqueeze(1).expand(-1, g.shape[1], -1))  # [n, T, S]
            out.append((picked * (a @ rows.transpose(1, 2).to(a.dtype))).sum((1, 2)))
        return cat(out)

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        name = self.names[0]
        if need.m2:  # the output layer's rows a slice at a time, the embedding's rows added
            rest = replace(need, sums=False, m2=False)
            first = self.pass1(rest, keep)[name] if rest.any else Pass1()
            return {name: self.outer.with_moments(first, need, self._add_rows)}
        # a part's mean is not the tied parameter's; the sums are the output layer's with
        # the embedding's rows added in place (each a fresh vocab x dim table cost page faults)
        part = replace(need, cos=False, sums=False)
        parts = [p.pass1(part)[name] for p in self.parts]
        e, o = parts

        def add(u: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor | None:
            return None if u is None or v is None else u + v.to(u)

        sq = add(e.sq, o.sq)
        return {name: Pass1(
            sq=None if sq is None else sq + 2 * self.cross().to(sq),
            dot=add(e.dot, o.dot),
            dots=add(e.dots, o.dots),
            sums=tuple(self.emb.add_to(self.outer.wsum(None, x, y, need.sums_dtype), None, x, y)
                       for x, y in need.bounds) if need.sums else None,
        )}

    def _add_rows(self, lo: int, r0: int, piece: torch.Tensor) -> None:
        """The embedding's part of samples [lo, lo + n)'s gradients in rows [r0, r0 + r)."""
        n, r = piece.shape[0], piece.shape[-2]  # [n, 1, r, d]: one group
        tokens = self.emb.tokens[lo : lo + n]
        inside = (tokens >= r0) & (tokens < r0 + r)
        at = torch.arange(n, device=tokens.device).unsqueeze(1) * r + tokens - r0
        piece.view(n * r, -1).index_add_(0, at[inside], self.emb.g[lo : lo + n][inside].to(piece))

    def pairs(self, lo: int, hi: int) -> torch.Tensor:
        """Samples [lo, hi)'s pairwise dot products ``[n, n]``: the output layer's
        (:meth:`~._outer.OuterSource.pairs`), the embedding's (rows at equal tokens) and the
        cross terms ``<L_j, E_i> = sum_s sum_t G_j[t, tok_is] <a_jt, e_is>``."""
        a, g = (v[:, 0] for v in self.outer.gathered(lo, hi))  # [n, T, d], [n, T, p]
        n, tokens = hi - lo, self.emb.tokens[lo:hi].reshape(-1)  # every sample's, [n S]
        rows = self.emb.g[lo:hi].reshape(len(tokens), -1).to(a.dtype)  # [n S, d]
        le = (g.index_select(2, tokens) * (a @ rows.t())).sum(1).view(n, n, -1).sum(2)
        ee = (rows @ rows.t()).masked_fill_(tokens.unsqueeze(1) != tokens, 0)
        ee = ee.view(n, -1, n, len(tokens) // n).sum((1, 3))
        return self.outer.pairs(lo, hi) + le + le.t() + ee

    def pass2(
        self, clip: torch.Tensor | None, means: Sequence[Tensors] | None, bounds: Bounds
    ) -> dict[str, Pass2]:
        """The clipped sums, the output layer's with the embedding's rows added in place; each
        sample's dot with the tied parameter's mean from the pairwise products where they cost
        less than the dot (GPT-2 small at B=4 T=64: the output layer's dot with the 50257 x 768
        mean is a product of its forward's size), else the parts' dots added."""
        name = self.names[0]
        cos = None
        if means is not None and all(self.outer.pairs_cheaper(y - x) for x, y in bounds):
            cos = cat([self.pairs(x, y).sum(1) / (y - x) for x, y in bounds])
        elif means is not None:
            e, o = (p.pass2(None, means, bounds)[name].cos for p in self.parts)
            cos = None if e is None or o is None else e + o.to(e)
        return {name: Pass2(
            clipped=tuple(self.emb.add_to(self.outer.wsum(clip[x:y], x, y, clip.dtype),
                                          clip[x:y], x, y) for x, y in bounds)
            if clip is not None else None,
            cos=cos,
        )}


def summed(name: str, parts: Sequence[Source], shape: torch.Size, batch: int,
           budget: Budget) -> Summed:
    """The source of a parameter read by several kinds of use: in closed form where it has
    one (an embedding tied to a weight of the same shape), else materialised."""
    emb = [p for p in parts if isinstance(p, EmbeddingSource)]
    outer = [p for p in parts if isinstance(p, OuterSource)]
    if (len(parts) == 2 and len(emb) == 1 and len(outer) == 1 and outer[0].groups == 1
            and (outer[0].p, outer[0].d) == tuple(shape)):
        return Tied(name, emb[0], outer[0], shape, batch, budget)
    return Summed(name, parts, shape, batch, budget)
