"""``psgrad worker``: one process per device, taking jobs from Redis and running the batching loop.

The loop (:mod:`service.worker.loop`) runs in a thread; the main thread owns the signals and watches
Redis. SIGTERM (or SIGINT) stops taking jobs, finishes and acknowledges the batch in hand, hands
back jobs read but not started, and exits 0. A worker that cannot reach Redis for
``PSGRAD_WORKER_REDIS_GRACE_S`` exits 1, so its supervisor (Docker, systemd, Kubernetes)
restarts it. This process starts no children; one that did would use the ``spawn`` start
method (CUDA cannot be forked).
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from prometheus_client import start_http_server

from service.broker.redis.worker import RedisJobSource, consumer_name
from service.compile_cache import CompiledFunctions
from service.config import Settings, get_settings
from service.registry import make_registry
from service.storage import open_storage
from service.worker.events import Events
from service.worker.loop import Worker
from service.worker.recorder import WorkerStatus
from service.worker.series import WorkerMetrics

log = logging.getLogger("psgrad.worker")

EXIT_OK = 0
EXIT_REDIS_LOST = 1
EXIT_CONFIG = 2


def worker(device: str = "auto", settings: Settings | None = None) -> int:
    """Run one worker on ``device`` until SIGTERM; the exit code tells the supervisor why."""
    settings = (settings or get_settings()).model_copy(update={"device": device})
    if not settings.redis_url:
        log.error("psgrad worker needs PSGRAD_REDIS_URL (the api and the workers share a Redis)")
        return EXIT_CONFIG
    metrics = WorkerMetrics()
    if settings.worker_metrics_port:
        try:
            start_http_server(settings.worker_metrics_port, addr=settings.worker_metrics_host,
                              registry=metrics.registry)
        except OSError as exc:
            log.error("cannot serve metrics on %s port %d (PSGRAD_WORKER_METRICS_HOST, "
                      "PSGRAD_WORKER_METRICS_PORT): %s", settings.worker_metrics_host,
                      settings.worker_metrics_port, exc)
            return EXIT_CONFIG
        log.info("metrics on http://%s:%d/metrics", settings.worker_metrics_host,
                 settings.worker_metrics_port)
    storage = open_storage(settings)  # every store, once, handed to the loop
    registry = make_registry(settings, storage.models)
    source = RedisJobSource(settings, name=consumer_name(str(registry.device)))
    stop = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log.info("%s: finishing the batch in hand, then exiting", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    compiled = CompiledFunctions(settings, source.r, writer=True) if settings.compile else None
    status = WorkerStatus(source.name, str(registry.device))
    source.status = status.snapshot_json  # published with each heartbeat, for GET /status
    work = Worker(source, registry, settings, Events(metrics.on_event, status.on_event),
                  compiled, name=source.name, storage=storage)
    work.plan_warmup()
    source.ready = work.warmed.is_set  # its heartbeat, which /readyz reads, after the warm-up
    loop = threading.Thread(target=work.run, args=(stop,), name="psgrad-worker-loop")
    source.start()
    loop.start()
    log.info("worker %s on %s, Redis prefix %r", source.name, registry.device,
             settings.redis_prefix)
    code = EXIT_OK
    while loop.is_alive():
        if stop.wait(0.5):
            break
        if source.unreachable_for() > settings.worker_redis_grace_s:
            log.error("Redis unreachable for %.0f s: exiting so that the supervisor restarts "
                      "this worker", source.unreachable_for())
            code = EXIT_REDIS_LOST
            stop.set()
    loop.join()
    source.requeue_buffered()
    source.close()
    storage.close()
    log.info("worker %s stopped (exit %d)", source.name, code)
    return code
