"""Reference sets kept on the server: the sketches (or gradients) of some samples, by id.

``PUT /reference-sets/{id}`` computes a batch's per-sample sketches ``[M, k]`` (or, within the
size limit, full gradients ``{param: [M, *shape]}``) and keeps them here; a request then asks for
``influence`` against ``reference_set: id`` without sending them again. The backends follow
:mod:`service.model_store`: memory (embedded default), files under ``PSGRAD_MODEL_DIR``
(``<dir>/_reference_sets/<id>.json`` beside ``<id>.safetensors``, written atomically, tensors
first), or Redis (one hash per set, key names in :mod:`service.keys`), so every worker of a
Redis deployment reads the same sets. A set holds JSON and safetensors bytes, never a pickle.

Each tenant names its sets in a namespace of its own: the stores hold a set under its key,
:func:`set_key` (the id itself for the default tenant, so that sets made before tenants existed
are the default tenant's; ``<tenant>~<id>`` for any other, ``~`` being in no id).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from service import keys
from service.config import Settings
from service.model_store import _write_atomic, is_safe_id
from service.tenants import DEFAULT_TENANT, TENANT_NAME


def set_key(tenant: str, set_id: str) -> str:
    """Where the stores keep ``tenant``'s set ``set_id`` (an id checked by the caller)."""
    return set_id if tenant == DEFAULT_TENANT else f"{tenant}~{set_id}"


def set_name(key: str) -> str:
    """The id a tenant gave the set stored under ``key``."""
    return key.rpartition("~")[2]


def _safe_key(key: str) -> bool:
    tenant, sep, set_id = key.partition("~")
    return is_safe_id(set_id) and bool(TENANT_NAME.fullmatch(tenant)) if sep else is_safe_id(key)


@dataclass(frozen=True)
class ReferenceSet:
    """One stored set: how it was made and its tensors (``sketches`` or one per parameter)."""

    id: str
    model: str  # the model it was computed with, id@version
    loss: str
    params: tuple[str, ...]
    shapes: dict[str, list[int]]
    projection: tuple[int, int, str] | None  # (k, seed, kind); None: full gradients
    count: int  # M, the samples
    created: float
    tensors: dict[str, np.ndarray]
    nbytes: int = 0  # of the tensors, kept in the spec so that GET needs no tensors
    tenant: str = DEFAULT_TENANT  # whose it is (the namespace of its id)

    @property
    def key(self) -> str:
        return set_key(self.tenant, self.id)

    def doc(self) -> dict[str, Any]:
        """``GET /reference-sets/{id}``: everything but the tensors."""
        k, seed, kind = self.projection if self.projection is not None else (None, None, None)
        return {"id": self.id, "tenant": self.tenant, "model": self.model, "loss": self.loss,
                "params": list(self.params),
                "shapes": self.shapes, "projection_dim": k, "projection_seed": seed,
                "projection_kind": kind,
                "count": self.count, "created": self.created,
                "bytes": self.nbytes or sum(int(v.nbytes) for v in self.tensors.values())}

    def spec_json(self) -> str:
        return json.dumps({**self.doc(), "params": list(self.params)}, sort_keys=True)

    def tensor_bytes(self) -> bytes:
        return st_save({k: np.ascontiguousarray(v) for k, v in self.tensors.items()})

    @classmethod
    def from_parts(cls, spec: str | bytes, data: bytes | None) -> ReferenceSet:
        d = json.loads(spec)
        k, seed = d.get("projection_dim"), d.get("projection_seed")
        kind = d.get("projection_kind") or "kronecker"  # sets made before kinds were Kronecker
        return cls(d["id"], d["model"], d["loss"], tuple(d["params"]), d["shapes"],
                   (int(k), int(seed), str(kind)) if k is not None else None, int(d["count"]),
                   float(d["created"]), dict(st_load(data)) if data is not None else {},
                   int(d.get("bytes", 0)), str(d.get("tenant", DEFAULT_TENANT)))


class ReferenceStore:
    """The interface of every backend; safe to call from threads. Sets are read and deleted
    by their :func:`set_key`."""

    def put(self, ref: ReferenceSet) -> None:
        raise NotImplementedError

    def get(self, set_id: str) -> ReferenceSet | None:
        raise NotImplementedError

    def doc(self, set_id: str) -> dict[str, Any] | None:
        found = self.get(set_id)
        return found.doc() if found is not None else None

    def delete(self, set_id: str) -> bool:
        raise NotImplementedError


class MemoryReferenceStore(ReferenceStore):
    def __init__(self) -> None:
        self._sets: dict[str, ReferenceSet] = {}
        self._lock = threading.Lock()

    def put(self, ref: ReferenceSet) -> None:
        with self._lock:
            self._sets[ref.key] = ref

    def get(self, set_id: str) -> ReferenceSet | None:
        with self._lock:
            return self._sets.get(set_id)

    def delete(self, set_id: str) -> bool:
        with self._lock:
            return self._sets.pop(set_id, None) is not None


class FileReferenceStore(ReferenceStore):
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root) / "_reference_sets"
        self.root.mkdir(parents=True, exist_ok=True)

    def _paths(self, set_id: str) -> tuple[Path, Path]:
        name = set_id if _safe_key(set_id) else "_"  # an unsafe key names no file
        return self.root / f"{name}.json", self.root / f"{name}.safetensors"

    def put(self, ref: ReferenceSet) -> None:
        spec, data = self._paths(ref.key)
        _write_atomic(data, ref.tensor_bytes())
        _write_atomic(spec, ref.spec_json().encode())

    def get(self, set_id: str) -> ReferenceSet | None:
        spec, data = self._paths(set_id)
        try:
            return ReferenceSet.from_parts(spec.read_bytes(), data.read_bytes())
        except FileNotFoundError:
            return None

    def doc(self, set_id: str) -> dict[str, Any] | None:
        spec, _ = self._paths(set_id)
        try:
            return ReferenceSet.from_parts(spec.read_bytes(), None).doc()
        except FileNotFoundError:
            return None

    def delete(self, set_id: str) -> bool:
        spec, data = self._paths(set_id)
        existed = spec.exists()
        spec.unlink(missing_ok=True)  # the spec first: gone at once
        data.unlink(missing_ok=True)
        return existed


class RedisReferenceStore(ReferenceStore):
    def __init__(self, client: Any, prefix: str) -> None:
        self.r = client
        self.prefix = prefix

    def put(self, ref: ReferenceSet) -> None:
        self.r.hset(keys.reference_set(self.prefix, ref.key),
                    mapping={"spec": ref.spec_json(), "tensors": ref.tensor_bytes()})

    def get(self, set_id: str) -> ReferenceSet | None:
        spec, data = self.r.hmget(keys.reference_set(self.prefix, set_id), ["spec", "tensors"])
        if spec is None or data is None:
            return None
        return ReferenceSet.from_parts(spec, bytes(data))

    def doc(self, set_id: str) -> dict[str, Any] | None:
        spec = self.r.hget(keys.reference_set(self.prefix, set_id), "spec")
        return ReferenceSet.from_parts(spec, None).doc() if spec is not None else None

    def delete(self, set_id: str) -> bool:
        return bool(self.r.delete(keys.reference_set(self.prefix, set_id)))


def make_reference_store(settings: Settings) -> ReferenceStore:
    """Redis when a Redis URL is set, else files under ``model_dir`` when set, else memory."""
    if settings.redis_url:
        import redis

        return RedisReferenceStore(redis.Redis.from_url(settings.redis_url),
                                   settings.redis_prefix)
    if settings.model_dir:
        return FileReferenceStore(settings.model_dir)
    return MemoryReferenceStore()
