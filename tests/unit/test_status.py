"""The status page's data (``GET /status.json``) in embedded mode, its pieces, the page and auth.

Redis mode: tests/integration/test_status_redis.py; the page in a browser:
tests/e2e/test_status_page.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest
import torch

from service.api.body import decode_json_body
from service.api.status_data import MAX_LABELS, OTHER, RequestStats
from service.broker.embedded import EmbeddedBroker
from service.jobs import Job, JobStatus, new_job_id
from service.registry import ModelRegistry
from service.storage import open_storage
from service.worker.events import BatchEnded, BatchStarted, Events, JobEnded, WorkerEvent
from service.worker.loop import Worker
from service.worker.recorder import NORM_EDGES, Recent, TimeRing, WorkerStatus, percentiles
from service.worker.series import WorkerMetrics
from tests.support.api import TD0, app_of, open_client, settings
from tests.support.status import (
    buckets,
    hold_compute,
    norms_of,
    norms_request,
    reference_norms,
)

rng = np.random.default_rng(7)
MLP = norms_request(6, seed=7)
VALUE = {
    "model": "value-mlp",
    "loss": "mse",
    "inputs": rng.standard_normal((5, 8)).astype(np.float32).round(3).tolist(),
    "targets": rng.standard_normal(5).astype(np.float32).round(3).tolist(),
}


def model_row(view: dict[str, Any], model: str) -> dict[str, Any]:
    return next(m for m in view["models"] if m["model"] == model)


# --- the pieces -------------------------------------------------------------------------------


def test_time_ring_sums_only_its_window() -> None:
    ring = TimeRing(slots=10, slice_s=1.0)
    ring.add(3, now=100.2)
    ring.add(4, now=100.9)
    ring.add(5, now=105.0)
    assert ring.total(now=105.5) == 12
    assert ring.total(now=109.99) == 12  # slices 100..109: all still in
    assert ring.total(now=110.0) == 5  # slice 100 left the window
    ring.add(1, now=115.0)  # slot of slice 105 reused
    assert ring.total(now=115.0) == 1
    counts = TimeRing(4, 30.0)
    counts.add(np.array([1, 0]), now=0.0)
    counts.add(np.array([0, 2]), now=31.0)
    assert counts.total(now=60.0, zero=np.zeros(2, int)).tolist() == [1, 2]
    assert counts.total(now=120.0, zero=np.zeros(2, int)).tolist() == [0, 2]


def test_recent_and_percentiles() -> None:
    recent = Recent(maxlen=4)
    for i in range(6):
        recent.add(float(i), now=1000.0 + i)
    assert recent.values(window_s=100, now=1005.0) == [2.0, 3.0, 4.0, 5.0]  # the last 4
    assert recent.values(window_s=1.5, now=1005.0) == [4.0, 5.0]
    assert percentiles([]) == {"count": 0, "p50": None, "p99": None}
    values = [float(v) for v in range(1, 101)]
    assert percentiles(values[::-1]) == {"count": 100, "p50": 50.0, "p99": 99.0}
    assert percentiles([7.0]) == {"count": 1, "p50": 7.0, "p99": 7.0}


def observe_norms(status: WorkerStatus, model: str, norms: torch.Tensor,
                  owners: tuple[tuple[str, int], ...] = ()) -> None:
    """An engine call on ``model`` that computed ``norms`` (of ``owners``' jobs), as its events."""
    n = norms.numel()
    status.on_event(BatchStarted(model=model, jobs=max(1, len(owners)), samples=n))
    status.on_event(BatchEnded(model=model, jobs=max(1, len(owners)), samples=n, compute_s=0.1,
                               norms=(norms,), owners=owners))


def test_worker_status_batch_counts_and_norm_buckets() -> None:
    status = WorkerStatus("w", "cpu")
    assert status.snapshot()["batch"] is None
    status.on_event(BatchStarted(model="mlp@1", jobs=2, samples=9))
    batch = status.snapshot()["batch"]
    assert batch["jobs"] == 2 and batch["samples"] == 9 and batch["model"] == "mlp@1"
    status.on_event(BatchEnded(model="mlp@1", jobs=2, samples=9, compute_s=0.1))
    status.on_event(BatchStarted(model="mlp@1", jobs=1, samples=5))
    status.on_event(BatchEnded(model="mlp@1", jobs=1, samples=5, compute_s=None))  # failed
    status.on_event(JobEnded(status="succeeded", queue_s=0.25))
    status.on_event(JobEnded(status="failed", queue_s=0.5))
    snap = status.snapshot()
    assert snap["batch"] is None and snap["samples_done"] == 9
    assert (snap["jobs_done"], snap["jobs_failed"], snap["jobs_canceled"]) == (1, 1, 0)
    assert snap["queue_wait_ms"] == [250.0, 500.0] and snap["samples_per_s"] == 0.9
    norms = torch.tensor([0.0, 1e-9, 1.0, 1.5, 2e6, float("inf"), float("nan")])
    observe_norms(status, "mlp@1", norms)
    counts = status.snapshot()["norms"]["mlp@1"]
    assert len(counts) == len(NORM_EDGES) + 1 and sum(counts) == 7
    assert counts[0] == 2  # zero and below 1e-6
    one = NORM_EDGES.index(1.0) + 1  # the bucket [1, 10^(1/8)) = [1, 1.33)
    assert counts[one] == 1 and counts[one + 1] == 1  # 1.0; 1.5 in [1.33, 1.78)
    assert counts[-1] == 3  # at or above 1e6, inf, NaN
    observe_norms(status, "other@1", torch.ones(3))
    assert set(status.snapshot()["norms"]) == {"mlp@1", "other@1"}


def test_a_merged_batchs_norms_count_for_each_jobs_tenant() -> None:
    status = WorkerStatus("w", "cpu")
    status.on_event(BatchStarted(model="mlp@1", jobs=3, samples=6, tenants=("b", "a", "b")))
    assert status.snapshot()["batch"]["tenants"] == ["a", "b"]
    one = NORM_EDGES.index(1.0) + 1
    # jobs in batch order: b's 2 samples, a's 1, b's 3
    norms = torch.tensor([1.0, 1.0, 1e3, 1.0, 1.0, 1e3])
    observe_norms(status, "mlp@1", norms, (("b", 2), ("a", 1), ("b", 3)))
    snap = status.snapshot()
    assert sum(snap["norms"]["mlp@1"]) == 6
    a, b = snap["tenant_norms"]["a"]["mlp@1"], snap["tenant_norms"]["b"]["mlp@1"]
    thousand = NORM_EDGES.index(1e3) + 1
    assert (sum(a), a[thousand]) == (1, 1)
    assert (sum(b), b[one], b[thousand]) == (5, 4, 1)
    observe_norms(status, "mlp@1", torch.ones(4), (("a", 1), ("b", 2)))  # lengths disagree:
    snap = status.snapshot()  # the model's histogram only
    assert sum(snap["norms"]["mlp@1"]) == 10 and sum(snap["tenant_norms"]["a"]["mlp@1"]) == 1


def test_a_tenants_view_shows_a_batch_only_with_its_jobs() -> None:
    from service.api.status_data import _worker

    doc = {"id": "w", "alive": True, "batch": {"jobs": 2, "samples": 3, "model": "m@1",
                                               "since": 1.0, "tenants": ["a", "b"]}}
    assert _worker(doc)["batch"]["tenants"] == ["a", "b"]
    assert _worker(doc, "a")["batch"]["tenants"] == ["a"]  # no other tenant's name
    assert _worker(doc, "c")["batch"] is None
    old = {**doc, "batch": {"jobs": 1, "samples": 3, "model": "m@1", "since": 1.0}}
    assert _worker(old)["batch"]["tenants"] == [] and _worker(old, "a")["batch"] is None


def test_request_stats_keep_each_tenants_own() -> None:
    from service.api.status_data import note_tenant

    stats = RequestStats()
    for tenant, status, code in (("a", 200, None), ("a", 404, "unknown_model"),
                                 ("b", 422, "invalid_input"), (None, 401, "unauthorized")):
        scope: dict[str, Any] = {"method": "POST"}
        if tenant is not None:
            note_tenant(scope, tenant)
        stats.observe(scope, route="/per-sample-grads", status=status, seconds=0.01, code=code)
    every = stats.view(0.0)
    assert every["routes"][0]["requests"] == 4 and every["routes"][0]["errors"] == 3
    a = stats.view(0.0, "a")
    assert (a["routes"][0]["requests"], a["routes"][0]["errors"]) == (2, 1)
    assert a["errors"] == [{"model": None, "code": "unknown_model", "count": 1}]
    assert stats.view(0.0, "b")["errors"][0]["code"] == "invalid_input"
    assert stats.view(0.0, "nobody") == {"routes": [], "models": [], "errors": []}


def test_request_stats_bound_the_models_clients_name() -> None:
    stats = RequestStats()
    for i in range(MAX_LABELS + 5):
        scope = {"method": "POST", "psgrad.model": f"model-{i}"}
        stats.observe(scope, route="/per-sample-grads", status=404, seconds=0.01,
                      code="unknown_model")
    view = stats.view(now=0.0)
    assert len(view["models"]) == MAX_LABELS + 1
    assert model_row(view, OTHER)["requests"] == 5
    stats.observe({"method": "BREW"}, route="unmatched", status=405, seconds=0.0, code=None)
    assert {(r["route"], r["method"]) for r in stats.view(0.0)["routes"]} == {
        ("/per-sample-grads", "POST"), ("unmatched", "OTHER")}


def _round(monkeypatch: pytest.MonkeyPatch, *, merged_call_fails: bool) -> tuple[
        WorkerMetrics, dict[str, Any]]:
    """Two jobs that merge, a canceled one and a bad one through one worker loop whose events
    go to a subscriber that always raises, the Prometheus series and a status recorder."""
    from service.worker import loop as worker_module

    if merged_call_fails:
        compute = worker_module._compute

        def fail_merged(group: Any, *args: Any, **kwargs: Any) -> Any:
            if len(group) > 1:
                raise RuntimeError("the merged call fails")
            return compute(group, *args, **kwargs)

        monkeypatch.setattr(worker_module, "_compute", fail_merged)

    def broken(event: WorkerEvent) -> None:
        raise RuntimeError("a subscriber's bug")

    s = settings(workers=0)
    broker = EmbeddedBroker(s)
    metrics, status = WorkerMetrics(), WorkerStatus("w", "cpu")
    work = Worker(broker, ModelRegistry(), s, Events(broken, metrics.on_event, status.on_event),
                  storage=open_storage(s))
    norms = {**TD0, "outputs": ["norms"]}
    docs = [norms, norms, norms, {**TD0, "rewards": [1.0, 2.0]}]
    jobs = [Job(new_job_id(), decode_json_body(d, max_elements=100), time.time() + 60)
            for d in docs]

    async def run() -> None:
        await broker.start()
        for job in jobs:
            await broker.submit(job)
        taken = broker.take(10, 100, 0.0, 0.0)
        await broker.cancel(jobs[2].id)
        await asyncio.to_thread(work.process, taken)
        states = [await broker.state(j.id) for j in jobs]
        await broker.close()
        assert [st.status for st in states] == [JobStatus.SUCCEEDED, JobStatus.SUCCEEDED,
                                                JobStatus.CANCELED, JobStatus.FAILED]

    asyncio.run(run())
    return metrics, status.snapshot()


@pytest.mark.parametrize("merged_call_fails", [False, True])
def test_one_event_stream_feeds_the_metrics_and_the_status_alike(
        monkeypatch: pytest.MonkeyPatch, merged_call_fails: bool) -> None:
    """The worker reports each event once; Prometheus and the status page count the same jobs,
    samples and waits, a failed merged call counts for neither (its jobs run alone), and a
    subscriber that raises fails no job and starves no other subscriber."""
    metrics, snap = _round(monkeypatch, merged_call_fails=merged_call_fails)
    value = metrics.registry.get_sample_value
    jobs = {k: value("psgrad_jobs_total", {"status": k}) for k in ("succeeded", "failed",
                                                                   "canceled")}
    assert jobs == {"succeeded": 2, "failed": 1, "canceled": 1}
    assert (snap["jobs_done"], snap["jobs_failed"], snap["jobs_canceled"]) == (2, 1, 1)
    assert value("psgrad_queue_wait_seconds_count") == len(snap["queue_wait_ms"]) == 4
    assert value("psgrad_samples_total") == snap["samples_done"] == 2
    calls = 2 if merged_call_fails else 1
    assert value("psgrad_compute_seconds_count") == value("psgrad_batch_jobs_count") == calls
    assert value("psgrad_batch_jobs_sum") == 2 and snap["batch"] is None
    [counts] = snap["norms"].values()  # the engine's norms of both jobs, once
    assert sum(counts) == 2


# --- the api, embedded mode -------------------------------------------------------------------


async def test_status_json_follows_requests_errors_and_norms() -> None:
    async with open_client(workers=2) as c:
        view = (await c.get("/status.json")).json()
        assert view["mode"] == "embedded" and view["broker_error"] is None
        assert [w["id"] for w in view["workers"]] == ["psgrad-worker-0", "psgrad-worker-1"]
        assert all(w["alive"] and w["device"] == "cpu" and w["jobs_done"] == 0
                   for w in view["workers"])
        assert view["queue"] == {"depth": 0, "wait_ms": {"count": 0, "p50": None, "p99": None}}
        assert view["norms"] == [] and view["models"] == [] and view["errors"] == []

        r = await c.post("/per-sample-grads", json=MLP)
        assert r.status_code == 200, r.text
        view = (await c.get("/status.json")).json()
        assert sum(w["jobs_done"] for w in view["workers"]) == 1
        assert sum(w["samples_done"] for w in view["workers"]) == 6
        assert view["queue"]["wait_ms"]["count"] == 1
        grads = next(r for r in view["routes"] if r["route"] == "/per-sample-grads")
        assert grads["method"] == "POST" and grads["requests"] == 1 and grads["errors"] == 0
        assert grads["latency_ms"]["count"] == 1 and grads["latency_ms"]["p50"] > 0
        hist = norms_of(view, "mlp")
        assert hist is not None and hist["count"] == 6
        assert hist["counts"] == buckets(reference_norms(MLP))
        assert view["norm_edges"] == list(NORM_EDGES)

        # errors: a shape the model refuses, an unknown model, a body that is not JSON
        bad = {**MLP, "inputs": [[0.0] * 5] * 2, "targets": [1, 2]}
        assert (await c.post("/per-sample-grads", json=bad)).status_code == 422
        assert (await c.post("/per-sample-grads", json={**MLP, "model": "nope"})).status_code == 404
        r = await c.post("/per-sample-grads", content=b"{", headers={"content-type":
                                                                       "application/json"})
        assert r.status_code == 400
        view = (await c.get("/status.json")).json()
        errors = {(e["model"], e["code"]): e["count"] for e in view["errors"]}
        assert errors == {("mlp", "shape_mismatch"): 1, ("nope", "unknown_model"): 1,
                          (None, "bad_request"): 1}
        assert model_row(view, "mlp") == {"model": "mlp", "requests": 2, "errors": 1,
                                          "codes": {"shape_mismatch": 1}}
        assert sum(w["jobs_failed"] for w in view["workers"]) == 2  # shape and unknown model
        assert norms_of(view, "mlp")["count"] == 6  # type: ignore[index]  # failures add none

        # no norms computed, none shown; clipped_mean computes them: its histogram appears
        r = await c.post("/per-sample-grads", json={**VALUE, "outputs": ["grads", "mean"]})
        assert r.status_code == 200
        assert norms_of((await c.get("/status.json")).json(), "value-mlp") is None
        clipped = {**VALUE, "outputs": ["clipped_mean"], "clip_norm": 0.5}
        assert (await c.post("/per-sample-grads", json=clipped)).status_code == 200
        hist = norms_of((await c.get("/status.json")).json(), "value-mlp")
        assert hist is not None and hist["counts"] == buckets(reference_norms(clipped))
        pool = app_of(c).state.psgrad.workers
    assert not any(w["alive"] for w in pool.snapshots())  # the lifespan stopped the threads


async def test_the_batch_in_hand_shows_while_it_computes(monkeypatch: pytest.MonkeyPatch) -> None:
    started, release = hold_compute(monkeypatch)
    async with open_client() as c:
        answer = asyncio.create_task(c.post("/per-sample-grads", json=MLP))
        try:
            assert await asyncio.to_thread(started.wait, 60)
            [w] = (await c.get("/status.json")).json()["workers"]
            assert w["batch"]["jobs"] == 1 and w["batch"]["samples"] == 6
            assert w["batch"]["model"].startswith("mlp@") and w["jobs_done"] == 0
        finally:
            release.set()
        assert (await answer).status_code == 200
        [w] = (await c.get("/status.json")).json()["workers"]
        assert w["batch"] is None and w["jobs_done"] == 1


async def test_status_json_needs_a_key_the_page_does_not() -> None:
    async with open_client(api_keys="user-key", admin_keys="admin-key") as c:
        r = await c.get("/status.json")
        assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
        for key in ("user-key", "admin-key"):
            r = await c.get("/status.json", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200 and r.json()["workers"][0]["alive"], key
        r = await c.get("/status.json", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        view = (await c.get("/status.json", headers={"Authorization": "Bearer user-key"})).json()
        assert view["errors"] == []  # requests without a valid key are nobody's: admins see them
        view = (await c.get("/status.json", headers={"Authorization": "Bearer admin-key"})).json()
        assert {(e["model"], e["code"]): e["count"] for e in view["errors"]} == {
            (None, "unauthorized"): 2}
        page = await c.get("/status")  # holds no data: served without a key
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert 'fetch("status.json"' in page.text and "Authorization" in page.text
    assert "http://" not in page.text.replace("http://www.w3.org/2000/svg", "")
    assert "https://" not in page.text and "<link" not in page.text  # works offline


async def test_openapi_documents_both_routes() -> None:
    async with open_client() as c:
        doc = (await c.get("/openapi.json")).json()
    page = doc["paths"]["/status"]["get"]["responses"]["200"]["content"]
    assert "text/html" in page
    data = doc["paths"]["/status.json"]["get"]
    schema = data["responses"]["200"]["content"]["application/json"]["schema"]
    assert schema == {"$ref": "#/components/schemas/StatusView"} and "401" in data["responses"]
    fields = doc["components"]["schemas"]["StatusView"]["properties"]
    assert {"workers", "queue", "routes", "models", "errors", "norms", "norm_edges"} <= set(fields)
