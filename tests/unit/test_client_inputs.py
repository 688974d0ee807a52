"""What a new user tries first: the URL positionally, and numpy's default float64 arrays.

The SDK sends floating arrays as float32 (every served model computes in float32, as the server
reads JSON lists) and leaves integer and boolean arrays alone, on the binary and the JSON path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import psgrad
from psgrad._wire import REQUEST_KEY, RESPONSE_KEY, fields_from_safetensors, fields_to_safetensors
from service.api import create_app
from tests.support.api import settings
from tests.support.client import running_app

MODEL = "value-mlp"  # 8 -> 64 -> 64 -> 1
OUTPUTS = ["grads", "losses", "norms", "mean", "dot"]
SAFETENSORS = "application/x-safetensors"


def recorder() -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport that records each request and answers as the server would, briefly."""
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/models":
            return httpx.Response(200, json={"models": []})
        if request.url.path == "/jobs":
            return httpx.Response(202, json={"job_id": "j1", "status": "queued"})
        body = fields_to_safetensors(
            {"model": "m@1", "batch_size": 1, "norms": np.ones(1, np.float32)}, RESPONSE_KEY
        )
        return httpx.Response(200, content=body, headers={"content-type": SAFETENSORS})

    return httpx.MockTransport(handler), seen


# ------------------------------------------------------------------ the URL


def test_the_sync_client_takes_the_url_positionally() -> None:
    transport, seen = recorder()
    with psgrad.Client("http://gpu-host:8000/", transport=transport) as client:
        assert client.base_url == "http://gpu-host:8000"
        assert client.models.list() == []
    assert str(seen[0].url) == "http://gpu-host:8000/models"
    with psgrad.Client(base_url="http://other:1") as client:
        assert client.base_url == "http://other:1"


async def test_the_async_client_takes_the_url_positionally() -> None:
    transport, seen = recorder()  # a MockTransport serves async clients too
    async with psgrad.AsyncClient("http://gpu-host:8000", transport=transport) as client:
        assert client.base_url == "http://gpu-host:8000"
        assert await client.models.list() == []
    assert str(seen[0].url) == "http://gpu-host:8000/models"
    async with psgrad.AsyncClient(base_url="http://other:1") as client:
        assert client.base_url == "http://other:1"


def test_without_a_url_the_environment_still_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSGRAD_URL", "http://from-env:9000")
    with psgrad.Client() as client, psgrad.Client(None) as none:
        assert client.base_url == none.base_url == "http://from-env:9000"


# ------------------------------------------------------------------ dtypes on the wire


def _sent(seen: list[httpx.Request]) -> dict[str, Any]:
    return fields_from_safetensors(seen[-1].content, REQUEST_KEY)


def test_floating_arrays_are_sent_as_float32_and_integers_stay_integers() -> None:
    transport, seen = recorder()
    x64 = np.linspace(-1, 1, 6).reshape(2, 3)
    with psgrad.Client("http://fake", transport=transport) as client:
        client.per_sample_grads(
            "m",
            x64,
            np.array([0, 2]),
            outputs=["norms"],
            weights={"w": np.ones(3), "b": np.zeros(1, np.float16)},
            reference={"w": np.ones(3, np.longdouble)},
        )
        sent = _sent(seen)
        assert sent["inputs"].dtype == np.float32 and sent["targets"].dtype == np.int64
        np.testing.assert_array_equal(sent["inputs"], x64.astype(np.float32))
        assert {a.dtype for a in (*sent["weights"].values(), sent["reference"]["w"])} == {
            np.dtype(np.float32)
        }
        client.td0("m", x64, np.ones(2), x64, dones=np.array([True, False]), gamma=0.5)
        sent = _sent(seen)
        assert sent["next_inputs"].dtype == sent["rewards"].dtype == np.float32
        assert sent["dones"].dtype == np.bool_
        client.per_sample_grads("tokens", np.array([[1, 2, 3]], np.int32), outputs=["norms"])
        assert _sent(seen)["inputs"].dtype == np.int32  # token ids are never made floats
        client.submit("m", np.ones((1, 3), np.float16), np.ones(1), loss="mse")
        assert _sent(seen)["inputs"].dtype == _sent(seen)["targets"].dtype == np.float32


def test_the_json_path_casts_the_same_way() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json={"model": "m@1", "batch_size": 1, "norms": [1.0]})

    with psgrad.Client(
        "http://fake", transport=httpx.MockTransport(handler), binary=False
    ) as client:
        client.per_sample_grads("m", np.ones((1, 3)), np.array([1]), outputs=["norms"])
    assert bodies[0]["inputs"]["dtype"] == "float32" and bodies[0]["targets"]["dtype"] == "int64"


def test_torch_float64_and_bfloat16_tensors_are_sent_as_float32() -> None:
    torch = pytest.importorskip("torch")
    transport, seen = recorder()
    with psgrad.Client("http://fake", transport=transport) as client:
        for dtype in (torch.float64, torch.bfloat16, torch.float16):
            client.per_sample_grads("m", torch.ones(1, 3, dtype=dtype), outputs=["norms"])
            assert _sent(seen)["inputs"].dtype == np.float32, dtype
        client.per_sample_grads("m", torch.ones(1, 3), torch.tensor([4]), outputs=["norms"])
        assert _sent(seen)["targets"].dtype == np.int64


# ------------------------------------------------------------------ the real app


@pytest.fixture(scope="module")
def transport() -> Iterator[httpx.BaseTransport]:
    with running_app(create_app(settings(batch_max_delay_ms=0.0))) as t:
        yield t


def _batch() -> dict[str, Any]:
    rng = np.random.default_rng(3)
    return {
        "inputs": rng.normal(size=(6, 8)),  # numpy's default float64, as a new user has them
        "targets": rng.normal(size=6),
    }


def _assert_equal(got: psgrad.GradsResult, want: psgrad.GradsResult) -> None:
    assert list(got.outputs) == list(want.outputs)
    for name in want.outputs:
        a, b = got[name], want[name]
        for key in a if isinstance(a, dict) else [None]:
            x, y = (a[key], b[key]) if key is not None else (a, b)
            assert x.dtype == y.dtype == np.float32, name
            np.testing.assert_array_equal(x, y, err_msg=f"{name} {key}")


def test_float64_through_the_binary_path_equals_float32(transport: httpx.BaseTransport) -> None:
    b = _batch()
    with psgrad.Client("http://app", transport=transport) as client:
        weights = client.models.download_weights(MODEL)
        w64 = {k: v.astype(np.float64) + 0.01 for k, v in weights.items()}
        opts: dict[str, Any] = {"loss": "mse", "outputs": OUTPUTS}
        got = client.per_sample_grads(
            MODEL, b["inputs"], b["targets"], weights=w64, reference=w64, **opts
        )
        w32 = {k: v.astype(np.float32) for k, v in w64.items()}
        want = client.per_sample_grads(
            MODEL,
            b["inputs"].astype(np.float32),
            b["targets"].astype(np.float32),
            weights=w32,
            reference=w32,
            **opts,
        )
        _assert_equal(got, want)
        half = client.per_sample_grads(MODEL, b["inputs"].astype(np.float16), b["targets"],
                                       loss="mse", outputs=["norms"])
        assert half.norms.shape == (6,)
        labels = np.array([3, 1])  # int64 class targets stay integers: cross-entropy accepts them
        digits = client.per_sample_grads("mlp", np.zeros((2, 784)), labels, outputs=["norms"])
        assert digits.norms.shape == (2,)
        job = client.submit(MODEL, b["inputs"], b["targets"], loss="mse", outputs=["norms"])
        np.testing.assert_allclose(
            job.result(timeout=60).norms,
            client.per_sample_grads(MODEL, b["inputs"], b["targets"], loss="mse",
                                    outputs=["norms"]).norms,
            rtol=1e-6,
        )


async def test_float64_through_the_async_client_equals_float32() -> None:
    app = create_app(settings(batch_max_delay_ms=0.0))
    b = _batch()
    async with (
        app.router.lifespan_context(app),
        psgrad.AsyncClient("http://app", transport=httpx.ASGITransport(app=app)) as client,
    ):
        got = await client.per_sample_grads(MODEL, b["inputs"], b["targets"], loss="mse",
                                            outputs=OUTPUTS[:3])
        want = await client.per_sample_grads(
            MODEL, b["inputs"].astype(np.float32), b["targets"].astype(np.float32), loss="mse",
            outputs=OUTPUTS[:3],
        )
    _assert_equal(got, want)
