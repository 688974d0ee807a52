"""Chunking and exact merging in the SDK, against a numpy reference server (httpx.MockTransport).

The fake server's model is linear in the simplest way: sample i's gradient is its input row
(parameter ``w``, shape [D]), so every output has an obvious numpy definition over the whole batch,
and the SDK's combined answer over chunks must equal it.
"""

from __future__ import annotations

import json
import sys

import httpx
import numpy as np
import pytest

import psgrad
from psgrad._contract import answer_fields
from psgrad._merge import merge_moments
from psgrad._wire import REQUEST_KEY, RESPONSE_KEY, fields_from_safetensors, fields_to_safetensors

ALL = ["grads", "losses", "norms", "layer_norms", "mean", "variance", "clipped_mean", "dot",
       "cosine_mean"]


def reference(x: np.ndarray, outputs: list[str], *, clip: float = 1.0,
              ref: np.ndarray | None = None) -> dict[str, object]:
    """Every output over the whole batch, by definition (float64)."""
    g = x.astype(np.float64)
    norms = np.linalg.norm(g, axis=1)
    mean = g.mean(0)
    out: dict[str, object] = {
        "grads": {"w": g}, "losses": g.sum(1), "norms": norms, "layer_norms": {"w": norms},
        "mean": {"w": mean}, "variance": {"w": g.var(0)},
        "clipped_mean": {"w": (g * np.minimum(1.0, clip / norms)[:, None]).sum(0) / len(g)},
        "cosine_mean": g @ mean / (norms * np.linalg.norm(mean)),
    }
    if len(g) >= 2:  # the noise scale: tr(Sigma) from the deviations, |G|^2 = |mean|^2 - tr/B
        trace = ((g - mean) ** 2).sum() / (len(g) - 1)
        grad_sq = mean @ mean - trace / len(g)
        out |= {"gns": trace / grad_sq, "gns_trace": trace, "gns_grad_sq": grad_sq,
                "layer_gns": {"w": trace / grad_sq}, "layer_gns_trace": {"w": trace},
                "layer_gns_grad_sq": {"w": grad_sq}}
    if ref is not None:
        out["dot"] = g @ ref
    return {k: out[k] for k in answer_fields(outputs)}


class FakeServer:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.sizes: list[int] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        fields = fields_from_safetensors(request.content, REQUEST_KEY)
        x = fields["inputs"]
        self.sizes.append(len(x))
        if len(x) > self.limit:
            body = {"error": {"code": "too_large", "message": "too many samples",
                              "details": {"limit": self.limit, "size": len(x)}}}
            return httpx.Response(413, json=body)
        assert float(fields.get("noise_multiplier") or 0.0) == 0.0  # the SDK adds the noise
        ref = fields.get("reference", {}).get("w")
        out = reference(x, fields["outputs"], clip=fields.get("clip_norm") or 1.0, ref=ref)
        cast = {k: ({p: np.asarray(a, np.float32) for p, a in v.items()} if isinstance(v, dict)
                    else np.asarray(v, dtype=np.float32)) for k, v in out.items()}
        body = fields_to_safetensors(
            {"model": "lin@0123456789abcdef", "batch_size": len(x), "loss": "mse", **cast,
             "timing": {"queue_ms": 1.0, "compute_ms": 2.0}, "meta": {"route": "vmap"}},
            RESPONSE_KEY,
        )
        return httpx.Response(200, content=body,
                              headers={"content-type": "application/x-safetensors"})


def make_client(server: FakeServer, **kwargs: object) -> psgrad.Client:
    return psgrad.Client(base_url="http://fake", transport=httpx.MockTransport(server),
                         **kwargs)  # type: ignore[arg-type]


def assert_outputs_equal(got: psgrad.GradsResult, want: dict[str, object]) -> None:
    assert set(got.outputs) == set(want)
    for name, value in want.items():
        if isinstance(value, dict):
            for p, arr in value.items():
                np.testing.assert_allclose(got[name][p], arr, rtol=1e-5, atol=1e-6, err_msg=name)
        else:
            np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("chunk_size", [None, 1, 3, 7, 20])
def test_chunked_outputs_equal_the_whole_batch(chunk_size: int | None) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(20, 5)).astype(np.float32)
    ref = rng.normal(size=5).astype(np.float32)
    server = FakeServer(limit=7)
    with make_client(server) as client:
        got = client.per_sample_grads("lin", x, outputs=ALL, clip_norm=1.5,
                                      reference={"w": ref}, chunk_size=chunk_size)
    assert_outputs_equal(got, reference(x, ALL, clip=1.5, ref=ref))
    assert got.batch_size == 20 and got.model == "lin@0123456789abcdef"
    assert max(server.sizes[1:]) <= 7  # after at most one 413
    assert got.meta["requests"] >= 1 and got.timing["compute_ms"] >= 2.0


def test_the_limit_is_learned_from_413_and_remembered() -> None:
    server = FakeServer(limit=4)
    x = np.arange(30, dtype=np.float32).reshape(10, 3)
    with make_client(server) as client:
        client.per_sample_grads("lin", x, outputs=["norms"])
        assert client.max_batch_size == 4
        assert server.sizes == [10, 4, 4, 2]
        server.sizes.clear()
        client.per_sample_grads("lin", x, outputs=["norms"])
        assert server.sizes == [4, 4, 2]  # no second 413


def test_variance_without_mean_and_cosine_alone_are_combined() -> None:
    x = np.random.default_rng(1).normal(size=(9, 4)).astype(np.float32)
    with make_client(FakeServer(limit=2)) as client:
        got = client.per_sample_grads("lin", x, outputs=["variance", "cosine_mean"])
    assert_outputs_equal(got, reference(x, ["variance", "cosine_mean"]))


@pytest.mark.parametrize("chunk_size", [None, 1, 3])
def test_the_noise_scale_is_combined_from_the_chunks_norms_and_means(chunk_size: int | None
                                                                      ) -> None:
    """gns and layer_gns of a split batch: chunks of one sample too, which alone have none."""
    rng = np.random.default_rng(3)
    x = (rng.normal(size=(10, 6)) + 0.8).astype(np.float32)  # a mean well above the noise
    server = FakeServer(limit=100)
    with make_client(server) as client:
        got = client.per_sample_grads("lin", x, outputs=["gns", "layer_gns"],
                                      chunk_size=chunk_size)
    assert list(got.outputs) == ["gns", "gns_trace", "gns_grad_sq", "layer_gns",
                                 "layer_gns_trace", "layer_gns_grad_sq"]
    assert_outputs_equal(got, reference(x, ["gns", "layer_gns"]))
    assert got.gns_trace == got["gns_trace"]
    assert server.sizes == [10] if chunk_size is None else len(server.sizes) > 1


def test_clipped_mean_noise_is_seeded_added_once_and_independent_of_the_split() -> None:
    x = np.random.default_rng(2).normal(size=(12, 4000)).astype(np.float32)
    results = []
    for chunk in (None, 5):
        with make_client(FakeServer(limit=100)) as client:
            results.append(client.per_sample_grads(
                "lin", x, outputs=["clipped_mean"], clip_norm=2.0, noise_multiplier=0.5,
                seed=7, chunk_size=chunk))
    np.testing.assert_allclose(results[0].clipped_mean["w"], results[1].clipped_mean["w"],
                               rtol=1e-5, atol=1e-6)
    assert results[0].meta["seed"] == 7
    noiseless = reference(x, ["clipped_mean"], clip=2.0)["clipped_mean"]["w"]  # type: ignore[index]
    noise = (results[1].clipped_mean["w"] - noiseless) * len(x)
    assert abs(noise.std() - 0.5 * 2.0) < 0.05  # N(0, (noise_multiplier * clip_norm)^2), once
    assert abs(noise.mean()) < 0.05


def test_merge_moments_matches_numpy_on_uneven_chunks() -> None:
    rng = np.random.default_rng(3)
    x = rng.normal(3.0, 2.0, size=(50, 6))
    splits = np.split(x, [1, 4, 30, 31])
    mean, var = merge_moments([len(s) for s in splits], [{"w": s.mean(0)} for s in splits],
                              [{"w": s.var(0)} for s in splits])
    np.testing.assert_allclose(mean["w"], x.mean(0), rtol=1e-12)
    np.testing.assert_allclose(var["w"], x.var(0), rtol=1e-12)


def test_progress_callback_reaches_the_total() -> None:
    calls: list[tuple[int, int]] = []
    x = np.ones((10, 2), dtype=np.float32)
    with make_client(FakeServer(limit=3)) as client:
        client.per_sample_grads("lin", x, outputs=["cosine_mean"], chunk_size=3,
                                progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (20, 20)  # two passes over 10 samples
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_plain_progress_bar_draws_on_stderr(capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # the plain bar, tqdm installed or not
    with make_client(FakeServer(limit=3)) as client:
        client.per_sample_grads("lin", np.ones((7, 2), np.float32), outputs=["norms"],
                                progress=True)
    err = capsys.readouterr().err
    assert "7/7 samples" in err and err.endswith("\n")


def test_lists_and_torch_inputs_become_arrays_and_as_torch_returns_tensors() -> None:
    torch = pytest.importorskip("torch")
    seen: list[dict[str, object]] = []
    server = FakeServer(limit=100)

    def spy(request: httpx.Request) -> httpx.Response:
        seen.append(fields_from_safetensors(request.content, REQUEST_KEY))
        return server(request)

    with psgrad.Client(base_url="http://fake", transport=httpx.MockTransport(spy)) as client:
        client.per_sample_grads("lin", [[1.0, 2.0], [3.0, 4.0]], outputs=["norms"])
        got = client.per_sample_grads("lin", torch.ones(3, 2), outputs=["norms", "grads"],
                                      as_torch=True)
    assert seen[0]["inputs"].dtype == np.float32  # type: ignore[union-attr]
    assert isinstance(got.norms, torch.Tensor) and isinstance(got.grads["w"], torch.Tensor)
    torch.testing.assert_close(got.norms, torch.full((3,), 2.0**0.5))


def test_json_transport_round_trips() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["content-type"] == "application/json"
        body = json.loads(request.content)
        assert body["inputs"]["dtype"] == "float32"
        return httpx.Response(200, json={"model": "lin@1", "batch_size": 2,
                                         "norms": [1.0, 2.0], "grads": {"w": [[1.0], [2.0]]}})

    with psgrad.Client(base_url="http://fake", transport=httpx.MockTransport(handler),
                       binary=False) as client:
        got = client.per_sample_grads("lin", np.ones((2, 1), np.float32),
                                      outputs=["norms", "grads"])
    np.testing.assert_array_equal(got.norms, [1.0, 2.0])
    np.testing.assert_array_equal(got.grads["w"], [[1.0], [2.0]])
    with pytest.raises(AttributeError, match="was not requested"):
        _ = got.mean
