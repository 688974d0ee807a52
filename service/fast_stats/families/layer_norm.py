"""``F.layer_norm``'s affine parameters (and ``aten.layer_norm``'s, in exported graphs), from the
saved input and output gradient.

Their per-sample gradients are small (the parameter's own size per sample), so they are built
directly instead of replaying the op under ``vmap``: the weight gets ``sum(g * x_hat)`` and the
bias ``sum(g)`` over the positions of each sample.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.fast_stats._capture import Capture, bind, roles_of
from service.fast_stats._dense import dense_sum
from service.fast_stats._family import Captured, Family, register_family
from service.fast_stats._records import Use
from service.fast_stats._source import Source, SourceContext

_NAMES = ("input", "normalized_shape", "weight", "bias", "eps")


@dataclass(frozen=True)
class NormInput:
    """The layer input and each position's mean and 1/std, as the forward kernel computed them."""

    x: torch.Tensor
    mean: torch.Tensor
    rstd: torch.Tensor
    shape: tuple[int, ...]  # normalized_shape

    @property
    def key(self) -> Hashable:
        return self.shape


@register_family(F.layer_norm, torch.ops.aten.layer_norm.default)  # same first five arguments
class LayerNorm(Family[NormInput]):
    method = "direct"

    def source(self, name: str, role: str, uses: Sequence[Use], ctx: SourceContext) -> Source:
        k = len(ctx.shapes[name])
        parts = []
        for use in uses:
            g = use.grad
            dims = tuple(range(1, g.dim() - k))
            if role == "weight":
                p = self.payload(use)
                g = g * ((p.x - p.mean) * p.rstd)
            parts.append(g.sum(dims) if dims else g)
        return dense_sum(name, parts, ctx, self.method)

    def capture(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        x, shape, w, b, eps = bind(args, kwargs, _NAMES)
        if id(x) in found or not cap.is_batched(x) or x.dim() <= len(shape):
            return None
        # the same kernel F.layer_norm runs, which also answers each position's mean and 1/std
        out, mean, rstd = torch.native_layer_norm(
            x, list(shape), w, b, 1e-5 if eps is None else eps)
        payload = NormInput(x.detach(), mean.detach(), rstd.detach(), tuple(shape))
        return out, [self.use(func, roles_of(found, weight=w, bias=b), payload, out)]
