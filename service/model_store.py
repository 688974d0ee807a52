"""Where registered models live: id -> versions, each an architecture, a config and weights.

Three backends behind one small interface, chosen by :func:`make_store` from the settings:

- :class:`MemoryModelStore`: the embedded default; gone when the process ends.
- :class:`FileModelStore`: embedded mode with ``PSGRAD_MODEL_DIR``: ``<dir>/<id>/<version>.json``
  (the spec) beside ``<version>.safetensors`` (the weights), each written to a temporary file
  and renamed into place, weights first, so a version exists exactly when its JSON does. One
  process writes a directory at a time.
- :class:`RedisModelStore`: distributed mode; every api and worker sees the same models, and
  they outlive any process. Key names are in :mod:`service.redis_keys`.

A store holds bytes and JSON only: weights are a safetensors file, never a pickle, and are
checked (names, shapes, dtypes, finiteness) before they get here. Versions of an id are ordered
by registration; the newest answers the plain id.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from psgrad._contract import ID_PATTERN, REF_PATTERN, VERSION_PATTERN
from service import redis_keys
from service.config import Settings
from service.disk import unwritable

ID_RE = re.compile(ID_PATTERN)  # the request contract's (psgrad._contract)
VERSION_RE = re.compile(VERSION_PATTERN)
REF_RE = re.compile(REF_PATTERN)  # id, or id@version


def is_safe_id(model_id: str) -> bool:
    """Ids are file names and Redis key parts: 1-64 of a-z 0-9 . _ -, not starting with . _ -."""
    return bool(ID_RE.fullmatch(model_id))


@dataclass(frozen=True)
class ModelRecord:
    """One registered version: what to build and the safetensors bytes of its state."""

    id: str
    version: str
    architecture: str
    config: dict[str, Any]
    weights: bytes
    created: float
    doc: dict[str, Any] = field(default_factory=dict)  # GET /models/{id}, kept to list cheaply

    def spec_json(self) -> str:
        return json.dumps({"id": self.id, "version": self.version,
                           "architecture": self.architecture, "config": self.config,
                           "created": self.created, "doc": self.doc}, sort_keys=True)

    @classmethod
    def from_spec(cls, spec: str | bytes, weights: bytes) -> ModelRecord:
        d = json.loads(spec)
        return cls(d["id"], d["version"], d["architecture"], d["config"], weights,
                   float(d["created"]), d.get("doc") or {})


class ModelStore:
    """The interface every backend implements; all methods are safe to call from threads."""

    def put(self, record: ModelRecord) -> None:
        """Add a version, or make an existing one (same digest) the newest again."""
        raise NotImplementedError

    def get(self, model_id: str, version: str, *, weights: bool = True) -> ModelRecord | None:
        """A version; ``weights=False``: without its weights where they would be read (the
        record's ``weights`` empty), for what needs only its spec."""
        raise NotImplementedError

    def weights_file(self, model_id: str, version: str) -> Path | None:
        """The version's weights as a safetensors file on this host, where the store keeps them
        so (a loader maps it in place of reading it whole); None: they are ``get``'s bytes."""
        return None

    def doc(self, model_id: str, version: str) -> dict[str, Any] | None:
        """The stored ``GET /models/{id}`` document of a version, without its weights."""
        record = self.get(model_id, version, weights=False)
        return record.doc if record is not None else None

    def versions(self, model_id: str) -> list[str]:
        """The versions of ``model_id``, oldest first; empty when the id is unknown."""
        raise NotImplementedError

    def latest(self, model_id: str) -> str | None:
        found = self.versions(model_id)
        return found[-1] if found else None

    def has(self, model_id: str, version: str) -> bool:
        return version in self.versions(model_id)

    def ids(self) -> list[str]:
        raise NotImplementedError

    def delete(self, model_id: str, version: str | None = None) -> list[str]:
        """Remove one version, or every version when ``version`` is None; answer what went."""
        raise NotImplementedError

    def warmup(self, model_id: str, version: str) -> dict[str, Any] | None:
        """The warm-up asked for at the version's registration (:mod:`service.warmup`)."""
        raise NotImplementedError

    def set_warmup(self, model_id: str, version: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (plain JSON) with the version; nothing once the version is gone."""
        raise NotImplementedError

    def close(self) -> None:
        return None


class MemoryModelStore(ModelStore):
    def __init__(self) -> None:
        self._models: dict[str, OrderedDict[str, ModelRecord]] = {}
        self._warmups: dict[tuple[str, str], dict[str, Any]] = {}
        self._lock = threading.Lock()

    def put(self, record: ModelRecord) -> None:
        with self._lock:
            versions = self._models.setdefault(record.id, OrderedDict())
            versions.pop(record.version, None)
            versions[record.version] = record

    def get(self, model_id: str, version: str, *, weights: bool = True) -> ModelRecord | None:
        with self._lock:  # the weights are in memory: kept either way
            versions = self._models.get(model_id)
            return versions.get(version) if versions is not None else None

    def versions(self, model_id: str) -> list[str]:
        with self._lock:
            return list(self._models.get(model_id, {}))

    def ids(self) -> list[str]:
        with self._lock:
            return sorted(self._models)

    def delete(self, model_id: str, version: str | None = None) -> list[str]:
        with self._lock:
            versions = self._models.get(model_id)
            if versions is None:
                return []
            gone = list(versions) if version is None else [version] if version in versions else []
            for v in gone:
                del versions[v]
                self._warmups.pop((model_id, v), None)
            if not versions:
                del self._models[model_id]
            return gone

    def warmup(self, model_id: str, version: str) -> dict[str, Any] | None:
        with self._lock:
            return self._warmups.get((model_id, version))

    def set_warmup(self, model_id: str, version: str, record: dict[str, Any]) -> None:
        with self._lock:
            if version in self._models.get(model_id, {}):
                self._warmups[(model_id, version)] = record


def _write_atomic(path: Path, data: bytes, exclusive: bool = False) -> bool:
    """Write beside ``path``, flush to disk, then rename: readers see all or nothing.
    ``exclusive``: only where no ``path`` exists (linked in, not renamed over it; False where
    one did, written by this process or another)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if not exclusive:
            os.replace(tmp, path)
            return True
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)
        return True
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class FileModelStore(ModelStore):
    """Versions as files under ``root``; ids are restricted to a safe character set upstream."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def _folder(self, model_id: str) -> Path:
        """Only safe ids become paths: anything else is a folder that cannot exist."""
        return self.root / model_id if is_safe_id(model_id) else self.root / "_"  # never made

    def _file(self, model_id: str, version: str, suffix: str) -> Path:
        """A version's file; a version not of its form (``../x``, 300 characters) names a file
        that cannot exist, so no path outside the folder is ever read or tested."""
        if not VERSION_RE.fullmatch(version):
            return self.root / "_" / "_"
        return self._folder(model_id) / f"{version}{suffix}"

    def _specs(self, model_id: str) -> list[tuple[float, str]]:
        folder = self._folder(model_id)
        if not folder.is_dir():
            return []
        found = []
        for path in folder.glob("*.json"):
            try:
                created = float(json.loads(path.read_text())["created"])
            except (OSError, ValueError, KeyError):
                continue  # deleted meanwhile, or not ours
            found.append((created, path.stem))
        return sorted(found)

    def put(self, record: ModelRecord) -> None:
        if not is_safe_id(record.id):
            raise ValueError(f"unsafe model id {record.id!r}")
        folder = self._folder(record.id)
        with self._lock:
            newest = max((c for c, _ in self._specs(record.id)), default=0.0)
            created = max(record.created, newest + 1e-6)
            stored = replace(record, created=created)
            weights = folder / f"{record.version}.safetensors"
            written = False
            try:
                folder.mkdir(exist_ok=True)
                if not weights.exists():
                    _write_atomic(weights, record.weights)
                    written = True
                _write_atomic(folder / f"{record.version}.json", stored.spec_json().encode())
            except OSError as exc:  # a full or read-only volume is the client's 507, not a 500
                if written:  # no weights without their spec: nothing of the version is left
                    weights.unlink(missing_ok=True)
                refused = unwritable(exc, "the model directory", "PSGRAD_MODEL_DIR")
                if refused is None:
                    raise
                raise refused from None

    def has(self, model_id: str, version: str) -> bool:
        return self._file(model_id, version, ".json").is_file()

    def get(self, model_id: str, version: str, *, weights: bool = True) -> ModelRecord | None:
        try:
            spec = self._file(model_id, version, ".json").read_bytes()
            data = self._file(model_id, version, ".safetensors").read_bytes() if weights else b""
        except (FileNotFoundError, NotADirectoryError):
            return None
        return ModelRecord.from_spec(spec, data)

    def weights_file(self, model_id: str, version: str) -> Path | None:
        path = self._file(model_id, version, ".safetensors")
        return path if path.is_file() else None

    def versions(self, model_id: str) -> list[str]:
        return [v for _, v in self._specs(model_id)]

    def ids(self) -> list[str]:
        return sorted(p.name for p in self.root.iterdir()  # unsafe names are not models
                      if p.is_dir() and is_safe_id(p.name) and any(p.glob("*.json")))

    def delete(self, model_id: str, version: str | None = None) -> list[str]:
        folder = self._folder(model_id)
        with self._lock:
            targets = self.versions(model_id) if version is None else (
                [version] if self._file(model_id, version, ".json").exists() else [])
            for v in targets:
                (folder / f"{v}.json").unlink(missing_ok=True)  # the spec first: gone at once
                (folder / f"{v}.safetensors").unlink(missing_ok=True)
                (folder / f"{v}.warmup").unlink(missing_ok=True)
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        return targets

    def warmup(self, model_id: str, version: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = json.loads(self._file(model_id, version, ".warmup")
                                               .read_bytes())
        except (OSError, ValueError):  # none asked, or not ours
            return None
        return found

    def set_warmup(self, model_id: str, version: str, record: dict[str, Any]) -> None:
        with self._lock:
            if self.has(model_id, version):
                _write_atomic(self._file(model_id, version, ".warmup"),
                              json.dumps(record).encode())


class RedisModelStore(ModelStore):
    """Versions in Redis: a set of ids, a sorted set of versions per id, a hash per version."""

    def __init__(self, client: Any, prefix: str) -> None:
        self.r = client
        self.prefix = prefix

    def has(self, model_id: str, version: str) -> bool:
        return self.r.zscore(redis_keys.model_versions(self.prefix, model_id), version) is not None

    def put(self, record: ModelRecord) -> None:
        seq = self.r.incr(redis_keys.model_seq(self.prefix))
        pipe = self.r.pipeline(transaction=True)
        pipe.hset(redis_keys.model_version(self.prefix, record.id, record.version),
                  mapping={"spec": record.spec_json(), "weights": record.weights})
        pipe.zadd(redis_keys.model_versions(self.prefix, record.id), {record.version: seq})
        pipe.sadd(redis_keys.model_ids(self.prefix), record.id)
        pipe.execute()

    def get(self, model_id: str, version: str, *, weights: bool = True) -> ModelRecord | None:
        key = redis_keys.model_version(self.prefix, model_id, version)
        spec, data = self.r.hmget(key, ["spec", "weights"]) if weights else (
            self.r.hget(key, "spec"), b"")
        if spec is None or data is None:
            return None
        return ModelRecord.from_spec(spec, bytes(data))

    def versions(self, model_id: str) -> list[str]:
        found = self.r.zrange(redis_keys.model_versions(self.prefix, model_id), 0, -1)
        return [v.decode() for v in found]

    def latest(self, model_id: str) -> str | None:
        found = self.r.zrange(redis_keys.model_versions(self.prefix, model_id), -1, -1)
        return found[0].decode() if found else None

    def ids(self) -> list[str]:
        found = self.r.smembers(redis_keys.model_ids(self.prefix))
        return sorted(v.decode() for v in found)

    def delete(self, model_id: str, version: str | None = None) -> list[str]:
        versions_key = redis_keys.model_versions(self.prefix, model_id)
        gone: list[str] = []

        def remove(pipe: Any) -> None:
            gone.clear()
            present = [v.decode() for v in pipe.zrange(versions_key, 0, -1)]
            targets = present if version is None else [v for v in present if v == version]
            pipe.multi()
            for v in targets:
                pipe.delete(redis_keys.model_version(self.prefix, model_id, v))
                pipe.zrem(versions_key, v)
            if targets and len(targets) == len(present):
                pipe.delete(versions_key)
                pipe.srem(redis_keys.model_ids(self.prefix), model_id)
            gone.extend(targets)

        self.r.transaction(remove, versions_key)
        return gone

    def warmup(self, model_id: str, version: str) -> dict[str, Any] | None:
        raw = self.r.hget(redis_keys.model_version(self.prefix, model_id, version), "warmup")
        try:
            return json.loads(raw) if raw is not None else None
        except ValueError:
            return None

    def set_warmup(self, model_id: str, version: str, record: dict[str, Any]) -> None:
        key = redis_keys.model_version(self.prefix, model_id, version)
        self.r.eval(SET_IF_PRESENT, 1, key, "warmup", json.dumps(record))

    def close(self) -> None:
        self.r.close()


# a field of a hash that exists (a version deleted meanwhile stays deleted)
SET_IF_PRESENT = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
"""


def make_store(settings: Settings) -> ModelStore:
    """Redis when a Redis URL is set, else files under ``model_dir`` when set, else memory."""
    if settings.redis_url:
        import redis

        return RedisModelStore(redis.Redis.from_url(settings.redis_url), settings.redis_prefix)
    if settings.model_dir:
        return FileModelStore(settings.model_dir)
    return MemoryModelStore()
