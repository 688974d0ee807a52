"""TensorSketch: count sketches of a matrix's two sides combined by circular convolution.

The sketch of a parameter seen as an ``[m, n]`` matrix ``M`` sends entry ``(o, j)`` to bucket
``(h_row(o) + h_col(j)) mod k`` with sign ``s_row(o) s_col(j)`` (Pham and Pagh's TensorSketch):
a count sketch of ``vec(M)`` whose hash factors over the two sides. Signs are independent
+-1, so ``E[<S x, S y>] = <x, y>`` (unbiased), and the variance stays of order ``1/k`` on the
rank-one terms ``g a^T`` a layer's gradient is made of, where a Kronecker product of Gaussians
(:mod:`service.strategies.projection`) pays order ``1/sqrt(k)``. Each side's hash is
``pos mod k`` for ``pos`` the first entries of a random permutation of ``k * ceil(side / k)``
slots: a side of at most k entries never puts two in one bucket, and a longer side fills every
bucket to at most ``ceil(side / k)``.

Groups. When a side is longer than k, two of its indices ``j, j'`` share a bucket, and with one
hash they share it in every row: the error ``|g|^2 (<C a, C a'> - <a, a'>)`` of the long side's
count sketch is paid once for the whole matrix, scaled by the other side's full norm. On a
rank-one term that doubles the variance of a dense projection (about ``4/k`` against ``2/k``
for a squared norm): the zoo simple-cnn's ``fc1`` (``[128, 9216]``, 96% of its gradient) at
k = 1024 had a worst pair 2.1x a dense projection's. So the short side's indices are split
into ``r = min(GROUPS, short side)`` random balanced groups, and each group meets its own
independent hash (and signs) of the long side: the shared error splits into r independent
parts, ``(2 + 2/r)/k``, and the worst pair falls to 1.4x a dense projection's (r = 2, 4 or 8
alike; r = 4 costs less than 8 and keeps more margin than 2: ``docs/attribution.md``). The
sketch stays one count sketch of ``vec(M)`` (entry ``(o, j)`` goes to ``h_row(o) +
h_col[group(o)](j)``), unbiased, and its layers' cost: scattering a built gradient is unchanged,
a transform per position does r of them. Sides of at most k entries keep ``r = 1``.

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
from functools import cached_property

import torch

TENSORSKETCH = "tensorsketch"
_CHUNK = 1 << 20  # entries of one scatter's index (8 MiB of int64)
GROUPS = 4  # r, the groups of the short side when the long side shares buckets
_FFT_BYTES = 64 << 20  # count sketches and spectra of one FFT chunk
_MAT_BYTES = 32 << 20  # per-sample gradients of one chunk built for the scatter
# Rough costs on our CPU (nanoseconds), to pick an evaluation: a multiply-add of a batched
# matmul, an entry scattered to a bucket, one unit of k log2 k of a real FFT, an entry copied.
_NS_MAC, _NS_SCATTER, _NS_FFT, _NS_COPY = 0.075, 4.0, 1.0, 0.5


@dataclass(frozen=True)
class Side:
    """The count sketches of one side of a matrix: ``copies`` hashes of its indices (one per
    group of the other side), or one hash and each index's ``group``."""

    k: int
    slots: int  # k * ceil(size / k)
    pos: torch.Tensor  # [copies, size] distinct slots in [0, slots) per copy; bucket = pos % k
    bucket: torch.Tensor  # [copies, size] int64
    sign: torch.Tensor  # [copies, size] +-1, float32
    group: torch.Tensor  # [size] int64: which copy of the other side's hash an index meets
    r: int  # the pair's number of groups (1: a plain TensorSketch)

    @property
    def copies(self) -> int:
        return int(self.pos.shape[0])

    @cached_property
    def sources(self) -> torch.Tensor:
        """``[r, slots // k, k]``: where each slot of each group's count sketch finds its entry
        in the signed entries ``[x * sign of copy 0, x * sign of copy 1, ..., 0]`` (the last, 0,
        for an empty slot), so that a sketch is one multiply of the entries and one gather:
        cheaper than filling zeros and scattering into them, or signing every slot."""
        copies, size = self.pos.shape
        index = torch.full((self.r * self.slots,), copies * size, dtype=torch.long,
                           device=self.pos.device)
        entry = torch.arange(copies * size, device=self.pos.device)
        if copies > 1:
            offset = torch.arange(copies, device=self.pos.device)[:, None] * self.slots
            index[(self.pos + offset).reshape(-1)] = entry
        else:
            index[self.pos[0] + self.group * self.slots] = entry
        return index.view(self.r, self.slots // self.k, self.k)

    def part(self, lo: int, hi: int) -> Side:
        """The indices [lo, hi) (one group's rows of a grouped convolution)."""
        return Side(self.k, self.slots, self.pos[:, lo:hi], self.bucket[:, lo:hi],
                    self.sign[:, lo:hi], self.group[lo:hi], self.r)

    def sketch(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., r, k]`` count sketches of ``x`` ``[..., size]``, one per group: each slot
        gathers its signed entry (slots are distinct), then the slots fold onto the buckets. A
        side with copies puts every entry in each copy's sketch; a grouped side puts each entry
        in its own group's only."""
        copies, size = self.pos.shape
        lead = x.shape[:-1]
        signed = x.new_empty((*lead, copies * size + 1))
        torch.mul(x.unsqueeze(-2), self.sign.to(x.dtype),
                  out=signed[..., :-1].view(*lead, copies, size))
        signed[..., -1] = 0
        index = self.sources
        got = signed.index_select(-1, index.reshape(-1)).view(*lead, *index.shape)
        return got.squeeze(-2) if index.shape[1] == 1 else got.sum(-2)


Pair = tuple[Side, Side]  # the rows' and the columns' count sketches of one TensorSketch


def draw(k: int, seed: int, name: str, shape: tuple[int, ...], device: torch.device) -> Pair:
    """The row and column sides of parameter ``name``'s TensorSketch, from (k, seed, name,
    shape) alone, on the CPU generator (the same in every process, batch and strategy).

    When one side is longer than k (its indices share buckets), the other side's indices are
    split into ``r = min(GROUPS, its length)`` random groups, each meeting its own hash of the
    long side: see the module's docstring for why. Otherwise ``r = 1``, one plain TensorSketch."""
    m, n = int(shape[0]), math.prod(shape[1:])
    digest = hashlib.sha256(repr((k, seed, name, tuple(shape), TENSORSKETCH)).encode())
    gen = torch.Generator().manual_seed(int.from_bytes(digest.digest()[:8], "little") >> 1)
    slots = {size: k * max(1, math.ceil(size / k)) for size in (m, n)}

    def hashes(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.randperm(slots[size], generator=gen)[:size]
        sign = torch.randint(0, 2, (size,), generator=gen).float().mul_(2).sub_(1)
        return pos, sign

    first = [hashes(m), hashes(n)]  # rows, columns: a plain TensorSketch's
    long_rows = m > n
    r = min(GROUPS, m, n) if max(m, n) > k else 1
    more = [hashes(m if long_rows else n) for _ in range(r - 1)]  # the long side's other hashes
    group = torch.randperm(min(m, n), generator=gen) % r  # the short side's groups

    def side(size: int, own: list[tuple[torch.Tensor, torch.Tensor]], grouped: bool) -> Side:
        pos, sign = torch.stack([p for p, _ in own]), torch.stack([s for _, s in own])
        mine = group if grouped else torch.zeros(size, dtype=torch.long)
        return Side(k, slots[size], pos.to(device), (pos % k).to(device), sign.to(device),
                    mine.to(device), r)

    rows = side(m, [first[0], *(more if long_rows else [])], grouped=not long_rows)
    cols = side(n, [first[1], *([] if long_rows else more)], grouped=long_rows)
    return rows, cols


def entries(rows: Side, cols: Side, which: torch.Tensor, signs: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(bucket + k or bucket, sign)`` of the entries ``(o, j)`` for the rows ``o`` in
    ``which`` (any shape ``S``) and every column ``j``: ``[*S, n]``, or broadcastable to it
    (``[*S, 1]`` and ``[n]``) while both sides have one hash. The bucket is left unreduced (the
    sum of the two sides', below 2k: an integer modulo costs more than folding the 2k sums onto
    k afterwards, :func:`fold`); the sign only when ``signs``."""
    rb = rows.bucket[:, which]  # [row copies, *S]
    rs = rows.sign[:, which] if signs else None
    if rows.copies > 1:  # the column's group picks the row's hash
        rb = rb[cols.group].movedim(0, -1)
        rs = rs[cols.group].movedim(0, -1) if rs is not None else None
    else:
        rb = rb[0, ..., None]
        rs = rs[0, ..., None] if rs is not None else None
    if cols.copies > 1:  # the row's group picks the column's hash
        group = rows.group[which]
        cb, cs = cols.bucket[group], cols.sign[group]
    else:
        cb, cs = cols.bucket[0], cols.sign[0]
    return rb + cb, rs * cs if rs is not None else None


def fold(wide: torch.Tensor, out: torch.Tensor) -> None:
    """Adds ``[b, 2k]`` sums by unreduced bucket to ``out`` ``[b, k]``."""
    k = out.shape[-1]
    out += wide[:, :k]
    out += wide[:, k:]


def scatter(rows: Side, cols: Side, grads: torch.Tensor, out: torch.Tensor,
            signed: bool = False) -> None:
    """Adds the sketches of materialised ``[b, m, n]`` matrices to ``out`` ``[b, k]``
    (``signed``: the entries already carry their signs)."""
    b, m, n = grads.shape
    step = max(1, _CHUNK // max(1, n))
    wide = out.new_zeros((b, 2 * rows.k))
    for lo in range(0, m, step):
        hi = min(m, lo + step)
        index, sign = entries(rows, cols, torch.arange(lo, hi, device=grads.device),
                              signs=not signed)
        part = grads[:, lo:hi]
        if sign is not None:
            part = part * sign.to(grads.dtype)
        wide.index_add_(1, index.expand(hi - lo, n).reshape(-1), part.reshape(b, -1))
    fold(wide, out)


def fft_is_cheaper(positions: int, p: int, d: int, k: int, r: int = 1) -> bool:
    """Whether a transform per position beats building the ``[p, d]`` gradient and scattering
    it (rough costs on our CPU; either gives the same sketch), for a pair of ``r`` groups."""
    build = positions * p * d * _NS_MAC + p * d * _NS_SCATTER
    fft = positions * r * (2 * k * math.log2(max(k, 2)) * _NS_FFT + (2 * k + d + p) * _NS_COPY)
    return fft < build


def outer(rows: Side, cols: Side, a: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> None:
    """Adds the sketches of ``sum_t g_t a_t^T`` per group to ``out`` ``[n, k]``, from ``a``
    ``[n, groups, T, d]`` and ``g`` ``[n, groups, T, p]`` (the weight the ``[groups * p, d]``
    matrix), by whichever evaluation :func:`fft_is_cheaper` picks."""
    n, groups, t, p = g.shape
    d = a.shape[-1]
    if fft_is_cheaper(t, p, d, rows.k, rows.r):
        _convolved(rows, cols, a, g, out)
        return
    # signs on the inputs and output gradients (fewer entries), where they factor (r = 1)
    early = rows.r == 1 and t * (d + p) < p * d
    col_sign, row_sign = cols.sign[0].to(g.dtype), rows.sign[0].to(g.dtype).view(groups, 1, p)
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
    """``irfft(sum_t sum_q rfft(C_q g_t) * rfft(C_q a_t))`` per sample (``q`` over the pair's
    groups), a chunk of terms at a time."""
    n, groups, t, p = g.shape
    k, d = rows.k, a.shape[-1]
    work = torch.float64 if g.dtype == torch.float64 else torch.float32  # what FFTs take
    # a term's spectra and, per side, its signed entries and gathered slots (a side with copies
    # holds every entry once per copy)
    per_term = (4 * k * rows.r + 2 * (rows.copies * p + cols.copies * d)) * torch.empty(
        (), dtype=work).element_size()
    terms = max(1, _FFT_BYTES // per_term)
    samples = max(1, terms // (groups * t))
    span = t if samples > 1 else max(1, terms // groups)  # positions of one chunk
    parts = [rows.part(q * p, (q + 1) * p) for q in range(groups)] if groups > 1 else [rows]
    for lo in range(0, n, samples):
        hi = min(n, lo + samples)
        spectrum: torch.Tensor | None = None
        for x in range(0, t, span):
            y = min(t, x + span)
            sa = cols.sketch(a[lo:hi, :, x:y].to(work))  # [c, groups, span, r, k]
            sg = (rows.sketch(g[lo:hi, :, x:y].to(work)) if groups == 1 else
                  torch.stack([part.sketch(g[lo:hi, q, x:y].to(work))
                               for q, part in enumerate(parts)], 1))
            part = (torch.fft.rfft(sa) * torch.fft.rfft(sg)).sum((1, 2, 3))
            spectrum = part if spectrum is None else spectrum + part
        assert spectrum is not None
        out[lo:hi] += torch.fft.irfft(spectrum, n=k).to(out.dtype)


def embedding_rows(rows: Side, cols: Side, ids: torch.Tensor, g: torch.Tensor,
                   out: torch.Tensor) -> None:
    """Adds the sketches of ``sum_t e_{ids_t} g_t^T`` (an embedding table's per-sample
    gradient, row ``ids[i, t]`` getting ``g[i, t]``) to ``out`` ``[n, k]``."""
    n, t, dim = g.shape
    step = max(1, _CHUNK // max(1, t * dim))
    wide = out.new_zeros((n, 2 * rows.k))
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        ids_ = ids[lo:hi]
        index, sign = entries(rows, cols, ids_)  # [c, T, dim], or [c, T, 1] and [dim]
        assert sign is not None
        wide[lo:hi].scatter_add_(1, index.expand(hi - lo, t, dim).reshape(hi - lo, -1),
                                 (g[lo:hi] * sign.to(g.dtype)).reshape(hi - lo, -1))
    fold(wide, out)
