"""Summary statistics without materialising every per-sample gradient (``PSGRAD_FAST_STATS``).

One batched forward pass records, for every op that reads a selected parameter, the layer input
``a``; one backward pass of the summed per-sample losses gives each op output's gradient ``g``
(row i is sample i's own, samples being independent in eval mode). Each parameter's statistics
then come from the closed form of its layer family (``linear``, ``conv``, ``embedding``), the
per-sample replay of the one op that reads it (``direct``: norms, positional parameters), or the
per-sample vjp of the smallest enclosing module (``vmap``); tied weights sum their parts
(``tied``). ``clipped_mean`` needs every norm first, so it takes a second pass over the saved
``a`` and ``g`` (``G^T diag(c) A`` for a linear layer), never a second backward.

:func:`compute` answers exactly what :func:`service.engine.compute` answers, or None when this
model, loss or call cannot take the fast path (the engine then runs ``vmap``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import torch

from service.fast_stats import (  # noqa: F401  (register the families)
    conv,
    elementwise,
    embedding,
    linear,
)
from service.fast_stats._core import (
    Budget,
    Need,
    Pass1,
    Pass2,
    Tensors,
    Unsupported,
    grouped,
    total,
)
from service.fast_stats._plan import forward_backward, plan_for, sources
from service.strategies.base import clip_factors

__all__ = ["PER_SAMPLE_OUTPUTS", "compute", "supports"]

PER_SAMPLE_OUTPUTS = frozenset({"grads", "updates"})  # need the per-sample tensors themselves


def supports(model: Any, outputs: Sequence[str]) -> bool:
    """Whether a call with these outputs may take the fast path at all."""
    return model.route == "vmap" and not PER_SAMPLE_OUTPUTS & set(outputs)


def compute(
    model: Any, batch: Any, opts: Any, segments: Sequence[int], *, budget_bytes: int = 1 << 30
) -> list[dict[str, Any]] | None:
    """Every requested output for each segment, as :func:`service.engine.compute` gives them."""
    if not supports(model, opts.outputs):
        return None
    device = next(iter(model.params.values())).device
    params = {**model.params, **{k: v.to(device, model.dtype) for k, v in batch.weights.items()}}
    samples = {k: v.to(device) for k, v in batch.samples().items()}
    reference = {k: v.to(device, model.dtype) for k, v in batch.reference.items()}
    plan = plan_for(model, params, samples, opts.loss, opts.gamma, opts.params)
    if plan is None:
        return None
    try:
        run = forward_backward(model, params, samples, opts.loss, opts.gamma, plan)
    except Unsupported:
        return None
    if [u.signature() for u in run.uses] != plan.signature:
        return None  # the model read its parameters differently from the probe: play safe
    size = batch.size
    budget = Budget(budget_bytes)
    found = grouped(sources(model, params, run, plan, size, budget))
    bounds = list(itertools.pairwise(itertools.accumulate(segments, initial=0)))
    want = set(opts.outputs)
    need = Need(
        sq=bool(want & {"norms", "layer_norms", "clipped_mean", "cosine_mean"}),
        reference=reference if "dot" in want else None,
        sums=bool(want & {"mean", "variance", "cosine_mean"}),
        sqsums="variance" in want,
        bounds=bounds,
        sums_dtype=torch.float64 if "variance" in want else model.dtype,
    )
    first: dict[str, Pass1] = {}
    for source in found:
        first.update(source.pass1(need))
    names = list(opts.params)
    norms = None
    if need.sq:
        norms = total([first[k].sq for k in names]).sqrt()  # type: ignore[misc]
    means = None
    if need.sums:
        means = [
            {
                k: (first[k].sums[s] / (b - a)).to(model.dtype)  # type: ignore[index]
                for k in names
            }
            for s, (a, b) in enumerate(bounds)
        ]
    second: dict[str, Pass2] = {}
    clip = None
    if "clipped_mean" in want and norms is not None:
        clip = clip_factors(opts.clip_norm, norms, opts.norm_offset)
    if clip is not None or "cosine_mean" in want:
        for source in found:
            second.update(source.pass2(clip, means if "cosine_mean" in want else None, bounds))
    meta = {
        "route": model.route,
        "chunk_size": size,
        "path": "fast_stats",
        "method": {k: s.method_of(k) for s in found for k in s.names},
        "form": {k: s.form(k) for s in found for k in s.names},
    }
    meta["method"] = {k: meta["method"][k] for k in names}
    meta["form"] = {k: meta["form"][k] for k in names}
    results = []
    for s, (a, b) in enumerate(bounds):
        out, extra = _segment(opts, names, s, a, b, run, first, second, norms, means)
        results.append({**out, "meta": {**meta, **extra}})
    return results


def _segment(
    opts: Any,
    names: list[str],
    s: int,
    a: int,
    b: int,
    run: Any,
    first: dict[str, Pass1],
    second: dict[str, Pass2],
    norms: torch.Tensor | None,
    means: list[Tensors] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    from service.engine import noised_mean

    out: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    n = b - a
    for name in opts.outputs:
        if name == "losses":
            out[name] = run.losses[a:b]
        elif name == "td_errors":
            out[name] = run.aux[a:b]
        elif name == "norms":
            out[name] = norms[a:b]  # type: ignore[index]
        elif name == "layer_norms":
            out[name] = {k: first[k].sq[a:b].sqrt() for k in names}  # type: ignore[index]
        elif name == "dot":
            out[name] = total([first[k].dot[a:b] for k in names])  # type: ignore[index]
        elif name == "mean":
            out[name] = dict(means[s])  # type: ignore[index]
        elif name == "variance":
            out[name] = {}
            for k in names:
                mean64 = first[k].sums[s] / n  # type: ignore[index]
                var = first[k].sqsums[s] / n - mean64 * mean64  # type: ignore[index]
                out[name][k] = var.clamp(min=0).to(means[s][k].dtype)  # type: ignore[index]
        elif name == "clipped_mean":
            sums = {k: second[k].clipped[s] for k in names}  # type: ignore[index]
            out[name], extra["seed"] = noised_mean(sums, opts, n)
        elif name == "cosine_mean":
            mean_norm = torch.stack([means[s][k].pow(2).sum() for k in names]).sum().sqrt()  # type: ignore[index]
            dots = total([second[k].cos for k in names])  # type: ignore[misc]
            cos = dots[a:b] / (norms[a:b] * mean_norm)  # type: ignore[index]
            out[name] = cos.nan_to_num(0.0, posinf=0.0, neginf=0.0)
    return out, extra
