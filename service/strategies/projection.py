"""Random projections of per-sample gradients (Johnson-Lindenstrauss sketches), defined once.

A sketch is ``P g`` in ``k`` dimensions, ``P`` a random matrix with independent N(0, 1) entries
scaled by ``1/sqrt(k)``, so ``E[<P g, P h>] = <g, h>``. The sketch of a gradient over several
parameters is the sum of each parameter's sketch (the concatenated gradient times the side by
side blocks ``[P_1 | P_2 | ...]``). Each parameter's block is drawn from a seed derived from
(``seed``, ``k``, the parameter's name and shape) alone, on the CPU generator, so any request,
batch size, worker, process or weights of the same architecture give comparable sketches.

Which matrix a parameter gets depends on the projection's ``kind`` and the parameter's shape
only, so that every strategy applies the same. Parameters of two or more dimensions get the
kind's matrix, ``tensorsketch`` (the default) or ``kronecker``; one-dimensional ones (biases,
norms' scales) a TensorSketch of their ``[numel, 1]`` matrix (a count sketch: exact up to k
entries, against a dense Gaussian's 2/k relative variance, and O(numel) where a dense matrix
is k x numel: GPT-2 small's biases alone drew 2 GiB of Gaussians per call at k = 4096) under
``tensorsketch``, a dense one under ``kronecker``; scalars a dense one:

- ``tensorsketch`` (:mod:`service.strategies.tensorsketch`): the count sketch of the
  ``[shape[0], prod(shape[1:])]`` matrix with a hash that factors over its rows and columns,
  so a layer's ``sum_t g_t a_t^T`` is sketched from ``g_t`` and ``a_t`` by FFTs (the short
  side in groups where the long side shares buckets). Unbiased, with a variance of order
  ``1/k`` like a dense sketch's: on the zoo's mlp, simple-cnn and tiny-transformer its worst
  pairwise inner-product error is within 2x a dense Gaussian projection's of the same k
  (1.1-1.5x, the worst of 8 seeds at k = 1024 and 2048; ``tests/unit/test_sketch_quality.py``,
  ``benchmarks/sketch_quality.py``).
- ``kronecker`` (parameters of two or more dimensions, seen as a matrix ``[m, n]`` =
  ``[shape[0], prod(shape[1:])]``: a Linear weight, a convolution's ``[out, in/groups *
  kernel]``, an embedding table): ``P = P_out (x) P_in`` with ``k = k_out * k_in`` (``k_out`` the
  largest divisor of k up to sqrt(k)); the sketch of a gradient ``G`` is ``P_out G P_in^T``
  flattened (LoGra's structure). For a layer whose per-sample gradient is ``sum_t g_t a_t^T``
  this is ``sum_t (P_out g_t) (x) (P_in a_t)``: two small GEMMs, no per-sample gradient.
  Guarantee: unbiased (``E[<Pg, Ph>] = <g, h>``); the relative variance of a squared norm is at
  most ``(1 + 2/k_out)(1 + 2/k_in) - 1`` (reached by rank-one gradients, e.g. a Linear layer at
  one position; about ``4/sqrt(k)``), against ``2/k`` for a dense sketch: the zoo mlp's worst
  pair error at k = 2048 is 0.52 against 0.065 dense. Kept for sketches made with it.
- ``dense`` (scalars; under ``kronecker`` also biases and norms' scales): a Gaussian
  ``[k, numel]``, the classic JL
  guarantee (relative variance ``2/k``), generated a 4 MiB block of columns at a time (each
  block from its own seed), never held whole.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from psgrad._contract import MAX_PROJECTION_DIM, PROJECTION_KINDS
from service.lru import LockedLRU
from service.strategies import tensorsketch
from service.strategies.tensorsketch import TENSORSKETCH, Pair

KRONECKER = "kronecker"
DENSE = "dense"
assert (TENSORSKETCH, KRONECKER) == PROJECTION_KINDS
KINDS = PROJECTION_KINDS  # what ``projection_kind`` names (the contract); the first is the default
# Each kind's definition of its numbers, bumped when they change: stores and reference sets
# record it and refuse sketches of another (tensorsketch 1: one hash per side, before groups)
VERSIONS = {TENSORSKETCH: 2, KRONECKER: 1}
MAX_DIM = MAX_PROJECTION_DIM
_BLOCK_BYTES = 4 << 20  # one dense block of a projection matrix, float32
_GROUP_BYTES = 16 << 20  # one side-by-side matrix of small dense projections
# Matrices drawn, kept for the next call of the same model: at most 512 MiB of them (at k = 8192
# one dense block is 4 MiB and one side-by-side matrix 16 MiB)
_FACTORS: LockedLRU[tuple[object, ...], torch.Tensor] = LockedLRU(
    256, budget=512 << 20, weigh=lambda t: t.element_size() * t.nelement())
_SIDES: LockedLRU[tuple[object, ...], Pair] = LockedLRU(
    256, budget=256 << 20, weigh=lambda pair: sum(
        t.element_size() * t.nelement() for side in pair
        for t in (side.pos, side.bucket, side.sign)))


@dataclass(frozen=True)
class Projection:
    """The projection of a request: ``k`` dimensions drawn from ``seed``, of ``kind``."""

    k: int
    seed: int = 0
    kind: str = TENSORSKETCH

    def __post_init__(self) -> None:
        assert self.kind in KINDS, f"unknown projection kind {self.kind!r}"

    @property
    def split(self) -> tuple[int, int]:
        """``(k_out, k_in)`` of the Kronecker factors: the largest divisor of k up to sqrt(k)."""
        k_out = next(d for d in range(math.isqrt(self.k), 0, -1) if self.k % d == 0)
        return k_out, self.k // k_out

    def factor(self, name: str, shape: torch.Size | tuple[int, ...], part: str, rows: int,
               cols: int, like: torch.Tensor) -> torch.Tensor:
        """A ``[rows, cols]`` Gaussian block scaled by ``1/sqrt(rows)``, in ``like``'s dtype and
        device; cached (up to 512 MiB in all), since a model's factors repeat on every call."""
        key = (self.k, self.seed, name, tuple(shape), part, rows, cols, like.dtype, like.device)
        return _FACTORS.get_or_make(key, lambda: self._draw(name, shape, part, rows, cols, like))

    def _draw(self, name: str, shape: torch.Size | tuple[int, ...], part: str, rows: int,
              cols: int, like: torch.Tensor) -> torch.Tensor:
        """The block itself, from a seed derived from (seed, k, name, shape, part) alone."""
        digest = hashlib.sha256(repr((self.k, self.seed, name, tuple(shape), part)).encode())
        gen = torch.Generator().manual_seed(int.from_bytes(digest.digest()[:8], "little") >> 1)
        block = torch.randn(rows, cols, generator=gen, dtype=torch.float32)
        return (block / math.sqrt(rows)).to(like.device, like.dtype)

    def kronecker(self, name: str, shape: torch.Size | tuple[int, ...], like: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(P_out [k_out, m], P_in [k_in, n])`` of a parameter seen as an ``[m, n]`` matrix."""
        m, n = matrix_shape(shape)
        k_out, k_in = self.split
        return (self.factor(name, shape, "out", k_out, m, like),
                self.factor(name, shape, "in", k_in, n, like))

    def sides(self, name: str, shape: torch.Size | tuple[int, ...], like: torch.Tensor
              ) -> Pair:
        """The row and column count sketches of a parameter's TensorSketch; cached."""
        key = (self.k, self.seed, name, tuple(shape), like.device)
        return _SIDES.get_or_make(key, lambda: tensorsketch.draw(
            self.k, self.seed, name, tuple(shape), like.device))

    def dense_blocks(self, name: str, shape: torch.Size | tuple[int, ...], like: torch.Tensor
                     ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """``(start, stop, P[:, start:stop])`` over the columns of a dense projection."""
        for start, stop in self._columns(shape):
            yield start, stop, self.factor(name, shape, f"dense{start}", self.k, stop - start,
                                           like)

    def _columns(self, shape: torch.Size | tuple[int, ...]) -> Iterator[tuple[int, int]]:
        """The column ranges of a dense projection's blocks (4 MiB of float32 each)."""
        numel = math.prod(shape)
        step = max(1, _BLOCK_BYTES // (4 * self.k))
        for start in range(0, numel, step):
            yield start, min(numel, start + step)

    def side_by_side(self, members: Sequence[tuple[str, torch.Size | tuple[int, ...]]],
                     like: torch.Tensor) -> torch.Tensor:
        """``[k, sum of numels]``: the dense projections of several parameters side by side,
        block for block the matrices :meth:`dense_blocks` gives, so that their sketches are one
        GEMM of the gradients side by side; cached as one matrix (its blocks are not)."""
        key = (self.k, self.seed, "side by side", tuple((k, tuple(s)) for k, s in members),
               like.dtype, like.device)

        def make() -> torch.Tensor:
            return torch.cat([self._draw(name, shape, f"dense{a}", self.k, b - a, like)
                              for name, shape in members for a, b in self._columns(shape)], 1)

        return _FACTORS.get_or_make(key, make)

    def project(self, name: str, grads: torch.Tensor) -> torch.Tensor:
        """``[n, k]`` sketches of materialised per-sample gradients ``[n, *shape]``."""
        out = grads.new_zeros((grads.shape[0], self.k))
        self.project_into(name, grads, out)
        return out

    def project_into(self, name: str, grads: torch.Tensor, out: torch.Tensor) -> None:
        """Adds the sketches of materialised per-sample gradients ``[n, *shape]`` to ``out``
        ``[n, k]`` (contiguous), in ``out``'s dtype (a model of mixed dtypes has parameters in
        others)."""
        grads = grads.to(out.dtype)
        n, shape = grads.shape[0], grads.shape[1:]
        kind = kind_of(shape, self.kind)
        if kind == TENSORSKETCH:
            rows, cols = self.sides(name, shape, grads)
            tensorsketch.scatter(rows, cols, grads.reshape(n, *matrix_shape(shape)), out)
            return
        if kind == KRONECKER:
            p_out, p_in = self.kronecker(name, shape, grads)
            mat = grads.reshape(n, *matrix_shape(shape))
            out.view(n, *self.split).add_(p_out @ (mat @ p_in.t()))
            return
        flat = grads.reshape(n, -1)
        for start, stop, block in self.dense_blocks(name, shape, grads):
            out.addmm_(flat[:, start:stop], block.t())

    def project_many(self, grads: Mapping[str, torch.Tensor], out: torch.Tensor) -> None:
        """Adds the sketches of several parameters' per-sample gradients ``{name: [n, *shape]}``
        to ``out`` ``[n, k]``: the small dense ones (biases, norms' scales) side by side, one
        GEMM per 16 MiB of their matrix instead of one per parameter, the rest one by one."""
        n = out.shape[0]
        cap = max(1, _GROUP_BYTES // (4 * self.k))  # columns of one side-by-side matrix
        run: list[tuple[str, torch.Tensor]] = []
        width = 0

        def flush() -> None:
            if len(run) == 1:
                self.project_into(*run[0], out)
            elif run:
                flat = torch.cat([g.reshape(n, -1) for _, g in run], 1)
                matrix = self.side_by_side([(k, g.shape[1:]) for k, g in run], flat)
                out.addmm_(flat, matrix.t())
            run.clear()

        for name, g in grads.items():
            g = g.to(out.dtype)
            numel = math.prod(g.shape[1:])
            if kind_of(g.shape[1:], self.kind) != DENSE or numel > cap:
                self.project_into(name, g, out)
                continue
            if width + numel > cap:
                flush()
                width = 0
            run.append((name, g))
            width += numel
        flush()

    def project_outer(self, name: str, shape: torch.Size | tuple[int, ...], a: torch.Tensor,
                      g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, k]`` sketches of per-sample gradients ``sum_t g_t a_t^T`` per group, from
        ``a`` ``[n, groups, T, d]`` and ``g`` ``[n, groups, T, p]``, the weight being the
        ``[groups * p, d]`` matrix: never the ``[n, groups * p, d]`` gradients themselves.
        With ``out`` (``[n, k]``, contiguous) they are added to it, which is returned."""
        n, groups, _, p = g.shape
        out = g.new_zeros((n, self.k)) if out is None else out
        if self.kind == TENSORSKETCH:
            tensorsketch.outer(*self.sides(name, shape, g), a, g, out)
            return out
        p_out, p_in = self.kronecker(name, shape, g)
        k_out, k_in = self.split
        ap = (a @ p_in.t().to(a.dtype)).to(g.dtype)  # [n, groups, T, k_in]
        if groups == 1:  # (P_out G^T) (A P_in^T) per sample: two GEMMs and one batched one
            out.view(n, k_out, k_in).baddbmm_(p_out @ g[:, 0].transpose(-1, -2), ap[:, 0])
            return out
        gp = torch.einsum("ngtp,gop->ngto", g, p_out.reshape(k_out, groups, p).transpose(0, 1))
        out.view(n, k_out, k_in).add_(torch.einsum("ngto,ngti->noi", gp, ap))
        return out

    def project_rows(self, name: str, shape: torch.Size | tuple[int, ...], rows: torch.Tensor,
                     g: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``[n, k]`` sketches of per-sample gradients ``sum_t e_{rows_t} g_t^T`` (an embedding
        table's: row ``rows[i, t]`` gets ``g[i, t]``), from the ids and the rows alone; added
        to ``out`` as :meth:`project_outer` does."""
        n, t = rows.shape
        out = g.new_zeros((n, self.k)) if out is None else out
        if self.kind == TENSORSKETCH:
            tensorsketch.embedding_rows(*self.sides(name, shape, g), rows, g, out)
            return out
        p_out, p_in = self.kronecker(name, shape, g)
        k_out, k_in = self.split
        po = p_out.index_select(1, rows.reshape(-1)).view(k_out, n, t).transpose(0, 1)
        out.view(n, k_out, k_in).baddbmm_(po, g @ p_in.t())  # [n, k_out, T] [n, T, k_in]
        return out


def kind_of(shape: torch.Size | tuple[int, ...], kind: str = TENSORSKETCH) -> str:
    """The matrix a parameter of this shape gets under a projection of ``kind`` (the same in
    every strategy): the kind's own for two or more dimensions and, for ``tensorsketch``, one
    (a count sketch of a ``[numel, 1]`` matrix); else a dense one."""
    return kind if len(shape) >= 2 or (len(shape) == 1 and kind == TENSORSKETCH) else DENSE


def matrix_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """A parameter of one or more dimensions as a matrix: ``[shape[0], prod(shape[1:])]``."""
    return int(shape[0]), math.prod(shape[1:])


def kinds(shapes: dict[str, torch.Size], kind: str = TENSORSKETCH) -> dict[str, str]:
    """``meta["projection"]``: which matrix each selected parameter got."""
    return {k: kind_of(s, kind) for k, s in shapes.items()}
