"""For the status page tests: requests that compute norms, the histogram they must give, and an
engine call held while the page looks at it."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from service.api.body import decode_json_body
from service.registry import ModelRegistry
from service.validate import parse_request
from service.worker import loop as worker_module
from service.worker.recorder import NORM_EDGES
from tests.support.reference import loop_of


def norms_request(n: int, seed: int = 0, outputs: tuple[str, ...] = ("norms",)) -> dict[str, Any]:
    """``n`` samples of the zoo ``mlp`` (MNIST-sized inputs)."""
    rng = np.random.default_rng(seed)
    return {
        "model": "mlp",
        "inputs": rng.standard_normal((n, 784)).astype(np.float32).round(3).tolist(),
        "targets": rng.integers(0, 10, n).tolist(),
        "outputs": list(outputs),
    }


def reference_norms(doc: dict[str, Any], registry: ModelRegistry | None = None) -> np.ndarray:
    """Each sample's gradient norm from the per-sample loop (tests/support/reference.py)."""
    parsed = parse_request(decode_json_body(doc, max_elements=1 << 24),
                           registry or ModelRegistry())
    norms = loop_of(parsed.model, parsed.batch, parsed.opts).norms.double().cpu().numpy()
    edges = np.asarray(NORM_EDGES)  # none so close to an edge that rounding could move it
    assert np.abs(norms[:, None] / edges[None, :] - 1).min() > 1e-4
    return norms


def buckets(norms: np.ndarray) -> list[int]:
    """The expected histogram: each norm's bucket among NORM_EDGES, counted."""
    idx = np.searchsorted(np.asarray(NORM_EDGES), norms, side="right")
    return np.bincount(idx, minlength=len(NORM_EDGES) + 1).tolist()  # type: ignore[no-any-return]


def norms_of(view: dict[str, Any], model_id: str) -> dict[str, Any] | None:
    """The histogram of ``model_id`` (any version) in a /status.json answer, if any."""
    found = [h for h in view["norms"] if h["model"].split("@")[0] == model_id]
    assert len(found) <= 1
    return found[0] if found else None


def hold_compute(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """The worker loop's engine call waits for ``release`` after setting ``started``."""
    started, release = threading.Event(), threading.Event()
    compute = worker_module._compute

    def held(*args: Any, **kwargs: Any) -> Any:
        started.set()
        assert release.wait(60), "never released"
        return compute(*args, **kwargs)

    monkeypatch.setattr(worker_module, "_compute", held)
    return started, release
