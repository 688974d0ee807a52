"""The SDK against the real app in-process (embedded broker): sync over a portal, async over
``httpx.ASGITransport``. Chunked answers must equal the server's own unchunked answers; with
``verify`` the report is ``result.meta["verify"]``, a split batch's samples placed in the whole
batch, and a wrong answer raises ``psgrad.VerificationFailed``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import psgrad
from service.api import create_app
from service.config import Settings
from service.registry import ModelRegistry
from service.verify import choose
from tests.support import faults
from tests.support.client import running_app
from tests.support.reference import assert_noise_scale, loop_noise_scales

MODEL = "value-mlp"  # 8 -> 64 -> 64 -> 1, small enough for exact checks on a shared CPU
ALL = ["grads", "losses", "norms", "layer_norms", "mean", "variance", "clipped_mean", "dot",
       "cosine_mean"]


@pytest.fixture(scope="module")
def transport() -> Iterator[httpx.BaseTransport]:
    app = create_app(Settings(max_batch_size=16, workers=1, batch_max_delay_ms=0.0))
    with running_app(app) as t:
        yield t


@pytest.fixture
def client(transport: httpx.BaseTransport) -> Iterator[psgrad.Client]:
    with psgrad.Client(base_url="http://app", transport=transport) as c:
        yield c


def batch(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n, 8)).astype(np.float32),
            rng.normal(size=n).astype(np.float32))


def assert_same(a: psgrad.GradsResult, b: psgrad.GradsResult, *, rtol: float = 1e-4,
                atol: float = 1e-5) -> None:
    assert list(a.outputs) == list(b.outputs)
    for name in a.outputs:
        x, y = a[name], b[name]
        if isinstance(x, dict):
            assert list(x) == list(y), name
            for p in x:
                np.testing.assert_allclose(x[p], y[p], rtol=rtol, atol=atol, err_msg=f"{name}.{p}")
        else:
            np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=name)


def reference_for(client: psgrad.Client) -> dict[str, np.ndarray]:
    weights = client.models.download_weights(MODEL)
    rng = np.random.default_rng(9)
    return {k: rng.normal(size=v.shape).astype(np.float32) for k, v in weights.items()}


@pytest.mark.parametrize("chunk_size", [3, 5])
def test_chunked_equals_unchunked_for_every_output(client: psgrad.Client,
                                                   chunk_size: int) -> None:
    x, y = batch(13)
    opts: dict[str, Any] = {"loss": "mse", "outputs": ALL, "clip_norm": 0.05,
                            "noise_multiplier": 0.7, "seed": 3,
                            "reference": reference_for(client)}
    whole = client.per_sample_grads(MODEL, x, y, **opts)
    parts = client.per_sample_grads(MODEL, x, y, chunk_size=chunk_size, **opts)
    assert whole.meta["requests"] == 1 and parts.meta["requests"] == 2 * -(-13 // chunk_size)
    assert whole.batch_size == parts.batch_size == 13 and whole.model == parts.model
    assert_same(whole, parts)
    # the clip bound is active and the noise was added: the result is not the plain mean
    assert not np.allclose(whole.clipped_mean["net.fc1.weight"], whole.mean["net.fc1.weight"])


def test_the_noise_scale_of_a_split_batch_equals_the_loops(client: psgrad.Client) -> None:
    """gns and layer_gns, whole and merged by the SDK from chunks' norms and means."""
    x, y = batch(13, seed=4)
    module = ModelRegistry().get(MODEL).module  # the weights the app serves
    want = loop_noise_scales(module, {"inputs": torch.from_numpy(x),
                                      "targets": torch.from_numpy(y)}, "mse")
    for chunk_size in (None, 4):
        got = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["gns", "layer_gns"],
                                      chunk_size=chunk_size)
        assert got.meta["requests"] == (1 if chunk_size is None else 4)
        for name in ("gns", "layer_gns"):
            assert_noise_scale(name, got.outputs, want, f"chunk_size={chunk_size}")


def test_clipped_mean_without_noise_equals_the_servers_own(client: psgrad.Client) -> None:
    x, y = batch(10, seed=1)
    fields = {"model": MODEL, "inputs": x, "targets": y, "loss": "mse",
              "outputs": ["clipped_mean"], "clip_norm": 0.05}
    raw = client._decode(client._post_fields("/per-sample-grads", fields))  # no SDK logic
    got = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["clipped_mean"],
                                  clip_norm=0.05, chunk_size=4)
    for k, v in raw["clipped_mean"].items():
        np.testing.assert_allclose(got.clipped_mean[k], v, rtol=1e-4, atol=1e-6)


def test_the_batch_limit_is_learned_from_the_servers_413(transport: httpx.BaseTransport) -> None:
    x, y = batch(40, seed=2)
    with psgrad.Client(base_url="http://app", transport=transport) as c:
        got = c.per_sample_grads(MODEL, x, y, loss="mse", outputs=["norms", "mean"])
        assert c.max_batch_size == 16
        whole = c.per_sample_grads(MODEL, x[:16], y[:16], loss="mse", outputs=["norms"])
    assert got.batch_size == 40 and got.meta["requests"] == 3
    np.testing.assert_allclose(got.norms[:16], whole.norms, rtol=1e-5)


def test_td0_matches_the_hand_example_and_chunks(client: psgrad.Client) -> None:
    theta = {"theta": np.array([0.2, -0.2, 0.1], np.float32)}
    s = np.tile(np.array([[2.0, 1.0, -2.0]], np.float32), (5, 1))
    s2 = np.tile(np.array([[1.0, 2.0, 0.0]], np.float32), (5, 1))
    got = client.td0("linear-value", s, [2.0] * 5, s2, weights=theta,
                     outputs=["updates", "td_errors", "grads", "mean"], chunk_size=2)
    np.testing.assert_allclose(got.td_errors, [1.8] * 5, rtol=1e-6)
    np.testing.assert_allclose(got.updates["theta"], np.tile([3.6, 1.8, -3.6], (5, 1)), rtol=1e-6)
    np.testing.assert_allclose(got.grads["theta"][0], [-7.2, -3.6, 7.2], rtol=1e-6)
    np.testing.assert_allclose(got.mean["theta"], [-7.2, -3.6, 7.2], rtol=1e-6)
    done = client.td0("linear-value", s[:1], [2.0], s2[:1], dones=[True], weights=theta)
    np.testing.assert_allclose(done.td_errors, [2.0], rtol=1e-6)  # no bootstrap after the end


def test_json_transport_gives_the_same_answer(transport: httpx.BaseTransport,
                                              client: psgrad.Client) -> None:
    x, y = batch(6, seed=4)
    with psgrad.Client(base_url="http://app", transport=transport, binary=False) as js:
        a = js.per_sample_grads(MODEL, x, y, loss="mse", outputs=["grads", "norms", "mean"])
    b = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["grads", "norms", "mean"])
    assert_same(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(("call", "error"), [
    (lambda c: c.per_sample_grads("no-such-model", [[1.0]]), psgrad.UnknownModel),
    (lambda c: c.per_sample_grads(MODEL, np.ones((2, 3), np.float32), [0.0, 1.0], loss="mse"),
     psgrad.ShapeMismatch),
    (lambda c: c.per_sample_grads(MODEL, np.ones((2, 8), np.float32), [0.0, 1.0], loss="mse",
                                  outputs=["gradz"]), psgrad.UnknownOutput),
    (lambda c: c.per_sample_grads(MODEL, np.ones((2, 8), np.float32), loss="xent"),
     psgrad.UnknownLoss),
    (lambda c: c.per_sample_grads(MODEL, np.ones((0, 8), np.float32), np.ones(0, np.float32),
                                  loss="mse"), psgrad.EmptyBatch),
    (lambda c: c.per_sample_grads(MODEL, np.ones((2, 8), np.float32), [0.0, 1.0], loss="mse",
                                  params=["nope"]), psgrad.UnknownParameter),
    (lambda c: c.per_sample_grads(MODEL, np.full((2, 8), np.nan, np.float32), [0.0, 1.0],
                                  loss="mse"), psgrad.NonFinite),
    (lambda c: c.models.get("no-such-model"), psgrad.UnknownModel),
    (lambda c: c.job("0123456789abcdef").status(), psgrad.UnknownJob),
])
def test_the_apps_errors_arrive_as_their_classes(client: psgrad.Client, call: Any,
                                                 error: type[psgrad.PsgradError]) -> None:
    with pytest.raises(error) as info:
        call(client)
    assert info.value.message and info.value.http_status == error.status
    assert info.value.request_id and len(info.value.request_id) == 32  # the server's X-Request-ID


def test_jobs_submit_status_result_and_cancel(client: psgrad.Client) -> None:
    x, y = batch(4, seed=5)
    job = client.submit(MODEL, x, y, loss="mse", outputs=["norms", "grads"])
    result = job.result(timeout=60)
    assert job.status() is psgrad.JobStatus.SUCCEEDED
    direct = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["norms", "grads"])
    assert_same(result, direct, rtol=1e-6, atol=1e-7)
    failing = client.submit(MODEL, x, y, loss="mse", outputs=["norms"],
                            weights={"net.fc1.weight": np.full((64, 8), np.inf, np.float32)})
    with pytest.raises(psgrad.PsgradError):
        failing.result(timeout=60)
    again = client.job(job.id)
    assert again.status() is psgrad.JobStatus.SUCCEEDED
    assert again.cancel() is psgrad.JobStatus.SUCCEEDED  # a finished job stays as it was


def test_models_register_upload_download_delete(client: psgrad.Client) -> None:
    info = client.models.register("sdk-test-mlp", architecture="mlp",
                                  config={"sizes": [4, 3, 2], "activation": "tanh"})
    try:
        assert info.id == "sdk-test-mlp" and set(info.parameters) == {
            "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        assert "sdk-test-mlp" in [m.id for m in client.models.list()]
        weights = client.models.download_weights("sdk-test-mlp")
        new = {k: np.full_like(v, 0.5) for k, v in weights.items()}
        info2 = client.models.upload_weights("sdk-test-mlp", new)
        assert info2.version != info.version
        back = client.models.download_weights(info2.ref)
        for k, v in new.items():
            np.testing.assert_array_equal(back[k], v)
        old = client.models.download_weights(info.ref)  # old versions stay addressable
        np.testing.assert_array_equal(old["fc1.weight"], weights["fc1.weight"])
        x = np.ones((3, 4), np.float32)
        r = client.per_sample_grads("sdk-test-mlp", x, [0, 1, 1], outputs=["losses"])
        assert r.model == info2.ref
        np.testing.assert_allclose(r.losses, np.log(2.0), rtol=1e-5)  # equal logits
        inline = client.models.register("sdk-test-mlp", architecture="mlp",
                                        config={"sizes": [4, 3, 2], "activation": "tanh"},
                                        weights=new)
        assert inline.version == info2.version  # the same weights, the same content digest
    finally:
        client.models.delete("sdk-test-mlp")
    with pytest.raises(psgrad.UnknownModel):
        client.models.get("sdk-test-mlp")


async def test_the_async_client_against_the_app() -> None:
    app = create_app(Settings(max_batch_size=4, workers=1, batch_max_delay_ms=0.0))
    x, y = batch(9, seed=6)
    async with app.router.lifespan_context(app), psgrad.AsyncClient(
            base_url="http://app", transport=httpx.ASGITransport(app=app)) as client:
        got = await client.per_sample_grads(MODEL, x, y, loss="mse",
                                            outputs=["norms", "variance", "cosine_mean"])
        assert client.max_batch_size == 4 and got.meta["requests"] == 6
        first = await client.per_sample_grads(MODEL, x[:4], y[:4], loss="mse",
                                              outputs=["norms"])
        np.testing.assert_allclose(got.norms[:4], first.norms, rtol=1e-5)
        job = await client.submit(MODEL, x[:3], y[:3], loss="mse", outputs=["losses"])
        assert (await job.result(timeout=60)).losses.shape == (3,)
        assert await job.status() is psgrad.JobStatus.SUCCEEDED
        assert [m.id for m in await client.models.list()]
        assert (await client.models.get("simple-cnn")).input["shape"] == [1, 28, 28]
        with pytest.raises(psgrad.UnknownModel):
            await client.td0("nope", [[1.0]], [1.0], [[1.0]])


def test_keys_are_sent_and_refusals_are_typed() -> None:
    app = create_app(Settings(api_keys="user-key", admin_keys="admin-key", workers=1))
    with running_app(app) as t:
        with psgrad.Client(base_url="http://app", transport=t, api_key="") as anon, \
                pytest.raises(psgrad.Unauthorized):
            anon.models.list()
        with psgrad.Client(base_url="http://app", transport=t, api_key="user-key") as user:
            assert user.models.list()
            with pytest.raises(psgrad.Forbidden):
                user.models.delete("whatever")


# ----------------------------------------------------------------------------- verify


def test_verify_one_request_reports_it(client: psgrad.Client) -> None:
    x, y = batch(7)
    got = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["norms", "mean"], verify=3,
                                  verify_seed=2)
    report = got.meta["verify"]
    assert report["samples"] == choose(7, 3, 2) and report["seed"] == 2
    assert list(report["checked"]) == ["norms", "mean"] and report["max_abs_diff"] <= 3e-3
    plain = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["norms"])
    assert "verify" not in plain.meta


def test_verify_of_a_split_batch_places_each_requests_samples(client: psgrad.Client) -> None:
    x, y = batch(40, seed=1)
    got = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["grads", "variance"],
                                  verify=2, verify_seed=5)
    report = got.meta["verify"]
    assert got.meta["requests"] == 3
    want = [start + i for start, n in ((0, 16), (16, 16), (32, 8)) for i in choose(n, 2, 5)]
    assert report["samples"] == sorted(want) and report["seeds"] == [5, 5, 5]
    assert list(report["checked"]) == ["grads", "variance", "mean"]  # mean: Chan's merge asks it
    assert report["max_abs_diff"] == max(report["checked"].values()) <= 3e-3
    cos = client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["cosine_mean"], verify=1)
    assert cos.meta["requests"] == 6 and "dot" in cos.meta["verify"]["checked"]


def test_verify_through_jobs_and_td0(client: psgrad.Client) -> None:
    x, y = batch(5, seed=2)
    result = client.submit(MODEL, x, y, loss="mse", outputs=["losses"], verify=5).result(
        timeout=60)
    assert result.meta["verify"]["samples"] == [0, 1, 2, 3, 4]
    td = client.td0("linear-value", x[:, :3], y, x[:, 3:6], verify=2, verify_seed=0)
    assert td.meta["verify"]["samples"] == choose(5, 2, 0)
    with pytest.raises(psgrad.InvalidInput, match=r"'verify' must be an integer in \[0, 64\]"):
        client.per_sample_grads(MODEL, x, y, loss="mse", verify=65)


async def test_verify_through_the_async_client() -> None:
    app = create_app(Settings(workers=1, batch_max_delay_ms=0.0))
    async with app.router.lifespan_context(app), psgrad.AsyncClient(
            base_url="http://app", transport=httpx.ASGITransport(app=app)) as c:
        x, y = batch(4, seed=3)
        got = await c.per_sample_grads(MODEL, x, y, loss="mse", outputs=["norms"], verify=2,
                                       verify_seed=1)
    assert got.meta["verify"]["samples"] == choose(4, 2, 1)


def test_a_wrong_verified_answer_raises(transport: httpx.BaseTransport,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    faults.wrong_output(monkeypatch, "norms", row=1)
    x, y = batch(3, seed=4)
    with psgrad.Client(base_url="http://app", transport=transport, max_retries=0) as client, \
            pytest.raises(psgrad.VerificationFailed) as caught:
        client.per_sample_grads(MODEL, x, y, loss="mse", outputs=["norms"], verify=3)
    assert caught.value.http_status == 500 and caught.value.details["sample"] == 1
    assert isinstance(caught.value, psgrad.InternalError)
