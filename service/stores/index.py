"""A gradient store's approximate top-k index: FAISS over the store's rows, inner product.

``PUT /stores/{id}`` may name a FAISS factory string (``"IVF1024,Flat"``, ``"IVF4096,PQ64"``,
``"HNSW32"``, ...). The index holds every committed row as stored (FAISS's ids are the global row
numbers: rows are added in commit order) and is kept beside the shards, one file per commit
(``index-<seq>.faiss``, FAISS's own binary format, never a pickle), made by
:meth:`~service.stores.files.StoreFiles.commit`: the previous commit's index with the batch's
rows added, or, while there is none, a new one trained on the rows committed so far (an index
that needs training waits until there are enough rows: queries scan exactly until then).

One index over the raw rows serves ``dot`` and ``trak``: ``trak``'s preconditioner is applied to
the query (``(Phi^T Phi + lambda I)^-1 q``), whose inner products with the rows are its scores.
A query over-fetches :data:`OVERFETCH` times ``k`` candidates and ranks them by their exact
scores from the stored rows, so the answer's scores are exact and only its recall is
approximate. ``cosine`` divides by each row's norm, which no inner-product search over the raw
rows orders by, and ``self_influence`` needs no query: both scan exactly.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from psgrad._errors import InvalidInput

OVERFETCH = 4  # candidates per query: this many times k (at least k + MIN_EXTRA)
MIN_EXTRA = 256  # PQ codes rank coarsely: 74 candidates kept 0.94 of the top 10, 256 all
PROBES = 64  # an IVF index's lists searched per query (nprobe), at most all of them
TRAIN_ROWS = 65536  # rows an index is trained on, at most (evenly drawn): FAISS k-means
# subsamples to 256 per centroid anyway, and training runs inside a commit (a minute at 65536
# rows of IVF256,PQ32 on two cores)
INDEXED = ("dot", "trak")  # the scores an inner-product index over the raw rows serves


def _faiss() -> Any:
    import faiss  # the package loads its BLAS and threads: only where an index is used

    return faiss


def check_factory(factory: object, width: int) -> str:
    """``factory`` as a FAISS factory string that makes an index of ``width`` rows; else a
    422 with FAISS's reason."""
    if not isinstance(factory, str) or not factory.strip() or len(factory) > 200:
        raise InvalidInput("'index' is a FAISS factory string such as \"IVF1024,Flat\", "
                           "\"IVF4096,PQ64\" or \"HNSW32\", or null for none")
    try:
        _faiss().index_factory(width, factory, _faiss().METRIC_INNER_PRODUCT)
    except RuntimeError as exc:
        reason = str(exc).strip().splitlines()[-1][:300]
        raise InvalidInput(f"'index' {factory!r} is not a FAISS index of rows {width} wide: "
                           f"{reason}", index=factory) from None
    return factory


@functools.cache
def rows_to_train(factory: str, width: int) -> int:
    """The fewest rows that can train ``factory``'s index of ``width`` rows: an IVF index's
    lists, a product quantizer's codes per subvector, whichever is more (1 for others; 0 for an
    index that needs no training). A lower bound: training may still refuse more rows than
    this, and then :func:`extended` waits."""
    faiss = _faiss()
    index = faiss.index_factory(width, factory, faiss.METRIC_INNER_PRODUCT)
    if index.is_trained:
        return 0
    ivf = _ivf(index)
    inner = faiss.downcast_index(ivf if ivf is not None else index)
    storage = getattr(inner, "storage", None)  # HNSW's codes
    pq = getattr(inner if storage is None else faiss.downcast_index(storage), "pq", None)
    return max(1, int(ivf.nlist) if ivf is not None else 1, int(pq.ksub) if pq else 1)


def extended(old: Any, factory: str, width: int, new_rows: np.ndarray,
             every_row: np.ndarray | None) -> Any:
    """The index after a commit: ``old`` (not modified) with ``new_rows`` added, or with no
    ``old`` a new one trained on ``every_row`` (the store's rows after the commit) and holding
    them; None while there are too few rows to train it."""
    faiss = _faiss()
    if old is not None:
        index = faiss.clone_index(old)
        index.add(np.ascontiguousarray(new_rows, dtype=np.float32))
        return index
    assert every_row is not None
    index = faiss.index_factory(width, factory, faiss.METRIC_INNER_PRODUCT)
    rows = np.ascontiguousarray(every_row, dtype=np.float32)
    if not index.is_trained:
        step = max(1, len(rows) // TRAIN_ROWS)
        try:
            index.train(np.ascontiguousarray(rows[::step]))
        except RuntimeError:  # fewer rows than its clusters or codes need: later
            return None
    index.add(rows)
    return index


def to_bytes(index: Any) -> bytes:
    return bytes(_faiss().serialize_index(index).tobytes())


def from_bytes(raw: bytes) -> Any:
    return _faiss().deserialize_index(np.frombuffer(raw, dtype=np.uint8))


def candidates(index: Any, q: np.ndarray, k: int) -> np.ndarray:
    """``[queries, n]`` row numbers (-1 where the index has fewer): each query's best ``n``
    by inner product as the index finds them, ``n`` = :data:`OVERFETCH` ``k``."""
    n = min(int(index.ntotal), max(OVERFETCH * k, k + MIN_EXTRA))
    ivf = _ivf(index)
    if ivf is not None:
        ivf.nprobe = min(int(ivf.nlist), PROBES)
    _, rows = index.search(np.ascontiguousarray(q, dtype=np.float32), n)
    return np.asarray(rows, dtype=np.int64)


def _ivf(index: Any) -> Any:
    """The IVF index inside ``index``, or None where it is no IVF index."""
    try:
        return _faiss().extract_index_ivf(index)
    except RuntimeError:
        return None
