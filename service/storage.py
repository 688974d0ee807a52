"""Where a process keeps what outlives a request: every store, built once from the settings.

The api (:func:`service.api.create_app`) and each worker process
(:mod:`service.worker_process`) call :func:`open_storage` once, where they are assembled, and
hand the :class:`Storage` to what reads or writes state: the routes through ``AppState``, the
worker loops (the embedded pool shares the app's), the registry over its model store. Nothing
finds a store through a module-level cache, so two apps in one process (tests, a restart) never
share one by accident, and the embedded mode's memory stores are the same objects for the api
and its worker threads because they are handed the same ``Storage``.

Each store picks its backend from the settings the same way: Redis when ``PSGRAD_REDIS_URL`` is
set (shared by the api and every worker), else files (``PSGRAD_MODEL_DIR`` for models and DP
runs), else memory; gradient stores (reference sets among them) are always files under
``PSGRAD_DATA_DIR``, which every process of a deployment must see.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from service.config import Settings
from service.dp.runs import RunStore, make_run_store
from service.fast_stats import FileBackend, RedisBackend, SharedPlans
from service.model_store import ModelStore, make_store
from service.stores import StoreFiles, data_dir, make_store_files
from service.stores.sets import StoredSets

__all__ = ["Storage", "make_plan_store", "open_storage"]
log = logging.getLogger("psgrad.storage")


@dataclass(frozen=True)
class Storage:
    """The stores of one process."""

    models: ModelStore  # registered models' versions (:mod:`service.model_store`)
    runs: RunStore  # DP runs and their step counts (:mod:`service.dp.runs`)
    gradients: StoreFiles  # gradient stores and reference sets (:mod:`service.stores`)
    sets: StoredSets  # the same stores read whole as reference sets, by influence (one view,
    # and the sets it keeps in memory, for every worker loop of the process)
    plans: SharedPlans | None = None  # fast statistics' plans (:mod:`service.fast_stats._shared`)

    def close(self) -> None:
        """Close the stores' connections (Redis); the process is done with them."""
        self.models.close()
        self.runs.close()
        if self.plans is not None:
            self.plans.close()


def open_storage(settings: Settings, *, models: ModelStore | None = None) -> Storage:
    """Every store these settings name; ``models``: a model store the caller already has (a
    registry handed to :func:`service.api.create_app`), kept instead of a new one."""
    gradients = make_store_files(settings)
    return Storage(models=models if models is not None else make_store(settings),
                   runs=make_run_store(settings), gradients=gradients,
                   sets=StoredSets(gradients, settings.max_reference_set_bytes),
                   plans=make_plan_store(settings))


def make_plan_store(settings: Settings) -> SharedPlans | None:
    """Plans in Redis when a Redis URL is set (every worker reads them), else under the data
    directory's ``plans/`` when it is a local folder (an embedded server's restart reads them);
    signed with ``PSGRAD_COMPILE_SECRET`` where it is set, else, in a folder, its own key."""
    if settings.redis_url:
        import redis

        client = redis.Redis.from_url(settings.redis_url, socket_timeout=settings.redis_timeout_s)
        return SharedPlans(RedisBackend(client, settings.redis_prefix), settings.compile_secret)
    folder = data_dir(settings)
    if "://" in folder:  # an object store: plans are small and read once; keep them local
        return None
    files = FileBackend(f"{folder}/plans")
    try:
        secret = settings.compile_secret or files.own_secret()
    except OSError as exc:  # a read-only data directory: plans stay in memory
        log.warning("plans are not kept: %s", exc)
        return None
    return SharedPlans(files, secret)
