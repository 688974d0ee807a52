"""Prometheus metrics, one :class:`CollectorRegistry` per app (so tests and apps never share).

The request counter is filled by :class:`MetricsMiddleware` with the route template (not the raw
path, so ids do not explode the label set); the worker loop reports batches and jobs through the
:class:`service.worker.WorkerObserver` methods; the queue depth is read from the broker on scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from service.strategies.per_sample import FUNCTIONS

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _CacheCollector(Collector):
    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "psgrad_cache_hits",
            "lookups of the transformed-function cache that found an entry",
            labels=["cache"],
        )
        family.add_metric(["per_sample_fn"], FUNCTIONS.hits)
        yield family
        misses = CounterMetricFamily(
            "psgrad_cache_misses", "lookups that had to build the function", labels=["cache"]
        )
        misses.add_metric(["per_sample_fn"], FUNCTIONS.misses)
        yield misses


class WorkerMetrics:
    """What the worker loop measures (its :class:`service.worker.WorkerObserver`); ``psgrad
    worker`` serves these alone on ``PSGRAD_WORKER_METRICS_PORT``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_wait = Histogram(
            "psgrad_queue_wait_seconds",
            "time a job waited before its engine call started",
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.compute = Histogram(
            "psgrad_compute_seconds",
            "duration of one engine call",
            buckets=TIME_BUCKETS,
            registry=r,
        )
        self.batch_jobs = Histogram(
            "psgrad_batch_jobs",
            "jobs merged into one engine call",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128),
            registry=r,
        )
        self.batch_samples = Histogram(
            "psgrad_batch_samples",
            "samples in one engine call",
            buckets=(1, 4, 16, 64, 256, 1024, 4096),
            registry=r,
        )
        self.samples = Counter("psgrad_samples", "samples processed", registry=r)
        self.jobs = Counter(
            "psgrad_jobs", "jobs finished by the workers, by status", ["status"], registry=r
        )
        r.register(_CacheCollector())

    def observe_batch(self, *, jobs: int, samples: int, compute_s: float) -> None:
        self.compute.observe(compute_s)
        self.batch_jobs.observe(jobs)
        self.batch_samples.observe(samples)
        self.samples.inc(samples)

    def observe_job(self, *, queue_s: float, samples: int, status: str) -> None:
        self.queue_wait.observe(queue_s)
        self.jobs.labels(status=status).inc()


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

    def render(self, queue_depth: int | None) -> bytes:
        if queue_depth is not None:
            self.queue_depth.set(queue_depth)
        return generate_latest(self.registry)


class MetricsMiddleware:
    """Counts every HTTP request by the matched route template and the answered status."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]
        start = time.perf_counter()

        async def observing_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, observing_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            self.metrics.requests.labels(
                route=route, method=scope.get("method", ""), status=str(status[0])
            ).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - start)
