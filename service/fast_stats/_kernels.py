"""Fused CPU loops for the passes over per-sample gradients and activations.

torch's eager operations read a tensor once per operation: a piece's mean over the samples, its
squared deviations (written) and their sum are three passes, about 1 ns per element on a 2-core
Xeon, as long again as the batched matmul that built the piece. One loop over blocks of the
piece's columns small enough to stay in the L1 cache reads each element twice from there and
writes none: about four times faster (``benchmarks/pieces.py --loops fused,eager``). A batch
norm's per-sample sums and dots over positions likewise take one read. Numba compiles each loop
for each dtype it meets (about a second per dtype): a CPU worker does it for float32 and bfloat16
as it starts (:func:`warm_up`), other dtypes at their first use, and keeps the machine code in
:data:`CACHE` for the next process on this host, which reads it back in a tenth of the time
(:func:`cache_folder`). numba has no bfloat16 or float16:
their pieces go through the float32 loops a slab of columns at a time (:func:`_slabs`, copied
to float32, :data:`SLAB_BYTES` each), the results rounded back to the piece's dtype, except
that the moments' and the norms-and-dots' loops take a bfloat16 piece's bits as they are and
widen each block in cache (:func:`_block`); torch's eager operations on them ran 1.7 to 2.6
times as long as the slabs (``benchmarks/pieces.py --dtype bfloat16``), and rounded every
deviation to the narrow dtype. On an accelerator (whose eager kernels are bandwidth-bound and
fast), and for any other dtype or layout, the eager operations run.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba.core.caching import FunctionCache

from service.fast_stats._tuning import TUNING
from service.strategies.base import squared_norms

NARROW = (torch.bfloat16, torch.float16)  # float dtypes the loops (and the plan check) widen
SLAB_BYTES = 4 << 20  # the float32 copy of one slab of a narrow piece's columns, every sample's
log = logging.getLogger("psgrad.loops")


def cache_folder() -> Path | None:
    """Where the compiled loops are kept between processes: ``$XDG_CACHE_HOME/psgrad/loops``
    (by default ``~/.cache/psgrad/loops``), made owner-only; None where it cannot be made or
    someone else may write to it (the loops are then compiled in each process). numba reads
    its cache back with pickle, so only a folder of this host that this user alone writes is
    read: never the data directory, which other hosts share, nor anything from Redis."""
    try:
        base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
        folder = Path(base) / "psgrad" / "loops"
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        status = folder.stat()
    except (OSError, RuntimeError) as exc:  # RuntimeError: no home folder to be found
        log.warning("compiled loops are not kept between processes: %s", exc)
        return None
    if status.st_uid != os.getuid() or status.st_mode & 0o022:
        log.warning("compiled loops are not kept between processes: %s may be written by "
                    "another user (make it yours, mode 700)", folder)
        return None
    return folder


CACHE = cache_folder()


class _Kept(FunctionCache):
    """numba's cache of one loop, where an entry that does not load (a torn file, another
    numba's) is a miss: the loop's index is cleared and the loop compiled and kept afresh; and
    where keeping fails, the loop runs compiled all the same."""

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        try:
            return super().load_overload(sig, target_context)
        except Exception as exc:  # whatever unpickling a torn file raises
            log.warning("a kept compiled loop did not load (%r): compiling it again", exc)
            with contextlib.suppress(Exception):
                self.flush()
            return None

    def save_overload(self, sig: Any, data: Any) -> None:
        try:
            super().save_overload(sig, data)
        except Exception as exc:
            log.warning("compiled loops are not kept between processes: %r", exc)


def _loop(**options: Any) -> Callable[[Callable[..., Any]], Any]:
    """``numba.njit`` with the GIL released and no bounds checks, the machine code kept in
    :data:`CACHE` and read from there alone (numba's own fallbacks, such as a ``__pycache__``
    beside the source, never)."""
    def compiled(func: Callable[..., Any]) -> Any:
        loop = numba.njit(nogil=True, boundscheck=False, **options)(func)
        if CACHE is None:
            return loop
        config: Any = numba.config  # its settings are made at run time: no types
        kept = config.CACHE_DIR, config.CACHE_LOCATOR_CLASSES
        config.CACHE_DIR, config.CACHE_LOCATOR_CLASSES = str(CACHE), "UserProvidedCacheLocator"
        try:  # what njit(cache=True) does (enable_caching), with this folder and class
            loop._cache = _Kept(loop.py_func)
        except RuntimeError as exc:  # the folder went away or became unwritable since
            log.warning("compiled loops are not kept between processes: %s", exc)
        finally:
            config.CACHE_DIR, config.CACHE_LOCATOR_CLASSES = kept
        return loop
    return compiled


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
    fused = _fused(rows, mean, m2)
    if fused is None:
        return False
    if not fused:
        _moments(_flat(rows, len(rows)), _flat(mean), _flat(m2), _step(rows), seen)
        return True
    for (x, mu, q), write in _slabs(rows, mean, m2, read=seen > 0, bits=True):
        _moments(x, mu[0], q[0], _step(x), seen)
        write(mean, mu)
        write(m2, q)
    return True


def norms_and_mean_dots(rows: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """Each sample's squared norm and dot product with the samples' mean, ``[n, 2]``, for
    ``rows`` ``[n, *shape]``; the mean is written into ``mean`` (``shape``)."""
    n = rows.shape[0]
    fused = _fused(rows, mean)
    if fused is False:
        out = rows.new_empty((n, 2))
        _norms_and_dots(_flat(rows, n), _flat(mean), out.numpy(), _step(rows))
        return out
    if fused:
        total, part = np.zeros((n, 2), np.float32), np.empty((n, 2), np.float32)
        for (x, at), write in _slabs(rows, mean, read=False, bits=True):
            _norms_and_dots(x, at[0], part, _step(x))
            total += part
            write(mean, at)
        return torch.from_numpy(total).to(rows.dtype)
    flat = rows.reshape(n, -1)
    mu = torch.mean(rows, 0, out=mean).reshape(-1)
    return torch.stack((squared_norms(flat), flat @ mu), 1)


def sums_and_dots(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Each row's sum of ``a`` ``[R, K]`` written into ``out[:, 0]`` (``out`` ``[R, 2]``), and
    each row's dot product with ``b``'s row answered ``[R]`` (fused: written into ``out[:, 1]``
    in the same read of ``a``; eager: one batched matmul, one kernel on an accelerator, which
    ran 1.5 to 3.5 times slower than a product and a sum on a Xeon's CPU)."""
    fused = _fused(a, b, out)
    if fused is False:
        _sums_and_dots(_flat(a, len(a)), _flat(b, len(b)), out.numpy())
        return out[:, 1]
    if fused:
        total, part = np.zeros((len(a), 2), np.float32), np.empty((len(a), 2), np.float32)
        for (x, y), _ in _slabs(a, b):
            _sums_and_dots(x, y, part)
            total += part
        out.copy_(torch.from_numpy(total))
        return out[:, 1]
    torch.sum(a, 1, out=out[:, 0])
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


def warm_up(dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)) -> None:
    """Compile every loop for ``dtypes`` now, as the calls compile them (the same argument
    types), so that a worker's first request does not: ResNet-18's first check spent 1.0 s of
    its 1.6 s compiling the batch norm's loop. CPU workers call this when they start (1.5 s for
    float32 alone, 2.8 s with bfloat16's bits, on a 2-core Xeon; 0.3 s where an earlier
    process of the host kept them in :data:`CACHE`)."""
    for dtype in dtypes:
        rows, mean, m2 = torch.ones(2, 3, dtype=dtype), torch.zeros(3, dtype=dtype), \
            torch.zeros(3, dtype=dtype)
        merged_into(rows, mean, m2, 0)
        norms_and_mean_dots(rows, mean)
        sums_and_dots(rows, rows, torch.zeros(2, 2, dtype=dtype))


def _fused(*tensors: torch.Tensor) -> bool | None:
    """How the loops take ``tensors``: False as they are (float32, float64), True a slab at a
    time in float32 (:data:`NARROW`), None not at all (the eager operations): off, another
    device, dtype or layout, or mixed dtypes."""
    dtype = tensors[0].dtype
    if not TUNING.fused or not all(
            t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() and t.numel() > 0
            for t in tensors):
        return None
    return True if dtype in NARROW else False if dtype in (torch.float32, torch.float64) else None


WriteBack = Callable[[torch.Tensor, np.ndarray], None]


def _slabs(rows: torch.Tensor, *more: torch.Tensor, read: bool = True, bits: bool = False
           ) -> Iterator[tuple[list[np.ndarray], WriteBack]]:
    """The same columns of ``rows`` ``[n, *shape]`` and of each of ``more`` (``shape``, or
    ``[n, *shape]``), :data:`SLAB_BYTES` of ``rows``' at a time, as float32 arrays ``[n, k]``
    and ``[1, k]`` (copies; ``more``'s left unset unless ``read``: outputs the loop only
    writes, whose copy took a sixth of a bfloat16 piece's moments); with each slab, how to
    write a float32 array of its columns back into a tensor of ``more`` (rounded to its
    dtype). With ``bits``, bfloat16 ``rows`` come whole as their bits (uint16, no copy: one
    slab), for a loop that widens each block in cache (:func:`_block`; the copy to float32 took
    as long as the loop, and a slab's columns, strided, ran the widening unvectorised)."""
    n = len(rows)
    views = [t.detach().view(len(t) if t.dim() == rows.dim() else 1, -1) for t in (rows, *more)]
    bits = bits and rows.dtype == torch.bfloat16
    width = views[0].shape[1] if bits else max(256, SLAB_BYTES // (4 * n))
    for start in range(0, views[0].shape[1], width):
        cols = slice(start, start + width)

        def write(t: torch.Tensor, got: np.ndarray, cols: slice = cols) -> None:
            t.view(1, -1)[:, cols] = torch.from_numpy(got)

        first = (views[0].view(torch.int16).numpy().view(np.uint16) if bits
                 else views[0][:, cols].float().numpy())
        yield [first, *(v[:, cols].float().numpy() if read
                        else np.empty((len(v), first.shape[1]), np.float32)
                        for v in views[1:])], write


def _flat(t: torch.Tensor, rows: int | None = None) -> np.ndarray:
    """``t``'s memory as an array: ``[rows, -]``, or one dimension (no copy: ``t`` is
    contiguous)."""
    return t.detach().view(-1 if rows is None else (rows, -1)).numpy()


def _step(rows: torch.Tensor | np.ndarray) -> int:
    """Columns per block: every sample's share of ``TUNING.block_bytes`` (as float32 at least:
    bfloat16's bits are widened a block at a time), at least 256."""
    size = rows.element_size() if isinstance(rows, torch.Tensor) else rows.itemsize
    return max(256, TUNING.block_bytes // (rows.shape[0] * max(4, size)))


@_loop()
def _scalar(x: Any, value: float) -> Any:  # pragma: no cover - compiled
    """``value`` in ``x``'s dtype."""
    out = np.empty(1, x.dtype)
    out[0] = value
    return out[0]


def _block(x: Any, j0: int, k: int, scratch: Any) -> Any:  # pragma: no cover - compiled
    """Where columns [j0, j0 + k) of ``x`` ``[n, m]`` are to be read, as (array, first
    column): ``x`` itself, or for bfloat16's bits (uint16) their float32 values written into
    ``scratch`` ``[n, >= k]`` from column 0 (a block stays in the L1 cache: 0.05 ms per million
    elements, where torch's copy to float32 in memory took 0.23). Rows are read as
    ``array[b, c0 : c0 + k]``, contiguous where the array is (a 2-D view of the block was not,
    and its loops ran 3.5 times slower)."""
    raise NotImplementedError("compiled through its overload")


@numba.extending.overload(_block, jit_options={"nogil": True})
def _block_typed(x, j0, k, scratch):  # pragma: no cover
    # (numba matches an overload's argument names to its implementation's: no annotations)
    if x.dtype != numba.types.uint16:
        def as_is(x, j0, k, scratch):
            return x, j0

        return as_is

    def widened(x, j0, k, scratch):
        out = scratch.view(np.uint32)
        for b in range(x.shape[0]):
            src, dst = x[b, j0 : j0 + k], out[b]
            for j in range(k):
                dst[j] = np.uint32(src[j]) << np.uint32(16)  # bfloat16: float32's top half
        return scratch, 0

    return widened


@_loop()
def _block_mean(x: Any, mu: Any, j0: int, k: int, inv: Any
                ) -> None:  # pragma: no cover - compiled
    """``mu`` (``k`` long) := the mean over the samples of ``x``'s columns [j0, j0 + k): the sum
    times ``inv`` = 1/n in ``mu``'s dtype (a division took a third longer; exact for n a power
    of two)."""
    row = x[0, j0 : j0 + k]
    for j in range(k):
        mu[j] = row[j]
    for b in range(1, x.shape[0]):
        row = x[b, j0 : j0 + k]
        for j in range(k):
            mu[j] += row[j]
    for j in range(k):
        mu[j] *= inv


@_loop()
def _moments(x: Any, mean: Any, m2: Any, step: int, seen: int
             ) -> None:  # pragma: no cover - compiled
    """``mean`` and ``m2`` := ``x``'s; with ``seen``, ``x``'s merged into those of ``seen``
    earlier samples (Chan's update, each block's own moments first: nothing cancels)."""
    n, m = x.shape
    own_mean, own_m2 = np.empty(step, mean.dtype), np.empty(step, mean.dtype)
    scratch = np.empty((n, step), mean.dtype)
    grow, cross, inv = n / (seen + n), seen * n / (seen + n), _scalar(mean, 1.0 / n)
    for j0 in range(0, m, step):
        k = min(step, m - j0)
        at, sq = mean[j0 : j0 + k], m2[j0 : j0 + k]
        mu, q = (at, sq) if seen == 0 else (own_mean[:k], own_m2[:k])
        rows, c0 = _block(x, j0, k, scratch)
        _block_mean(rows, mu, c0, k, inv)
        q[:] = 0
        for b in range(n):
            row = rows[b, c0 : c0 + k]
            for j in range(k):
                d = row[j] - mu[j]
                q[j] += d * d
        if seen > 0:
            for j in range(k):
                delta = mu[j] - at[j]
                at[j] += delta * grow
                sq[j] += q[j] + delta * delta * cross


# the sums over a block's columns may be reordered (vectorised), as torch's own reductions are
@_loop(fastmath={"reassoc", "contract"})
def _norms_and_dots(x: Any, mean: Any, out: Any, step: int) -> None:  # pragma: no cover
    n, m = x.shape
    zero, inv = _scalar(mean, 0.0), _scalar(mean, 1.0 / n)  # sums in the mean's dtype (the
    out[:] = zero  # rows', or float32 for bfloat16's bits), as torch keeps
    scratch = np.empty((n, step), mean.dtype)
    for j0 in range(0, m, step):
        k = min(step, m - j0)
        mu = mean[j0 : j0 + k]
        rows, c0 = _block(x, j0, k, scratch)
        _block_mean(rows, mu, c0, k, inv)
        for b in range(n):
            row = rows[b, c0 : c0 + k]
            sq, dot = zero, zero
            for j in range(k):
                sq += row[j] * row[j]
                dot += row[j] * mu[j]
            out[b, 0] += sq
            out[b, 1] += dot


@_loop(fastmath={"reassoc", "contract"})
def _sums_and_dots(a: Any, b: Any, out: Any) -> None:  # pragma: no cover - compiled
    zero = _scalar(a, 0.0)
    for r in range(a.shape[0]):
        total, dot = zero, zero
        for k in range(a.shape[1]):
            total += a[r, k]
            dot += a[r, k] * b[r, k]
        out[r, 0] = total
        out[r, 1] = dot
