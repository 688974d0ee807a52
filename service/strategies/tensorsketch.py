"""TensorSketch: count sketches of a matrix's two sides combined by circular convolution.

The sketch of a parameter seen as an ``[m, n]`` matrix ``M`` sends entry ``(o, j)`` to bucket
``(h_row(o) + h_col(j)) mod k`` with sign ``s_row(o) s_col(j)`` (Pham and Pagh's TensorSketch):
a count sketch of ``vec(M)`` whose hash factors over the two sides. Signs are independent
+-1, so ``E[<S x, S y>] = <x, y>`` (unbiased), and the variance stays of order ``1/k`` on the
rank-one terms ``g a^T`` a layer's gradient is made of, where a Kronecker product of Gaussians
(:mod:`service.strategies.projection`) pays order ``1/sqrt(k)``. Each side's hash is
``pos mod k`` for ``pos`` the first entries of a random permutation of ``k * ceil(side / k)``
slots: a side of at most k entries never puts two in one bucket (no two rows or columns of a
gradient collide whole, the term that makes a plain TensorSketch's worst pair twice as bad),
and a longer side fills every bucket to at most ``ceil(side / k)``.

Because the hash factors, one linear map has three evaluations, and every strategy picks the
cheapest for what it holds (the same sketch up to rounding):

- materialised per-sample gradients: one scatter of their entries into the k buckets;
- a layer's ``sum_t g_t a_t^T`` (Linear, Conv): the sketch of a rank-one term is the circular
  convolution of the count sketches of ``g_t`` and ``a_t``, so per sample ``irfft(sum_t
  rfft(C g_t) * rfft(C a_t))``: ``O(d + p + k log k)`` per term, no gradient built. Where a
  layer has many positions and a small matrix (a convolution, a small transformer's
  projections), building ``G_i^T A_i`` a chunk of samples at a time and scattering it is
  cheaper than a transform per position, and is taken instead (:func:`fft_is_cheaper`);
- an embedding's rows ``sum_t e_{id_t} g_t^T``: each row's entries scattered to their buckets.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

TENSORSKETCH = "tensorsketch"
_CHUNK = 1 << 20  # entries of one scatter's index (8 MiB of int64)
_FFT_BYTES = 64 << 20  # count sketches and spectra of one FFT chunk
_MAT_BYTES = 32 << 20  # per-sample gradients of one chunk built for the scatter
# Rough costs on our CPU (nanoseconds), to pick an evaluation: a multiply-add of a batched
# matmul, an entry scattered to a bucket, one unit of k log2 k of a real FFT, an entry copied.
_NS_MAC, _NS_SCATTER, _NS_FFT, _NS_COPY = 0.075, 4.0, 1.0, 0.5


@dataclass(frozen=True)
class Side:
    """The count sketch of one side of a matrix: each index's bucket and sign."""

    k: int
    slots: int  # k * ceil(size / k)
    pos: torch.Tensor  # [size] distinct slots in [0, slots); bucket = pos % k
    bucket: torch.Tensor  # [size] int64
    sign: torch.Tensor  # [size] +-1, float32

    def part(self, lo: int, hi: int) -> Side:
        """The indices [lo, hi) (one group's rows of a grouped convolution)."""
        return Side(self.k, self.slots, self.pos[lo:hi], self.bucket[lo:hi], self.sign[lo:hi])

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., k]`` count sketches of ``x`` ``[..., size]``: each entry placed in its own
        slot (no accumulation: slots are distinct), then the slots folded onto the buckets."""
        buf = x.new_zeros((*x.shape[:-1], self.slots))
        buf.index_copy_(-1, self.pos, x * self.sign.to(x.dtype))
        if self.slots == self.k:
            return buf
        return buf.view(*x.shape[:-1], self.slots // self.k, self.k).sum(-2)


Pair = tuple[Side, Side]  # the rows' and the columns' count sketches of one TensorSketch


def draw(k: int, seed: int, name: str, shape: tuple[int, ...], device: torch.device) -> Pair:
    """The row and column sides of parameter ``name``'s TensorSketch, from (k, seed, name,
    shape) alone, on the CPU generator (the same in every process, batch and strategy).

    One sketch, not a sum of independent ones: summing 2 or 4 TensorSketches (each scaled
    ``1/sqrt(copies)``) left the zoo's worst pairs where they were (within the spread over
    seeds) at 2 or 4 times the cost."""
    m, n = int(shape[0]), math.prod(shape[1:])
    digest = hashlib.sha256(repr((k, seed, name, tuple(shape), TENSORSKETCH)).encode())
    gen = torch.Generator().manual_seed(int.from_bytes(digest.digest()[:8], "little") >> 1)

    def side(size: int) -> Side:
        slots = k * max(1, math.ceil(size / k))
        pos = torch.randperm(slots, generator=gen)[:size]
        sign = torch.randint(0, 2, (size,), generator=gen).float().mul_(2).sub_(1)
        return Side(k, slots, pos.to(device), (pos % k).to(device), sign.to(device))

    rows = side(m)
    return rows, side(n)


def scatter(rows: Side, cols: Side, grads: torch.Tensor, out: torch.Tensor,
            signed: bool = False) -> None:
    """Adds the sketches of materialised ``[b, m, n]`` matrices to ``out`` ``[b, k]``
    (``signed``: the entries already carry their signs)."""
    b, m, n = grads.shape
    step = max(1, _CHUNK // max(1, n))
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        index = (rows.bucket[lo:hi, None] + cols.bucket[None, :]) % rows.k
        part = grads[:, lo:hi]
        if not signed:
            part = part * (rows.sign[lo:hi, None] * cols.sign[None, :]).to(grads.dtype)
        out.index_add_(1, index.reshape(-1), part.reshape(b, -1))


def fft_is_cheaper(positions: int, p: int, d: int, k: int) -> bool:
    """Whether a transform per position beats building the ``[p, d]`` gradient and scattering
    it (rough costs on our CPU; either gives the same sketch)."""
    build = positions * p * d * _NS_MAC + p * d * _NS_SCATTER
    fft = positions * (2 * k * math.log2(max(k, 2)) * _NS_FFT + (2 * k + d + p) * _NS_COPY)
    return fft < build


def outer(rows: Side, cols: Side, a: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> None:
    """Adds the sketches of ``sum_t g_t a_t^T`` per group to ``out`` ``[n, k]``, from ``a``
    ``[n, groups, T, d]`` and ``g`` ``[n, groups, T, p]`` (the weight the ``[groups * p, d]``
    matrix), by whichever evaluation :func:`fft_is_cheaper` picks."""
    n, groups, t, p = g.shape
    d = a.shape[-1]
    if fft_is_cheaper(t, p, d, rows.k):
        _convolved(rows, cols, a, g, out)
        return
    early = t * (d + p) < p * d  # signs on the inputs and output gradients: fewer entries
    col_sign, row_sign = cols.sign.to(g.dtype), rows.sign.to(g.dtype).view(groups, 1, p)
    step = max(1, _MAT_BYTES // (groups * p * d * g.element_size()))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        ga, aa = g[lo:hi], a[lo:hi].to(g.dtype)
        if early:
            ga, aa = ga * row_sign, aa * col_sign
        built = (ga.transpose(-1, -2) @ aa).reshape(hi - lo, -1, d)
        scatter(rows, cols, built, out[lo:hi], signed=early)


def _convolved(rows: Side, cols: Side, a: torch.Tensor, g: torch.Tensor,
               out: torch.Tensor) -> None:
    """``irfft(sum_t rfft(C g_t) * rfft(C a_t))`` per sample, a chunk of terms at a time."""
    n, groups, t, p = g.shape
    k = rows.k
    work = torch.float64 if g.dtype == torch.float64 else torch.float32  # what FFTs take
    per_term = 4 * k * torch.empty((), dtype=work).element_size()
    terms = max(1, _FFT_BYTES // per_term)
    samples = max(1, terms // (groups * t))
    span = t if samples > 1 else max(1, terms // groups)  # positions of one chunk
    for lo in range(0, n, samples):
        hi = min(n, lo + samples)
        spectrum: torch.Tensor | None = None
        for x in range(0, t, span):
            y = min(t, x + span)
            sa = cols.sketch(a[lo:hi, :, x:y].to(work))  # [c, groups, span, k]
            sg = torch.stack([rows.part(q * p, (q + 1) * p).sketch(g[lo:hi, q, x:y].to(work))
                              for q in range(groups)], 1)
            part = (torch.fft.rfft(sa) * torch.fft.rfft(sg)).sum((1, 2))
            spectrum = part if spectrum is None else spectrum + part
        assert spectrum is not None
        out[lo:hi] += torch.fft.irfft(spectrum, n=k).to(out.dtype)


def embedding_rows(rows: Side, cols: Side, ids: torch.Tensor, g: torch.Tensor,
                   out: torch.Tensor) -> None:
    """Adds the sketches of ``sum_t e_{ids_t} g_t^T`` (an embedding table's per-sample
    gradient, row ``ids[i, t]`` getting ``g[i, t]``) to ``out`` ``[n, k]``."""
    n, t, dim = g.shape
    step = max(1, _CHUNK // max(1, t * dim))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        ids_ = ids[lo:hi]
        index = (rows.bucket[ids_][..., None] + cols.bucket) % rows.k  # [c, T, dim]
        sign = (rows.sign[ids_][..., None] * cols.sign).to(g.dtype)
        out[lo:hi].scatter_add_(1, index.reshape(hi - lo, -1),
                                (g[lo:hi] * sign).reshape(hi - lo, -1))
