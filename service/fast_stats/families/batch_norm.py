"""Batch normalization in eval mode (``F.batch_norm``, ``aten.batch_norm`` in exported graphs):
its affine parameters from the saved input and output gradient.

With running statistics every sample is normalised on its own, ``x_hat = (x - mean) / sqrt(var
+ eps)`` per channel, so sample i's weight gradient is ``sum(g * x_hat)`` and its bias gradient
``sum(g)`` over the sample's positions (the first as ``rstd sum(g x) + shift sum(g)``, ``shift
= -mean rstd``: no product the size of the activations): small, built directly. Replaying
the op under ``vmap`` (what an unclaimed op gets) took a third of a ResNet-18 training step for
these few thousand parameters. A training-mode call mixes the samples' statistics: declined.

The per-channel ``rstd = 1 / sqrt(var + eps)`` and ``shift`` depend only on the running
statistics, the same buffers in every call: they are computed once and kept while
neither buffer changes (:class:`_Scales`), not two operations per layer and call (on a GPU, at
small batches, each a launch that costs more than its work).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from typing import Any
from weakref import ref

import torch
import torch.nn.functional as F

from service.fast_stats._capture import Capture, bind, roles_of
from service.fast_stats._dense import dense_sum
from service.fast_stats._family import Captured, Family, register_family
from service.fast_stats._kernels import sums_and_dots
from service.fast_stats._records import Use
from service.fast_stats._source import Source, SourceContext

_ATEN = torch.ops.aten.batch_norm.default
_NAMES = ("input", "running_mean", "running_var", "weight", "bias", "training", "momentum",
          "eps")
_ATEN_NAMES = ("input", "weight", "bias", "running_mean", "running_var", "training",
               "momentum", "eps")


@dataclass(frozen=True)
class NormInput:
    """The layer input and the per-channel scale and shift that normalise it."""

    x: torch.Tensor
    rstd: torch.Tensor
    shift: torch.Tensor

    @property
    def key(self) -> Hashable:
        return None

    def normalised(self) -> torch.Tensor:
        shape = (1, -1) + (1,) * (self.x.dim() - 2)
        return torch.addcmul(self.shift.view(shape), self.x, self.rstd.view(shape))


class _Scales:
    """``(rstd, shift)`` of each pair of running statistics, computed once and kept while both
    buffers live and neither is written (their version counters unchanged)."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int, float], tuple[Any, ...]] = {}

    def __call__(self, mean: torch.Tensor, var: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        key = (id(mean), id(var), eps)
        held = self._held.get(key)
        if held is not None:
            mean_ref, var_ref, versions, rstd, shift = held
            if (mean_ref() is mean and var_ref() is var
                    and versions == (mean._version, var._version)):
                return rstd, shift
        with torch.no_grad():
            rstd = (var.detach() + eps).rsqrt()
            shift = (mean.detach() * rstd).neg_()

        def forget(_: object) -> None:
            self._held.pop(key, None)

        self._held[key] = (ref(mean, forget), ref(var, forget),
                           (mean._version, var._version), rstd, shift)
        return rstd, shift


@register_family(F.batch_norm, _ATEN)
class BatchNorm(Family[NormInput]):
    method = "batch_norm"

    reduces = True

    def reduce(self, use: Use, g: torch.Tensor) -> torch.Tensor:
        """Each sample's ``[B, C, 2]`` sums over its positions as the backward pass reaches
        the output: ``sum(g)`` (the bias's gradient) and ``sum(g * x_hat)`` (the weight's), the
        latter as ``rstd sum(g x) + shift sum(g)``, no product the size of the activations;
        both written into the answer."""
        p = self.payload(use)
        if g.dim() == 2:  # [B, C]: one position
            return torch.stack([g, g * p.normalised().to(g)], -1)
        b, c = g.shape[:2]
        out = g.new_empty((b, c, 2))
        gx = sums_and_dots(g.reshape(b * c, -1), p.x.reshape(b * c, -1).to(g), out.view(-1, 2))
        torch.mul(gx.view(b, c), p.rstd.to(g), out=out[..., 1]).addcmul_(out[..., 0],
                                                                         p.shift.to(g))
        return out

    def spent(self, payload: NormInput) -> NormInput:
        return replace(payload, x=payload.x[:0])  # the layer's input: read by reduce alone

    def source(self, name: str, role: str, uses: Sequence[Use], ctx: SourceContext) -> Source:
        column = 1 if role == "weight" else 0
        return dense_sum(name, [use.grad[..., column] for use in uses], ctx, self.method)

    def capture(
        self, cap: Capture, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
        found: dict[int, str],
    ) -> Captured | None:
        if func is _ATEN:
            x, w, b, mean, var, training, _, eps = bind(args, kwargs, _ATEN_NAMES)
        else:
            x, mean, var, w, b, training, _, eps = bind(args, kwargs, _NAMES)
        if (
            training
            or not isinstance(mean, torch.Tensor)
            or not isinstance(var, torch.Tensor)
            or id(mean) in found
            or id(var) in found
            or id(x) in found
            or not cap.is_batched(x)
            or x.dim() < 2
        ):
            return None
        eps = 1e-5 if eps is None else float(eps)
        out = func(*args, **kwargs)
        payload = NormInput(x.detach(), *_SCALES(mean, var, eps))
        return out, [self.use(func, roles_of(found, weight=w, bias=b), payload, out)]


_SCALES = _Scales()
