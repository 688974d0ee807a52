"""A gradient store's approximate top-k index: FAISS over the store's rows, inner product.

``PUT /stores/{id}`` may name a FAISS factory string (``"IVF1024,Flat"``, ``"IVF4096,SQ4"``,
``"HNSW32"``, ...). The commit that first holds enough rows trains an empty index on them and
writes it once (``trained-<seq>.faiss``, FAISS's own binary format, never a pickle); from then on
every commit encodes only its own rows, one piece per shard beside it (``shard-<uuid>.faiss``:
the trained index holding that shard's rows, FAISS's ids being the global row numbers), so an
append costs the same at ten rows as at ten million. A process answering queries keeps one
:class:`Live` index per store in memory, the trained index with every piece merged in, and
merges each new commit's pieces as a query first sees it (an IVF index of many lists finds a
query's lists through an HNSW graph over its centroids there: :func:`_graph_quantizer`). An
index FAISS cannot merge (HNSW) gets no pieces: its live index adds the shards' stored rows
instead; so does a piece that is missing or unreadable (logged), whose rows are all still in
its shard.

One index over the raw rows serves ``dot`` and ``trak``: ``trak``'s preconditioner is applied to
the query (``(Phi^T Phi + lambda I)^-1 q``), whose inner products with the rows are its scores.
A query over-fetches :data:`OVERFETCH` times ``k`` candidates and ranks them by their exact
scores from the stored rows, so the answer's scores are exact and only its recall is
approximate. ``cosine`` divides by each row's norm, which no inner-product search over the raw
rows orders by, and ``self_influence`` needs no query: both scan exactly.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import Any

import numpy as np

from psgrad._errors import InvalidInput

OVERFETCH = 4  # candidates per query: this many times k (at least k + MIN_EXTRA)
MIN_EXTRA = 256  # PQ codes rank coarsely: 74 candidates kept 0.94 of the top 10, 256 all
PROBES = 64  # an IVF index's lists searched per query (nprobe) unless the query says
TRAIN_ROWS = 65536  # rows an index is trained on, at most (evenly drawn): FAISS k-means
# subsamples to 256 per centroid anyway, and training runs inside a commit (a minute at 65536
# rows of IVF256,PQ32 on two cores)
GRAPH_LISTS = 1024  # an IVF index with this many lists searches them through a graph
INDEXED = ("dot", "trak")  # the scores an inner-product index over the raw rows serves
log = logging.getLogger(__name__)


def _faiss() -> Any:
    import faiss  # the package loads its BLAS and threads: only where an index is used

    return faiss


def check_factory(factory: object, width: int) -> str:
    """``factory`` as a FAISS factory string that makes an index of ``width`` rows; else a
    422 with FAISS's reason."""
    if not isinstance(factory, str) or not factory.strip() or len(factory) > 200:
        raise InvalidInput("'index' is a FAISS factory string such as \"IVF1024,Flat\", "
                           "\"IVF4096,SQ4\" or \"HNSW32\", or null for none")
    try:
        _faiss().index_factory(width, factory, _faiss().METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        # FAISS's own words, without the C++ function and source line it prefixes them with
        reason = re.sub(r"^Error in .* at \S+:\d+: ", "", str(exc).strip().splitlines()[-1])[:300]
        raise InvalidInput(f"'index' {factory!r} is not a FAISS index of rows {width} wide: "
                           f"{reason}", index=factory) from None
    return factory


@functools.cache
def rows_to_train(factory: str, width: int) -> int:
    """The fewest rows that can train ``factory``'s index of ``width`` rows: an IVF index's
    lists, a product quantizer's codes per subvector, whichever is more (1 for others; 0 for an
    index that needs no training). A lower bound: training may still refuse more rows than
    this, and then :func:`trained` waits."""
    faiss = _faiss()
    index = faiss.index_factory(width, factory, faiss.METRIC_INNER_PRODUCT)
    if index.is_trained:
        return 0
    ivf = _ivf(index)
    inner = faiss.downcast_index(ivf if ivf is not None else index)
    storage = getattr(inner, "storage", None)  # HNSW's codes
    pq = getattr(inner if storage is None else faiss.downcast_index(storage), "pq", None)
    return max(1, int(ivf.nlist) if ivf is not None else 1, int(pq.ksub) if pq else 1)


def trained(factory: str, width: int, rows: np.ndarray) -> Any:
    """An empty ``factory`` index trained on ``rows`` (at most :data:`TRAIN_ROWS` of them,
    evenly drawn); None while they are too few to train it."""
    faiss = _faiss()
    index = faiss.index_factory(width, factory, faiss.METRIC_INNER_PRODUCT)
    if not index.is_trained:
        step = max(1, len(rows) // TRAIN_ROWS)
        try:
            index.train(np.ascontiguousarray(rows[::step], dtype=np.float32))
        except RuntimeError:  # fewer rows than its clusters or codes need: later
            return None
    return index


def mergeable(index: Any) -> bool:
    """Whether FAISS merges two indexes of ``index``'s kind (IVF and flat codes do; HNSW not)."""
    faiss = _faiss()
    try:
        faiss.clone_index(index).merge_from(faiss.clone_index(index), 0)
    except RuntimeError:
        return False
    return True


def add(index: Any, rows: np.ndarray, first: int) -> None:
    """``rows`` added to ``index`` as global rows ``first, first + 1, ...``: as their ids where
    the index keeps ids (IVF); elsewhere in order, which is the same while rows come in order."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)
    if _ivf(index) is not None:
        index.add_with_ids(rows, np.arange(first, first + len(rows), dtype=np.int64))
    else:
        index.add(rows)


def piece(index: Any, rows: np.ndarray, first: int) -> bytes:
    """A shard's piece: the empty trained ``index`` holding ``rows`` (global rows from
    ``first``), as bytes; an IVF piece without its centroids (the trained index has them:
    16 MiB a piece at 4096 lists of 1024), its lists merged as they are (:meth:`Live.extend`)."""
    faiss = _faiss()
    part = faiss.clone_index(index)
    add(part, rows, first)
    ivf = _ivf(part)
    if ivf is not None:
        centroids, ivf.own_fields = ivf.quantizer, False
        centroids.this.own(True)  # freed with this call
        ivf.quantizer = faiss.IndexFlat(ivf.d, ivf.metric_type)
    return to_bytes(part)


def to_bytes(index: Any) -> bytes:
    return bytes(_faiss().serialize_index(index).tobytes())


def from_bytes(raw: bytes) -> Any:
    return _faiss().deserialize_index(np.frombuffer(raw, dtype=np.uint8))


class Live:
    """One store's index in a process's memory: its trained index with the pieces of the first
    :attr:`shards` shards merged in (:attr:`rows` rows). Hold :attr:`lock` to extend or
    search it (FAISS does not search an index while it grows)."""

    def __init__(self, epoch: str, name: str, empty: Any) -> None:
        self.epoch, self.name, self.index = epoch, name, empty
        self.merge = mergeable(empty)
        self.shards, self.rows = 0, 0
        self.lock = threading.Lock()
        self._empty_bytes = len(to_bytes(empty))  # its flat quantizer too, kept beside a graph
        self._quantizers = _graph_quantizer(empty)
        if self._quantizers is not None:
            graph = self._quantizers[1]
            self._empty_bytes += int(graph.ntotal) * row_bytes(graph)
        self._lists = _ivf(empty)  # the IVF index inside, whose lists pieces merge into
        self._row_bytes = row_bytes(empty)

    @property
    def held_bytes(self) -> int:
        """What it holds in memory, about: the trained index (its graph over the centroids
        too) and :func:`row_bytes` per row (an IVF index's lists grow by doubling as pieces
        merge, so a merged index may hold up to twice its rows' bytes)."""
        return self._empty_bytes + self.rows * self._row_bytes

    def extend(self, raw: bytes | None, rows: Any, count: int, what: str) -> None:
        """The next shard (``count`` rows) added: its piece ``raw`` merged in, or its stored
        rows (``rows()``) encoded where the index does not merge or the piece is missing or
        unreadable."""
        part = None
        if self.merge and raw is not None:
            try:
                part = from_bytes(raw)
                if part.ntotal != count or part.d != self.index.d:
                    raise RuntimeError(f"{part.ntotal} rows of {part.d}, not {count}")
                mine, theirs = self._lists, _ivf(part)
                if mine is not None and (theirs is None or (theirs.nlist, theirs.code_size) != (
                        mine.nlist, mine.code_size)):
                    raise RuntimeError("its lists are not this index's")
                ids = _ids(part)
                if ids is not None and not np.array_equal(np.sort(ids), np.arange(
                        self.rows, self.rows + count)):
                    raise RuntimeError(f"it holds other rows than {self.rows} to "
                                       f"{self.rows + count - 1}")
            except RuntimeError as exc:
                log.warning("index piece %s is unreadable (%s): its rows are encoded again",
                            what, str(exc).strip().splitlines()[-1][:200])
                part = None
        elif self.merge:
            log.warning("index piece %s is missing: its rows are encoded again", what)
        if part is not None and self._lists is not None:  # its lists (checked above), as they are
            self._lists.invlists.merge_from(_ivf(part).invlists, 0)
            self._lists.ntotal += count
            if not isinstance(_faiss().downcast_index(self.index), _faiss().IndexIVF):
                self.index.ntotal += count  # a transform around the IVF index counts too
        elif part is not None:
            self.index.merge_from(part, 0)
        else:
            add(self.index, rows(), self.rows)
        self.shards, self.rows = self.shards + 1, self.rows + count

    def candidates(self, q: np.ndarray, k: int, probes: int | None) -> np.ndarray:
        """``[queries, n]`` row numbers (-1 where the index has fewer): each query's best
        ``n`` by inner product as the index finds them, ``n`` = :data:`OVERFETCH` ``k``,
        searching ``probes`` lists of an IVF index (:data:`PROBES` by default)."""
        n = min(int(self.index.ntotal), max(OVERFETCH * k, k + MIN_EXTRA))
        if self._lists is not None:
            self._lists.nprobe = min(int(self._lists.nlist), probes or PROBES)
        _, rows = self.index.search(np.ascontiguousarray(q, dtype=np.float32), n)
        return np.asarray(rows, dtype=np.int64)


def row_bytes(index: Any) -> int:
    """The bytes ``index`` holds per row: an IVF index's code and id, a flat index's code, an
    HNSW graph's vector and level-0 links; a float32 vector where FAISS does not say."""
    faiss, ivf = _faiss(), _ivf(index)
    if ivf is not None:
        return int(ivf.code_size) + 8
    inner = faiss.downcast_index(index)
    if hasattr(inner, "hnsw"):
        return int(faiss.downcast_index(inner.storage).sa_code_size()) + 4 * int(
            inner.hnsw.nb_neighbors(0))
    try:
        return int(index.sa_code_size())
    except RuntimeError:
        return 4 * int(index.d)


def _graph_quantizer(index: Any) -> tuple[Any, Any] | None:
    """An IVF index of at least :data:`GRAPH_LISTS` lists over a flat quantizer gets an HNSW
    graph over the same centroids in its place (a search's lists found in 2 ms instead of 8
    at 4096 lists of 1024 and 16 queries; the same nearest list for each here); the two
    quantizers, kept with the index that uses one (None: nothing replaced)."""
    faiss = _faiss()
    ivf = _ivf(index)
    if (ivf is None or ivf.nlist < GRAPH_LISTS
            or type(faiss.downcast_index(ivf.quantizer)) not in (faiss.IndexFlatIP,
                                                                 faiss.IndexFlatL2)):
        return None
    flat = ivf.quantizer
    graph = faiss.IndexHNSWFlat(ivf.d, 32, ivf.metric_type)
    graph.hnsw.efSearch = 64
    graph.add(flat.reconstruct_n(0, ivf.nlist))
    if ivf.own_fields:  # the flat one is freed with this pair, the graph never by the index
        ivf.own_fields = False
        flat.this.own(True)
    ivf.quantizer = graph
    return flat, graph


def _ids(index: Any) -> np.ndarray | None:
    """The ids an IVF index holds (None for another index: its rows are numbered in order)."""
    ivf = _ivf(index)
    if ivf is None:
        return None
    faiss, lists = _faiss(), ivf.invlists
    return np.concatenate([np.empty(0, np.int64), *(
        faiss.rev_swig_ptr(lists.get_ids(i), lists.list_size(i)).copy()
        for i in range(ivf.nlist) if lists.list_size(i))])


def _ivf(index: Any) -> Any:
    """The IVF index inside ``index``, or None where it is no IVF index."""
    try:
        return _faiss().extract_index_ivf(index)
    except RuntimeError:
        return None
