"""Gradient stores on real files: appends sharded and committed whole, queries streamed and
held to a numpy reference over the whole matrix (same top-k ids, scores to float tolerance, for
every score), a crash between the shard writes and the manifest's commit, queries while a batch
is being appended, concurrent committers (threads, and api replicas sharing a Redis lease), and
memory bounded by one shard."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import tracemalloc
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from psgrad._errors import (
    BadRequest,
    Conflict,
    InvalidInput,
    NonFinite,
    NotFound,
    Overloaded,
    StoreDamaged,
    TooLarge,
)
from service import redis_keys
from service.api.routes.stores import _doc as described
from service.stores import files as files_module
from service.stores import query
from service.stores.files import MANIFEST, StoreFiles
from service.stores.locks import RedisLocks, ThreadLocks
from service.stores.query import Largest, check_score, default_lambda, search
from service.stores.spec import EXACT, StoreSpec, checked_ids
from tests.support.redis import prefix_on, redis_or_skip
from tests.support.stores import reference

K = 16
LIMIT = 1 << 30  # a factors file's bytes, far above these


def spec(dtype: str = "float32", dim: int = K) -> StoreSpec:
    return StoreSpec(id="s", model="mlp@abc", loss="cross_entropy", params=("w",),
                     projection_dim=dim, projection_seed=0, projection_kind="kronecker",
                     dtype=dtype)


def files(tmp_path: Path, shard_rows: int = 7, dtype: str = "float32",
          url: str | None = None) -> StoreFiles:
    return StoreFiles(url or str(tmp_path / "data"), ThreadLocks(),
                      shard_bytes=shard_rows * K * np.dtype(dtype).itemsize)


def filled(tmp_path: Path, dtype: str = "float32", sizes: tuple[int, ...] = (5, 11, 1, 23, 9),
           url: str | None = None) -> tuple[StoreFiles, np.ndarray, list[int | str]]:
    """A store of several appends (each split into shards of 7 rows): its files, the matrix it
    should hold (rounded to its dtype, as float64) and its ids in order."""
    store = files(tmp_path, dtype=dtype, url=url)
    store.create("s", spec(dtype))
    rng = np.random.default_rng(0)
    rows, ids = [], []
    for i, n in enumerate(sizes):
        x = rng.standard_normal((n, K)).astype(np.float32)
        names: list[int | str] = [f"train-{i}-{j}" for j in range(n)]
        store.append("s", spec(dtype), names, "str", x)
        rows.append(x.astype(dtype).astype(np.float64))
        ids += names
    return store, np.concatenate(rows), ids


@pytest.mark.parametrize("dtype", ["float32", "float16"])
@pytest.mark.parametrize("score", ["dot", "cosine", "trak", "self_influence"])
def test_query_equals_numpy_over_the_whole_matrix(tmp_path: Path, dtype: str,
                                                  score: str) -> None:
    store, phi, ids = filled(tmp_path, dtype)
    manifest = store.manifest("s")
    assert manifest.count == 49 and len(manifest.shards) == 1 + 2 + 1 + 4 + 2  # 7 rows a shard
    q = np.random.default_rng(1).standard_normal((4, K))
    for k in (1, 5, 49):
        found = search(store, "s", "s", None if score == "self_influence" else q, k, score)
        want_rows, want_scores = reference(phi, q, score, k)
        np.testing.assert_array_equal(found.rows, want_rows)
        np.testing.assert_allclose(found.scores, want_scores, rtol=2e-5, atol=2e-5)
        assert store.id_at("s", found.manifest, found.rows) == [[ids[r] for r in row]
                                                               for row in want_rows]
    np.testing.assert_allclose(store.gram("s", manifest), phi.T @ phi, rtol=1e-12)


def test_a_store_at_an_fsspec_url_works_the_same(tmp_path: Path) -> None:
    """fsspec's in-memory filesystem stands for an object store: no mapping of local files,
    renames that are copies."""
    url = f"memory://psgrad-test-{tmp_path.name}"
    store, phi, ids = filled(tmp_path, "float16", url=url)
    try:
        q = np.random.default_rng(1).standard_normal((4, K))
        for score in ("dot", "cosine", "trak", "self_influence"):
            found = search(store, "s", "s", None if score == "self_influence" else q, 9, score)
            rows, scores = reference(phi, q, score, 9)
            np.testing.assert_array_equal(found.rows, rows)
            np.testing.assert_allclose(found.scores, scores, rtol=2e-5, atol=2e-5)
            assert store.id_at("s", found.manifest, found.rows)[0] == [ids[r] for r in rows[0]]
        assert store.store_keys() == ["s"] and not (tmp_path / "data").exists()
        assert store.delete("s") and store.store_keys() == []
    finally:
        store.fs.rm(store.root, recursive=True)


def test_trak_takes_the_querys_lambda(tmp_path: Path) -> None:
    store, phi, _ = filled(tmp_path)
    q = np.random.default_rng(2).standard_normal((3, K))
    default = search(store, "s", "s", q, 8, "trak")
    assert default.lam == pytest.approx(np.trace(phi.T @ phi) / K)
    for lam in (1e-3, 10.0):
        found = search(store, "s", "s", q, 8, "trak", lam)
        rows, scores = reference(phi, q, "trak", 8, lam)
        np.testing.assert_array_equal(found.rows, rows)
        np.testing.assert_allclose(found.scores, scores, rtol=1e-4, atol=1e-5)
    assert not np.array_equal(search(store, "s", "s", q, 8, "trak", 1e-3).rows, default.rows)


def test_ties_go_to_the_earlier_row(tmp_path: Path) -> None:
    store = files(tmp_path)
    store.create("s", spec())
    x = np.zeros((20, K), np.float32)
    x[:, 0] = [1, 2, 2, 1, 2, 3, 2, 1, 1, 2, 3, 2, 1, 2, 2, 1, 3, 2, 2, 1]
    store.append("s", spec(), list(range(20)), "int", x)
    found = search(store, "s", "s", np.eye(1, K), 6, "dot")
    assert found.rows.tolist() == [[5, 10, 16, 1, 2, 4]]


def test_a_crash_before_the_commit_leaves_the_store_as_it_was(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    store, phi, ids = filled(tmp_path)
    before = store.manifest("s")
    q = np.random.default_rng(3).standard_normal((2, K))
    x = np.random.default_rng(4).standard_normal((10, K)).astype(np.float32)
    new: list[int | str] = [f"new-{j}" for j in range(10)]

    # the process dies between its shard writes and the manifest's rename: the shards are on
    # disk, no manifest names them
    staged = store.stage("s", spec(), new, "str", x)
    assert all((tmp_path / "data/stores/s" / s.file).exists() for s in staged.shards)
    again = StoreFiles(str(tmp_path / "data"), ThreadLocks(), store.shard_bytes)  # restarted
    assert again.manifest("s") == before
    found = search(again, "s", "s", q, 49, "dot")
    np.testing.assert_array_equal(found.rows, reference(phi, q, "dot", 49)[0])

    # the manifest's write fails: the batch's files are removed, the manifest is the old one
    real = StoreFiles._write

    def failing(self: StoreFiles, path: str, *data: bytes | memoryview) -> None:
        if path.endswith(MANIFEST):
            raise OSError("disk gone")
        real(self, path, *data)

    monkeypatch.setattr(StoreFiles, "_write", failing)
    with pytest.raises(OSError):
        again.append("s", spec(), new, "str", x)
    monkeypatch.setattr(StoreFiles, "_write", real)
    assert again.manifest("s") == before
    assert again.ids("s", again.manifest("s")) == set(ids)

    # the retried batch is added whole, once
    after = again.append("s", spec(), new, "str", x)
    assert after.count == 59 and after.seq == before.seq + 1
    phi2 = np.concatenate([phi, x.astype(np.float64)])
    found = search(again, "s", "s", q, 59, "trak")
    np.testing.assert_array_equal(found.rows, reference(phi2, q, "trak", 59)[0])
    np.testing.assert_allclose(again.gram("s", after), phi2.T @ phi2, rtol=1e-12)


def test_a_query_during_an_append_sees_what_is_committed(tmp_path: Path) -> None:
    store, phi, _ = filled(tmp_path)
    q = np.random.default_rng(5).standard_normal((2, K))
    x = 100 * np.ones((4, K), np.float32)  # would win every dot query once committed
    staged = store.stage("s", spec(), ["a", "b", "c", "d"], "str", x)
    found = search(store, "s", "s", q, 3, "dot")
    assert found.manifest.count == 49
    np.testing.assert_array_equal(found.rows, reference(phi, q, "dot", 3)[0])
    store.commit(staged)
    found = search(store, "s", "s", np.ones((1, K)), 3, "dot")
    assert found.manifest.count == 53 and found.rows.tolist() == [[49, 50, 51]]


def test_duplicate_ids_refuse_the_whole_batch(tmp_path: Path) -> None:
    store, _, _ = filled(tmp_path)
    x = np.ones((3, K), np.float32)
    with pytest.raises(Conflict) as err:
        store.append("s", spec(), ["fresh", "train-1-3", "train-4-0"], "str", x)
    assert err.value.details["duplicates"] == ["train-1-3", "train-4-0"]
    assert "nothing of this batch was added" in err.value.message
    assert store.manifest("s").count == 49
    assert sorted(p.name for p in (tmp_path / "data/stores/s").glob("shard-*")) == sorted(
        s.file for s in store.manifest("s").shards)  # the refused batch's shards are gone
    with pytest.raises(InvalidInput, match="str ids"):
        store.append("s", spec(), [1, 2, 3], "int", x)
    with pytest.raises(InvalidInput, match="repeats"):
        checked_ids(["a", "b", "a"], 3)
    with pytest.raises(InvalidInput, match="mixes"):
        checked_ids(["a", 1], 2)
    with pytest.raises(InvalidInput, match="3 entries"):
        checked_ids([1, 2, 3], 2)
    assert checked_ids(np.arange(3), 3) == ([0, 1, 2], "int")


def test_rows_past_float16_are_refused(tmp_path: Path) -> None:
    store = files(tmp_path, dtype="float16")
    store.create("s", spec("float16"))
    with pytest.raises(InvalidInput, match="float32"):
        store.append("s", spec("float16"), [1], "int", np.full((1, K), 1e6, np.float32))
    with pytest.raises(NonFinite):
        store.append("s", spec("float16"), [1], "int", np.full((1, K), np.nan, np.float32))
    assert store.manifest("s").count == 0 and not list((tmp_path / "data/stores/s").glob("sh*"))


def test_issue_53_finding_5_an_unrepresentable_row_is_refused_naming_it(
        tmp_path: Path) -> None:
    """Issue 53, finding 5: an input of 1e30 gave a finite row whose self-influence was
    3.2e59; it was kept, the default lambda followed it, and every later trak query of the
    store answered zeros. Such a row is refused (422, its id named), nothing of its batch
    kept, and the store answers as before."""
    store, _, _ = filled(tmp_path)
    q = np.random.default_rng(2).standard_normal((3, K))
    want = search(store, "s", "s", q, 8, "trak")
    x = np.random.default_rng(3).standard_normal((3, K)).astype(np.float32)
    x[1] *= np.float32(1.4e29)  # finite in float32; its squared norm about 3e59 is not
    with pytest.raises(InvalidInput) as err:
        store.append("s", spec(), ["ok-0", "huge", "ok-2"], "str", x)
    assert err.value.status == 422
    assert err.value.details["samples"] == ["huge"] and err.value.details["count"] == 1
    assert "'huge'" in err.value.message and "nothing of this batch was added" in (
        err.value.message)
    assert store.manifest("s").count == 49
    assert sorted(p.name for p in (tmp_path / "data/stores/s").glob("shard-*")) == sorted(
        s.file for s in store.manifest("s").shards)
    again = search(store, "s", "s", q, 8, "trak")
    np.testing.assert_array_equal(again.rows, want.rows)
    assert again.lam == want.lam and np.abs(again.scores).min() > 0

    # a row with a non-finite entry: named too
    x[1] = np.inf
    with pytest.raises(NonFinite) as err:
        store.append("s", spec(), ["ok-0", "inf", "ok-2"], "str", x)
    assert err.value.details["samples"] == ["inf"] and "'inf'" in err.value.message
    assert store.manifest("s").count == 49


def test_issue_53_finding_5_one_extreme_row_does_not_zero_trak(tmp_path: Path) -> None:
    """Issue 53, finding 5: one extreme row that is accepted (its squared norm, 1e36, is a
    float32 number) no longer sets the default lambda: a row counts for at most the total of
    all the others, so lambda stays near the store's own, and trak ranks as the reference at
    that lambda (before: lambda about 6e34, the scores 1e-35 or zero, ranked as dot)."""
    store, phi, _ = filled(tmp_path)
    base = np.trace(phi.T @ phi) / K
    extreme = np.zeros((1, K), np.float32)
    extreme[0, 0] = 1e18  # self-influence 1e36
    store.append("s", spec(), ["extreme"], "str", extreme)
    phi2 = np.concatenate([phi, extreme.astype(np.float64)])
    s = np.einsum("ij,ij->i", phi2, phi2)
    lam = 2 * s[:-1].sum() / K  # the rule, from the docs: twice the rest's trace / k
    q = np.random.default_rng(2).standard_normal((3, K))
    found = search(store, "s", "s", q, 50, "trak")
    assert found.lam == pytest.approx(lam, rel=1e-9) and found.lam < 2.01 * base
    rows, scores = reference(phi2, q, "trak", 50, lam, exact=True)
    np.testing.assert_array_equal(found.rows, rows)
    np.testing.assert_allclose(found.scores, scores, rtol=1e-4, atol=1e-6)
    assert (np.abs(found.scores) > 1e-3).mean() > 0.5  # useful scores, not zeros

    # any finite lambda scores without underflow (the scoring is scaled, not float32 alone)
    huge = search(store, "s", "s", q, 50, "trak", 1e45)
    rows, scores = reference(phi2, q, "trak", 50, 1e45, exact=True)
    np.testing.assert_array_equal(huge.rows, rows)
    np.testing.assert_allclose(huge.scores, scores, rtol=1e-4)
    assert (huge.scores != 0).all()


def test_issue_53_a_dense_dominating_row_keeps_trak_exact(tmp_path: Path) -> None:
    """Issue 53's second rerun: an input of 1e9 (accepted: self-influence 1.8e20) made every
    default ``trak`` query of its store answer 422 "Phi^T Phi + lambda I is singular": the row's
    share of the float64 Gram sum rounded every other row's out. That row is kept apart and
    added back exactly; the scores equal the SVD reference (the others' too), for the default
    lambda and a given one (the reference: in exact rational numbers), and a later append reads
    the store afresh."""
    store, phi, _ = filled(tmp_path)
    extreme = (np.random.default_rng(5).standard_normal((1, K)) * 3e9).astype(np.float32)
    store.append("s", spec(), ["extreme"], "str", extreme)
    phi2 = np.concatenate([phi, extreme.astype(np.float64)])
    s = np.einsum("ij,ij->i", phi2, phi2)
    assert s[-1] > 1e20 and s[-1] > 1e16 * s[:-1].sum()
    q = np.random.default_rng(2).standard_normal((3, K))
    for lam in (None, 0.5):
        found = search(store, "s", "s", q, 50, "trak", lam)
        want = 2 * s[:-1].sum() / K if lam is None else lam
        assert found.lam == pytest.approx(want, rel=1e-9)
        rows, scores = reference(phi2, q, "trak", 50, want, exact=True)
        np.testing.assert_array_equal(found.rows, rows)
        np.testing.assert_allclose(found.scores, scores, rtol=1e-4, atol=1e-7)
        assert (np.abs(found.scores) > 1e-3).mean() > 0.5  # useful scores, not zeros

    more = np.random.default_rng(6).standard_normal((4, K)).astype(np.float32)
    store.append("s", spec(), [f"more-{i}" for i in range(4)], "str", more)
    phi3 = np.concatenate([phi2, more.astype(np.float64)])
    found = search(store, "s", "s", q, 54, "trak", 0.5)
    rows, scores = reference(phi3, q, "trak", 54, 0.5, exact=True)
    np.testing.assert_array_equal(found.rows, rows)
    np.testing.assert_allclose(found.scores, scores, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(("sizes", "weights_bytes"),
                         [((5, 11, 1, 23, 9), 0), ((5, 11, 1, 23, 9), 1 << 20), ((5, 6), 0)],
                         ids=["k-space", "k-space-weights", "row-space"])
def test_trak_factors_once_per_committed_state_and_lambda(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sizes: tuple[int, ...],
        weights_bytes: int) -> None:
    """Issue 51, item 2: Phi^T Phi + lambda I is factored once per committed state and lambda,
    not once per query; a commit or another lambda factors again, and every answer equals the
    reference: queries solved with the factor, or scored by the rows' weights made with it
    (while they fit ``TRAK_WEIGHTS_BYTES``). A store of no more rows than k (11 here, k = 16)
    solves with its rows' kernel instead (its lambda = 0 refused: Phi^T Phi is singular),
    until an append passes k."""
    monkeypatch.setattr(query, "TRAK_WEIGHTS_BYTES", weights_bytes)
    store, phi, _ = filled(tmp_path, sizes=sizes)
    factored: list[float] = []
    real = query._factor
    monkeypatch.setattr(query, "_factor",
                        lambda a, lam: factored.append(lam) or real(a, lam))
    q = np.random.default_rng(2).standard_normal((5, K))

    def check(phi: np.ndarray, lam: float | None) -> None:
        found = search(store, "s", "s", q, 10, "trak", lam)
        rows, scores = reference(phi, q, "trak", 10, lam)
        np.testing.assert_array_equal(found.rows, rows)
        np.testing.assert_allclose(found.scores, scores, rtol=2e-5, atol=2e-5)

    for _ in range(3):
        check(phi, None)
    assert len(factored) == 1
    check(phi, 0.5)
    check(phi, 0.5)
    assert factored[1:] == [0.5]
    more = np.random.default_rng(9).standard_normal((6, K)).astype(np.float32)
    store.append("s", spec(), [f"more-{i}" for i in range(6)], "str", more)
    phi = np.concatenate([phi, more.astype(np.float64)])
    check(phi, None)
    check(phi, None)
    assert len(factored) == 3
    if len(phi) < K:
        for zero in (0.0, -0.0):  # -0.0 is read as 0 in the message too
            with pytest.raises(InvalidInput, match=r"Phi \+ 0 I is singular"):
                search(store, "s", "s", q, 5, "trak", zero)
    else:
        check(phi, 0.0)


def test_the_default_lambda_is_the_mean_eigenvalue_unless_one_row_dominates() -> None:
    """The rule of docs/attribution.md: trace / k while no row holds more than the others
    together (every store of the LDS benchmark), else twice the rest's trace / k."""
    rng = np.random.default_rng(7)
    phi = rng.standard_normal((30, K))

    def split(phi: np.ndarray) -> Largest:
        s = np.einsum("ij,ij->i", phi, phi)
        top = int(np.argmax(s))
        return Largest(float(s[top]), float(np.delete(s, top).sum()), top)

    gram = phi.T @ phi  # trace(Phi^T Phi): the rows' summed squared norms
    assert default_lambda(K, split(phi)) == pytest.approx(np.trace(gram) / K, rel=1e-13)
    phi[3] *= 1e6
    largest = split(phi)
    assert default_lambda(K, largest) == pytest.approx(2 * largest.rest / K)
    assert default_lambda(K, Largest()) == 1.0
    assert default_lambda(K, Largest(9.0)) == pytest.approx(9.0 / K)  # one row: no rest


def test_definitions_and_deletion(tmp_path: Path) -> None:
    store = files(tmp_path)
    made, created = store.create("s", spec())
    assert created and store.spec("s") == made
    assert store.create("s", spec())[1] is False
    with pytest.raises(Conflict, match="another definition"):
        store.create("s", spec("float16"))
    store.append("s", spec(), [1, 2], "int", np.ones((2, K), np.float32))
    assert store.delete("s") and not (tmp_path / "data/stores/s").exists()
    assert not store.delete("s") and store.spec("s") is None
    with pytest.raises(InvalidInput, match="unknown score"):
        check_score("influence")
    for sent in (None, 5, ["dot"]):  # no string: the wrong type, a 400 as the contract's
        with pytest.raises(BadRequest, match="'score' must be a string, one of dot, cosine"
                           ) as caught:
            check_score(sent)
        assert caught.value.status == 400


def test_a_delete_racing_a_staged_shard_removes_the_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file that goes while the folder is walked (an append staging a shard: its temporary
    file renamed) does not fail the delete, which walks again (before: a 500, the store half
    removed and a retried DELETE a 404)."""
    store = files(tmp_path)
    store.create("s", spec())
    store.append("s", spec(), [1, 2], "int", np.ones((2, K), np.float32))
    real, calls = store.fs.rm, []

    def racing(path: str, recursive: bool = False, **kwargs: Any) -> None:
        calls.append(path)
        if len(calls) == 1:  # the walk found a temporary file that was renamed meanwhile
            real(str(next((tmp_path / "data/stores/s").glob("shard-*"))))
            raise FileNotFoundError(2, "No such file or directory", ".tmp-0")
        real(path, recursive=recursive, **kwargs)

    monkeypatch.setattr(store.fs, "rm", racing)  # fsspec shares the instance: undone after
    assert store.delete("s") and len(calls) == 2
    assert not (tmp_path / "data/stores/s").exists() and store.spec("s") is None


def _cut(path: Path, keep: int | None = None) -> None:
    """``path`` cut to ``keep`` bytes (None: half of them), as a file damaged on the disk."""
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2 if keep is None else keep])


@pytest.mark.parametrize("name, damage, says", [
    (MANIFEST, _cut, "cannot be read"),
    (MANIFEST, lambda p: p.write_text('{"seq": 1}'), "cannot be read"),
    (MANIFEST, Path.unlink, "is missing"),
    ("shard", lambda p: _cut(p, 12 + int.from_bytes(p.read_bytes()[:8], "little")),
     "cannot be read"),  # its header whole, its rows cut
    ("shard", lambda p: _cut(p, 40), "cannot be read"),  # its header cut
    ("shard", lambda p: _cut(p, 0), "cannot be read"),
    ("shard", lambda p: p.write_bytes(b"\xff" * 64), "cannot be read"),  # a header size of 2**64
    ("shard", Path.unlink, "is missing"),
])
def test_a_damaged_file_is_a_store_damaged_naming_it(
        tmp_path: Path, name: str, damage: Any, says: str) -> None:
    """A store file cut short, changed or lost outside psgrad is StoreDamaged (500
    store_damaged) naming the file, for every score: before, Python's own error (a 500 with
    'buffer is smaller than requested size'), a lost shard called a deleted store (404), and
    a lost manifest read as an empty store, whose next append orphaned every shard."""
    store, _, _ = filled(tmp_path)
    folder = tmp_path / "data/stores/s"
    target = folder / (store.manifest("s").shards[1].file if name == "shard" else name)
    damage(target)
    again = StoreFiles(str(tmp_path / "data"), ThreadLocks(), store.shard_bytes)  # restarted
    q = np.ones((1, K))
    for score in ("dot", "trak", "self_influence"):
        with pytest.raises(StoreDamaged) as caught:
            search(again, "s", "s", q, 3, score)
        assert str(caught.value) == (f"store 's' is damaged: its file {target.name} {says}; "
                                     "DELETE it and add its samples again")
        assert caught.value.status == 500 and caught.value.code == "store_damaged"
    assert again.delete("s") and not folder.exists()


def test_a_damaged_definition_is_named_and_the_store_can_be_deleted(tmp_path: Path) -> None:
    """A spec.json that does not parse is StoreDamaged where the store is read, a store that
    pins nothing (a model version can be deleted), and DELETE removes it (before: every
    route a 500, DELETE too, so that only an operator could remove it)."""
    store, _, _ = filled(tmp_path)
    _cut(tmp_path / "data/stores/s/spec.json")
    with pytest.raises(StoreDamaged, match=r"its file spec.json cannot be read"):
        store.spec("s")
    assert store.pinning({"mlp@abc"}) == []
    assert store.delete("s") and store.spec("s") is None
    assert not store.delete("s")


def test_an_index_that_cannot_be_read_is_scanned_past(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    """A trained index cut short: the query scans every row (exact, as the scan ranks) and
    says so in the log (before: FAISS's RuntimeError, a 500)."""
    indexed = indexed_spec()
    store = files(tmp_path)
    store.create("s", indexed)
    phi = np.random.default_rng(9).standard_normal((100, K)).astype(np.float32)
    store.append("s", indexed, list(range(100)), "int", phi)
    trained = store.manifest("s").trained
    assert trained is not None
    _cut(tmp_path / "data/stores/s" / trained)
    again = StoreFiles(str(tmp_path / "data"), ThreadLocks(), store.shard_bytes)
    q = np.random.default_rng(1).standard_normal((2, K))
    with caplog.at_level(logging.WARNING, logger="service.stores.files"):
        found = search(again, "s", "s", q, 5, "dot")
    assert found.exact and f"its index {trained} cannot be read" in caplog.text
    np.testing.assert_array_equal(found.rows, reference(phi.astype(np.float64), q, "dot", 5)[0])


def test_an_append_to_a_deleted_store_is_refused(tmp_path: Path) -> None:
    """Deleted before its commit, or before its shards are written (its folder gone: that
    was a FileNotFoundError, a 500): a 404, and nothing of it left behind."""
    store = files(tmp_path)
    store.create("s", spec())
    staged = store.stage("s", spec(), [1], "int", np.ones((1, K), np.float32))
    store.delete("s")
    with pytest.raises(NotFound, match="store 's' was deleted"):
        store.commit(staged)
    with pytest.raises(NotFound, match="store 's' was deleted"):
        store.stage("s", spec(), [1], "int", np.ones((1, K), np.float32))
    assert not (tmp_path / "data/stores/s").exists()


def test_a_write_checked_against_a_store_made_again_since_is_refused(tmp_path: Path) -> None:
    """A batch (or a fit) checked against one store and written after that store was deleted
    and made again under its id is a 409, the new store left as it was and the batch's
    shards removed (before, the old definition's rows went into the new store)."""
    from service.stores import factors

    store = files(tmp_path)
    store.create("s", spec())
    epoch = store.manifest("s").epoch
    staged = store.stage("s", spec(), [1], "int", np.ones((1, K), np.float32), epoch)
    store.delete("s")
    store.create("s", spec(dim=8))
    with pytest.raises(Conflict, match="'s' was deleted and made again while this request "
                       "was computed: nothing of it was written; send it again"):
        store.commit(staged)
    assert store.manifest("s").count == 0
    assert sorted(p.name for p in (tmp_path / "data/stores/s").iterdir()) == [MANIFEST,
                                                                               "spec.json"]
    with pytest.raises(Conflict, match="made again"):
        store.append("s", spec(dim=8), [1], "int", np.ones((1, 8), np.float32), epoch)
    store.append("s", spec(dim=8), [1], "int", np.ones((1, 8), np.float32),
                 store.manifest("s").epoch)  # the store's own epoch: added
    assert store.manifest("s").count == 1
    with pytest.raises(Conflict, match="made again"):
        factors.add(store, [("s", fitting_spec(), fitting_answer(np.ones((2, 10))))], LIMIT,
                    epochs=[epoch])
    assert factors.fitted(store, "s") is None


def _hammer(stores: list[StoreFiles], per: int = 6) -> None:
    """Threads appending to one store through ``stores`` (one each) at once."""
    def run(i: int) -> None:
        for j in range(per):
            stores[i].append("s", spec(), [i * 100 + j], "int",
                             np.full((1, K), i * 100 + j, np.float32))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_concurrent_commits_lose_nothing(tmp_path: Path) -> None:
    store = files(tmp_path)
    store.create("s", spec())
    _hammer([store] * 4)
    manifest = store.manifest("s")
    assert manifest.count == 24 and manifest.seq == 24
    assert store.ids("s", manifest) == {i * 100 + j for i in range(4) for j in range(6)}


def ensemble(tmp_path: Path) -> tuple[StoreFiles, StoreSpec, list[tuple[str, StoreSpec]]]:
    """An ensemble of two checkpoints (each its own rows, a store inside the store)."""
    store = files(tmp_path)
    whole = replace(spec(), checkpoints=("mlp@a", "mlp@b"))
    store.create("e", whole)
    members = whole.members("e")
    for key, member in members:
        store.create(key, member)
    return store, whole, members


def _append_all(store: StoreFiles, members: list[tuple[str, StoreSpec]], ids: list[int],
                ) -> list[np.ndarray]:
    """One batch appended to every checkpoint (rows of its own each); the rows."""
    rows = [np.random.default_rng([c, *ids]).standard_normal((len(ids), K)).astype(np.float32)
            for c in range(len(members))]
    files_module.commit_all(store, [(key, member, r) for (key, member), r in zip(
        members, rows, strict=True)], list(ids), "int")
    return rows


def _summed_reference(rows: list[list[np.ndarray]], queries: list[np.ndarray], k: int
                      ) -> tuple[np.ndarray, np.ndarray]:
    """An ensemble's top-k dot scores in float64: each checkpoint's, summed by row."""
    scores = sum(q.astype(np.float64) @ np.concatenate(r).astype(np.float64).T
                 for r, q in zip(rows, queries, strict=True))
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, 1)


def test_an_ensemble_append_that_fails_at_its_last_checkpoint_commits_nowhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first checkpoint's manifest is written last: a disk that fills (or a process that
    dies) before it leaves the other checkpoint ahead, and that checkpoint is read as it was.
    Before, the checkpoints committed in order: the first kept the batch, the other refused
    it (507 "nothing was written"), a retry was 409 for good, and queries summed the scores of
    different samples."""
    store, _, members = ensemble(tmp_path)
    keys = [key for key, _ in members]
    held = [[r] for r in _append_all(store, members, [0, 1, 2])]
    real = StoreFiles._write

    def full(self: StoreFiles, path: str, *data: bytes | memoryview) -> None:
        if path.endswith(f"{keys[0]}/{MANIFEST}"):
            raise OSError(28, "No space left on device")
        real(self, path, *data)

    monkeypatch.setattr(StoreFiles, "_write", full)
    with pytest.raises(OSError, match="No space left"):
        _append_all(store, members, [3, 4])
    monkeypatch.setattr(StoreFiles, "_write", real)
    assert store.manifest(keys[1]).count == 5  # written ahead, read as it was
    assert [m.count for m in store.states(keys)] == [3, 3]
    assert [m.seq for m in store.states(keys)] == [1, 1]
    q = [np.random.default_rng(9).standard_normal((2, K)) for _ in keys]
    found = query.search_all(store, keys, "e", q, 3, "dot")
    want = _summed_reference(held, q, 3)
    np.testing.assert_array_equal(found.rows, want[0])
    np.testing.assert_allclose(found.scores, want[1], rtol=1e-5)

    # the batch sent again is added whole, to both; queries sum each sample's own scores
    for c, r in enumerate(_append_all(store, members, [3, 4])):
        held[c].append(r)
    for c, r in enumerate(_append_all(store, members, [5])):
        held[c].append(r)
    assert [(m.count, m.seq) for m in store.states(keys)] == [(6, 3), (6, 3)]
    assert [store.ids(key, m) for key, m in zip(keys, store.states(keys), strict=True)] == [
        set(range(6))] * 2
    found = query.search_all(store, keys, "e", q, 6, "dot")
    want = _summed_reference(held, q, 6)
    np.testing.assert_array_equal(found.rows, want[0])
    np.testing.assert_allclose(found.scores, want[1], rtol=1e-5)
    for c, (key, m) in enumerate(zip(keys, store.states(keys), strict=True)):
        phi = np.concatenate(held[c]).astype(np.float64)  # trak's Gram: its own rows'
        np.testing.assert_allclose(store.gram(key, m), phi.T @ phi, rtol=1e-12)


def test_an_ensemble_whose_first_checkpoint_ran_ahead_is_read_at_the_others_commit(
        tmp_path: Path) -> None:
    """A store written before the first checkpoint was committed last can hold it ahead (one
    commit, or two): read at the others'. Further apart than the Gram files kept, it is a
    StoreDamaged that says to rebuild it, never scores summed across different samples."""
    store, _, members = ensemble(tmp_path)
    keys = [key for key, _ in members]
    _append_all(store, members, [0, 1])
    for ids in ([2], [3, 4]):  # the old order's failure: the first took it, the other not
        store.append(keys[0], members[0][1], ids, "int", np.ones((len(ids), K), np.float32))
        assert [m.count for m in store.states(keys)] == [2, 2]
    for ids in ([5], [6], [7]):  # the old Gram files are gone: nothing to read it at
        store.append(keys[0], members[0][1], ids, "int", np.ones((1, K), np.float32))
    with pytest.raises(files_module.StoreDamaged, match="'e' is damaged: its checkpoints hold "
                       r"1 and 6 commits; DELETE it and add its samples again") as caught:
        store.states(keys)
    assert caught.value.status == 500


def test_concurrent_ensemble_appends_keep_the_checkpoints_rows_in_one_order(
        tmp_path: Path) -> None:
    """Two appends to one ensemble at once commit one after the other in every checkpoint:
    row i is the same sample in each (before, each checkpoint took its own lock in turn, and
    two appends could land in one order here and in the other there)."""
    store, _, members = ensemble(tmp_path)
    keys = [key for key, _ in members]

    def run(i: int) -> None:
        for j in range(5):
            _append_all(store, members, [i * 100 + j])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    states = store.states(keys)
    orders = [[int(i) for shard in m.shards for i in store.ids_of(key, shard)]
              for key, m in zip(keys, states, strict=True)]
    assert orders[0] == orders[1] and sorted(orders[0]) == sorted(
        i * 100 + j for i in range(4) for j in range(5))


def test_api_replicas_share_a_redis_lease(tmp_path: Path) -> None:
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        replicas = [StoreFiles(str(tmp_path / "data"), RedisLocks(client, prefix))
                    for _ in range(4)]  # four api processes: no lock in common but Redis's
        replicas[0].create("s", spec())
        _hammer(replicas)
        manifest = replicas[1].manifest("s")
        assert manifest.count == 24 and manifest.seq == 24
        gram = replicas[2].gram("s", manifest)
        values = np.array([i * 100 + j for i in range(4) for j in range(6)], np.float64)
        assert gram is not None and gram[0, 0] == pytest.approx((values**2).sum())
    client.close()


def test_a_commit_longer_than_its_lease_keeps_it() -> None:
    """The lease is renewed while its commit runs: a commit three leases long still holds it
    (another replica cannot take the store), and it is gone once the commit ends."""
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        mine, other = RedisLocks(client, prefix, lease_ms=300), RedisLocks(client, prefix)
        key = redis_keys.store_lock(prefix, "s")
        with mine.hold("s"):
            token = client.get(key)
            time.sleep(1.0)
            assert client.get(key) == token and 0 < client.pttl(key) <= 300
            assert not client.set(key, b"other", nx=True, px=1000)  # nobody else takes it
        assert client.get(key) is None
        with other.hold("s"):
            assert client.get(key) is not None
    client.close()


def test_a_lease_left_by_a_dead_api_says_when_it_frees(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """An api that died holding a store's lease: a commit waits for the lease to run out and
    goes on; past its wait, the 503's Retry-After is the lease's time left (it was 1 s, for a
    lease of 60 s that each try waited 30 s of), and the message names the store."""
    from service.stores import locks

    client = redis_or_skip()
    with prefix_on(client) as prefix:
        key = redis_keys.store_lock(prefix, "alice~s")
        assert locks.LEASE_MS < locks.WAIT_S * 1000  # a dead holder's lease frees in a wait
        client.set(key, b"dead-holder", px=400)
        started = time.monotonic()
        with RedisLocks(client, prefix).hold("alice~s"):
            assert 0.2 < time.monotonic() - started < 5
        client.set(key, b"dead-holder", px=8000)
        monkeypatch.setattr(locks, "WAIT_S", 0.2)
        with pytest.raises(Overloaded) as busy, RedisLocks(client, prefix).hold("alice~s"):
            pass
        assert 6 < busy.value.retry_after <= 8
        assert "store 's' has been written by another request" in str(busy.value)
        assert f"retry in {busy.value.retry_after:.0f} s" in str(busy.value)
    client.close()


def test_issue_53_finding_12_shards_are_on_disk_before_their_manifest(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 53, finding 12: an append's shard files (and its Gram file) were not fsynced
    before the manifest that names them was renamed into place, so a host crash could leave a
    manifest naming files the disk never got. Every file a committed manifest names, and the
    manifest itself, is synced before the manifest's rename."""
    store = files(tmp_path)
    store.create("s", spec())
    events: list[tuple[str, str]] = []
    real_fsync, real_mv = files_module.os.fsync, store.fs.mv

    def fsync(fd: int) -> None:
        events.append(("sync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def mv(src: str, dst: str, **kwargs: object) -> None:
        events.append(("rename", f"{os.path.basename(src)}>{os.path.basename(dst)}"))
        real_mv(src, dst, **kwargs)

    monkeypatch.setattr(files_module.os, "fsync", fsync)
    monkeypatch.setattr(store.fs, "mv", mv)
    x = np.random.default_rng(0).standard_normal((20, K)).astype(np.float32)
    store.append("s", spec(), list(range(20)), "int", x)
    manifest = store.manifest("s")
    named = [s.file for s in manifest.shards] + [manifest.gram or ""] + [MANIFEST]
    assert len(manifest.shards) == 3  # 7 rows a shard
    synced: set[str] = set()
    renamed: set[str] = set()
    for kind, what in events:
        if kind == "sync":
            synced.add(what)
            continue
        tmp, final = what.split(">")
        assert tmp in synced, f"{final} renamed into place before its bytes were synced"
        if final == MANIFEST:
            assert set(named[:-1]) <= renamed, "the manifest names a file not yet in place"
        renamed.add(final)
    assert MANIFEST in renamed


def test_a_query_holds_one_shard_at_a_time(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Past trak's weights' bytes (here one shard's), a trak query streams the shards."""
    dim, rows, shards = 256, 1024, 24  # 1 MiB of float32 a shard, 24 MiB in all
    monkeypatch.setattr(query, "TRAK_WEIGHTS_BYTES", rows * dim * 4)
    store = StoreFiles(str(tmp_path / "data"), ThreadLocks(), shard_bytes=rows * dim * 4)
    big = spec(dim=dim)
    store.create("s", big)
    rng = np.random.default_rng(6)
    for i in range(shards):
        store.append("s", big, list(range(i * rows, (i + 1) * rows)), "int",
                     rng.standard_normal((rows, dim)).astype(np.float32))
    q = rng.standard_normal((16, dim))
    tracemalloc.start()
    try:
        search(store, "s", "s", q, 10, "trak")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 5 * rows * dim * 4, peak  # a few shards' worth, not the store's 24


def test_replicas_never_use_what_they_kept_of_another_version(tmp_path: Path) -> None:
    """Ids and Gram matrices kept in memory between appends are valid for one commit of one
    store: another replica's commit, or the store deleted and made again, is read anew."""
    one, two = (StoreFiles(str(tmp_path / "data"), ThreadLocks()) for _ in range(2))
    one.create("s", spec())
    one.append("s", spec(), [1, 2], "int", np.ones((2, K), np.float32))
    assert two.delete("s")
    two.create("s", spec())
    x = np.arange(K, dtype=np.float32)[None, :]
    two.append("s", spec(), [1], "int", x)
    manifest = one.append("s", spec(), [2], "int", 2 * x)  # 2 is new to the new store
    assert one.ids("s", manifest) == {1, 2}
    phi = np.concatenate([x, 2 * x]).astype(np.float64)
    np.testing.assert_allclose(one.gram("s", manifest), phi.T @ phi, rtol=1e-12)
    manifest = two.append("s", spec(), [3], "int", 3 * x)  # after one's commit
    phi = np.concatenate([phi, 3 * x])
    np.testing.assert_allclose(two.gram("s", manifest), phi.T @ phi, rtol=1e-12)
    assert two.ids("s", manifest) == {1, 2, 3}
    with pytest.raises(Conflict):
        one.append("s", spec(), [3], "int", x)


def test_trak_on_full_gradients_sums_the_gram_once_and_refuses_one_too_wide(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store of full gradients keeps no Gram file: past its width in rows, trak sums
    Phi^T Phi from the rows once per committed state (answers equal numpy's); a store wider
    than MAX_EXACT_WIDTH is refused there with a 422 naming the scores that still work."""
    exact = StoreSpec(id="s", model="mlp@abc", loss="cross_entropy", params=("w",),
                      projection_dim=K, projection_seed=0, projection_kind="exact",
                      dtype="float32")
    store = files(tmp_path)
    store.create("s", exact)
    phi = np.random.default_rng(3).standard_normal((40, K)).astype(np.float32)
    store.append("s", exact, list(range(40)), "int", phi)
    assert store.manifest("s").gram is None
    q = np.random.default_rng(4).standard_normal((3, K))
    summed = []
    real = query._apart
    monkeypatch.setattr(query, "_apart", lambda *a: summed.append(1) or real(*a))
    for _ in range(2):
        found = search(store, "s", "s", q, 5, "trak")
        want_rows, want_scores = reference(phi.astype(np.float64), q, "trak", 5)
        np.testing.assert_array_equal(found.rows, want_rows)
        np.testing.assert_allclose(found.scores, want_scores, rtol=1e-5, atol=1e-7)
    assert len(summed) == 1  # the second query found it kept
    monkeypatch.setattr(query, "MAX_EXACT_WIDTH", K - 1)
    store.append("s", exact, [40], "int", phi[:1])  # a new state: the Gram is summed again
    with pytest.raises(InvalidInput, match="'dot' or 'cosine'"):
        search(store, "s", "s", q, 5, "trak")


def indexed_spec(factory: str = "IVF4,Flat") -> StoreSpec:
    return StoreSpec(id="s", model="mlp@abc", loss="cross_entropy", params=("w",),
                     projection_dim=K, projection_seed=0, projection_kind="kronecker",
                     dtype="float32", index=factory)


def assert_ranks_as_the_scan(store: StoreFiles, phi: np.ndarray, q: np.ndarray,
                             ks: tuple[int, ...] = (1, 10, 40)) -> None:
    """Through the index (searched in all its lists, so at full over-fetch) the top k of dot
    and trak equal the exact scan's; cosine scans."""
    for score in ("dot", "trak"):
        for k in ks:
            found = search(store, "s", "s", q, k, score)
            want_rows, want_scores = reference(phi.astype(np.float64), q, score, k)
            assert not found.exact
            np.testing.assert_array_equal(found.rows, want_rows)
            np.testing.assert_allclose(found.scores, want_scores, rtol=1e-5, atol=1e-6)
            assert search(store, "s", "s", q, k, score, exact=True).exact
    assert search(store, "s", "s", q, 5, "cosine").exact


def test_an_index_is_trained_once_and_each_commit_encodes_only_its_own_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store with an IVF index: none while too few rows train it (queries scan, and a commit
    reads no stored rows to try); the commit that can trains it once on every row and writes a
    piece per shard; later commits read no stored rows and write only their own shards'
    pieces; another process merges the pieces and ranks as the scan; a query holding an older
    state finds no row committed after it; DELETE takes it all."""
    indexed = indexed_spec()
    store = files(tmp_path)
    store.create("s", indexed)
    rng = np.random.default_rng(9)
    phi = rng.standard_normal((150, K)).astype(np.float32)
    q = rng.standard_normal((3, K))
    store.append("s", indexed, [0], "int", phi[:1])
    read: list[str] = []
    rows = StoreFiles.rows

    def counted(self: StoreFiles, key: str, *args: Any, **kwargs: Any) -> Any:
        read.append(key)
        return rows(self, key, *args, **kwargs)

    monkeypatch.setattr(StoreFiles, "rows", counted)
    store.append("s", indexed, [1, 2], "int", phi[1:3])  # 3 rows cannot train 4 lists
    assert store.manifest("s").index is None and not read
    monkeypatch.undo()
    assert search(store, "s", "s", q, 2, "dot").exact
    store.append("s", indexed, list(range(3, 100)), "int", phi[3:100])  # trains: seq 3
    folder = tmp_path / "data" / "stores" / "s"
    pieces = {p.name for p in folder.glob("shard-*.faiss")}
    shards = store.manifest("s").shards
    assert store.manifest("s").index == "trained-3.faiss"
    assert pieces == {s.file.removesuffix(".safetensors") + ".faiss" for s in shards}
    old = store.manifest("s")
    assert_ranks_as_the_scan(store, phi[:100], q)  # merges every piece into its live index
    monkeypatch.setattr(StoreFiles, "rows", counted)
    store.append("s", indexed, list(range(100, 150)), "int", phi[100:150])
    assert not read  # a commit after training reads no stored rows
    monkeypatch.undo()
    manifest = store.manifest("s")
    assert manifest.index == "trained-3.faiss" and len(manifest.shards) > len(shards)
    assert len(list(folder.glob("shard-*.faiss"))) == len(manifest.shards)
    assert_ranks_as_the_scan(store, phi, q)  # the live index, the new pieces merged in
    assert_ranks_as_the_scan(files(tmp_path), phi, q)  # another process: from the files
    stale = store.candidates("s", old, q, 10, None)
    assert stale is not None and stale.max() < old.count  # nothing the old state lacks
    every, one = (store.candidates("s", manifest, q, 10, p) for p in (None, 1))
    assert every is not None and one is not None
    assert (every >= 0).all() and (one < 0).any()  # all 4 lists searched, or only 1 of them
    store.delete("s")
    assert not folder.exists()


def test_a_store_indexed_before_pieces_scans_until_its_next_commit_trains_again(
        tmp_path: Path) -> None:
    """A manifest naming an index written whole (``index-<seq>.faiss``, before pieces): the
    store is not ``trained`` (what its GET's ``indexed`` says) and queries scan; its next
    commit trains the index again, after which queries go through it."""
    indexed = indexed_spec()
    files(tmp_path).create("s", indexed)
    phi = np.random.default_rng(7).standard_normal((120, K)).astype(np.float32)
    q = np.random.default_rng(8).standard_normal((2, K))
    files(tmp_path).append("s", indexed, list(range(100)), "int", phi[:100])
    path = tmp_path / "data" / "stores" / "s" / MANIFEST
    doc = json.loads(path.read_text())
    doc["index"] = f"index-{doc['seq']}.faiss"
    path.write_text(json.dumps(doc))
    store = files(tmp_path)  # another process: it reads the manifest as written
    assert store.manifest("s").index is not None and store.manifest("s").trained is None
    assert described(indexed, store.manifest("s"))["indexed"] is False
    assert search(store, "s", "s", q, 5, "dot").exact
    store.append("s", indexed, list(range(100, 120)), "int", phi[100:])
    assert store.manifest("s").trained == f"trained-{doc['seq'] + 1}.faiss"
    assert described(indexed, store.manifest("s"))["indexed"] is True
    assert_ranks_as_the_scan(store, phi, q)


def test_queries_racing_to_a_fresh_process_merge_each_piece_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four queries at once in a process that holds no index yet: each shard's piece is merged
    once (one index in memory, not one per query), and every query ranks as the scan."""
    from service.stores import index as index_file

    indexed = indexed_spec()
    files(tmp_path).create("s", indexed)
    phi = np.random.default_rng(5).standard_normal((90, K)).astype(np.float32)
    files(tmp_path).append("s", indexed, list(range(90)), "int", phi)
    store = files(tmp_path)
    merged: list[int] = []
    extend = index_file.Live.extend
    monkeypatch.setattr(index_file.Live, "extend",
                        lambda self, *a: merged.append(a[2]) or extend(self, *a))
    q = np.random.default_rng(6).standard_normal((2, K))
    start, found = threading.Barrier(4), []

    def query() -> None:
        start.wait()
        found.append(search(store, "s", "s", q, 5, "dot"))

    threads = [threading.Thread(target=query) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(merged) == 90 and len(merged) == len(store.manifest("s").shards)
    want_rows, _ = reference(phi.astype(np.float64), q, "dot", 5)
    for one in found:
        assert not one.exact
        np.testing.assert_array_equal(one.rows, want_rows)


def test_an_index_of_many_lists_finds_them_through_a_graph(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past GRAPH_LISTS lists, the live index searches its centroids through an HNSW graph
    instead of the flat quantizer it was trained with, and still ranks as the scan."""
    import faiss

    from service.stores import index as index_file

    monkeypatch.setattr(index_file, "GRAPH_LISTS", 4)
    indexed = indexed_spec()
    store = files(tmp_path)
    store.create("s", indexed)
    rng = np.random.default_rng(8)
    phi = rng.standard_normal((120, K)).astype(np.float32)
    store.append("s", indexed, list(range(120)), "int", phi)
    assert_ranks_as_the_scan(store, phi, rng.standard_normal((3, K)))
    live = store._live.find("s")
    assert live is not None
    quantizer = faiss.extract_index_ivf(live.index).quantizer
    assert isinstance(faiss.downcast_index(quantizer), faiss.IndexHNSWFlat)


def test_a_querys_gradients_are_preconditioned_a_few_rows_at_a_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """However few rows a chunk of ``CHUNK_BYTES`` holds, a query's preconditioned rows,
    flattened for a store of full gradients or sketched for a store of sketches, are those of
    all its rows at once."""
    from service.stores import factors

    store, exact = files(tmp_path), fitting_spec()
    store.create("f", exact)
    rows = np.random.default_rng(6).standard_normal((7, 10)).astype(np.float32)
    factors.add(store, [("f", exact, fitting_answer(rows))], LIMIT)
    factors.add_eigenvalues(store, [("f", exact, rows)], "f", LIMIT)
    curv = factors.curvature_of(store, "f", exact, "f")
    for kept in (exact, replace(exact, projection_dim=4, projection_kind="kronecker")):
        whole, used = factors.preconditioned(kept, curv, rows, "ekfac", None)
        with monkeypatch.context() as small:
            small.setattr(factors, "CHUNK_BYTES", 3 * 10 * 8)  # 3 rows of 10 float64 values
            parts, again = factors.preconditioned(kept, curv, rows, "ekfac", None)
        assert whole.shape == (7, kept.projection_dim) and again == used
        np.testing.assert_allclose(parts, whole, rtol=1e-12, atol=0)


def test_factors_not_finite_are_refused_and_a_damping_too_small_is_a_422(
        tmp_path: Path) -> None:
    """A batch whose factors overflowed (an input of 2e19: its a a^T passes float32) is
    refused, the file as it was (it was kept: every kfac query after answered null scores or
    a 500); a damping so small that the preconditioned query is not finite is a 422 (it was a
    500 from the ranking of NaN scores), and NaN scores rank last rather than fail."""
    from service.stores import factors

    store, exact = files(tmp_path), fitting_spec()
    store.create("f", exact)
    rows = np.random.default_rng(6).standard_normal((2, 10)).astype(np.float32)
    flat = fitting_answer(rows)  # factors of rank one: zero eigenvalues
    flat["kfac_inputs"]["fc1.weight"] = np.outer(np.arange(1.0, 5.0), np.arange(1.0, 5.0))
    flat["kfac_grads"]["fc1.weight"] = np.outer([1.0, 2.0], [1.0, 2.0])
    factors.add(store, [("f", exact, flat)], LIMIT)
    before = store.read_file("f", factors.FILE)
    bad = fitting_answer(rows)
    bad["kfac_inputs"]["fc1.weight"] = np.full((4, 4), np.inf)
    with pytest.raises(NonFinite, match="store 'f': this batch's factors are not finite "
                       r"\(inputs/fc1.weight"):
        factors.add(store, [("f", exact, bad)], LIMIT)
    assert store.read_file("f", factors.FILE) == before
    curv = factors.curvature_of(store, "f", exact, "f")
    with pytest.raises(InvalidInput, match=r"'damping' 9\.99989e-321 is too small for store "
                       r"'f''s factors"):
        factors.preconditioned(exact, curv, rows, "kfac", 1e-320)
    assert np.isfinite(factors.preconditioned(exact, curv, rows, "kfac", None)[0]).all()
    scores = np.array([[1.0, np.nan, 3.0, np.nan, 2.0]])
    found = query._best(scores, np.arange(5)[None, :], 2)
    assert sorted(found[1][0].tolist()) == [2, 4]


@pytest.mark.parametrize("budget", [1, 1 << 30])
def test_indexes_past_the_memory_budget_go_least_recently_queried_first(
        tmp_path: Path, budget: int, caplog: pytest.LogCaptureFixture) -> None:
    """Each store's index in memory weighs its trained index and its rows' codes and ids; past
    ``index_bytes`` the least recently queried store's is evicted (logged) and made again by its
    next query, which still ranks as the scan; the one in use stays whatever it weighs, and
    under the budget both stay."""
    caplog.set_level(logging.INFO, logger=files_module.__name__)
    store = StoreFiles(str(tmp_path / "data"), ThreadLocks(), shard_bytes=7 * K * 4,
                       index_bytes=budget)
    rng = np.random.default_rng(9)
    phis = {}
    for name in ("a", "b"):
        indexed = replace(indexed_spec(), id=name)
        store.create(name, indexed)
        phis[name] = rng.standard_normal((60, K)).astype(np.float32)
        store.append(name, indexed, list(range(60)), "int", phis[name])
    q = rng.standard_normal((3, K))
    for name in ("a", "b", "a"):
        found = search(store, name, name, q, 10, "dot")
        want_rows, _ = reference(phis[name].astype(np.float64), q, "dot", 10)
        assert not found.exact
        np.testing.assert_array_equal(found.rows, want_rows)
        live = store._live.find(name)
        assert live is not None and live.rows == 60
        assert live.held_bytes > 60 * (K * 4 + 8)  # IVF4,Flat: each row's float32 code and its id
    evicted = "indexes of 1 stores evicted from memory" in caplog.text
    assert ("b" in store._live, evicted) == ((False, True) if budget == 1 else (True, False))


@pytest.mark.parametrize("factory", ["HNSW8", "IVF4,Flat", "RR16,IVF4,Flat"])
def test_an_index_without_pieces_encodes_the_stored_rows(
        tmp_path: Path, factory: str, caplog: pytest.LogCaptureFixture) -> None:
    """An index FAISS cannot merge (HNSW) writes no pieces and adds the shards' stored rows; an
    IVF index (behind a rotation, too) whose piece is lost or corrupt says so in the log and
    does the same: either way the top k equal the scan's."""
    indexed = indexed_spec(factory)
    store = files(tmp_path)
    store.create("s", indexed)
    rng = np.random.default_rng(4)
    phi = rng.standard_normal((60, K)).astype(np.float32)
    store.append("s", indexed, list(range(60)), "int", phi)
    folder = tmp_path / "data" / "stores" / "s"
    pieces = sorted(folder.glob("shard-*.faiss"))
    if factory.startswith("HNSW"):
        assert not pieces
    else:
        pieces[0].unlink()
        pieces[1].write_bytes(b"not an index")
        pieces[2].write_bytes(pieces[3].read_bytes())  # another shard's rows
    hnsw = factory.startswith("HNSW")  # a graph: exact at small k only
    assert_ranks_as_the_scan(files(tmp_path), phi, rng.standard_normal((3, K)),
                             (1, 10) if hnsw else (1, 10, 40))
    logged = [r.getMessage() for r in caplog.records if "index piece" in r.getMessage()]
    assert len(logged) == (0 if hnsw else 3), logged


def fitting_spec() -> StoreSpec:
    """A store of full gradients of a linear layer ``fc1`` [2, 3] with its bias (8 values)
    and one more parameter ``scale`` [2] outside any layer."""
    return StoreSpec(id="f", model="mlp@abc", loss="cross_entropy",
                     params=("fc1.weight", "fc1.bias", "scale"), projection_dim=10,
                     projection_seed=0, projection_kind=EXACT, dtype="float32",
                     shapes={"fc1.weight": [2, 3], "fc1.bias": [2], "scale": [2]})


def fitting_answer(rows: np.ndarray, layers: tuple[str, ...] = ("fc1.weight",), seed: int = 0
                   ) -> dict[str, Any]:
    """A first-pass answer for gradient ``rows`` ``[n, 10]``: the factors (means over its
    samples; ``fc1`` with its bias column), and the gradients' mean and variance."""
    rng = np.random.default_rng(seed)
    a, g = rng.standard_normal((4, 4)), rng.standard_normal((2, 2))
    split = dict(zip(fitting_spec().params, np.split(rows.astype(np.float64), [6, 8], axis=1),
                     strict=True))
    return {"batch_size": len(rows), "kfac_inputs": {w: a @ a.T for w in layers},
            "kfac_grads": {w: g @ g.T for w in layers},
            "kfac_tokens": {w: np.float64(1.0) for w in layers},
            "mean": {k: v.mean(0) for k, v in split.items()},
            "variance": {k: v.var(0) for k, v in split.items()}}


def test_factors_of_an_ensemble_are_added_to_every_checkpoint_or_to_none(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch whose layers one checkpoint's factors do not cover is refused there, and the
    other checkpoint's file is left as it was; so is a batch past the size limit; the file
    does not grow with the samples fitted."""
    from service.stores import factors

    store = files(tmp_path)
    for key in ("a", "b"):
        store.create(key, fitting_spec())
    rows = np.ones((2, 10), np.float32)
    first = factors.add(store, [("b", fitting_spec(), fitting_answer(rows))], LIMIT)
    assert (first.samples, first.writes, first.layers) == (2, 1, ["fc1.weight"])
    before = store.read_file("b", factors.FILE)
    assert before is not None
    with pytest.raises(Conflict, match=r"cover the layers fc1\.weight"):  # this one: none
        factors.add(store, [("a", fitting_spec(), fitting_answer(rows, ())),
                            ("b", fitting_spec(), fitting_answer(rows, ()))], LIMIT)
    assert factors.fitted(store, "a") is None and store.read_file("b", factors.FILE) == before
    with pytest.raises(TooLarge, match="PSGRAD_MAX_FACTORS_BYTES") as refused:
        factors.add(store, [("a", fitting_spec(), fitting_answer(rows)),
                            ("b", fitting_spec(), fitting_answer(rows))], len(before) - 1)
    assert refused.value.details["size"] == len(before)
    assert factors.fitted(store, "a") is None and store.read_file("b", factors.FILE) == before
    both = factors.add(store, [("a", fitting_spec(), fitting_answer(rows)),
                               ("b", fitting_spec(), fitting_answer(rows))], LIMIT)
    assert (both.samples, both.writes) == (2, 1)  # a's own first batch
    assert factors.fitted(store, "b") == factors.Fitted(4, 2, ["fc1.weight"], 0, 2)
    assert len(store.read_file("b", factors.FILE) or b"") == len(before)
    # a batch id counted is refused for every checkpoint, nothing written; a pass remembers
    # its last RECENT ids
    monkeypatch.setattr(factors, "RECENT", 2)
    again = [(k, fitting_spec(), fitting_answer(rows)) for k in "ab"]
    for batch_id in ("x1", "x2"):
        factors.add(store, again, LIMIT, batch_id)
    held = [store.read_file(k, factors.FILE) for k in "ab"]
    with pytest.raises(Conflict, match="counted batch 'x1' already") as counted:
        factors.add(store, again, LIMIT, "x1")
    assert counted.value.details == {"batch_id": "x1", "counted": True}
    assert [store.read_file(k, factors.FILE) for k in "ab"] == held
    factors.add(store, again, LIMIT, "x3")
    assert factors.fitted(store, "b").batches == ("x2", "x3")  # type: ignore[union-attr]
    factors.add(store, again, LIMIT, "x1")  # forgotten: counted as a new batch
    assert factors.fitted(store, "a").samples == 10  # type: ignore[union-attr]


def test_eigenvalues_are_second_moments_in_the_bases_of_the_factors_as_they_are(
        tmp_path: Path) -> None:
    """The second pass adds each sample's ``(Q_S^T G Q_A)^2`` in the bases of the first pass's
    sums (EK-FAC's eigenvalues by their definition, against numpy's eigendecomposition), and
    ``scale`` gets its diagonal Fisher from the first pass's means and variances (``E[g^2]``
    of every sample of both batches); a first-pass batch after it drops
    them (409 for ``ekfac``, ``kfac`` still answered); a store without factors and a file of an
    earlier psgrad are 409s."""
    import torch

    from service import curvature
    from service.stores import factors

    store, spec_ = files(tmp_path), fitting_spec()
    store.create("f", spec_)
    rng = np.random.default_rng(5)
    rows = [rng.standard_normal((n, 10)).astype(np.float32) for n in (3, 4)]
    with pytest.raises(Conflict, match="POST /stores/f/factors"):
        factors.add_eigenvalues(store, [("f", spec_, rows[0])], "f", LIMIT)
    answers = [fitting_answer(part, seed=i) for i, part in enumerate(rows, 1)]
    for answer in answers:
        factors.add(store, [("f", spec_, answer)], LIMIT)
    for part in rows:
        done = factors.add_eigenvalues(store, [("f", spec_, part)], "f", LIMIT)
    assert (done.samples, done.eigenvalues, done.writes, done.basis) == (7, 7, 4, 2)

    every = np.concatenate(rows).astype(np.float64)
    inputs = sum(a["kfac_inputs"]["fc1.weight"] * len(r) for a, r in zip(answers, rows,
                                                                        strict=True))
    grads = sum(a["kfac_grads"]["fc1.weight"] * len(r) for a, r in zip(answers, rows,
                                                                      strict=True))
    q_a = np.linalg.eigh(inputs / 7)[1]
    q_s = np.linalg.eigh(grads / 7)[1]
    g = np.concatenate([every[:, :6].reshape(7, 2, 3), every[:, 6:8, None]], axis=2)  # bias last
    want = (np.einsum("so,nsi,ij->noj", q_s, g, q_a) ** 2).mean(0)
    curv = factors.curvature_of(store, "f", spec_, "f")
    np.testing.assert_allclose(curv.corrected["fc1.weight"].numpy(), want, rtol=1e-6)
    np.testing.assert_allclose(curv.diagonal["scale"].numpy(), (every[:, 8:] ** 2).mean(0),
                               rtol=1e-6)
    assert set(curv.diagonal) == {"scale"}
    query = every[:2]
    for kind in curvature.KINDS:
        got, used = factors.preconditioned(spec_, curv, query, kind, None)
        assert used == pytest.approx(curv.default_damping(kind)) and got.shape == (2, 10)

    factors.add(store, [("f", spec_, answers[0])], LIMIT)
    again = factors.curvature_of(store, "f", spec_, "f")
    assert not again.corrected and factors.fitted(store, "f").eigenvalues == 0  # type: ignore[union-attr]
    with pytest.raises(Conflict, match="POST /stores/f/factors/eigenvalues"):
        factors.preconditioned(spec_, again, query, "ekfac", None)
    assert factors.preconditioned(spec_, again, query, "kfac", None)[0].shape == (2, 10)

    old = {"rows": np.zeros((1, 10), np.float32), "inputs/fc1.weight": np.eye(4)}
    from safetensors.numpy import save as st_save
    store.write_file("f", factors.FILE, st_save(old, metadata={"samples": "1", "writes": "1"}))
    with pytest.raises(Conflict, match="earlier psgrad"):
        factors.curvature_of(store, "f", spec_, "f")
    assert torch.is_tensor(again.diagonal["scale"])
