"""``psgrad stores ...`` against ``psgrad serve``: a store made, filled from .npy and
.safetensors files (string ids from a .npy), resumed without sending an id twice, queried and
deleted; the query equals the SDK's."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import psgrad
from tests.support.client import psgrad_serve

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def url(tmp_path: Path) -> Iterator[str]:
    with psgrad_serve({"PSGRAD_DATA_DIR": str(tmp_path / "data")}) as u:
        yield u


def cli(url: str, *args: str, code: int = 0) -> str:
    """The command's output; ``code``: the exit status it must end with (stderr follows the
    output when it is not 0)."""
    out = subprocess.run([sys.executable, "-m", "service.cli", *args, "--url", url],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert out.returncode == code, out.stdout + out.stderr
    return out.stdout if code == 0 else out.stdout + out.stderr


def test_stores_commands(url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((40, 784)).astype(np.float32), rng.integers(0, 10, 40)
    np.save(tmp_path / "x.npy", x)
    save_file({"targets": y}, str(tmp_path / "y.safetensors"))
    np.save(tmp_path / "ids.npy", np.asarray([f"train-{i}" for i in range(40)]))
    np.save(tmp_path / "x_half.npy", x[:20])
    np.save(tmp_path / "y_half.npy", y[:20])
    np.save(tmp_path / "ids_half.npy", np.asarray([f"train-{i}" for i in range(20)]))

    made = json.loads(cli(url, "stores", "create", "train", "mlp", "--projection-dim", "64",
                          "--dtype", "float16"))
    assert made["samples"] == 0 and made["model"].startswith("mlp@")
    half = json.loads(cli(url, "stores", "add", "train", "--inputs", str(tmp_path / "x_half.npy"),
                          "--targets", str(tmp_path / "y_half.npy"), "--ids",
                          str(tmp_path / "ids_half.npy"), "--batch-size", "8"))
    assert half["samples"] == 20 and half["commits"] == 3
    resumed = cli(url, "stores", "add", "train", "--inputs", str(tmp_path / "x.npy"),
                  "--targets", str(tmp_path / "y.safetensors"), "--ids",
                  str(tmp_path / "ids.npy"), "--batch-size", "16", "--no-progress", code=3)
    whole = json.loads(resumed.splitlines()[0])  # the first 20 ids skipped, and said so
    assert whole["samples"] == 40 and whole["commits"] == 5
    assert (whole["added"], whole["skipped"]) == (20, 20)
    assert "20 of 40 samples skipped: store train held their ids" in resumed
    # without ids, a store with samples is not numbered from 0 again (all 40 were skipped)
    refused = cli(url, "stores", "add", "train", "--inputs", str(tmp_path / "x_half.npy"),
                  "--targets", str(tmp_path / "y_half.npy"), code=1)
    assert "holds 40 samples" in refused and "--first-id 40" in refused
    assert "past the ids it holds" in refused  # they need not be 0 to 39 (these are strings)
    zero = cli(url, "stores", "add", "train", "--inputs", str(tmp_path / "x_half.npy"),
               "--targets", str(tmp_path / "y_half.npy"), "--first-id", "100", "--batch-size",
               "0", code=1)  # refused as -1 is, not read as the default
    assert "'batch_size' must be a positive integer" in zero, zero
    assert json.loads(cli(url, "stores", "show", "train"))["samples"] == 40
    assert [s["id"] for s in json.loads(cli(url, "stores", "list"))] == ["train"]

    np.save(tmp_path / "tx.npy", x[:3])
    np.save(tmp_path / "ty.npy", y[:3])
    got = json.loads(cli(url, "stores", "query", "train", "--inputs", str(tmp_path / "tx.npy"),
                         "--targets", str(tmp_path / "ty.npy"), "-k", "4", "--score", "trak"))
    with psgrad.Client(base_url=url) as client:
        want = client.stores.get("train").query(x[:3], y[:3], k=4, score="trak")
    assert got["ids"] == want.ids.tolist() and got["score"] == "trak"
    np.testing.assert_allclose(got["scores"], want.scores, rtol=1e-6)
    top = json.loads(cli(url, "stores", "query", "train", "--score", "self_influence", "-k", "2"))
    assert np.asarray(top["ids"]).shape == (1, 2)

    # the same sketches imported as rows rank the same (--rows, then the store's query)
    with psgrad.Client(base_url=url) as client:
        phi = client.per_sample_grads("mlp", x, y, outputs=["projection"],
                                      projection_dim=64).projection
    np.save(tmp_path / "rows.npy", np.asarray(phi, np.float32))
    cli(url, "stores", "create", "rows", "mlp", "--projection-dim", "64", "--dtype", "float16")
    imported = json.loads(cli(url, "stores", "add", "rows", "--rows", str(tmp_path / "rows.npy"),
                              "--ids", str(tmp_path / "ids.npy"), "--no-progress"))
    assert (imported["samples"], imported["added"], imported["commits"]) == (40, 40, 1)
    again = json.loads(cli(url, "stores", "query", "rows", "--inputs", str(tmp_path / "tx.npy"),
                           "--targets", str(tmp_path / "ty.npy"), "-k", "4", "--score", "trak"))
    assert again["ids"] == got["ids"]
    # float16 rows: a sketch computed in another batch (40 at once here, 8 and 16 there) can
    # round to the neighbouring float16 (seen on Xeon with AVX-512: scores 2e-5 apart)
    np.testing.assert_allclose(again["scores"], got["scores"], rtol=1e-3)
    assert json.loads(cli(url, "stores", "delete", "train"))["deleted"] is True


def test_stores_factors_and_ekfac_query(url: str, tmp_path: Path) -> None:
    """``psgrad stores factors`` fits a store of full gradients (resumed with --resume), and
    ``query --score ekfac --damping`` answers the SDK's."""
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((30, 6)).astype(np.float32), rng.integers(0, 3, 30)
    for name, value in (("x", x), ("y", y), ("x_part", x[:12]), ("y_part", y[:12]),
                        ("tx", x[:2]), ("ty", y[:2])):
        np.save(tmp_path / f"{name}.npy", value)
    with psgrad.Client(base_url=url) as client:
        client.models.register("small", architecture="mlp", config={"sizes": [6, 5, 3]})
    cli(url, "stores", "create", "full", "small")
    cli(url, "stores", "add", "full", "--inputs", str(tmp_path / "x.npy"), "--targets",
        str(tmp_path / "y.npy"), "--no-progress")
    part = json.loads(cli(url, "stores", "factors", "full", "--inputs",
                          str(tmp_path / "x_part.npy"), "--targets", str(tmp_path / "y_part.npy"),
                          "--no-progress"))
    assert part["factors"]["samples"] == part["factors"]["eigenvalues"] == 12
    done = json.loads(cli(url, "stores", "factors", "full", "--inputs", str(tmp_path / "x.npy"),
                          "--targets", str(tmp_path / "y.npy"), "--resume", "--batch-size", "8",
                          "--no-progress"))
    assert (done["factors"]["samples"], done["fitted"], done["skipped"]) == (30, 18, 12)
    assert done["factors"]["eigenvalues"] == 30  # the factors' new bases: all of them again
    got = json.loads(cli(url, "stores", "query", "full", "--inputs", str(tmp_path / "tx.npy"),
                         "--targets", str(tmp_path / "ty.npy"), "-k", "3", "--score", "ekfac",
                         "--damping", "0.05"))
    with psgrad.Client(base_url=url) as client:
        want = client.stores.get("full").query(x[:2], y[:2], k=3, score="ekfac", damping=0.05)
    assert got["ids"] == want.ids.tolist() and got["damping"] == 0.05 == want.damping
    np.testing.assert_allclose(got["scores"], want.scores, rtol=1e-6)
