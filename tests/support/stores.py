"""For the gradient-store tests: the top-k answer computed over the whole matrix at once, and
batches of MNIST-shaped samples for the ``mlp`` model."""

from __future__ import annotations

import numpy as np


def reference(phi: np.ndarray, q: np.ndarray | None, score: str, k: int,
              lam: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Top-k over the whole matrix at once, in float64: (rows, scores), ties by row."""
    norms = np.linalg.norm(phi, axis=1)
    if score == "self_influence":
        s = (norms**2)[None, :]
    elif score == "dot":
        s = q @ phi.T
    elif score == "cosine":
        s = (q @ phi.T) / np.linalg.norm(q, axis=1, keepdims=True) / norms
    else:
        gram = phi.T @ phi
        k_dim = phi.shape[1]
        if lam is None:  # the default: the mean eigenvalue, no row above all the others
            power = np.sort(norms**2)
            rest = power[:-1].sum()
            lam = (np.trace(gram) if rest <= 0 or power[-1] <= rest else 2 * rest) / k_dim
        s = q @ np.linalg.inv(gram + lam * np.eye(k_dim)) @ phi.T
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(s, order, 1)


def mlp_samples(n: int, first: int) -> dict[str, object]:
    """``n`` samples for the zoo's ``mlp`` (784 inputs, 10 classes), ids from ``first``."""
    rng = np.random.default_rng(first)
    return {"inputs": rng.standard_normal((n, 784)).astype(np.float32).round(3).tolist(),
            "targets": rng.integers(0, 10, n).tolist(), "ids": list(range(first, first + n))}
