"""Top-k queries over a store, streamed one shard at a time.

The scores of a test sample's row ``q`` against a store's row ``phi_i`` (both made with the
store's model version, loss, parameters and projection: sketches, or full gradients flattened):

- ``dot``: ``<q, phi_i>``, TracIn's score (one checkpoint, unit step);
- ``cosine``: ``<q, phi_i> / (|q| |phi_i|)`` (0 where a norm is 0);
- ``trak``: ``q^T (Phi^T Phi + lambda I)^-1 phi_i``, TRAK's score (its ``Phi^T Phi`` is the Gram
  matrix of every committed row, accumulated in float64 as batches are committed; a store of
  full gradients sums it from its rows where it needs one, :func:`gram_of`). ``lambda``
  is the query's, else :data:`LAMBDA_RULE`: the mean eigenvalue ``trace(Phi^T Phi) / k``, with
  no row counting for more than all the others together (so one extreme row cannot set it); a
  rule that reads the store alone, never a retrained model;
- ``self_influence``: ``|phi_i|^2``, the store ranked by itself (no test samples);
- ``kfac``, ``ekfac``: ``g_q^T (F + damping I)^-1 g_i`` with the store's K-FAC or EK-FAC Fisher
  (:mod:`service.stores.factors`): the query's full gradient preconditioned there (and
  sketched as the rows are, on a store of sketches), then scored as ``dot``.

Each shard's rows are widened to float32 and multiplied by the queries (one GEMM per shard; each
query scaled by a power of two to entries below 1 first, and its scores scaled back in float64,
so that no lambda underflows the query to zeros); the
best ``k`` of each query are kept as the shards go by, so memory holds one shard, its ``[queries,
shard rows]`` scores and the running best, never the store (save ``trak``'s weights, kept up to
:data:`TRAK_WEIGHTS_BYTES` per store: :func:`trak_by_rows`). Ties go to the earlier row.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import numpy as np
from scipy.linalg import cho_factor, cho_solve

from psgrad._contract import Field, shown
from psgrad._errors import BadRequest, Conflict, InvalidInput
from service.stores.files import Manifest, StoreFiles, widened
from service.stores.index import INDEXED, PROBES
from service.stores.spec import MAX_EXACT_WIDTH

Score = Literal["dot", "cosine", "trak", "self_influence", "kfac", "ekfac"]
SCORES: tuple[str, ...] = get_args(Score)
LAMBDA_RULE = "trace(Phi^T Phi) / k, no row counting for more than all the others"
# A query's numbers, declared once, as the request contract declares its fields: the door's
# schema is made of them (``QueryBody``), and the route holds a query to them (400 for the
# wrong type, 422 for a number out of range).
QUERY_NUMBERS = {f.name: f for f in (
    Field("k", "int", "the best k training samples of each query", default=10, ge=1),
    Field("lambda", "float", f"trak only; default: {LAMBDA_RULE} together", ge=0.0),
    Field("damping", "float", "kfac and ekfac only; default: a tenth of the fitted Fisher's "
          "mean eigenvalue", gt=0.0),
    Field("probes", "int", "an IVF index's lists searched per query (FAISS's nprobe; default "
          f"{PROBES}): more for recall, fewer for speed", ge=1),
)}
BLOCK_ROWS = 16384  # rows widened to float32 at once: 64 MiB at k = 1024
# trak's weights of a store of more rows than k are kept up to this size (32768 rows at k =
# 1024, 8192 at k = 4096); past it a query solves with the k x k factor, 2k / N of its scan
# (a store of at most k rows keeps weights of at most that factor's size: 512 MiB at 8192)
TRAK_WEIGHTS_BYTES = 256 << 20


@dataclass(frozen=True)
class Found:
    """A query's answer: global row numbers and scores ``[queries, k]``, best first."""

    manifest: Manifest
    rows: np.ndarray
    scores: np.ndarray
    lam: float | list[float] | None = None  # of a trak query (an ensemble's: one per model)
    exact: bool = True  # every row scored (False: the index's candidates, ranked exactly)


def check_score(score: object) -> str:
    """``score`` as one of :data:`SCORES`: 400 for what is no string (``null``, ``5``), 422 for a
    string that names none, as the request contract answers a choice."""
    if not isinstance(score, str):
        raise BadRequest(f"'score' must be a string, one of {', '.join(SCORES)}; got "
                         f"{shown(score)}", known=list(SCORES))
    if score not in SCORES:
        raise InvalidInput(f"unknown score {score!r}; known: {', '.join(SCORES)}",
                           known=list(SCORES))
    return str(score)


def check_k(manifest: Manifest, k: int, store_id: str) -> None:
    if manifest.count == 0:
        raise Conflict(f"store '{store_id}' is empty: add samples with POST "
                       f"/stores/{store_id}/samples first")
    if k > manifest.count:
        raise InvalidInput(f"k={k} but store '{store_id}' holds {manifest.count} samples: ask "
                           f"for k <= {manifest.count}", k=k, samples=manifest.count)


@dataclass(frozen=True)
class Largest:
    """The store's largest self-influence ``|phi_i|^2`` (``top``, of row ``row``) and the sum
    of all the others' (``rest``)."""

    top: float = 0.0
    rest: float = 0.0
    row: int = -1

    @property
    def dominates(self) -> bool:
        """That row holds more than all the others together."""
        return self.top > self.rest > 0


def default_lambda(width: int, largest: Largest) -> float:
    """:data:`LAMBDA_RULE`: ``trace(Phi^T Phi) / k`` (the rows' summed squared norms over their
    width k) unless the largest row :attr:`~Largest.dominates`; then ``2 rest / k``, as if that
    row held only as much as the rest (robust to one extreme row; TRAK scored best at 1 to 10
    times the mean eigenvalue). A store of one nonzero row has no rest: ``trace / k``. 1.0 for
    an all-zero store (any positive value then serves)."""
    trace = 2 * largest.rest if largest.dominates else largest.top + largest.rest
    lam = trace / width
    return lam if lam > 0 else 1.0


def gram_of(files: StoreFiles, key: str, manifest: Manifest, width: int) -> np.ndarray:
    """``Phi^T Phi`` in float64: a sketched store's, kept with each commit; a store of full
    gradients keeps none (most are reference sets, scored by their rows' kernel), so it is
    summed from the rows once per committed state, for stores of more rows than their width
    and at most :data:`MAX_EXACT_WIDTH` wide."""
    gram = files.gram(key, manifest)
    if gram is not None:
        return gram
    if width > MAX_EXACT_WIDTH:
        raise InvalidInput(f"score 'trak' on a store of full gradients with more rows "
                           f"({manifest.count}) than values per row ({width}) factors a "
                           f"[{width}, {width}] matrix; at most {MAX_EXACT_WIDTH} wide: ask for "
                           "'dot' or 'cosine', or keep sketches (a store with projection_dim)",
                           width=width, limit=MAX_EXACT_WIDTH)
    summed: np.ndarray = files.kept("gram", key, manifest,
                                    lambda: _apart(files, key, manifest, -1, width)[0])
    return summed


def largest_row(files: StoreFiles, key: str, manifest: Manifest) -> Largest:
    """The store's :class:`Largest` row, from the shards' norms alone (kept until the next
    commit); summed without subtracting, so that a rest of 800 beside a row of 1e36 is not
    lost to rounding."""
    found: Largest = files.kept("largest", key, manifest,
                                lambda: _largest(files, key, manifest))
    return found


def _largest(files: StoreFiles, key: str, manifest: Manifest) -> Largest:
    top, rest, row = 0.0, 0.0, -1
    for offset, norms in files.norms(key, manifest):
        power = np.square(norms)
        if not len(power):
            continue
        i = int(np.argmax(power))
        if power[i] > top:
            rest += top + float(power[:i].sum() + power[i + 1:].sum())
            top, row = float(power[i]), offset + i
        else:
            rest += float(power.sum())
    return Largest(top, rest, row)


@dataclass(frozen=True)
class TrakSolver:
    """``(Phi^T Phi + lam I)^-1`` for one committed state and ``lam``, factored once
    (Cholesky, float64) and kept until the next commit, so that a query costs two triangular
    solves of its sketches (``k^2`` per query, like scoring ``k`` rows) instead of a ``k^3``
    factorisation: 0.27 s for 100 queries at k = 8192 where a solve took 9.6 s.

    Where one row ``u`` holds more than all the others together, its share of the summed Gram
    matrix can round theirs away (a row of self-influence 1.8e20 made Phi^T Phi singular in
    float64), so it is kept ``apart``: ``Phi^T Phi = G + u u^T``, with ``G`` summed again from the
    other rows (one pass over the store), and Sherman-Morrison adds ``u`` back exactly, with ``v
    = u / |u|``, ``A = G + lam I``, ``x = A^-1 q``, ``w = A^-1 v``: ``(A + |u|^2 v v^T)^-1 q = x -
    w (v.x) / (1 / |u|^2 + v.w)``. Its own score ``|u| (v.x) / (1 + |u|^2 v.w)`` is computed so
    too: the product of a row of 1e10 with a solved query's tiny share along it would be
    rounding alone."""

    factor: tuple[np.ndarray, bool]  # scipy's cho_factor of A
    v: np.ndarray | None = None  # the row kept apart, as a unit vector
    w: np.ndarray | None = None  # A^-1 v
    top: float = 0.0  # |u|^2

    def solve(self, q: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """``(Phi^T Phi + lam I)^-1 q^T`` for each query row of ``q``, as rows; and the scores
        ``[queries]`` of the row kept apart (None where none is)."""
        x = cho_solve(self.factor, q.T, check_finite=False)
        if self.v is None or self.w is None:
            return x.T, None
        vx, vw = self.v @ x, float(self.v @ self.w)
        return ((x - np.outer(self.w, vx / (1.0 / self.top + vw))).T,
                np.sqrt(self.top) * vx / (1.0 + self.top * vw))


def trak_solver(files: StoreFiles, key: str, manifest: Manifest, gram: np.ndarray,
                largest: Largest, lam: float) -> TrakSolver:
    """The :class:`TrakSolver` of the store as ``manifest`` commits it, for ``lam``."""
    solver: TrakSolver = _held(files, key, manifest, "k-space", lam, lambda: _trak_solver(
        files, key, manifest, gram, largest, lam))
    return solver


def weighed(count: int, k: int, largest: Largest, indexed: bool) -> bool:
    """Whether ``trak`` scores a store of ``count`` rows of ``k`` values by its rows' weights
    (:func:`trak_by_rows`): always where ``count <= k``; past k while the weights take at most
    :data:`TRAK_WEIGHTS_BYTES`, no row dominates (its score is then computed apart, on the
    solved query) and the query does not go through an index (which searches solved queries)."""
    return count <= k or (8 * count * k <= TRAK_WEIGHTS_BYTES and not largest.dominates
                          and not indexed)


def trak_by_rows(files: StoreFiles, key: str, manifest: Manifest, q: np.ndarray,
                 lam: float) -> np.ndarray:
    """``trak``'s scores ``[queries, N]`` of a store of ``N`` rows by their ``k x N`` weights
    ``W = (Phi^T Phi + lam I)^-1 Phi^T``, made once per committed state and ``lam`` (in float64),
    so that a query is one product ``q W``, as a ``dot`` query is ``q Phi^T``: TRAK's features,
    with no solve per query. Where ``N <= k`` they are made by the push-through identity ``W =
    Phi^T (Phi Phi^T + lam I)^-1`` (the rows' ``N x N`` kernel factored, then solved for
    ``Phi``), else by factoring ``Phi^T Phi + lam I`` and solving for ``Phi^T``. ``lam = 0`` is
    refused where ``N < k``, as ``Phi^T Phi`` is then singular."""
    count, width = manifest.count, q.shape[1]
    if lam == 0 and count < width:
        raise _singular(lam)

    def weights() -> np.ndarray:
        phi = np.concatenate([rows.astype(np.float64) for _, rows, _ in
                              files.rows(key, manifest)])
        if count <= width:
            kernel = _factor(phi @ phi.T + lam * np.eye(count), lam)
            return np.asarray(cho_solve(kernel, phi, check_finite=False).T)
        gram = gram_of(files, key, manifest, width) + lam * np.eye(width)
        return np.asarray(cho_solve(_factor(gram, lam), phi.T, overwrite_b=True,
                                    check_finite=False))

    scores: np.ndarray = q @ _held(files, key, manifest, "rows", lam, weights)
    return scores


def _held(files: StoreFiles, key: str, manifest: Manifest, kind: str, lam: float,
          make: Callable[[], Any]) -> Any:
    """``make()``, the ``kind`` of factor for this committed state and ``lam``, made once and
    kept until the next commit; one factor per store (a few stores), in one memo slot for
    both kinds, so that a store grown past what its weights may take (:func:`weighed`) drops
    them."""
    held: dict[tuple[str, float], Any] = files.kept("trak", key, manifest, dict)
    found = held.get((kind, lam))
    if found is None:
        found = make()
        held.clear()
        held[(kind, lam)] = found
    return found


def _trak_solver(files: StoreFiles, key: str, manifest: Manifest, gram: np.ndarray,
                 largest: Largest, lam: float) -> TrakSolver:
    eye = np.eye(len(gram))
    if not largest.dominates:
        return TrakSolver(_factor(gram + lam * eye, lam))
    rest, u = _apart(files, key, manifest, largest.row, len(gram))
    factor = _factor(rest + lam * eye, lam)
    v = u / np.sqrt(largest.top)
    return TrakSolver(factor, v, cho_solve(factor, v, check_finite=False), largest.top)


def _factor(a: np.ndarray, lam: float) -> tuple[np.ndarray, bool]:
    try:
        factor: tuple[np.ndarray, bool] = cho_factor(a, lower=True, overwrite_a=True,
                                                     check_finite=False)
    except np.linalg.LinAlgError:
        raise _singular(lam) from None
    return factor


def _singular(lam: float) -> InvalidInput:
    return InvalidInput(f"Phi^T Phi + {lam + 0.0:g} I is singular: send a 'lambda' > 0, or "
                        "leave it out for the default")  # + 0.0: -0.0 reads as 0


def _apart(files: StoreFiles, key: str, manifest: Manifest, row: int, k: int
           ) -> tuple[np.ndarray, np.ndarray]:
    """(the Gram matrix of every row but ``row``, in float64; that row)."""
    gram, kept = np.zeros((k, k)), np.zeros(k)
    for offset, rows, _ in files.rows(key, manifest):
        wide = rows.astype(np.float64)
        if offset <= row < offset + len(wide):
            kept = wide[row - offset].copy()
            wide[row - offset] = 0.0
        gram += wide.T @ wide
    return gram, kept


def search(files: StoreFiles, key: str, store_id: str, sketches: np.ndarray | None, k: int,
           score: str, lam: float | None = None, exact: bool | None = None,
           probes: int | None = None) -> Found:
    """The best ``k`` rows of each query over what the store has committed now: through its
    index where it has one and the score allows (searching ``probes`` of an IVF index's
    lists), unless ``exact``."""
    return search_all(files, [key], store_id, [sketches], k, score, lam, exact, probes)


def search_all(files: StoreFiles, keys: list[str], store_id: str,
               queries: list[np.ndarray | None], k: int, score: str, lam: float | None = None,
               exact: bool | None = None, probes: int | None = None) -> Found:
    """:func:`search` of one store (``keys`` of one), or of an ensemble: each checkpoint's
    store scored with that checkpoint's rows of the queries (``queries``, one per key), every
    row, and the best ``k`` of the sums (TRAK's ensemble: the scores summed over models),
    over one commit of every checkpoint (:meth:`StoreFiles.states`); the answer is exact, its
    ``lam`` one per checkpoint for ``trak``."""
    for attempt in range(3):
        manifests = files.states(keys)
        check_k(manifests[0], k, store_id)
        try:
            if len(keys) == 1:
                return _search(files, keys[0], manifests[0], queries[0], k, score, lam,
                               exact is not True, probes)
            return _summed(files, keys, manifests, queries, k, score, lam)
        except FileNotFoundError:  # its Gram file was replaced meanwhile: read the new state
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _summed(files: StoreFiles, keys: list[str], manifests: list[Manifest],
            queries: list[np.ndarray | None], k: int, score: str, lam: float | None) -> Found:
    """An ensemble's best ``k`` rows: each checkpoint scored exactly, the scores summed."""
    parts = []
    for key, manifest, q in zip(keys, manifests, queries, strict=True):
        found = _search(files, key, manifest, q, manifest.count, score, lam, False, None)
        full = np.empty(found.rows.shape)  # [queries, rows] in row order
        np.put_along_axis(full, found.rows, found.scores, 1)
        parts.append(replace(found, scores=full))
    best = Best(len(parts[0].scores), k)
    best.add(np.add.reduce([p.scores for p in parts]), 0)
    lams = [p.lam for p in parts]
    return Found(parts[0].manifest, *best.result(),
                 lam=[float(x) for x in lams if isinstance(x, float)] or None)


def _search(files: StoreFiles, key: str, manifest: Manifest, sketches: np.ndarray | None,
            k: int, score: str, lam: float | None, approximate: bool, probes: int | None
            ) -> Found:
    best = Best(1 if sketches is None else len(sketches), k)
    if score == "self_influence":
        for offset, norms in files.norms(key, manifest):
            best.add(np.square(norms)[None, :], offset)
        return Found(manifest, *best.result())
    assert sketches is not None
    q: np.ndarray = sketches.astype(np.float64)
    apart: tuple[int, np.ndarray] | None = None  # a row scored on its own: (row, its scores)
    if score == "trak":
        width = q.shape[1]
        largest = largest_row(files, key, manifest)
        lam = default_lambda(width, largest) if lam is None else lam
        indexed = approximate and manifest.trained is not None
        if weighed(manifest.count, width, largest, indexed):  # score by the rows' weights
            best.add(trak_by_rows(files, key, manifest, q, lam), 0)
            return Found(manifest, *best.result(), lam=lam)
        q, own = trak_solver(files, key, manifest, gram_of(files, key, manifest, width),
                             largest, lam).solve(q)
        apart = None if own is None else (largest.row, own)
    rows = (files.candidates(key, manifest, q, k, probes)
            if approximate and score in INDEXED and apart is None else None)
    if rows is not None and ((rows >= 0).sum(axis=1) >= k).all():  # else too few: scan
        wanted = np.unique(rows[rows >= 0])
        qm, scale = _scaled(q)  # their exact scores, as the scan below makes them
        every = (qm @ files.rows_at(key, manifest, wanted).T) * scale  # [queries, wanted]
        scores = np.take_along_axis(every, np.searchsorted(wanted, np.maximum(rows, 0)), 1)
        best.add_rows(np.where(rows >= 0, scores, -np.inf), rows)
        return Found(manifest, *best.result(), lam=lam if score == "trak" else None,
                     exact=False)
    if score == "cosine":
        size = np.linalg.norm(q, axis=1, keepdims=True)
        q = np.divide(q, size, out=np.zeros_like(q), where=size > 0)
    qm, scale = _scaled(q)
    for offset, rows, norms in files.rows(key, manifest):
        for a in range(0, len(rows), BLOCK_ROWS):  # widened a block at a time
            scores = (qm @ widened(rows[a:a + BLOCK_ROWS]).T) * scale
            if score == "cosine":
                part = norms[a:a + BLOCK_ROWS]
                scores = np.divide(scores, part, out=np.zeros(scores.shape), where=part > 0)
            if apart is not None and 0 <= apart[0] - offset - a < scores.shape[1]:
                scores[:, apart[0] - offset - a] = apart[1]
            best.add(scores, offset + a)
    return Found(manifest, *best.result(), lam=lam if score == "trak" else None)


def _scaled(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``q`` in float32 for a GEMM against the rows, and the scale its scores are multiplied by
    (in float64): each query scaled by a power of two (exact) to entries in [0.5, 1), so that
    in float32 it neither underflows (a trak query over a large lambda) nor overflows against
    rows of self-influence at most MAX_SELF_INFLUENCE."""
    scale = np.ldexp(1.0, np.frexp(np.abs(q).max(axis=1, initial=0.0))[1])[:, None]
    return (q / scale).astype(np.float32), scale


class Best:
    """The ``k`` best scores of each of ``queries`` rows so far, with their row numbers."""

    def __init__(self, queries: int, k: int) -> None:
        self.k = k
        self.scores = np.empty((queries, 0))
        self.rows = np.empty((queries, 0), np.int64)

    def add(self, scores: np.ndarray, offset: int) -> None:
        self.add_rows(scores, np.broadcast_to(np.arange(offset, offset + scores.shape[1]),
                                              scores.shape))

    def add_rows(self, scores: np.ndarray, rows: np.ndarray) -> None:
        """Scores ``[queries, n]`` of the rows numbered ``rows`` (the same shape)."""
        scores, rows = _best(scores, rows, self.k)
        self.scores, self.rows = _best(np.concatenate([self.scores, scores], 1),
                                       np.concatenate([self.rows, rows], 1), self.k)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, scores), best first, ties by row."""
        order = np.lexsort((self.rows, -self.scores), axis=1)
        return (np.take_along_axis(self.rows, order, 1),
                np.take_along_axis(self.scores, order, 1))


def _best(scores: np.ndarray, rows: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` highest of each row of ``scores`` (ties: the lower row number), unordered; a
    score that is not a number ranks last."""
    if np.isnan(scores.max(initial=-np.inf)):  # one reduction; a copy only where one is NaN
        scores = np.where(np.isnan(scores), -np.inf, scores)
    n = scores.shape[1]
    if n <= k:
        return scores, rows
    kth = np.partition(scores, n - k, axis=1)[:, n - k : n - k + 1]
    keep = scores >= kth
    if (keep.sum(1) == k).all():  # no tie at the k-th score: one gather
        return scores[keep].reshape(-1, k), rows[keep].reshape(-1, k)
    out_s, out_r = np.empty((len(scores), k)), np.empty((len(scores), k), np.int64)
    for i in range(len(scores)):
        idx = np.flatnonzero(keep[i])
        idx = idx[np.lexsort((rows[i, idx], -scores[i, idx]))[:k]]
        out_s[i], out_r[i] = scores[i, idx], rows[i, idx]
    return out_s, out_r
