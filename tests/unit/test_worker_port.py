"""``psgrad worker``'s own HTTP port (service/worker_process.py): ``/readyz`` follows the worker's
readiness (its warm-ups ended), for a readiness probe; every other path stays Prometheus's."""

from __future__ import annotations

import threading

import httpx
from prometheus_client import CollectorRegistry, Counter

from service.worker_process import WorkerPort
from tests.support.client import free_port


def test_readyz_follows_the_worker_and_metrics_stay_prometheus() -> None:
    registry = CollectorRegistry()
    Counter("psgrad_test_jobs", "jobs", registry=registry).inc(3)
    port = WorkerPort("127.0.0.1", free_port(), registry)
    warmed = threading.Event()
    url = f"http://127.0.0.1:{port.server.server_port}"
    port.start()
    try:
        r = httpx.get(f"{url}/readyz")  # bound and served before the worker is set
        assert (r.status_code, r.json()) == (503, {"ready": False})
        port.ready = warmed.is_set
        assert httpx.get(f"{url}/readyz").status_code == 503
        warmed.set()
        r = httpx.get(f"{url}/readyz")
        assert (r.status_code, r.json()) == (200, {"ready": True})
        assert r.headers["content-type"] == "application/json"
        metrics = httpx.get(f"{url}/metrics")
        assert metrics.status_code == 200 and "psgrad_test_jobs_total 3.0" in metrics.text
    finally:
        port.server.shutdown()
        port.server.server_close()
