"""``client.stores``: gradient stores on the server (docs/attribution.md).

``client.stores.create(id, model, projection_dim=...)`` defines a store (without
``projection_dim``: of full gradients) and returns its handle;
``store.add(x, y, ids=...)`` sends the samples in batches (``batch_size``), each committed whole
by the server, skipping the ids the store already holds (so an interrupted upload resumes where
it stopped); ``store.fit_factors(x, y)`` fits its K-FAC factors and EK-FAC eigenvalues over
samples; ``store.query(x, y, k=10, score="trak")`` answers ``(ids, scores)``, each ``[queries, k]``,
best first. Each exchange is described once (:class:`_Calls`); ``Store`` sends
it and ``AsyncStore`` awaits it.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np

from psgrad._arrays import to_numpy
from psgrad._base import Call, Steps, json_doc, resource_path
from psgrad._errors import APIConnectionError, BadRequest, Conflict, InvalidInput
from psgrad._progress import Progress
from psgrad._wire import REQUEST_KEY, SAFETENSORS, fields_to_safetensors

if TYPE_CHECKING:
    from psgrad._async_client import AsyncClient
    from psgrad._client import Client

__all__ = ["AsyncStore", "AsyncStores", "QueryResult", "Store", "Stores"]
Batch = tuple[Any, Any, Sequence[Any]]  # (inputs, targets or None, ids)


@dataclass(frozen=True)
class QueryResult:
    """A query's answer: ``ids`` and ``scores``, each ``[queries, k]``, best first."""

    ids: np.ndarray
    scores: np.ndarray
    score: str
    lam: float | None = None  # the lambda of a ``trak`` query
    exact: bool = True  # False: ranked among the store's index's candidates
    damping: float | list[float] | None = None  # of a ``kfac`` or ``ekfac`` query


def _path(store_id: str, tail: str = "") -> str:
    return resource_path("stores", "store", store_id, tail)


_doc = json_doc


def _result(response: httpx.Response) -> QueryResult:
    doc = response.json()
    return QueryResult(np.asarray(doc["ids"]), np.asarray(doc["scores"], dtype=np.float64),
                       doc["score"], doc.get("lambda"), bool(doc.get("exact", True)),
                       doc.get("damping"))


def _binary(path: str, fields: dict[str, Any]) -> Call[dict[str, Any]]:
    return Call("POST", path, _doc, content=fields_to_safetensors(fields, REQUEST_KEY),
                headers={"Content-Type": SAFETENSORS})


class _Calls:
    """Every exchange of the stores, described."""

    @staticmethod
    def create(store_id: str, model: str, projection_dim: int | None, loss: str | None,
               params: Sequence[str] | None, projection_seed: int | None,
               projection_kind: str | None, dtype: str | None,
               index: str | None, checkpoints: Sequence[str] | None) -> Call[dict[str, Any]]:
        body = {"model": model, "projection_dim": projection_dim, "loss": loss,
                "params": None if params is None else list(params),
                "projection_seed": projection_seed, "projection_kind": projection_kind,
                "dtype": dtype, "index": index,
                "checkpoints": None if checkpoints is None else list(checkpoints)}
        return Call("PUT", _path(store_id), _doc, json={k: v for k, v in body.items()
                                                         if v is not None})

    @staticmethod
    def get(store_id: str) -> Call[dict[str, Any]]:
        return Call("GET", _path(store_id), _doc)

    @staticmethod
    def listing() -> Call[dict[str, Any]]:
        return Call("GET", "/stores", _doc)

    @staticmethod
    def delete(store_id: str) -> Call[dict[str, Any]]:
        return Call("DELETE", _path(store_id), _doc)

    @staticmethod
    def lookup(store_id: str, ids: list[Any]) -> Call[dict[str, Any]]:
        return Call("POST", _path(store_id, "/lookup"), _doc, json={"ids": ids})

    @staticmethod
    def add(store_id: str, fields: dict[str, Any]) -> Call[dict[str, Any]]:
        return _binary(_path(store_id, "/samples"), fields)

    @staticmethod
    def factors(store_id: str, fields: dict[str, Any], second: bool = False
                ) -> Call[dict[str, Any]]:
        return _binary(_path(store_id, "/factors/eigenvalues" if second else "/factors"),
                       fields)

    @staticmethod
    def rows(store_id: str, fields: dict[str, Any]) -> Call[dict[str, Any]]:
        return _binary(_path(store_id, "/rows"), fields)

    @staticmethod
    def query(store_id: str, fields: dict[str, Any]) -> Call[QueryResult]:
        call = _binary(_path(store_id, "/query"), fields)
        return Call(call.method, call.path, _result, content=call.content, headers=call.headers)


def _ids(ids: Any, n: int) -> list[Any]:
    """Python ints or strs (numpy integers and arrays accepted), one per sample."""
    out = [int(v) if isinstance(v, (int, np.integer)) and not isinstance(v, bool) else v
           for v in (ids.tolist() if isinstance(ids, np.ndarray) else list(ids))]
    if len(out) != n:
        raise InvalidInput(f"'ids' has {len(out)} entries for {n} samples: send one per sample")
    return out


def batches(inputs: Any, targets: Any, ids: Any, batch_size: int) -> Iterator[Batch]:
    """``(inputs, targets, ids)`` of at most ``batch_size`` samples: from arrays (numpy, torch,
    lists), or from an iterable of such triples passed as ``inputs`` (each its own batch)."""
    if batch_size < 1:
        raise BadRequest("'batch_size' must be a positive integer")
    if ids is None:
        for item in inputs:
            if not isinstance(item, (tuple, list)) or len(item) != 3:
                raise BadRequest("without 'ids', add() takes an iterable of (inputs, targets, "
                                 "ids) batches")
            yield item[0], item[1], item[2]
        return
    x = to_numpy(inputs, "inputs")
    y = None if targets is None else to_numpy(targets, "targets")
    names = _ids(ids, len(x))
    for a in range(0, len(x), batch_size):
        yield x[a:a + batch_size], None if y is None else y[a:a + batch_size], \
            names[a:a + batch_size]


def _sample_fields(model: str, x: Any, y: Any, ids: list[Any], keep: list[bool]) -> dict[str, Any]:
    """The batch's samples whose ``keep`` is true, as a request (ids as a list: JSON in the
    metadata, so strings and integers alike)."""
    pick = np.flatnonzero(keep)
    fields: dict[str, Any] = {"model": model, "inputs": to_numpy(x, "inputs")[pick],
                              "ids": [ids[i] for i in pick]}
    if y is not None:
        fields["targets"] = to_numpy(y, "targets")[pick]
    return fields


def _query_fields(model: str, x: Any, y: Any, sketches: Any, k: int, score: str,
                  lam: float | None, exact: bool | None, damping: float | None,
                  probes: int | None) -> dict[str, Any]:
    fields: dict[str, Any] = {"k": k, "score": score}
    if lam is not None:
        fields["lambda"] = float(lam)
    if damping is not None:
        fields["damping"] = float(damping)
    if exact is not None:
        fields["exact"] = bool(exact)
    if probes is not None:
        fields["probes"] = int(probes)
    if sketches is not None:
        fields["sketches"] = to_numpy(sketches, "sketches").astype(np.float32)
    elif x is not None:
        fields.update(model=model, inputs=to_numpy(x, "inputs"))
        if y is not None:
            fields["targets"] = to_numpy(y, "targets")
    return fields


def _adding(store: _Handle, inputs: Any, targets: Any, ids: Any, batch_size: int,
            progress: bool | Progress, rows: bool = False
            ) -> Steps[dict[str, Any]]:
    """``add`` (``add_rows`` where ``rows``: ``inputs`` are the rows), as steps that ``Store``
    runs and ``AsyncStore`` awaits: per batch, which ids the store holds, then the rest of the
    batch (samples in the model's dtype, or rows in the store's), then its commit. Ends with
    the store's description and this call's ``added`` and ``skipped`` (ids it held)."""
    bar = Progress(f"store {store.id}") if progress is True else progress or None
    total = None if ids is None else len(_ids(ids, len(ids)))
    done = skipped = 0
    for x, y, names in batches(inputs, targets, ids, batch_size):
        names = _ids(names, len(names))
        present = (yield from store._client._calling(_Calls.lookup(store.id, names)))["present"]
        keep = [not p for p in present]
        new = [n for n, k in zip(names, keep, strict=True) if k]
        if rows and new:
            fields = {"rows": _in_dtype(x[np.flatnonzero(keep)], store.info["dtype"]),
                      "ids": new}
            store.info = yield from _once(store, _Calls.rows(store.id, fields), new)
        elif new:
            fields = yield from store._client._preparing(
                _sample_fields(store.info["model"], x, y, names, keep), float32=True)
            store.info = yield from _once(store, _Calls.add(store.id, fields), new)
        done += len(names)
        skipped += len(names) - sum(keep)
        if bar is not None:
            if skipped and isinstance(bar, Progress):
                bar.label(f"store {store.id} ({skipped} held already, skipped)")
            bar(done, total or done)
    if bar is not None:
        bar.close()
    store.info = yield from store._client._calling(_Calls.get(store.id))
    return {**store.info, "added": done - skipped, "skipped": skipped}


def _once(store: _Handle, call: Call[dict[str, Any]], ids: list[Any] | None = None
          ) -> Steps[dict[str, Any]]:
    """A batch that adds (``call``) taken once, as steps: sent again after a lost answer, up
    to the client's ``max_retries`` times, since the server takes a batch once at most. After
    a lost answer, or a 409 on a resend (perhaps the lost try, taken meanwhile), the store says
    whether an earlier try took: a batch of new ``ids`` (samples or rows, committed whole) took
    where the store holds all of them, and none of them means send it again; a factors batch
    (no ``ids``: sent under a ``batch_id`` of its own) took where the 409 says ``counted``.
    Answers the store's description."""
    for attempt in itertools.count():
        try:
            doc: dict[str, Any] = yield from store._client._calling(call)
            return doc
        except (APIConnectionError, Conflict) as exc:
            lost = isinstance(exc, APIConnectionError) and bool(exc.details.get("maybe_applied"))
            if not (lost or (isinstance(exc, Conflict) and attempt > 0)):
                raise
            if ids is None:
                took: bool | None = bool(exc.details.get("counted"))
            else:
                present = (yield from store._client._calling(_Calls.lookup(store.id, ids))
                           )["present"]
                took = True if all(present) else None if any(present) else False
            if took:
                doc = yield from store._client._calling(_Calls.get(store.id))
                return doc
            if took is None or not lost or attempt >= store._client.max_retries:
                raise
    raise AssertionError("unreachable")


PASSES = ("factors", "eigenvalues")  # a fit's passes, each counted in the store's ``factors``


def _fitting(store: _Handle, inputs: Any, targets: Any, batch_size: int,
             progress: bool | Progress, resume: bool, passes: tuple[str, ...]
             ) -> Steps[dict[str, Any]]:
    """``fit_factors`` as steps: each of ``passes`` sends the samples in batches of
    ``batch_size``, each added to the store's factors (``factors``) or to their EK-FAC
    eigenvalues (``eigenvalues``); ``resume`` first skips as many leading samples as that pass
    holds. Answers the first pass's ``fitted`` and ``skipped`` samples."""
    if batch_size < 1:
        raise BadRequest("'batch_size' must be a positive integer")
    x = to_numpy(inputs, "inputs")
    y = None if targets is None else to_numpy(targets, "targets")
    store.info = yield from store._client._calling(_Calls.get(store.id))
    bar = Progress(f"factors {store.id}") if progress is True else progress or None
    counts = []
    for at, name in enumerate(passes):
        held = {"factors": "samples", "eigenvalues": "eigenvalues"}[name]
        start = min(int((store.info.get("factors") or {}).get(held, 0)), len(x)) if resume else 0
        counts.append((len(x) - start, start))
        if isinstance(bar, Progress):
            bar.label(f"{name} {store.id}")
        for a in range(start, len(x), batch_size):
            fields: dict[str, Any] = {"model": store.info["model"], "inputs": x[a:a + batch_size]}
            if y is not None:
                fields["targets"] = y[a:a + batch_size]
            fields = {**(yield from store._client._preparing(fields, float32=True)),
                      "batch_id": uuid.uuid4().hex}
            store.info = yield from _once(store, _Calls.factors(store.id, fields,
                                                                name == "eigenvalues"))
            if bar is not None:
                bar(at * len(x) + min(a + batch_size, len(x)), len(passes) * len(x))
    if bar is not None:
        bar.close()
    return {**store.info, "fitted": counts[0][0], "skipped": counts[0][1]}


def _querying(store: _Handle, inputs: Any, targets: Any, sketches: Any, k: int, score: str,
              lam: float | None, exact: bool | None, damping: float | None = None,
              probes: int | None = None) -> Steps[QueryResult]:
    fields = _query_fields(store.info["model"], inputs, targets, sketches, k, score, lam, exact,
                           damping, probes)
    if "inputs" in fields:
        fields = yield from store._client._preparing(fields, float32=True)
    result: QueryResult = yield from store._client._calling(_Calls.query(store.id, fields))
    return result


def _in_dtype(rows: np.ndarray, dtype: str) -> np.ndarray:
    """``rows`` in the store's ``dtype``; refused as the server refuses them where a value is
    past its range (a cast would make it infinite, refused as 'not finite')."""
    top = float(np.abs(rows).max(initial=0.0)) if rows.dtype.kind in "iuf" else 0.0
    if np.isfinite(top) and top > float(np.finfo(dtype).max):
        raise InvalidInput(f"the rows reach {top:.3g}, past {dtype}'s range: make the store "
                           "with dtype float32")
    return np.ascontiguousarray(rows, dtype=dtype)


class _Handle:
    def __init__(self, client: Any, info: dict[str, Any]) -> None:
        self._client = client
        self.info = info

    @property
    def id(self) -> str:
        return str(self.info["id"])

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} {self.id}: {self.info.get('samples')} samples of "
                f"{self.info.get('model')}>")


class Store(_Handle):
    """One store; ``info`` is its description as of the last call that returned it."""

    _client: Client

    def refresh(self) -> dict[str, Any]:
        self.info = self._client._call(_Calls.get(self.id))
        return self.info

    def _run(self, plan: Steps[Any]) -> Any:
        return self._client._drive(plan)

    def add(self, inputs: Any, targets: Any = None, *, ids: Any = None, batch_size: int = 256,
            progress: bool | Progress = False) -> dict[str, Any]:
        """Add samples in batches of ``batch_size``, each committed whole, skipping the ids
        the store already holds (an interrupted upload resumes). ``inputs`` is an array (numpy,
        torch, nested lists) with ``targets`` and ``ids`` beside it, or an iterable of
        ``(inputs, targets, ids)`` batches. Returns the store's description with this call's
        ``added`` and ``skipped`` (samples whose ids the store held: never silently lost)."""
        added: dict[str, Any] = self._run(_adding(self, inputs, targets, ids, batch_size,
                                                  progress))
        return added

    def add_rows(self, rows: Any, *, ids: Any, batch_size: int = 16384,
                 progress: bool | Progress = False) -> dict[str, Any]:
        """Import rows made elsewhere (``[n, projection_dim]``: the ``projection`` output for
        the store's fields, or flattened gradients for a store of them), sent in the store's
        dtype in batches of ``batch_size``, each committed whole, skipping the ids the store
        holds, as :meth:`add` does; nothing is computed on the server."""
        added: dict[str, Any] = self._run(_adding(self, rows, None, ids, batch_size, progress,
                                                  rows=True))
        return added

    def fit_factors(self, inputs: Any, targets: Any = None, *, batch_size: int = 256,
                    progress: bool | Progress = False, resume: bool = False,
                    eigenvalues: bool = True) -> dict[str, Any]:
        """Fit the store's K-FAC factors over samples, then (``eigenvalues``) EK-FAC's
        eigenvalues in their bases over the same samples: two passes, each sending them in
        batches of ``batch_size`` (docs/attribution.md). ``kfac`` queries need the first,
        ``ekfac`` both; with ``eigenvalues=False`` only the first runs (fit factors over many
        calls, then :meth:`fit_eigenvalues`). ``resume=True`` skips as many leading samples
        as each pass already holds: an interrupted fit of the same samples in the same order
        goes on where it stopped. Returns the store's description with the first pass's
        ``fitted`` and ``skipped`` samples."""
        fitted: dict[str, Any] = self._run(_fitting(
            self, inputs, targets, batch_size, progress, resume, PASSES[:1 + eigenvalues]))
        return fitted

    def fit_eigenvalues(self, inputs: Any, targets: Any = None, *, batch_size: int = 256,
                        progress: bool | Progress = False, resume: bool = False
                        ) -> dict[str, Any]:
        """The second pass of :meth:`fit_factors` alone: EK-FAC's eigenvalues over samples,
        in the bases of the factors fitted so far (a later factors batch drops them)."""
        fitted: dict[str, Any] = self._run(_fitting(
            self, inputs, targets, batch_size, progress, resume, PASSES[1:]))
        return fitted

    def query(self, inputs: Any = None, targets: Any = None, *, sketches: Any = None,
              k: int = 10, score: str = "trak", lam: float | None = None,
              exact: bool | None = None, damping: float | None = None,
              probes: int | None = None) -> QueryResult:
        """The top ``k`` training samples of each test sample (or of each sketch), best first;
        ``score`` ``self_influence`` takes no samples and ranks the store itself. A store with
        an index answers ``dot`` and ``trak`` through it (``result.exact`` False, searching
        ``probes`` of an IVF index's lists: default 64) unless ``exact=True``. ``kfac`` and
        ``ekfac`` need the store's factors (:meth:`fit_factors`) and take ``damping``
        (default: a tenth of the Fisher's mean eigenvalue)."""
        result: QueryResult = self._run(_querying(self, inputs, targets, sketches, k, score,
                                                  lam, exact, damping, probes))
        return result

    def delete(self) -> dict[str, Any]:
        return self._client._call(_Calls.delete(self.id))


class Stores:
    """``client.stores``."""

    def __init__(self, client: Client) -> None:
        self._client = client

    def create(self, store_id: str, model: str, *, projection_dim: int | None = None,
               loss: str | None = None, params: Sequence[str] | None = None,
               projection_seed: int | None = None, projection_kind: str | None = None,
               dtype: str | None = None, index: str | None = None,
               checkpoints: Sequence[str] | None = None) -> Store:
        """Define a store (or find the same definition already made) and return its handle:
        rows of ``projection_dim`` k (sketches), or without it each sample's full gradient
        (models of at most 8192 selected values). ``index``: a FAISS factory string (such as
        ``"IVF1024,Flat"``) for an approximate index of ``dot`` and ``trak`` queries.
        ``checkpoints``: versions of ``model`` (``id@version``), an ensemble whose scores are
        the sums over them."""
        call = _Calls.create(store_id, model, projection_dim, loss, params, projection_seed,
                             projection_kind, dtype, index, checkpoints)
        return Store(self._client, self._client._call(call))

    def get(self, store_id: str) -> Store:
        return Store(self._client, self._client._call(_Calls.get(store_id)))

    def list(self) -> list[dict[str, Any]]:
        return list(self._client._call(_Calls.listing())["stores"])

    def delete(self, store_id: str) -> dict[str, Any]:
        return self._client._call(_Calls.delete(store_id))


class AsyncStore(_Handle):
    """``Store``'s methods, awaited."""

    _client: AsyncClient

    async def refresh(self) -> dict[str, Any]:
        self.info = await self._client._call(_Calls.get(self.id))
        return self.info

    async def _run(self, plan: Steps[Any]) -> Any:
        return await self._client._drive(plan)

    async def add(self, inputs: Any, targets: Any = None, *, ids: Any = None,
                  batch_size: int = 256, progress: bool | Progress = False) -> dict[str, Any]:
        """See ``Store.add``."""
        added: dict[str, Any] = await self._run(_adding(self, inputs, targets, ids, batch_size,
                                                        progress))
        return added

    async def add_rows(self, rows: Any, *, ids: Any, batch_size: int = 16384,
                       progress: bool | Progress = False) -> dict[str, Any]:
        """See ``Store.add_rows``."""
        added: dict[str, Any] = await self._run(_adding(self, rows, None, ids, batch_size,
                                                        progress, rows=True))
        return added

    async def fit_factors(self, inputs: Any, targets: Any = None, *, batch_size: int = 256,
                          progress: bool | Progress = False, resume: bool = False,
                          eigenvalues: bool = True) -> dict[str, Any]:
        """See ``Store.fit_factors``."""
        fitted: dict[str, Any] = await self._run(_fitting(
            self, inputs, targets, batch_size, progress, resume, PASSES[:1 + eigenvalues]))
        return fitted

    async def fit_eigenvalues(self, inputs: Any, targets: Any = None, *, batch_size: int = 256,
                              progress: bool | Progress = False, resume: bool = False
                              ) -> dict[str, Any]:
        """See ``Store.fit_eigenvalues``."""
        fitted: dict[str, Any] = await self._run(_fitting(
            self, inputs, targets, batch_size, progress, resume, PASSES[1:]))
        return fitted

    async def query(self, inputs: Any = None, targets: Any = None, *, sketches: Any = None,
                    k: int = 10, score: str = "trak", lam: float | None = None,
                    exact: bool | None = None, damping: float | None = None,
                    probes: int | None = None) -> QueryResult:
        """See ``Store.query``."""
        result: QueryResult = await self._run(_querying(self, inputs, targets, sketches, k,
                                                        score, lam, exact, damping, probes))
        return result

    async def delete(self) -> dict[str, Any]:
        return await self._client._call(_Calls.delete(self.id))


class AsyncStores:
    """``client.stores`` of ``AsyncClient``."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def create(self, store_id: str, model: str, *, projection_dim: int | None = None,
                     loss: str | None = None, params: Sequence[str] | None = None,
                     projection_seed: int | None = None, projection_kind: str | None = None,
                     dtype: str | None = None, index: str | None = None,
                     checkpoints: Sequence[str] | None = None) -> AsyncStore:
        """See ``Stores.create``."""
        call = _Calls.create(store_id, model, projection_dim, loss, params, projection_seed,
                             projection_kind, dtype, index, checkpoints)
        return AsyncStore(self._client, await self._client._call(call))

    async def get(self, store_id: str) -> AsyncStore:
        return AsyncStore(self._client, await self._client._call(_Calls.get(store_id)))

    async def list(self) -> list[dict[str, Any]]:
        return list((await self._client._call(_Calls.listing()))["stores"])

    async def delete(self, store_id: str) -> dict[str, Any]:
        return await self._client._call(_Calls.delete(store_id))
