"""Gradient stores: every training sample's sketch kept on disk, queried for the top-k most
influential samples of a test batch (``/stores``; docs/attribution.md).

- :mod:`service.stores.spec`: what a store is (model version, loss, parameters, projection,
  dtype) and its sample ids;
- :mod:`service.stores.files`: shards, manifest and Gram matrix under the data directory
  (fsspec), the commit protocol;
- :mod:`service.stores.locks`: one committer of a store at a time (a thread lock, or a Redis
  lease shared by api replicas);
- :mod:`service.stores.query`: the streamed top-k (``dot``, ``cosine``, ``trak``,
  ``self_influence``, ``kfac``, ``ekfac``);
- :mod:`service.stores.index`: a store's FAISS index for approximate top-k: trained once, a
  piece per shard, merged in a process's memory (``Live``);
- :mod:`service.stores.factors`: a store's K-FAC factors and the ``kfac``/``ekfac`` scores'
  preconditioning of a query;
- :mod:`service.stores.requests`: bodies to specs and to the jobs that compute a batch's rows.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from service.config import Settings
from service.stores.files import StoreFiles
from service.stores.locks import Locks, RedisLocks, ThreadLocks

__all__ = ["StoreFiles", "data_dir", "make_store_files"]


def data_dir(settings: Settings) -> str:
    """``PSGRAD_DATA_DIR`` (a path or an fsspec URL), else a folder of this server's own under
    ``$XDG_DATA_HOME/psgrad`` (by default ``~/.local/share/psgrad``): ``port-<port>`` for an
    embedded server, ``redis-<digest of the URL and prefix>`` for the api and workers of one
    Redis queue. Two servers a user runs never list, or delete, each other's tenants' data."""
    if settings.data_dir:
        return settings.data_dir
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    if settings.redis_url:
        queue = f"{settings.redis_url}|{settings.redis_prefix}".encode()
        own = f"redis-{hashlib.sha256(queue).hexdigest()[:12]}"
    else:
        own = f"port-{settings.listen_port}"
    return str(Path(base) / "psgrad" / own)


def make_store_files(settings: Settings) -> StoreFiles:
    """The stores of the data directory; their commits locked in Redis when a Redis URL is set
    (every api replica appends), else in this process."""
    locks: Locks
    if settings.redis_url:
        import redis

        locks = RedisLocks(redis.Redis.from_url(settings.redis_url,
                                                socket_timeout=settings.redis_timeout_s),
                           settings.redis_prefix)
    else:
        locks = ThreadLocks()
    return StoreFiles(data_dir(settings), locks, settings.store_shard_bytes,
                      settings.index_memory_bytes)
