"""``answer_dtype``: float16 and bfloat16 answers hold the float32 answer rounded to nearest, so
each number is within the format's relative rounding error (2^-11 for float16 in its normal
range, 2^-8 for bfloat16), on both wire forms and through the SDK."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import psgrad
from psgrad._answer_reader import AnswerReader
from psgrad._wire import RESPONSE_KEY, bfloat16_values
from service.api import create_app
from service.config import Settings
from tests.support.api import open_client
from tests.support.client import running_app

MODEL = "value-mlp"
OUTPUTS = ["grads", "norms", "losses", "mean"]
# unit roundoff of round to nearest; float16's smallest normal is 2^-14 (below it the absolute
# error is at most half its subnormal spacing, 2^-25)
BOUND = {"float16": (2.0**-11, 2.0**-25), "bfloat16": (2.0**-8, 0.0)}


def doc(answer_dtype: str | None = None) -> dict[str, Any]:
    rng = np.random.default_rng(3)
    body: dict[str, Any] = {"model": MODEL, "loss": "mse", "outputs": OUTPUTS,
                            "inputs": rng.normal(size=(6, 8)).tolist(),
                            "targets": rng.normal(size=6).tolist()}
    if answer_dtype is not None:
        body["answer_dtype"] = answer_dtype
    return body


def flat(result: Any, names: Any = OUTPUTS) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    for name in names:
        value = result[name]
        for key, arr in (value.items() if isinstance(value, dict) else [("", value)]):
            out[f"{name}.{key}"] = np.asarray(arr)
    return out


def assert_rounded(half: dict[str, np.ndarray], full: dict[str, np.ndarray], dtype: str) -> None:
    rel, tiny = BOUND[dtype]
    assert list(half) == list(full)
    for name, ref in full.items():
        got = half[name].astype(np.float64)
        ref64 = ref.astype(np.float64)
        assert got.shape == ref64.shape, name
        assert np.all(np.abs(got - ref64) <= rel * np.abs(ref64) + tiny), name
        assert np.any(got != ref64) or not np.any(ref64), f"{name} was not rounded"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_safetensors_answers_are_half_the_bytes_and_rounded(dtype: str) -> None:
    accept = {"Accept": "application/x-safetensors"}
    async with open_client() as c:
        full = await c.post("/per-sample-grads", json=doc(), headers=accept)
        half = await c.post("/per-sample-grads", json=doc(dtype), headers=accept)
    assert full.status_code == half.status_code == 200, half.text
    header = len(half.content[:8]) + int.from_bytes(half.content[:8], "little")
    assert len(half.content) - header < (len(full.content) - header) * 0.51
    st_name = {"float16": "F16", "bfloat16": "BF16"}[dtype]
    assert st_name in half.content[8:header].decode()  # the JSON header after its length
    read = []
    for body in (full.content, half.content):
        reader = AnswerReader(RESPONSE_KEY)
        reader.feed(body)
        read.append(flat(reader.fields()))
    assert_rounded(read[1], read[0], dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
async def test_json_answers_hold_the_rounded_numbers(dtype: str) -> None:
    async with open_client() as c:
        full = (await c.post("/per-sample-grads", json=doc())).json()
        half = (await c.post("/per-sample-grads", json=doc(dtype))).json()
    assert_rounded(flat(half), flat(full), dtype)


async def test_an_unknown_answer_dtype_is_422() -> None:
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json=doc("int8"))
    assert r.status_code == 422, r.text
    assert "answer_dtype" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def transport() -> Iterator[httpx.BaseTransport]:
    with running_app(create_app(Settings(workers=1, batch_max_delay_ms=0.0))) as t:
        yield t


@pytest.mark.parametrize("binary", [True, False])
def test_the_sdk_returns_float16_and_widened_bfloat16_arrays(
        transport: httpx.BaseTransport, binary: bool) -> None:
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(5, 8)).astype(np.float32), rng.normal(size=5).astype(np.float32)
    with psgrad.Client("http://app", transport=transport, binary=binary) as client:
        answers = {dtype: client.per_sample_grads(MODEL, x, y, loss="mse", outputs=OUTPUTS,
                                                  answer_dtype=dtype)
                   for dtype in ("float32", "float16", "bfloat16")}
        with pytest.raises(psgrad.InvalidInput):
            client.per_sample_grads(MODEL, x, y, loss="mse", answer_dtype="float64")
    full = flat({n: answers["float32"][n] for n in OUTPUTS})
    for dtype, want in (("float16", np.float16), ("bfloat16", np.float32)):
        half = flat({n: answers[dtype][n] for n in OUTPUTS})
        assert all(a.dtype == want for a in half.values()), dtype  # JSON's were float32
        assert_rounded(half, full, dtype)


def test_json_answers_are_the_binary_ones(transport: httpx.BaseTransport) -> None:
    """Through JSON (binary=False) the SDK returns the arrays safetensors gives, dtype and
    value: a float64 model's in float64 (they were rounded to float32), and a value that is
    not finite (JSON's null) as NaN where it was a BadRequest on a 200 answer."""
    torch = pytest.importorskip("torch")
    net = torch.nn.Sequential(torch.nn.Linear(6, 3)).double().eval()
    program = torch.export.export(net, (torch.randn(1, 6, dtype=torch.float64),))
    rng = np.random.default_rng(2)
    x, y = rng.normal(size=(4, 6)), np.array([0, 1, 2, 0])
    far = rng.normal(size=(5, 8)).astype(np.float32), np.full(5, 3e38, np.float32)
    with psgrad.Client("http://app", transport=transport) as binary, psgrad.Client(
            "http://app", transport=transport, binary=False) as text:
        binary.models.register_exported("f64-lin", program, default_loss="cross_entropy")
        names = ["norms", "grads", "losses", "gns", "mean"]
        a, b = (c.per_sample_grads("f64-lin", x, y, outputs=names) for c in (binary, text))
        for name in a.outputs:
            for got, want in zip(flat(b, [name]).values(), flat(a, [name]).values(),
                                 strict=True):
                assert got.dtype == want.dtype == np.float64, name
                np.testing.assert_array_equal(got, want, err_msg=name)
        a, b = (c.per_sample_grads(MODEL, *far, loss="mse", outputs=["losses", "norms"])
                for c in (binary, text))
    assert not np.isfinite(a.losses).any() and np.isnan(b.losses).all()
    np.testing.assert_array_equal(np.isfinite(b.norms), np.isfinite(a.norms))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_split_batch_is_merged_wide_and_rounded_once(transport: httpx.BaseTransport,
                                                        dtype: str) -> None:
    """A batch the SDK splits, with a narrow answer_dtype: the chunks come in float32, are
    merged in float64 and the merged answer is rounded once, so it is the float32 answer
    rounded. Before, each chunk came rounded and the merge compounded it: layer_gns 75% off
    in bfloat16 (its sum |g|^2 - B |mean|^2 cancels)."""
    rng = np.random.default_rng(7)
    x, y = rng.normal(size=(16, 8)).astype(np.float32), rng.normal(size=16).astype(np.float32)
    names = ["gns", "layer_gns", "mean", "variance", "cosine_mean"]
    with psgrad.Client("http://app", transport=transport) as whole, psgrad.Client(
            "http://app", transport=transport, max_batch_size=4) as split:
        full = whole.per_sample_grads(MODEL, x, y, loss="mse", outputs=names)
        half = split.per_sample_grads(MODEL, x, y, loss="mse", outputs=names, answer_dtype=dtype)
    assert half.meta["requests"] == 4 * 2  # chunks of 4, and cosine_mean's second pass
    rel, tiny = BOUND[dtype]
    for name in full.outputs:
        value = full[name]
        for key, ref in (value.items() if isinstance(value, dict) else [("", value)]):
            got = np.asarray(half[name][key] if key else half[name])
            want = np.asarray(ref, np.float64)
            assert got.dtype == (np.float16 if dtype == "float16" else np.float32), name
            # the float32 answer rounded, give or take float32's own error of the merge
            assert np.all(np.abs(got - want) <= (rel + 1e-3) * np.abs(want) + tiny + 1e-7), (
                name, key, got, want)
            if dtype == "bfloat16":
                np.testing.assert_array_equal(bfloat16_values(got), got)


async def test_embedded_answers_stream_in_pieces_the_reader_fills_in_place() -> None:
    """Embedded mode: the safetensors answer goes out as its header, then views of the arrays
    (no copy of the whole answer); read piece by piece it equals the JSON answer."""
    rng = np.random.default_rng(4)
    body = {"model": "mlp", "inputs": rng.normal(size=(3, 784)).tolist(), "targets": [1, 2, 3]}
    async with open_client() as c:
        want = (await c.post("/per-sample-grads", json=body)).json()
        reader = AnswerReader(RESPONSE_KEY)
        pieces = 0
        async with c.stream("POST", "/per-sample-grads", json=body,
                            headers={"Accept": "application/x-safetensors"}) as r:
            assert r.status_code == 200
            size = int(r.headers["content-length"])
            async for chunk in r.aiter_raw():  # in-process: one chunk; a socket: many
                for start in range(0, len(chunk), 1 << 20):
                    reader.feed(chunk[start:start + (1 << 20)])
                    pieces += 1
    assert size > 8_000_000 and pieces > 1  # 8 MB of grads
    got = reader.fields()
    for name, arr in got["grads"].items():
        np.testing.assert_allclose(arr, np.asarray(want["grads"][name], np.float32), rtol=1e-6)


async def test_small_answers_go_in_one_write() -> None:
    """An answer of at most 64 KiB is one plain response (no streaming task), whole and equal to
    the JSON answer; a larger one is streamed (above)."""
    rng = np.random.default_rng(5)
    body = {"model": "mlp", "inputs": rng.normal(size=(4, 784)).tolist(), "targets": [1, 2, 3, 4],
            "outputs": ["norms", "losses"]}
    async with open_client() as c:
        want = (await c.post("/per-sample-grads", json=body)).json()
        r = await c.post("/per-sample-grads", json=body,
                         headers={"Accept": "application/x-safetensors"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-safetensors"
    assert int(r.headers["content-length"]) == len(r.content) < 64 * 1024
    reader = AnswerReader(RESPONSE_KEY)
    reader.feed(r.content)
    got = reader.fields()
    for name in ("norms", "losses"):
        np.testing.assert_allclose(got[name], np.asarray(want[name], np.float32), rtol=1e-6)


@pytest.mark.parametrize(("floats", "streamed"), [(1000, False), (100_000, True)])
async def test_only_answers_over_64_kib_are_streamed(floats: int, streamed: bool) -> None:
    from starlette.requests import Request
    from starlette.responses import StreamingResponse

    from service.api.body import encode_result

    request = Request({"type": "http", "method": "POST", "path": "/", "query_string": b"",
                       "headers": [(b"accept", b"application/x-safetensors")]})
    response = await encode_result(request, {"norms": np.ones(floats, np.float32)})
    assert isinstance(response, StreamingResponse) is streamed
