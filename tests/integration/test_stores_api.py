"""Gradient stores through the HTTP api, in both modes (embedded, and Redis with a ``psgrad
worker`` process): the stored rows equal the ``projection`` output of ``/per-sample-grads`` for
the same samples, queries equal a numpy reference over those sketches (same top-k ids, scores to
float tolerance) for every score, each tenant's stores are its own, bad input is a clear 4xx,
and a worker killed in the middle of an append loses nothing and doubles nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import redis
import torch

from psgrad._errors import Conflict
from psgrad._wire import REQUEST_KEY, SAFETENSORS, fields_to_safetensors
from service import curvature
from service.api.routes import stores as store_routes
from service.api.routes.stores import _same_model
from service.broker.redis import keyspace
from service.broker.redis.common import text
from service.registry import load_model
from service.stores import factors
from service.stores.files import StoreFiles
from service.stores.locks import ThreadLocks
from service.stores.spec import StoreSpec
from service.strategies.projection import Projection
from tests.support.api import open_client
from tests.support.cluster import cluster
from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip
from tests.support.reference import per_sample_loop
from tests.support.stores import reference

KEYS = {"api_keys": "alice:alice-key,bob:bob-key", "admin_keys": "ops:ops-key"}
ALICE, BOB, OPS = ({"authorization": f"Bearer {k}-key"} for k in ("alice", "bob", "ops"))
MLP = {"sizes": [6, 5, 3]}
DIM, SEED = 64, 3
SPEC_OF_ATT = StoreSpec(id="fk", model="att@1", loss="cross_entropy",
                        params=("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"),
                        projection_dim=53, projection_seed=0, projection_kind="exact",
                        dtype="float32", shapes={"fc1.weight": [5, 6], "fc1.bias": [5],
                                                 "fc2.weight": [3, 5], "fc2.bias": [3]})


def batch(n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.standard_normal((n, 6)).astype(np.float32).round(3).tolist(),
            "targets": rng.integers(0, 3, n).tolist()}


def error(r: httpx.Response, status: int, code: str, *words: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert body["code"] == code, body
    for word in words:
        assert word in body["message"], body


@pytest.fixture(params=["embedded", "redis"])
async def service(request: pytest.FixtureRequest, tmp_path: Path
                  ) -> AsyncIterator[tuple[httpx.AsyncClient, Path]]:
    """A keyed service with the zoo mlp ``att`` registered; its client and data directory."""
    data = tmp_path / "data"
    if request.param == "embedded":
        async with open_client(data_dir=str(data), **KEYS) as c:
            await _register(c)
            yield c, data
    else:
        shared = redis_or_skip()
        with prefix_on(shared) as prefix:
            async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1, data_dir=str(data),
                               **KEYS) as c:
                await _register(c.client)
                yield c.client, data
        shared.close()


async def _register(c: httpx.AsyncClient) -> None:
    r = await c.put("/models/att", json={"architecture": "mlp", "config": MLP}, headers=OPS)
    assert r.status_code == 200, r.text


async def projection(c: httpx.AsyncClient, data: dict[str, Any], **extra: Any) -> np.ndarray:
    """The sketches ``/per-sample-grads`` answers for these samples (the loop-tested path)."""
    r = await c.post("/per-sample-grads", headers=ALICE, json={
        "model": "att", **data, "outputs": ["projection"], "projection_dim": DIM,
        "projection_seed": SEED, **extra})
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["projection"], dtype=np.float64)


async def test_a_store_holds_the_projection_and_answers_as_numpy(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    c, data_dir = service
    r = await c.put("/stores/train", headers=ALICE, json={
        "model": "att", "projection_dim": DIM, "projection_seed": SEED})
    assert r.status_code == 201, r.text
    doc = r.json()
    assert doc["model"].startswith("att@") and doc["samples"] == 0 and doc["state"] == "empty"
    assert (doc["projection_dim"], doc["projection_seed"], doc["dtype"]) == (DIM, SEED, "float32")
    assert doc["projection_kind"] == "tensorsketch" and doc["loss"] == "cross_entropy"
    assert doc["tenant"] == "alice"
    again = await c.put("/stores/train", headers=ALICE, json={
        "model": "att", "projection_dim": DIM, "projection_seed": SEED})
    assert again.status_code == 200 and again.json()["created"] == doc["created"]

    parts = [batch(5, 1), batch(9, 2), batch(4, 3)]
    ids = [f"ex-{i}" for i in range(18)]
    at = 0
    for part in parts:
        n = len(part["inputs"])
        r = await c.post("/stores/train/samples", headers=ALICE,
                         json={**part, "ids": ids[at:at + n]})
        assert r.status_code == 200, r.text
        at += n
        assert r.json()["samples"] == at and r.json()["added"] == n
    doc = (await c.get("/stores/train", headers=ALICE)).json()
    assert doc["samples"] == 18 and doc["state"] == "ready" and doc["bytes"] > 18 * DIM * 4
    r = await c.post("/stores/train/lookup", headers=ALICE,
                     json={"ids": ["ex-17", "ex-18", 3, 2**63 - 1, -(2**63)]})
    assert r.json() == {"present": [True, False, False, False, False], "samples": 18}, r.text
    # an entry of another type is a 400, one out of an id's range a 422, as for any field
    for entry, status in (([1], 400), (True, 400), (None, 400), (1.5, 400), ("x" * 129, 422),
                          ("", 422), (2**63, 422), (-(2**63) - 1, 422), (2.0, 422),
                          (2**70, 422)):
        r = await c.post("/stores/train/lookup", headers=ALICE, json={"ids": ["ex-1", entry]})
        error(r, status, "bad_request" if status == 400 else "invalid_input",
              "'ids' entry 1 (")
    error(await c.post("/stores/train/lookup", headers=BOB, json={"ids": [1]}), 404, "not_found")
    error(await c.post("/stores/train/lookup", headers=ALICE, json={"ids": "ex-17"}), 400,
          "bad_request", "the body is {\"ids\": [...]}", "got {'ids': 'ex-17'}")

    # the rows are /per-sample-grads' projection of the same samples, in the order added
    train = {k: [v for p in parts for v in p[k]] for k in ("inputs", "targets")}
    phi = await projection(c, train)
    files = StoreFiles(str(data_dir), ThreadLocks())
    manifest = files.manifest("alice~train")
    rows = np.concatenate([x for _, x, _ in files.rows("alice~train", manifest)])
    np.testing.assert_allclose(rows, phi, rtol=1e-5, atol=1e-6)

    test = batch(4, 9)
    q = await projection(c, test)
    for score in ("dot", "cosine", "trak", "self_influence"):
        body = {"k": 6, "score": score, **({} if score == "self_influence" else test)}
        r = await c.post("/stores/train/query", headers=ALICE, json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        want_rows, want_scores = reference(phi, q, score, 6)
        assert got["ids"] == [[ids[i] for i in row] for row in want_rows], score
        np.testing.assert_allclose(got["scores"], want_scores, rtol=1e-4,
                                   atol=1e-5 * np.abs(want_scores).max())
        assert got["samples"] == 18 and np.asarray(got["scores"]).shape == (
            1 if score == "self_influence" else 4, 6)
        if score == "trak":
            assert got["lambda"] == pytest.approx(np.trace(phi.T @ phi) / DIM, rel=1e-4)
    # the test samples' own sketches score the same as the samples
    r = await c.post("/stores/train/query", headers=ALICE,
                     json={"k": 3, "score": "trak", "lambda": 0.5, "sketches": q.tolist()})
    assert r.status_code == 200, r.text
    want_rows, want_scores = reference(phi, q, "trak", 3, 0.5)
    assert r.json()["ids"] == [[ids[i] for i in row] for row in want_rows]
    np.testing.assert_allclose(r.json()["scores"], want_scores, rtol=1e-4,
                               atol=1e-5 * np.abs(want_scores).max())

    # a store of Kronecker sketches of TRAK's margin: the same as /per-sample-grads' again
    fields = {"projection_kind": "kronecker", "loss": "margin"}
    r = await c.put("/stores/krn", headers=ALICE, json={
        "model": "att", "projection_dim": DIM, "projection_seed": SEED, **fields})
    assert r.status_code == 201 and r.json()["projection_kind"] == "kronecker", r.text
    r = await c.post("/stores/krn/samples", headers=ALICE, json={**parts[1], "ids": ids[:9]})
    assert r.status_code == 200, r.text
    rows = np.concatenate([x for _, x, _ in files.rows("alice~krn", files.manifest("alice~krn"))])
    np.testing.assert_allclose(rows, await projection(c, parts[1], **fields), rtol=1e-5,
                               atol=1e-6)
    r = await c.post("/stores/krn/query", headers=ALICE, json={"k": 2, **test})
    assert r.json()["projection_kind"] == "kronecker", r.text
    error(await c.post("/stores/krn/query", headers=ALICE,
                       json={"k": 2, "sketches": q.tolist(), "projection_kind": "tensorsketch"}),
          409, "conflict", "projection_kind")

    # another tenant's store of the same name is its own; an admin reaches alice's
    error(await c.get("/stores/train", headers=BOB), 404, "not_found", "PUT /stores/train")
    error(await c.post("/stores/train/query", headers=BOB, json={"score": "self_influence"}),
          404, "not_found")
    r = await c.put("/stores/train", headers=BOB, json={"model": "att", "projection_dim": 8})
    assert r.status_code == 201 and r.json()["tenant"] == "bob", r.text
    error(await c.post("/stores/train/query", headers=BOB, json={"score": "self_influence"}),
          409, "conflict", "empty", "POST /stores/train/samples")
    assert (await c.get("/stores/train?tenant=alice", headers=OPS)).json()["samples"] == 18

    def listed(r: httpx.Response) -> list[tuple[str, str]]:
        assert r.status_code == 200, r.text
        return sorted((d["tenant"], d["id"]) for d in r.json()["stores"])

    assert listed(await c.get("/stores", headers=ALICE)) == [("alice", "krn"), ("alice", "train")]
    assert listed(await c.get("/stores", headers=BOB)) == [("bob", "train")]
    assert listed(await c.get("/stores", headers=OPS)) == [
        ("alice", "krn"), ("alice", "train"), ("bob", "train")]
    assert listed(await c.get("/stores?tenant=bob", headers=OPS)) == [("bob", "train")]
    error(await c.get("/stores/train?tenant=alice", headers=BOB), 403, "forbidden")
    assert (await c.delete("/stores/train", headers=BOB)).json()["deleted"] is True
    assert (await c.get("/stores/train", headers=ALICE)).json()["samples"] == 18
    r = await c.delete("/stores/train?tenant=alice", headers=OPS)
    assert r.status_code == 200, r.text
    error(await c.get("/stores/train", headers=ALICE), 404, "not_found")
    error(await c.delete("/stores/train", headers=ALICE), 404, "not_found")
    assert not (data_dir / "stores" / "alice~train").exists()


def loop_rows(data: dict[str, Any]) -> np.ndarray:
    """Each sample's gradient by the per-sample loop on ``att``'s weights, flattened in the
    model's parameter order: an exact store's rows."""
    module = load_model("att", "mlp", MLP, device=torch.device("cpu")).module
    loop = per_sample_loop(module, {"inputs": torch.tensor(data["inputs"]),
                                    "targets": torch.tensor(data["targets"])}, "cross_entropy")
    return torch.cat([g.reshape(len(g), -1) for g in loop.grads.values()], 1).double().numpy()


async def test_a_store_of_full_gradients_holds_the_loops_and_answers_every_score(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """No projection_dim: each row is the sample's gradient (the per-sample loop's, flattened
    in parameter order), and the store answers every score for samples or their rows; with
    more rows than values per row, trak factors the Gram matrix it sums from the rows."""
    c, data_dir = service
    r = await c.put("/stores/full", headers=ALICE, json={"model": "att"})
    assert r.status_code == 201, r.text
    width = 6 * 5 + 5 + 5 * 3 + 3
    assert (r.json()["projection_kind"], r.json()["projection_dim"]) == ("exact", width)
    parts = [batch(40, 11), batch(30, 12)]  # 70 rows, each of 53 values
    for at, part in zip((0, 40), parts, strict=True):
        r = await c.post("/stores/full/samples", headers=ALICE,
                         json={**part, "ids": list(range(at, at + len(part["inputs"])))})
        assert r.status_code == 200, r.text
    phi = np.concatenate([loop_rows(part) for part in parts])
    files = StoreFiles(str(data_dir), ThreadLocks())
    rows = np.concatenate([x for _, x, _ in files.rows("alice~full",
                                                       files.manifest("alice~full"))])
    np.testing.assert_allclose(rows, phi, rtol=1e-5, atol=1e-7)

    test = batch(4, 13)
    q = loop_rows(test)
    for score in ("dot", "cosine", "trak", "self_influence"):
        for sent in ({} if score == "self_influence" else test, {"sketches": q.tolist()}):
            if score == "self_influence" and "sketches" in sent:
                continue
            r = await c.post("/stores/full/query", headers=ALICE,
                             json={"k": 6, "score": score, **sent})
            assert r.status_code == 200, (score, r.text)
            want_rows, want_scores = reference(phi, q, score, 6)
            assert r.json()["ids"] == want_rows.tolist(), score
            np.testing.assert_allclose(r.json()["scores"], want_scores, rtol=1e-4,
                                       atol=1e-6 * np.abs(want_scores).max())


async def test_kfac_and_ekfac_scores_precondition_the_query_by_the_fitted_factors(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """``POST /stores/{id}/factors`` in two batches, then ``kfac`` and ``ekfac`` queries: the
    scores are the per-sample loop's query gradients preconditioned by the curvature fitted
    in process over the same batches (service.curvature, itself held to dense solves), dotted
    with the stored rows; damping defaults and is echoed; what cannot be scored says so."""
    c, _ = service
    r = await c.put("/stores/fk", headers=ALICE, json={"model": "att"})
    assert r.status_code == 201 and r.json()["factors"] is None, r.text
    train, test = batch(40, 21), batch(3, 22)
    r = await c.post("/stores/fk/samples", headers=ALICE, json={**train, "ids": list(range(40))})
    assert r.status_code == 200, r.text
    error(await c.post("/stores/fk/query", headers=ALICE, json={"k": 3, "score": "ekfac",
                                                                 **test}),
          409, "conflict", "POST /stores/fk/factors")
    halves = [{k: v[a:a + 20] for k, v in train.items()} for a in (0, 20)]
    error(await c.post("/stores/fk/factors/eigenvalues", headers=ALICE, json=halves[0]),
          409, "conflict", "POST /stores/fk/factors")
    await _fit(c, "fk", halves)
    r = await c.get("/stores/fk", headers=ALICE)
    fitted_doc = {"samples": 40, "eigenvalues": 40, "layers": ["fc1.weight", "fc2.weight"]}
    assert r.json()["factors"] == fitted_doc
    # the list shows them as GET does (it showed null), and so does an append's answer
    listed = (await c.get("/stores", headers=ALICE)).json()["stores"]
    assert [s["factors"] for s in listed if s["id"] == "fk"] == [fitted_doc]

    model = load_model("att", "mlp", MLP, device=torch.device("cpu"), dtype=torch.float64)
    params = list(model.params)
    fields = [{"inputs": torch.tensor(h["inputs"], dtype=torch.float64),
               "targets": torch.tensor(h["targets"])} for h in halves]
    fitted = curvature.fit(model, "cross_entropy", 1.0, params, fields)
    phi, q = loop_rows(train), loop_rows(test)
    grads = factors.as_grads(SPEC_OF_ATT, q)
    for kind in ("kfac", "ekfac"):
        for damping in (None, 0.01):
            used = fitted.default_damping(kind) if damping is None else damping
            pre = fitted.precondition(grads, used, kind)  # type: ignore[arg-type]
            want = np.concatenate([pre[p].reshape(3, -1).numpy() for p in params], 1) @ phi.T
            order = np.argsort(-want, axis=1, kind="stable")[:, :5]
            for sent in (test, {"sketches": q.tolist()}):
                body = {"k": 5, "score": kind, **sent,
                        **({} if damping is None else {"damping": damping})}
                r = await c.post("/stores/fk/query", headers=ALICE, json=body)
                assert r.status_code == 200, (kind, r.text)
                assert r.json()["ids"] == order.tolist(), kind
                np.testing.assert_allclose(r.json()["scores"],
                                           np.take_along_axis(want, order, 1), rtol=2e-3,
                                           atol=1e-4 * np.abs(want).max())
                assert r.json()["damping"] == pytest.approx(used, rel=1e-3)
    error(await c.post("/stores/fk/query", headers=ALICE, json={"k": 3, "damping": 0.1,
                                                                 **test}),
          422, "invalid_input", "'damping'")
    error(await c.post("/stores/fk/query", headers=ALICE, json={"k": 3, "score": "ekfac",
                                                                 "damping": -1.0, **test}),
          422, "invalid_input", "'damping' must be > 0; got -1.0")
    error(await c.post("/stores/fk/query", headers=ALICE, json={"k": 3, "score": "ekfac",
                                                                 "damping": 0, **test}),
          422, "invalid_input", "'damping' must be > 0")
    for route in ("factors", "factors/eigenvalues"):  # another tenant's store: none of Bob's
        error(await c.post(f"/stores/fk/{route}", headers=BOB, json=halves[0]), 404, "not_found")

    # a store of sketches: the preconditioned query sketched with the store's projection
    r = await c.put("/stores/sk", headers=ALICE, json={"model": "att", "projection_dim": DIM,
                                                        "projection_seed": SEED})
    assert r.status_code == 201, r.text
    r = await c.post("/stores/sk/samples", headers=ALICE, json={**train, "ids": list(range(40))})
    assert r.status_code == 200, r.text
    await _fit(c, "sk", halves)

    def sketch(g: dict[str, torch.Tensor]) -> np.ndarray:
        out = torch.zeros(len(g[params[0]]), DIM, dtype=torch.float64)
        Projection(DIM, SEED).project_many({p: g[p].double() for p in params}, out)
        return out.numpy()

    stored = sketch(factors.as_grads(SPEC_OF_ATT, phi))
    for kind in ("kfac", "ekfac"):
        used = fitted.default_damping(kind)
        want = sketch(fitted.precondition(grads, used, kind)) @ stored.T  # type: ignore[arg-type]
        order = np.argsort(-want, axis=1, kind="stable")[:, :5]
        r = await c.post("/stores/sk/query", headers=ALICE, json={"k": 5, "score": kind, **test})
        assert r.status_code == 200, (kind, r.text)
        assert r.json()["ids"] == order.tolist(), kind
        np.testing.assert_allclose(r.json()["scores"], np.take_along_axis(want, order, 1),
                                   rtol=2e-3, atol=1e-4 * np.abs(want).max())
        assert r.json()["damping"] == pytest.approx(used, rel=1e-3)
    error(await c.post("/stores/sk/query", headers=ALICE, json={
        "k": 1, "score": "kfac", "sketches": stored[:1].tolist()}),
          422, "invalid_input", "send the samples")


async def _fit(c: httpx.AsyncClient, store: str, batches: list[dict[str, Any]]) -> None:
    """Both passes of a store's fit over ``batches``: its factors, then their eigenvalues
    (``ekfac`` refused in between, naming the second pass, before any worker computes the
    query's gradients; ``kfac`` answered)."""
    test = {k: v[:1] for k, v in batches[0].items()}
    for i, part in enumerate(batches):
        r = await c.post(f"/stores/{store}/factors", headers=ALICE, json=part)
        assert r.status_code == 200 and r.json()["fitted"] == len(part["inputs"]), r.text
        assert r.json()["factors"]["eigenvalues"] == 0, r.text
        if i == 0 and len(batches) > 1:  # dropped by the next batch's new bases
            r = await c.post(f"/stores/{store}/factors/eigenvalues", headers=ALICE, json=part)
            assert r.status_code == 200 and r.json()["factors"]["eigenvalues"] == len(
                part["inputs"]), r.text
    before = (await c.get("/metrics")).text
    error(await c.post(f"/stores/{store}/query", headers=ALICE,
                       json={"k": 1, "score": "ekfac", **test}),
          409, "conflict", f"POST /stores/{store}/factors/eigenvalues")
    if "psgrad_samples_total " in before:  # the api's own workers: refused before they ran
        assert _samples_computed((await c.get("/metrics")).text) == _samples_computed(before)
    r = await c.post(f"/stores/{store}/query", headers=ALICE, json={"k": 1, "score": "kfac",
                                                                     **test})
    assert r.status_code == 200, r.text
    for part in batches:
        r = await c.post(f"/stores/{store}/factors/eigenvalues", headers=ALICE, json=part)
        assert r.status_code == 200 and r.json()["fitted"] == len(part["inputs"]), r.text
    assert r.json()["factors"]["samples"] == r.json()["factors"]["eigenvalues"] == sum(
        len(part["inputs"]) for part in batches)
    fitted = r.json()["factors"]
    r = await c.post(f"/stores/{store}/samples", headers=ALICE,
                     json={**batch(1, 9), "ids": [999]})
    assert r.status_code == 200 and r.json()["factors"] == fitted, r.text  # it showed null


async def test_factors_past_the_size_limit_are_refused_before_the_workers_run(
        tmp_path: Path) -> None:
    """The factors file does not grow with the samples fitted: a limit under its estimate (the
    layers' factors and two values per parameter, 8 bytes each, and the header) is a 413 naming
    ``PSGRAD_MAX_FACTORS_BYTES`` before any job is queued; at the estimate, both passes fit."""
    model = load_model("att", "mlp", MLP, device=torch.device("cpu"))
    estimate = factors.estimate(model, list(model.params))
    assert estimate > 8 * curvature.factor_numel(model, list(model.params))
    for limit in (estimate - 1, estimate):
        async with open_client(data_dir=str(tmp_path / f"data-{limit}"),
                               max_factors_bytes=limit, **KEYS) as c:
            await _register(c)
            r = await c.put("/stores/fk", headers=ALICE, json={"model": "att"})
            assert r.status_code == 201, r.text
            if limit < estimate:
                error(await c.post("/stores/fk/factors", headers=ALICE, json=batch(20, 21)),
                      413, "too_large", f"would hold at most {estimate} bytes",
                      "PSGRAD_MAX_FACTORS_BYTES")
                r = await c.get("/stores/fk", headers=ALICE)
                assert r.json()["factors"] is None
                assert _samples_computed((await c.get("/metrics")).text) == 0
            else:
                r = await c.post("/stores/fk/samples", headers=ALICE,
                                 json={**batch(20, 21), "ids": list(range(20))})
                assert r.status_code == 200, r.text
                await _fit(c, "fk", [batch(20, 21), batch(20, 22)])
                size = (tmp_path / f"data-{limit}" / "stores").glob("*/factors.safetensors")
                assert 0 < next(size).stat().st_size <= estimate


async def test_a_fit_batch_is_counted_once_per_pass_under_its_id(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """A batch sent again under a ``batch_id`` its pass counted (its answer lost, say) is a 409
    with ``details.counted`` and adds nothing; each pass counts its own ids, and a first-pass
    batch, which drops the eigenvalues, drops their ids with them."""
    c, _ = service
    assert (await c.put("/stores/f", headers=ALICE, json={"model": "att"})).status_code == 201

    async def fit(route: str, seed: int, batch_id: Any) -> httpx.Response:
        return await c.post(f"/stores/f/{route}", headers=ALICE,
                            json={**batch(4, seed), "batch_id": batch_id})

    async def counts() -> tuple[int, int]:
        got = (await c.get("/stores/f", headers=ALICE)).json()["factors"]
        return got["samples"], got["eigenvalues"]

    assert (await fit("factors", 1, "b1")).status_code == 200
    for route in ("factors", "factors/eigenvalues"):
        r = await fit(route, 2, "b1" if route == "factors" else "e1")
        if route == "factors":  # a resend of b1 (other samples, to see that none are added)
            error(r, 409, "conflict", "counted batch 'b1' already")
            assert r.json()["error"]["details"] == {"batch_id": "b1", "counted": True}
        else:
            assert r.status_code == 200, r.text
    assert await counts() == (4, 4)
    error(await fit("factors/eigenvalues", 2, "e1"), 409, "conflict", "'e1'")
    assert await counts() == (4, 4)
    assert (await fit("factors", 3, "b2")).status_code == 200  # the eigenvalues go, e1 with them
    assert (await fit("factors/eigenvalues", 3, "e1")).status_code == 200
    assert await counts() == (8, 4)
    error(await fit("factors", 3, 7), 400, "bad_request", "'batch_id' must be a string")
    error(await fit("factors", 3, "x" * 129), 422, "invalid_input", "'batch_id'")
    assert await counts() == (8, 4)


def _samples_computed(metrics: str) -> float:
    """The workers' ``psgrad_samples_total`` in a ``/metrics`` page."""
    line = next(x for x in metrics.splitlines() if x.startswith("psgrad_samples_total "))
    return float(line.split()[1])


def test_an_answer_of_another_model_version_is_refused_by_what_it_holds() -> None:
    """A store's batch answered by another version than the store's (a new version registered
    meanwhile) is a 409 naming what came back: sketches, or gradients for a store of full
    gradients and for the fits and queries that need them."""
    spec = SPEC_OF_ATT  # of att@1
    _same_model(spec, {"model": "att@1", "grads": {}})
    for outputs, rows in (({"projection": []}, "sketches"), ({"grads": {}}, "gradients")):
        with pytest.raises(Conflict, match=f"the {rows} came from att@2 .*send the batch again"):
            _same_model(spec, {"model": "att@2", **outputs})


async def test_an_ensembles_checkpoints_each_fit_and_score_their_own_factors(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """An ensemble of full gradients: each checkpoint fits factors of its own, and an ``ekfac``
    query's scores are the sums over checkpoints of each one's own preconditioned scores."""
    c, _ = service
    first = (await c.get("/models/att", headers=OPS)).json()["version"]
    base = load_model("att", "mlp", MLP, device=torch.device("cpu")).module.state_dict()
    shifted = {k: v.detach() * 1.5 + 0.01 for k, v in base.items()}
    r = await c.put("/models/att", headers=OPS, json={
        "architecture": "mlp", "config": MLP,
        "weights": {k: v.tolist() for k, v in shifted.items()}})
    assert r.status_code == 200, r.text
    refs = [f"att@{first}", f"att@{r.json()['version']}"]
    r = await c.put("/stores/ek", headers=ALICE, json={"checkpoints": refs})
    assert r.status_code == 201, r.text
    train, test = batch(30, 51), batch(2, 52)
    r = await c.post("/stores/ek/samples", headers=ALICE, json={**train, "ids": list(range(30))})
    assert r.status_code == 200, r.text
    await _fit(c, "ek", [train])
    total, dampings = np.zeros((2, 30)), []
    for state in ({k: v.detach() for k, v in base.items()}, shifted):
        model = load_model("att", "mlp", MLP, state, device=torch.device("cpu"),
                           dtype=torch.float64)
        sent = {name: {"inputs": torch.tensor(data["inputs"], dtype=torch.float64),
                       "targets": torch.tensor(data["targets"])}
                for name, data in (("train", train), ("test", test))}
        fitted = curvature.fit(model, "cross_entropy", 1.0, list(model.params), [sent["train"]])
        rows = {k: per_sample_loop(model.module, data, "cross_entropy").grads
                for k, data in sent.items()}
        flat = {k: torch.cat([g.reshape(len(g), -1) for g in v.values()], 1).double().numpy()
                for k, v in rows.items()}
        dampings.append(fitted.default_damping("ekfac"))
        pre = fitted.precondition(factors.as_grads(SPEC_OF_ATT, flat["test"]), dampings[-1],
                                  "ekfac")
        total += np.concatenate([pre[p].reshape(2, -1).numpy() for p in SPEC_OF_ATT.params],
                                1) @ flat["train"].T
    r = await c.post("/stores/ek/query", headers=ALICE, json={"k": 4, "score": "ekfac", **test})
    assert r.status_code == 200, r.text
    want = np.argsort(-total, axis=1, kind="stable")[:, :4]
    assert r.json()["ids"] == want.tolist()
    np.testing.assert_allclose(r.json()["scores"], np.take_along_axis(total, want, 1),
                               rtol=2e-3, atol=1e-4 * np.abs(total).max())
    assert r.json()["damping"] == pytest.approx(dampings, rel=1e-3)


async def test_rows_imported_are_kept_as_sent_and_bad_ones_refused_whole(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """POST /stores/{id}/rows: the projection of a batch, made by /per-sample-grads, imported
    in JSON and safetensors, ranks as the same samples added through /samples; wrong dims, a
    NaN, a repeated or held id, another dtype or a batch's fields are refused, nothing kept."""
    c, data_dir = service
    r = await c.put("/stores/imp", headers=ALICE, json={
        "model": "att", "projection_dim": DIM, "projection_seed": SEED})
    assert r.status_code == 201, r.text
    train = batch(12, 21)
    phi = (await projection(c, train)).astype(np.float32)
    r = await c.post("/stores/imp/rows", headers=ALICE,
                     json={"rows": phi[:5].tolist(), "ids": [f"r{i}" for i in range(5)]})
    assert r.status_code == 200 and (r.json()["added"], r.json()["samples"]) == (5, 5), r.text
    body = fields_to_safetensors({"rows": phi[5:], "ids": [f"r{i}" for i in range(5, 12)]},
                                 REQUEST_KEY)
    r = await c.post("/stores/imp/rows", headers={**ALICE, "content-type": SAFETENSORS},
                     content=body)
    assert r.status_code == 200 and r.json()["samples"] == 12, r.text
    files = StoreFiles(str(data_dir), ThreadLocks())
    rows = np.concatenate([x for _, x, _ in files.rows("alice~imp", files.manifest("alice~imp"))])
    np.testing.assert_array_equal(rows, phi)  # kept as sent
    test = batch(3, 22)
    r = await c.post("/stores/imp/query", headers=ALICE, json={"k": 4, "score": "trak", **test})
    assert r.status_code == 200, r.text
    want_rows, want_scores = reference(phi.astype(np.float64), await projection(c, test),
                                       "trak", 4)
    assert r.json()["ids"] == [[f"r{i}" for i in row] for row in want_rows]
    np.testing.assert_allclose(r.json()["scores"], want_scores, rtol=1e-4,
                               atol=1e-5 * np.abs(want_scores).max())

    async def refused(status: int, words: str, **body: Any) -> None:
        sent = {"rows": phi[:2].tolist(), "ids": ["n0", "n1"], **body}
        if isinstance(sent["rows"], np.ndarray):
            r = await c.post("/stores/imp/rows", content=fields_to_safetensors(sent, REQUEST_KEY),
                             headers={**ALICE, "content-type": SAFETENSORS})
        else:
            r = await c.post("/stores/imp/rows", headers=ALICE, json=sent)
        assert r.status_code == status and words in r.text, r.text
        assert (await c.get("/stores/imp", headers=ALICE)).json()["samples"] == 12

    await refused(422, "[n, 64]", rows=phi[:2, :10].tolist())
    await refused(422, "not finite", rows=np.where(np.eye(2, DIM) > 0, np.nan, phi[:2]
                                                   ).astype(np.float32))
    await refused(422, "repeats", ids=["n0", "n0"])
    await refused(409, "already holds", ids=["n0", "r3"])
    await refused(422, "float64", rows=phi[:2].astype(np.float64))
    await refused(422, "takes 'rows' and 'ids' only", targets=[0, 1])
    await refused(409, "projection_dim", projection_dim=8)
    error(await c.post("/stores/nope/rows", headers=ALICE, json={"rows": [[0.0]], "ids": [1]}),
          404, "not_found")


async def test_a_store_with_an_index_answers_through_it_and_says_so(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """``index`` at PUT: a FAISS factory string (a bad one is a 422 with FAISS's reason);
    queries answer ``exact`` false through the index (the same top k here: every list is
    searched), true when asked or for cosine; the store's GET says ``indexed``."""
    c, _ = service
    bad = await c.put("/stores/ix", headers=ALICE, json={"model": "att", "projection_dim": DIM,
                                                         "index": "IVF,Nope"})
    error(bad, 422, "invalid_input", "FAISS", "could not parse index string IVF,Nope")
    assert ".cpp" not in bad.text and "faiss::" not in bad.text, bad.text  # not FAISS's C++
    r = await c.put("/stores/ix", headers=ALICE, json={
        "model": "att", "projection_dim": DIM, "projection_seed": SEED, "index": "IVF2,Flat"})
    assert r.status_code == 201 and r.json()["index"] == "IVF2,Flat", r.text
    assert r.json()["indexed"] is False
    train = batch(80, 31)  # more rows than k: trak through its factor, not the rows' kernel
    r = await c.post("/stores/ix/samples", headers=ALICE, json={**train, "ids": list(range(80))})
    assert r.status_code == 200 and r.json()["indexed"] is True, r.text
    phi = await projection(c, train)
    test = batch(2, 32)
    q = await projection(c, test)
    for score, exact, said in (("dot", None, False), ("dot", True, True),
                               ("trak", False, False), ("cosine", None, True)):
        body = {"k": 5, "score": score, **test, **({} if exact is None else {"exact": exact}),
                **({"probes": 2} if score == "trak" else {})}
        r = await c.post("/stores/ix/query", headers=ALICE, json=body)
        assert r.status_code == 200 and r.json()["exact"] is said, (score, r.text)
        want_rows, want_scores = reference(phi, q, score, 5)
        assert r.json()["ids"] == want_rows.tolist(), score
        np.testing.assert_allclose(r.json()["scores"], want_scores, rtol=1e-4,
                                   atol=1e-5 * np.abs(want_scores).max())
    error(await c.post("/stores/ix/query", headers=ALICE, json={"k": 1, **test, "exact": "yes"}),
          422, "invalid_input", "exact")
    for probes, status, code in ((0, 422, "invalid_input"), ("many", 400, "bad_request")):
        error(await c.post("/stores/ix/query", headers=ALICE,
                           json={"k": 1, **test, "probes": probes}), status, code,
              f"'probes' must be an integer >= 1; got {probes!r}")


def full_scores(phi: np.ndarray, q: np.ndarray | None, score: str) -> np.ndarray:
    """The reference's score of every row, in row order ``[queries, rows]``."""
    rows, scores = reference(phi, q, score, len(phi))
    out = np.empty(rows.shape)
    np.put_along_axis(out, rows, scores, 1)
    return out


async def test_an_ensemble_scores_the_sum_over_its_checkpoints(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """``checkpoints``: two versions of ``att``; each keeps its own rows (the projection under
    that version), and a query's scores are the sums of each checkpoint's own scores (each
    ``trak`` with its own lambda), for every score; what an ensemble cannot do says so."""
    c, _ = service
    first = (await c.get("/models/att", headers=OPS)).json()["version"]
    module = load_model("att", "mlp", MLP, device=torch.device("cpu")).module
    weights = {k: (v.detach() * 1.5 + 0.01).tolist() for k, v in module.state_dict().items()}
    r = await c.put("/models/att", headers=OPS, json={"architecture": "mlp", "config": MLP,
                                                       "weights": weights})
    assert r.status_code == 200, r.text
    second = r.json()["version"]
    refs = [f"att@{first}", f"att@{second}"]
    assert first != second
    r = await c.put("/stores/ens", headers=ALICE, json={
        "checkpoints": refs, "projection_dim": DIM, "projection_seed": SEED})
    assert r.status_code == 201, r.text
    assert r.json()["checkpoints"] == refs and r.json()["model"] == refs[0]
    train, test = batch(30, 41), batch(3, 42)
    r = await c.post("/stores/ens/samples", headers=ALICE, json={**train, "ids": list(range(30))})
    assert r.status_code == 200 and r.json()["samples"] == 30, r.text
    phis = [await projection(c, train, model=ref) for ref in refs]
    qs = [await projection(c, test, model=ref) for ref in refs]
    assert not np.allclose(phis[0], phis[1])  # two checkpoints, two sets of rows
    for score in ("dot", "cosine", "trak", "self_influence"):
        body = {"k": 5, "score": score, **({} if score == "self_influence" else test)}
        r = await c.post("/stores/ens/query", headers=ALICE, json=body)
        assert r.status_code == 200, (score, r.text)
        total = sum(full_scores(phi, None if score == "self_influence" else q, score)
                    for phi, q in zip(phis, qs, strict=True))
        want = np.argsort(-total, axis=1, kind="stable")[:, :5]
        assert r.json()["ids"] == want.tolist(), score
        np.testing.assert_allclose(r.json()["scores"], np.take_along_axis(total, want, 1),
                                   rtol=1e-4, atol=1e-5 * np.abs(total).max())
        assert r.json()["checkpoints"] == refs
        if score == "trak":
            assert len(r.json()["lambda"]) == 2
    got = await c.post("/stores/ens/query", headers=ALICE,
                       json={"k": 1, "sketches": qs[0].tolist()})
    error(got, 422, "invalid_input", "ensemble")
    got = await c.post("/stores/ens/rows", headers=ALICE, json={"rows": phis[0][:1].tolist(),
                                                                "ids": [99]})
    error(got, 422, "invalid_input", "ensemble")
    got = await c.post("/per-sample-grads", headers=ALICE, json={
        "model": refs[0], **test, "outputs": ["influence"], "reference_set": "ens"})
    error(got, 409, "conflict", "ensemble")
    error(await c.delete(f"/models/att@{second}", headers=OPS), 409, "conflict", "alice~ens")
    error(await c.put("/stores/e2", headers=ALICE, json={"checkpoints": [refs[0], refs[0]],
                                                         "projection_dim": DIM}),
          422, "invalid_input", "twice")


async def test_a_store_of_an_older_sketch_definition_is_refused_not_mixed(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """A store made before the default kind's numbers changed (its record has no
    ``projection_version``: version 1) is shown, but neither appended to nor queried: rows of
    two definitions would not compare. A new store records the current version."""
    c, data_dir = service
    r = await c.put("/stores/old", headers=ALICE, json={"model": "att", "projection_dim": DIM})
    assert r.status_code == 201 and r.json()["projection_version"] == 2, r.text
    r = await c.post("/stores/old/samples", headers=ALICE, json={**batch(3, 1), "ids": [1, 2, 3]})
    assert r.status_code == 200, r.text
    [path] = [p for p in data_dir.rglob("spec.json") if json.loads(p.read_text())["id"] == "old"]
    record = json.loads(path.read_text())
    del record["projection_version"]  # as written before versions existed
    path.write_text(json.dumps(record))
    r = await c.get("/stores/old", headers=ALICE)
    assert r.status_code == 200 and r.json()["projection_version"] == 1, r.text
    error(await c.post("/stores/old/samples", headers=ALICE,
                       json={**batch(3, 5), "ids": [4, 5, 6]}),
          409, "conflict", "version 1", "version 2", "make a new store")
    error(await c.post("/stores/old/query", headers=ALICE,
                       json={"k": 1, "sketches": np.zeros((1, DIM)).tolist()}),
          409, "conflict", "tensorsketch sketches of version 1")
    error(await c.post("/per-sample-grads", headers=ALICE, json={  # nor as a reference set
        "model": "att", **batch(2, 4), "outputs": ["influence"], "reference_set": "old"}),
          409, "conflict", "version 1")
    assert (await c.delete("/stores/old", headers=ALICE)).status_code == 200


async def test_bad_input_is_a_clear_4xx(service: tuple[httpx.AsyncClient, Path]) -> None:
    c, _ = service

    async def put(body: dict[str, Any], name: str = "s") -> httpx.Response:
        return await c.put(f"/stores/{name}", headers=ALICE, json=body)

    good = {"model": "att", "projection_dim": 16}
    # without projection_dim: full gradients, for models of at most 8192 selected values
    error(await put({"model": "mlp"}), 422, "invalid_input", "8192", "projection_dim")
    error(await put({"model": "att", "projection_seed": 3}), 422, "invalid_input",
          "needs 'projection_dim'")
    error(await put({**good, "dtype": "int8"}), 422, "invalid_input", "float16")
    error(await put({**good, "color": 1}), 400, "bad_request", "color")
    error(await put({**good, "model": "nope"}), 404, "unknown_model")
    error(await put({**good, "loss": "td0"}), 422, "loss_not_supported")
    error(await put({**good, "params": ["no.such"]}), 422, "unknown_parameter")
    error(await put({**good, "projection_kind": "no-such-kind"}), 422, "invalid_input",
          "projection_kind")
    error(await put({**good, "projection_dim": 0}), 422, "invalid_input",
          "'projection_dim' must be an integer in [1, 8192]; got 0")
    error(await put(good, "Bad!"), 400, "bad_request", "a store id", "'Bad!'")
    assert (await put(good)).status_code == 201
    error(await put({**good, "projection_dim": 32}), 409, "conflict", "DELETE")

    def samples(n: int, **extra: Any) -> dict[str, Any]:
        return {**batch(n, 5), "ids": list(range(n)), **extra}

    post = c.post
    error(await post("/stores/nope/samples", headers=ALICE, json=samples(2)), 404, "not_found")
    error(await post("/stores/s/query", headers=ALICE, json={"k": 1, **batch(1, 1)}), 409,
          "conflict", "empty")
    error(await post("/stores/s/samples", headers=ALICE, json=batch(2, 5)), 400,
          "bad_request", "'ids' is required")
    error(await post("/stores/s/samples", headers=ALICE, json={**batch(2, 5), "ids": 7}), 400,
          "bad_request", "'ids' must be a list (got 7)")
    error(await post("/stores/s/samples", headers=ALICE, json={**batch(2, 5), "ids": [1]}),
          422, "invalid_input", "1 entries")
    error(await post("/stores/s/samples", headers=ALICE, json=samples(2, model="att@0123")),
          409, "conflict", "att@")
    error(await post("/stores/s/samples", headers=ALICE,
                     json=samples(2, projection_kind="kronecker")), 409, "conflict",
          "projection_kind")
    error(await post("/stores/s/samples", headers=ALICE,  # no store's: the contract's 422
                     json=samples(2, projection_kind="another-kind")), 422, "invalid_input",
          "tensorsketch, kronecker")
    error(await post("/stores/s/samples", headers=ALICE, json=samples(2, loss="nll")), 409,
          "conflict", "loss")
    error(await post("/stores/s/samples", headers=ALICE, json=samples(2, outputs=["grads"])),
          422, "invalid_input", "outputs")
    for route, known in (("samples", "ids"), ("query", "score"), ("factors", "inputs")):
        body = samples(2) if route == "samples" else batch(2, 5)
        r = await post(f"/stores/s/{route}", headers=ALICE, json={**body, "nope": 1})
        error(r, 400, "bad_request", "unknown fields: nope")  # and it lists what the route takes
        taken = r.json()["error"]["message"].partition("known: ")[2].split(", ")
        assert known in taken and "clip_norm" not in taken, (route, taken)
    assert (await post("/stores/s/samples", headers=ALICE, json=samples(3))).status_code == 200
    r = await post("/stores/s/samples", headers=ALICE, json={**batch(3, 6), "ids": [7, 2, 1]})
    error(r, 409, "conflict", "nothing of this batch was added")
    assert r.json()["error"]["details"]["duplicates"] == [2, 1]
    error(await post("/stores/s/samples", headers=ALICE, json={**batch(1, 6), "ids": ["x"]}),
          422, "invalid_input", "int ids")
    assert (await c.get("/stores/s", headers=ALICE)).json()["samples"] == 3

    async def query(body: dict[str, Any]) -> httpx.Response:
        return await post("/stores/s/query", headers=ALICE, json={"k": 1, **body})

    error(await query({"k": 4, **batch(1, 1)}), 422, "invalid_input", "k=4", "3 samples")
    error(await query({"k": 0, **batch(1, 1)}), 422, "invalid_input",
          "'k' must be an integer >= 1; got 0")
    error(await query({"k": "3", **batch(1, 1)}), 400, "bad_request", "'k' must be an integer")
    error(await query({"score": "influence", **batch(1, 1)}), 422, "invalid_input",
          "trak", "self_influence")
    error(await query({"score": "dot", "lambda": 1.0, **batch(1, 1)}), 422, "invalid_input",
          "'lambda'")
    error(await query({"score": "trak", "lambda": -1.0, **batch(1, 1)}), 422, "invalid_input",
          "'lambda' must be >= 0; got -1.0")
    error(await query({"score": "trak", "lambda": "1", **batch(1, 1)}), 400, "bad_request",
          "'lambda' must be a finite number")
    error(await query({"score": "self_influence", **batch(1, 1)}), 422, "invalid_input",
          "no samples")
    error(await query({"score": "dot"}), 422, "invalid_input", "test samples")
    error(await query({"sketches": [[0.0] * 8]}), 422, "invalid_input", "[n, 16]")
    error(await query({"sketches": [[0.0] * 16], "projection_dim": 8}), 409, "conflict",
          "projection_dim")
    error(await query({"sketches": [[0.0] * 16], "projection_kind": "kronecker"}), 409,
          "conflict", "projection_kind")
    error(await query({"sketches": [[0.0] * 16], **batch(1, 1)}), 422, "invalid_input",
          "not both")
    error(await query({**batch(1, 1), "model": "att@0123"}), 409, "conflict")
    # issue 53's third rerun: a query by sketches ignored a model and fields a batch refuses
    for model in ("simple-cnn", "att@0000000000000000", "m1@bad", "nosuch"):
        error(await query({"sketches": [[0.0] * 16], "model": model}), 409, "conflict",
              "'model'")
    for extra in ({"outputs": ["grads"]}, {"answer_dtype": "float16"},
                  {"dp_run": "dp-" + "0" * 24}):
        error(await query({"sketches": [[0.0] * 16], **extra}), 422, "invalid_input",
              *extra)
    r = await query({"sketches": [[0.0] * 16], "model": "att"})
    assert r.status_code == 200, r.text
    r = await query({"k": 3, "score": "self_influence"})
    assert r.status_code == 200 and sorted(r.json()["ids"][0]) == [0, 1, 2], r.text


async def test_issue_53_finding_5_an_input_of_1e30_is_refused_and_trak_keeps_working(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """Issue 53, finding 5: an input of 1e30 is finite and was accepted; its row's
    self-influence (about 1e59) set the default lambda, and every later trak query of the
    store answered all-zero scores. Its batch is now refused whole (422 naming the sample),
    and the store's trak answers are what they were."""
    c, _ = service
    r = await c.put("/stores/s", headers=ALICE, json={"model": "att", "projection_dim": DIM})
    assert r.status_code == 201, r.text
    good = batch(12, 1)
    r = await c.post("/stores/s/samples", headers=ALICE, json={**good, "ids": list(range(12))})
    assert r.status_code == 200, r.text
    test = {"k": 12, "score": "trak", **batch(3, 2)}
    before = await c.post("/stores/s/query", headers=ALICE, json=test)
    assert before.status_code == 200, before.text

    bad = batch(3, 3)
    bad["inputs"][1] = [1e30] * 6
    r = await c.post("/stores/s/samples", headers=ALICE, json={**bad, "ids": [20, 21, 22]})
    error(r, 422, "invalid_input", "1 sample (21)", "self-influence", "nothing of this batch")
    details = r.json()["error"]["details"]
    assert details["samples"] == [21] and details["count"] == 1
    assert details["self_influence"][0] > details["limit"]
    assert (await c.get("/stores/s", headers=ALICE)).json()["samples"] == 12
    r = await c.post("/stores/s/lookup", headers=ALICE, json={"ids": [20, 21, 22]})
    assert r.json()["present"] == [False, False, False]

    after = await c.post("/stores/s/query", headers=ALICE, json=test)
    assert after.status_code == 200, after.text
    assert after.json() == before.json()
    assert np.abs(after.json()["scores"]).min() > 0  # not all-zero scores



async def test_issue_53_an_input_of_1e9_is_kept_and_trak_stays_exact(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """Issue 53's second rerun: an input of 1e9 is accepted; its row held more than all the
    others together and every default trak query of its store answered 422 "Phi^T Phi +
    lambda I is singular". The store answers, equal to the exact reference over the rows it
    keeps on disk (read back here), at the default lambda."""
    c, data = service
    r = await c.put("/stores/x", headers=ALICE, json={"model": "att", "projection_dim": 16})
    assert r.status_code == 201, r.text
    r = await c.post("/per-sample-grads", headers=ALICE, json={
        "model": "att", "inputs": [[1e9] * 6] * 3, "targets": [0, 1, 2], "outputs": ["norms"]})
    assert r.status_code == 200, r.text
    extreme = batch(12, 1)  # sample 5: 1e9 everywhere, with the target it is most wrong about
    extreme["inputs"][5] = [1e9] * 6
    extreme["targets"][5] = int(np.argmax(r.json()["norms"]))
    r = await c.post("/stores/x/samples", headers=ALICE, json={**extreme, "ids": list(range(12))})
    assert r.status_code == 200, r.text
    files = StoreFiles(str(data), ThreadLocks())
    phi = np.concatenate([x for _, x, _ in files.rows("alice~x", files.manifest("alice~x"))]
                         ).astype(np.float64)
    power = np.einsum("ij,ij->i", phi, phi)
    assert power[5] > 1e8 * np.delete(power, 5).sum()  # that row dominates, by far
    q = np.random.default_rng(4).standard_normal((3, 16))
    r = await c.post("/stores/x/query", headers=ALICE,
                     json={"k": 12, "score": "trak", "sketches": q.tolist()})
    assert r.status_code == 200, r.text
    rows, scores = reference(phi, q, "trak", 12, exact=True)
    assert r.json()["ids"] == rows.tolist()
    np.testing.assert_allclose(r.json()["scores"], scores, rtol=1e-4, atol=1e-7)


async def _running_job(cluster_: Any, timeout: float = 120) -> str:
    """The id of a job some worker holds running (polled in Redis)."""
    s = cluster_.settings
    until = time.monotonic() + timeout
    with redis.Redis.from_url(s.redis_url) as r:
        while time.monotonic() < until:
            for key in r.scan_iter(match=keyspace.job_state(s.redis_prefix, "*"), count=1000,
                                   _type="hash"):  # job states, not their payloads
                if text(r.hget(key, "status") or b"") == "running":
                    return text(key).rpartition(":")[2]
            await asyncio.sleep(0.01)
    raise AssertionError("no job was seen running")


async def test_a_worker_killed_mid_append_loses_and_doubles_nothing(tmp_path: Path) -> None:
    """The append's job is taken by a worker that dies (kill -9) while running it; the job is
    retried by another worker and the batch is committed once, equal to the projection."""
    shared = redis_or_skip()
    with prefix_on(shared) as prefix:
        async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1, fast_stats=False,
                           data_dir=str(tmp_path / "data")) as c:
            rng = np.random.default_rng(4)
            data = {"inputs": rng.standard_normal((256, 1, 28, 28)).round(3).tolist(),
                    "targets": rng.integers(0, 10, 256).tolist()}
            r = await c.client.put("/stores/cnn", json={
                "model": "simple-cnn", "projection_dim": 32, "dtype": "float16"})
            assert r.status_code == 201, r.text
            append = asyncio.create_task(c.client.post("/stores/cnn/samples", json={
                **data, "ids": list(range(256))}))
            job_id = await _running_job(c)
            c.workers[0].send_signal(signal.SIGKILL)
            c.start_worker()
            attempts = 0
            while not append.done():  # the job's record goes once its answer is read
                attempts = max(attempts, int(c.job_hash(job_id).get("attempts", 0)))
                await asyncio.sleep(0.02)
            r = await append
            assert r.status_code == 200, r.text + c.dump()
            assert r.json()["samples"] == 256 and r.json()["commits"] == 1
            assert attempts > 1 and c.workers[0].wait() == -9, "the job was not retried"
            r = await c.client.post("/per-sample-grads", json={
                "model": "simple-cnn", **data, "outputs": ["projection"],
                "projection_dim": 32})
            assert r.status_code == 200, r.text
            want = np.asarray(r.json()["projection"], dtype=np.float32).astype(np.float16)
            files = StoreFiles(str(tmp_path / "data"), ThreadLocks())
            manifest = files.manifest("cnn")
            got = np.concatenate([x for _, x, _ in files.rows("cnn", manifest)])
            np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32),
                                       rtol=2e-3, atol=1e-4)
            assert files.ids("cnn", manifest) == set(range(256))
    shared.close()


async def test_safetensors_bodies(tmp_path: Path) -> None:
    """The binary form: integer ids as a tensor, a query's sketches as a tensor."""
    async with open_client(data_dir=str(tmp_path / "data")) as c:
        await _register(c)
        r = await c.put("/stores/bin", json={"model": "att", "projection_dim": DIM,
                                             "projection_seed": SEED})
        assert r.status_code == 201, r.text
        data = batch(6, 4)
        body = fields_to_safetensors({"inputs": np.asarray(data["inputs"], np.float32),
                                      "targets": np.asarray(data["targets"]),
                                      "ids": np.arange(100, 106)}, REQUEST_KEY)
        r = await c.post("/stores/bin/samples", content=body,
                         headers={"content-type": SAFETENSORS})
        assert r.status_code == 200 and r.json()["samples"] == 6, r.text
        phi = await projection(c, data)
        q = np.random.default_rng(0).standard_normal((3, DIM)).astype(np.float32)
        body = fields_to_safetensors({"sketches": q, "k": 4, "score": "cosine"}, REQUEST_KEY)
        r = await c.post("/stores/bin/query", content=body,
                         headers={"content-type": SAFETENSORS})
        assert r.status_code == 200, r.text
        rows, scores = reference(phi, q.astype(np.float64), "cosine", 4)
        assert r.json()["ids"] == (rows + 100).tolist()
        np.testing.assert_allclose(r.json()["scores"], scores, rtol=1e-4, atol=1e-6)


async def test_a_model_version_a_store_pins_is_not_deleted(
        service: tuple[httpx.AsyncClient, Path]) -> None:
    """Deleting the version a store was computed with would leave the store a dead end (its
    appends and queries by inputs 404): the deletion is refused, naming the store, until the
    store is gone."""
    c, _ = service
    r = await c.put("/stores/train", headers=ALICE, json={"model": "att", "projection_dim": DIM})
    assert r.status_code == 201, r.text
    version = r.json()["model"].partition("@")[2]
    for ref in ("att", f"att@{version}"):
        error(await c.delete(f"/models/{ref}", headers=OPS), 409, "conflict",
              "pinned by 1 store", "alice~train")
    assert (await c.get("/models/att", headers=OPS)).json()["version"] == version
    r = await c.post("/stores/train/samples", headers=ALICE, json={**batch(3, 1), "ids": [0, 1, 2]})
    assert r.status_code == 200, r.text
    assert (await c.delete("/stores/train", headers=ALICE)).status_code == 200
    r = await c.delete("/models/att", headers=OPS)
    assert r.status_code == 200 and r.json()["deleted"] == [version], r.text


async def test_an_append_computed_while_its_store_was_made_again_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A store deleted and made again (another projection_dim) while an append's rows were
    computed: the append is a 409, the new store holds none of its rows and works (before,
    the old definition's rows were committed into it, and every query and append after was
    a 500)."""
    computing, go = asyncio.Event(), asyncio.Event()
    real = store_routes._rows

    async def held(*args: Any, **kwargs: Any) -> np.ndarray:
        computing.set()
        await go.wait()
        return await real(*args, **kwargs)

    monkeypatch.setattr(store_routes, "_rows", held)
    async with open_client(data_dir=str(tmp_path / "data"), **KEYS) as c:
        await _register(c)
        r = await c.put("/stores/r", headers=ALICE, json={"model": "att", "projection_dim": DIM})
        assert r.status_code == 201, r.text
        append = asyncio.create_task(c.post("/stores/r/samples", headers=ALICE,
                                            json={**batch(4, 1), "ids": [0, 1, 2, 3]}))
        await computing.wait()
        assert (await c.delete("/stores/r", headers=ALICE)).status_code == 200
        r = await c.put("/stores/r", headers=ALICE, json={"model": "att", "projection_dim": 16})
        assert r.status_code == 201, r.text
        go.set()
        error(await append, 409, "conflict", "'r' was deleted and made again", "send it again")
        assert (await c.get("/stores/r", headers=ALICE)).json()["samples"] == 0
        r = await c.post("/stores/r/samples", headers=ALICE,
                         json={**batch(4, 1), "ids": [0, 1, 2, 3]})
        assert r.status_code == 200 and r.json()["samples"] == 4, r.text
        r = await c.post("/stores/r/query", headers=ALICE, json={
            "model": "att", **batch(1, 2), "k": 2, "score": "trak"})
        assert r.status_code == 200 and len(r.json()["ids"][0]) == 2, r.text


async def test_a_damaged_store_is_named_and_does_not_break_another_tenants_list(
        tmp_path: Path) -> None:
    """Bob's spec.json cut short: alice's GET /stores is hers as before (it was a 500, every
    tenant's spec read before filtering); bob's lists the store as damaged, GET answers 500
    store_damaged naming the file and no traceback, and DELETE removes it (it was a 500)."""
    data = tmp_path / "data"
    async with open_client(data_dir=str(data), **KEYS) as c:
        await _register(c)
        for who, name in ((ALICE, "a"), (BOB, "b")):
            r = await c.put(f"/stores/{name}", headers=who, json={"model": "att",
                                                                  "projection_dim": DIM})
            assert r.status_code == 201, r.text
        spec = data / "stores" / "bob~b" / "spec.json"
        spec.write_bytes(spec.read_bytes()[:20])
        r = await c.get("/stores", headers=ALICE)
        assert r.status_code == 200 and [s["id"] for s in r.json()["stores"]] == ["a"], r.text
        r = await c.get("/stores", headers=BOB)
        assert r.json()["stores"] == [{
            "id": "b", "tenant": "bob", "state": "damaged",
            "error": "store 'b' is damaged: its file spec.json cannot be read; DELETE it and "
                     "add its samples again"}], r.text
        got = await c.get("/stores/b", headers=BOB)
        error(got, 500, "store_damaged", "spec.json", "DELETE it")
        assert "Traceback" not in got.text and "JSONDecodeError" not in got.text
        assert (await c.delete("/stores/b", headers=BOB)).status_code == 200
        assert (await c.get("/stores", headers=BOB)).json()["stores"] == []
        assert (await c.get("/stores/b", headers=BOB)).status_code == 404
