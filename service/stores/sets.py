"""Reference sets: small gradient stores that ``influence`` reads whole.

``PUT /reference-sets/{id}`` computes a batch's sketches (with ``projection_dim``) or its full
gradients and keeps them as the caller's gradient store ``{id}``, its rows under the ids 0 to
M - 1: one concept and one namespace, so the set is also ``/stores/{id}`` (``GET``, ``query``,
``DELETE``), and any store of the caller is a ``reference_set``. A set of full gradients is a
store of kind :data:`~service.stores.spec.EXACT`: each row is a sample's gradients of the
selected parameters, flattened and concatenated in the model's parameter order (it keeps no Gram
matrix, so ``trak`` needs sketches).

``influence`` scores a batch against every row of the set at once, so the worker reads the set
whole (:class:`StoredSets`, which keeps the sets it read as of their last commit), and only a
store within ``PSGRAD_MAX_REFERENCE_SET_BYTES`` serves as one; a larger store is ranked by
``POST /stores/{id}/query`` (top-k, streamed).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from psgrad._errors import Conflict, TooLarge
from service.config import raise_setting
from service.lru import LockedLRU
from service.registry import LoadedModel
from service.stores import factors
from service.stores.files import Manifest, StoreFiles
from service.stores.spec import EXACT, StoreSpec
from service.strategies.projection import KINDS, VERSIONS, Projection
from service.tenants import owned_name
from service.validate.attribution import ReferenceSet


def set_spec(set_id: str, fields: dict[str, Any], result: dict[str, Any], model: LoadedModel,
             tenant: str) -> StoreSpec:
    """The store a set made by ``fields`` is (``result``: the joined answer of its jobs,
    ``model``: the version that computed it)."""
    params = tuple(p for p in model.params if p in set(fields.get("params") or model.params))
    shapes = {p: list(model.params[p].shape) for p in params}
    dim = fields.get("projection_dim")
    meta = result.get("meta") or {}
    if dim is None:
        kind, k, seed = EXACT, sum(math.prod(s) for s in shapes.values()), 0
    else:
        kind = str(meta.get("projection_kind") or fields.get("projection_kind") or KINDS[0])
        k, seed = int(dim), int(fields.get("projection_seed") or 0)
    version = int(meta.get("projection_version") or VERSIONS.get(kind, 1))
    return StoreSpec(id=set_id, model=str(result["model"]), loss=str(result["loss"]),
                     params=params, projection_dim=k, projection_seed=seed, projection_kind=kind,
                     dtype="float32", tenant=tenant, shapes=shapes, projection_version=version)


def set_rows(spec: StoreSpec, result: dict[str, Any], full: bool = False) -> np.ndarray:
    """The set's rows ``[M, projection_dim]``: the sketches, or each sample's gradients
    flattened in ``spec.params`` order (``full``: the gradients of a store that keeps sketches,
    which K-FAC fits and preconditions)."""
    if not (spec.exact or full):
        return np.asarray(result["projection"])
    grads = result["grads"]
    return np.concatenate([np.asarray(grads[p]).reshape(len(grads[p]), -1)
                           for p in spec.params], axis=1)


def set_bytes(spec: StoreSpec, manifest: Manifest) -> int:
    """The bytes of the set's rows (what ``PSGRAD_MAX_REFERENCE_SET_BYTES`` bounds)."""
    return manifest.count * spec.projection_dim * spec.itemsize


def keep_set(files: StoreFiles, key: str, spec: StoreSpec, rows: np.ndarray,
             max_bytes: int) -> Manifest:
    """Keep the set as the store ``key``, replacing a set of that id; a store no set could be
    (larger than a set may be, an ensemble, one with an index or fitted factors) is refused
    (409), never replaced."""
    old = files.spec(key)
    if old is not None:
        kept = ("larger than a reference set (PSGRAD_MAX_REFERENCE_SET_BYTES, "
                f"{max_bytes})" if set_bytes(old, files.manifest(key)) > max_bytes else
                f"an ensemble of {len(old.checkpoints)} checkpoints" if old.checkpoints else
                "one with an index" if old.index is not None else
                "one with fitted factors" if factors.fitted(files, key) is not None else None)
        if kept is not None:
            raise Conflict(f"'{spec.id}' is a gradient store {kept}; a reference set does not "
                           f"replace it: DELETE /stores/{spec.id} first, or use another id")
    files.delete(key)
    files.create(key, spec)
    return files.append(key, spec, list(range(len(rows))), "int", rows)


def set_doc(spec: StoreSpec, manifest: Manifest) -> dict[str, Any]:
    """``GET /reference-sets/{id}``: how the set was made (projection fields null for full
    gradients), its samples and the bytes of its rows."""
    sketched = not spec.exact
    return {"id": spec.id, "tenant": spec.tenant, "model": spec.model, "loss": spec.loss,
            "params": list(spec.params), "shapes": spec.shapes,
            "projection_dim": spec.projection_dim if sketched else None,
            "projection_seed": spec.projection_seed if sketched else None,
            "projection_kind": spec.projection_kind if sketched else None,
            "projection_version": spec.projection_version if sketched else None,
            "count": manifest.count, "created": spec.created,
            "bytes": set_bytes(spec, manifest)}


class StoredSets:
    """The reference sets ``influence`` reads (:class:`service.validate.attribution.ReferenceSets`):
    the stores of a data directory, each read whole, up to ``max_bytes``. The sets read last
    are kept (``max_bytes`` of rows in all) as of their commit, so a batch split in many
    requests reads its set once; a commit or a store made again under the id is read anew."""

    def __init__(self, files: StoreFiles, max_bytes: int) -> None:
        self.files = files
        self.max_bytes = max_bytes
        self._kept: LockedLRU[tuple[str, str, int], ReferenceSet] = LockedLRU(
            16, budget=max_bytes, weigh=lambda ref: sum(v.nbytes for v in ref.tensors.values()))

    def get(self, key: str) -> ReferenceSet | None:
        spec = self.files.spec(key)
        if spec is None:
            return None
        name = owned_name(key)
        if spec.checkpoints:
            raise Conflict(f"store '{name}' is an ensemble of {len(spec.checkpoints)} "
                           f"checkpoints, not a reference set: rank it with POST "
                           f"/stores/{name}/query")
        manifest = self.files.manifest(key)
        size = set_bytes(spec, manifest)
        if size > self.max_bytes:
            raise TooLarge(f"store '{name}' holds {size} bytes of rows, more than a reference "
                           f"set may ({self.max_bytes}): rank it with POST /stores/{name}/query "
                           "(top k, streamed), or "
                           f"{raise_setting('max_reference_set_bytes', self.max_bytes)}",
                           limit=self.max_bytes, size=size)
        if manifest.count == 0:
            raise Conflict(f"store '{name}' is empty: add samples with POST "
                           f"/stores/{name}/samples first")
        spec.check_version()
        return self._kept.get_or_make((key, *manifest.version),
                                      lambda: self._read(key, spec, manifest))

    def _read(self, key: str, spec: StoreSpec, manifest: Manifest) -> ReferenceSet:
        rows = np.concatenate([np.array(part, dtype=np.float32)  # copied out of the shard
                               for _, part, _ in self.files.rows(key, manifest)])
        if not spec.exact:
            return ReferenceSet(spec.id, spec.model, spec.params, spec.shapes,
                                Projection(spec.projection_dim, spec.projection_seed,
                                           spec.projection_kind), {"sketches": rows})
        tensors, start = {}, 0
        for p in spec.params:
            shape = spec.shapes[p]
            width = math.prod(shape)
            tensors[p] = rows[:, start:start + width].reshape(len(rows), *shape)
            start += width
        return ReferenceSet(spec.id, spec.model, spec.params, spec.shapes, None, tensors)
