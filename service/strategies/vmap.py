"""The ``vmap`` strategy: the per-sample function over the batch, reduced to the records.

The batch runs in chunks sized from a memory budget; per-sample gradients are kept only when the
need asks for them (``grads``), so a large batch of summary outputs never holds B copies of the
gradient. Statistics are per segment (one per job), never over the merged batch: means and
squared deviations merge chunk by chunk (Chan's parallel update), clipped sums use each chunk's
own norms (a chunk holds every selected parameter of its samples), and the cosine with the
segment mean takes a second pass unless the gradients are at hand.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from service.registry import LoadedModel
from service.strategies.base import (
    Call,
    ParamStats,
    Result,
    Tensors,
    clip_factors,
    dots_with,
    keep_rows,
    squared_norms,
    total,
)
from service.strategies.per_sample import per_sample_fn

Chunk = tuple[int, int, Tensors, torch.Tensor, torch.Tensor]  # start, stop, grads, losses, aux


def chunk_size(model: LoadedModel, selected: Sequence[str], batch: int, budget_bytes: int,
               *, keep: bool = False) -> int:
    """Samples per vmap call so that the transient memory stays inside ``budget_bytes``.

    A chunk holds its per-sample gradients plus about one working copy, and its activations.
    With ``keep`` (``grads``/``updates`` asked for) the gradients are the answer itself, already
    bounded by the result-size limit, so only the working copy counts: splitting such a batch
    would add a copy of the whole answer and its page faults (3x slower for mlp at B=256).
    """
    itemsize = torch.finfo(model.dtype).bits // 8
    n_selected = sum(model.params[k].numel() for k in selected)
    copies = 1 if keep else 2
    per_sample = itemsize * (copies * n_selected + 4 * model.activation_numel) or 1
    return max(1, min(batch, budget_bytes // per_sample))


class Vmap:
    """Every model, every need: the strategy of last resort (it never declines)."""

    name = "vmap"

    def run(self, call: Call) -> Result:
        model, opts = call.model, call.opts
        selected = {k: call.params[k] for k in call.selected}
        others = {k: v for k, v in call.params.items() if k not in selected}
        fn = per_sample_fn(model, opts.loss, opts.gamma)
        if call.compiled is not None:
            fn = call.compiled.wrap(fn, model, opts.loss, opts.gamma)
        step = chunk_size(model, call.selected, call.size, call.budget_bytes,
                          keep=call.need.grads)

        def chunks() -> Iterator[Chunk]:
            for start in range(0, call.size, step):
                stop = min(call.size, start + step)
                with opts.precision(model.device):
                    grads, (losses, aux) = fn(selected, others, model.buffers,
                                              {k: v[start:stop] for k, v in call.samples.items()})
                yield start, stop, grads, losses, aux

        acc = _Accumulator(call)
        last = None
        for last in chunks():
            acc.add(*last)
        if call.need.cos:
            if step >= call.size and last is not None:
                acc.cosine(0, last[2])
            elif call.need.grads:  # every per-sample gradient is at hand: no second pass
                acc.cosine(0, acc.kept)
            else:
                for start, _, grads, _, _ in chunks():
                    acc.cosine(start, grads)
        meta = {"route": model.route, "chunk_size": step,
                "method": {k: model.route for k in call.selected}}
        return acc.result(meta)


def _rows(g: torch.Tensor) -> torch.Tensor:
    """One row per sample (``flatten(1)`` fails on the [B] gradients of a scalar parameter)."""
    return g.reshape(g.shape[0], -1)


class _Accumulator:
    """Collects per-sample values and per-segment statistics chunk by chunk."""

    def __init__(self, call: Call) -> None:
        self.call = call
        self.need = call.need
        self.names = call.selected
        segments = range(len(call.bounds))
        self.losses: list[torch.Tensor] = []
        self.aux: list[torch.Tensor] = []
        self.sq: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        self.dot: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        self.cos: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        self.sketch: list[torch.Tensor] = []  # [n, k] per chunk, over every parameter
        self.dots: dict[str, list[torch.Tensor]] = {k: [] for k in self.names}
        self.kept: Tensors = {}  # {param: [B, *shape]}: the single chunk's own, or one buffer
        self.count = [0 for _ in segments]  # per segment: count, mean, M2, clipped sums
        self.mean: list[Tensors] = [{} for _ in segments]
        self.m2: list[Tensors] = [{} for _ in segments]
        self.clipped: list[Tensors] = [{} for _ in segments]

    def overlaps(self, start: int, stop: int) -> Iterator[tuple[int, int, int]]:
        """(segment, from, to) of each segment's rows within [start, stop), relative to start."""
        for s, (a, b) in enumerate(self.call.bounds):
            lo, hi = max(a, start), min(b, stop)
            if lo < hi:
                yield s, lo - start, hi - start

    def add(self, start: int, stop: int, grads: Tensors, losses: torch.Tensor,
            aux: torch.Tensor) -> None:
        need = self.need
        self.losses.append(losses)
        self.aux.append(aux)
        factors = None
        if need.sq:
            sq = {k: squared_norms(g) for k, g in grads.items()}
            for k, v in sq.items():
                self.sq[k].append(v)
            if need.clipped:
                opts = self.call.opts
                factors = clip_factors(opts.clip_norm, total(list(sq.values())).sqrt(),
                                       opts.norm_offset)
        if need.dot:
            for k, g in grads.items():
                self.dot[k].append(_rows(g) @ self.call.reference[k].flatten().to(g))
        if need.proj:
            projection = self.call.opts.projection
            assert projection is not None, "validation asks for a projection with 'proj'"
            sketch = losses.new_zeros((stop - start, projection.k), dtype=self.call.model.dtype)
            projection.project_many(grads, sketch)
            self.sketch.append(sketch)
        if need.dots:
            for k, g in grads.items():
                refs = self.call.references[k]
                self.dots[k].append(dots_with(g, refs))
        if need.grads:
            keep_rows(self.kept, self.call.size, start, stop, grads)
        for s, lo, hi in self.overlaps(start, stop):
            part = {k: g[lo:hi] for k, g in grads.items()}
            if need.mean or need.m2:
                self._merge_stats(s, part)
            if factors is not None:
                for k, g in part.items():
                    term = torch.tensordot(factors[lo:hi].to(g.dtype), g, dims=1)
                    self.clipped[s][k] = self.clipped[s][k] + term if k in self.clipped[s] else term

    def _merge_stats(self, s: int, part: Tensors) -> None:
        n_b = next(iter(part.values())).shape[0]
        n_a = self.count[s]
        for k, g in part.items():
            mean_b = g.mean(0)
            m2_b = (g - mean_b).pow(2).sum(0)
            if n_a == 0:
                self.mean[s][k], self.m2[s][k] = mean_b, m2_b
            else:
                delta = mean_b - self.mean[s][k]
                n = n_a + n_b
                self.mean[s][k] = self.mean[s][k] + delta * (n_b / n)
                self.m2[s][k] = self.m2[s][k] + m2_b + delta.pow(2) * (n_a * n_b / n)
        self.count[s] = n_a + n_b

    def cosine(self, start: int, grads: Tensors) -> None:
        stop = start + next(iter(grads.values())).shape[0]
        for s, lo, hi in self.overlaps(start, stop):
            for k, g in grads.items():
                self.cos[k].append(_rows(g[lo:hi]) @ self.mean[s][k].flatten())

    def result(self, meta: dict[str, object]) -> Result:
        need = self.need

        def per_segment(values: list[Tensors], k: str) -> tuple[torch.Tensor, ...]:
            return tuple(v[k] for v in values)

        params = {
            k: ParamStats(
                grads=self.kept[k] if need.grads else None,
                sq=torch.cat(self.sq[k]) if need.sq else None,
                dot=torch.cat(self.dot[k]) if need.dot else None,
                mean=per_segment(self.mean, k) if need.mean else None,
                m2=per_segment(self.m2, k) if need.m2 else None,
                clipped=per_segment(self.clipped, k) if need.clipped else None,
                cos=torch.cat(self.cos[k]) if need.cos else None,
                dots=torch.cat(self.dots[k]) if need.dots else None,
            )
            for k in self.names
        }
        return Result(torch.cat(self.losses), torch.cat(self.aux), params, dict(meta),
                      torch.cat(self.sketch) if need.proj else None)
