"""Small parameters applied elementwise: ``F.layer_norm``'s affine and broadcast additions.

Their per-sample gradients are small (the parameter's own size per sample), so they are built
directly from the saved input and output gradient instead of replaying the op under ``vmap``:
LayerNorm's weight gets ``sum(g * x_hat)`` and its bias ``sum(g)`` over the positions of each
sample; a parameter added to a batch of activations (positional embeddings, a scalar bias) gets
``g`` summed down to its shape.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from service.fast_stats._core import Capture, Dense, Materialised, Use, register_op, total
from service.fast_stats._sources import SourceContext, register_source
from service.fast_stats.linear import bind, roles_of


def _per_sample(name: str, parts: list[torch.Tensor], ctx: SourceContext) -> Dense:
    return Dense(name, total(parts).reshape(ctx.batch, *ctx.shapes[name]), ctx.budget, "direct")


@register_source("layer_norm")
def layer_norm_source(name: str, role: str, uses: list[Use], ctx: SourceContext) -> Materialised:
    parts = []
    for use in uses:
        k = len(ctx.shapes[name])
        g = use.grad_bf()
        dims = tuple(range(1, g.dim() - k))
        if role == "weight":
            x, mean, rstd = use.a
            g = g * ((x - mean) * rstd)
        parts.append(g.sum(dims) if dims else g)
    return _per_sample(name, parts, ctx)


@register_op(F.layer_norm)
def capture_layer_norm(
    cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], found: dict[int, str]
) -> tuple[Any, list[Use]] | None:
    x, shape, w, b, eps = bind(args, kwargs, ("input", "normalized_shape", "weight", "bias", "eps"))
    if id(x) in found or not cap.is_batched(x) or x.dim() <= len(shape):
        return None
    # the same kernel F.layer_norm runs, which also answers each position's mean and 1/std
    out, mean, rstd = torch.native_layer_norm(x, list(shape), w, b, 1e-5 if eps is None else eps)
    saved = (x.detach(), mean.detach(), rstd.detach())
    return out, [
        Use(
            "layer_norm",
            func,
            roles_of(found, weight=w, bias=b),
            out=out,
            a=saved,
            info={"key": tuple(shape)},
        )
    ]


@register_source("add")
def add_source(name: str, role: str, uses: list[Use], ctx: SourceContext) -> Materialised:
    shape = ctx.shapes[name]
    parts = []
    for use in uses:
        g = use.grad_bf()
        target = (ctx.batch, *([1] * (g.dim() - 1 - len(shape))), *shape)
        parts.append(g.sum_to_size(target))
    return _per_sample(name, parts, ctx)


@register_op(torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__)
def capture_add(
    cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], found: dict[int, str]
) -> tuple[Any, list[Use]] | None:
    if kwargs or len(args) != 2 or len(found) != 1:
        return None
    p, x = (args[0], args[1]) if id(args[0]) in found else (args[1], args[0])
    if id(p) not in found or not cap.is_batched(x) or p.dim() >= x.dim():
        return None
    out = func(*args, **kwargs)
    return out, [Use("add", func, {found[id(p)]: "added"}, out=out, info={"key": None})]
