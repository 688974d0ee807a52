"""Sources formed, and their statistics taken, as the backward pass reaches their layer.

A call whose statistics take one pass over each source (no clipped mean, no per-sample
gradients, no sketches) need not hold a layer's input and output gradient past the point where
the backward pass has made that gradient: as the pass is about to run the node that reads it,
:class:`Stream` forms the sources of each use whose parameters no other use reads, and a source
that is not small takes its passes there (:func:`settle`): what is left of it is its answers,
and the layer's input and output gradient go as a training step's do. A small per-sample
gradient (a bias's, a norm's affine parameters') is kept for :func:`~._dense.grouped`, so that
each statistic of those is still one operation per size. Without this, ResNet-18 held every
convolution's output gradient and input to the end of the pass (its peak 1.3-1.4x a training
step's).

A clipped mean needs every norm before its second pass, so its sources are read after the
backward pass; but a layer whose per-sample gradients are smaller than its input and output
gradient (many positions, few weights: ResNet-18's first layers, 5-100x) holds those instead
(:func:`held`), built once for both passes. The cosines take a second pass over a layer too
(each sample's dot with the mean), and such a layer's are read off its held gradients
(ResNet-18 at B=32: its cosines' statistics took 6.0 s of CPU time in a 11.5 s call against
2.5 s after, with the plain step at 8.2 s).
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from functools import partial

import torch

from service.fast_stats._build import source_for
from service.fast_stats._dense import Dense, groupable
from service.fast_stats._records import Pass1, Pass1Need, Use
from service.fast_stats._run import Plan, Reduce, widened_use
from service.fast_stats._source import Source, SourceContext, present
from service.strategies.base import Bounds, Tensors, divide_

ASKED = "the first pass fills what its need asks for"


def segment_means(done: dict[str, Pass1], names: Sequence[str], bounds: Bounds,
                  dtype: torch.dtype) -> list[Tensors]:
    """Each segment's mean of ``names``' per-sample gradients, from their first pass's sums,
    divided in place once (each segment's sums are fresh and read for the mean alone; those
    already ``averaged`` are the means)."""
    out = []
    for s, (a, b) in enumerate(bounds):
        divide_({k: present(done[k].sums, ASKED)[s] for k in names if not done[k].averaged},
                b - a)
        out.append({k: present(done[k].sums, ASKED)[s].to(dtype) for k in names})
    return out


class Settled(Source):
    """A source whose passes are done: their answers (the cosines among the first pass's), and
    nothing of the forward or backward pass."""

    def __init__(self, source: Source, first: dict[str, Pass1]) -> None:
        super().__init__(source.names, source.shapes, source.batch, source.budget)
        self.how = source.described()
        self.first = first

    def method_of(self, name: str) -> str:
        return self.how[name][0]

    def form(self, name: str) -> str:
        return self.how[name][1]

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        return self.first


def held(source: Source, numel: int) -> Source:
    """What of ``source`` is kept for passes after the backward: where its norms materialise its
    per-sample gradients anyway (:func:`~._outer.form_for`), those gradients, built once for
    both passes, if they are fewer numbers than the ``numel`` its use holds; else the source."""
    name = source.names[0]
    if (len(source.names) > 1 or source.form(name) != "materialise"
            or source.batch * math.prod(source.shapes[name]) > numel):
        return source
    return Dense(name, source.answer()[name], source.budget, source.method_of(name),
                 "materialise")


def settle(source: Source, need: Pass1Need) -> Settled:
    """``source``'s first pass and, for the cosines where the first pass leaves them, its
    second (it needs the source's own means alone), whose cosines join the first's."""
    first = source.pass1(need, need.cos)
    if need.cos and any(first[k].cos is None for k in source.names):
        means = segment_means(first, source.names, need.bounds, need.sums_dtype)
        second = source.pass2(None, means, need.bounds)
        first = {k: replace(v, averaged=True,  # its sums: the call's means
                            cos=second[k].cos if v.cos is None else v.cos)
                 for k, v in first.items()}
    return Settled(source, first)


class Stream:
    """The ``early`` of :func:`~._run.forward_backward` for a call that reads each source after
    the backward pass no more than its statistics do (no per-sample gradients, no sketches).

    ``formed`` lists the parameters whose sources it made, ``sources`` those sources (settled
    where the call takes ``one_pass``, else :func:`held`; small ones whole); ``widen`` is the
    model's dtype under autocast (the statistics are formed in it, :func:`~._run.widened`).
    """

    def __init__(self, ctx: SourceContext, plan: Plan, need: Pass1Need,
                 widen: torch.dtype | None, *, one_pass: bool) -> None:
        readers = Counter(name for use in plan.signature for name, _ in use.roles)
        self.alone = {k for k, n in readers.items() if n == 1}
        self.ctx, self.need, self.widen, self.one_pass = ctx, need, widen, one_pass
        self.formed: set[str] = set()
        self.sources: list[Source] = []

    def __call__(self, use: Use) -> Reduce | None:
        if use.family is None or not use.roles.keys() <= self.alone:
            return None
        self.formed |= use.roles.keys()
        return partial(self._form, use)

    def _form(self, use: Use, g: torch.Tensor) -> torch.Tensor:
        family = use.family
        assert family is not None
        if family.reduces:
            g = family.reduce(use, g)
        use = replace(use, g=g)
        if self.widen is not None:
            use = widened_use(use, self.widen)
        # the backward pass may run under autocast, and the captured input is in its graph
        numel = g.numel() + sum(t.numel() for t in _tensors(use.payload))
        with torch.autocast(self.ctx.device.type, enabled=False), torch.no_grad():
            for name, role in use.roles.items():
                source = source_for(name, [(use, role)], self.ctx)
                if not groupable(source) and (self.need.cos or not self.one_pass):
                    source = held(source, numel)  # a second pass over it follows
                if not groupable(source) and self.one_pass:
                    source = settle(source, self.need)
                self.sources.append(source)
        return g.new_empty(0)  # nothing is left to read


def _tensors(payload: object) -> list[torch.Tensor]:
    """The tensors a family's payload holds (its fields)."""
    return [v for f in dataclasses.fields(payload)  # type: ignore[arg-type]
            if isinstance(v := getattr(payload, f.name), torch.Tensor)]
