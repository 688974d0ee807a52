"""Two tenants on one service, in both modes (embedded, and Redis with a ``psgrad worker``
process): each tenant's jobs, DP runs, reference sets and status view are its own (another
tenant gets 404, or its own namespace), an admin key sees and manages every tenant's, and data
made before tenants existed belongs to the default tenant."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from service import redis_keys
from service.broker.redis import keyspace
from service.dp import runs
from service.dp.runs import DPRun
from service.tenants import DEFAULT_TENANT
from tests.support.api import TD0, open_client
from tests.support.cluster import cluster
from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip

KEYS = {"api_keys": "alice:alice-key,bob:bob-key,default:default-key",
        "admin_keys": "ops:ops-key"}
MLP = {"sizes": [6, 5, 3]}
ALICE, BOB, OPS, DEFAULT = ({"authorization": f"Bearer {k}-key"}
                            for k in ("alice", "bob", "ops", "default"))


def batch(n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.standard_normal((n, 6)).astype(np.float32).round(3).tolist(),
            "targets": rng.integers(0, 3, n).tolist()}


@pytest.fixture(params=["embedded", "redis"])
async def service(request: pytest.FixtureRequest, tmp_path: Path
                  ) -> AsyncIterator[tuple[httpx.AsyncClient, str | None]]:
    """A keyed service with the model ``att`` registered; yields its client and, in Redis
    mode, its key prefix. Embedded mode keeps its stores in files under ``tmp_path``."""
    if request.param == "embedded":
        async with open_client(model_dir=str(tmp_path / "store"), data_dir=str(tmp_path / "data"),
                               **KEYS) as c:
            await _register(c)
            yield c, None
    else:
        shared = redis_or_skip()
        with prefix_on(shared) as prefix:
            async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1, **KEYS) as c:
                await _register(c.client)
                yield c.client, prefix
        shared.close()


async def _register(c: httpx.AsyncClient) -> None:
    r = await c.put("/models/att", json={"architecture": "mlp", "config": MLP}, headers=OPS)
    assert r.status_code == 200, r.text


def error(r: httpx.Response, status: int, code: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    return str(body["message"])


async def finished(c: httpx.AsyncClient, job_id: str, who: dict[str, str]) -> dict[str, Any]:
    until = time.monotonic() + 60
    while True:
        view: dict[str, Any] = (await c.get(f"/jobs/{job_id}", headers=who)).json()
        if view["status"] in ("succeeded", "failed", "canceled"):
            return view
        assert time.monotonic() < until, view
        await asyncio.sleep(0.05)


# --- jobs ---------------------------------------------------------------------------------------


async def test_a_job_is_its_tenants(service: tuple[httpx.AsyncClient, str | None]) -> None:
    c, _ = service
    r = await c.post("/jobs", json=TD0, headers=ALICE)
    assert r.status_code == 202, r.text
    job = r.json()["job_id"]
    nobody = "0" * 32
    # another tenant's job answers exactly as a job that does not exist
    never = error(await c.get(f"/jobs/{nobody}", headers=BOB), 404, "unknown_job")
    for call in (c.get, c.delete):
        message = error(await call(f"/jobs/{job}", headers=BOB), 404, "unknown_job")
        assert message == never.replace(nobody, job)
    assert (await finished(c, job, ALICE))["status"] == "succeeded"  # bob's DELETE did nothing
    r = await c.get(f"/jobs/{job}", headers=OPS)  # an admin reads any tenant's job
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["result"]["grads"]["theta"], [[-7.2, -3.6, 7.2]],
                               rtol=1e-6)
    r = await c.delete(f"/jobs/{job}", headers=OPS)  # and removes it
    assert (r.json()["status"], r.json()["deleted"]) == ("succeeded", "removed")
    error(await c.get(f"/jobs/{job}", headers=ALICE), 404, "unknown_job")
    r = await c.post("/per-sample-grads", json=TD0, headers=BOB)  # the sync route: one's own
    assert r.status_code == 200
    np.testing.assert_allclose(r.json()["grads"]["theta"], [[-7.2, -3.6, 7.2]], rtol=1e-6)


# --- DP runs ------------------------------------------------------------------------------------

RUN = {"model": "att", "clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.01,
       "dataset_size": 1000, "delta": 1e-5, "max_epsilon": 5.0}


def step(run_id: str) -> dict[str, Any]:
    return {"model": "att", **batch(2, 9), "outputs": ["clipped_mean"], "dp_run": run_id}


async def test_a_dp_run_is_its_tenants(service: tuple[httpx.AsyncClient, str | None]) -> None:
    c, _ = service
    r = await c.post("/dp-runs", json=RUN, headers=ALICE)
    assert r.status_code == 201, r.text
    run = r.json()["id"]
    assert r.json()["tenant"] == "alice"
    mine = (await c.post("/dp-runs", json=RUN, headers=BOB)).json()["id"]
    assert [x["id"] for x in (await c.get("/dp-runs", headers=BOB)).json()["runs"]] == [mine]
    never = error(await c.get("/dp-runs/dp-" + "0" * 24, headers=BOB), 404, "unknown_dp_run")
    message = error(await c.get(f"/dp-runs/{run}", headers=BOB), 404, "unknown_dp_run")
    assert message == never.replace("dp-" + "0" * 24, run)
    # a step on another tenant's run is refused as if the run did not exist; nothing is spent
    for path in ("/per-sample-grads", "/jobs"):
        error(await c.post(path, json=step(run), headers=BOB), 404, "unknown_dp_run")
    error(await c.post("/per-sample-grads", json=step(run), headers=OPS), 404, "unknown_dp_run")
    assert (await c.get(f"/dp-runs/{run}", headers=ALICE)).json()["steps"] == 0
    r = await c.post("/per-sample-grads", json=step(run), headers=ALICE)
    assert r.status_code == 200 and r.json()["dp"]["steps"] == 1, r.text
    assert (await c.get(f"/dp-runs/{run}", headers=ALICE)).json()["steps"] == 1
    # an admin lists and reads every tenant's runs, one tenant's with ?tenant=
    every = {(x["id"], x["tenant"]) for x in (await c.get("/dp-runs", headers=OPS)).json()["runs"]}
    assert every == {(run, "alice"), (mine, "bob")}
    only = (await c.get("/dp-runs?tenant=bob", headers=OPS)).json()["runs"]
    assert [x["id"] for x in only] == [mine]
    assert (await c.get(f"/dp-runs/{run}", headers=OPS)).json()["steps"] == 1
    error(await c.get("/dp-runs?tenant=alice", headers=BOB), 403, "forbidden")
    assert (await c.get("/dp-runs?tenant=bob", headers=BOB)).status_code == 200  # one's own
    # deleting is an admin's; ?tenant= names whose run it must be
    error(await c.delete(f"/dp-runs/{run}", headers=BOB), 403, "forbidden")
    error(await c.delete(f"/dp-runs/{run}?tenant=bob", headers=OPS), 404, "unknown_dp_run")
    assert (await c.delete(f"/dp-runs/{run}", headers=OPS)).json()["deleted"] is True
    error(await c.get(f"/dp-runs/{run}", headers=ALICE), 404, "unknown_dp_run")
    assert (await c.get(f"/dp-runs/{mine}", headers=BOB)).status_code == 200


# --- reference sets -----------------------------------------------------------------------------


async def put_set(c: httpx.AsyncClient, who: dict[str, str], n: int, seed: int,
                  query: str = "") -> dict[str, Any]:
    r = await c.put(f"/reference-sets/train{query}", headers=who,
                    json={"model": "att", **batch(n, seed), "projection_dim": 16})
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


async def influence(c: httpx.AsyncClient, who: dict[str, str]) -> np.ndarray:
    r = await c.post("/per-sample-grads", headers=who, json={
        "model": "att", **batch(2, 5), "outputs": ["influence"], "reference_set": "train"})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["influence"])


async def sketches(c: httpx.AsyncClient, n: int, seed: int) -> np.ndarray:
    r = await c.post("/per-sample-grads", headers=ALICE, json={
        "model": "att", **batch(n, seed), "outputs": ["projection"], "projection_dim": 16})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["projection"])


async def test_reference_sets_are_each_tenants_own(
        service: tuple[httpx.AsyncClient, str | None]) -> None:
    c, _ = service
    assert (await put_set(c, ALICE, 3, 1))["tenant"] == "alice"
    assert (await put_set(c, BOB, 5, 2))["tenant"] == "bob"  # the same id: bob's own set
    assert (await c.get("/reference-sets/train", headers=ALICE)).json()["count"] == 3
    assert (await c.get("/reference-sets/train", headers=BOB)).json()["count"] == 5
    # each tenant's influence reads its own 'train'
    test = await sketches(c, 2, 5)
    np.testing.assert_allclose(await influence(c, ALICE), test @ (await sketches(c, 3, 1)).T,
                               rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(await influence(c, BOB), test @ (await sketches(c, 5, 2)).T,
                               rtol=1e-4, atol=1e-4)
    error(await c.get("/reference-sets/train?tenant=alice", headers=BOB), 403, "forbidden")
    assert (await c.delete("/reference-sets/train", headers=BOB)).json()["deleted"] is True
    error(await c.get("/reference-sets/train", headers=BOB), 404, "not_found")
    r = await c.post("/per-sample-grads", headers=BOB, json={
        "model": "att", **batch(2, 5), "outputs": ["influence"], "reference_set": "train"})
    assert "'train' not found" in error(r, 404, "not_found")  # the name bob gave, no more
    assert (await c.get("/reference-sets/train", headers=ALICE)).json()["count"] == 3
    error(await c.delete("/reference-sets/train", headers=BOB), 404, "not_found")
    # an admin's own namespace, and another tenant's with ?tenant=
    error(await c.get("/reference-sets/train", headers=OPS), 404, "not_found")
    assert (await c.get("/reference-sets/train?tenant=alice", headers=OPS)).json()["count"] == 3
    assert (await put_set(c, OPS, 4, 3, "?tenant=bob"))["tenant"] == "bob"
    assert (await c.get("/reference-sets/train", headers=BOB)).json()["count"] == 4
    r = await c.delete("/reference-sets/train?tenant=alice", headers=OPS)
    assert r.status_code == 200
    error(await c.get("/reference-sets/train", headers=ALICE), 404, "not_found")
    assert (await c.get("/reference-sets/train", headers=BOB)).json()["count"] == 4
    for bad in ("a~b", "a/b", "..", ""):  # a tenant parameter is a tenant name or refused
        r = await c.get(f"/reference-sets/train?tenant={bad}", headers=OPS)
        assert r.status_code == 422, (bad, r.text)
    r = await c.post("/per-sample-grads", headers=ALICE, json={
        "model": "att", **batch(2, 5), "outputs": ["influence"], "reference_set": "x~train"})
    assert r.status_code == 400, r.text  # no way to name another namespace from a request


# --- the status page ----------------------------------------------------------------------------


async def status_when(c: httpx.AsyncClient, who: dict[str, str], ok: Any,
                      query: str = "") -> dict[str, Any]:
    """/status.json once ``ok(view)`` holds (Redis workers publish with their heartbeats)."""
    until = time.monotonic() + 30
    while True:
        r = await c.get(f"/status.json{query}", headers=who)
        assert r.status_code == 200, r.text
        view: dict[str, Any] = r.json()
        if ok(view):
            return view
        assert time.monotonic() < until, view
        await asyncio.sleep(0.1)


def errors_of(view: dict[str, Any]) -> dict[tuple[str | None, str], int]:
    return {(e["model"], e["code"]): e["count"] for e in view["errors"]}


def norm_count(view: dict[str, Any]) -> int:
    return sum(h["count"] for h in view["norms"])


async def test_the_status_page_shows_each_tenant_its_own(
        service: tuple[httpx.AsyncClient, str | None]) -> None:
    c, _ = service
    for who, n, ghost in ((ALICE, 3, "nope"), (BOB, 5, "ghost")):
        r = await c.post("/per-sample-grads", headers=who,
                         json={"model": "att", **batch(n, n), "outputs": ["norms"]})
        assert r.status_code == 200, r.text
        r = await c.post("/per-sample-grads", headers=who, json={"model": ghost, **batch(1, 1)})
        assert r.status_code == 404, r.text
    await c.get("/status.json", headers={"authorization": "Bearer wrong"})
    alice = await status_when(c, ALICE, lambda v: norm_count(v) == 3)
    assert alice["tenant"] == "alice"
    assert errors_of(alice) == {("nope", "unknown_model"): 1}
    assert {m["model"] for m in alice["models"]} == {"att", "nope"}
    grads = next(x for x in alice["routes"] if x["route"] == "/per-sample-grads")
    assert (grads["requests"], grads["errors"]) == (2, 1)
    bob = await status_when(c, BOB, lambda v: norm_count(v) == 5)
    assert errors_of(bob) == {("ghost", "unknown_model"): 1}
    every = await status_when(c, OPS, lambda v: norm_count(v) == 8)
    assert every["tenant"] is None
    assert errors_of(every) == {("nope", "unknown_model"): 1, ("ghost", "unknown_model"): 1,
                                (None, "unauthorized"): 1}
    one = await status_when(c, OPS, lambda v: norm_count(v) == 3, "?tenant=alice")
    assert one["tenant"] == "alice" and errors_of(one) == errors_of(alice)
    error(await c.get("/status.json?tenant=alice", headers=BOB), 403, "forbidden")


# --- data made before tenants -------------------------------------------------------------------


def old_run() -> DPRun:
    """A run as an api before tenants wrote it: no tenant in its record."""
    doc = json.loads(DPRun(id=runs.new_run_id(), model="att", clip_norm=1.0,
                           noise_multiplier=1.0, sample_rate=0.01, expected_batch_size=10.0,
                           delta=1e-5, max_epsilon=5.0, max_steps=100,
                           accountant="rdp").to_json())
    del doc["tenant"]
    return DPRun(**doc)


async def check_pre_tenant(c: httpx.AsyncClient, run_id: str) -> None:
    """The run made before tenants is the default tenant's, and admins'. (Reference sets made
    before they became gradient stores are not read: made again, they are the maker's.)"""
    assert (await c.get(f"/dp-runs/{run_id}", headers=DEFAULT)).json()["tenant"] == DEFAULT_TENANT
    error(await c.get(f"/dp-runs/{run_id}", headers=ALICE), 404, "unknown_dp_run")
    assert (await c.get(f"/dp-runs/{run_id}", headers=OPS)).status_code == 200


def without_tenant(spec: str | bytes) -> str:
    doc = json.loads(spec)
    doc.pop("tenant")
    return json.dumps(doc)


async def test_files_made_before_tenants_are_the_default_tenants(tmp_path: Path) -> None:
    store = tmp_path / "store"
    run = old_run()
    runs.FileRunStore(store).create(run)
    folder = store / ".dp-runs" / run.id
    (folder / "run.json").write_text(without_tenant((folder / "run.json").read_text()))
    async with open_client(model_dir=str(store), **KEYS) as c:
        await check_pre_tenant(c, run.id)


async def test_redis_data_made_before_tenants_is_the_default_tenants(tmp_path: Path) -> None:
    shared = redis_or_skip()
    with prefix_on(shared) as prefix:
        run = old_run()
        shared.hset(redis_keys.dp_run(prefix, run.id),
                    mapping={"spec": without_tenant(run.to_json()), "steps": 0})
        shared.sadd(redis_keys.dp_run_ids(prefix), run.id)
        async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1, **KEYS) as cl:
            c = cl.client
            await check_pre_tenant(c, run.id)
            r = await c.post("/jobs", json=TD0, headers=ALICE)
            job = r.json()["job_id"]
            shared.hdel(keyspace.job_state(prefix, job), "tenant")  # a job queued before tenants
            error(await c.get(f"/jobs/{job}", headers=ALICE), 404, "unknown_job")
            assert (await finished(c, job, DEFAULT))["status"] == "succeeded"
            assert (await c.get(f"/jobs/{job}", headers=OPS)).status_code == 200
            assert re.fullmatch(r"[0-9a-f]{32}", job)
    shared.close()


# --- the SDK, unchanged for a user with one key ---------------------------------------------------


def test_the_sdk_works_unchanged_for_each_tenant(tmp_path: Path) -> None:
    import psgrad
    from psgrad import dp
    from service.api import create_app
    from tests.support.api import settings
    from tests.support.client import running_app

    app = create_app(settings(model_dir=str(tmp_path), data_dir=str(tmp_path / "data"),
                              workers=1, **KEYS))
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(4, 6)).astype(np.float32), rng.integers(0, 3, 4)

    def client(key: str, transport: Any) -> psgrad.Client:
        return psgrad.Client(base_url="http://psgrad.test", api_key=key, transport=transport)

    with running_app(app) as transport, client("alice-key", transport) as alice, \
            client("bob-key", transport) as bob, client("ops-key", transport) as ops:
        ops.models.register("att", architecture="mlp", config=MLP)
        run = dp.create_run(alice, "att", clip_norm=1.0, noise_multiplier=1.0, delta=1e-5,
                            expected_batch_size=4, dataset_size=100, max_epsilon=5.0)
        assert run.step(x, y).steps == 1
        with pytest.raises(psgrad.NotFound):
            dp.get_run(bob, run.id)
        job = alice.submit("att", x, y, outputs=["norms"])
        assert job.result(timeout=60).norms.shape == (4,)
        with pytest.raises(psgrad.NotFound):
            bob.job(job.id).status()
        with pytest.raises(psgrad.NotFound):
            bob.job(job.id).cancel()
        alice.reference_sets.put("train", "att", x, y, projection_dim=8)
        with pytest.raises(psgrad.NotFound):
            bob.reference_sets.get("train")
        bob.reference_sets.put("train", "att", x[:2], y[:2], projection_dim=8)
        assert alice.reference_sets.get("train")["count"] == 4
        assert bob.reference_sets.get("train")["count"] == 2
        got = alice.per_sample_grads("att", x[:1], y[:1], reference_set="train",
                                     outputs=["influence"], projection_dim=8)
        assert got.influence.shape == (1, 4)
        with client("alice:alice-key", transport) as whole, pytest.raises(psgrad.Unauthorized):
            whole.models.list()  # the secret alone is the key, not the 'name:secret' entry
