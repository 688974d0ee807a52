"""The Redis keys of what psgrad keeps (registered models, gradient stores' commit leases,
compiled artifacts, fast-statistics plans, DP runs) and their TTLs: nothing else spells one.
The job queue's keys are the Redis broker's (:mod:`service.broker.redis.keyspace`), beside the
scripts that use them.

Each key starts with the configured prefix (``PSGRAD_REDIS_PREFIX``), so several deployments or
test runs share one Redis without seeing each other.
"""

from __future__ import annotations

# --- the registered-model store (service/model_store.py); no TTL: models live until deleted ---


def model_ids(prefix: str) -> str:
    """Set of registered model ids."""
    return f"{prefix}:models"


def model_seq(prefix: str) -> str:
    """Counter giving each registered version its place in its id's order."""
    return f"{prefix}:models:seq"


def model_versions(prefix: str, model_id: str) -> str:
    """Sorted set of an id's versions, scored by registration order (newest last)."""
    return f"{prefix}:model:{model_id}:versions"


def model_version(prefix: str, model_id: str, version: str) -> str:
    """Hash of one version: ``spec`` (JSON) and ``weights`` (safetensors bytes)."""
    return f"{prefix}:model:{model_id}:v:{version}"


def store_lock(prefix: str, store: str) -> str:
    """The commit lease of one gradient store (service/stores/locks.py): a token, expiring."""
    return f"{prefix}:store-lock:{store}"


# --- compiled-function cache (service/compile_cache.py) ---


COMPILE_TTL_S = 7 * 24 * 3600  # compiled artifacts unused this long are dropped


def compile_artifact(prefix: str, signature: str) -> str:
    """Bytes of ``torch.compiler.save_cache_artifacts`` for one signature digest."""
    return f"{prefix}:compiled:{signature}"


# --- fast-statistics plans (service/fast_stats/_shared.py) ---


PLAN_TTL_S = 30 * 24 * 3600  # a fast-statistics plan unread this long is dropped


def plan(prefix: str, name: str) -> str:
    """A fast-statistics plan (JSON, service/fast_stats/_shared.py), by a digest of what it
    depends on: model structure, dtype, loss, selection, sample fields, device, code."""
    return f"{prefix}:plan:{name}"


# --- DP runs (service/dp/runs.py); no TTL: a run and its step count live until deleted ---


def dp_run_ids(prefix: str) -> str:
    """Set of DP run ids."""
    return f"{prefix}:dp-runs"


def dp_run(prefix: str, run_id: str) -> str:
    """Hash of one DP run: ``spec`` (JSON) and ``steps`` (the steps counted so far)."""
    return f"{prefix}:dp-run:{run_id}"


def dp_run_jobs(prefix: str, run_id: str) -> str:
    """Set of the job ids already counted as steps of a run (a retried job counts once)."""
    return f"{prefix}:dp-run:{run_id}:jobs"


def dp_run_released(prefix: str, run_id: str) -> str:
    """Set of the job ids of a run whose noisy answers went out, or began to: a step releases
    one answer at most (:meth:`service.dp.runs.RunStore.released`)."""
    return f"{prefix}:dp-run:{run_id}:released"


def dp_ledger_sync(prefix: str) -> str:
    """Counter a worker increments right before ``WAITAOF``: a write of that connection after
    every step it counted, so that the wait covers them all (``WAITAOF`` waits for the writes
    of its own connection only)."""
    return f"{prefix}:dp-ledger-sync"
