"""The SDK, the ``psgrad`` command and the examples against ``psgrad serve`` on a loopback port."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import psgrad
from tests.support.client import psgrad_serve

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 32  # the server's batch limit: larger batches exercise the SDK's chunking


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with psgrad_serve({"PSGRAD_MAX_BATCH_SIZE": str(LIMIT)}) as u:
        yield u


def cli(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", "service.cli", *args, "--url", url],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def test_the_sdk_over_http_chunks_and_matches(url: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 8)).astype(np.float32)
    y = rng.normal(size=70).astype(np.float32)
    outputs = ["norms", "mean", "variance", "cosine_mean", "clipped_mean"]
    with psgrad.Client(base_url=url) as client:
        chunked = client.per_sample_grads("value-mlp", x, y, loss="mse", outputs=outputs,
                                          clip_norm=0.1)
        assert client.max_batch_size == LIMIT and chunked.meta["requests"] == 6
        first = client.per_sample_grads("value-mlp", x[:LIMIT], y[:LIMIT], loss="mse",
                                        outputs=["norms", "mean"])
    np.testing.assert_allclose(chunked.norms[:LIMIT], first.norms, rtol=1e-5)
    # mean over all 70 from the server's per-chunk means weighted by size = the chunked mean
    assert set(chunked.mean) == set(first.mean)
    assert chunked.cosine_mean.shape == (70,) and np.all(np.abs(chunked.cosine_mean) <= 1 + 1e-5)


def test_large_answers_land_in_their_arrays_and_match_the_per_sample_loop(url: str) -> None:
    """Grads of 3 MB a sample: the sync SDK receives them from the socket into the arrays
    (psgrad._receive), closes that connection and goes on with a new one."""
    from service.registry import ModelRegistry
    from tests.support.reference import per_sample_loop

    rng = np.random.default_rng(3)
    x = rng.normal(size=(3, 784)).astype(np.float32)
    y = np.array([1, 7, 3])
    with psgrad.Client(base_url=url) as client:
        answers = [client.per_sample_grads("mlp", x, y, outputs=["grads", "norms"])
                   for _ in range(2)]
    module = ModelRegistry().get("mlp").module
    want = per_sample_loop(module, {"inputs": torch.from_numpy(x),
                                    "targets": torch.from_numpy(y)}, "cross_entropy")
    for got in answers:
        assert sum(g.nbytes for g in got.grads.values()) > 3 << 20
        assert list(got.grads) == list(want.grads)
        for k, g in want.grads.items():
            np.testing.assert_allclose(got.grads[k], g.cpu().numpy(), rtol=1e-4, atol=1e-6,
                                       err_msg=k)
        np.testing.assert_allclose(got.norms, want.norms.cpu().numpy(), rtol=1e-4)


async def test_the_async_sdk_over_http(url: str) -> None:
    async with psgrad.AsyncClient(base_url=url) as client:
        job = await client.submit("linear-value", [[2.0, 1.0, -2.0]], loss="td0",
                                  outputs=["updates"], next_inputs=[[1.0, 2.0, 0.0]],
                                  rewards=[2.0], weights={"theta": [0.2, -0.2, 0.1]})
        result = await job.result(timeout=60)
    np.testing.assert_allclose(result.updates["theta"][0], [3.6, 1.8, -3.6], rtol=1e-6)


def test_help_everywhere() -> None:
    for args in ([], ["models"], ["models", "list"], ["models", "show"], ["models", "register"],
                 ["models", "upload"], ["models", "download"], ["models", "delete"], ["grads"],
                 ["serve"], ["worker"]):
        out = subprocess.run([sys.executable, "-m", "service.cli", *args, "--help"],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "usage: psgrad" in out.stdout, (args, out.stderr)


def test_models_commands(url: str, tmp_path: Path) -> None:
    listed = cli(url, "models", "list").stdout
    assert "simple-cnn" in listed and "ID" in listed.splitlines()[0]
    shown = json.loads(cli(url, "models", "show", "linear-value").stdout)
    assert shown["parameters"]["theta"]["shape"] == [3]
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"sizes": [3, 4, 2], "activation": "relu"}))
    ref = cli(url, "models", "register", "cli-mlp", "--architecture", "mlp",
              "--config", f"@{config}").stdout.strip()
    try:
        assert ref.startswith("cli-mlp@")
        weights = tmp_path / "w.safetensors"
        cli(url, "models", "download", "cli-mlp", str(weights))
        state = load_file(str(weights))
        assert set(state) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
        save_file({k: np.zeros_like(v) for k, v in state.items()}, str(weights))
        new_ref = cli(url, "models", "upload", "cli-mlp", str(weights)).stdout.strip()
        assert new_ref != ref and new_ref.startswith("cli-mlp@")
    finally:
        cli(url, "models", "delete", "cli-mlp")
    missing = cli(url, "models", "show", "cli-mlp", check=False)
    assert missing.returncode == 1 and "UnknownModel" in missing.stderr


def test_grads_command_reads_npy_and_safetensors_and_writes_safetensors(
        url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(40, 8)).astype(np.float32)
    y = rng.normal(size=40).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    out = tmp_path / "out.safetensors"
    run = cli(url, "grads", "value-mlp", "--inputs", str(tmp_path / "x.npy"), "--targets",
              str(tmp_path / "y.npy"), "--loss", "mse", "--outputs", "norms,layer_norms,mean",
              "-o", str(out), "--progress")
    assert "40/40 samples" in run.stderr  # the batch is above the limit: chunked, with a bar
    tensors = load_file(str(out))
    with psgrad.Client(base_url=url) as client:
        want = client.per_sample_grads("value-mlp", x, y, loss="mse",
                                       outputs=["norms", "layer_norms", "mean"])
    np.testing.assert_allclose(tensors["norms"], want.norms, rtol=1e-6)
    for k, v in want.mean.items():
        np.testing.assert_allclose(tensors[f"mean/{k}"], v, rtol=1e-5, atol=1e-7)
    both = tmp_path / "batch.safetensors"
    save_file({"inputs": x[:5], "targets": y[:5]}, str(both))
    cli(url, "grads", "value-mlp", "--inputs", str(both), "--loss", "mse", "-o", str(out))
    np.testing.assert_allclose(load_file(str(out))["grads/net.fc1.bias"].shape, (5, 64))
    np.save(tmp_path / "obj.npy", np.array([{"a": 1}], dtype=object), allow_pickle=True)
    refused = cli(url, "grads", "value-mlp", "--inputs", str(tmp_path / "obj.npy"), "-o",
                  str(out), check=False)
    assert refused.returncode != 0 and "pickle" in refused.stderr.lower()


@pytest.mark.parametrize(("script", "args"), [
    ("pytorch_tutorial.py", ["--batch-size", "8"]),
    ("mindspore_td0.py", []),
    ("dp_sgd.py", ["--steps", "10"]),
    ("find_mislabelled.py", []),
])
def test_examples_run(url: str, script: str, args: list[str]) -> None:
    out = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args],
                         env={**os.environ, "PSGRAD_URL": url}, capture_output=True,
                         text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip()
