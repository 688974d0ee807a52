"""``GET /status.json`` in Redis mode: the api aggregates what each ``psgrad worker`` process
published with its heartbeat (real Redis, real worker processes, own key prefix per test)."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from service.broker.redis import keyspace
from service.broker.redis.common import text
from service.registry import make_registry
from service.storage import open_storage
from service.worker.events import Events
from service.worker.recorder import WorkerStatus
from tests.support.api import open_client
from tests.support.client import free_port
from tests.support.cluster import cluster, settings_for
from tests.support.redis import SHARED_URL, fresh_prefix, worker_loop
from tests.support.status import (
    buckets,
    hold_compute,
    norms_of,
    norms_request,
    reference_norms,
)

prefix = pytest.fixture(fresh_prefix)


async def view_when(client: httpx.AsyncClient, ok: Any, what: str,
                    timeout: float = 30.0) -> dict[str, Any]:
    """/status.json once ``ok(view)`` holds (workers publish with their heartbeats)."""
    until = time.monotonic() + timeout
    while True:
        r = await client.get("/status.json")
        assert r.status_code == 200, r.text
        view: dict[str, Any] = r.json()
        if ok(view):
            return view
        assert time.monotonic() < until, f"timed out waiting for {what}: {view}"
        await asyncio.sleep(0.1)


def by_id(view: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {w["id"]: w for w in view["workers"]}


async def test_status_aggregates_every_workers_heartbeat(tmp_path: Path, prefix: str) -> None:
    docs = [norms_request(n, seed=n) for n in (3, 5, 2, 7)]
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=2) as c:
        with redis.Redis.from_url(SHARED_URL) as r:
            names = {text(n) for n in r.smembers(keyspace.worker_names(prefix))}
        # (a heartbeat of 0.3 s may lapse for a moment while a loaded machine imports torch)
        view = await view_when(c.client, lambda v: len(v["workers"]) == 2 and all(
            w["alive"] and w["pid"] for w in v["workers"]), "two live workers")
        assert view["mode"] == "redis" and view["broker_error"] is None
        assert set(by_id(view)) == names
        assert all(w["device"] == "cpu" and w["host"] for w in view["workers"]), view
        assert {w["pid"] for w in view["workers"]} == {p.pid for p in c.workers}

        answers = await asyncio.gather(*(c.client.post("/per-sample-grads", json=d)
                                         for d in docs))
        assert [a.status_code for a in answers] == [200] * 4
        bad = {**docs[0], "inputs": [[0.0] * 5] * 2, "targets": [1, 2]}
        assert (await c.client.post("/per-sample-grads", json=bad)).status_code == 422

        def settled(v: dict[str, Any]) -> bool:
            return (sum(w["jobs_done"] for w in v["workers"]) == 4
                    and sum(w["jobs_failed"] for w in v["workers"]) == 1)

        view = await view_when(c.client, settled, "every job in the workers' heartbeats")
        assert sum(w["samples_done"] for w in view["workers"]) == 17
        assert view["queue"]["wait_ms"]["count"] == 5 and view["queue"]["depth"] == 0
        hist = norms_of(view, "mlp")
        s = settings_for(SHARED_URL, prefix)
        registry = make_registry(s, open_storage(s).models)
        try:
            want = [sum(col) for col in zip(*(buckets(reference_norms(d, registry))
                                              for d in docs), strict=True)]
        finally:
            registry.store.close()
        assert hist is not None and hist["count"] == 17 and hist["counts"] == want
        assert {(e["model"], e["code"]): e["count"] for e in view["errors"]} == {
            ("mlp", "shape_mismatch"): 1}
        grads = next(r for r in view["routes"] if r["route"] == "/per-sample-grads")
        assert grads["requests"] == 5 and grads["latency_ms"]["count"] == 5

        # a worker killed: shown dead (its heartbeat expires) while its last status lives;
        # one stopped cleanly leaves the page at once
        killed, stopped = c.workers
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        view = await view_when(
            c.client, lambda v: sum(w["alive"] for w in v["workers"]) == 1, "a dead worker")
        dead = [w for w in view["workers"] if not w["alive"]]
        assert len(dead) == 1 and dead[0]["pid"] == killed.pid
        assert await c.broker.live_workers() == 1
        assert (await c.client.get("/readyz")).status_code == 200
        stopped.send_signal(signal.SIGTERM)
        assert stopped.wait(30) == 0
        view = await view_when(c.client, lambda v: len(v["workers"]) == 1, "the stopped worker")
        assert view["workers"][0]["pid"] == killed.pid and not view["workers"][0]["alive"]


async def test_the_batch_in_hand_travels_with_the_heartbeat(
        tmp_path: Path, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Redis worker loop in a thread here (its engine call held): the api shows its batch."""
    started, release = hold_compute(monkeypatch)
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=0, heartbeat_s=0.1) as c:
        status = WorkerStatus("held", "cpu")
        with worker_loop(c.settings, "held", Events(status.on_event), status, block_s=0.1):
            try:
                answer = asyncio.create_task(c.client.post("/per-sample-grads",
                                                           json=norms_request(4)))
                assert await asyncio.to_thread(started.wait, 60)
                view = await view_when(c.client,
                                       lambda v: v["workers"] and v["workers"][0]["batch"],
                                       "the batch in hand")
                [w] = view["workers"]
                assert w["id"] == "held" and w["alive"] and w["jobs_done"] == 0
                assert w["batch"]["samples"] == 4 and w["batch"]["model"].startswith("mlp@")
                release.set()
                assert (await answer).status_code == 200
                await view_when(c.client, lambda v: v["workers"][0]["batch"] is None
                                and v["workers"][0]["jobs_done"] == 1, "the batch done")
            finally:
                release.set()


async def test_unreadable_statuses_are_shown_never_a_500(tmp_path: Path, prefix: str) -> None:
    """A worker of another version (other fields) or a damaged value still gets its row."""
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=0) as c:
        with redis.Redis.from_url(SHARED_URL) as r:
            for name, value in (("odd", json.dumps({"jobs_done": "many", "batch": 3})),
                                ("garbled", "{not json"), ("listed", json.dumps([1, 2]))):
                r.sadd(keyspace.worker_names(prefix), name)
                r.set(keyspace.worker_heartbeat(prefix, name), "1", ex=60)
                r.set(keyspace.worker_status(prefix, name), value, ex=60)
            r.sadd(keyspace.worker_names(prefix), "gone")  # neither heartbeat nor status: pruned
        r2 = await c.client.get("/status.json")
        assert r2.status_code == 200, r2.text
        rows = by_id(r2.json())
        assert set(rows) == {"odd", "garbled", "listed"}
        assert all(w["alive"] and w["jobs_done"] == 0 and w["batch"] is None
                   for w in rows.values())
        with redis.Redis.from_url(SHARED_URL) as r:
            assert {text(n) for n in r.smembers(keyspace.worker_names(prefix))} == set(rows)


async def test_redis_down_the_api_still_shows_its_own_view() -> None:
    settings = settings_for(f"redis://127.0.0.1:{free_port()}/0", "psgrad-test-down")
    async with open_client(**settings.model_dump()) as c:  # a Redis nobody listens at
        await c.post("/per-sample-grads", json=norms_request(1))  # 503: queue unreachable
        r = await c.get("/status.json")
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["mode"] == "redis" and "unavailable" in view["broker_error"]
    assert view["workers"] == [] and view["queue"]["depth"] is None
    assert {(e["model"], e["code"]) for e in view["errors"]} == {("mlp", "overloaded")}
