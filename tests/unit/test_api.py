"""The api's routes on the embedded broker, through httpx's ASGI transport (lifespan running)."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
from safetensors.numpy import load as st_load

import psgrad
from psgrad._wire import RESPONSE_KEY, fields_from_safetensors
from service.api.schemas import GradsRequest
from service.registry import ModelRegistry
from tests.support.api import (
    SAFETENSORS,
    TD0,
    app_of,
    assert_outputs,
    in_process,
    open_client,
    post_st,
    until_ready,
)

rng = np.random.default_rng(0)
VALUE_MLP = {
    "model": "value-mlp",
    "loss": "mse",
    "inputs": rng.standard_normal((5, 8)).astype(np.float32).tolist(),
    "targets": rng.standard_normal(5).astype(np.float32).tolist(),
    "outputs": ["grads", "losses", "norms", "layer_norms", "mean", "variance"],
}


async def test_health_and_readiness() -> None:
    async with open_client() as c:
        assert (await c.get("/healthz")).json() == {"status": "ok", "version": psgrad.__version__}
        r = await until_ready(c)
        assert r.status_code == 200 and r.json()["ready"] is True
    async with open_client(workers=0) as c:  # a queue that nobody serves is not ready
        r = await c.get("/readyz")
        assert r.status_code == 503 and r.json()["ready"] is False
        assert r.headers["retry-after"] == "1"


async def test_td0_hand_check_json_and_safetensors() -> None:
    """The TD(0) example hand-computed in docs/requests.md, in both wire forms."""
    doc = {**TD0, "outputs": ["grads", "updates", "td_errors", "losses"]}
    want = {
        "td_errors": np.array([1.8]),
        "updates": {"theta": np.array([[3.6, 1.8, -3.6]])},
        "grads": {"theta": np.array([[-7.2, -3.6, 7.2]])},
        "losses": np.array([1.8**2]),
    }
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json=doc)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"].startswith("linear-value@") and body["batch_size"] == 1
        assert body["loss"] == "td0" and set(body["timing"]) == {"queue_ms", "compute_ms"}
        for name, ref in want.items():
            got = body[name]["theta"] if isinstance(ref, dict) else body[name]
            ref = ref["theta"] if isinstance(ref, dict) else ref
            np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5)
        r2, fields = await post_st(c, doc)
        assert r2.status_code == 200 and r2.headers["content-type"] == SAFETENSORS
        assert_outputs(
            fields,
            {
                k: np.asarray(body[k], np.float32)
                if not isinstance(body[k], dict)
                else {p: np.asarray(v, np.float32) for p, v in body[k].items()}
                for k in doc["outputs"]
            },
            exact=True,
        )


@pytest.mark.parametrize(
    "doc",
    [
        VALUE_MLP,
        {
            "model": "simple-cnn",
            "inputs": rng.standard_normal((3, 1, 28, 28)).astype(np.float32).tolist(),
            "targets": [1, 7, 3],
            "outputs": ["losses", "norms", "cosine_mean"],
        },
        {
            **TD0,
            "model": "linear-value",
            "outputs": ["updates", "td_errors", "dot"],
            "reference": {"theta": [1.0, 2.0, 3.0]},
        },
    ],
    ids=["value-mlp", "simple-cnn", "linear-value"],
)
async def test_json_and_safetensors_equal_the_engine(doc: dict[str, object]) -> None:
    want = in_process(dict(doc), ModelRegistry())
    async with open_client(batch_max_delay_ms=0) as c:
        r = await c.post("/per-sample-grads", json=doc)
        assert r.status_code == 200, r.text
        r2, fields = await post_st(c, dict(doc))
        assert r2.status_code == 200, r2.text
        meta = json.loads(_metadata(r2.content))
    assert_outputs(r.json(), want)
    assert_outputs(fields, want)
    assert_outputs(fields, {k: v for k, v in fields.items() if k in want}, exact=True)
    # JSON lists of float32 values round-trip exactly: both forms carry identical numbers
    assert_outputs(r.json(), {k: fields[k] for k in want}, exact=True)
    assert meta["model"] == r.json()["model"] and "timing" in meta


def _metadata(data: bytes) -> str:
    n = int.from_bytes(data[:8], "little")
    return str(json.loads(data[8 : 8 + n])["__metadata__"][RESPONSE_KEY])


async def test_base64_tensors_in_json() -> None:
    import base64

    x = rng.standard_normal((2, 8)).astype(np.float32)
    doc = {
        "model": "value-mlp",
        "loss": "mse",
        "outputs": ["norms"],
        "targets": [0.5, -1.0],
        "inputs": {
            "dtype": "float32",
            "shape": [2, 8],
            "data": base64.b64encode(x.tobytes()).decode(),
        },
    }
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json=doc)
    assert r.status_code == 200, r.text
    assert_outputs(r.json(), in_process({**doc, "inputs": x.tolist()}))


async def test_models_routes() -> None:
    async with open_client() as c:
        r = await c.get("/models")
        ids = [m["id"] for m in r.json()["models"]]
        assert {"simple-cnn", "mlp", "linear-value", "value-mlp"} <= set(ids)
        doc = (await c.get("/models/value-mlp")).json()
        assert doc["input"] == {"shape": [8], "dtype": "float32"}
        versioned = await c.get(f"/models/value-mlp@{doc['version']}")
        assert versioned.status_code == 200 and versioned.json()["version"] == doc["version"]
        r = await c.get("/models/value-mlp/weights")
        assert r.status_code == 200 and r.headers["content-type"] == SAFETENSORS
        assert r.headers["x-psgrad-model"] == f"value-mlp@{doc['version']}"
        weights = st_load(r.content)
        model = app_of(c).state.psgrad.registry.get("value-mlp")
        assert list(doc["parameters"]) == list(model.params)  # the module's own order
        for name, p in model.params.items():
            np.testing.assert_array_equal(weights[name], p.numpy())
        assert {k: list(v.shape) for k, v in weights.items() if k in doc["parameters"]} == {
            k: v["shape"] for k, v in doc["parameters"].items()
        }
        missing = await c.get("/models/no-such-model")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_model"
        wrong = await c.get("/models/value-mlp@0000")
        assert wrong.status_code == 404


async def test_jobs_lifecycle_json_and_safetensors() -> None:
    doc = {**TD0, "outputs": ["updates"]}
    async with open_client() as c:
        r = await c.post("/jobs", json=doc)
        assert r.status_code == 202 and r.json()["status"] == "queued"
        job_id = r.json()["job_id"]
        assert r.headers["location"] == f"/jobs/{job_id}"
        body = await _poll(c, job_id)
        assert body["status"] == "succeeded" and body["error"] is None
        np.testing.assert_allclose(
            body["result"]["updates"]["theta"], [[3.6, 1.8, -3.6]], rtol=1e-5
        )
        r = await c.get(f"/jobs/{job_id}", headers={"accept": SAFETENSORS})
        assert r.headers["content-type"] == SAFETENSORS
        fields = fields_from_safetensors(r.content, RESPONSE_KEY)
        np.testing.assert_array_equal(
            fields["updates"]["theta"], np.asarray(body["result"]["updates"]["theta"], np.float32)
        )
        # DELETE of a finished job answers it as it was and removes it
        assert (await c.delete(f"/jobs/{job_id}")).json()["status"] == "succeeded"
        r = await c.get(f"/jobs/{job_id}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_job"
        assert (await c.delete(f"/jobs/{job_id}")).status_code == 404
        # a failing job shows its error (what needs the model: the inputs' shape)
        bad = (await c.post("/jobs", json={**doc, "inputs": [[1.0, 2.0]]})).json()["job_id"]
        failed = await _poll(c, bad)
        assert failed["status"] == "failed" and failed["error"]["code"] == "shape_mismatch"
        for method in (c.get, c.delete):
            r = await method("/jobs/0123456789abcdef")
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_job"
        assert (await c.get("/jobs/..%2F..")).status_code == 404


async def test_cancel_a_queued_job_and_results_expire() -> None:
    async with open_client(workers=0) as c:  # nobody takes jobs: it stays queued
        job_id = (await c.post("/jobs", json=TD0)).json()["job_id"]
        assert (await c.get(f"/jobs/{job_id}")).json()["status"] == "queued"
        r = await c.delete(f"/jobs/{job_id}")
        assert r.status_code == 200 and r.json()["status"] == "canceled"
        assert (await c.get(f"/jobs/{job_id}")).json()["status"] == "canceled"
        assert (await c.delete(f"/jobs/{job_id}")).json()["status"] == "canceled"  # now removed
        assert (await c.get(f"/jobs/{job_id}")).status_code == 404
        assert (await c.get("/metrics")).text.count("psgrad_queue_depth 0.0") == 1
    async with open_client(result_ttl_s=1) as c:
        job_id = (await c.post("/jobs", json=TD0)).json()["job_id"]
        assert (await _poll(c, job_id))["status"] == "succeeded"
        await asyncio.sleep(1.6)
        r = await c.get(f"/jobs/{job_id}")
        assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_job"


async def test_jobs_refuses_what_the_schema_forbids_before_queueing() -> None:
    async with open_client(workers=0) as c:
        for bad, status, code in (
            ({"model": ""}, 400, "bad_request"),
            ({"seed": -1}, 422, "invalid_input"),
            ({"seed": "1"}, 400, "bad_request"),
            ({"clip_norm": 0}, 422, "invalid_input"),
            ({"outputs": ["nope"]}, 422, "unknown_output"),
            ({"gamma": "0.5"}, 400, "bad_request"),
            ({"dones": False}, 422, "shape_mismatch"),
        ):
            r = await c.post("/jobs", json={**TD0, **bad})
            assert r.status_code == status and r.json()["error"]["code"] == code, (bad, r.text)
        # a model that does not exist: 404 at once, as POST /per-sample-grads answers (issue
        # 53's third rerun: 202, then a failed job); what needs the model is queued
        for ref in ("nope", "m1@0000000000000000", "linear-value@0000000000000000"):
            r = await c.post("/jobs", json={**TD0, "model": ref})
            assert r.status_code == 404 and r.json()["error"]["code"] == "unknown_model", r.text
        assert (await c.post("/jobs", json={**TD0, "inputs": [[1.0, 2.0]]})).status_code == 202


async def test_jobs_refuses_a_reference_set_as_the_sync_route_does() -> None:
    """Issue 53's fourth rerun: a reference set that 'influence' reads and that does not exist
    (or is another tenant's) answered POST /jobs 202, then a failed job, where the sync route
    answers 404; a malformed id answered 404 there and 400 here. Both routes now agree."""
    influence = {"model": "mlp", "inputs": [[0.0] * 784], "targets": [0],
                 "outputs": ["influence"]}
    async with open_client() as c:
        for route in ("/jobs", "/per-sample-grads"):
            for name, status, code in (("nope", 404, "not_found"),
                                       ("A3", 400, "bad_request"), ("a~b", 400, "bad_request")):
                r = await c.post(route, json={**influence, "reference_set": name})
                assert (r.status_code, r.json()["error"]["code"]) == (status, code), (route,
                                                                                      r.text)


async def _poll(c: object, job_id: str) -> dict[str, object]:
    for _ in range(600):
        r = await c.get(f"/jobs/{job_id}")  # type: ignore[attr-defined]
        body: dict[str, object] = r.json()
        if body["status"] in ("succeeded", "failed", "canceled"):
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} did not finish")


def _sample(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_metrics_move() -> None:
    async with open_client() as c:
        before = (await c.get("/metrics")).text
        # grads need the vmap function (summary outputs may take the fast statistics instead)
        r = await c.post("/per-sample-grads", json={**VALUE_MLP, "outputs": ["grads"]})
        assert r.status_code == 200
        await c.post(
            "/per-sample-grads", content=b"{", headers={"content-type": "application/json"}
        )
        after = (await c.get("/metrics")).text
    grads_ok = 'psgrad_requests_total{method="POST",route="/per-sample-grads",status="200"}'
    grads_bad = 'psgrad_requests_total{method="POST",route="/per-sample-grads",status="400"}'
    assert _sample(before, grads_ok) == 0 and _sample(after, grads_ok) == 1
    assert _sample(after, grads_bad) == 1
    assert _sample(after, "psgrad_samples_total") == _sample(before, "psgrad_samples_total") + 5
    for name in (
        "psgrad_batch_samples_count",
        "psgrad_batch_jobs_count",
        "psgrad_compute_seconds_count",
        "psgrad_queue_wait_seconds_count",
    ):
        assert _sample(after, name) == _sample(before, name) + 1, name
    assert "psgrad_queue_depth" in after
    assert _sample(after, "psgrad_cache_hits_total") + _sample(
        after, "psgrad_cache_misses_total"
    ) > _sample(before, "psgrad_cache_hits_total") + _sample(before, "psgrad_cache_misses_total")


async def test_openapi_documents_every_field_and_docs_work_offline() -> None:
    async with open_client() as c:
        spec = (await c.get("/openapi.json")).json()
        page = await c.get("/docs")
        asset = await c.get("/docs-assets/swagger-ui-bundle.js")
    schemas = spec["components"]["schemas"]
    for model in ("GradsRequest", "GradsResponse", "JobView", "ErrorBody", "ModelDoc"):
        assert model in schemas
    for name, prop in schemas["GradsRequest"]["properties"].items():
        assert prop.get("description"), f"GradsRequest.{name} has no description"
    assert set(schemas["GradsRequest"]["properties"]) == set(GradsRequest.model_fields)
    body = spec["paths"]["/per-sample-grads"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", SAFETENSORS}
    for path in (
        "/per-sample-grads",
        "/jobs",
        "/jobs/{job_id}",
        "/models",
        "/models/{model_id}",
        "/models/{model_id}/weights",
        "/healthz",
        "/readyz",
        "/metrics",
    ):
        assert path in spec["paths"], path
    assert page.status_code == 200 and "/docs-assets/swagger-ui-bundle.js" in page.text
    assert "cdn" not in page.text.lower()
    assert asset.status_code == 200 and len(asset.content) > 100_000


def test_streamed_safetensors_equal_the_reference_encoder() -> None:
    """The api streams views of the arrays; the file must be what safetensors itself writes."""
    from safetensors.numpy import save as st_save

    from psgrad._wire import safetensors_parts

    fields = {
        "model": "m@1",
        "batch_size": 3,
        "norms": rng.random(3).astype(np.float32),
        "grads": {"w": rng.random((3, 2, 2)), "b": np.zeros((3, 0), np.float32)},
        "td_errors": np.arange(3, dtype=">f4"),
        "flags": np.array([True, False]),
        "ids": np.arange(4, dtype=np.int64)[::2],
    }
    data = b"".join(safetensors_parts(fields, RESPONSE_KEY))
    ours, reference = (
        st_load(data),
        st_load(
            st_save(
                {
                    "norms": fields["norms"],
                    "grads/w": fields["grads"]["w"],
                    "grads/b": fields["grads"]["b"],
                    "td_errors": fields["td_errors"].astype("<f4"),
                    "flags": fields["flags"],
                    "ids": np.ascontiguousarray(fields["ids"]),
                }
            )
        ),
    )
    assert set(ours) == set(reference)
    for name, arr in reference.items():
        assert ours[name].dtype == arr.dtype and ours[name].shape == arr.shape, name
        np.testing.assert_array_equal(ours[name], arr, err_msg=name)
    decoded = fields_from_safetensors(data, RESPONSE_KEY)
    assert decoded["model"] == "m@1" and list(decoded["grads"]) == ["w", "b"]


def test_streamed_json_is_the_same_json() -> None:
    from service.api.body import json_chunks

    doc = {
        "model": "m@1",
        "norms": np.array([1.5, np.nan], np.float32),
        "grads": {"w": rng.random((2, 3, 4)).astype(np.float32), "b": np.zeros((2, 0))},
        "timing": {"queue_ms": 1.0},
        "result": {"mean": {"w": np.ones((3, 4))}},
    }
    text = b"".join(json_chunks(doc))
    expected = {
        "model": "m@1",
        "norms": [1.5, None],
        "grads": {"w": doc["grads"]["w"].tolist(), "b": [[], []]},  # type: ignore[index]
        "timing": {"queue_ms": 1.0},
        "result": {"mean": {"w": np.ones((3, 4)).tolist()}},
    }
    assert json.loads(text) == expected


def test_large_streamed_json_reads_back_as_tolist() -> None:
    from service.api.body import JSON_CHUNK, dumps, json_chunks

    big = rng.standard_normal((300, JSON_CHUNK // 1000)).astype(np.float32)  # > JSON_CHUNK bytes
    big[7, 3] = np.inf
    flat = rng.standard_normal(JSON_CHUNK // 2).astype(np.float32)
    doc = {
        "clipped_mean": {"w": big, "v": flat},
        "half": np.array([0.5, 1.5], np.float16),
        "strided": np.arange(6, dtype=np.int64)[::2],
        "meta": {"seed": 2**70},
    }
    pieces = list(json_chunks(doc))
    assert len(pieces) > 10  # streamed, not one piece
    got = json.loads(b"".join(pieces))
    expected_w = big.tolist()
    expected_w[7][3] = None
    assert got["clipped_mean"]["w"] == expected_w
    assert got["clipped_mean"]["v"] == flat.tolist()
    assert got["half"] == [0.5, 1.5] and got["strided"] == [0, 2, 4]
    assert got["meta"] == {"seed": 2**70}
    assert dumps({"x": float("nan"), 1: np.float32(0.5)}) == b'{"x":null,"1":0.5}'
