"""The gradient noise scale over HTTP: JSON and safetensors answers against the per-sample loop."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import psgrad
from service.registry import ModelRegistry
from tests.support.api import finished_job, open_client, post_st
from tests.support.reference import assert_noise_scale, loop_noise_scales

rng = np.random.default_rng(7)
X = rng.standard_normal((6, 8)).astype(np.float32)
Y = rng.standard_normal(6).astype(np.float32)
DOC = {"model": "value-mlp", "loss": "mse", "inputs": X.tolist(), "targets": Y.tolist(),
       "outputs": ["gns", "layer_gns"]}


def loop_fields() -> dict[str, Any]:
    """Every noise-scale field by its definition, from the per-sample loop's gradients."""
    data = {"inputs": torch.from_numpy(X), "targets": torch.from_numpy(Y)}
    return loop_noise_scales(ModelRegistry().get("value-mlp").module, data, "mse")


async def test_the_noise_scale_in_json_and_safetensors_equals_the_loops() -> None:
    want = loop_fields()
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json=DOC)
        assert r.status_code == 200, r.text
        r2, fields = await post_st(c, dict(DOC))
        assert r2.status_code == 200, r2.text
    body = r.json()
    assert [k for k in body if "gns" in k] == ["gns", "gns_trace", "gns_grad_sq", "layer_gns",
                                               "layer_gns_trace", "layer_gns_grad_sq"]
    assert isinstance(body["gns"], float) and isinstance(body["gns_trace"], float)
    assert list(body["layer_gns"]) == list(want["layer_gns"])
    for got in (body, fields):
        for name in ("gns", "layer_gns"):
            assert_noise_scale(name, got, want, name)
    assert fields["gns"].shape == ()
    assert all(v.shape == () for v in fields["layer_gns"].values())
    # the whole model's estimates are the sums of the parameters'
    assert body["gns_trace"] == pytest.approx(sum(body["layer_gns_trace"].values()), rel=1e-5)


async def test_one_sample_has_no_noise_scale() -> None:
    async with open_client() as c:
        for route in ("/per-sample-grads", "/jobs"):
            r = await c.post(route, json={**DOC, "inputs": X[:1].tolist(),
                                          "targets": Y[:1].tolist(), "outputs": ["layer_gns"]})
            if route == "/jobs":  # the batch's size is read with the model: the job fails
                assert r.status_code == 202, r.text
                job = await finished_job(c, r.json()["job_id"])
                assert job["status"] == "failed", job
                error = job["error"]
            else:
                assert r.status_code == 422, r.text
                error = r.json()["error"]
            assert error["code"] == "invalid_input"
            assert "'layer_gns'" in error["message"] and "at least 2" in error["message"]
            assert "got a batch of 1" in error["message"]


async def test_the_openapi_document_names_the_estimates() -> None:
    async with open_client() as c:
        doc = (await c.get("/openapi.json")).json()
    fields = doc["components"]["schemas"]["GradsResponse"]["properties"]
    assert {"gns", "gns_trace", "gns_grad_sq", "layer_gns", "layer_gns_trace",
            "layer_gns_grad_sq"} <= set(fields)
    assert "tr(Sigma) / |G|^2" in fields["gns"]["description"]
    request = doc["components"]["schemas"]["GradsRequest"]["properties"]["outputs"]
    assert "gns" in str(request)


def test_the_running_noise_scale_is_the_ratio_of_the_estimates_averages() -> None:
    """Over steps of known estimates: the EMAs by hand, their ratio, not the ratios' average."""
    steps = [(4.0, 1.0, {"w": (2.0, 0.5)}), (2.0, -0.2, {"w": (1.0, 0.25)}),
             (3.0, 2.0, {"w": (1.5, 1.0)})]
    ema = psgrad.NoiseScale(beta=0.5)
    assert ema.value == 0.0 and ema.trace == 0.0
    trace = grad_sq = 0.0
    for t, g, layers in steps:
        answer = {"gns": t / g, "gns_trace": t, "gns_grad_sq": g,
                  "layer_gns_trace": {k: v[0] for k, v in layers.items()},
                  "layer_gns_grad_sq": {k: v[1] for k, v in layers.items()}}
        trace, grad_sq = 0.5 * trace + 0.5 * t, 0.5 * grad_sq + 0.5 * g
        assert ema.update(answer) == pytest.approx(trace / grad_sq)
    assert ema.trace == pytest.approx(trace / (1 - 0.5**3))  # bias-corrected as Adam's
    assert ema.grad_sq == pytest.approx(grad_sq / (1 - 0.5**3))
    assert ema.layers == {"w": pytest.approx((0.125 * 2 + 0.25 * 1 + 0.5 * 1.5)
                                             / (0.125 * 0.5 + 0.25 * 0.25 + 0.5 * 1.0))}
    assert ema.value != pytest.approx(sum(t / g for t, g, _ in steps) / 3)
    with pytest.raises(KeyError, match="outputs=\\['gns'\\]"):
        ema.update({"norms": 1.0})
    with pytest.raises(ValueError, match="beta must be in"):
        psgrad.NoiseScale(beta=1.0)
