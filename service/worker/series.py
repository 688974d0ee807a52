"""The worker loop's Prometheus series, one :class:`CollectorRegistry` per owner.

:class:`WorkerMetrics` subscribes to the loop's events (:mod:`service.worker.events`).
``psgrad worker`` serves it alone on ``PSGRAD_WORKER_METRICS_PORT``; the api's metrics
(:class:`service.api.metrics.Metrics`) extend it, so in embedded mode one ``/metrics`` shows the
requests and the worker threads together. Tests and apps never share a registry.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from service.fast_stats._plan import PLANS
from service.lru import LockedLRU
from service.strategies import per_sample
from service.worker.events import BatchEnded, JobEnded, JobVerified, WorkerEvent

__all__ = ["TIME_BUCKETS", "WorkerMetrics"]

TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _CacheCollector(Collector):
    """The compute caches' lookups, read on scrape (each cache counts them): the per-sample
    functions (``vmap``) and the fast-statistics plans (one per model structure and call shape).
    """

    CACHES: dict[str, LockedLRU[object, object]] = {
        "per_sample_fn": per_sample.FUNCTIONS,  # type: ignore[dict-item]
        "fast_stats_plan": PLANS,  # type: ignore[dict-item]
    }

    def collect(self) -> Iterator[Metric]:
        hits = CounterMetricFamily(
            "psgrad_cache_hits", "lookups of a compute cache that found an entry",
            labels=["cache"],
        )
        misses = CounterMetricFamily(
            "psgrad_cache_misses", "lookups that had to build the entry", labels=["cache"]
        )
        for name, cache in self.CACHES.items():
            hits.add_metric([name], cache.hits)
            misses.add_metric([name], cache.misses)
        yield hits
        yield misses


class WorkerMetrics:
    """What the worker loop measures: engine calls, their batches, and how each job ended."""

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
        self.verified_jobs = Counter(
            "psgrad_verified_jobs", "jobs whose answer was verified (verify, or "
            "PSGRAD_VERIFY_FRACTION), failed ones included", registry=r)
        self.verified_samples = Counter(
            "psgrad_verified_samples", "samples recomputed with the per-sample loop", registry=r)
        self.verify_failures = Counter(
            "psgrad_verification_failures", "verified answers that differed from the per-sample "
            "loop (each failed its job with verification_failed)", registry=r)
        self.verify_seconds = Histogram(
            "psgrad_verification_seconds", "duration of one job's verification",
            buckets=TIME_BUCKETS, registry=r)
        r.register(_CacheCollector())

    def on_event(self, event: WorkerEvent) -> None:
        """A subscriber of :class:`service.worker.events.Events`: each event into its series."""
        match event:
            case BatchEnded(compute_s=float(compute_s)):  # a failed call (None) is not timed
                self.compute.observe(compute_s)
                self.batch_jobs.observe(event.jobs)
                self.batch_samples.observe(event.samples)
                self.samples.inc(event.samples)
            case JobEnded():
                self.queue_wait.observe(event.queue_s)
                self.jobs.labels(status=event.status).inc()
            case JobVerified():
                self.verified_jobs.inc()
                self.verified_samples.inc(event.samples)
                self.verify_seconds.observe(event.seconds)
                if event.failed:
                    self.verify_failures.inc()
