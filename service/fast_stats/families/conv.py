"""Convolutions (1d, 2d, 3d, any stride, padding, dilation and groups) through the unfolded input.

Unfolded, a convolution is a linear layer over the output positions (T = L positions, d =
in_channels / groups * kernel elements, p = out_channels / groups), so
:class:`~.._outer.OuterSource` gives its statistics; the input is unfolded a block of samples
at a time to bound memory. A bias's per-sample gradient is the output gradient summed over
positions, held whole.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from service.fast_stats._capture import Capture, bind, roles_of
from service.fast_stats._dense import dense_sum
from service.fast_stats._family import Captured, Family, register_family
from service.fast_stats._outer import Block, OuterSource
from service.fast_stats._records import Pass1, Pass1Need, Use
from service.fast_stats._source import Materialised, Source, SourceContext, cat
from service.fast_stats._tuning import TUNING
from service.strategies.base import Tensors

_NAMES = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_ATEN = torch.ops.aten
# the functions and the aten overloads an exported graph calls (same arguments, same order)
_DIMS = {torch.conv1d: 1, torch.conv2d: 2, torch.conv3d: 3,
         _ATEN.conv1d.default: 1, _ATEN.conv2d.default: 2, _ATEN.conv3d.default: 3,
         _ATEN.conv1d.padding: 1, _ATEN.conv2d.padding: 2, _ATEN.conv3d.padding: 3}


@dataclass(frozen=True)
class Geometry:
    """Everything but the tensors that decides a convolution's receptive fields."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    pads: tuple[tuple[int, int], ...]  # (before, after) per spatial dimension
    dilation: tuple[int, ...]
    groups: int


@dataclass(frozen=True)
class ConvInput:
    x: torch.Tensor  # the layer input, [B, C, *spatial]
    geometry: Geometry

    @property
    def key(self) -> Hashable:
        return self.geometry


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


def unfold(x: torch.Tensor, geo: Geometry) -> torch.Tensor:
    """``[n, C * prod(kernel), L]``: every receptive field as a column (``F.unfold``, N-d)."""
    kernel, stride, dilation = geo.kernel, geo.stride, geo.dilation
    nd = len(kernel)
    flat = [p for pair in reversed(geo.pads) for p in pair]
    if any(flat):
        x = F.pad(x, flat)
    for j in range(nd):  # views: F.unfold's im2col is several times slower on CPU
        x = x.unfold(2 + j, dilation[j] * (kernel[j] - 1) + 1, stride[j])[..., :: dilation[j]]
    order = (0, 1, *range(2 + nd, 2 + 2 * nd), *range(2, 2 + nd))
    return x.permute(order).reshape(x.shape[0], x.shape[1] * math.prod(kernel), -1)


class ConvSource(OuterSource):
    """The weight of convolution calls of one geometry, unfolded a block at a time."""

    cache = True  # rebuilding a chunk means unfolding its input again
    pieces_cos = True  # where the whole batch is one block (:meth:`_cos_in_pieces`)

    def __init__(
        self, name: str, inputs: Sequence[ConvInput], grads: Sequence[torch.Tensor],
        ctx: SourceContext,
    ) -> None:
        self.xs = [p.x for p in inputs]
        self.gs = list(grads)
        self.geometry = inputs[0].geometry
        shape = ctx.shapes[name]
        out_ch, in_per_group, groups = shape[0], shape[1], self.geometry.groups
        super().__init__(
            name, shape, ctx.batch, ctx.budget, groups=groups,
            d=in_per_group * math.prod(self.geometry.kernel), p=out_ch // groups,
            positions=sum(math.prod(g.shape[2:]) for g in grads), method="conv",
        )

    def gain(self) -> float:
        """``TUNING.fold_gain`` where the weight-gradient convolution materialises (the Gram form
        runs on unfolded fields)."""
        return TUNING.fold_gain if self.folded() else 1.0

    @property
    def dtype(self) -> torch.dtype:
        return self.xs[0].dtype

    def chunk_size(self) -> int:
        """Samples per chunk of per-sample gradients (with their unfolded columns), ~48 MB:
        larger chunks run the batched matmul faster, smaller ones bound the memory."""
        per = (self.groups * self.t * self.d + self.numel) * self.itemsize
        return self.budget.chunk(per, self.batch, 48 << 20)

    def pass1(self, need: Pass1Need, keep: bool = True) -> dict[str, Pass1]:
        if (need.m2 or need.references is not None) and self.folded():
            # the batch-folded convolution builds each chunk's gradients faster than unfolded
            # pieces do (no copy of every receptive field); their moments merge chunk by chunk
            # (ResNet-18's variance: 1.19x a plain step against 1.35x), their dots are taken
            # chunk by chunk
            return Materialised.pass1(self, need, keep)
        return super().pass1(need, keep)

    def span(self) -> int:
        """Samples per unfolded block, ~64 MiB of receptive fields: what a piece, a Gram form
        or a dot product reads holds no per-sample gradient of the whole weight, so a block
        is larger than a chunk (ResNet-18's 7x7 layers at B=32: the whole batch in one block
        instead of eight of 4 samples, each split into pieces of 3 and 1 samples)."""
        return self.budget.chunk(self.groups * self.t * self.d * self.itemsize, self.batch,
                                 64 << 20)

    def _cos_in_pieces(self) -> bool:
        """As a linear layer's, where the whole batch is one unfolded block, unless the
        batch-folded convolution builds the gradients that the norms need anyway (the
        materialised form: their chunks, kept, give the second pass). ResNet-18's 14x14
        layers at B=32 paid the Gram form's norms, the sum's weight-gradient convolution and
        a forward convolution with the mean, against one build of pieces."""
        return (super()._cos_in_pieces() and self.span() >= self.batch
                and not (self.folded() and self._form == "materialise"))

    def blocks(self, lo: int, hi: int) -> Iterator[Block]:
        step = self.span()
        for x in range(lo, hi, step):
            y = min(hi, x + step)
            a = cat([unfold(v[x:y], self.geometry) for v in self.xs], -1)
            g = cat([v[x:y].flatten(2) for v in self.gs], -1)
            yield (
                x,
                y,
                a.view(y - x, self.groups, self.d, -1).transpose(-1, -2),
                g.view(y - x, self.groups, self.p, -1).transpose(-1, -2),
            )

    def answer(self, rows: int | None = None) -> Tensors:
        """Every sample's weight gradient, allocated once: by one weight-gradient convolution
        with the batch folded into the groups where that is faster (:meth:`folded`), else by
        the unfolded chunks' batched matmuls written straight into the answer."""
        if not self.folded():
            return super().answer(rows)
        return self.grads(0, self.batch if rows is None else rows)

    def grads(self, lo: int, hi: int) -> Tensors:
        """Rows [lo, hi) by the batch-folded convolution where it is faster (:meth:`folded`):
        ResNet-18's 56x56 layers at 33 ms for 16 samples against 107 ms unfolded."""
        if not self.folded():
            return super().grads(lo, hi)
        name = self.names[0]
        out = weight_grad(self.xs[0][lo:hi].detach(), self.gs[0][lo:hi].detach(),
                          self.geometry, self.shapes[name], per_sample=True)
        return {name: out.view(hi - lo, *self.shapes[name])}

    def dot_rows(self, ref: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        """``<g_i, R> = sum g_i * conv(x_i, R)`` over the output positions: one forward
        convolution with the weight ``R``, never unfolded."""
        if any(x.dtype != ref.dtype for x in self.xs):
            return super().dot_rows(ref, lo, hi)
        geo, nd = self.geometry, len(self.geometry.kernel)
        conv = (F.conv1d, F.conv2d, F.conv3d)[nd - 1]
        out: torch.Tensor | None = None
        for x, g in zip(self.xs, self.gs, strict=True):
            x = F.pad(x[lo:hi].detach(), [p for pair in reversed(geo.pads) for p in pair])
            y = conv(x, ref, None, geo.stride, 0, geo.dilation, geo.groups)
            term = (g[lo:hi].detach() * y).flatten(1).sum(1)
            out = term if out is None else out + term
        assert out is not None
        return out

    def wsum(self, c: torch.Tensor | None, lo: int, hi: int, dtype: torch.dtype) -> torch.Tensor:
        """``sum_i c_i grad_i`` as the batch's weight-gradient convolution of the output
        gradients scaled by ``c`` (what a training step runs), never unfolded; in float64
        (variance's sums) by the unfolded blocks, which oneDNN's kernels do not take."""
        if any(x.dtype != dtype for x in self.xs):
            return super().wsum(c, lo, hi, dtype)
        name = self.names[0]
        total: torch.Tensor | None = None
        for x, g in zip(self.xs, self.gs, strict=True):
            g = g[lo:hi].detach()
            if c is not None:
                g = g * c.to(g.dtype).reshape(-1, *(1,) * (g.dim() - 1))
            term = weight_grad(x[lo:hi].detach(), g.to(dtype), self.geometry, self.shapes[name],
                               per_sample=False)
            total = term if total is None else total + term
        assert total is not None
        return total

    def folded(self) -> bool:
        """Whether the weight-gradient convolution (:func:`weight_grad` per sample) beats
        unfolding: it skips the copy of every receptive field, which pays off when the
        fields are wide and many (``d`` and ``T``); on few input channels or few positions
        oneDNN's kernels are slower than the batched matmul, and its grouped ones scale badly
        on two threads shared with other work (measured in ``docs/architecture.md``)."""
        return (len(self.xs) == 1 and self.xs[0].dtype == torch.float32
                and self.d >= TUNING.fold_min_field and self.t >= TUNING.fold_min_positions)


def weight_grad(x: torch.Tensor, g: torch.Tensor, geo: Geometry, shape: torch.Size, *,
                per_sample: bool, folded: bool | None = None) -> torch.Tensor:
    """The weight gradient of the batch, ``shape``, by one weight-gradient convolution; with
    ``per_sample``, every sample's, ``[B * out_channels, in / groups, *kernel]``: the batch
    folded into the groups (what ``vmap`` does: one call), or one convolution per sample on a
    CPU where the input has few channels per group (oneDNN's grouped kernel ran ResNet-18's
    first layer, 3 channels, at half the speed of its ungrouped one; on wider inputs the two
    were even, and one per sample paid a copy); ``folded`` chooses."""
    n, nd = x.shape[0], len(geo.kernel)
    if folded is None:
        folded = x.device.type != "cpu" or x.shape[1] // geo.groups >= TUNING.few_channels
    if per_sample and n > 1 and not folded:
        return torch.cat([weight_grad(x[i : i + 1], g[i : i + 1], geo, shape, per_sample=False)
                          for i in range(n)])
    padding = [a for a, _ in geo.pads]
    if any(a != b for a, b in geo.pads):  # "same" with an even kernel: pad explicitly
        x = F.pad(x, [p for pair in reversed(geo.pads) for p in pair])
        padding = [0] * nd
    groups, rows = geo.groups, shape[0]
    if per_sample:
        g = g.reshape(1, n * g.shape[1], *g.shape[2:])
        x = x.reshape(1, n * x.shape[1], *x.shape[2:])
        groups, rows = n * groups, n * rows
    like = x.new_empty((1,) * (nd + 2)).expand(rows, *shape[1:])  # only its shape is read
    return torch.ops.aten.convolution_backward(
        g, x, like, None, list(geo.stride), padding, list(geo.dilation), False, [0] * nd,
        groups, [False, True, False],
    )[1]


@register_family(*_DIMS)
class Conv(Family[ConvInput]):
    method = "conv"

    def source(self, name: str, role: str, uses: Sequence[Use], ctx: SourceContext) -> Source:
        if role == "bias":
            return dense_sum(name, [u.grad.flatten(2).sum(2) for u in uses], ctx, self.method)
        return ConvSource(name, [self.payload(u) for u in uses], [u.grad for u in uses], ctx)

    def capture(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        x, w, b, stride, padding, dilation, groups = bind(args, kwargs, _NAMES)
        nd = _DIMS[func]
        if (
            id(x) in found
            or not cap.is_batched(x)
            or x.dim() != nd + 2
            or not isinstance(w, torch.Tensor)
        ):
            return None
        kernel = tuple(w.shape[2:])
        dil = _tuple(1 if dilation is None else dilation, nd)
        geometry = Geometry(
            kernel=kernel,
            stride=_tuple(1 if stride is None else stride, nd),
            pads=_pads(0 if padding is None else padding, kernel, dil),
            dilation=dil,
            groups=1 if groups is None else int(groups),
        )
        out = func(*args, **kwargs)
        return out, [self.use(func, roles_of(found, weight=w, bias=b), ConvInput(x, geometry), out)]
