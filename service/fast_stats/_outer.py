"""Weights whose per-sample gradient is a sum of outer products ``sum_t g_it a_it^T`` per group.

A linear layer is one group over its T positions (one without a sequence); a convolution,
unfolded, is ``groups`` of them over its output positions. The squared norm is
``|g_i|^2 |a_i|^2`` for one position, the Gram form ``<A_i A_i^T, G_i G_i^T>`` for T positions
where ``T (d + p) < d p`` (cheaper), and is otherwise read off the materialised ``G_i^T A_i``
(one batched matmul a chunk at a time); a dot product with a reference R is
``sum_t g_it^T R a_it`` and a weighted sum over samples is one matmul ``G^T diag(c) A``. Dot
products with M references, variance and (a linear layer's) cosine over T positions build
``G_i^T A_i`` a slice of output rows at a time into one buffer that stays in cache
(:meth:`OuterSource.pieces`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

import torch
from torch.linalg import vector_norm

from service.config import get_settings
from service.fast_stats._budget import Budget
from service.fast_stats._kernels import norms_and_mean_dots
from service.fast_stats._records import Pass1, Pass1Need, Pass2
from service.fast_stats._source import (
    Materialised,
    Moments,
    cat,
    m2_of,
    merge,
    present,
)
from service.fast_stats._tuning import TUNING
from service.strategies.base import Bounds, Tensors, dots_with
from service.strategies.projection import Projection

Block = tuple[int, int, torch.Tensor, torch.Tensor]  # lo, hi, A [n, Gr, T, d], G [n, Gr, T, p]
AddRows = Callable[[int, int, torch.Tensor], None]  # first sample, first row, piece


def form_for(positions: int, d: int, p: int, gain: float = 1.0) -> str:
    """How a weight's per-sample norms are formed, from its shapes: ``outer`` for one position;
    over T positions the Gram form (``T^2 (d + p)`` per sample and group) where it is cheaper
    than materialising ``G_i^T A_i`` (``T d p``, run ``gain`` times faster per operation than
    the Gram form's), unless ``PSGRAD_FAST_STATS_FORM`` forces one.
    """
    if positions == 1:
        return "outer"
    forced = get_settings().fast_stats_form
    if forced != "auto":
        return forced
    return "gram" if positions * (d + p) * gain < d * p else "materialise"


class OuterSource(Materialised):
    """A weight whose per-sample gradient is ``sum_t g_t a_t^T`` per group (Linear, Conv);
    a subclass says how to read its blocks of ``A`` and ``G``."""

    cache = False  # one batched matmul rebuilds a chunk: cheaper than holding B copies
    whole = True  # the whole parameter's gradient (False: a part of a tied one's)
    pieces_cos = False  # norms and dots with the mean may come from pieces (_cos_in_pieces)

    def __init__(
        self,
        name: str,
        shape: torch.Size,
        batch: int,
        budget: Budget,
        *,
        groups: int,
        d: int,
        p: int,
        positions: int,
        method: str,
    ) -> None:
        super().__init__([name], {name: shape}, batch, budget)
        self.method = method
        self.groups, self.d, self.p, self.t = groups, d, p, positions
        self._form = form_for(positions, d, p, self.gain())

    def gain(self) -> float:
        """How many times faster per operation this weight's per-sample gradients are
        materialised than the Gram form's products run (:func:`form_for`)."""
        return 1.0

    def form(self, name: str) -> str:
        return self._form

    def blocks(self, lo: int, hi: int) -> Iterator[Block]:
        raise NotImplementedError

    def grads(self, lo: int, hi: int) -> Tensors:
        parts = [
            (g.transpose(-1, -2) @ a).reshape(y - x, *self.shapes[self.names[0]])
            for x, y, a, g in self.blocks(lo, hi)
        ]
        return {self.names[0]: cat(parts)}

    def answer(self, rows: int | None = None) -> Tensors:
        """``G_i^T A_i`` per block, written straight into the answer (allocated once, never
        zeroed): one position is an outer product, a broadcast multiply that writes each
        element once (a batched matmul of inner size 1 is slower, see
        ``docs/architecture.md``); more positions are one batched matmul."""
        name = self.names[0]
        batch = self.batch if rows is None else rows
        out: torch.Tensor | None = None
        for x, y, a, g in self.blocks(0, batch):
            if out is None:
                out = g.new_empty((batch, *self.shapes[name]))
            n = (y - x) * self.groups
            view = out[x:y].view(n, self.p, self.d)
            gt, a = g.detach().transpose(-1, -2).reshape(n, self.p, -1), a.detach()
            if self.t == 1:
                torch.mul(gt, a.reshape(n, 1, self.d), out=view)
            else:
                torch.bmm(gt, a.reshape(n, -1, self.d), out=view)
        assert out is not None
        return {name: out}

    def project(self, projection: Projection, out: torch.Tensor) -> None:
        """Sketches from each block's inputs and output gradients (``project_outer``: Kronecker
        by two small GEMMs and a batched one, TensorSketch by FFTs or a built chunk)."""
        name = self.names[0]
        for x, y, a, g in self.blocks(0, self.batch):
            projection.project_outer(name, self.shapes[name], a, g, out[x:y])

    def _sq(self, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        if self._form == "outer":
            sq = vector_norm(a, dim=-1).square() * vector_norm(g, dim=-1).square()
            return sq.sum((1, 2))
        return (g @ g.transpose(-1, -2)).mul_(self.gram(a)).sum((1, 2, 3))

    def gram(self, a: torch.Tensor) -> torch.Tensor:
        """Each sample's and group's ``A A^T`` ``[n, Gr, T, T]`` (read, never written)."""
        return a @ a.transpose(-1, -2)

    def dot_rows(self, ref: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """Samples [lo, hi)'s dot products with ``ref`` (in the parameter's shape)."""
        return cat([self._dot(ref, a, g) for _, _, a, g in self.blocks(lo, hi)])

    def _dot(self, ref: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        """Each sample's dot product with ``ref`` (in the parameter's shape), for one block."""
        r = ref.reshape(self.groups, self.p, self.d).to(g.dtype)
        if self.groups > 1:
            return ((g @ r) * a).sum((1, 2, 3))
        g, a = g[:, 0], a[:, 0]  # one GEMM over every row, as a forward pass runs it
        rows = _time_major(g, a)
        g, a = (g.transpose(0, 1), a.transpose(0, 1)) if rows else (g, a)
        prod = (g.reshape(-1, self.p) @ r[0]).view(a.shape).mul_(a)
        return prod.sum((0, 2)) if rows else prod.sum((1, 2))

    def wsum(self, c: torch.Tensor | None, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """``sum_i c_i grad_i`` over rows [lo, hi) (``c`` of length hi - lo, or all ones)."""
        total: torch.Tensor | None = None
        for x, y, a, g in self.blocks(lo, hi):
            if c is not None:  # scale the smaller side
                scale = c[x - lo : y - lo].to(g.dtype).reshape(-1, 1, 1, 1)
                if self.p <= self.d:
                    g = g * scale
                else:
                    a = a * scale
            g, a = g.to(dtype), a.to(dtype)
            if self.groups == 1:  # one GEMM, as a batch gradient would be
                g, a = _rows(g[:, 0], a[:, 0])
                term = (g.reshape(-1, self.p).t() @ a.reshape(-1, self.d)).unsqueeze(0)
            else:
                term = torch.einsum("ngtp,ngtd->gpd", g, a)
            total = term if total is None else total + term
        assert total is not None
        return total.reshape(self.shapes[self.names[0]])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the inputs and output gradients (a subclass knows them)."""
        raise NotImplementedError

    def _sqsum(self, lo: int, hi: int) -> torch.Tensor:
        """``sum_i grad_i^2`` over rows [lo, hi) for one position: ``(g^2)^T (a^2)``, float64."""
        total = torch.zeros((self.groups, self.p, self.d), dtype=torch.float64)
        for _, _, a, g in self.blocks(lo, hi):
            a64, g64 = a.to(torch.float64), g.to(torch.float64)
            total = total.to(a.device) + torch.einsum("ngtp,ngtd->gpd", g64 * g64, a64 * a64)
        return total.reshape(self.shapes[self.names[0]])

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        name = self.names[0]
        if need.cos and self._cos_in_pieces():
            return {name: self._with_cos(need, keep)}
        if need.m2 and self._form != "outer":  # variance over T positions: one build
            rest = replace(need, sums=False, m2=False)
            first = self.pass1(rest, keep)[name] if rest.any else Pass1()
            return {name: self.with_moments(first, need)}
        if need.references is not None and self._form != "outer":
            # M dot products per sample cost M products of a forward's size in closed form:
            # from the gradients built a piece at a time, one batched matmul and small GEMMs
            rest = replace(need, references=None)
            first = self.pass1(rest, keep)[name] if rest.any else Pass1()
            return {name: replace(first, dots=self.dots(need.references[name]))}
        if self._form == "materialise" or need.references is not None:
            return super().pass1(need, keep)
        ref = need.reference[name] if need.reference is not None else None
        sq, dot = [], []
        for _, _, a, g in self.blocks(0, self.batch):  # one pass: a conv unfolds each block
            if need.sq:
                sq.append(self._sq(a, g))
            if ref is not None:
                dot.append(self._dot(ref, a, g))
        # one position's variance from its exact sums of squares, in float64
        totals: tuple[torch.Tensor, ...] | None = None
        if need.sums or need.m2:
            dtype = torch.float64 if need.m2 else need.sums_dtype
            totals = tuple(self.wsum(None, x, y, dtype) for x, y in need.bounds)
        return {name: Pass1(
            sq=cat(sq) if need.sq else None,
            dot=cat(dot) if ref is not None else None,
            sums=tuple(s.to(need.sums_dtype) for s in totals) if need.sums and totals else None,
            m2=tuple(m2_of(total, self._sqsum(x, y), y - x)
                     for total, (x, y) in zip(totals, need.bounds, strict=True))
            if need.m2 and totals is not None else None,
        )}

    def pieces(self, lo: int, hi: int, *, whole: bool = False
               ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Samples [lo, hi)'s gradients a piece at a time: (first sample, first row,
        ``[n, groups, rows, d]``), each written by one ``bmm`` into one reused buffer of about
        ``TUNING.piece_bytes`` (read it before the next), so that what is computed from it runs in
        cache, not over every per-sample gradient in memory. A piece is a slice of output rows
        of a set of samples (:meth:`piece_shape`; with ``whole``, every sample of a block);
        the sets come in sample order, and a set's slices one after another from row 0."""
        gr, p, d = self.groups, self.p, self.d
        for x, y, a, g in self.blocks(lo, hi):
            step, rows = self.piece_shape(y - x)
            step = y - x if whole else step
            buf = a.new_empty(min(step, y - x) * gr * rows * d)
            for s in range(0, y - x, step):
                e = min(y - x, s + step)
                n = (e - s) * gr
                a3 = a[s:e].reshape(n, -1, d)
                gt = g[s:e].reshape(n, -1, p).transpose(1, 2)  # [n, p, T]
                for r0 in range(0, p, rows):
                    r = min(p, r0 + rows) - r0
                    piece = buf[: n * r * d].view(n, r, d)
                    torch.bmm(gt[:, r0 : r0 + r], a3, out=piece)
                    yield x + s, r0, piece.view(e - s, gr, r, d)

    def piece_shape(self, n: int) -> tuple[int, int]:
        """Samples and output rows of one piece, for a block of n samples: at least
        ``TUNING.min_rows`` rows (a thinner batched matmul of inner size T runs at a fraction of a
        GEMM's speed: BERT-base's 3072-wide layers at B=32, T=64 took 10-row pieces at 22-37
        GFLOP/s against the GEMM's 80; on a 2-core EPYC host 64-row pieces ran BERT-base's
        layers at 47-53 GFLOP/s, 128-row ones at 55-59, the GEMM at 60-72), then as many
        samples as ``TUNING.piece_bytes`` holds (on an accelerator: as a quarter of the budget
        holds, the whole layer where it fits)."""
        per = self.groups * self.d * self.dtype.itemsize  # one output row of one sample
        size = self.budget.piece(TUNING.piece_bytes)
        rows = min(self.p, max(TUNING.min_rows, size // (n * per)))
        return max(1, min(n, size // (rows * per))), rows

    def span(self) -> int:
        """Samples per block of :meth:`blocks` (a linear layer: the whole batch at once)."""
        return self.batch

    def with_moments(self, first: Pass1, need: Pass1Need, add: AddRows | None = None) -> Pass1:
        """``first`` with each segment's m2, and its sums where asked, from :meth:`moments`."""
        moments = [self.moments(x, y, add, sums=need.sums) for x, y in need.bounds]
        return replace(first, m2=tuple(m2 for _, m2 in moments), sums=tuple(
            present(s, "moments(..., sums=True) answers the sum").to(need.sums_dtype)
            for s, _ in moments) if need.sums else None)

    def moments(self, lo: int, hi: int, add: AddRows | None = None, *, sums: bool = False
                ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Rows [lo, hi)'s sum (with ``sums``) and sum of squared deviations from their mean,
        from one build of their gradients a piece at a time (:meth:`pieces`): each piece's
        deviations from its own samples' mean (:func:`~._source.merge`: no
        cancellation), blocks of samples merged by Chan's formula. No weight-gradient GEMM for
        the sum, no second build, and the running mean kept only where it is asked for or
        blocks merge (GPT-2 small's variance took 1.7x a plain step with a GEMM and a second
        build). ``add(x, r0, piece)`` adds another part of the samples' gradients to the piece
        (a tied embedding's)."""
        shape = (self.groups, self.p, self.d)
        n = hi - lo  # more than one set of samples: their moments merge
        keep = sums or self.piece_shape(min(n, self.span()))[0] < n
        mean: torch.Tensor | None = None
        m2: torch.Tensor | None = None
        spare = torch.empty(0)  # a piece's own mean and m2, reused (fresh memory faults)
        for x, r0, piece in self.pieces(lo, hi):
            if add is not None:
                add(x, r0, piece)
            seen, rows = x - lo, slice(r0, r0 + piece.shape[2])
            if m2 is None:
                m2 = piece.new_empty(shape)
                mean = piece.new_empty(shape) if keep else None
            size = piece[0].numel()
            if spare.numel() < 2 * size:
                spare = piece.new_empty(2 * size)
            if seen == 0:  # straight into the answer (a copy of fresh memory costs more)
                at = mean[:, rows] if mean is not None else spare[:size].view(piece.shape[1:])
                merge(None, piece, part=(at, m2[:, rows]), in_place=True)
                continue
            # this set's moments merged into the rows' so far
            running = present(mean, "sets merge through the running mean")[:, rows]
            own = spare[:size].view(piece.shape[1:]), spare[size : 2 * size].view(piece.shape[1:])
            merge(Moments(seen, running, m2[:, rows]), piece, part=own, in_place=True)
        assert m2 is not None, "every segment has samples"
        out = self.shapes[self.names[0]]
        total = mean.mul_(hi - lo).reshape(out) if sums and mean is not None else None
        return total, m2.reshape(out)

    def dots(self, refs: torch.Tensor) -> torch.Tensor:
        """``[B, M]`` dot products with M references ``[M, *shape]``, a piece at a time."""
        refs = refs.reshape(len(refs), self.groups, self.p, self.d).to(self.dtype)
        return self._rowwise(0, self.batch, lambda rows, piece: dots_with(
            piece, refs[:, :, rows]))

    def _rowwise(self, lo: int, hi: int, part: Callable[[slice, torch.Tensor], torch.Tensor],
                 *, whole: bool = False) -> torch.Tensor:
        """Samples [lo, hi)'s sums over the pieces (:meth:`pieces`) of ``part(rows, piece)``,
        ``[n, ...]`` for a piece ``[n, groups, r, d]`` of output rows ``rows``."""
        out: list[torch.Tensor] = []
        for _, r0, piece in self.pieces(lo, hi, whole=whole):
            got = part(slice(r0, r0 + piece.shape[2]), piece)
            if r0 == 0:
                out.append(got)
            else:
                out[-1] += got
        return cat(out)

    def _cos_in_pieces(self) -> bool:
        """Whether each sample's squared norm and dot with its segment's mean, and the
        segment's sum, come from one build of its gradient a piece at a time, every sample of
        the segment in each piece (:meth:`_with_cos`): a linear layer over positions, where
        such a piece of ``TUNING.min_rows`` rows fits ``TUNING.whole_piece_bytes`` (on an
        accelerator, a quarter of the budget)."""
        per = self.groups * self.d * self.dtype.itemsize * min(self.p, TUNING.min_rows)
        return (self.pieces_cos and self.whole and self._form != "outer"
                and self.batch * per <= self.budget.piece(TUNING.whole_piece_bytes))

    def _with_cos(self, need: Pass1Need, keep: bool) -> Pass1:
        """The first pass with each sample's squared norm and dot with its segment's mean,
        and each segment's sum, from one build of the segment's gradients a slice of output
        rows at a time: the slice's sum over the samples, then each sample's dot with it, in
        cache. The Gram form's norms, a product for the sum and another of a forward's size
        for the dots cost BERT-base's cosine 1.54x a plain step at T=256."""
        rest = replace(need, sq=False, sums=False, cos=False)
        first = self.pass1(rest, keep)[self.names[0]] if rest.any else Pass1()
        done = [self._sq_and_cos(x, y) for x, y in need.bounds]
        both = cat([b for b, _ in done])
        return replace(first, sq=both[:, 0], cos=both[:, 1], averaged=True, sums=tuple(
            mean.reshape(self.shapes[self.names[0]]).to(need.sums_dtype) for _, mean in done))

    def _sq_and_cos(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [lo, hi)'s squared norms and dots with their mean ``[n, 2]``, and their mean
        ``[groups, p, d]``, written a slice of rows at a time as the pieces come (the mean
        itself, not a sum to divide: the dots need no division, the call's means none)."""
        held: list[torch.Tensor] = []

        def part(rows: slice, piece: torch.Tensor) -> torch.Tensor:
            if not held:
                held.append(piece.new_empty((self.groups, self.p, self.d)))
            return norms_and_mean_dots(piece, held[0][:, rows])

        return self._rowwise(lo, hi, part, whole=True), held[0]

    def pass2(
        self, clip: torch.Tensor | None, means: Sequence[Tensors] | None, bounds: Bounds
    ) -> dict[str, Pass2]:
        if self._cache is not None:
            return super().pass2(clip, means, bounds)
        # either form: the clipped sum is one product G^T diag(c) A, the dot with the mean
        # one per block or pairwise, never the per-sample gradients again
        name = self.names[0]
        return {name: Pass2(
            clipped=tuple(self.wsum(clip[x:y], x, y, clip.dtype) for x, y in bounds)
            if clip is not None else None,
            cos=cat([self.pairs(x, y).sum(1) / (y - x)
                     if self.whole and self.pairs_cheaper(y - x)
                     else self.dot_rows(means[s][name], x, y)
                     for s, (x, y) in enumerate(bounds)])
            if means is not None else None,
        )}

    def pairs_cheaper(self, n: int) -> bool:
        """Whether the n samples' pairwise products (``(n T)^2 (d + p)``) cost less than a dot
        with the mean (``n T d p``). Each sample's dot with the mean is then the mean of its
        dot products with each sample (:meth:`pairs`): for the whole parameter, or through
        the tied source whose part this is (the mean is the tied parameter's)."""
        return self.t > 1 and n * self.t * (self.d + self.p) < self.d * self.p

    def gathered(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples [lo, hi)'s ``A`` ``[n, Gr, T, d]`` and ``G`` ``[n, Gr, T, p]``, their
        blocks joined."""
        blocks = list(self.blocks(lo, hi))
        return cat([a for _, _, a, _ in blocks]), cat([g for _, _, _, g in blocks])

    def pairs(self, lo: int, hi: int) -> torch.Tensor:
        """Samples [lo, hi)'s pairwise dot products ``[n, n]``,
        ``<G_i^T A_i, G_j^T A_j> = sum (A_i A_j^T) * (G_i G_j^T)`` (GPT-2 small at B=4, T=64:
        under half the products of the dot with the mean)."""
        a, g = self.gathered(lo, hi)
        n, gr = hi - lo, self.groups
        a = a.transpose(0, 1).reshape(gr, -1, self.d)  # [Gr, n T, d]
        g = g.transpose(0, 1).reshape(gr, -1, self.p)
        each = (a @ a.transpose(1, 2)).mul_(g @ g.transpose(1, 2)).sum(0)  # [n T, n T]
        t = each.shape[0] // n
        return each.view(n, t, n, t).sum((1, 3))


def _rows(g: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``g``, ``a`` [n, T, k], or both time-major when both are laid out that way (attention's
    projections): a sum over every (sample, position) row does not care about the order of
    the rows as long as both sides share it, and this order needs no copy."""
    return (g.transpose(0, 1), a.transpose(0, 1)) if _time_major(g, a) else (g, a)


def _time_major(g: torch.Tensor, a: torch.Tensor) -> bool:
    """Whether ``g``, ``a`` [n, T, k] are both laid out time-major, and not batch first."""
    gt, at = g.transpose(0, 1), a.transpose(0, 1)
    return (not (g.is_contiguous() and a.is_contiguous())
            and gt.is_contiguous() and at.is_contiguous())
