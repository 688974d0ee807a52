"""A running gradient noise scale across training steps, kept by the client.

Each answer's ``gns_trace`` and ``gns_grad_sq`` are unbiased estimates of ``tr(Sigma)`` and
``|G|^2`` from one batch; their ratio is not unbiased and, where ``|G|^2`` is small next to the
noise, swings far from batch to batch. As McCandlish et al. (2018, appendix A) do, the running
estimate is the ratio of the two estimates' exponential moving averages, not an average of
ratios. The server keeps nothing between requests: this object is the caller's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from psgrad._types import GradsResult

__all__ = ["NoiseScale"]


class NoiseScale:
    """Exponential moving averages of the noise scale's two estimates, whole-model and, where
    the answers carry ``layer_gns``, per parameter.

        ema = psgrad.NoiseScale(beta=0.95)
        for step, (x, y) in enumerate(loader):
            result = client.per_sample_grads("my-model", x, y, outputs=["gns"])
            ema.update(result)
            log(step, ema.value)            # tr(Sigma) / |G|^2, smoothed

    The averages are bias-corrected as Adam's are (divided by ``1 - beta^steps``), so the first
    steps are not pulled towards 0; the ratio is the same either way.
    """

    def __init__(self, beta: float = 0.99) -> None:
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1): the weight of the past; got {beta!r}")
        self.beta = beta
        self.steps = 0
        self._trace = 0.0
        self._grad_sq = 0.0
        self._layers: dict[str, list[float]] = {}  # param: [trace, grad_sq], uncorrected

    def update(self, result: GradsResult | Mapping[str, Any]) -> float:
        """Take one answer's ``gns_trace`` and ``gns_grad_sq`` (and ``layer_gns_trace`` and
        ``layer_gns_grad_sq`` where it has them): a :class:`psgrad.GradsResult` or its fields.
        Answers the running noise scale."""
        if "gns_trace" not in result or "gns_grad_sq" not in result:
            raise KeyError("the answer has no gns_trace and gns_grad_sq: ask for outputs=['gns']")
        b = self.beta
        self.steps += 1
        self._trace = b * self._trace + (1 - b) * float(result["gns_trace"])
        self._grad_sq = b * self._grad_sq + (1 - b) * float(result["gns_grad_sq"])
        if "layer_gns_trace" in result:
            for param, trace in result["layer_gns_trace"].items():
                kept = self._layers.setdefault(param, [0.0, 0.0])
                kept[0] = b * kept[0] + (1 - b) * float(trace)
                kept[1] = b * kept[1] + (1 - b) * float(result["layer_gns_grad_sq"][param])
        return self.value

    @property
    def trace(self) -> float:
        """The running ``tr(Sigma)``, bias-corrected."""
        return self._corrected(self._trace)

    @property
    def grad_sq(self) -> float:
        """The running ``|G|^2``, bias-corrected."""
        return self._corrected(self._grad_sq)

    @property
    def value(self) -> float:
        """The running noise scale, ``trace / grad_sq`` (0 before any step or where
        ``grad_sq`` is 0)."""
        return _ratio(self._trace, self._grad_sq)

    @property
    def layers(self) -> dict[str, float]:
        """The running noise scale of each parameter, from answers with ``layer_gns``."""
        return {param: _ratio(t, g) for param, (t, g) in self._layers.items()}

    def _corrected(self, value: float) -> float:
        return value / (1 - self.beta**self.steps) if self.steps else 0.0


def _ratio(trace: float, grad_sq: float) -> float:
    return trace / grad_sq if grad_sq else 0.0
