"""The Open Inference Protocol routes, called with tritonclient (a client nobody here wrote)
through a real HTTP server: norms, full gradients in Triton's binary form, a DP clipped mean,
each equal to the per-sample loop; metadata, health, keys and errors in the protocol's shape."""

from __future__ import annotations

import time
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
from tests.support.api import serving, settings
from tests.support.reference import per_sample_loop, summarize

http = pytest.importorskip("tritonclient.http")
utils = pytest.importorskip("tritonclient.utils")

MODEL = "value-mlp"
rng = np.random.default_rng(3)
X = rng.standard_normal((6, 8)).astype(np.float32)
Y = rng.standard_normal(6).astype(np.float32)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(create_app(Settings(workers=1, batch_max_delay_ms=0.0))) as u:
        yield u


def client(url: str) -> Any:
    return http.InferenceServerClient(url.removeprefix("http://"))


def inputs(binary: bool) -> list[Any]:
    out = []
    for name, arr in (("inputs", X), ("targets", Y)):
        tensor = http.InferInput(name, list(arr.shape), "FP32")
        tensor.set_data_from_numpy(arr, binary_data=binary)
        out.append(tensor)
    return out


def loop_summary(clip_norm: float | None = None) -> dict[str, Any]:
    module = ModelRegistry().get(MODEL).module
    loop = per_sample_loop(module, {"inputs": torch.from_numpy(X),
                                    "targets": torch.from_numpy(Y)}, "mse")
    return summarize(loop, [len(X)], clip_norm=clip_norm)[0]


def test_health_server_and_model_metadata(url: str) -> None:
    c = client(url)
    assert c.is_server_live()
    deadline = time.monotonic() + 60  # ready once the workers' warm-up ends
    while not c.is_server_ready() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.is_server_ready() and c.is_model_ready(MODEL)
    assert c.get_server_metadata()["extensions"] == ["binary_tensor_data", "parameters"]
    meta = c.get_model_metadata(MODEL)
    assert meta["name"] == MODEL and meta["platform"] == "psgrad"
    assert [i["name"] for i in meta["inputs"]] == ["inputs", "next_inputs", "rewards", "dones"]
    assert meta["inputs"][0] == {"name": "inputs", "datatype": "FP32", "shape": [-1, 8]}
    outputs = {o["name"]: o["shape"] for o in meta["outputs"]}
    assert outputs["norms"] == [-1] and outputs["grads/net.fc1.weight"] == [-1, 64, 8]
    assert outputs["clipped_mean/net.fc1.weight"] == [64, 8] and outputs["gns_trace"] == []


def test_norms_in_json_equal_the_loops(url: str) -> None:
    result = client(url).infer(MODEL, inputs(binary=False), parameters={"loss": "mse"},
                               outputs=[http.InferRequestedOutput("norms", binary_data=False)])
    want = loop_summary()["norms"].numpy()
    np.testing.assert_allclose(result.as_numpy("norms"), want, rtol=1e-5, atol=1e-6)
    response = result.get_response()
    assert response["model_name"] == MODEL and response["parameters"]["batch_size"] == 6
    assert [o["name"] for o in response["outputs"]] == ["norms"]


def test_full_gradients_in_binary_both_ways_equal_the_loops(url: str) -> None:
    want = loop_summary()["grads"]
    asked = [http.InferRequestedOutput(f"grads/{p}", binary_data=True) for p in want]
    result = client(url).infer(MODEL, inputs(binary=True), outputs=asked,
                               parameters={"loss": "mse"})
    for p, g in want.items():
        got = result.as_numpy(f"grads/{p}")
        assert got.dtype == np.float32 and got.shape == (6, *g.shape[1:])
        np.testing.assert_allclose(got, g.numpy(), rtol=1e-5, atol=1e-6, err_msg=p)
        assert result.get_output(f"grads/{p}")["parameters"]["binary_data_size"] == got.nbytes


def test_a_dp_clipped_mean_equals_the_loops_and_psgrads_own(url: str) -> None:
    """Noiseless, the loop's clipped mean; with noise and a seed, POST /per-sample-grads's."""
    want = loop_summary(clip_norm=0.5)["clipped_mean"]
    asked = [http.InferRequestedOutput(f"clipped_mean/{p}") for p in want]
    quiet = client(url).infer(MODEL, inputs(binary=True), outputs=asked,
                              parameters={"loss": "mse", "clip_norm": 0.5})
    for p, v in want.items():
        np.testing.assert_allclose(quiet.as_numpy(f"clipped_mean/{p}"), v.numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=p)
    noisy = client(url).infer(MODEL, inputs(binary=True), outputs=asked, parameters={
        "loss": "mse", "clip_norm": 0.5, "noise_multiplier": 1.0, "seed": 11})
    assert noisy.get_response()["parameters"]["seed"] == 11
    own = httpx.post(f"{url}/per-sample-grads", json={
        "model": MODEL, "loss": "mse", "inputs": X.tolist(), "targets": Y.tolist(),
        "outputs": ["clipped_mean"], "clip_norm": 0.5, "noise_multiplier": 1.0, "seed": 11},
        timeout=60).json()
    for p in want:
        np.testing.assert_array_equal(noisy.as_numpy(f"clipped_mean/{p}"),
                                      np.asarray(own["clipped_mean"][p], np.float32))
        assert not np.allclose(noisy.as_numpy(f"clipped_mean/{p}"), want[p].numpy())


def test_without_named_outputs_every_field_of_the_asked_outputs_comes(url: str) -> None:
    result = client(url).infer(MODEL, inputs(binary=False),
                               parameters={"loss": "mse", "outputs": "gns,losses"})
    names = [o["name"] for o in result.get_response()["outputs"]]
    assert names == ["gns", "gns_trace", "gns_grad_sq", "losses"]
    assert result.get_output("gns")["shape"] == [] and result.as_numpy("gns").size == 1
    assert result.as_numpy("losses").shape == (6,)


def test_errors_are_in_the_protocols_shape(url: str) -> None:
    c = client(url)
    with pytest.raises(utils.InferenceServerException) as caught:
        c.infer("no-such-model", inputs(binary=False), parameters={"loss": "mse"})
    assert caught.value.status() == "404" and "unknown model 'no-such-model'" in str(caught.value)
    with pytest.raises(utils.InferenceServerException) as caught:
        c.infer(MODEL, inputs(binary=False), parameters={"loss": "hinge"})
    assert caught.value.status() == "422" and "hinge" in str(caught.value)
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", timeout=30, json={
        "inputs": [{"name": "inputs", "shape": [2, 8], "datatype": "FP32", "data": [1.0]}]})
    assert r.status_code == 422 and r.json() == {"error": "input 'inputs': 1 values for shape "
                                                          "[2, 8]"}
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", timeout=30, content=b"{}",
                   headers={"Inference-Header-Content-Length": "9"})
    assert r.status_code == 400 and set(r.json()) == {"error"}


def _tensor(name: str, arr: np.ndarray, datatype: str = "FP32") -> dict[str, Any]:
    return {"name": name, "shape": list(arr.shape), "datatype": datatype,
            "data": arr.reshape(-1).tolist()}


GOOD = [_tensor("inputs", X), _tensor("targets", Y)]
HUGE = 1180591620717411303424  # 2**70


@pytest.mark.parametrize("doc, status, word", [
    ({"parameters": {"outputs": 5}}, 400, "parameters.outputs must be a list"),
    ({"parameters": {"outputs": [["norms"]]}}, 400, "parameters.outputs must be a list"),
    ({"parameters": {"binary_data_output": "false"}}, 400,
     "parameters.binary_data_output' should be a valid boolean"),
    ({"outputs": [{"name": "norms", "parameters": {"binary_data": "false"}}]}, 400,
     "binary_data"),
    ({"parameters": {"weights": 5},
      "inputs": [*GOOD, _tensor("weights/fc2.bias", np.ones(1, np.float32))]}, 400,
     "'weights' is sent twice"),
    ({"inputs": [*GOOD, _tensor("outputs", np.ones(2, np.float32))]}, 400,
     "'outputs' is not a tensor"),
    ({"inputs": [GOOD[0], {"name": "targets", "shape": [6], "datatype": "INT64",
                           "data": [HUGE, *[1] * 5]}]}, 422, "INT64 numbers"),
    ({"inputs": [GOOD[0], {"name": "targets", "shape": [6], "datatype": "UINT8",
                           "data": [-1, *[1] * 5]}]}, 422, "UINT8 numbers"),
    ({"inputs": [{"name": "inputs", "shape": [4294967296, 4294967296, 4], "datatype": "FP32",
                  "data": []}, GOOD[1]]}, 413, "elements; the limit is"),
    ({"inputs": [{"name": "inputs", "shape": [6, 8], "datatype": "FP32",
                  "parameters": {"binary_data_size": 192}}, GOOD[1]]}, 422,
     "binary_data_size 192 does not hold [6, 8] FP32 (192 bytes) in the 0 bytes left"),
])
def test_a_bad_request_is_a_protocol_error_naming_what_to_fix(
        url: str, doc: dict[str, Any], status: int, word: str) -> None:
    """Parameters of the wrong type, an input clashing with a parameter or naming a field that
    is no tensor, values past their datatype's range and a shape whose size passes every
    integer: each a 4xx in the protocol's shape, and the next request is answered."""
    body = {"inputs": GOOD, "parameters": {"loss": "mse"}, **doc}
    body["parameters"] = {"loss": "mse", **body["parameters"]}
    r = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error"} and word in r.json()["error"], r.text
    ok = httpx.post(f"{url}/v2/models/{MODEL}/infer", timeout=30,
                    json={"inputs": GOOD, "parameters": {"loss": "mse"}})
    assert ok.status_code == 200, ok.text


def test_a_body_past_the_limit_is_413_and_an_answer_not_finite_is_null() -> None:
    """The protocol's body is held to PSGRAD_MAX_BODY_BYTES as every body is; an answer's
    value that is not finite is JSON's null, as POST /per-sample-grads answers it."""
    with serving(create_app(settings(workers=1, batch_max_delay_ms=0.0,
                                     max_body_bytes=20_000))) as u:
        padded = b'{"inputs": []' + b" " * 30_000 + b"}"
        r = httpx.post(f"{u}/v2/models/{MODEL}/infer", content=padded, timeout=30)
        assert r.status_code == 413 and "PSGRAD_MAX_BODY_BYTES" in r.json()["error"], r.text
        far = np.full_like(Y, 3e38)  # the loss's gradient -6e38 is past float32: NaN norms
        r = httpx.post(f"{u}/v2/models/{MODEL}/infer", timeout=30, json={
            "inputs": [GOOD[0], _tensor("targets", far)], "parameters": {"loss": "mse"}})
        assert r.status_code == 200, r.text
        assert r.json()["outputs"][0]["data"] == [None] * len(X)


def test_keys_and_tenants_hold_as_everywhere() -> None:
    app = create_app(settings(api_keys="alice:k-alice", workers=1, batch_max_delay_ms=0.0))
    with serving(app) as u:
        c = client(u)
        with pytest.raises(utils.InferenceServerException) as caught:
            c.get_model_metadata(MODEL)
        assert caught.value.status() == "401" and "API key" in str(caught.value)
        result = c.infer(MODEL, inputs(binary=True), parameters={"loss": "mse"},
                         headers={"Authorization": "Bearer k-alice"})
        np.testing.assert_allclose(result.as_numpy("norms"), loop_summary()["norms"].numpy(),
                                   rtol=1e-5, atol=1e-6)


def test_a_dp_step_answers_its_epsilon_and_takes_an_idempotency_key(url: str) -> None:
    """A DP run's step through the protocol answers the privacy spent so far in its
    parameters (it answered none: a step counted, its epsilon unsaid), and under an
    Idempotency-Key a try sent again answers the first's noisy mean, one step counted."""
    run = httpx.post(f"{url}/dp-runs", timeout=30, json={
        "model": MODEL, "clip_norm": 1.0, "noise_multiplier": 1.0, "sample_rate": 0.01,
        "dataset_size": 600, "delta": 1e-5, "max_epsilon": 10}).json()
    body = {"inputs": GOOD, "parameters": {"loss": "mse", "outputs": ["clipped_mean"],
                                           "dp_run": run["id"]}}
    key = {"Idempotency-Key": "oip-step-1"}
    first = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, headers=key, timeout=30)
    assert first.status_code == 200, first.text
    params = first.json()["parameters"]
    assert (params["dp_run"], params["dp_steps"], params["dp_accountant"]) == (
        run["id"], 1, "rdp")
    assert 0 < params["dp_epsilon"] <= 10 and params["dp_delta"] == 1e-5
    again = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, headers=key, timeout=30)
    assert again.json()["outputs"] == first.json()["outputs"]
    assert httpx.delete(url + first.headers["content-location"], timeout=30).status_code == 200
    new = httpx.post(f"{url}/v2/models/{MODEL}/infer", json=body, timeout=30,
                     headers={"Idempotency-Key": "oip-step-2"})
    assert new.json()["parameters"]["dp_steps"] == 2
    assert httpx.get(f"{url}/dp-runs/{run['id']}", timeout=30).json()["steps"] == 2


def test_a_float64_models_metadata_says_the_outputs_are_fp64(url: str) -> None:
    """A float64 model answers FP64 tensors, and its metadata says so (it said FP32 for every
    output: a client that sizes its buffers from it read them wrong)."""
    net = torch.nn.Sequential(torch.nn.Linear(6, 3)).double().eval()
    program = torch.export.export(net, (torch.randn(1, 6, dtype=torch.float64),))
    with psgrad.Client(url) as sdk:
        sdk.models.register_exported("f64-oip", program, default_loss="cross_entropy")
    meta = client(url).get_model_metadata("f64-oip")
    assert {o["datatype"] for o in meta["outputs"]} == {"FP64"}
    assert meta["inputs"][0]["datatype"] == "FP64"
    r = httpx.post(f"{url}/v2/models/f64-oip/infer", timeout=30, json={
        "inputs": [_tensor("inputs", np.ones((2, 6)), "FP64"),
                   _tensor("targets", np.array([0, 2]), "INT64")],
        "parameters": {"outputs": "norms"}})
    assert r.status_code == 200 and r.json()["outputs"][0]["datatype"] == "FP64", r.text
