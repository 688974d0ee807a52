"""A parameter added to a batch of activations (positional embeddings, a scalar bias).

Its per-sample gradient is the output gradient summed down to the parameter's shape, small
enough to hold whole.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from service.fast_stats._capture import Capture
from service.fast_stats._dense import dense_sum
from service.fast_stats._family import Captured, Family, register_family
from service.fast_stats._records import Use
from service.fast_stats._source import Source, SourceContext


@dataclass(frozen=True)
class Added:
    """Nothing of the forward pass is needed beyond the output gradient."""

    @property
    def key(self) -> Hashable:
        return None


@register_family(torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__,
                 torch.ops.aten.add.Tensor)
class Add(Family[Added]):
    method = "direct"

    def source(self, name: str, role: str, uses: Sequence[Use], ctx: SourceContext) -> Source:
        shape = ctx.shapes[name]
        parts = []
        for use in uses:
            g = use.grad
            parts.append(g.sum_to_size((ctx.batch, *([1] * (g.dim() - 1 - len(shape))), *shape)))
        return dense_sum(name, parts, ctx, self.method)

    def capture(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        if set(kwargs) - {"alpha"} or kwargs.get("alpha", 1) != 1 or len(args) != 2 or \
                len(found) != 1:
            return None
        p, x = (args[0], args[1]) if id(args[0]) in found else (args[1], args[0])
        if id(p) not in found or not cap.is_batched(x) or p.dim() >= x.dim():
            return None
        out = func(*args, **kwargs)
        return out, [self.use(func, {found[id(p)]: "added"}, Added(), out)]
