"""Every Redis key psgrad uses, and their TTLs: nothing else spells a key.

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
