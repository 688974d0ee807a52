"""Gradient stores as files: shards written as batches arrive, made visible by a manifest.

Under the data directory (a local path or any fsspec URL: ``s3://bucket/psgrad``, ...)::

    stores/<key>/spec.json                  the StoreSpec; the store exists while this file does
    stores/<key>/manifest.json              the committed state: shards in order, the Gram file
    stores/<key>/shard-<uuid>.safetensors   ``sketches`` [n, k] in the store's dtype, ``norms``
                                            [n] (float64, of the stored rows), metadata ``ids``
                                            (a JSON list: the caller's sample ids)
    stores/<key>/gram-<seq>.safetensors     ``gram`` [k, k] float64: Phi^T Phi of every
                                            committed row (TRAK's preconditioner)
    stores/<key>/trained-<seq>.faiss        a store made with ``index``: its FAISS index,
                                            trained and empty (:mod:`service.stores.index`)
    stores/<key>/shard-<uuid>.faiss         that index holding the shard's rows (its piece)
    stores/<key>/factors.safetensors        its K-FAC factors, once fitted
                                            (:mod:`service.stores.factors`)

An append is staged, then committed. :meth:`StoreFiles.stage` writes the batch's shards (at most
``PSGRAD_STORE_SHARD_BYTES`` of rows each) under fresh names that no manifest lists yet.
:meth:`StoreFiles.commit`, under the store's lock, checks the ids against the committed ones,
writes the new Gram matrix (the old one plus the batch's, in float64) and the index pieces of
the batch's shards, then the new manifest:
a whole file written beside it and renamed over it (one object PUT on an object store), the one
step that makes the batch visible. A process that dies before the rename leaves only files no
manifest names (ignored, removed with the store); a reader holding the previous manifest keeps
reading exactly what it committed, because committed shards are never rewritten. An
ensemble's batch goes to each checkpoint's store (``checkpoint-<i>/``), the first's manifest
last: that rename is the ensemble's commit (:func:`commit_all`, :meth:`StoreFiles.states`).
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import logging
import mmap
import os
import posixpath
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from psgrad._errors import (
    Conflict,
    InsufficientStorage,
    InvalidInput,
    NonFinite,
    NotFound,
    StoreDamaged,
)
from service.disk import unwritable
from service.lru import LockedLRU
from service.stores import index as index_file
from service.stores.locks import Locks
from service.stores.spec import StoreSpec
from service.tenants import owned_name

SPEC, MANIFEST = "spec.json", "manifest.json"
GRAM_KEEP = 3  # Gram files kept: a reader of an older manifest still finds its own
MEMO_STORES = 4  # stores whose ids, Gram matrix and trak factor are kept in memory
ListedIds = np.ndarray | tuple[str, ...]  # a shard's ids: int64 for integer ids
MAPPED_SHARDS = 1024  # local shards kept mapped (64 GiB of rows at the default shard size)
IDS_BUDGET = 128 << 20  # bytes of shard ids kept in memory: 16 million integer ids
# a row's squared norm, at most: float32's largest number (about 3.4e38), so that a row's
# self-influence is a float32 number and its float32 dot products with a query scaled to
# entries at most 1 stay below about 1e21 at any k up to 8192 (docs/attribution.md)
MAX_SELF_INFLUENCE = float(np.finfo(np.float32).max)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    file: str
    rows: int
    bytes: int


@dataclass(frozen=True)
class Manifest:
    """A store's committed state; ``seq`` counts commits."""

    seq: int = 0
    shards: tuple[Shard, ...] = ()
    gram: str | None = None
    id_kind: str | None = None  # "int" or "str", fixed by the first batch
    epoch: str = ""  # drawn when the store is made: a store made again under its id is another
    index: str | None = None  # the trained index (a store made with one, once trained)

    @property
    def trained(self) -> str | None:
        """The trained index's file (None: no index yet, or one written whole per commit
        before pieces, ``index-<seq>.faiss``, which scans until a commit trains anew)."""
        return None if self.index is None or self.index.startswith("index-") else self.index

    @property
    def count(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def nbytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    def to_json(self) -> bytes:
        return json.dumps({"seq": self.seq, "gram": self.gram, "id_kind": self.id_kind,
                           "epoch": self.epoch, "index": self.index,
                           "shards": [vars(s) for s in self.shards]}).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> Manifest:
        d = json.loads(raw)
        return cls(int(d["seq"]), tuple(Shard(**s) for s in d["shards"]), d["gram"],
                   d["id_kind"], d["epoch"], d.get("index"))

    @property
    def version(self) -> tuple[str, int]:
        """Which store and which commit of it: what a value kept in memory is valid for."""
        return self.epoch, self.seq


@dataclass(frozen=True)
class Staged:
    """A batch written as shards, not yet committed."""

    key: str
    shards: tuple[Shard, ...]
    ids: tuple[int | str, ...]
    id_kind: str
    gram: np.ndarray | None = field(repr=False)  # None: a store of full gradients keeps none
    rows: np.ndarray | None = field(default=None, repr=False)  # for a store with an index
    epoch: str | None = None  # the store it was checked against (None: any of that key)


class StoreFiles:
    """Every store of one data directory; safe to call from threads and processes."""

    def __init__(self, url: str, locks: Locks, shard_bytes: int = 64 << 20,
                 index_bytes: int = 16 << 30) -> None:
        self.url = url
        self.fs, self.root = fsspec.core.url_to_fs(url)
        self.locks = locks
        self.shard_bytes = shard_bytes
        self._guard = threading.Lock()
        self._memo: dict[tuple[str, str], tuple[tuple[str, int], Any]] = {}
        # a few stores' indexes as last queried, at most index_bytes of them (the one in use
        # stays whatever it weighs): another store's query evicts the least recently used
        self._live: LockedLRU[str, index_file.Live] = LockedLRU(
            MEMO_STORES, budget=index_bytes, weigh=lambda live: live.held_bytes)
        # the ids of committed shards (immutable files), read from their headers once
        self._ids: LockedLRU[str, ListedIds] = LockedLRU(
            65536, budget=IDS_BUDGET, weigh=_weight)
        # where each tensor of a committed shard lies: its header parsed once (ids and all)
        self._layouts: LockedLRU[str, Layout] = LockedLRU(65536)
        # local shards' rows kept mapped for reads of a few rows (a deleted store's go with
        # it; another process's delete frees their disk once they leave this cache)
        self._maps: LockedLRU[str, np.ndarray] = LockedLRU(MAPPED_SHARDS)

    def path(self, key: str, name: str = "") -> str:
        return posixpath.join(self.root, "stores", key, name) if name else posixpath.join(
            self.root, "stores", key)

    # --- whole files ---------------------------------------------------------------------

    def _write(self, path: str, *parts: bytes | memoryview) -> None:
        """``parts`` at ``path`` all at once: written beside it, synced (on a local disk: a
        shard is on disk before the manifest that names it), then renamed over it. A full
        disk is a 507 that leaves no temporary file behind (so the disk does not stay full);
        a read-only or unwritable one is a 507 too (:func:`_unwritable`)."""
        tmp = posixpath.join(posixpath.dirname(path), f".tmp-{uuid.uuid4().hex}")
        try:
            with self.fs.open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                _sync(f)
            self.fs.mv(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.fs.rm(tmp)
            raise _unwritable(exc) or exc from None

    def _read(self, path: str, start: int | None = None, end: int | None = None
              ) -> bytes | None:
        try:
            return bytes(self.fs.cat_file(path, start=start, end=end))
        except FileNotFoundError:
            return None

    def _rm(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    # --- the store's records ---------------------------------------------------------------

    def spec(self, key: str) -> StoreSpec | None:
        """The store's definition (None: there is no such store)."""
        raw = self._read(self.path(key, SPEC))
        if raw is None:
            return None
        with _parsing(key, SPEC):
            return StoreSpec.from_json(raw)

    def store_keys(self) -> list[str]:
        """Every store's key (``<tenant>~<id>``, or the id of a default tenant's store)."""
        try:
            found = self.fs.ls(posixpath.join(self.root, "stores"), detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(p).rstrip("/")) for p in found)

    def pinning(self, refs: set[str]) -> list[str]:
        """The stores (``<tenant>~<id>`` keys) whose pinned model version is one of ``refs``
        (a store whose definition cannot be read pins nothing: logged)."""
        found = []
        for key in self.store_keys():
            try:
                spec = self.spec(key)
            except StoreDamaged as exc:
                log.warning("%s", exc)
                continue
            if spec is not None and (spec.model in refs or refs & set(spec.checkpoints)):
                found.append(key)
        return found

    def manifest(self, key: str) -> Manifest:
        """The store's committed state (empty where there is no store: deleted meanwhile)."""
        raw = self._read(self.path(key, MANIFEST))
        if raw is None:
            if self.fs.exists(self.path(key, SPEC)):  # made with it: lost since
                raise _damaged(key, f"its file {MANIFEST} is missing")
            return Manifest()
        with _parsing(key, MANIFEST):
            return Manifest.from_json(raw)

    def states(self, keys: Sequence[str]) -> list[Manifest]:
        """The committed state of one store's rows (:meth:`StoreSpec.members`' keys: the store,
        or an ensemble's checkpoints), each checkpoint's manifest as of one commit: an
        ensemble's append writes the first checkpoint's manifest last (:func:`commit_all`),
        so a checkpoint ahead of the others holds a batch that failed or died before that, and
        is read as the others hold it (its shards up to theirs, its Gram file of then)."""
        found = [self.manifest(key) for key in keys]
        low = min(found, key=lambda m: m.seq)
        out = [m if m.seq == low.seq else self._rewound(key, m, low)
               for key, m in zip(keys, found, strict=True)]
        if len({tuple(s.rows for s in m.shards) for m in out}) > 1:
            raise _damaged(keys[0], "its checkpoints hold different batches")
        return out

    def _rewound(self, key: str, ahead: Manifest, low: Manifest) -> Manifest:
        """``ahead`` as it was at commit ``low.seq``: its first shards, as many rows as
        ``low`` holds (every checkpoint adds the same batches, in the same shards)."""
        counts = np.cumsum([0] + [s.rows for s in ahead.shards]).tolist()
        gram = f"gram-{low.seq}.safetensors" if low.seq and ahead.gram else None
        if (low.count not in counts or ahead.trained is not None
                or (gram is not None and not self.fs.exists(self.path(key, gram)))):
            raise _damaged(key, f"its checkpoints hold {low.seq} and {ahead.seq} commits")
        return replace(ahead, seq=low.seq, shards=ahead.shards[:counts.index(low.count)],
                       gram=gram, id_kind=low.id_kind, index=None)

    def create(self, key: str, spec: StoreSpec) -> tuple[StoreSpec, bool]:
        """Make the store (True), or find the same one already made (False); another store
        of that id is a conflict."""
        with self.locks.hold(key):
            found = self.spec(key)
            if found is not None:
                if not found.same_as(spec):
                    raise Conflict(f"store '{spec.id}' exists with another definition (model "
                                   f"{found.model}, loss {found.loss}, projection_dim "
                                   f"{found.projection_dim}, ...): DELETE it first, or use "
                                   "another id", existing=found.doc())
                return found, False
            try:
                self.fs.makedirs(self.path(key), exist_ok=True)
            except OSError as exc:
                raise _unwritable(exc) or exc from None
            self._write(self.path(key, MANIFEST), Manifest(epoch=uuid.uuid4().hex).to_json())
            self._write(self.path(key, SPEC), spec.to_json())  # now it exists
            return spec, True

    def delete(self, key: str) -> bool:
        """Remove the store and its files (False: there is none); a damaged one too."""
        with self.locks.hold(key):
            if not self.fs.exists(self.path(key, SPEC)):
                return False
            self._live.drop(lambda held: held != key)
            self._maps.drop(lambda path: not path.startswith(self.path(key) + "/"))
            try:
                self._rm(self.path(key, SPEC))  # gone at once; then its files
                self._rm_tree(self.path(key))
            except OSError as exc:
                raise _unwritable(exc) or exc from None
            return True

    def _rm_tree(self, path: str) -> None:
        """``path`` and what is under it, while an append that read the store before it went
        may still stage a shard there (its temporary file renamed, or gone, as the walk
        passes): walked again until nothing is left."""
        for _ in range(5):
            try:
                self.fs.rm(path, recursive=True)
                return
            except FileNotFoundError:
                if not self.fs.exists(path):
                    return
        log.warning("files of a deleted store are left under %s: writes raced its removal", path)

    # --- appending ---------------------------------------------------------------------------

    def stage(self, key: str, spec: StoreSpec, ids: list[int | str], id_kind: str,
              sketches: np.ndarray, epoch: str | None = None) -> Staged:
        """Write a batch's rows as new shards (listed by no manifest yet), for the store of
        ``epoch`` (:meth:`still`)."""
        rows = stored_rows(spec, sketches, ids)
        wide = rows.astype(np.float64)
        gram = None if spec.exact else wide.T @ wide  # [D, D] of full gradients: never
        norms = np.sqrt(np.einsum("ij,ij->i", wide, wide))
        per = max(1, self.shard_bytes // (spec.projection_dim * spec.itemsize))
        shards: list[Shard] = []
        try:
            for a in range(0, len(rows), per):
                name = f"shard-{uuid.uuid4().hex}.safetensors"
                data = st_save({"sketches": np.ascontiguousarray(rows[a:a + per]),
                                "norms": norms[a:a + per]},
                               metadata={"ids": json.dumps(ids[a:a + per])})
                self._write(self.path(key, name), data)
                shards.append(Shard(name, len(rows[a:a + per]), len(data)))
        except BaseException as exc:
            self.discard(Staged(key, tuple(shards), (), id_kind, gram))
            if isinstance(exc, FileNotFoundError):  # its folder went: deleted meanwhile
                raise _deleted(key) from None
            raise
        return Staged(key, tuple(shards), tuple(ids), id_kind, gram,
                      rows if spec.index is not None else None, epoch)

    def discard(self, staged: Staged) -> None:
        """Remove a staged batch's shards, best effort: on a disk that just turned read-only
        they stay (no manifest lists them; they go with the store), and the error that made
        the batch fail is the one reported, not this one."""
        for shard in staged.shards:
            try:
                self._rm(self.path(staged.key, shard.file))
                self._rm(self.path(staged.key, shard.file.removesuffix(".safetensors") + ".faiss"))
            except OSError as exc:
                log.warning("staged shard %s of store %s not removed: %s", shard.file,
                            staged.key, exc)

    def commit(self, staged: Staged, old: Manifest | None = None) -> Manifest:
        """Make a staged batch part of the store, all of it or (refused) none of it; ``old``:
        the committed state to add it to, read under a lock the caller holds (an ensemble's
        checkpoint, :func:`commit_all`), else the store's manifest."""
        key = staged.key
        try:
            with self.locks.hold(key):
                spec = self.still(key, staged.epoch)
                old = self.manifest(key) if old is None else old
                if old.id_kind not in (None, staged.id_kind):
                    raise InvalidInput(f"store '{spec.id}' holds {old.id_kind} ids; this batch "
                                       f"sends {staged.id_kind} ids: use one kind per store")
                committed = self.ids(key, old)
                refuse_duplicates(spec.id, committed, staged.ids)
                gram = self.gram(key, old)
                seq = old.seq + 1
                total = (None if staged.gram is None else
                         staged.gram if gram is None else gram + staged.gram)
                trained, pieces = self._indexed(key, spec, old, staged)
                new = Manifest(seq, old.shards + staged.shards,
                               f"gram-{seq}.safetensors" if total is not None else None,
                               staged.id_kind if old.count == 0 else old.id_kind, old.epoch,
                               trained[0] if trained is not None else None)
                if total is not None:
                    self._write(self.path(key, new.gram or ""), *raw_safetensors("gram", total))
                if trained is not None and trained[1] is not None:
                    self._write(self.path(key, trained[0]), trained[1])
                for name, raw in pieces:
                    self._write(self.path(key, name), raw)
                self._write(self.path(key, MANIFEST), new.to_json())  # the commit
                committed.update(staged.ids)  # in place: a copy would cost O(store)
                self._remember("ids", key, new.version, committed)
                if total is not None:
                    self._remember("gram", key, new.version, total)
        except BaseException:
            self.discard(staged)
            raise
        if seq > GRAM_KEEP:
            self._rm(self.path(key, f"gram-{seq - GRAM_KEEP}.safetensors"))
        return new

    def _indexed(self, key: str, spec: StoreSpec, old: Manifest, staged: Staged
                 ) -> tuple[tuple[str, bytes | None] | None, list[tuple[str, bytes]]]:
        """The trained index of the store with ``staged`` committed, as (its file, its bytes
        where this commit writes it), and the pieces to write (file, bytes): the batch's
        shards', or, on the commit that trains it, every shard's. None: the store has no
        index, or too few rows to train one yet."""
        if spec.index is None or staged.rows is None:
            return None, []
        name = old.trained
        if name is not None:
            empty, merge = self.kept_at("trained", key, (f"{old.epoch}/{name}", 0),
                                        functools.partial(self._mergeable, key, name))
            return (name, None), _pieces(empty, merge, staged.shards, staged.rows, old.count)
        if old.count + len(staged.rows) < index_file.rows_to_train(spec.index,
                                                                   spec.projection_dim):
            return None, []  # too few rows yet: the stored ones are not read to learn it
        every = np.concatenate([*(rows for _, rows, _ in self.rows(key, old)), staged.rows])
        empty = index_file.trained(spec.index, spec.projection_dim, every)
        if empty is None:
            return None, []
        name = f"trained-{old.seq + 1}.faiss"
        return (name, index_file.to_bytes(empty)), _pieces(
            empty, index_file.mergeable(empty), old.shards + staged.shards, every, 0)

    def _mergeable(self, key: str, name: str) -> tuple[Any, bool]:
        """The store's trained index, and whether FAISS merges indexes of its kind (asked
        once: it clones the index twice)."""
        empty = self._trained(key, name)
        return empty, index_file.mergeable(empty)

    def _trained(self, key: str, name: str) -> Any:
        raw = self._read(self.path(key, name))
        if raw is None:
            raise FileNotFoundError(name)
        return index_file.from_bytes(raw)

    def append(self, key: str, spec: StoreSpec, ids: list[int | str], id_kind: str,
               sketches: np.ndarray, epoch: str | None = None) -> Manifest:
        return self.commit(self.stage(key, spec, ids, id_kind, sketches, epoch))

    def still(self, key: str, epoch: str | None) -> StoreSpec:
        """The store's definition, while it is the store of ``epoch`` (its manifest's, read
        when a request was checked; None: whichever): a write computed for a store that was
        deleted meanwhile is a 404, for one deleted and made again under its id a 409, never
        added to the new one. Hold its lock."""
        spec = self.spec(key)
        if spec is None:
            raise _deleted(key)
        if epoch is not None and self.manifest(key).epoch != epoch:
            raise Conflict(f"store '{owned_name(key)}' was deleted and made again while this "
                           "request was computed: nothing of it was written; send it again")
        return spec

    # --- reading -----------------------------------------------------------------------------

    def ids_of(self, key: str, shard: Shard) -> ListedIds:
        """A committed shard's ids, from its header alone (cached: shards never change)."""
        def read() -> ListedIds:
            with self._opened(key, shard.file) as f, _parsing(key, shard.file):
                header = json.loads(f.read(_header_size(f.read(8))))
                ids = json.loads(header["__metadata__"]["ids"])
                return (np.asarray(ids, dtype=np.int64) if ids and isinstance(ids[0], int)
                        else tuple(ids))

        return self._ids.get_or_make(self.path(key, shard.file), read)

    def ids(self, key: str, manifest: Manifest) -> set[int | str]:
        """Every id ``manifest`` commits (do not modify): kept between appends, so that an
        append checks its ids without listing a million others again."""
        def read() -> set[int | str]:
            found: set[int | str] = set()
            for shard in manifest.shards:
                ids = self.ids_of(key, shard)
                found.update(ids.tolist() if isinstance(ids, np.ndarray) else ids)
            return found

        listed: set[int | str] = self.kept("ids", key, manifest, read)
        return listed

    def kept(self, what: str, key: str, manifest: Manifest, make: Callable[[], Any]) -> Any:
        """``make()`` for this store as ``manifest`` commits it, made once and kept (for a few
        stores) until another commit: ``what`` names it ("ids", "gram", ...)."""
        return self.kept_at(what, key, manifest.version, make)

    def kept_at(self, what: str, key: str, version: tuple[str, int],
                make: Callable[[], Any]) -> Any:
        """:meth:`kept` of a state that another record than the manifest versions (a store's
        factors: its epoch and their own count of writes)."""
        value = self._recall(what, key, version)
        if value is None:
            value = make()
            self._remember(what, key, version, value)
        return value

    def read_file(self, key: str, name: str, start: int | None = None, end: int | None = None
                  ) -> bytes | None:
        """A file of the store, whole or bytes ``[start, end)`` (None where there is none)."""
        return self._read(self.path(key, name), start, end)

    def write_file(self, key: str, name: str, *parts: bytes | memoryview) -> None:
        """A whole file of the store, written beside it and renamed over it; a caller that
        reads, changes and writes one holds the store's lock (``locks.hold``)."""
        self._write(self.path(key, name), *parts)

    def _recall(self, what: str, key: str, version: tuple[str, int]) -> Any:
        """What :meth:`_remember` kept of this store at ``version`` (else None)."""
        with self._guard:
            kept, value = self._memo.get((what, key), (None, None))
        return value if kept == version else None

    def _remember(self, what: str, key: str, version: tuple[str, int], value: Any) -> None:
        """Keep ``value`` (the ids, the Gram matrix) of a few stores as of ``version`` (a
        :attr:`Manifest.version`: another replica's commit, or the store made again, is
        another version)."""
        with self._guard:
            self._memo.pop((what, key), None)
            self._memo[(what, key)] = (version, value)
            while len(self._memo) > 6 * MEMO_STORES:  # ids, Gram, largest row, trak's,
                # trained index, curvature
                del self._memo[next(iter(self._memo))]

    def gram(self, key: str, manifest: Manifest) -> np.ndarray | None:
        """Phi^T Phi over what ``manifest`` commits (None for an empty store; do not modify)."""
        if manifest.gram is None:
            return None
        name = manifest.gram

        def read() -> np.ndarray:
            raw = self._read(self.path(key, name))
            if raw is None:
                raise FileNotFoundError(name)  # replaced since: the caller reads again
            with _parsing(key, name):
                gram: np.ndarray = st_load(raw)["gram"]
            return gram

        found: np.ndarray = self.kept("gram", key, manifest, read)
        return found

    def _keep(self, key: str, live: index_file.Live) -> None:
        """``live`` kept as store ``key``'s (made or grown: weighed again), the least recently
        queried stores' indexes evicted (logged) while they all weigh more than the budget.
        Hold :attr:`_guard`."""
        before = len(self._live) + (key not in self._live)
        self._live.put(key, live)
        if len(self._live) < before:
            log.info("indexes of %d stores evicted from memory: the %d kept weigh %.2f GiB "
                     "(PSGRAD_INDEX_MEMORY_BYTES: %.2f GiB)", before - len(self._live),
                     len(self._live), self._live.weight / 2**30, (self._live.budget or 0) / 2**30)

    def candidates(self, key: str, manifest: Manifest, q: np.ndarray, k: int,
                   probes: int | None) -> np.ndarray | None:
        """Each query's candidate rows (``[queries, n]``, -1 for none) from the store's index
        as ``manifest`` commits it (None where it has none): the process's live index, brought
        up to ``manifest`` first (rows committed after it are left out)."""
        name = manifest.trained
        if name is None:
            return None
        with self._guard:  # one live index per store, even when queries race to make it
            live = self._live.find(key)
            if live is None or (live.epoch, live.name) != (manifest.epoch, name):
                try:
                    trained = self._trained(key, name)
                except (OSError, RuntimeError, ValueError) as exc:  # FAISS's: RuntimeError
                    log.warning("store %s: its index %s cannot be read (%s); scanning every "
                                "row instead", key, name, str(exc).splitlines()[0][:200])
                    return None
                live = index_file.Live(manifest.epoch, name, trained)
                self._keep(key, live)
        with live.lock:
            first = live.rows
            for number, shard in enumerate(manifest.shards[live.shards:], live.shards):
                stem = shard.file.removesuffix(".safetensors")
                live.extend(self._read(self.path(key, f"{stem}.faiss")) if live.merge else None,
                            lambda n=number: next(self.rows(key, manifest, np.array([n])))[1],
                            shard.rows, f"{key}/{stem}")
            if live.rows > first:
                log.info("index of store %s: %d rows added, %d in all", key, live.rows - first,
                         live.rows)
                with self._guard:
                    if self._live.find(key) is live:  # not replaced since
                        self._keep(key, live)
            rows = live.candidates(q, k, probes)
        return np.where(rows < manifest.count, rows, -1)

    def rows_at(self, key: str, manifest: Manifest, wanted: np.ndarray) -> np.ndarray:
        """The rows of global row numbers ``wanted`` (sorted, unique), ``[n, k]`` float32,
        reading only the shards that hold them."""
        starts = np.cumsum([0] + [s.rows for s in manifest.shards])
        which = np.searchsorted(starts, wanted, side="right") - 1
        bounds = np.searchsorted(wanted, starts)  # shard n's rows: wanted[bounds[n]:bounds[n+1]]
        out = np.empty((len(wanted), 0), np.float32)
        for number, sketches in self._shards(key, manifest, np.unique(which).tolist()):
            if not out.shape[1]:
                out = np.empty((len(wanted), sketches.shape[1]), sketches.dtype)  # as stored
            part = slice(bounds[number], bounds[number + 1])
            out[part] = sketches[wanted[part] - starts[number]]
        return widened(out)

    def _shards(self, key: str, manifest: Manifest, numbers: list[int]
                ) -> Iterator[tuple[int, np.ndarray]]:
        """``(number, sketches)`` of the shards at positions ``numbers`` (sorted): a local
        shard mapped once per process and kept mapped (a query through an index reads a few
        rows of every shard: mapping 153 shards again for each query cost more than reading
        its rows), another read."""
        if not isinstance(self.fs, LocalFileSystem):
            for number, (_, sketches, _) in zip(numbers, self.rows(
                    key, manifest, np.asarray(numbers, dtype=np.int64)), strict=True):
                yield number, sketches
            return
        for number in numbers:
            path = self.path(key, manifest.shards[number].file)
            yield number, self._maps.get_or_make(path, functools.partial(self._map, key, path))

    def _map(self, key: str, path: str) -> np.ndarray:
        name = posixpath.basename(path)
        with self._opened(key, name) as f, _parsing(key, name):
            raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            return views(raw, self._layouts.get_or_make(path, functools.partial(layout, raw)))[
                "sketches"]

    @contextlib.contextmanager
    def _opened(self, key: str, name: str) -> Iterator[Any]:
        """A store's file open for reading; missing, it is a 404 where the store was deleted
        meanwhile, and the store is damaged where it was not."""
        try:
            f = self.fs.open(self.path(key, name), "rb")
        except FileNotFoundError:
            if self.fs.exists(self.path(key, SPEC)):
                raise _damaged(key, f"its file {name} is missing") from None
            raise _deleted(key) from None
        with f:
            yield f

    def rows(self, key: str, manifest: Manifest, only: np.ndarray | None = None
             ) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        """``(offset, sketches, norms)`` of each shard in order, one shard in memory at a time:
        a local file is mapped (its pages come from the page cache, no copy), any other is read
        into one buffer reused for every shard (fresh memory for each would fault its pages
        in again). ``only``: the shards' positions to read (the others are skipped)."""
        offset, buffer = 0, bytearray()
        chosen = None if only is None else set(np.asarray(only).tolist())
        for number, shard in enumerate(manifest.shards):
            if chosen is not None and number not in chosen:
                offset += shard.rows
                continue
            path = self.path(key, shard.file)
            with self._opened(key, shard.file) as f, _parsing(key, shard.file):
                if isinstance(self.fs, LocalFileSystem):
                    raw: Any = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                else:
                    if len(buffer) < shard.bytes:
                        buffer = bytearray(shard.bytes)
                    raw = memoryview(buffer)[:f.readinto(buffer)]
                tensors = views(raw, self._layouts.get_or_make(path, functools.partial(layout,
                                                                                      raw)))
                _as_listed(shard, tensors["sketches"], tensors["norms"])
            yield offset, tensors["sketches"], tensors["norms"]
            del tensors
            offset += shard.rows

    def norms(self, key: str, manifest: Manifest) -> Iterator[tuple[int, np.ndarray]]:
        """``(offset, norms)`` of each shard, reading only that tensor's bytes."""
        offset = 0
        for shard in manifest.shards:
            path = self.path(key, shard.file)
            with self._opened(key, shard.file) as f, _parsing(key, shard.file):
                def header(f: Any = f) -> Layout:
                    size = f.read(8)
                    return layout(size + f.read(_header_size(size)))

                dtype, shape, start = self._layouts.get_or_make(path, header)["norms"]
                f.seek(start)
                norms = np.frombuffer(f.read(int(np.prod(shape)) * dtype.itemsize), dtype)
                _as_listed(shard, norms)
            yield offset, norms
            offset += shard.rows

    def id_at(self, key: str, manifest: Manifest, rows: np.ndarray) -> list[Any]:
        """The ids of global row numbers ``rows`` (any shape), as nested lists."""
        starts = np.cumsum([0] + [s.rows for s in manifest.shards])
        which = np.searchsorted(starts, rows, side="right") - 1
        flat = [_plain(self.ids_of(key, manifest.shards[s])[r - starts[s]])
                for s, r in zip(which.ravel().tolist(), rows.ravel().tolist(), strict=True)]
        return np.asarray(flat, dtype=object).reshape(rows.shape).tolist()


_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64}


def _weight(ids: ListedIds) -> int:
    return 16 + (ids.nbytes if isinstance(ids, np.ndarray) else 64 * len(ids))


def _plain(value: Any) -> int | str:
    """A listed id as JSON writes it (an int64 as a Python int)."""
    return value.item() if isinstance(value, np.generic) else value


def widened(rows: np.ndarray) -> np.ndarray:
    """``rows`` in float32 (as they are, if they are): widened by torch, which does float16 at
    several times numpy's speed here (4,256 rows of 1024: 1 ms against 9). A mapped shard is
    mapped copy-on-write, so that torch takes its rows (they are only read)."""
    if rows.dtype == np.float32:
        return rows
    out = np.empty(rows.shape, np.float32)
    torch.from_numpy(out).copy_(torch.from_numpy(rows))
    return out


Layout = dict[str, tuple[np.dtype, tuple[int, ...], int]]  # name: dtype, shape, byte offset


def _as_listed(shard: Shard, *tensors: np.ndarray) -> None:
    """A ValueError (read as damage) where a shard's tensors hold other rows than its manifest
    lists: a file cut short."""
    if any(len(t) != shard.rows for t in tensors):
        raise ValueError(f"{shard.rows} rows listed")


def _header_size(raw: bytes | memoryview | mmap.mmap) -> int:
    """A safetensors file's header length, from its first 8 bytes (ValueError past the
    format's 100 MB: no file psgrad wrote)."""
    size = int.from_bytes(raw[:8], "little")
    if size > 100_000_000:
        raise ValueError(f"a header of {size} bytes")
    return size


def layout(raw: bytes | memoryview | mmap.mmap) -> Layout:
    """Where a shard's tensors lie in its bytes, from its safetensors header."""
    size = _header_size(raw)
    header = json.loads(bytes(raw[8:8 + size]))
    return {name: (np.dtype(_DTYPES[entry["dtype"]]).newbyteorder("<"), tuple(entry["shape"]),
                   8 + size + entry["data_offsets"][0])
            for name, entry in header.items() if name != "__metadata__"}


def views(raw: bytes | memoryview | mmap.mmap, where: Layout) -> dict[str, np.ndarray]:
    """A shard's tensors as read-only views of its bytes (``safetensors.numpy.load`` copies;
    no copy here), laid out as ``where`` says."""
    return {name: np.frombuffer(raw, dtype, int(np.prod(shape)), offset).reshape(shape)
            for name, (dtype, shape, offset) in where.items()}


def _pieces(empty: Any, merge: bool, shards: Sequence[Shard], rows: np.ndarray, first: int
            ) -> list[tuple[str, bytes]]:
    """The index pieces of ``shards``, which hold ``rows`` from global row ``first`` on: none
    for an index FAISS does not ``merge`` (its live index adds the shards' rows)."""
    if not merge:
        return []
    out, at = [], 0
    for shard in shards:
        out.append((shard.file.removesuffix(".safetensors") + ".faiss",
                    index_file.piece(empty, rows[at:at + shard.rows], first + at)))
        at += shard.rows
    return out


def raw_safetensors(name: str, array: np.ndarray) -> tuple[bytes, memoryview]:
    """A safetensors file of one float64 tensor as (header, the array's own bytes): the 8 MiB
    Gram matrix of k = 1024 is written at every commit, and serialising copied it first."""
    array = np.ascontiguousarray(array, dtype="<f8")
    header = json.dumps({name: {"dtype": "F64", "shape": list(array.shape),
                                "data_offsets": [0, array.nbytes]}}).encode()
    header += b" " * (-len(header) % 8)  # the data starts 8-byte aligned
    return len(header).to_bytes(8, "little") + header, array.data.cast("B")


def commit_all(files: StoreFiles, parts: Sequence[tuple[str, StoreSpec, np.ndarray]],
               ids: list[int | str], id_kind: str,
               epochs: Sequence[str | None] | None = None) -> Manifest:
    """Append one batch's rows to each store of ``parts`` (an ensemble's checkpoints: key,
    definition, rows), all staged before any is committed, so that a batch refused by one
    (its ids, its rows) is committed by none; answers the first's manifest. An ensemble's
    checkpoints are committed under the store's own lock (two appends never interleave their
    rows), the first one last: its manifest is the commit, and one that fails or dies before
    it leaves the others ahead, read as they were (:meth:`StoreFiles.states`). ``epochs``:
    each checkpoint's when the batch was checked (:meth:`StoreFiles.still`)."""
    staged: list[Staged] = []
    try:
        for (key, spec, rows), epoch in zip(parts, epochs or [None] * len(parts), strict=True):
            staged.append(files.stage(key, spec, ids, id_kind, rows, epoch))
    except BaseException:
        for one in staged:
            files.discard(one)
        raise
    if len(staged) == 1:
        return files.commit(staged[0])
    order = [*range(1, len(staged)), 0]
    with files.locks.hold(parts[0][0].rpartition("/")[0]):
        try:
            olds = files.states([key for key, _, _ in parts])
        except BaseException:
            for one in staged:
                files.discard(one)
            raise
        for n, i in enumerate(order):
            try:
                done = files.commit(staged[i], olds[i])
            except BaseException:
                for rest in order[n + 1:]:
                    files.discard(staged[rest])
                raise
    return done


def refuse_duplicates(store_id: str, committed: set[int | str],
                      ids: Sequence[int | str]) -> None:
    """An id already in the store refuses the whole batch (409, the ids listed): a sample is
    added once; appending it again is a mistake or a retry that already succeeded."""
    twice = [i for i in ids if i in committed]
    if twice:
        raise Conflict(f"store '{store_id}' already holds {len(twice)} of these ids (first: "
                       f"{twice[0]!r}): nothing of this batch was added; send only new ids (the "
                       "SDK skips the ids a store holds), or DELETE the store to start over",
                       duplicates=twice[:100], count=len(twice))


def stored_rows(spec: StoreSpec, sketches: np.ndarray, ids: Sequence[int | str]) -> np.ndarray:
    """The sketches in the store's dtype. Refused, naming the samples (nothing of the batch is
    kept): a row that is not finite; a row whose squared norm, its self-influence, is past
    :data:`MAX_SELF_INFLUENCE` (such a row's dot products are not float32 numbers: an input of
    1e30 gave 3.2e59, and a default lambda that followed it zeroed every ``trak`` score); a
    value past the store's dtype's range (it would be kept as infinity)."""
    finite = np.isfinite(sketches).all(axis=1)
    if not finite.all():
        raise NonFinite(f"the sketches of {_named(ids, ~finite)} are not finite (a loss or "
                        "gradient overflowed); nothing of this batch was added: check these "
                        "samples' inputs and the weights, or leave the samples out",
                        **_details(ids, ~finite))
    power = np.einsum("ij,ij->i", sketches, sketches, dtype=np.float64)  # [B], never overflows
    past = power > MAX_SELF_INFLUENCE
    if past.any():
        first = int(np.flatnonzero(past)[0])
        raise InvalidInput(
            f"the rows of {_named(ids, past)} have a squared norm (self-influence) past "
            f"{MAX_SELF_INFLUENCE:.3g}, the most a store keeps (the first: {power[first]:.3g}); "
            "nothing of this batch was added: check these samples' inputs (a finite but "
            "extreme value such as 1e30 gives a gradient no score can use), rescale them, or "
            "leave them out", **_details(ids, past), limit=MAX_SELF_INFLUENCE,
            self_influence=power[past][:100].tolist())
    top = float(np.abs(sketches).max(initial=0.0))
    if top > float(np.finfo(spec.dtype).max):
        raise InvalidInput(f"the sketches reach {top:.3g}, past {spec.dtype}'s range: make the "
                           "store with dtype float32")
    return np.ascontiguousarray(sketches, dtype=spec.dtype)


def _named(ids: Sequence[int | str], which: np.ndarray) -> str:
    """``which`` samples, for a message: how many, and the ids of the first three."""
    named = [ids[i] for i in np.flatnonzero(which)[:4].tolist()]
    count = int(np.count_nonzero(which))
    shown = ", ".join(repr(i) for i in named[:3]) + (", ..." if count > 3 else "")
    return f"{count} sample{'s' if count > 1 else ''} ({shown})"


def _details(ids: Sequence[int | str], which: np.ndarray) -> dict[str, Any]:
    """``which`` samples, for an error's details: the first 100 ids, and how many."""
    return {"samples": [ids[i] for i in np.flatnonzero(which)[:100].tolist()],
            "count": int(np.count_nonzero(which))}


__all__ = ["MAX_SELF_INFLUENCE", "Manifest", "Shard", "Staged", "StoreFiles", "commit_all",
           "refuse_duplicates",
           "stored_rows"]


@contextlib.contextmanager
def _parsing(key: str, name: str) -> Iterator[None]:
    """A store's file read: one that does not parse as psgrad wrote it (cut short, changed
    outside psgrad) is :class:`StoreDamaged`, naming it."""
    try:
        yield
    except (ValueError, KeyError, TypeError, IndexError, OverflowError, SafetensorError) as exc:
        log.warning("store %s: its file %s cannot be read: %s: %s", key, name,
                    type(exc).__name__, str(exc)[:200])
        raise _damaged(key, f"its file {name} cannot be read") from None


def _deleted(key: str) -> NotFound:
    """A store that went while a request read or wrote it."""
    return NotFound(f"store '{owned_name(key)}' was deleted")


def _damaged(key: str, what: str) -> StoreDamaged:
    """A store whose files disagree: what is wrong, and the way out."""
    name = owned_name(key)
    return StoreDamaged(f"store '{name}' is damaged: {what}; DELETE it and add its samples "
                        "again", store=name)


def _unwritable(exc: OSError) -> InsufficientStorage | None:
    """The 507 for a data directory that cannot take a write (:func:`service.disk.unwritable`)."""
    return unwritable(exc, "the data directory", "PSGRAD_DATA_DIR")


def _sync(f: Any) -> None:
    """``f``'s bytes on the disk where it is a local file (an object store has no fsync)."""
    try:
        f.flush()
        os.fsync(f.fileno())
    except (AttributeError, OSError, io.UnsupportedOperation):
        return
