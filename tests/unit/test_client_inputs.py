"""What a new user tries first: the URL positionally, and numpy's default float64 arrays.

A floating array in a dtype other than float32 is cast to the dtype the model computes in (asked
of ``GET /models/{id}`` once per model); integer and boolean arrays are never cast; on the binary
and the JSON path alike.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import psgrad
from psgrad._arrays import bfloat16_values
from psgrad._wire import REQUEST_KEY, RESPONSE_KEY, fields_from_safetensors, fields_to_safetensors
from service.api import create_app
from tests.support.api import settings
from tests.support.client import running_app

MODEL = "value-mlp"  # 8 -> 64 -> 64 -> 1
OUTPUTS = ["grads", "losses", "norms", "mean", "dot"]
SAFETENSORS = "application/x-safetensors"


def recorder(dtypes: dict[str, str] | None = None
             ) -> tuple[httpx.MockTransport, list[httpx.Request]]:
    """A transport that records each request and answers as the server would, briefly; the
    model ``m`` computes in float32, others in ``dtypes[model]`` (a float16 or bfloat16 model
    refuses a float32 array it cannot hold, as the server does; ``refuses`` every dtype)."""
    seen: list[httpx.Request] = []
    dtypes = {"m": "float32", "refuses": "float32", **(dtypes or {})}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        path = request.url.path
        if path == "/models":
            return httpx.Response(200, json={"models": []})
        if path.startswith("/models/"):
            model = path.removeprefix("/models/")
            return httpx.Response(200, json={"id": model, "parameters": {
                "w": {"shape": [3], "dtype": dtypes[model]}}})
        if path == "/jobs":
            return httpx.Response(202, json={"job_id": "j1", "status": "queued"})
        binary = request.headers.get("content-type") == SAFETENSORS
        sent = fields_from_safetensors(request.content, REQUEST_KEY) if binary else {}
        if _refuses(sent, dtypes.get(str(sent.get("model")), "")):
            return httpx.Response(422, json={"error": {
                "code": "dtype_mismatch", "message": "round them first", "details": {}}})
        body = fields_to_safetensors(
            {"model": "m@1", "batch_size": 1, "norms": np.ones(1, np.float32)}, RESPONSE_KEY
        )
        return httpx.Response(200, content=body, headers={"content-type": SAFETENSORS})

    return httpx.MockTransport(handler), seen


def _refuses(fields: dict[str, Any], dtype: str) -> bool:
    """Whether a model computing in ``dtype`` refuses ``fields``, as the server does: a float32
    array holding values a float16 or bfloat16 model cannot hold (the model ``refuses``: any)."""
    if fields.get("model") == "refuses":
        return True
    if dtype not in ("float16", "bfloat16"):
        return False

    def held(a: np.ndarray) -> np.ndarray:
        return bfloat16_values(a) if dtype == "bfloat16" else a.astype(np.float16)

    return any(a.dtype == np.float32 and not np.array_equal(a, held(a))
               for a in fields.values() if isinstance(a, np.ndarray))


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


@pytest.mark.parametrize("kwargs, said", [
    ({"base_url": "127.0.0.1:8000"}, "must be http://host:port"),
    ({"base_url": "ftp://host"}, "must be http://host:port"),
    ({"base_url": "http://127.0.0.1:notaport"}, "is invalid"),
    ({"base_url": 18555}, "must be http://host:port"),
    ({"api_key": "k1\n"}, "strip a key read from a file"),
    ({"api_key": "caf\u00e9"}, "printable ASCII"),
    ({"timeout": -5}, "timeout must be a number of seconds > 0"),
    ({"timeout": float("nan")}, "timeout must be"),
    ({"timeout": float("inf")}, "timeout must be"),
])
async def test_a_client_refuses_a_setting_it_cannot_use_at_once(
        kwargs: dict[str, Any], said: str) -> None:
    """A URL that is no http(s) URL, an API key no header can carry and a timeout that is
    no positive number are refused as the client is made, saying what is wrong, rather than
    as a connection that failed after its retries ("is the server running?") or httpx's own
    words."""
    for make in (psgrad.Client, psgrad.AsyncClient):
        with pytest.raises(ValueError, match=said):
            make(**{"base_url": "http://127.0.0.1:9", **kwargs})


def test_an_argument_of_the_wrong_kind_is_refused_in_the_sdks_words() -> None:
    """A weights path where a mapping goes, a chunk size that is no integer and a sampling
    rate of 0 raised AttributeError, TypeError and ZeroDivisionError from inside the SDK."""
    from psgrad import dp

    transport, seen = recorder()
    with psgrad.Client("http://fake", transport=transport) as client:
        with pytest.raises(psgrad.BadRequest, match=r"mapping \{name: array\}.*got str"):
            client.models.upload_weights("m", "w.safetensors")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"chunk_size must be an integer >= 1; got 2\.5"):
            client.per_sample_grads("m", np.ones((2, 3)), np.ones(2),
                                    chunk_size=2.5)  # type: ignore[arg-type]
    assert not [r for r in seen if r.method in ("PUT", "POST")]
    with pytest.raises(ValueError, match=r"sample_rate is a probability in \(0, 1\]; got 0.0"):
        next(dp.poisson_batches(10, 0.0))


def test_without_a_url_the_environment_still_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PSGRAD_URL", "http://from-env:9000")
    with psgrad.Client() as client, psgrad.Client(None) as none:
        assert client.base_url == none.base_url == "http://from-env:9000"


# ------------------------------------------------------------------ dtypes on the wire


def _sent(seen: list[httpx.Request]) -> dict[str, Any]:
    return fields_from_safetensors(seen[-1].content, REQUEST_KEY)


def _asked(seen: list[httpx.Request]) -> list[str]:
    return [r.url.path for r in seen if r.method == "GET" and r.url.path.startswith("/models/")]


def test_floating_arrays_take_the_models_dtype_and_integers_stay_integers() -> None:
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
        client.submit("m", np.ones((1, 3), np.float16), np.ones(1), loss="mse")
        assert _sent(seen)["inputs"].dtype == _sent(seen)["targets"].dtype == np.float32
        assert _asked(seen) == ["/models/m"]  # once per model, not once per request


@pytest.mark.parametrize("bad", [np.array([["a"] * 3] * 2), np.array([[None] * 3] * 2),
                                 np.ones((2, 3), np.complex64)],
                         ids=["strings", "objects", "complex"])
async def test_a_numpy_array_of_what_is_no_number_is_refused_before_sending(
        bad: np.ndarray) -> None:
    """As a list of such values is: a 400 naming the field, from either client, nothing sent
    (it reached the encoder, which raised safetensors' own error)."""
    transport, seen = recorder()
    with psgrad.Client("http://fake", transport=transport) as client, pytest.raises(
            psgrad.BadRequest, match="'inputs' must hold numbers or booleans"):
        client.per_sample_grads("m", bad, np.array([0, 2]), outputs=["norms"])
    async with psgrad.AsyncClient("http://fake", transport=transport) as aclient:
        with pytest.raises(psgrad.BadRequest, match="'targets' must hold numbers"):
            await aclient.per_sample_grads("m", np.ones((2, 3)), bad[:, 0], outputs=["norms"])
    assert not [r for r in seen if r.method == "POST"]


def test_float32_and_integer_requests_ask_nothing() -> None:
    transport, seen = recorder()
    with psgrad.Client("http://fake", transport=transport) as client:
        client.per_sample_grads("tokens", np.array([[1, 2, 3]], np.int32), outputs=["norms"])
        assert _sent(seen)["inputs"].dtype == np.int32  # token ids are never made floats
        client.per_sample_grads("m", np.ones((1, 3), np.float32), [1.5], outputs=["norms"])
        assert _sent(seen)["targets"].dtype == np.float32  # lists read as float32
    assert _asked(seen) == [] and len(seen) == 2


def test_a_float64_float16_or_bfloat16_model_gets_its_own_dtype() -> None:
    transport, seen = recorder({"f64": "float64", "f16": "float16", "bf16": "bfloat16"})
    x64 = np.full((1, 3), 1 / 3)
    with psgrad.Client("http://fake", transport=transport) as client:
        client.per_sample_grads("f64", x64, outputs=["norms"])
        np.testing.assert_array_equal(_sent(seen)["inputs"], x64)  # never through float32
        client.per_sample_grads("f16", x64, outputs=["norms"])
        assert _sent(seen)["inputs"].dtype == np.float16
        client.per_sample_grads("bf16", x64, outputs=["norms"])  # numpy has no bfloat16:
        sent = _sent(seen)["inputs"]  # its values, rounded to nearest even, held in float32
        assert sent.dtype == np.float32 and (sent == np.float32(0.333984375)).all()
    assert _asked(seen) == ["/models/f64", "/models/f16", "/models/bf16"]


async def _either(asynchronous: bool, sync: psgrad.Client, aclient: psgrad.AsyncClient,
                  method: str, *args: Any, **options: Any) -> Any:
    """The same call through the async client or the sync one."""
    if asynchronous:
        return await getattr(aclient, method)(*args, **options)
    return getattr(sync, method)(*args, **options)


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_float32_arrays_a_narrow_model_refuses_are_cast_and_sent_again(
    asynchronous: bool,
) -> None:
    """float32 goes as it is, no question asked; a float16 or bfloat16 model refuses values
    it cannot hold, and the client then asks the model's dtype (once), casts and sends the call
    again. The next call is cast before it goes; a float32 model's refusal stands."""
    transport, seen = recorder({"f16": "float16", "bf16": "bfloat16"})
    x = np.full((1, 3), 1 / 3, np.float32)
    with psgrad.Client("http://fake", transport=transport) as sync:
        aclient = psgrad.AsyncClient("http://fake", transport=transport)
        for model, want in (("f16", np.float16(1 / 3)), ("bf16", np.float32(0.333984375))):
            for _ in range(2):
                await _either(asynchronous, sync, aclient, "per_sample_grads", model, x,
                              outputs=["norms"])
                assert (_sent(seen)["inputs"] == want).all()
        # per model: refused, asked, sent again; the next call cast at once
        assert sum(r.method == "POST" for r in seen) == 6
        assert _asked(seen) == ["/models/f16", "/models/bf16"]
        seen.clear()
        with pytest.raises(psgrad.DtypeMismatch):
            await _either(asynchronous, sync, aclient, "per_sample_grads", "refuses", x,
                          outputs=["norms"])
        assert [r.method for r in seen] == ["POST", "GET"]  # float32: nothing to cast
        await aclient.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_a_queued_jobs_float32_arrays_take_the_models_dtype_first(asynchronous: bool) -> None:
    """A queued job's refusal would come only with its result, too late to cast and send it
    again: ``submit`` asks a model's dtype before its first job with floating arrays (once a
    model, float32 ones too) and casts them; a float32 model's go as they are."""
    transport, seen = recorder({"bf16": "bfloat16"})
    x = np.full((1, 3), 1 / 3, np.float32)
    with psgrad.Client("http://fake", transport=transport) as sync:
        aclient = psgrad.AsyncClient("http://fake", transport=transport)
        for model, want in (("bf16", np.float32(0.333984375)), ("m", np.float32(1 / 3))):
            for _ in range(2):
                await _either(asynchronous, sync, aclient, "submit", model, x, outputs=["norms"])
                assert (_sent(seen)["inputs"] == want).all()
        assert [r.method for r in seen] == ["GET", "POST", "POST"] * 2
        assert _asked(seen) == ["/models/bf16", "/models/m"]
        await aclient.close()


def test_bfloat16_values_round_as_torch_rounds() -> None:
    """Ties to even, overflow to infinity, NaN kept, subnormals: as ``x.to(torch.bfloat16)``."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_normal(4096) * 10.0 ** rng.integers(-40, 39, 4096),
                        np.float32(1 + 2**-8) * np.array([1, -1, 3]),  # exact ties
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 3.4e38, 1e-42, 1 / 3]])
    got = bfloat16_values(x)
    want = torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16).float().numpy()
    assert got.dtype == np.float32 and np.array_equal(got, want, equal_nan=True)


async def test_the_async_client_casts_the_same_way() -> None:
    transport, seen = recorder()
    async with psgrad.AsyncClient("http://fake", transport=transport) as client:
        await client.per_sample_grads("m", np.ones((2, 3)), np.array([0, 1]), outputs=["norms"])
        sent = _sent(seen)
        assert sent["inputs"].dtype == np.float32 and sent["targets"].dtype == np.int64
        await client.submit("m", np.ones((1, 3)))
        assert _sent(seen)["inputs"].dtype == np.float32
    assert _asked(seen) == ["/models/m"]


def test_the_json_path_casts_the_same_way() -> None:
    transport, seen = recorder()
    with psgrad.Client("http://fake", transport=transport, binary=False) as client:
        client.per_sample_grads("m", np.ones((1, 3)), np.array([1]), outputs=["norms"])
    body = json.loads(seen[-1].content)
    assert body["inputs"]["dtype"] == "float32" and body["targets"]["dtype"] == "int64"


def test_torch_float64_and_float16_tensors_take_the_models_dtype() -> None:
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


def test_float32_arrays_reach_a_narrow_program_cast(transport: httpx.BaseTransport) -> None:
    """numpy's float32 arrays to a float16 and a bfloat16 exported program, through the real
    app: answered, and as the same arrays cast by hand are; added to a store of the model and
    queried."""
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
    y = np.array([0, 2, 1, 2])
    with psgrad.Client("http://app", transport=transport) as client:
        for dtype in (torch.float16, torch.bfloat16):
            torch.manual_seed(0)
            module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                                         torch.nn.Linear(8, 3)).to(dtype)
            model = f"narrow-{str(dtype).removeprefix('torch.')}"
            example = torch.from_numpy(x[:1]).to(dtype)
            client.models.register_exported(model, torch.export.export(module, (example,)))
            got = client.per_sample_grads(model, x, y, outputs=["norms", "grads"])
            by_hand = psgrad.Client("http://app", transport=transport)  # knows no dtype yet
            with by_hand:
                want = by_hand.per_sample_grads(model, torch.from_numpy(x).to(dtype), y,
                                                outputs=["norms", "grads"])
            np.testing.assert_array_equal(got.norms, want.norms)
            for k, g in want.grads.items():
                np.testing.assert_array_equal(got.grads[k], g)
            with psgrad.Client("http://app", transport=transport) as fresh:  # a queued job
                job = fresh.submit(model, x, y, outputs=["norms", "grads"])  # is cast first
                np.testing.assert_array_equal(job.result(timeout=60).norms, want.norms)
            # a store's batches are cast before they go (each was refused), its query too
            with psgrad.Client("http://app", transport=transport) as fresh:
                store = fresh.stores.create(f"s-{model}", model, projection_dim=8)
                assert store.add(x, y, ids=list(range(4)), batch_size=2)["added"] == 4
                assert store.query(x[:1], y[:1], k=2).ids.shape == (1, 2)


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
