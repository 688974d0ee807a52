"""Convolutions (1d, 2d, 3d, any stride, padding, dilation and groups) through the unfolded input.

Unfolded, a convolution is a linear layer over the output positions (T = L positions, d =
in_channels / groups * kernel elements, p = out_channels / groups), so :class:`OuterSource`
gives its statistics; the input is unfolded a chunk of samples at a time to bound memory.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from service.fast_stats._core import Capture, Dense, Materialised, Use, cat, register_op, total
from service.fast_stats._sources import SourceContext, register_source
from service.fast_stats.linear import Block, OuterSource, bind, roles_of

_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")


def _tuple(value: Any, nd: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * nd
    out = tuple(int(v) for v in value)
    return out * nd if len(out) == 1 else out


def _pads(
    padding: Any, kernel: Sequence[int], dilation: Sequence[int]
) -> tuple[tuple[int, int], ...]:
    if padding == "valid":
        return tuple((0, 0) for _ in kernel)
    if padding == "same":
        total = [d * (k - 1) for k, d in zip(kernel, dilation, strict=True)]
        return tuple((t // 2, t - t // 2) for t in total)
    return tuple((p, p) for p in _tuple(padding, len(kernel)))


def unfold(
    x: torch.Tensor,
    kernel: Sequence[int],
    stride: Sequence[int],
    pads: Sequence[tuple[int, int]],
    dilation: Sequence[int],
) -> torch.Tensor:
    """``[n, C * prod(kernel), L]``: every receptive field as a column (``F.unfold``, N-d)."""
    nd = len(kernel)
    flat = [p for pair in reversed(pads) for p in pair]
    if any(flat):
        x = F.pad(x, flat)
    for j in range(nd):  # views: F.unfold's im2col is several times slower on CPU
        x = x.unfold(2 + j, dilation[j] * (kernel[j] - 1) + 1, stride[j])[..., :: dilation[j]]
    order = (0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    return x.permute(order).reshape(x.shape[0], x.shape[1] * math.prod(kernel), -1)


class ConvSource(OuterSource):
    def __init__(self, name: str, uses: list[Use], ctx: SourceContext) -> None:
        self.uses = uses
        _, self.kernel, self.stride, self.pads, self.dilation, groups = uses[0].info["key"]
        shape = ctx.shapes[name]
        out_ch, in_per_group = shape[0], shape[1]
        positions = sum(math.prod(u.grad_bf().shape[2:]) for u in uses)
        d = in_per_group * math.prod(self.kernel)
        super().__init__(
            name, shape, ctx.batch, ctx.budget, groups, d, out_ch // groups, positions, "conv"
        )

    cache = True  # rebuilding a chunk means unfolding its input again

    def chunk_size(self) -> int:
        """Samples per unfolded chunk (its columns and its per-sample gradients), ~48 MB:
        larger chunks run the batched matmul faster, smaller ones bound the memory."""
        per = (self.groups * self.t * self.d + self.numel) * self.itemsize
        return self.budget.chunk(per, self.batch, 48 << 20)

    def blocks(self, lo: int, hi: int) -> Iterator[Block]:
        step = self.chunk_size()
        for x in range(lo, hi, step):
            y = min(hi, x + step)
            cols = [
                unfold(u.a[x:y], self.kernel, self.stride, self.pads, self.dilation)
                for u in self.uses
            ]
            grads = [u.grad_bf()[x:y].flatten(2) for u in self.uses]
            a, g = cat(cols, -1), cat(grads, -1)
            yield (
                x,
                y,
                a.view(y - x, self.groups, self.d, -1).transpose(-1, -2),
                g.view(y - x, self.groups, self.p, -1).transpose(-1, -2),
            )


@register_source("conv")
def conv_source(name: str, role: str, uses: list[Use], ctx: SourceContext) -> Materialised:
    if role == "bias":
        per = total([u.grad_bf().flatten(2).sum(2) for u in uses])
        return Dense(name, per, ctx.budget, "conv")
    return ConvSource(name, uses, ctx)


@register_op(torch.conv1d, torch.conv2d, torch.conv3d)
def capture_conv(
    cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], found: dict[int, str]
) -> tuple[Any, list[Use]] | None:
    x, w, b, stride, padding, dilation, groups = bind(args, kwargs, _NAMES)
    nd = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3}[func]
    if (
        id(x) in found
        or not cap.is_batched(x)
        or x.dim() != nd + 2
        or not isinstance(w, torch.Tensor)
    ):
        return None
    kernel = tuple(w.shape[2:])
    dil = _tuple(1 if dilation is None else dilation, nd)
    key = (
        nd,
        kernel,
        _tuple(1 if stride is None else stride, nd),
        _pads(0 if padding is None else padding, kernel, dil),
        dil,
        1 if groups is None else int(groups),
    )
    out = func(*args, **kwargs)
    roles = roles_of(found, weight=w, bias=b)
    return out, [Use("conv", func, roles, out=out, a=x, info={"key": key})]
