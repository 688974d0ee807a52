"""The fast-statistics strategy: the records of a call from one batched forward and backward.

Per-sample gradients themselves (``grads``, ``updates``) are each source's answer, written
once into one buffer per parameter: a linear or convolution weight by one batched matmul of its
output gradients and (unfolded) inputs, an embedding by one ``index_add``, biases and norms'
parameters as the family builds them, and parameters on the op or module replay a chunk at a
time into the same buffer. Statistics asked for besides are then read off those buffers.
Statistics that take one pass over each layer (all but the clipped mean) are taken as the
backward pass reaches the layer (:mod:`._stream`); the clipped mean after it, from what it
left.

It declines (the engine then runs ``vmap``) when the model takes the per-sample loop or runs one
sample at a time only (an exported graph whose traced batch of one could not be made generic,
:mod:`service.export.batch`), when the probe found no plan, and when the call reads its
parameters unlike the probe did.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import torch

from service.fast_stats._budget import Budget
from service.fast_stats._build import build_sources, context
from service.fast_stats._dense import Dense, grouped
from service.fast_stats._plan import plan_for
from service.fast_stats._records import Pass1, Pass1Need, Pass2, Unsupported
from service.fast_stats._run import Setup, forward_backward, widened
from service.fast_stats._sketch import sketch
from service.fast_stats._source import Source, answers, present
from service.fast_stats._stream import ASKED, Stream, segment_means
from service.strategies.base import (
    Call,
    ParamStats,
    Result,
    Tensors,
    clip_factors,
    total,
)

T = TypeVar("T")


class FastStats:
    """Summary statistics without materialising every per-sample gradient."""

    name = "fast_stats"

    def run(self, call: Call) -> Result | None:
        model = call.model
        if model.route != "vmap" or not model.batched:
            return None
        setup = Setup(model, call.params, call.samples, call.opts.loss, call.opts.gamma,
                      call.selected)
        plan = plan_for(setup, call.plans, call.planning)
        if plan is None:
            return None
        budget = Budget(call.budget_bytes, model.device)
        widen = model.dtype if call.opts.autocast != "off" else None
        need, ask = call.need, _ask(call)
        # statistics that take one pass over each layer are taken in the backward pass, and a
        # clipped mean's sources formed there (sketches and gradients read every source after)
        stream = None
        if ask.any and not (need.grads or need.proj):
            stream = Stream(context(setup, budget), plan, ask, widen, one_pass=not need.clipped)
        try:
            with call.opts.precision(model.device):
                # check: a model that reads its parameters differently from the probe plays
                # safe (vmap)
                run = forward_backward(setup, plan, check=True, early=stream)
        except Unsupported:
            return None
        if widen is not None:
            run = widened(run, widen)
        losses, aux = run.losses, run.aux
        formed = stream.sources if stream is not None else []
        # the captured inputs are activations of the forward graph: nothing computed from them
        # may join it (an answer that requires grad cannot be read as an array, and holds the
        # graph)
        with torch.no_grad():
            found = grouped([*formed, *build_sources(
                setup, run, plan, budget, stream.formed if stream is not None else ())])
            del formed, stream
            del run  # each source holds what it still needs; the rest (LayerNorm inputs,
            # gradients already reduced to per-sample values) can go now, and each source's
            # part as its statistics are done (:func:`_stats`): no frame may keep the run
            return self._answer(call, found, budget, losses, aux)

    def _answer(self, call: Call, found: list[Source], budget: Budget, losses: torch.Tensor,
                aux: torch.Tensor) -> Result:
        need = call.need
        sources = {k: s for s in found for k in s.names}
        meta = {
            "route": self.name,  # one name for how it was computed: fast_stats runs on vmap's
            "chunk_size": call.size,
            "method": {k: sources[k].method_of(k) for k in call.selected},
            "form": {k: sources[k].form(k) for k in call.selected},
        }
        del sources
        grads: Tensors = {}
        if need.grads:
            grads = answers(found)
            # what the sources held can go: any statistic is read off the answer now
            found[:] = grouped([Dense(k, grads[k], budget, "answer") for k in call.selected])
        params = _stats(call, found, grads, keep=need.proj)
        return Result(losses=losses, aux=aux, params=params, meta=meta,
                      sketch=sketch(call, found))


def _stats(call: Call, found: list[Source], grads: Tensors, *, keep: bool
           ) -> dict[str, ParamStats]:
    """The two passes over the sources, and each selected parameter's record.

    ``clipped`` needs every sample's whole norm first, so it takes a second pass over what the
    sources hold, never a second backward; ``cos`` needs a parameter's own mean only, so each
    source's second pass follows its first. Unless ``keep`` (the sketch reads the sources
    after), each source leaves ``found`` after its last pass, and what it holds of the forward
    and backward passes goes with it: the memory held falls as the answer grows (BERT-base's
    clipped mean and variance held every layer's inputs and output gradients to the end).
    """
    need, bounds, dtype = call.need, call.bounds, call.model.dtype
    ask = _ask(call)
    first: dict[str, Pass1] = {}
    second: dict[str, Pass2] = {}
    means: list[Tensors] | None = [{} for _ in bounds] if ask.sums else None
    summed: list[str] = []  # parameters whose sums are not yet divided into their means

    def average() -> None:  # the summed parameters' means, one division per segment
        for s, mean in enumerate(segment_means(first, summed, bounds, dtype)):
            present(means, "asked for sums")[s].update(mean)
        summed.clear()

    later: list[tuple[Source, bool]] = []  # and whether its dots with the mean are to do
    for source in _drain(found, keep):
        done = (source.pass1(ask, need.clipped or need.cos) if ask.any  # keep: a second pass
                else {k: Pass1() for k in source.names})
        first.update(done)
        summed.extend(source.names if means is not None else ())
        cos = need.cos and any(done[k].cos is None for k in source.names)  # still to do
        if need.clipped:
            later.append((source, cos))
        elif cos:
            average()
            second.update(source.pass2(None, means, bounds))
    if summed:
        average()
    clip = None
    if need.clipped:
        norms = total([present(first[k].sq, ASKED) for k in call.selected]).sqrt()
        clip = clip_factors(call.opts.clip_norm, norms, call.opts.norm_offset)
        for source, cos in _drain(later, keep):
            second.update(source.pass2(clip, means if cos else None, bounds))
    return {
        k: ParamStats(
            grads=grads.get(k),
            sq=first[k].sq if ask.sq else None,
            dot=first[k].dot,
            dots=first[k].dots,
            mean=tuple(m[k] for m in means) if means is not None else None,
            m2=first[k].m2 if need.m2 else None,
            clipped=second[k].clipped if clip is not None else None,
            cos=(first[k].cos if first[k].cos is not None else second[k].cos)
            if need.cos else None,
        )
        for k in call.selected
    }


def _ask(call: Call) -> Pass1Need:
    """What the first pass over every source computes for ``call``."""
    need = call.need
    return Pass1Need(
        sq=need.sq or need.clipped or need.cos,
        reference=call.reference if need.dot else None,
        references=call.references if need.dots else None,
        sums=need.mean or need.cos,  # variance's m2 comes with its own mean where it needs one
        m2=need.m2,
        cos=need.cos,
        bounds=call.bounds,
        sums_dtype=call.model.dtype,
    )


def _drain(items: list[T], keep: bool) -> Iterator[T]:
    """``items`` in order; unless ``keep``, each leaves the list as it is handed out (the
    loop's variable is then its last reference, dropped at the next item)."""
    if keep:
        yield from items
        return
    items.reverse()
    while items:
        yield items.pop()


