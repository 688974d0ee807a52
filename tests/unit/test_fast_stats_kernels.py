"""The CPU's fused loops over a piece of per-sample gradients against torch's eager operations
and float64: each sample's mean, squared deviations, squared norms and dots with the mean, in
float32 and float64, and bfloat16 and float16 a slab at a time in float32."""

from __future__ import annotations

import itertools
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from service.fast_stats import TUNING, _kernels
from service.fast_stats._kernels import (
    merged_into,
    moments_into,
    norms_and_mean_dots,
    sums_and_dots,
)
from service.fast_stats._source import merge

CASES = [(1, (5, 7)), (2, (3,)), (3, (1, 40, 33)), (4, (2, 300, 9)), (5, (700,)), (32, (1, 3, 130))]


def _rows(n: int, shape: tuple[int, ...], dtype: torch.dtype, offset: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(n * 1000 + len(shape))
    return (offset + torch.randn((n, *shape), generator=gen, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "shape"), CASES)
def test_moments_keep_their_digits_when_the_mean_is_large(
    n: int, shape: tuple[int, ...], dtype: torch.dtype, fused: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Mean 300 next to a spread of 1: the deviations from the rows' own mean keep their
    digits (E[g^2] - E[g]^2 in float32 would keep none), blocks of columns of every size."""
    monkeypatch.setattr(TUNING, "fused", fused)
    monkeypatch.setattr(TUNING, "block_bytes", 64)  # several blocks, the last one short
    rows = _rows(n, shape, dtype, 300.0)
    mean, m2 = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    moments_into(rows, mean, m2)
    exact = rows.double()
    want_m2 = ((exact - exact.mean(0)) ** 2).sum(0)
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(mean.double(), exact.mean(0), rtol=tol, atol=0)
    torch.testing.assert_close(m2.double(), want_m2, rtol=0, atol=tol * 300 * 300 * n)
    assert m2.min() >= 0


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("n", "shape"), CASES)
def test_norms_and_dots_with_the_mean(
    n: int, shape: tuple[int, ...], dtype: torch.dtype, fused: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(TUNING, "fused", fused)
    monkeypatch.setattr(TUNING, "block_bytes", 64)
    rows = _rows(n, shape, dtype, 0.5)
    mean = torch.full(shape, float("nan"), dtype=dtype)
    got = norms_and_mean_dots(rows, mean)
    flat = rows.double().reshape(n, -1)
    want = torch.stack((flat.square().sum(1), flat @ flat.mean(0)), 1)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    assert got.shape == (n, 2) and got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    torch.testing.assert_close(mean.double(), rows.double().mean(0), rtol=tol, atol=tol)


def test_other_layouts_take_the_eager_operations() -> None:
    """A strided output, float32 or bfloat16, still gets its answer (the eager operations; with
    ``in_place`` those write over the rows)."""
    rows = _rows(3, (4, 6), torch.float32, 2.0)
    exact = rows.double()
    wide = torch.empty(4, 12)
    mean, m2 = wide[:, ::2], wide[:, 1::2]  # not contiguous
    moments_into(rows.clone(), mean, m2)
    torch.testing.assert_close(mean.double(), exact.mean(0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m2.double(), ((exact - exact.mean(0)) ** 2).sum(0),
                               rtol=1e-5, atol=1e-5)
    half = rows.to(torch.bfloat16)
    wide16 = torch.empty(4, 12, dtype=torch.bfloat16)
    mean16, m216 = wide16[:, ::2], wide16[:, 1::2]
    moments_into(half.clone(), mean16, m216, in_place=True)
    torch.testing.assert_close(mean16.double(), half.double().mean(0), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(("rows", "width"), [(1, 1), (3, 17), (64, 49), (8, 3136)])
def test_row_sums_and_dots(rows: int, width: int, dtype: torch.dtype, fused: bool,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch norm's per-sample, per-channel sums over positions: of the output gradient, and
    of its product with the input."""
    monkeypatch.setattr(TUNING, "fused", fused)
    a, b = _rows(rows, (width,), dtype, 0.3), _rows(rows, (width,), dtype, -2.0)
    out = torch.full((rows, 2), float("nan"), dtype=dtype)
    dots = sums_and_dots(a, b, out)
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(out[:, 0].double(), a.double().sum(1), rtol=tol, atol=tol)
    torch.testing.assert_close(dots.double(), (a.double() * b.double()).sum(1), rtol=tol,
                               atol=tol)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sets", [[1, 1], [3, 1, 4], [5, 2, 2, 1]])
def test_sets_of_samples_merge_into_the_running_moments(
    sets: list[int], dtype: torch.dtype, fused: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Chan's update of the running mean and m2 by each set's own moments (in the same loop
    where fused), with the mean large next to the spread: the moments of every sample."""
    monkeypatch.setattr(TUNING, "fused", fused)
    monkeypatch.setattr(TUNING, "block_bytes", 64)
    rows = _rows(sum(sets), (3, 70), dtype, 300.0)
    acc = None
    ends = list(itertools.accumulate(sets))
    for lo, hi in zip([0, *ends], ends, strict=False):
        acc = merge(acc, rows[lo:hi])
    assert acc is not None and acc.n == len(rows)
    exact = rows.double()
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(acc.mean.double(), exact.mean(0), rtol=tol, atol=0)
    torch.testing.assert_close(acc.m2.double(), ((exact - exact.mean(0)) ** 2).sum(0), rtol=0,
                               atol=tol * 300 * 300 * len(rows))
    assert merged_into(rows, acc.mean, acc.m2, 1) == fused  # where the loops run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "shape"), CASES)
def test_narrow_pieces_take_the_float32_loops(
    n: int, shape: tuple[int, ...], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bfloat16 and float16 pieces, several blocks (the last ones short) widened in the loops
    (bfloat16's bits) or in several slabs (float16, and bfloat16's sums and dots), the mean 300
    next to a spread of 1: every result is the float64 one on the same rows, rounded once to
    the dtype (the eager operations round each deviation, and the mean they are taken from, to
    the dtype: bfloat16 is 2 apart at 300)."""
    monkeypatch.setattr(TUNING, "block_bytes", 64)
    monkeypatch.setattr(_kernels, "SLAB_BYTES", 4 * n * 300)  # 300 columns: at least 256
    rtol = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    rows = _rows(n, shape, dtype, 300.0)
    exact = rows.double()
    mean, m2 = torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, 7.0, dtype=dtype)
    moments_into(rows, mean, m2)
    assert mean.dtype == m2.dtype == dtype
    torch.testing.assert_close(mean.double(), exact.mean(0), rtol=rtol, atol=0)
    want_m2 = ((exact - exact.mean(0)) ** 2).sum(0)
    torch.testing.assert_close(m2.double(), want_m2, rtol=rtol, atol=1e-6)
    a, b = _rows(n, shape, dtype, 0.5).reshape(n, -1), _rows(n, shape, dtype, -2.0).reshape(n, -1)
    wide = a.double()  # sums of squares within float16's range
    if n > 1:  # two sets merged in the same loop, a slab at a time, the running mean between
        acc = merge(merge(None, a[: n // 2]), a[n // 2 :])  # them in the dtype
        torch.testing.assert_close(acc.mean.double(), wide.mean(0), rtol=rtol, atol=rtol)
        torch.testing.assert_close(acc.m2.double(), ((wide - wide.mean(0)) ** 2).sum(0),
                                   rtol=2 * rtol, atol=rtol * n)
    got = norms_and_mean_dots(a.view(rows.shape), torch.full(shape, float("nan"), dtype=dtype))
    want = torch.stack((wide.square().sum(1), wide @ wide.mean(0)), 1)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=rtol, atol=1e-3)
    out = torch.full((n, 2), float("nan"), dtype=dtype)
    dots = sums_and_dots(a, b, out)
    torch.testing.assert_close(out[:, 0].double(), wide.sum(1), rtol=rtol, atol=1e-3)
    torch.testing.assert_close(dots.double(), (wide * b.double()).sum(1), rtol=rtol, atol=1e-3)


WARMED = """
import torch
from service.fast_stats import _kernels, warm_kernels
loops = (_kernels._moments, _kernels._norms_and_dots, _kernels._sums_and_dots)
assert [len(f.signatures) for f in loops] == [0, 0, 0]
warm_kernels()
warmed = [len(f.signatures) for f in loops]
rows, mean, m2 = torch.randn(4, 64, 96), torch.empty(64, 96), torch.empty(64, 96)
_kernels.merged_into(rows, mean, m2, 0)
_kernels.merged_into(rows[:2], mean, m2, 4)
_kernels.norms_and_mean_dots(rows, mean)
_kernels.sums_and_dots(rows.reshape(8, -1), rows.reshape(8, -1), torch.empty(8, 2))
half, mean16, m216 = rows.bfloat16(), mean.bfloat16(), m2.bfloat16()
_kernels.merged_into(half, mean16, m216, 0)
_kernels.merged_into(half[:2], mean16, m216, 4)
_kernels.norms_and_mean_dots(half, mean16)
_kernels.sums_and_dots(half.reshape(8, -1), half.reshape(8, -1),
                       torch.empty(8, 2, dtype=torch.bfloat16))
print(warmed, [len(f.signatures) for f in loops])
"""


def test_a_worker_s_warm_up_compiles_the_loops_its_calls_run() -> None:
    """In a fresh process, :func:`warm_kernels` (a worker runs it as it starts) compiles each
    loop for float32, and the moments' and norms-and-dots' loops for bfloat16's bits too, with
    the argument types real calls pass: calls of other sizes, of float32 and of bfloat16,
    compile nothing more, so no request pays numba's compile (a second per loop)."""
    done = subprocess.run([sys.executable, "-c", WARMED], capture_output=True, text=True,
                          check=True, timeout=120)
    warmed, after = done.stdout.strip().split("] [")
    assert warmed == "[2, 2, 1" and after == "2, 2, 1]", done.stdout


KEPT = """
import torch
from service.fast_stats import _kernels, warm_kernels
warm_kernels()
rows = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
got = _kernels.norms_and_mean_dots(rows, torch.empty(50))
loops = (_kernels._moments, _kernels._norms_and_dots, _kernels._sums_and_dots)
print(_kernels.CACHE, sum(sum(f.stats.cache_hits.values()) for f in loops),
      sum(sum(f.stats.cache_misses.values()) for f in loops), got.double().tolist())
"""


Said = tuple[str, int, int, str]  # a process's cache folder, hits, misses and result


def _kept(cache_home: Path) -> Said:
    """A fresh process's cache folder, its loops' cache hits and misses as it warms up, and
    one result of theirs."""
    done = subprocess.run([sys.executable, "-c", KEPT], capture_output=True, text=True,
                          check=True, timeout=120,
                          env={**os.environ, "XDG_CACHE_HOME": str(cache_home)})
    folder, hits, misses, result = done.stdout.strip().split(" ", 3)
    return folder, int(hits), int(misses), result


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Said]:
    """A cache home that one fresh process filled, and what that process said (the tests that
    change a home change a copy)."""
    home = tmp_path_factory.mktemp("first")
    return home, _kept(home)


def test_compiled_loops_are_kept_for_the_next_process(first: tuple[Path, Said]) -> None:
    """The first process compiles the loops and keeps them in an owner-only folder of the
    user's cache; the next one reads every loop back from there, compiles none, and computes
    the same bits."""
    home, (folder, hits, misses, result) = first
    assert folder == str(home / "psgrad" / "loops")
    assert (hits, misses) == (0, 5)  # moments and norms-and-dots twice (bfloat16), sums once
    assert stat.S_IMODE((home / "psgrad" / "loops").stat().st_mode) == 0o700
    assert list((home / "psgrad" / "loops").rglob("*.nbi"))
    assert _kept(home) == (folder, 5, 0, result)


def test_a_folder_others_may_write_is_never_read(
        tmp_path: Path, first: tuple[Path, Said]) -> None:
    """numba reads its cache with pickle: a folder that another user may write (group
    writable here) is not used, nor one that cannot be made; the loops are compiled in the
    process instead, and answer the same."""
    shared = tmp_path / "shared"
    (shared / "psgrad" / "loops").mkdir(parents=True)
    (shared / "psgrad" / "loops").chmod(0o770)
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder would go")
    _, (_, _, _, want) = first
    for home in (shared, blocked):
        assert _kept(home) == ("None", 0, 5, want)  # compiled here, none read
    assert not list(shared.rglob("*.nb*"))


def test_a_torn_kept_loop_is_compiled_again(
        tmp_path: Path, first: tuple[Path, Said]) -> None:
    """A kept entry that does not load (truncated files, an index written over) is a miss, not
    a failure: the loops compile, answer the same, and are kept afresh for the next process."""
    home, (_, _, _, want) = first
    shutil.copytree(home, tmp_path, dirs_exist_ok=True)  # the kept loops, the home's own
    kept = tmp_path / "psgrad" / "loops"
    folder = str(kept)
    for path in kept.rglob("*.nbc"):
        path.write_bytes(path.read_bytes()[:100])
    for path in kept.rglob("*_moments*.nbi"):
        path.write_text("not an index")
    assert _kept(tmp_path) == (folder, 0, 5, want)
    assert _kept(tmp_path) == (folder, 5, 0, want)
