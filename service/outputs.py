"""The outputs a request can ask for: one table, each output defined once.

Each output says which primitives it needs of every selected parameter (a
:class:`~service.strategies.base.Need`) and how one job's value is assembled from the records a
strategy filled (:class:`Segment`). Whichever strategy ran (``vmap`` or fast statistics), the
answer is built here and only here: the engine asks :func:`need_of` what to compute and
:func:`assemble` for the answer.

Adding an output: declare it in the request contract (:data:`psgrad._contract.OUTPUTS`: its
shape and how a split batch combines it), then register a function with :func:`output`, naming
its need.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, reduce
from typing import Any

import torch

from psgrad._contract import output as contract_output
from psgrad._errors import UnknownOutput
from service import curvature
from service.dp.noise import secure_normal
from service.losses import LOSSES, Loss
from service.plugins import Registry
from service.strategies.base import (
    Call,
    Need,
    Options,
    ParamStats,
    Result,
    Tensors,
    divide_,
    squared_norm_each,
    squared_norm_sum,
    total,
)
from service.strategies.projection import VERSIONS, kinds

Assemble = Callable[["Segment"], Any]


NeedOf = Need | Callable[[Options], Need]  # an output's need, or how the options decide it


@dataclass(frozen=True)
class Output:
    name: str
    description: str
    need: NeedOf
    assemble: Assemble
    per_sample: bool  # one value (or tensor) per sample, split back per job
    per_param: bool = False  # a dict keyed by parameter name
    per_param_tensor: bool = False  # ... whose values have the parameter's shape
    td0_only: bool = False
    width: Callable[[Options], int] | None = None  # values per sample, when more than one
    also: tuple[str, ...] = ()  # fields it answers beside its own: it assembles them all

    def need_for(self, opts: Options | None) -> Need:
        if isinstance(self.need, Need):
            return self.need
        assert opts is not None, f"the need of {self.name!r} depends on the options"
        return self.need(opts)


OUTPUTS: Registry[str, Output] = Registry("output", UnknownOutput, sort=False)


def output(name: str, need: NeedOf, *,
           width: Callable[[Options], int] | None = None) -> Callable[[Assemble], Assemble]:
    """Decorator: register ``fn(segment) -> value`` as the output ``name``, which the request
    contract (:data:`psgrad._contract.OUTPUTS`) declares: its meaning, shape flags and how a
    split batch combines it are read from there (an output it does not declare is a KeyError)."""
    spec = contract_output(name)

    def decorate(fn: Assemble) -> Assemble:
        OUTPUTS.add(name, Output(name, spec.doc, need, fn, spec.per_sample, spec.per_param,
                                 spec.per_param_tensor, spec.td0_only, width, spec.also))
        return fn

    return decorate


def need_of(outputs: Sequence[str], opts: Options | None = None) -> Need:
    """What every selected parameter's record must hold for these outputs (some outputs'
    needs depend on the options: ``self_influence`` projected or not)."""
    return reduce(Need.__or__, (OUTPUTS[name].need_for(opts) for name in outputs), Need())


class Assembly:
    """The records of one call, and what several outputs derive from them (computed once)."""

    def __init__(self, call: Call, result: Result) -> None:
        self.call = call
        self.result = result
        self.loss: Loss = LOSSES[call.opts.loss]

    @cached_property
    def norms(self) -> torch.Tensor:
        """[B] each sample's whole-gradient norm over the selected parameters."""
        return total([_get(p.sq) for p in self.result.params.values()]).sqrt()

    @cached_property
    def sketches(self) -> torch.Tensor:
        """[B, k] each sample's sketch: the sum of its parameters' parts."""
        return _get(self.result.sketch)

    @cached_property
    def dots(self) -> torch.Tensor:
        """[B, M] each sample's dot products with the references (sketches or gradients)."""
        if self.call.sketches is not None:
            return self.sketches @ self.call.sketches.t().to(self.sketches.dtype)
        return total([_get(p.dots) for p in self.result.params.values()])


@dataclass
class Segment:
    """One job's part of a call: rows ``[start, stop)``, the ``index``-th segment."""

    assembly: Assembly
    index: int
    start: int
    stop: int
    meta: dict[str, Any] = field(default_factory=dict)  # added to the job's meta

    @property
    def n(self) -> int:
        return self.stop - self.start

    @property
    def opts(self) -> Options:
        return self.assembly.call.opts

    @property
    def params(self) -> dict[str, ParamStats]:
        return self.assembly.result.params

    def rows(self, t: torch.Tensor | None) -> torch.Tensor:
        return _get(t)[self.start : self.stop]

    def per_param(self, fn: Callable[[ParamStats], torch.Tensor]) -> Tensors:
        return {k: fn(p) for k, p in self.params.items()}


def assemble(call: Call, result: Result,
             on_norms: Callable[[torch.Tensor], None] | None = None) -> list[dict[str, Any]]:
    """Each job's answer: its requested outputs and ``meta`` (the strategy's, then its own).

    ``on_norms`` gets every sample's whole-gradient norm when the records hold squared norms (a
    sum over the parameters, computed once with the ``norms`` output); else it is not called.
    """
    assembly = Assembly(call, result)
    meta = dict(result.meta)
    if call.need.proj and call.opts.projection is not None:  # which matrix each parameter got
        kind = call.opts.projection.kind
        meta["projection"] = kinds({k: call.params[k].shape for k in call.selected}, kind)
        meta["projection_kind"] = kind
        meta["projection_version"] = VERSIONS[kind]
    answers = []
    for s, (a, b) in enumerate(call.bounds):
        seg = Segment(assembly, s, a, b)
        out: dict[str, Any] = {}
        for name in call.opts.outputs:
            info = OUTPUTS[name]
            value = info.assemble(seg)
            out.update(value if info.also else {name: value})
        answers.append({**out, "meta": {**meta, **seg.meta}})
    if on_norms is not None and call.need.sq:
        on_norms(assembly.norms)
    return answers


def noised_mean(sums: Tensors, opts: Options, n: int) -> tuple[Tensors, int | None]:
    """The DP-SGD aggregate from clipped sums: add seeded noise, divide by the sample count.

    A DP run's options divide by its expected batch size instead (``opts.divisor``) and draw the
    noise from the OS CSPRNG (``opts.secure_noise``): no seed exists, None is echoed. The sums
    are the strategy's own buffers, read by this output alone: they are noised and divided in
    place (a fresh copy of BERT-base's 109 M cost a sixth of its training step on the CPU).
    """
    sigma = opts.noise_multiplier * (opts.clip_norm or 0.0)
    divisor = opts.divisor or n
    if sigma == 0:
        return divide_(dict(sums), divisor), opts.seed
    if opts.secure_noise:
        return {k: v.add_(secure_normal(tuple(v.shape), sigma).to(v.device, v.dtype))
                .div_(divisor) for k, v in sums.items()}, None
    seed = opts.seed if opts.seed is not None else secrets.randbits(63)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in sums.items():  # noise drawn on the CPU so every device gives the same
        noise = torch.normal(0.0, sigma, size=tuple(v.shape), generator=gen)
        out[k] = v.add_(noise.to(v.device, v.dtype)).div_(divisor)
    return out, seed


def output_bytes(outputs: Sequence[str], n_params: int, n_selected: int, batch_size: int,
                 itemsize: int, opts: Options | None = None) -> int:
    """Bytes of an answer, to refuse an oversized result before computing it."""
    count = 0
    for name in outputs:
        info = OUTPUTS[name]
        per = n_selected if info.per_param_tensor else (n_params if info.per_param else 1)
        if info.width is not None and opts is not None:
            per *= info.width(opts)  # [B, k] sketches, [B, M] dot products
        count += per * (batch_size if info.per_sample else 1)
    return count * itemsize


def _get(t: Any) -> Any:
    assert t is not None, "the strategy did not fill a primitive its need asked for"
    return t


# --- the table ---

_GRADS = Need(grads=True)
_SQ = Need(sq=True)


@output("grads", _GRADS)
def _grads(seg: Segment) -> Tensors:
    return seg.per_param(lambda p: seg.rows(p.grads))


@output("losses", Need())
def _losses(seg: Segment) -> torch.Tensor:
    return seg.rows(seg.assembly.result.losses)


@output("norms", _SQ)
def _norms(seg: Segment) -> torch.Tensor:
    return seg.rows(seg.assembly.norms)


@output("layer_norms", _SQ)
def _layer_norms(seg: Segment) -> Tensors:
    return seg.per_param(lambda p: seg.rows(p.sq).sqrt())


@output("mean", Need(mean=True))
def _mean(seg: Segment) -> Tensors:
    return seg.per_param(lambda p: _get(p.mean)[seg.index])


@output("variance", Need(m2=True))
def _variance(seg: Segment) -> Tensors:
    dtype = seg.assembly.call.model.dtype  # m2 of exact closed forms is float64
    # in place: the strategy's own buffers, read by this output alone
    m2 = divide_(seg.per_param(lambda p: _get(p.m2)[seg.index]), seg.n)
    return {k: v.to(dtype) for k, v in m2.items()}


@output("clipped_mean", Need(sq=True, clipped=True))
def _clipped_mean(seg: Segment) -> Tensors:
    sums = seg.per_param(lambda p: _get(p.clipped)[seg.index])
    value, seg.meta["seed"] = noised_mean(sums, seg.opts, seg.n)
    return value


@output("dot", Need(dot=True))
def _dot(seg: Segment) -> torch.Tensor:
    return total([seg.rows(p.dot) for p in seg.params.values()])


@output("cosine_mean", Need(sq=True, mean=True, cos=True))
def _cosine_mean(seg: Segment) -> torch.Tensor:
    means = [_get(p.mean)[seg.index] for p in seg.params.values()]
    mean_norm = squared_norm_sum(means).sqrt()
    dots = total([seg.rows(p.cos) for p in seg.params.values()])
    cos = dots / (seg.rows(seg.assembly.norms) * mean_norm)
    return cos.nan_to_num(0.0, posinf=0.0, neginf=0.0)


@output("td_errors", Need())
def _td_errors(seg: Segment) -> torch.Tensor:
    return seg.rows(seg.assembly.result.aux)


@output("updates", _GRADS)
def _updates(seg: Segment) -> Tensors:
    updates = seg.assembly.loss.updates
    assert updates is not None, "validation lets 'updates' through only for losses that have it"
    return seg.per_param(lambda p: updates(seg.rows(p.grads)))


# --- data attribution: sketches and their dot products ---


def _sketch_width(opts: Options) -> int:
    return opts.projection.k if opts.projection is not None else 1


def _dots_need(opts: Options) -> Need:
    return Need(proj=True) if opts.reference_sketches else Need(dots=True)


@output("projection", Need(proj=True), width=_sketch_width)
def _projection(seg: Segment) -> torch.Tensor:
    return seg.rows(seg.assembly.sketches)


@output("dots", _dots_need, width=lambda opts: opts.reference_count)
def _dots(seg: Segment) -> torch.Tensor:
    return seg.rows(seg.assembly.dots)


@output("influence", _dots_need, width=lambda opts: opts.reference_count)
def _influence(seg: Segment) -> torch.Tensor:
    return seg.rows(seg.assembly.dots)


@output("self_influence", lambda o: Need(proj=o.projection is not None,
                                         sq=o.projection is None))
def _self_influence(seg: Segment) -> torch.Tensor:
    if seg.opts.projection is not None:
        return seg.rows(seg.assembly.sketches).pow(2).sum(1)
    return seg.rows(seg.assembly.norms).pow(2)


# --- the gradient noise scale ---


def noise_scale(sq_sum: torch.Tensor, mean_sq: torch.Tensor, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """McCandlish et al.'s simple noise scale ``tr(Sigma) / |G|^2`` and its two unbiased
    estimates from ``n >= 2`` samples, given ``sum_i |g_i|^2`` and ``|mean|^2``:
    ``tr(Sigma) = sum_i |g_i - mean|^2 / (n - 1) = (sum_i |g_i|^2 - n |mean|^2) / (n - 1)`` and
    ``|G|^2 = |mean|^2 - tr(Sigma) / n``; the ratio is 0 where the second is 0. Elementwise, in
    float64, where the difference cancels."""
    sq_sum, mean_sq = sq_sum.double(), mean_sq.double()
    trace = (sq_sum - mean_sq * n) / (n - 1)
    grad_sq = mean_sq - trace / n
    return (trace / grad_sq).nan_to_num(0.0, posinf=0.0, neginf=0.0), trace, grad_sq


def _gns_sums(seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
    """``[P]`` each selected parameter's ``sum_i |g_i|^2`` over the segment and ``|mean|^2``:
    the norms' and the mean's records, no per-sample gradient."""
    params = seg.params.values()
    sq = torch.stack([seg.rows(p.sq) for p in params]).double().sum(1)
    return sq, squared_norm_each([_get(p.mean)[seg.index] for p in params])


def _named(seg: Segment, name: str, values: Sequence[Any]) -> dict[str, Any]:
    """An output's value and its ``also`` fields, by their names in the answer, in the model's
    dtype (as ``variance``)."""
    dtype = seg.assembly.call.model.dtype
    cast = [{k: v.to(dtype) for k, v in x.items()} if isinstance(x, dict) else x.to(dtype)
            for x in values]
    return dict(zip((name, *contract_output(name).also), cast, strict=True))


_GNS = Need(sq=True, mean=True)


@output("gns", _GNS)
def _gns(seg: Segment) -> dict[str, torch.Tensor]:
    sq, mean_sq = _gns_sums(seg)
    return _named(seg, "gns", noise_scale(sq.sum(), mean_sq.sum(), seg.n))


@output("layer_gns", _GNS)
def _layer_gns(seg: Segment) -> dict[str, Tensors]:
    sq, mean_sq = _gns_sums(seg)
    return _named(seg, "layer_gns", [dict(zip(seg.params, v.unbind(), strict=True))
                                     for v in noise_scale(sq, mean_sq, seg.n)])


@output("kfac_inputs", Need())
def _kfac(seg: Segment) -> dict[str, Tensors]:
    call = seg.assembly.call
    rows = {k: v[seg.start : seg.stop] for k, v in call.samples.items()}
    return _named(seg, "kfac_inputs", curvature.factor_means(
        call.model, call.opts.loss, call.opts.gamma, call.selected, rows, call.params))
