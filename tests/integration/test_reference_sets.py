"""Reference sets through the HTTP api: made by ``PUT``, scored against by ``influence``, held to
their size limit, described, deleted, kept in files, and shared with ``psgrad worker`` processes
through Redis. Every influence score is checked against the per-sample loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from service.registry import load_model
from service.strategies.projection import Projection
from tests.support.api import open_client
from tests.support.cluster import cluster
from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip
from tests.support.reference import per_sample_loop

MLP = {"sizes": [6, 5, 3]}


def batch(n: int, seed: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"inputs": rng.standard_normal((n, 6)).astype(np.float32).tolist(),
            "targets": rng.integers(0, 3, n).tolist()}


def loop_grads(model_id: str, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The per-sample loop on the zoo mlp of ``MLP``'s config (the registered id's weights)."""
    model = load_model(model_id, "mlp", MLP, device=torch.device("cpu"))
    loop = per_sample_loop(model.module, {"inputs": torch.tensor(data["inputs"]),
                                          "targets": torch.tensor(data["targets"])},
                           "cross_entropy")
    return {k: v.double() for k, v in loop.grads.items()}


def sketches(grads: dict[str, torch.Tensor], proj: Projection) -> torch.Tensor:
    return sum(proj.project(k, g) for k, g in grads.items())  # type: ignore[return-value]


def flat(grads: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(len(g), -1) for g in grads.values()], 1)


async def register_mlp(client: httpx.AsyncClient, model_id: str) -> None:
    r = await client.put(f"/models/{model_id}", json={"architecture": "mlp", "config": MLP})
    assert r.status_code == 200, r.text


async def check_sets(client: httpx.AsyncClient, model_id: str) -> None:
    """A sketch set and a gradient set: PUT, GET, influence against the loop, DELETE."""
    refs, test = batch(7, 1), batch(4, 2)
    want_ref, want_test = loop_grads(model_id, refs), loop_grads(model_id, test)
    proj = Projection(128, 5)

    r = await client.put("/reference-sets/train-sk", json={
        "model": model_id, **refs, "projection_dim": 128, "projection_seed": 5})
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["count"] == 7 and doc["projection_dim"] == 128 and doc["bytes"] == 7 * 128 * 4
    assert doc["projection_kind"] == "tensorsketch"  # the default kind, recorded
    assert (await client.get("/reference-sets/train-sk")).json() == doc
    r = await client.post("/per-sample-grads", json={
        "model": model_id, **test, "outputs": ["influence", "self_influence"],
        "reference_set": "train-sk"})
    assert r.status_code == 200, r.text
    got = np.asarray(r.json()["influence"])
    want = sketches(want_test, proj) @ sketches(want_ref, proj).t()
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(r.json()["self_influence"],
                               sketches(want_test, proj).pow(2).sum(1).numpy(), rtol=1e-4)
    assert r.json()["meta"]["projection_kind"] == "tensorsketch"
    r = await client.post("/per-sample-grads", json={  # Kronecker sketches never meet its own
        "model": model_id, **test, "outputs": ["influence"], "reference_set": "train-sk",
        "projection_dim": 128, "projection_seed": 5, "projection_kind": "kronecker"})
    assert r.status_code == 422, r.text
    assert "projection_kind 'tensorsketch'" in r.json()["error"]["message"]

    r = await client.put("/reference-sets/train-full", json={"model": model_id, **refs})
    assert r.status_code == 200, r.text
    assert r.json()["projection_dim"] is None
    r = await client.post("/per-sample-grads", json={
        "model": model_id, **test, "outputs": ["influence"], "reference_set": "train-full"})
    assert r.status_code == 200, r.text
    exact = flat(want_test) @ flat(want_ref).t()
    np.testing.assert_allclose(r.json()["influence"], exact.numpy(), rtol=1e-4, atol=1e-5)

    assert (await client.delete("/reference-sets/train-sk")).status_code == 200
    r = await client.get("/reference-sets/train-sk")
    assert r.status_code == 404 and "PUT /reference-sets/train-sk" in r.json()["error"]["message"]
    r = await client.post("/per-sample-grads", json={
        "model": model_id, **test, "outputs": ["influence"], "reference_set": "train-sk"})
    assert r.status_code == 404, r.text
    assert (await client.delete("/reference-sets/train-sk")).status_code == 404


async def test_reference_sets_embedded_with_limits(tmp_path: Path) -> None:
    async with open_client(max_reference_set_bytes=7 * 128 * 4, data_dir=str(tmp_path)) as client:
        await register_mlp(client, "att")
        await check_sets(client, "att")
        r = await client.put("/reference-sets/big", json={"model": "att", **batch(8, 3),
                                                          "projection_dim": 128})
        assert r.status_code == 413, r.text
        assert "PSGRAD_MAX_REFERENCE_SET_BYTES" in r.json()["error"]["message"]
        r = await client.put("/reference-sets/big", json={"model": "att", **batch(68, 3)})
        assert r.status_code == 413 and "projection_dim" in r.json()["error"]["message"], r.text
        r = await client.put("/reference-sets/Bad!", json={"model": "att", **batch(2, 3)})
        assert r.status_code == 400, r.text
        # what a set does not read is refused, never ignored: rows made at other 'weights'
        # would be kept as the registered version's
        for name, value in (("outputs", ["grads"]), ("weights", {"fc3.bias": [5.0] * 10}),
                            ("clip_norm", 1.0), ("dp_run", "r")):
            r = await client.put("/reference-sets/x", json={"model": "att", **batch(2, 3),
                                                            name: value})
            assert r.status_code == 422, r.text
            assert r.json()["error"]["details"]["fields"] == [name]
            assert f"leave out: {name}" in r.json()["error"]["message"]
        r = await client.put("/reference-sets/x", json={"model": "att", **batch(2, 3), "nope": 1})
        assert r.status_code == 400, r.text
        known = r.json()["error"]["message"].partition("known: ")[2].split(", ")
        assert "projection_dim" in known and "clip_norm" not in known, known
        assert (await client.get("/reference-sets/x")).status_code == 404  # nothing kept


async def test_reference_sets_kept_in_files(tmp_path: Path) -> None:
    async with open_client(model_dir=str(tmp_path), data_dir=str(tmp_path / "data")) as client:
        await register_mlp(client, "att")
        r = await client.put("/reference-sets/kept", json={"model": "att", **batch(3, 1),
                                                           "projection_dim": 16})
        assert r.status_code == 200, r.text
    async with open_client(model_dir=str(tmp_path), data_dir=str(tmp_path / "data")) as client:
        assert (await client.get("/reference-sets/kept")).json()["count"] == 3
        ids = [m["id"] for m in (await client.get("/models")).json()["models"]]
        assert "_reference_sets" not in ids
        r = await client.post("/per-sample-grads", json={
            "model": "att", **batch(2, 2), "outputs": ["influence"], "reference_set": "kept"})
        assert r.status_code == 200 and np.shape(r.json()["influence"]) == (2, 3), r.text


async def test_reference_sets_shared_by_redis_workers(tmp_path: Path) -> None:
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1) as c:
            await register_mlp(c.client, "att-redis")
            await check_sets(c.client, "att-redis")
    client.close()


def test_sdk_reference_sets_and_chunked_influence(tmp_path: Path) -> None:
    """``client.reference_sets`` and ``influence`` over a batch the client splits in chunks."""
    import psgrad
    from service.api import create_app
    from service.config import Settings
    from tests.support.client import running_app

    app = create_app(Settings(max_batch_size=4, workers=1, batch_max_delay_ms=0.0,
                              data_dir=str(tmp_path)))
    rng = np.random.default_rng(0)
    refs = {"inputs": rng.standard_normal((6, 784)), "targets": rng.integers(0, 10, 6)}
    test = {"inputs": rng.standard_normal((10, 784)), "targets": rng.integers(0, 10, 10)}
    with running_app(app) as transport, psgrad.Client(base_url="http://app",
                                                      transport=transport) as client:
        # float64 inputs are cast to the model's dtype, as for per_sample_grads (they were
        # refused: DtypeMismatch)
        doc = client.reference_sets.put("sdk", "mlp", refs["inputs"],
                                        np.asarray(refs["targets"]), projection_dim=64,
                                        projection_seed=3)
        assert doc["count"] == 6 and client.reference_sets.get("sdk") == doc  # 2 jobs
        got = client.per_sample_grads("mlp", np.asarray(test["inputs"], np.float32),
                                      np.asarray(test["targets"]), reference_set="sdk",
                                      outputs=["influence", "projection"], projection_dim=64,
                                      projection_seed=3)
        assert got.meta["requests"] == 3  # 4 + 4 + 2 samples
        np.testing.assert_allclose(got.influence, got.projection @ client.per_sample_grads(
            "mlp", np.asarray(refs["inputs"], np.float32), np.asarray(refs["targets"]),
            outputs=["projection"], projection_dim=64, projection_seed=3).projection.T,
            rtol=1e-4, atol=1e-4)
        assert client.reference_sets.delete("sdk")["deleted"] is True
        with pytest.raises(psgrad.NotFound):
            client.reference_sets.get("sdk")


async def test_a_reference_set_is_a_small_gradient_store(tmp_path: Path) -> None:
    """One concept: a set is the store of its id (sketches, or full gradients of kind exact),
    any store of the caller is a reference set up to the size limit, and each refusal says
    where to go instead. Scores are checked against the per-sample loop."""
    refs, test = batch(5, 1), batch(3, 2)
    async with open_client(data_dir=str(tmp_path), max_reference_set_bytes=6 * 32 * 4) as c:
        await register_mlp(c, "att")
        want_ref, want_test = loop_grads("att", refs), loop_grads("att", test)
        proj = Projection(32, 7)
        r = await c.put("/reference-sets/sk", json={"model": "att", **refs,
                                                    "projection_dim": 32, "projection_seed": 7})
        assert r.status_code == 200, r.text
        store = (await c.get("/stores/sk")).json()  # the set, as a store
        assert store["samples"] == 5 and store["projection_kind"] == "tensorsketch"
        assert store["shapes"] == r.json()["shapes"] and store["model"] == r.json()["model"]
        q = sketches(want_test, proj)
        r = await c.post("/stores/sk/query", json={"sketches": q.tolist(), "k": 5})
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["scores"], torch.sort(
            q @ sketches(want_ref, proj).t(), dim=1, descending=True).values, rtol=1e-4,
            atol=1e-5)

        # a store made through /stores is a reference set too
        r = await c.put("/stores/made", json={"model": "att", "projection_dim": 32,
                                              "projection_seed": 7})
        assert r.status_code == 201, r.text
        inf = {"model": "att", **test, "outputs": ["influence"], "reference_set": "made"}
        r = await c.post("/per-sample-grads", json=inf)
        assert r.status_code == 409 and "POST /stores/made/samples" in r.text, r.text
        r = await c.post("/stores/made/samples", json={**refs, "ids": [10, 11, 12, 13, 14]})
        assert r.status_code == 200, r.text
        r = await c.post("/per-sample-grads", json=inf)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(r.json()["influence"],
                                   (q @ sketches(want_ref, proj).t()).numpy(), rtol=1e-4,
                                   atol=1e-4)
        assert (await c.get("/reference-sets/made")).json()["count"] == 5

        # a commit is read anew (the worker keeps a set only as of its commit)
        r = await c.post("/stores/made/samples", json={**batch(1, 3), "ids": [20]})
        assert r.status_code == 200, r.text
        r = await c.post("/per-sample-grads", json=inf)
        assert r.status_code == 200 and np.shape(r.json()["influence"]) == (3, 6), r.text

        # past the limit a store is no reference set: influence and PUT say where to go
        r = await c.post("/stores/made/samples", json={**batch(1, 6), "ids": [21]})
        assert r.status_code == 200, r.text
        r = await c.post("/per-sample-grads", json=inf)
        assert r.status_code == 413 and "POST /stores/made/query" in r.text, r.text
        r = await c.put("/reference-sets/made", json={"model": "att", **refs,
                                                      "projection_dim": 32})
        assert r.status_code == 409 and "DELETE /stores/made" in r.text, r.text
        assert (await c.get("/stores/made")).json()["samples"] == 7  # untouched

        # nor does it replace a store no set could be (it did: an ensemble, a store's index
        # or fitted factors, gone with a 200)
        r = await c.put("/stores/ix", json={"model": "att", "projection_dim": 32,
                                            "index": "Flat"})
        assert r.status_code == 201, r.text
        r = await c.put("/stores/fac", json={"model": "att", "projection_dim": 32})
        assert r.status_code == 201, r.text
        r = await c.post("/stores/fac/factors", json=refs)
        assert r.status_code == 200, r.text
        for name, kept in (("ix", "one with an index"), ("fac", "one with fitted factors")):
            r = await c.put(f"/reference-sets/{name}", json={"model": "att", **refs,
                                                             "projection_dim": 32})
            assert r.status_code == 409 and kept in r.text, r.text
        assert (await c.get("/stores/fac")).json()["factors"]["samples"] == 5

        # full gradients: a store of kind exact, queried by sketches of its own length only
        full = batch(2, 4)
        r = await c.put("/reference-sets/full", json={"model": "att", **full})
        assert r.status_code == 200 and r.json()["projection_kind"] is None, r.text
        store = (await c.get("/stores/full")).json()
        assert store["projection_kind"] == "exact"
        assert store["projection_dim"] == 6 * 5 + 5 + 5 * 3 + 3  # the mlp's every parameter
        exact = flat(want_test) @ flat(loop_grads("att", full)).t()
        r = await c.post("/stores/full/query", json={"sketches": flat(want_test).tolist(),
                                                     "k": 2})
        np.testing.assert_allclose(r.json()["scores"], torch.sort(
            exact, dim=1, descending=True).values, rtol=1e-4, atol=1e-5)
        # an exact store answers every score, and takes samples and queries as any store
        r = await c.post("/stores/full/samples", json={**batch(1, 5), "ids": [9]})
        assert r.status_code == 200 and r.json()["samples"] == 3, r.text
        phi = torch.cat([flat(loop_grads("att", full)), flat(loop_grads("att", batch(1, 5)))])
        lam = float((phi.double() ** 2).sum()) / phi.shape[1]  # the default: trace / width
        want_trak = flat(want_test).double() @ torch.linalg.solve(
            phi.double().t() @ phi.double() + lam * torch.eye(phi.shape[1], dtype=torch.float64),
            phi.double().t())
        r = await c.post("/stores/full/query", json={**test, "k": 3, "score": "trak"})
        assert r.status_code == 200, r.text
        assert r.json()["lambda"] == pytest.approx(lam, rel=1e-6)
        np.testing.assert_allclose(r.json()["scores"], torch.sort(
            want_trak, dim=1, descending=True).values, rtol=1e-4, atol=1e-6)
