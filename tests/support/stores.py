"""For the gradient-store tests: the top-k answer computed over the whole matrix at once, and
batches of MNIST-shaped samples for the ``mlp`` model."""

from __future__ import annotations

from fractions import Fraction

import numpy as np


def reference(phi: np.ndarray, q: np.ndarray | None, score: str, k: int,
              lam: float | None = None, exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Top-k over the whole matrix at once, in float64: (rows, scores), ties by row; ``exact``:
    trak's in rational numbers (:func:`exact_trak`)."""
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
        s = (exact_trak(phi, q, lam) if exact else
             q @ np.linalg.inv(gram + lam * np.eye(k_dim)) @ phi.T)
    order = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(s, order, 1)


def exact_trak(phi: np.ndarray, q: np.ndarray, lam: float) -> np.ndarray:
    """``q (Phi^T Phi + lam I)^-1 Phi^T`` in exact rational arithmetic (every float is a
    fraction), rounded once at the end: a reference where a dominating row leaves no float
    computation of it exact (the float64 Gram sum rounds the other rows out; Phi's SVD holds
    small singular values only to ``eps |Phi|``). Gauss-Jordan on ``[A | q^T]``; for small
    ``k`` (16: 0.1 s)."""
    rows = [[Fraction(float(x)) for x in row] for row in phi]
    k = phi.shape[1]
    a = [[sum((r[i] * r[j] for r in rows), Fraction(0)) + (Fraction(float(lam)) if i == j else 0)
          for j in range(k)] + [Fraction(float(x)) for x in q[:, i]] for i in range(k)]
    for c in range(k):  # A is positive definite: no pivot is zero
        a[c] = [x / a[c][c] for x in a[c]]
        for r in range(k):
            if r != c and a[r][c]:
                a[r] = [x - a[r][c] * y for x, y in zip(a[r], a[c], strict=True)]
    solved = [[a[i][k + j] for i in range(k)] for j in range(len(q))]
    return np.array([[float(sum((x * y for x, y in zip(s, r, strict=True)), Fraction(0)))
                      for r in rows] for s in solved])


def mlp_samples(n: int, first: int) -> dict[str, object]:
    """``n`` samples for the zoo's ``mlp`` (784 inputs, 10 classes), ids from ``first``."""
    rng = np.random.default_rng(first)
    return {"inputs": rng.standard_normal((n, 784)).astype(np.float32).round(3).tolist(),
            "targets": rng.integers(0, 10, n).tolist(), "ids": list(range(first, first + n))}
