"""Brokers: how jobs travel from the api to the workers. Both implement :mod:`service.jobs`.

:mod:`service.broker.embedded` is an in-process queue (the default, no Redis URL): the app's
lifespan starts a :class:`service.worker.loop.WorkerPool` of threads over it.
:mod:`service.broker.redis` (the api's side) and :mod:`service.broker.redis.worker` (the worker's
side) move jobs through Redis Streams to ``psgrad worker`` processes. Brokers only move jobs:
none starts a worker.
"""

from __future__ import annotations

from service.config import Settings
from service.jobs import Broker

__all__ = ["make_broker"]


def make_broker(settings: Settings) -> Broker:
    """The embedded broker without a Redis URL, else the Redis broker (api side)."""
    if settings.redis_url is None:
        from service.broker.embedded import EmbeddedBroker

        return EmbeddedBroker(settings)
    from service.broker.redis.api import RedisBroker

    broker: Broker = RedisBroker(settings)  # checked against the protocol
    return broker
