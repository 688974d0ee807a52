"""Fused CPU loops for the passes over per-sample gradients and activations.

torch's eager operations read a tensor once per operation: a piece's mean over the samples, its
squared deviations (written) and their sum are three passes, about 1 ns per element on a 2-core
Xeon, as long again as the batched matmul that built the piece. One loop over blocks of the
piece's columns small enough to stay in the L1 cache reads each element twice from there and
writes none: about four times faster (``benchmarks/pieces.py --loops fused,eager``). A batch
norm's per-sample sums and dots over positions likewise take one read. Numba compiles each loop
once per process (about a second per dtype): a worker does it for float32 as it starts
(:func:`warm_up`), other dtypes at their first use. On an accelerator (whose eager
kernels are bandwidth-bound and fast), and for any other dtype or layout, the eager operations
run.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np
import torch
import torch.nn.functional as F

from service.fast_stats._tuning import TUNING
from service.strategies.base import squared_norms


def squared_deviations(rows: torch.Tensor, mean: torch.Tensor, *, in_place: bool = False
                       ) -> torch.Tensor:
    """``(rows - mean)^2`` element-wise, one pass over ``rows`` (``mse_loss``'s kernel: ``sub_``
    then ``mul_`` took 30% longer on the CPU), written over ``rows`` with ``in_place``."""
    target = mean.expand_as(rows)
    if in_place:
        return torch.ops.aten.mse_loss.out(rows, target, 0, out=rows)  # 0: no reduction
    return F.mse_loss(rows, target, reduction="none")


def moments_into(rows: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, *,
                 in_place: bool = False) -> None:
    """The mean of ``rows`` ``[n, *shape]`` over its samples and their sum of squared deviations
    from it, written into ``mean`` and ``m2`` (``shape``). Each deviation is taken from the
    rows' own mean, so nothing cancels. With ``in_place`` the eager operations may write over
    ``rows`` (a reused buffer)."""
    if merged_into(rows, mean, m2, 0):
        return
    torch.mean(rows, 0, out=mean)
    torch.sum(squared_deviations(rows, mean, in_place=in_place), 0, out=m2)


def merged_into(rows: torch.Tensor, mean: torch.Tensor, m2: torch.Tensor, seen: int) -> bool:
    """``rows``' moments merged into the running ``mean`` and ``m2`` of ``seen`` earlier samples
    (none: written) in one loop, where the fused loops run; False where they do not (the caller
    takes the eager operations)."""
    if not _fused(rows, mean, m2):
        return False
    _moments(_flat(rows, len(rows)), _flat(mean), _flat(m2), _step(rows), seen)
    return True


def norms_and_mean_dots(rows: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Each sample's squared norm and dot product with the samples' mean, ``[n, 2]``, for
    ``rows`` ``[n, *shape]``; the mean is written into ``mean`` (``shape``)."""
    n = rows.shape[0]
    if _fused(rows, mean):
        out = rows.new_empty((n, 2))
        _norms_and_dots(_flat(rows, n), _flat(mean), out.numpy(), _step(rows))
        return out
    flat = rows.reshape(n, -1)
    mu = torch.mean(rows, 0, out=mean).reshape(-1)
    return torch.stack((squared_norms(flat), flat @ mu), 1)


def sums_and_dots(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each row's sum of ``a`` ``[R, K]`` written into ``out[:, 0]`` (``out`` ``[R, 2]``), and
    each row's dot product with ``b``'s row answered ``[R]`` (fused: written into ``out[:, 1]``
    in the same read of ``a``; eager: one batched matmul, one kernel on an accelerator, which
    ran 1.5 to 3.5 times slower than a product and a sum on a Xeon's CPU)."""
    if _fused(a, b, out):
        _sums_and_dots(_flat(a, len(a)), _flat(b, len(b)), out.numpy())
        return out[:, 1]
    torch.sum(a, 1, out=out[:, 0])
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def warm_up(dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
    """Compile every loop for ``dtypes`` now, as the calls compile them (the same argument
    types), so that a worker's first request does not: ResNet-18's first check spent 1.0 s of
    its 1.6 s compiling the batch norm's loop. Workers call this when they start."""
    for dtype in dtypes:
        rows, mean, m2 = torch.ones(2, 3, dtype=dtype), torch.zeros(3, dtype=dtype), \
            torch.zeros(3, dtype=dtype)
        merged_into(rows, mean, m2, 0)
        norms_and_mean_dots(rows, mean)
        sums_and_dots(rows, rows, torch.zeros(2, 2, dtype=dtype))


def _fused(*tensors: torch.Tensor) -> bool:
    dtype = tensors[0].dtype
    return TUNING.fused and dtype in (torch.float32, torch.float64) and all(
        t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and t.numel() > 0
        for t in tensors)


def _flat(t: torch.Tensor, rows: int | None = None) -> np.ndarray:
    """``t``'s memory as an array: ``[rows, -]``, or one dimension (no copy: ``t`` is
    contiguous)."""
    return t.detach().view(-1 if rows is None else (rows, -1)).numpy()


def _step(rows: torch.Tensor) -> int:
    """Columns per block: every sample's share of ``TUNING.block_bytes``, at least 256."""
    return max(256, TUNING.block_bytes // (rows.shape[0] * rows.element_size()))


@numba.njit(nogil=True, boundscheck=False)
def _scalar(x: Any, value: float) -> Any:  # pragma: no cover - compiled
    """``value`` in ``x``'s dtype."""
    out = np.empty(1, x.dtype)
    out[0] = value
    return out[0]


@numba.njit(nogil=True, boundscheck=False)
def _block_mean(x: Any, mu: Any, j0: int, k: int, inv: Any
                ) -> None:  # pragma: no cover - compiled
    """``mu`` (``k`` long) := the mean over the samples of ``x``'s columns [j0, j0 + k): the sum
    times ``inv`` = 1/n in ``x``'s dtype (a division took a third longer; exact for n a power of
    two)."""
    row = x[0, j0 : j0 + k]
    for j in range(k):
        mu[j] = row[j]
    for b in range(1, x.shape[0]):
        row = x[b, j0 : j0 + k]
        for j in range(k):
            mu[j] += row[j]
    for j in range(k):
        mu[j] *= inv


@numba.njit(nogil=True, boundscheck=False)
def _moments(x: Any, mean: Any, m2: Any, step: int, seen: int
             ) -> None:  # pragma: no cover - compiled
    """``mean`` and ``m2`` := ``x``'s; with ``seen``, ``x``'s merged into those of ``seen``
    earlier samples (Chan's update, each block's own moments first: nothing cancels)."""
    n, m = x.shape
    own_mean, own_m2 = np.empty(step, x.dtype), np.empty(step, x.dtype)
    grow, cross, inv = n / (seen + n), seen * n / (seen + n), _scalar(x, 1.0 / n)
    for j0 in range(0, m, step):
        k = min(step, m - j0)
        at, sq = mean[j0 : j0 + k], m2[j0 : j0 + k]
        mu, q = (at, sq) if seen == 0 else (own_mean[:k], own_m2[:k])
        _block_mean(x, mu, j0, k, inv)
        q[:] = 0
        for b in range(n):
            row = x[b, j0 : j0 + k]
            for j in range(k):
                d = row[j] - mu[j]
                q[j] += d * d
        if seen > 0:
            for j in range(k):
                delta = mu[j] - at[j]
                at[j] += delta * grow
                sq[j] += q[j] + delta * delta * cross


# the sums over a block's columns may be reordered (vectorised), as torch's own reductions are
@numba.njit(nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _norms_and_dots(x: Any, mean: Any, out: Any, step: int) -> None:  # pragma: no cover
    n, m = x.shape
    zero, inv = _scalar(x, 0.0), _scalar(x, 1.0 / n)  # sums in the rows' dtype, as torch keeps
    out[:] = zero
    for j0 in range(0, m, step):
        k = min(step, m - j0)
        mu = mean[j0 : j0 + k]
        _block_mean(x, mu, j0, k, inv)
        for b in range(n):
            row = x[b, j0 : j0 + k]
            sq, dot = zero, zero
            for j in range(k):
                sq += row[j] * row[j]
                dot += row[j] * mu[j]
            out[b, 0] += sq
            out[b, 1] += dot


@numba.njit(nogil=True, boundscheck=False, fastmath={"reassoc", "contract"})
def _sums_and_dots(a: Any, b: Any, out: Any) -> None:  # pragma: no cover - compiled
    zero = _scalar(a, 0.0)
    for r in range(a.shape[0]):
        total, dot = zero, zero
        for k in range(a.shape[1]):
            total += a[r, k]
            dot += a[r, k] * b[r, k]
        out[r, 0] = total
        out[r, 1] = dot
