"""Test-only fault injection: a wrong answer that ``verify`` must catch.

Nothing here is a production flag: each fault is a monkeypatch that lives for one test.

- :func:`wrong_gradient`: the ``vmap`` strategy's per-sample function returns a gradient off by
  ``delta`` (every element) for each sample whose first input element is ``marker``: the wrong
  gradient flows into every output the strategy computes from it (grads, norms, mean, variance,
  clipped_mean, cosine_mean, ...), as a real bug in it would. Fast statistics must be off
  (``fast_stats=False``), or the call take the ``vmap`` strategy.
- :func:`wrong_output`: the engine's answer has one output off by ``delta`` (at row ``row`` of
  each job for a per-sample output, everywhere for a statistic), whichever strategy ran.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from service import engine
from service.strategies import vmap

MARKER = 7.25  # a first input element no random batch holds


def wrong_gradient(monkeypatch: pytest.MonkeyPatch, *, marker: float = MARKER,
                   delta: float = 0.05) -> None:
    real = vmap.per_sample_fn

    def faulty(model: Any, loss: str, gamma: float) -> Any:
        fn = real(model, loss, gamma)

        def wrapped(selected: Any, others: Any, buffers: Any, samples: Any) -> Any:
            grads, rest = fn(selected, others, buffers, samples)
            x = samples["inputs"]
            hit = (x.reshape(x.shape[0], -1)[:, 0] == marker).to(torch.float32)
            return {k: g + delta * hit.to(g.dtype).reshape(-1, *[1] * (g.dim() - 1))
                    for k, g in grads.items()}, rest

        return wrapped

    monkeypatch.setattr(vmap, "per_sample_fn", faulty)


def wrong_output(monkeypatch: pytest.MonkeyPatch, name: str, *, row: int = 0,
                 delta: float = 0.05) -> None:
    real = engine.compute

    def faulty(*args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        answers = real(*args, **kwargs)
        for answer in answers:
            if name in answer:
                answer[name] = _shift(answer[name], row, delta, per_sample=name != "mean"
                                      and name not in ("variance", "clipped_mean"))
        return answers

    monkeypatch.setattr(engine, "compute", faulty)


def _shift(value: Any, row: int, delta: float, *, per_sample: bool) -> Any:
    if isinstance(value, dict):
        return {k: _shift(v, row, delta, per_sample=per_sample) for k, v in value.items()}
    value = value.clone()
    if not per_sample:
        return value + delta
    if row < value.shape[0]:
        value[row] += delta
    return value
