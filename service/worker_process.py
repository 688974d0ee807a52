"""``psgrad worker``: one process per device, taking jobs from Redis and running the batching loop.

The loop (:mod:`service.worker.loop`) runs in a thread; the main thread owns the signals and watches
Redis. SIGTERM (or SIGINT) stops taking jobs, finishes and acknowledges the batch in hand, hands
back jobs read but not started, and exits 0. A worker that cannot reach Redis for
``PSGRAD_WORKER_REDIS_GRACE_S`` exits 1, so its supervisor (Docker, systemd, Kubernetes)
restarts it. This process starts no children; one that did would use the ``spawn`` start
method (CUDA cannot be forked).

With ``PSGRAD_WORKER_METRICS_PORT`` the worker serves its own HTTP port (:class:`WorkerPort`):
Prometheus's ``/metrics``, and ``/readyz``, 200 once its warm-ups ended (as its heartbeat), for a
readiness probe that paces a rolling update on warm workers.
"""

from __future__ import annotations

import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from types import FrameType
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import orjson
from prometheus_client import CollectorRegistry, make_wsgi_app

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


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes and probes: no lines
        pass


class WorkerPort:
    """The worker's HTTP port: ``/readyz`` answers 200 ``{"ready": true}`` once :attr:`ready`
    says so (the worker's warm-ups ended: a job it takes now starts now), else 503; every
    other path, the Prometheus metrics of ``registry``. Bound here, served from :meth:`start`
    on, in a daemon thread: the port answers (a liveness probe) while the worker starts."""

    def __init__(self, host: str, port: int, registry: CollectorRegistry) -> None:
        self.ready: Callable[[], bool] = lambda: False
        metrics = make_wsgi_app(registry)

        def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
            if environ.get("PATH_INFO") != "/readyz":
                return metrics(environ, start_response)
            ready = self.ready()
            start_response("200 OK" if ready else "503 Service Unavailable",
                           [("Content-Type", "application/json")])
            return [orjson.dumps({"ready": ready})]

        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]  # IPv4 or 6
        server: type[_Server] = type("Server", (_Server,), {"address_family": family})
        self.server = make_server(host, port, app, server, handler_class=_Quiet)

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, name="psgrad-port",
                         daemon=True).start()


def worker(device: str = "auto", settings: Settings | None = None) -> int:
    """Run one worker on ``device`` until SIGTERM; the exit code tells the supervisor why."""
    settings = (settings or get_settings()).model_copy(update={"device": device})
    if not settings.redis_url:
        log.error("psgrad worker needs PSGRAD_REDIS_URL (the api and the workers share a Redis)")
        return EXIT_CONFIG
    metrics = WorkerMetrics()
    port: WorkerPort | None = None
    if settings.worker_metrics_port:
        try:
            port = WorkerPort(settings.worker_metrics_host, settings.worker_metrics_port,
                              metrics.registry)
        except OSError as exc:
            log.error("cannot serve metrics on %s port %d (PSGRAD_WORKER_METRICS_HOST, "
                      "PSGRAD_WORKER_METRICS_PORT): %s", settings.worker_metrics_host,
                      settings.worker_metrics_port, exc)
            return EXIT_CONFIG
        port.start()
        log.info("metrics and readiness on http://%s:%d (/metrics, /readyz)",
                 settings.worker_metrics_host, settings.worker_metrics_port)
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
    if port is not None:
        port.ready = work.warmed.is_set  # and its own /readyz
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
