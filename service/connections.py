"""How the server's processes connect to Redis: one set of client options for every user of it
(brokers, the worker's source, the model store, DP runs)."""

from __future__ import annotations

from typing import Any

from redis.backoff import NoBackoff
from redis.retry import Retry

from service.config import Settings


def connection_kwargs(settings: Settings, *, bulk: bool = False) -> dict[str, Any]:
    """Short timeouts, no hidden retries: a dead Redis costs a request seconds, never a hang.

    ``bulk`` clients move payloads and results (up to hundreds of MB: seconds on a loaded host)
    and wait ``PSGRAD_REDIS_TRANSFER_TIMEOUT_S`` for an answer instead.
    """
    return {
        "socket_timeout": settings.redis_transfer_timeout_s if bulk else settings.redis_timeout_s,
        "socket_connect_timeout": settings.redis_timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "health_check_interval": 30,
    }
