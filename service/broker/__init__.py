"""Brokers: how jobs travel from the api to the workers. Two implement one interface."""

from __future__ import annotations

from typing import TYPE_CHECKING

from service.broker.base import Broker, Job, JobSource, JobState, JobStatus, new_job_id

if TYPE_CHECKING:
    from service.config import Settings
    from service.registry import ModelRegistry
    from service.worker import WorkerObserver

__all__ = ["Broker", "Job", "JobSource", "JobState", "JobStatus", "make_broker", "new_job_id"]


def make_broker(
    settings: Settings,
    *,
    registry: ModelRegistry | None = None,
    observer: WorkerObserver | None = None,
) -> Broker:
    """The embedded broker (worker threads here) without a Redis URL, else the Redis broker.

    ``registry`` and ``observer`` serve the embedded broker's own worker threads; with Redis the
    workers are separate ``psgrad worker`` processes.
    """
    if settings.redis_url is None:
        from service.broker.embedded import EmbeddedBroker
        from service.registry import make_registry

        registry = registry or make_registry(settings)  # sees PSGRAD_MODEL_DIR models too
        return EmbeddedBroker(settings, registry, observer=observer)
    from service.broker.redis import RedisBroker  # type: ignore[import-not-found,unused-ignore]

    broker: Broker = RedisBroker(settings)  # checked against the protocol
    return broker
