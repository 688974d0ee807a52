"""Bring your own model through the HTTP api (httpx ASGITransport against ``create_app``).

Every allow-listed layer type is registered, given new weights, and differentiated by the
service; the answer must equal the per-sample loop on a stock-torch copy built here and loaded
with the weights that ``GET /models/{id}/weights`` returns.
"""

from __future__ import annotations

import io
import pickle
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from service.api.app import create_app
from service.config import Settings
from tests.support.layers import CASES, Case, perturbed, reference_model
from tests.support.reference import TOL, per_sample_loop

ADMIN = {"Authorization": "Bearer admin-key"}
USER = {"Authorization": "Bearer user-key"}
ST = {"Content-Type": "application/x-safetensors"}
LIMITS = {"max_layers": 8, "max_parameters": 10_000, "max_weight_bytes": 100_000}
MLP = {"architecture": "sequential", "layers": [{"type": "Linear", "args": [4, 2]}],
       "input": {"shape": [4]}}


@asynccontextmanager
async def serve(**overrides: Any) -> AsyncIterator[httpx.AsyncClient]:
    settings = Settings(**{"admin_keys": "admin-key", "api_keys": "user-key", "workers": 1,
                           **LIMITS, **overrides})
    app = create_app(settings)
    async with app.router.lifespan_context(app), httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://psgrad.test"
    ) as client:
        yield client


def _error(response: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    if code is not None:
        assert error["code"] == code, error
    return error


async def _weights(client: httpx.AsyncClient, ref: str) -> dict[str, torch.Tensor]:
    response = await client.get(f"/models/{ref}/weights", headers=USER)
    assert response.status_code == 200, response.text
    return st_load(response.content)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
async def test_every_layer_type_matches_the_per_sample_loop(case: Case) -> None:
    async with serve() as client:
        first = await client.put(f"/models/{case.name}", json=case.spec(), headers=ADMIN)
        assert first.status_code == 200, first.text
        sent = perturbed(await _weights(client, case.name))
        second = await client.put(f"/models/{case.name}/weights", content=st_save(sent),
                                  headers={**ADMIN, **ST})
        assert second.status_code == 200, second.text
        doc = second.json()
        assert doc["versions"] == [first.json()["version"], doc["version"]]
        state = await _weights(client, case.name)
        for name, value in sent.items():  # the weights round trip bit for bit
            assert state[name].dtype == value.dtype
            assert torch.equal(state[name].view(-1).view(torch.uint8),
                               value.reshape(-1).view(torch.uint8)), name
        x, y = case.batch()
        response = await client.post("/per-sample-grads", headers=USER, json={
            "model": case.name, "inputs": x.tolist(), "targets": y.tolist(),
            "outputs": ["grads", "norms"]})
        assert response.status_code == 200, response.text
        body = response.json()
        summary = await client.post("/per-sample-grads", headers=USER, json={
            "model": case.name, "inputs": x.tolist(), "targets": y.tolist(),
            "outputs": ["norms"]})  # no per-sample tensors asked: the fast-statistics route
        assert summary.status_code == 200, summary.text
    assert body["model"] == f"{case.name}@{doc['version']}"
    assert body["meta"]["route"] in ("vmap", "fast_stats")  # batched: never the loop route
    loop = per_sample_loop(reference_model(case, state), {"inputs": x, "targets": y}, case.loss)
    grads, norms = loop.grads, loop.norms
    assert list(body["grads"]) == list(grads) == list(doc["parameters"])
    for name, g in grads.items():
        torch.testing.assert_close(torch.tensor(body["grads"][name]), g, **TOL)
    torch.testing.assert_close(torch.tensor(body["norms"]), norms, **TOL)
    torch.testing.assert_close(torch.tensor(summary.json()["norms"]), norms, **TOL)


async def test_versions_and_id_at_version() -> None:
    w1 = {"0.weight": [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]], "0.bias": [0.0, 0.0]}
    x = {"inputs": [[1.0, 2.0, 3.0, 4.0]], "targets": [1], "outputs": ["grads"]}
    async with serve() as client:
        v1 = (await client.put("/models/m", json={**MLP, "weights": w1}, headers=ADMIN)).json()
        w2 = {"0.weight": torch.full((2, 4), 0.5), "0.bias": torch.tensor([1.0, -1.0])}
        v2 = (await client.put("/models/m/weights", content=st_save(w2),
                               headers={**ADMIN, **ST})).json()
        assert v1["version"] != v2["version"]
        doc = (await client.get("/models/m", headers=USER)).json()
        assert doc["version"] == v2["version"]
        assert doc["versions"] == [v1["version"], v2["version"]]
        old = (await client.get(f"/models/m@{v1['version']}", headers=USER)).json()
        assert old["version"] == v1["version"]
        assert (await _weights(client, f"m@{v1['version']}"))["0.weight"].tolist() == w1[
            "0.weight"]
        ids = [m["id"] for m in (await client.get("/models", headers=USER)).json()["models"]]
        assert "m" in ids and "sequential" not in ids
        by_version = {}
        for ref in ("m", f"m@{v1['version']}"):
            r = await client.post("/per-sample-grads", headers=USER, json={"model": ref, **x})
            assert r.status_code == 200, r.text
            by_version[r.json()["model"]] = r.json()["grads"]["0.bias"]
        # logits v1 = [1, 2] -> softmax p; grad of the bias = p - onehot(1)
        p = torch.softmax(torch.tensor([1.0, 2.0]), 0)
        torch.testing.assert_close(torch.tensor(by_version[f"m@{v1['version']}"][0]),
                                   p - torch.tensor([0.0, 1.0]))
        assert set(by_version) == {f"m@{v1['version']}", f"m@{v2['version']}"}
        gone = await client.delete(f"/models/m@{v2['version']}", headers=ADMIN)
        assert gone.json() == {"id": "m", "deleted": [v2["version"]], "versions": [v1["version"]]}
        assert (await client.get("/models/m", headers=USER)).json()["version"] == v1["version"]
        _error(await client.get(f"/models/m@{v2['version']}", headers=USER), 404, "unknown_model")
        r = await client.post("/per-sample-grads", headers=USER,
                              json={"model": f"m@{v2['version']}", **x})
        _error(r, 404, "unknown_model")
        assert (await client.delete("/models/m", headers=ADMIN)).status_code == 200
        _error(await client.get("/models/m", headers=USER), 404, "unknown_model")
        _error(await client.delete("/models/m", headers=ADMIN), 404, "unknown_model")


async def test_admin_key_is_required() -> None:
    async with serve() as client:
        for headers, status in (({}, 401), (USER, 403), ({"Authorization": "Bearer no"}, 401)):
            _error(await client.put("/models/m", json=MLP, headers=headers), status)
        assert (await client.put("/models/m", json=MLP, headers=ADMIN)).status_code == 200
        body = st_save({"0.weight": torch.zeros(2, 4), "0.bias": torch.zeros(2)})
        _error(await client.put("/models/m/weights", content=body, headers={**USER, **ST}), 403)
        _error(await client.delete("/models/m", headers=USER), 403)
        _error(await client.delete("/models/m", headers={}), 401)
        assert (await client.get("/models/m", headers=USER)).status_code == 200
    async with serve(admin_keys="", api_keys="") as client:  # no keys: an open (local) server
        assert (await client.put("/models/m", json=MLP)).status_code == 200


def _torch_save(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # made here, to check the server refuses it; never loaded
    return buffer.getvalue()


async def test_refusals() -> None:
    layer = {"type": "Linear", "args": [4, 2]}
    async with serve() as client:
        async def put(spec: Any, model_id: str = "r") -> httpx.Response:
            return await client.put(f"/models/{model_id}", json=spec, headers=ADMIN)

        err = _error(await put({**MLP, "layers": [layer, {"type": "Lambda"}]}), 422,
                     "invalid_model_spec")
        assert err["details"]["layer"] == 1 and "Linear" in err["details"]["allowed"]
        err = _error(await put({**MLP, "layers": [{"type": "Linear", "args": [4, "eval"]}]}),
                     422, "invalid_model_spec")
        assert "layer 0 (Linear)" in err["message"]
        err = _error(await put({**MLP, "layers": [layer, {"type": "Linear", "args": [3, 2]}]}),
                     422, "invalid_model_spec")
        assert err["details"]["layer"] == 1
        _error(await put({**MLP, "layers": [layer] + [{"type": "Identity"}] * 8}), 413,
               "too_large")
        _error(await put({**MLP, "layers": [{"type": "Linear", "args": [4, 5000]}]}), 413,
               "too_large")
        _error(await put({**MLP, "architecture": "resnet"}), 422, "invalid_model_spec")
        _error(await put({**MLP, "default_loss": "hinge"}), 422, "unknown_loss")
        _error(await put({**MLP, "weights": {"0.weight": [[0.0] * 4] * 2}}), 422,
               "shape_mismatch")
        for bad in ("Upper", "-x", "a.b.c" * 30):
            _error(await put(MLP, bad), 400, "bad_request")
        _error(await put(MLP, "mlp"), 409, "conflict")
        _error(await client.put("/models/r", content=b"layers: []", headers=ADMIN), 415,
               "unsupported_media_type")

        assert (await put(MLP)).status_code == 200
        good = {"0.weight": torch.zeros(2, 4), "0.bias": torch.zeros(2)}
        bodies = [
            (st_save({**good, "1.weight": torch.zeros(1)}), 422, "shape_mismatch"),
            (st_save({"0.weight": good["0.weight"]}), 422, "shape_mismatch"),
            (st_save({**good, "0.bias": torch.zeros(3)}), 422, "shape_mismatch"),
            (st_save({**good, "0.bias": torch.zeros(2, dtype=torch.float16)}), 422,
             "dtype_mismatch"),
            (st_save({**good, "0.bias": torch.tensor([0.0, float("nan")])}), 422, "non_finite"),
            (st_save({**good, "0.bias": torch.tensor([float("-inf"), 0.0])}), 422, "non_finite"),
            (pickle.dumps({k: v.numpy() for k, v in good.items()}), 400, "bad_request"),
            (_torch_save(good), 400, "bad_request"),
            (b"not a safetensors file at all", 400, "bad_request"),
        ]
        for body, status, code in bodies:
            err = _error(await client.put("/models/r/weights", content=body,
                                          headers={**ADMIN, **ST}), status, code)
        assert "never unpickles" in err["message"] or "safetensors" in err["message"]
        _error(await client.put("/models/r/weights", json={"0.bias": [0, 0]}, headers=ADMIN),
               415, "unsupported_media_type")
        _error(await client.put("/models/nobody/weights", content=st_save(good),
                                headers={**ADMIN, **ST}), 404, "unknown_model")
        _error(await client.put("/models/mlp/weights", content=st_save(good),
                                headers={**ADMIN, **ST}), 409, "conflict")
        _error(await client.delete("/models/mlp", headers=ADMIN), 409, "conflict")
        assert len((await client.get("/models/r", headers=USER)).json()["versions"]) == 1


async def _register_and_check(first: dict[str, Any], second: dict[str, Any]) -> None:
    async with serve(**first) as client:
        doc = (await client.put("/models/kept", json=MLP, headers=ADMIN)).json()
        sent = await _weights(client, "kept")
    async with serve(**second) as client:  # a new api process on the same store
        again = (await client.get("/models/kept", headers=USER)).json()
        assert again["version"] == doc["version"] and again["versions"] == [doc["version"]]
        kept = await _weights(client, "kept")
        assert all(torch.equal(kept[k], v) for k, v in sent.items())
        assert (await client.delete("/models/kept", headers=ADMIN)).status_code == 200


async def test_embedded_registry_survives_a_restart_with_model_dir(tmp_path: Path) -> None:
    await _register_and_check({"model_dir": str(tmp_path)}, {"model_dir": str(tmp_path)})
    async with serve() as client:  # without a model dir, a new process starts empty
        _error(await client.get("/models/kept", headers=USER), 404, "unknown_model")


async def test_redis_registry_survives_a_restart() -> None:
    prefix = f"psgrad-test-{uuid.uuid4().hex[:12]}"
    settings = {"redis_url": "redis://127.0.0.1:6379/0", "redis_prefix": prefix}
    try:
        await _register_and_check(settings, settings)
    finally:
        client = redis.Redis.from_url(settings["redis_url"])
        found = list(client.scan_iter(f"{prefix}:*"))
        if found:
            client.delete(*found)
        client.close()


async def test_stock_recurrent_layers_take_the_loop_route(request: pytest.FixtureRequest) -> None:
    """An operator family with a stock ``nn.GRU`` (vmap cannot batch it in torch 2.13)."""
    from torch import nn

    from models.base import ZOO, ModelFamily, TensorSpec
    from tests.support.layers import first_output

    class StockGRU(ModelFamily):
        name = "stock-gru"

        def build(self, config: dict[str, Any]) -> nn.Module:
            return nn.Sequential(first_output(nn.GRU)(3, 4, batch_first=True), nn.Flatten(),
                                 nn.Linear(8, 2))

        def input_spec(self, config: dict[str, Any]) -> TensorSpec:
            return TensorSpec((2, 3))

    ZOO.add("stock-gru", StockGRU())
    request.addfinalizer(lambda: ZOO.pop("stock-gru", None))
    case = Case("stock-gru", [], [2, 3])
    x, y = case.batch()
    async with serve() as client:
        response = await client.post("/per-sample-grads", headers=USER, json={
            "model": "stock-gru", "inputs": x.tolist(), "targets": y.tolist(),
            "outputs": ["grads", "norms"], "verify": 2})
        assert response.status_code == 200, response.text
        state = await _weights(client, "stock-gru")
    body = response.json()
    assert body["meta"]["route"] == "loop"
    assert len(body["meta"]["verify"]["samples"]) == 2  # the loop checked the loop route too
    reference = StockGRU().build({})
    reference.load_state_dict(state)
    loop = per_sample_loop(reference, {"inputs": x, "targets": y}, case.loss)
    grads, norms = loop.grads, loop.norms
    for name, g in grads.items():
        torch.testing.assert_close(torch.tensor(body["grads"][name]), g, **TOL)
    torch.testing.assert_close(torch.tensor(body["norms"]), norms, **TOL)
