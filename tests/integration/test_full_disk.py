"""A full data directory (a real tmpfs, as small as an unlucky volume): appending to a store
answers 507 insufficient_storage, leaves no temporary file (the disk does not stay full), keeps
what was committed before, and the directory takes samples again once there is room."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.api import open_client
from tests.support.stores import mlp_samples
from tests.support.volumes import tmpfs

DIM = 256


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "disk", "2m") as folder:
        yield folder


async def test_a_full_data_directory_is_a_507_that_leaves_nothing(small_disk: Path) -> None:
    async with open_client(data_dir=str(small_disk)) as c:
        r = await c.put("/stores/train", json={"model": "mlp", "projection_dim": DIM})
        assert r.status_code == 201, r.text
        held = 0
        for step in range(100):  # 64 samples of 256 floats a batch, and the store's Gram
            r = await c.post("/stores/train/samples", json=mlp_samples(64, 64 * step))
            if r.status_code != 200:
                break
            held = r.json()["samples"]
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "insufficient_storage" and "full" in error["message"]
        assert held > 0 and (await c.get("/stores/train")).json()["samples"] == held
        assert not list(small_disk.rglob(".tmp-*"))  # the failed write left nothing
        assert (await c.delete("/stores/train")).status_code == 200  # room again
        r = await c.put("/stores/again", json={"model": "mlp", "projection_dim": DIM})
        assert r.status_code == 201, r.text
        r = await c.post("/stores/again/samples", json=mlp_samples(64, 0))
        assert r.status_code == 200 and r.json()["samples"] == 64, r.text


@pytest.fixture
def small_model_dir(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "models", "1m") as folder:
        yield folder


async def test_a_full_model_directory_is_a_507_that_leaves_no_partial_version(
        small_model_dir: Path) -> None:
    """Issue 53's rerun: registering models (or uploading weights) into a full
    ``PSGRAD_MODEL_DIR`` answered 500 ``internal_error``; the model directory is a disk like
    the data directory, so it answers the same 507, and no version is left half written."""
    async with open_client(model_dir=str(small_model_dir)) as c:
        body = {"architecture": "mlp", "config": {"sizes": [64, 64, 10]}}
        for n in range(200):  # about 21 KB of weights each
            r = await c.put(f"/models/m{n}", json=body)
            if r.status_code != 200:
                break
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "insufficient_storage" and "PSGRAD_MODEL_DIR" in error["message"]
        r = await c.put("/models/m0/weights", content=_weights(),
                        headers={"Content-Type": "application/x-safetensors"})
        assert r.status_code == 507, r.text
        assert not list(small_model_dir.rglob("*.tmp"))
        weights = {p.with_suffix("") for p in small_model_dir.rglob("*.safetensors")}
        assert weights == {p.with_suffix("") for p in small_model_dir.rglob("*.json")}
        ids = {m["id"] for m in (await c.get("/models")).json()["models"]}
        assert f"m{n - 1}" in ids and f"m{n}" not in ids  # the refused one is not listed


def _weights() -> bytes:
    from safetensors.numpy import save

    rng = np.random.default_rng(0)
    return save({"fc1.weight": rng.normal(size=(64, 64)).astype(np.float32),
                 "fc1.bias": np.zeros(64, np.float32),
                 "fc2.weight": rng.normal(size=(10, 64)).astype(np.float32),
                 "fc2.bias": np.zeros(10, np.float32)})
