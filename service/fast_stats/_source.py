"""Sources: the per-sample statistics of some parameters, in two passes.

The first pass answers each sample's squared norm and dot product with a reference, and each
segment's sum and sum of squares; the second, once every norm is known, each segment's sum of
clipped gradients and each sample's dot product with its segment's mean. :class:`Materialised`
computes both from per-sample gradients built a chunk at a time (kept between the passes if the
budget allows); a family overrides the passes with its closed form where it has one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from service.fast_stats._budget import Budget
from service.fast_stats._kernels import merged_into, moments_into
from service.fast_stats._records import Pass1, Pass1Need, Pass2
from service.strategies.base import Bounds, Tensors, dots_with, keep_rows, squared_norms
from service.strategies.projection import Projection

T = TypeVar("T")
SAMPLES = "every segment has samples"


class LastGram:
    """The last per-sample Gram matrix ``A_i A_i^T`` of a linear layer's input ``[n, 1, T, d]``,
    kept for the next layer that reads the same input: the passes reach such layers one after
    another (BERT's query, key and value; a gated MLP's two input projections), which then build
    it once, not once each. One per call; it holds the input it was built from, so that the
    input's memory is no other tensor's while it is kept."""

    def __init__(self) -> None:
        self._last: tuple[tuple[object, ...], torch.Tensor, torch.Tensor] | None = None

    def __call__(self, a: torch.Tensor) -> torch.Tensor:
        key = (a.data_ptr(), a.shape, a.stride(), a.dtype, a.device, a._version)
        if self._last is None or self._last[0] != key:
            self._last = (key, a, a @ a.transpose(-1, -2))
        return self._last[2]


@dataclass(frozen=True)
class SourceContext:
    """What every source of one call may need besides its uses."""

    batch: int
    budget: Budget
    shapes: dict[str, torch.Size]
    params: Tensors  # every parameter's value for this call
    buffers: Tensors
    dtype: torch.dtype
    device: torch.device
    activation_numel: int
    grams: LastGram = field(default_factory=LastGram, compare=False)


def cat(parts: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat`` that does not copy a single part (fresh memory costs page faults)."""
    return parts[0] if len(parts) == 1 else torch.cat(list(parts), dim)


def overlaps(bounds: Bounds, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """(segment, start, stop) of each segment's part of rows [lo, hi), relative to lo."""
    for s, (a, b) in enumerate(bounds):
        x, y = max(a, lo), min(b, hi)
        if x < y:
            yield s, x - lo, y - lo


class Source:
    """Per-sample statistics of some parameters, from the uses captured for them."""

    method = "direct"

    def __init__(
        self, names: Sequence[str], shapes: dict[str, torch.Size], batch: int, budget: Budget
    ) -> None:
        self.names = tuple(names)
        self.shapes = shapes
        self.batch = batch
        self.budget = budget

    def form(self, name: str) -> str:
        """How ``meta["form"]`` names the way ``name``'s statistics were computed."""
        return self.method

    def method_of(self, name: str) -> str:
        return self.method

    def described(self) -> dict[str, tuple[str, str]]:
        """``{name: (method, form)}`` of its parameters, for a source that stands in for it."""
        return {k: (self.method_of(k), self.form(k)) for k in self.names}

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        """The first pass; ``keep``: a second pass follows (what it rereads may be kept)."""
        raise NotImplementedError

    def pass2(
        self, clip: torch.Tensor | None, means: Sequence[Tensors] | None, bounds: Bounds
    ) -> dict[str, Pass2]:
        raise NotImplementedError

    def grads(self, lo: int, hi: int) -> Tensors:
        """Materialised per-sample gradients of rows [lo, hi), ``{name: [n, *shape]}``."""
        raise NotImplementedError

    def answer(self, rows: int | None = None) -> Tensors:
        """Every sample's gradient, ``{name: [B, *shape]}``: the answer itself, so each
        parameter's is one buffer written once (a family overrides this to write its closed
        form straight into the buffer). ``rows``: the first samples' only, as the plan's check
        reads them."""
        return self.grads(0, self.batch if rows is None else rows)

    def project(self, projection: Projection, out: torch.Tensor) -> None:
        """Adds its parameters' part of every sample's sketch to ``out`` ``[B, k]``, from the
        materialised gradients; a family with a structured form overrides it."""
        projection.project_many(self.grads(0, self.batch), out)


def answers(found: Sequence[Source], rows: int | None = None) -> Tensors:
    """Every parameter's per-sample gradients (``rows``: the first samples'), each source's
    written into its own buffers."""
    out: Tensors = {}
    for source in found:
        out.update(source.answer(rows))
    return out


Chunk = tuple[int, int, Tensors]  # rows [lo, hi) and their per-sample gradients


@dataclass(frozen=True)
class Moments:
    """Count, mean and sum of squared deviations of some samples' gradients, element-wise."""

    n: int
    mean: torch.Tensor
    m2: torch.Tensor


def merge(acc: Moments | None, rows: torch.Tensor, *,
          part: tuple[torch.Tensor, torch.Tensor] | None = None, in_place: bool = False
          ) -> Moments:
    """``acc`` with the samples ``rows`` ``[n, *shape]`` added (Chan et al.'s pairwise update).

    Each chunk's deviations are taken from its own mean (:func:`~._kernels.moments_into`: two
    reads of the chunk), so nothing cancels: ``E[g^2] - E[g]^2`` in float32 loses every digit
    when the mean is large next to the spread, and float64 copies of every per-sample gradient
    cost more than the products that made them. (``torch.var_mean`` over the first dimension
    took ten times as long on the CPU.) ``acc`` is updated in place. Where the loops do not
    merge in the same read, the chunk's own mean and m2 go into ``part`` (reused buffers:
    fresh memory faults) or new tensors, and with ``in_place`` the eager operations may write
    over ``rows``.
    """
    n = rows.shape[0]
    if acc is not None and merged_into(rows, acc.mean, acc.m2, acc.n):  # in the same loop
        return Moments(acc.n + n, acc.mean, acc.m2)
    mean, m2 = part or (rows.new_empty(rows.shape[1:]), rows.new_empty(rows.shape[1:]))
    if n == 1:  # no deviations (two operations, not three, where the loops do not run)
        mean.copy_(rows[0])
        m2.zero_()
    else:
        moments_into(rows, mean, m2, in_place=in_place)
    own = Moments(n, mean, m2)
    return own if acc is None else combine(acc, own)


def combine(acc: Moments, part: Moments) -> Moments:
    """``acc`` with another group's moments added (Chan et al.'s pairwise update), written
    into ``acc``'s own tensors (views write through); ``part``'s mean is spent."""
    total = acc.n + part.n
    delta = part.mean.sub_(acc.mean)
    acc.mean.add_(delta, alpha=part.n / total)
    acc.m2.add_(part.m2).add_(delta.square_().mul_(acc.n * part.n / total))
    return Moments(total, acc.mean, acc.m2)


def m2_of(sums: torch.Tensor, sqsums: torch.Tensor, n: int) -> torch.Tensor:
    """The sum of squared deviations from sums and sums of squares, both float64 (closed forms
    that have the exact sums of squares: one position, embedding rows): ``n (E[g^2] - E[g]^2)``,
    clamped at 0 against rounding."""
    mean = sums.to(torch.float64) / n
    return (sqsums / n - mean * mean).clamp(min=0) * n


def present(value: T | None, why: str) -> T:
    """``value``, which ``why`` guarantees is set."""
    assert value is not None, why
    return value


class Materialised(Source):
    """Statistics from per-sample gradients built a chunk at a time (kept if the budget allows).

    ``variance``'s deviations are merged chunk by chunk (:func:`merge`), never formed as
    ``E[g^2] - E[g]^2``, so they keep their digits when the mean is large next to the spread.
    """

    cache = True  # keep the per-sample gradients for the second pass (when the budget allows)

    def __init__(
        self,
        names: Sequence[str],
        shapes: dict[str, torch.Size],
        batch: int,
        budget: Budget,
        itemsize: int = 4,
    ) -> None:
        super().__init__(names, shapes, batch, budget)
        self.numel = sum(shapes[k].numel() for k in self.names)
        self.itemsize = itemsize
        self._cache: list[Chunk] | None = None

    def chunk_size(self) -> int:
        return self.budget.chunk(self.numel * self.itemsize * 3, self.batch)

    def chunks(self, keep: bool = False) -> Iterator[Chunk]:
        if self._cache is not None:
            yield from self._cache
            return
        step = self.chunk_size()
        kept: list[Chunk] = []
        keep = keep and self.cache and self.budget.reserve(self.batch * self.numel * self.itemsize)
        for lo in range(0, self.batch, step):
            hi = min(self.batch, lo + step)
            item = (lo, hi, self.grads(lo, hi))
            if keep:
                kept.append(item)
            yield item
        if keep:
            self._cache = kept

    def answer(self, rows: int | None = None) -> Tensors:
        """The chunks (the cached ones, if any) copied into one buffer per parameter."""
        if rows is not None and rows < self.batch:
            return self.grads(0, rows)
        out: Tensors = {}
        for lo, hi, grads in self.chunks():
            keep_rows(out, self.batch, lo, hi, grads)
        return out

    def project(self, projection: Projection, out: torch.Tensor) -> None:
        for lo, hi, grads in self.chunks():
            projection.project_many(grads, out[lo:hi])

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        def zeros(k: str, dtype: torch.dtype) -> list[torch.Tensor]:
            return [torch.zeros(self.shapes[k], dtype=dtype) for _ in need.bounds]

        sq: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        dot: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        dots: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        sums = {k: zeros(k, need.sums_dtype) for k in self.names} if need.sums else None
        moments: dict[str, list[Moments | None]] = {k: [None] * len(need.bounds)
                                                     for k in self.names}
        for lo, hi, grads in self.chunks(keep):
            for k, g in grads.items():
                flat = g.reshape(hi - lo, -1)
                if need.sq:
                    sq[k].append(squared_norms(flat))
                if need.reference is not None:
                    dot[k].append(flat @ need.reference[k].reshape(-1).to(flat.dtype))
                if need.references is not None:
                    dots[k].append(dots_with(flat, need.references[k]))
                for s, x, y in overlaps(need.bounds, lo, hi):
                    if need.m2:  # the mean comes with it
                        moments[k][s] = merge(moments[k][s], g[x:y])
                    elif sums is not None:
                        part = g[x:y].sum(0, dtype=need.sums_dtype)
                        sums[k][s] = sums[k][s].to(g.device) + part
        if need.m2 and sums is not None:
            for k in self.names:
                sums[k] = [m.mean.mul(m.n).to(need.sums_dtype)
                           for m in (present(v, SAMPLES) for v in moments[k])]
        return {
            k: Pass1(
                sq=cat(sq[k]) if need.sq else None,
                dot=cat(dot[k]) if need.reference is not None else None,
                dots=cat(dots[k]) if need.references is not None else None,
                sums=tuple(sums[k]) if sums is not None else None,
                m2=tuple(present(m, SAMPLES).m2 for m in moments[k])
                if need.m2 else None,
            )
            for k in self.names
        }

    def pass2(
        self, clip: torch.Tensor | None, means: Sequence[Tensors] | None, bounds: Bounds
    ) -> dict[str, Pass2]:
        clipped = None
        if clip is not None:
            clipped = {k: [torch.zeros(self.shapes[k]) for _ in bounds] for k in self.names}
        cos: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        for lo, hi, grads in self.chunks():
            for k, g in grads.items():
                for s, x, y in overlaps(bounds, lo, hi):
                    if clip is not None and clipped is not None:
                        c = clip[lo + x : lo + y].to(g.dtype)
                        clipped[k][s] = clipped[k][s].to(g) + torch.tensordot(c, g[x:y], dims=1)
                    if means is not None:
                        cos[k].append(g[x:y].reshape(y - x, -1) @ means[s][k].reshape(-1).to(g))
        return {
            k: Pass2(
                clipped=tuple(clipped[k]) if clipped is not None else None,
                cos=cat(cos[k]) if means is not None else None,
            )
            for k in self.names
        }


class Summed(Materialised):
    """A parameter read by several uses of different kinds (tied weights): the per-sample
    gradient is the sum of the parts, so norms need it materialised."""

    method = "tied"

    def __init__(
        self, name: str, parts: Sequence[Source], shape: torch.Size, batch: int, budget: Budget
    ) -> None:
        super().__init__([name], {name: shape}, batch, budget)
        self.parts = tuple(parts)

    def grads(self, lo: int, hi: int) -> Tensors:
        name = self.names[0]
        total: torch.Tensor | None = None
        for source in self.parts:
            g = source.grads(lo, hi)[name]
            total = g if total is None else total + g
        assert total is not None
        return {name: total}

    def project(self, projection: Projection, out: torch.Tensor) -> None:
        """A sketch is linear: the sum of the parts' sketches, each in its own structured form
        (GPT-2's tied ``wte`` from its token rows and its output layer's inputs and output
        gradients), never the ``[B, vocab, d]`` gradients the sum would need."""
        for source in self.parts:
            source.project(projection, out)
