"""The api's Prometheus metrics: the worker loop's series plus the requests and the queue.

The request counter is filled by :class:`MetricsMiddleware` with the route template (not the raw
path, so ids do not explode the label set); the worker series (:mod:`service.worker.series`)
are fed by the embedded worker threads' events (and stay empty with Redis, whose workers serve
their own); the queue depth is read from the broker on scrape.
"""

from __future__ import annotations

import time

from prometheus_client import Counter, Gauge, Histogram, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.api.status_data import RequestStats, error_code
from service.worker.series import TIME_BUCKETS, WorkerMetrics

ERROR_BODY_BYTES = 8192  # an error answer's body is read this far for its code (status page)


class Metrics(WorkerMetrics):
    """Every metric of one app: the requests, the queue, and the worker loop's in embedded mode."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter(
            "psgrad_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "psgrad_request_seconds",
            "HTTP request latency by route",
            ["route"],
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.queue_depth = Gauge("psgrad_queue_depth", "jobs waiting in the queue", registry=r)
        self.recent = RequestStats()  # the status page's view of the same requests

    def render(self, queue_depth: int | None) -> bytes:
        if queue_depth is not None:
            self.queue_depth.set(queue_depth)
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP request by the matched route template and the answered status; for the
    status page also by model and, for an error answer, by its code (read from its body).

    A request counts when its answer's last byte is handed to the server, not when the app
    returns: background tasks (forgetting the job) run after that, and a server may already
    serve the client's next request on the connection (uvicorn's httptools protocol does).
    """

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        counted = False
        error = bytearray()  # the start of an error answer's body
        start = time.perf_counter()

        def count() -> None:
            nonlocal counted
            if counted:
                return
            counted = True
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(
                route=route, method=scope.get("method", ""), status=str(status)
            ).inc()
            seconds = time.perf_counter() - start
            self.metrics.latency.labels(route=route).observe(seconds)
            self.metrics.recent.observe(
                scope, route=route, status=status, seconds=seconds,
                code=error_code(bytes(error), status) if status >= 400 else None)

        async def observing_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif status >= 400 and len(error) < ERROR_BODY_BYTES:
                error.extend(message.get("body", b"")[:ERROR_BODY_BYTES])
            last = message["type"] == "http.response.body" and not message.get("more_body")
            if last:
                count()  # before the send: the client may ask again as soon as it has it
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        finally:
            count()  # no last body sent (an error, a client gone): counted all the same
