"""What each output should be on the verified samples, from the loop, in float64.

Written from the loop's gradients alone, apart from :mod:`service.outputs` (which assembles the
engine's answer from a strategy's records): the two only agree when the answer is right.

- :data:`PER_SAMPLE`: one value per sample; compared with the answer's own rows of the verified
  samples.
- :data:`AGGREGATE`: a value of the whole batch (``mean``, ``variance``, ``clipped_mean``) or one
  that depends on it (``cosine_mean``, against the batch mean). No sample's part of it can be
  read off the answer, so the engine computes it again with the verified samples as a segment
  of their own (the others a second one, the noise off): the first segment is compared with
  the loop's statistic of those samples, and the answer with :class:`Whole`, the loop's
  samples combined with the engine's statistic of the others.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import cached_property
from typing import Any

import torch

from psgrad._contract import answer_fields, output
from service.curvature import factor_means
from service.engine import Batch, Options, lock_for, prepare
from service.losses import LOSSES
from service.outputs import noised_mean
from service.registry import LoadedModel
from service.strategies.base import Tensors, clip_factors, total
from service.verify.reference import Loop

__all__ = ["AGGREGATE", "PER_SAMPLE", "Expected", "Whole"]


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[k, *shape] as [k, numel] (a 0-d parameter gives [k, 1])."""
    return t.reshape(t.shape[0], -1)


class Expected:
    """The loop's results on the verified samples and what the outputs derive from them."""

    def __init__(self, loop: Loop, batch: Batch, opts: Options,
                 model: LoadedModel | None = None) -> None:
        self.grads: Tensors = {k: v.detach().cpu().double() for k, v in loop.grads.items()}
        self.losses = loop.losses.detach().cpu().double()
        self.aux = loop.aux.detach().cpu().double()
        self.batch = batch
        self.opts = opts
        self.model = model  # for what the gradients do not hold (the K-FAC factors)

    @cached_property
    def factors(self) -> dict[str, Tensors]:
        """``kfac_inputs`` and its fields, one sample at a time with plain autograd (where
        the engine takes the batch at once)."""
        assert self.model is not None, "verify passes the model for kfac_inputs"
        call = prepare(self.model, self.batch, self.opts, [self.batch.size])
        with lock_for(self.model), torch.enable_grad():
            found = factor_means(self.model, self.opts.loss, self.opts.gamma, self.opts.params,
                                 call.samples, call.params, at_once=False)
        return dict(zip(answer_fields(["kfac_inputs"]),
                        ({k: v.detach().cpu().double() for k, v in part.items()}
                         for part in found), strict=True))

    @cached_property
    def sq(self) -> Tensors:
        return {k: _rows(g).pow(2).sum(1) for k, g in self.grads.items()}

    @cached_property
    def norms(self) -> torch.Tensor:
        return total(list(self.sq.values())).sqrt()

    @cached_property
    def sketches(self) -> torch.Tensor:
        projection = self.opts.projection
        assert projection is not None, "validation asks for projection_dim with these outputs"
        return total([projection.project(k, g) for k, g in self.grads.items()])

    @cached_property
    def dots(self) -> torch.Tensor:
        """[k, M] against the references: sketches when they were sent so, else gradients."""
        if self.batch.sketches is not None:
            return self.sketches @ self.batch.sketches.detach().cpu().double().t()
        refs = self.batch.references
        return total([_rows(g) @ _rows(refs[k].detach().cpu().double()).t()
                      for k, g in self.grads.items()])

    @cached_property
    def mean(self) -> Tensors:
        return {k: g.mean(0) for k, g in self.grads.items()}


class Whole:
    """The job's statistics over all its samples: the loop's for the verified ones, combined
    exactly (in float64) with the engine's statistics of the others (``rest``: that segment's
    noiseless outputs, None when every sample was verified)."""

    def __init__(self, e: Expected, rest: dict[str, Any] | None, n_rest: int,
                 seed: int | None) -> None:
        self.e, self.k, self.n_rest = e, len(e.losses), n_rest
        self.rest = {name: _float64(v) for name, v in (rest or {}).items() if name != "meta"}
        self.seed = seed  # the answer's noise seed (meta.seed)

    @cached_property
    def mean(self) -> Tensors:
        if not self.rest:
            return self.e.mean
        n = self.k + self.n_rest
        return {p: (self.k * m + self.n_rest * self.rest["mean"][p]) / n
                for p, m in self.e.mean.items()}

    @cached_property
    def variance(self) -> Tensors:
        """Chan's parallel formula: M2 = M2_a + M2_b + delta^2 n_a n_b / n."""
        own = AGGREGATE["variance"](self.e)
        if not self.rest:
            return dict(own)
        n = self.k + self.n_rest
        out = {}
        for p, v in own.items():
            delta = self.rest["mean"][p] - self.e.mean[p]
            m2 = (v * self.k + self.rest["variance"][p] * self.n_rest
                  + delta.pow(2) * (self.k * self.n_rest / n))
            out[p] = m2 / n
        return out

    @cached_property
    def clipped_mean(self) -> Tensors | None:
        """The clipped sums added up, then noised and divided as the answer was (the same seeded
        draw); None for a DP run's noise from the OS CSPRNG, which nothing can draw again."""
        opts = self.e.opts
        if opts.secure_noise and opts.noise_multiplier:
            return None
        sums = _clipped_sums(self.e)
        if self.rest:
            divisor = opts.divisor or self.n_rest
            sums = {p: s + self.rest["clipped_mean"][p] * divisor for p, s in sums.items()}
        value, _ = noised_mean(sums, replace(opts, seed=self.seed), self.k + self.n_rest)
        return value

    @cached_property
    def cosine_mean(self) -> torch.Tensor:
        """The verified samples' cosines with the mean of the whole job."""
        return _cosine(self.e, self.mean)

    @cached_property
    def layer_gns(self) -> dict[str, Tensors]:
        """Each parameter's estimates over the whole job: the loop's squared norms of the
        verified samples added to the engine's of the others (its ``layer_norms``), with the
        combined mean: ``tr(Sigma) = (sum_i |g_i|^2 - n |mean|^2) / (n - 1)``."""
        if not self.rest:
            return AGGREGATE["layer_gns"](self.e)
        n = self.k + self.n_rest
        trace, grad_sq = {}, {}
        for p, sq in self.e.sq.items():
            total_sq = sq.sum() + self.rest["layer_norms"][p].pow(2).sum()
            mean_sq = self.mean[p].pow(2).sum()
            trace[p] = (total_sq - n * mean_sq) / (n - 1)
            grad_sq[p] = mean_sq - trace[p] / n
        return _noise_fields("layer_gns", trace, grad_sq)

    @cached_property
    def gns(self) -> dict[str, Any]:
        return _whole_model(self.layer_gns)

    @cached_property
    def kfac_inputs(self) -> dict[str, Tensors]:
        """Each field's mean over the whole job: the loop's and the others', n-weighted."""
        if not self.rest:
            return self.e.factors
        n = self.k + self.n_rest
        return {field: {w: (self.k * v + self.n_rest * self.rest[field][w]) / n
                        for w, v in own.items()}
                for field, own in self.e.factors.items()}


def _float64(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _float64(v) for k, v in value.items()}
    return value.detach().cpu().double()


def _updates(e: Expected) -> Tensors:
    updates = LOSSES[e.opts.loss].updates
    assert updates is not None, "validation lets 'updates' through only for losses that have it"
    return {k: updates(g) for k, g in e.grads.items()}


def _dot(e: Expected) -> torch.Tensor:
    ref = e.batch.reference
    return total([_rows(g) @ ref[k].detach().cpu().double().flatten()
                  for k, g in e.grads.items()])


def _self_influence(e: Expected) -> torch.Tensor:
    if e.opts.projection is not None:
        return e.sketches.pow(2).sum(1)
    return e.norms.pow(2)


def _clipped_sums(e: Expected) -> Tensors:
    factors = clip_factors(e.opts.clip_norm, e.norms, e.opts.norm_offset)
    return {k: torch.tensordot(factors, g, dims=1) for k, g in e.grads.items()}


def _clipped_mean(e: Expected) -> Tensors:
    """Noiseless: the clipped sum over the samples, divided as the request divides it."""
    divisor = e.opts.divisor or len(e.norms)
    return {k: s / divisor for k, s in _clipped_sums(e).items()}


def _layer_gns(e: Expected) -> dict[str, Any]:
    """By the definitions: ``tr(Sigma)`` the squared deviations from the mean over k - 1,
    ``|G|^2 = |mean|^2 - tr(Sigma) / k``."""
    k = len(e.losses)
    trace = {p: _rows(g - e.mean[p]).pow(2).sum() / (k - 1) for p, g in e.grads.items()}
    grad_sq = {p: m.pow(2).sum() - trace[p] / k for p, m in e.mean.items()}
    return _noise_fields("layer_gns", trace, grad_sq)


def _whole_model(layer: dict[str, Any]) -> dict[str, Any]:
    """``gns``'s fields from ``layer_gns``'s: each estimate is the sum of the parameters'."""
    return _noise_fields("gns", sum(layer["layer_gns_trace"].values()),
                         sum(layer["layer_gns_grad_sq"].values()))


def _noise_fields(name: str, trace: Any, grad_sq: Any) -> dict[str, Any]:
    """The answer's fields of a noise scale from its two estimates (numbers, or per parameter);
    the ratio is 0 where the second is."""
    def ratio(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (t / g).nan_to_num(0.0, posinf=0.0, neginf=0.0)

    if isinstance(trace, dict):
        value: Any = {p: ratio(t, grad_sq[p]) for p, t in trace.items()}
    else:
        value = ratio(trace, grad_sq)
    return dict(zip((name, *output(name).also), (value, trace, grad_sq), strict=True))


def _cosine(e: Expected, mean: Tensors) -> torch.Tensor:
    """Each sample's cosine with ``mean`` (0 where a norm is 0, as the engine defines it)."""
    mean_norm = total([m.pow(2).sum() for m in mean.values()]).sqrt()
    dots = total([_rows(g) @ mean[k].flatten() for k, g in e.grads.items()])
    return (dots / (e.norms * mean_norm)).nan_to_num(0.0, posinf=0.0, neginf=0.0)


Want = Callable[[Expected], Any]

PER_SAMPLE: dict[str, Want] = {
    "grads": lambda e: e.grads,
    "updates": _updates,
    "losses": lambda e: e.losses,
    "td_errors": lambda e: e.aux,
    "norms": lambda e: e.norms,
    "layer_norms": lambda e: {k: v.sqrt() for k, v in e.sq.items()},
    "dot": _dot,
    "projection": lambda e: e.sketches,
    "dots": lambda e: e.dots,
    "influence": lambda e: e.dots,
    "self_influence": _self_influence,
}

AGGREGATE: dict[str, Want] = {
    "mean": lambda e: e.mean,
    "variance": lambda e: {k: g.var(0, unbiased=False) for k, g in e.grads.items()},
    "clipped_mean": _clipped_mean,
    "cosine_mean": lambda e: _cosine(e, e.mean),
    "gns": lambda e: _whole_model(_layer_gns(e)),
    "layer_gns": _layer_gns,
    "kfac_inputs": lambda e: e.factors,
}
# Of one sample the variance is 0 and the cosine with the mean 1, whatever the gradient: these
# take at least two samples, when the batch has them.
AT_LEAST_TWO = frozenset({"variance", "cosine_mean", "gns", "layer_gns"})
