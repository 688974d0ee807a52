"""Every refusal of the api is the JSON error body with the right status, never a traceback."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI

import psgrad
from service import engine
from service.api.deps import AdminKey
from tests.support.api import (
    SAFETENSORS,
    TD0,
    app_of,
    finished_job,
    open_client,
    safetensors_body,
)

JSON_CT = {"content-type": "application/json"}


def _error(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message", "details"}
    assert "Traceback" not in r.text and 'File "' not in r.text
    if code is not None:
        assert body["error"]["code"] == code, body
    err: dict[str, Any] = body["error"]
    return err


def _b64(dtype: str, shape: list[int], data: bytes) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data": base64.b64encode(data).decode()}


BAD_JSON_BODIES: list[tuple[str, bytes | dict[str, Any], int, str]] = [
    ("malformed json", b'{"model": "mlp", "inputs": [1, 2', 400, "bad_request"),
    ("not an object", b"[1, 2, 3]", 400, "bad_request"),
    ("invalid utf-8", b'{"model": "\xff"}', 400, "bad_request"),
    ("deep nesting", b"[" * 100_000 + b"]" * 100_000, 400, "bad_request"),
    (
        "bad base64",
        {**TD0, "inputs": {"dtype": "float32", "shape": [1, 3], "data": "@@@"}},
        400,
        "bad_request",
    ),
    (
        "shape vs data length",
        {**TD0, "inputs": _b64("float32", [1, 3], b"\0" * 8)},
        400,
        "bad_request",
    ),
    (
        "absurd declared shape",
        {**TD0, "inputs": _b64("float32", [10**9, 10**9, 10**9], b"\0" * 12)},
        413,
        "too_large",
    ),
    (
        "unknown dtype",
        {**TD0, "inputs": _b64("complex128", [1, 3], b"\0" * 48)},
        400,
        "bad_request",
    ),
    ("ragged lists", {**TD0, "inputs": [[1.0, 2.0, 3.0], [1.0, 2.0]]}, 400, "bad_request"),
    ("ragged depth", {**TD0, "inputs": [[1.0, 2.0, 3.0], 4.0]}, 400, "bad_request"),
    ("strings in a tensor", {**TD0, "inputs": [["a", "b", "c"]]}, 400, "bad_request"),
    ("unknown field", {**TD0, "inptus": [[1.0]]}, 400, "bad_request"),
    ("missing model", {"inputs": [[1.0, 2.0, 3.0]]}, 400, "bad_request"),
    ("unknown model", {**TD0, "model": "resnet-9000"}, 404, "unknown_model"),
    ("shape mismatch", {**TD0, "inputs": [[1.0, 2.0]]}, 422, "shape_mismatch"),
    ("unknown loss", {**TD0, "loss": "hinge"}, 422, "unknown_loss"),
    ("unknown output", {**TD0, "outputs": ["hessian"]}, 422, "unknown_output"),
    ("unknown parameter", {**TD0, "params": ["nope"]}, 422, "unknown_parameter"),
    (
        "non-finite",
        {
            **TD0,
            "inputs": {
                "dtype": "float32",
                "shape": [1, 3],
                "data": base64.b64encode(np.array([[np.nan, 1, 2]], np.float32).tobytes()).decode(),
            },
        },
        422,
        "non_finite",
    ),
    (
        "empty batch",
        {
            **TD0,
            "inputs": _b64("float32", [0, 3], b""),
            "next_inputs": _b64("float32", [0, 3], b""),
            "rewards": [],
        },
        422,
        "empty_batch",
    ),
    (
        "target out of range",
        {
            "model": "simple-cnn",
            "inputs": np.zeros((1, 1, 28, 28)).tolist(),
            "targets": [10],
            "outputs": ["norms"],
        },
        422,
        "target_out_of_range",
    ),
]


# refused at once by POST /jobs too: enums in the OpenAPI document, and a model that does not
# exist (the registry is asked before queueing)
AT_ONCE = ("unknown_loss", "unknown_output", "unknown_model")


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [c[1:] for c in BAD_JSON_BODIES],
    ids=[c[0] for c in BAD_JSON_BODIES],
)
async def test_bad_json_requests(body: bytes | dict[str, Any], status: int, code: str) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with open_client() as c:
        for path in ("/per-sample-grads", "/jobs"):
            r = await c.post(path, content=content, headers=JSON_CT)
            # found by the worker, the job fails; what AT_ONCE names is refused at once
            if path == "/jobs" and status in (404, 422) and code not in AT_ONCE:
                assert r.status_code == 202
                job = await finished_job(c, r.json()["job_id"])
                assert job["status"] == "failed" and job["error"]["code"] == code
                continue
            _error(r, status, code)


def _st_header(header: Any, data: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


BAD_SAFETENSORS: list[tuple[str, bytes]] = [
    ("too short", b"\x01\x02"),
    ("header length past the body", struct.pack("<Q", 1000) + b"{}"),
    ("oversized header", struct.pack("<Q", 2**40) + b"{}"),
    ("header not json", struct.pack("<Q", 4) + b"nope"),
    (
        "offsets past the data",
        _st_header({"inputs": {"dtype": "F32", "shape": [1, 3], "data_offsets": [0, 12]}}),
    ),
    (
        "unknown dtype",
        _st_header({"inputs": {"dtype": "Q99", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    ),
    ("metadata not json", _st_header({"__metadata__": {"request": "{nope"}})),
    ("metadata not an object", _st_header({"__metadata__": {"request": "[1]"}})),
    ("a pickle", b"\x80\x04\x95" + b"\0" * 40),
    ("header not an object", _st_header([1, 2, 3])),
    ("entry not an object", _st_header({"targets": 5})),
    ("float8", _st_header({"inputs": {"dtype": "F8_E4M3", "shape": [1], "data_offsets": [0, 1]}},
                          b"\0")),
    ("complex", _st_header({"inputs": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}},
                           b"\0" * 8)),
]
BAD_SAFETENSORS_SAID = {  # what the 400 says, where a reader would otherwise see Python's words
    "header not an object": "its header is not a JSON object",
    "entry not an object": "tensor 'targets' is not described by an object",
    "float8": "tensor 'inputs' has dtype 'F8_E4M3'; psgrad reads F64, F32",
    "complex": "tensor 'inputs' has dtype 'C64'",
    "unknown dtype": "tensor 'inputs' has dtype 'Q99'",
}


@pytest.mark.parametrize("case, body", BAD_SAFETENSORS, ids=[c[0] for c in BAD_SAFETENSORS])
async def test_bad_safetensors_requests(case: str, body: bytes) -> None:
    async with open_client() as c:
        r = await c.post("/per-sample-grads", content=body, headers={"content-type": SAFETENSORS})
    message = _error(r, 400, "bad_request")["message"]
    assert BAD_SAFETENSORS_SAID.get(case, "") in message, message


def _with_tensors(doc: dict[str, Any], **tensors: np.ndarray) -> bytes:
    """A safetensors body of ``doc`` (tensors as tensors, the rest in its metadata) with
    ``tensors`` added as tensors ('a__b' names the tensor 'a/b')."""
    from safetensors.numpy import load, save

    loaded = load(safetensors_body(doc))
    fields = _metadata(safetensors_body(doc))
    loaded.update({k.replace("__", "/"): v for k, v in tensors.items()})
    return save(loaded, metadata={"request": json.dumps(fields)})


def _metadata(body: bytes) -> dict[str, Any]:
    (size,) = struct.unpack("<Q", body[:8])
    meta: dict[str, Any] = json.loads(json.loads(body[8:8 + size])["__metadata__"]["request"])
    return meta


@pytest.mark.parametrize("path, doc, tensors, word", [
    ("/per-sample-grads", {"model": "mlp"}, {"outputs": np.array([1, 2])}, "'outputs' is not"),
    ("/jobs", {}, {"model": np.array([1, 2])}, "'model' is not a tensor"),
    ("/per-sample-grads", {}, {"seed": np.array(3)}, "'seed' is not a tensor"),
    ("/per-sample-grads", {}, {"clip_norm": np.array(1.0, np.float32)}, "'clip_norm' is not"),
    ("/per-sample-grads", {}, {"targets__x": np.array([1.0])}, "'targets' is one tensor, not"),
    ("/stores/s/query", {"model": None}, {"score": np.array([1, 2])}, "'score' is not a"),
    ("/stores/s/rows", {"model": None, "inputs": None, "targets": None, "outputs": None},
     {"rows__x": np.zeros((2, 8), np.float32), "ids": np.array([1, 2])}, "'rows' is one tensor"),
])
async def test_a_tensor_under_a_field_taken_as_json_is_refused_naming_it(
        path: str, doc: dict[str, Any], tensors: dict[str, np.ndarray], word: str) -> None:
    """A safetensors body's tensor under a field that is no tensor (it goes as JSON in the
    metadata) or under a tensor's name as a group is a 400 naming the tensor and the form to
    send, whatever its shape or dtype (a 0-d tensor for a scalar option is refused alike)."""
    mlp = {"model": "mlp", "inputs": [[0.1] * 784] * 2, "targets": [1, 2], "outputs": ["norms"]}
    named = {t.split("__")[0] for t in tensors}
    sent = {k: v for k, v in {**mlp, **doc}.items() if v is not None and k not in named}
    async with open_client() as c:
        r = await c.put("/stores/s", json={"model": "mlp", "projection_dim": 8})
        assert r.status_code in (200, 201), r.text  # made, or made before alike
        r = await c.post(path, content=_with_tensors(sent, **tensors),
                         headers={"content-type": SAFETENSORS})
        err = _error(r, 400, "bad_request")
        name = next(iter(tensors)).replace("__", "/")
        assert f"tensor '{name}'" in err["message"] and word in err["message"], err
        assert (await c.post("/per-sample-grads", json=mlp)).status_code == 200


async def test_wrong_content_type_unknown_route_and_method() -> None:
    async with open_client() as c:
        for ctype in ("text/plain", "application/x-www-form-urlencoded", ""):
            r = await c.post(
                "/per-sample-grads",
                content=b"model=mlp",
                headers={"content-type": ctype} if ctype else {},
            )
            err = _error(r, 415, "unsupported_media_type")
            assert "Content-Type" in err["message"] and "application/json" in err["message"]
        _error(await c.get("/no/such/route"), 404, "not_found")
        _error(await c.put("/healthz"), 405, "method_not_allowed")


async def test_an_unknown_query_parameter_is_refused_naming_it_and_the_known_ones() -> None:
    async with open_client() as c:
        err = _error(await c.get("/stores", params={"tennant": "x"}), 422, "invalid_input")
        assert "'tennant'" in err["message"] and "takes: tenant" in err["message"]
        assert err["details"] == {"unknown": ["tennant"], "accepted": ["tenant"]}
        err = _error(await c.post("/per-sample-grads?debug=1", json=TD0), 422, "invalid_input")
        assert "'debug'" in err["message"] and "takes: none" in err["message"]
        assert (await c.get("/stores", params={"tenant": "default"})).status_code == 200
        assert (await c.get("/readyz", params={"need_worker": "false"})).status_code == 200
        # the status page's script reads ?key= from the address bar: the route declares it
        assert (await c.get("/status", params={"key": "k"})).status_code == 200
        # a declared parameter's refusal follows the body's rule, in the same words: a value of
        # the wrong type is 400, one out of its range 422, each naming the parameter
        err = _error(await c.get("/readyz", params={"need_worker": "maybe"}), 400, "bad_request")
        assert err["message"].startswith("the query is invalid: 'need_worker' ") \
            and "got 'maybe'" in err["message"], err
        err = _error(await c.put("/models/m", params={"warmup": "4" * 401}, content=b"x"), 422,
                     "invalid_input")
        assert err["message"].startswith("the query is invalid: 'warmup' "), err
        doc = (await c.get("/openapi.json")).json()
        for path, item in doc["paths"].items():  # the rule is stated on every operation
            for method, operation in item.items():
                assert "422" in operation["responses"], (method, path)


async def test_body_too_large_is_refused_before_and_while_reading() -> None:
    async with open_client(max_body_bytes=1000) as c:
        big = json.dumps({**TD0, "pad": "x" * 2000}).encode()
        err = _error(
            await c.post("/per-sample-grads", content=big, headers=JSON_CT), 413, "too_large"
        )
        assert err["details"]["limit"] == 1000 and "1000" in err["message"]

        async def stream() -> AsyncIterator[bytes]:  # no Content-Length: counted while reading
            for _ in range(100):
                yield b" " * 100

        r = await c.post("/per-sample-grads", content=stream(), headers=JSON_CT)
        assert "content-length" not in r.request.headers
        _error(r, 413, "too_large")
        ok = await c.post("/per-sample-grads", json=TD0)
        assert ok.status_code == 200


async def test_gamma_outside_0_1_is_422_in_both_wire_forms() -> None:
    async with open_client() as c:
        for gamma in (-3, 7.5, 1e30, float("nan")):
            doc = {**TD0, "gamma": gamma}
            body = json.dumps(doc).encode()  # NaN as JSON's common extension, as Python writes it
            err = _error(
                await c.post("/per-sample-grads", content=body, headers=JSON_CT),
                422,
                "invalid_input",
            )
            assert "'gamma'" in err["message"] and "[0, 1]" in err["message"]
            st = await c.post(
                "/per-sample-grads",
                content=safetensors_body(doc),
                headers={"content-type": SAFETENSORS},
            )
            _error(st, 422, "invalid_input")


@pytest.mark.parametrize("extra, status, code, word", [
    ({"outputs": ["clipped_mean"]}, 422, "invalid_input", "'clip_norm'"),
    ({"outputs": ["norms"], "clip_norm": 0}, 422, "invalid_input", "'clip_norm' must be > 0"),
    ({"noise_multiplier": float("inf")}, 422, "invalid_input",
     "'noise_multiplier' must be a finite number >= 0; got inf"),
    ({"noise_multiplier": "1"}, 400, "bad_request", "'noise_multiplier' must be a finite number"),
    ({"gamma": 10**400}, 422, "invalid_input", "'gamma' must be a finite number in [0, 1]"),
    ({"seed": 1.5}, 400, "bad_request", "'seed' must be an integer"),
    ({"seed": 2**70}, 422, "invalid_input", "'seed' must be an integer in [0, 2**63); "
     "got 1180591620717411303424"),  # orjson reads it as a float
    ({"outputs": ["norms", "nrms"]}, 422, "unknown_output", "nrms"),
    ({"outputs": [3]}, 400, "bad_request", "'outputs'"),
    ({"loss": "l7"}, 422, "unknown_loss", "l7"),
    ({"params": []}, 400, "bad_request", "'params'"),
    ({"answer_dtype": "int8"}, 422, "invalid_input", "float16"),
    ({"reference_set": "refs"}, 422, "invalid_input", "'reference_set' is read by output"),
    ({"reference_sketches": [[1.0]]}, 422, "invalid_input", "'reference_sketches' is read"),
])
async def test_jobs_refuses_at_once_what_the_contract_refuses(
        extra: dict[str, Any], status: int, code: str, word: str) -> None:
    """A field's type, range or choices, a loss or output that does not exist, and
    'clipped_mean' without 'clip_norm' are the door's: ``POST /jobs`` answers them at once,
    as ``POST /per-sample-grads`` does, in both wire forms."""
    doc = {**TD0, "loss": "td0", **extra}
    async with open_client() as c:
        for route in ("/per-sample-grads", "/jobs"):
            body = json.dumps(doc).encode()  # inf as JSON's common extension, as Python writes it
            err = _error(await c.post(route, content=body, headers=JSON_CT), status, code)
            assert word in err["message"], err
            st = await c.post(route, content=safetensors_body(doc),
                              headers={"content-type": SAFETENSORS})
            assert _error(st, status, code)["message"] == err["message"]


async def test_gamma_0_and_1_are_accepted() -> None:
    async with open_client() as c:
        for gamma, td_error in ((0.0, 2.0), (1.0, 1.8), (0, 2.0), (1, 1.8)):
            r = await c.post("/per-sample-grads", json={**TD0, "gamma": gamma,
                                                        "outputs": ["td_errors"]})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["td_errors"], [td_error], rtol=1e-6)

async def test_batch_too_large() -> None:
    doc = {
        **TD0,
        "inputs": [[1.0, 2.0, 3.0]] * 3,
        "next_inputs": [[0.0, 0.0, 0.0]] * 3,
        "rewards": [1.0] * 3,
    }
    async with open_client(max_batch_size=2) as c:
        err = _error(await c.post("/per-sample-grads", json=doc), 413, "too_large")
        assert err["details"] == {"limit": 2, "size": 3}
        st = await c.post(
            "/per-sample-grads",
            content=safetensors_body(doc),
            headers={"content-type": SAFETENSORS},
        )
        _error(st, 413, "too_large")


async def test_result_too_large_names_the_limit_and_the_way_out() -> None:
    doc = {
        "model": "value-mlp",
        "loss": "mse",
        "inputs": np.zeros((4, 8)).tolist(),
        "targets": [0.0] * 4,
    }
    size = 4 * (8 * 64 + 64 + 64 * 64 + 64 + 64 + 1) * 4
    async with open_client(max_result_bytes=size - 1) as c:
        err = _error(
            await c.post("/per-sample-grads", json={**doc, "outputs": ["grads"]}), 413, "too_large"
        )
        assert err["details"] == {"limit": size - 1, "size": size}
        assert str(size - 1) in err["message"] and "summary outputs" in err["message"]
        assert "smaller batches" in err["message"]
        ok = await c.post("/per-sample-grads", json={**doc, "outputs": ["norms", "mean"]})
        assert ok.status_code == 200


async def test_deadline_gives_504_and_cancels_the_job() -> None:
    async with open_client(workers=0, request_timeout_s=0.3) as c:  # nobody computes
        err = _error(await c.post("/per-sample-grads", json=TD0), 504, "deadline_exceeded")
        assert "0.3" in err["message"]
        assert await app_of(c).state.psgrad.broker.queue_depth() == 0


async def test_deadline_passed_in_the_queue_fails_the_job() -> None:
    async with open_client(job_timeout_s=1e-9) as c:
        job = (await c.post("/jobs", json=TD0)).json()["job_id"]
        body = await finished_job(c, job)
    assert body["status"] == "failed" and body["error"]["code"] == "deadline_exceeded"


@pytest.mark.parametrize("key, said", [("k" * 129, "should have at most 128 characters"),
                                       ("two\tkeys", "should match pattern")])
async def test_a_malformed_idempotency_key_is_refused_naming_the_header(
        key: str, said: str) -> None:
    async with open_client() as c:
        r = await c.post("/jobs", json=TD0, headers={"Idempotency-Key": key})
    err = _error(r, 422, "invalid_input")
    assert err["message"].startswith(f"a header is invalid: 'Idempotency-Key' {said}"), err


async def test_two_idempotency_keys_are_refused() -> None:
    """Two Idempotency-Key headers name two requests: a 400, nothing queued (the first was
    taken silently, though the docs say one per request)."""
    async with open_client() as c:
        r = await c.post("/jobs", json=TD0, headers=[("Idempotency-Key", "a"),
                                                     ("Idempotency-Key", "b")])
        err = _error(r, 400, "bad_request")
        assert err["message"] == ("the request has 2 Idempotency-Key headers: send one, your "
                                  "name for this request")
        r = await c.post("/jobs", json=TD0, headers={"Idempotency-Key": "a"})
        assert r.status_code == 202, r.text


async def test_a_compressed_body_is_a_415_naming_its_encoding() -> None:
    """A body sent with Content-Encoding gzip was read as it is: a 400 "the body is not
    valid JSON: 'utf-8' codec can't decode byte 0x8b"."""
    import gzip

    async with open_client() as c:
        r = await c.post("/jobs", content=gzip.compress(json.dumps(TD0).encode()), headers={
            "content-type": "application/json", "content-encoding": "gzip"})
        err = _error(r, 415, "unsupported_media_type")
        assert err["message"] == ("the body is sent with Content-Encoding gzip, which the "
                                  "server does not take: send it uncompressed")
        r = await c.post("/jobs", json=TD0, headers={"content-encoding": "identity"})
        assert r.status_code == 202, r.text


async def test_queue_full_gives_503_with_retry_after() -> None:
    async with open_client(workers=0, max_queue_depth=1) as c:
        assert (await c.post("/jobs", json=TD0)).status_code == 202
        r = await c.post("/per-sample-grads", json=TD0)
        err = _error(r, 503, "overloaded")
        assert r.headers["retry-after"] == "1" and err["details"]["retry_after"] == 1.0
        _error(await c.post("/jobs", json=TD0), 503, "overloaded")


async def test_api_and_admin_keys() -> None:
    async with open_client(api_keys="key-one, key-two", admin_keys="admin-key") as c:
        app: FastAPI = app_of(c)
        app.add_api_route("/admin-probe", lambda: {"ok": True}, dependencies=[AdminKey])
        r = await c.get("/models/linear-value")
        _error(r, 401, "unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
        _error(await c.post("/per-sample-grads", json=TD0), 401, "unauthorized")
        bad = {"authorization": "Bearer key-on"}
        _error(await c.get("/models/linear-value", headers=bad), 401, "unauthorized")
        _error(await c.get("/models", headers={"authorization": "Basic a2V5LW9uZQ=="}), 401)
        for key in ("key-one", "key-two", "admin-key"):
            auth = {"authorization": f"Bearer {key}"}
            assert (await c.get("/models/linear-value", headers=auth)).status_code == 200
        r = await c.post("/per-sample-grads", json=TD0, headers={"authorization": "Bearer key-two"})
        assert r.status_code == 200
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json", "/docs"):
            assert (await c.get(path)).status_code == 200, path
        _error(await c.get("/admin-probe"), 401, "unauthorized")
        _error(
            await c.get("/admin-probe", headers={"authorization": "Bearer key-one"}),
            403,
            "forbidden",
        )
        ok = await c.get("/admin-probe", headers={"authorization": "Bearer admin-key"})
        assert ok.json() == {"ok": True}
    async with open_client(api_keys="key-one") as c:  # no admin key configured: nobody is admin
        app_of(c).add_api_route("/admin-probe", lambda: {"ok": True}, dependencies=[AdminKey])
        r = await c.get("/admin-probe", headers={"authorization": "Bearer key-one"})
        assert "PSGRAD_ADMIN_KEYS" in _error(r, 403, "forbidden")["message"]
    async with open_client() as c:  # no keys at all: everyone is let in
        app_of(c).add_api_route("/admin-probe", lambda: {"ok": True}, dependencies=[AdminKey])
        assert (await c.get("/admin-probe")).status_code == 200


async def test_unexpected_errors_are_logged_not_shown(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(*_a: Any, **_k: Any) -> Any:
        raise RuntimeError("secret internals /home/x/service/engine.py line 12")

    async with open_client() as c:
        monkeypatch.setattr(engine, "compute", broken)
        err = _error(await c.post("/per-sample-grads", json=TD0), 500, "internal_error")
        assert "secret" not in err["message"] and "engine.py" not in err["message"]
        monkeypatch.setattr(app_of(c).state.psgrad.registry, "ids", broken)
        r = await c.get("/models", headers={"X-Request-ID": "trace-7"})
        err = _error(r, 500, "internal_error")  # escapes every handler: the middleware answers
        assert r.headers["x-request-id"] == "trace-7" and "trace-7" in err["message"]
        assert r.headers["psgrad-version"] == psgrad.__version__
        logged = [rec for rec in caplog.records if "trace-7" in rec.getMessage()]
        assert logged and logged[0].exc_info is not None  # the traceback is in the log
        monkeypatch.setattr(app_of(c).state.psgrad.registry, "describe", broken)
        err = _error(await c.get("/models/linear-value"), 500, "internal_error")
        assert "secret" not in json.dumps(err)
        monkeypatch.undo()
        assert (await c.post("/per-sample-grads", json=TD0)).status_code == 200


async def test_a_bad_job_never_disturbs_the_others() -> None:
    good = {**TD0, "outputs": ["updates"]}
    async with open_client(batch_max_delay_ms=50) as c:
        answers = await asyncio.gather(
            *[
                c.post("/per-sample-grads", json=doc)
                for doc in [
                    good,
                    {**TD0, "inputs": [[1.0, 2.0]]},
                    good,
                    {**TD0, "rewards": [1.0, 2.0]},
                    good,
                    {**TD0, "weights": {"theta": [1.0, 2.0]}},
                ]
            ]
        )
    statuses = [r.status_code for r in answers]
    assert statuses == [200, 422, 200, 422, 200, 422]
    for r in answers[::2]:
        np.testing.assert_allclose(r.json()["updates"]["theta"], [[3.6, 1.8, -3.6]], rtol=1e-5)


async def test_every_answer_carries_a_request_id_and_the_version() -> None:
    async with open_client() as c:
        answers = [
            await c.post("/per-sample-grads", json=TD0),
            await c.post("/per-sample-grads", json={**TD0, "loss": "hinge"}),
            await c.get("/no/such/route"),
            await c.get("/healthz"),
            await c.get("/openapi.json"),
            await c.put("/healthz"),
        ]
        assert [r.headers.get_list("psgrad-version") for r in answers] == \
            [[psgrad.__version__]] * len(answers)
        doc = answers[4].json()  # and the document says so of every response
        assert doc["info"]["version"] == psgrad.__version__
        stated = [set(response["headers"]) >= {"psgrad-version", "X-Request-ID"}
                  for item in doc["paths"].values() for operation in item.values()
                  for response in operation["responses"].values()]
        assert len(stated) > 20 and all(stated)
        ids = [r.headers["x-request-id"] for r in answers]
        assert len(set(ids)) == len(ids) and all(len(i) == 32 for i in ids), ids
        mine = await c.get("/healthz", headers={"X-Request-ID": "client-1.a_b:c"})
        assert mine.headers["x-request-id"] == "client-1.a_b:c"
        for odd in ("two words", "x" * 129, "<script>"):  # not echoed: a fresh id instead
            r = await c.get("/healthz", headers={"X-Request-ID": odd})
            assert r.headers["x-request-id"] != odd and len(r.headers["x-request-id"]) == 32


DP_RUN = {"model": "mlp", "clip_norm": 1.0, "noise_multiplier": 2.0, "expected_batch_size": 8,
          "dataset_size": 200, "delta": 1e-5, "max_epsilon": 0.45}


async def test_a_dp_run_takes_numbers_as_the_gradients_request_does() -> None:
    """An integer where a number goes, and a whole float where an integer goes."""
    async with open_client() as c:
        r = await c.post("/dp-runs", json={**DP_RUN, "clip_norm": 1, "dataset_size": 200.0,
                                           "steps": 10.0})
    assert r.status_code == 201, r.text
    assert r.json()["clip_norm"] == 1.0 and r.json()["max_steps"] >= 1


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-safetensors"])
async def test_a_body_fastapi_parses_in_another_media_type_is_415(ctype: str | None) -> None:
    async with open_client() as c:
        err = _error(await c.post("/dp-runs", content=json.dumps(DP_RUN).encode(),
                                  headers={"content-type": ctype} if ctype else {}),
                     415, "unsupported_media_type")
        assert (await c.post("/dp-runs", content=json.dumps(DP_RUN).encode(), headers={
            "content-type": "application/json; charset=utf-8"})).status_code == 201
    assert err["message"] == (f"unsupported Content-Type {ctype or '(none)'!r}: send "
                              "application/json")


@pytest.mark.parametrize("ctype", [None, "text/plain", "application/x-safetensors"])
@pytest.mark.parametrize("method, path, doc, status", [
    ("PUT", "/stores/s", {"model": "mlp", "projection_dim": 8}, 201),
    ("POST", "/stores/s/lookup", {"ids": [1]}, 200),
])
async def test_a_json_only_body_in_another_media_type_is_415(
        ctype: str | None, method: str, path: str, doc: dict[str, Any], status: int,
        tmp_path: Path) -> None:
    """A store's definition and a lookup are JSON only: another media type (or none) is a
    415 naming JSON, and nothing is made; sent as JSON, the same bytes are answered."""
    raw = json.dumps(doc).encode()
    async with open_client(data_dir=str(tmp_path)) as c:
        err = _error(await c.request(method, path, content=raw,
                                     headers={"content-type": ctype} if ctype else {}),
                     415, "unsupported_media_type")
        assert (await c.get("/stores")).json()["stores"] == []
        if method == "POST":
            await c.put("/stores/s", json={"model": "mlp", "projection_dim": 8})
        assert (await c.request(method, path, content=raw, headers={
            "content-type": "application/json; charset=utf-8"})).status_code == status
    assert err["message"] == (f"unsupported Content-Type {ctype or '(none)'!r}: send "
                              "application/json")


@pytest.mark.parametrize("content, status, code, words", [
    (b"{nope", 400, "bad_request", ["the body is not valid JSON"]),
    (b"[1, 2]", 400, "bad_request", ["the body must be a JSON object"]),
    ({k: v for k, v in DP_RUN.items() if k != "delta"}, 400, "bad_request",
     ["'delta' is required"]),
    ({**DP_RUN, "epsilon": 1.0}, 400, "bad_request",
     ["'epsilon' is not a field of this body", "clip_norm, dataset_size, delta"]),
    ({**DP_RUN, "clip_norm": "abc"}, 400, "bad_request", ["'clip_norm' should be a valid number",
                                                          "got 'abc'"]),
    ({**DP_RUN, "steps": 1.5}, 400, "bad_request", ["'steps'", "got 1.5"]),
    ({**DP_RUN, "clip_norm": "1"}, 400, "bad_request", ["'clip_norm' should be a valid number",
                                                       "got '1'"]),
    ({**DP_RUN, "delta": True}, 400, "bad_request", ["'delta' should be a valid number"]),
    ({**DP_RUN, "steps": "10"}, 400, "bad_request", ["'steps' should be a valid integer"]),
    ({**DP_RUN, "model": ""}, 422, "invalid_input", ["'model' should have at least 1 character"]),
    ({**DP_RUN, "delta": 2.0}, 422, "invalid_input", ["'delta' should be less than 1", "got 2.0"]),
    ({**DP_RUN, "accountant": "gdp"}, 422, "invalid_input", ["'accountant'", "got 'gdp'"]),
    ({**DP_RUN, "delta": 2.0, "epsilon": 1.0}, 400, "bad_request", ["'delta'", "'epsilon'"]),
])
async def test_a_body_fastapi_parses_is_refused_by_the_contracts_rule(
        content: bytes | dict[str, Any], status: int, code: str, words: list[str]) -> None:
    """``POST /dp-runs``'s body is parsed by FastAPI, yet refused as the gradients request is:
    400 for a body that cannot be read, a field missing, unknown or of the wrong type; 422 for
    a value out of its range or choices (a body with both: 400); each field named, with what
    was sent."""
    raw = content if isinstance(content, bytes) else json.dumps(content).encode()
    async with open_client() as c:
        err = _error(await c.post("/dp-runs", content=raw, headers=JSON_CT), status, code)
        assert (await c.get("/dp-runs")).json()["runs"] == []
    for word in words:
        assert word in err["message"], err
