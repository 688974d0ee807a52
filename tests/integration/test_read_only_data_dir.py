"""A data directory that turns read-only between two appends (a real tmpfs remounted read-only,
as a volume is after a disk error): the append answers 507 ``insufficient_storage`` whose
message says the directory is read-only and what to do, commits nothing, leaves the store
readable and queryable with its earlier rows, and the next append succeeds once the volume is
read-write again. A DP run's ledger under a read-only ``PSGRAD_MODEL_DIR`` refuses the step
(507) and releases nothing. Needs root (mount); skipped elsewhere, saying why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tests.support.api import open_client
from tests.support.stores import mlp_samples
from tests.support.volumes import remount, tmpfs

DIM = 64


@pytest.fixture
def volume(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "volume", "64m") as folder:
        yield folder


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def read_only_error(r: object) -> dict[str, object]:
    assert r.status_code == 507, r.text  # type: ignore[attr-defined]
    error: dict[str, object] = r.json()["error"]  # type: ignore[attr-defined]
    assert error["code"] == "insufficient_storage", error
    message = str(error["message"])
    assert "read-only" in message and "remount" in message and "Traceback" not in message
    assert error["details"]["reason"] == "read_only", error  # type: ignore[index]
    return error


async def test_a_data_directory_read_only_mid_append_is_a_507_and_commits_nothing(
        volume: Path) -> None:
    async with open_client(data_dir=str(volume)) as c:
        r = await c.put("/stores/train", json={"model": "mlp", "projection_dim": DIM})
        assert r.status_code == 201, r.text
        r = await c.post("/stores/train/samples", json=mlp_samples(16, 0))
        assert r.status_code == 200 and r.json()["samples"] == 16, r.text
        query = {"k": 3, "score": "dot", **{k: v for k, v in mlp_samples(2, 100).items()
                                             if k != "ids"}}
        before = await c.post("/stores/train/query", json=query)
        assert before.status_code == 200, before.text
        held = files_under(volume)

        remount(volume, "ro")
        read_only_error(await c.post("/stores/train/samples", json=mlp_samples(16, 16)))
        assert files_under(volume) == held  # no shard, no temporary file, no manifest
        r = await c.get("/stores/train")
        assert r.status_code == 200 and r.json()["samples"] == 16, r.text
        after = await c.post("/stores/train/query", json=query)
        assert after.status_code == 200 and after.json() == before.json(), after.text
        read_only_error(await c.put("/stores/other", json={"model": "mlp",
                                                           "projection_dim": DIM}))
        read_only_error(await c.delete("/stores/train"))

        remount(volume, "rw")
        r = await c.post("/stores/train/samples", json=mlp_samples(16, 16))
        assert r.status_code == 200 and r.json()["samples"] == 32, r.text
        assert not list(volume.rglob(".tmp-*"))


async def test_a_dp_ledger_read_only_mid_run_refuses_the_step(volume: Path) -> None:
    async with open_client(model_dir=str(volume)) as c:
        r = await c.post("/dp-runs", json={
            "model": "mlp", "clip_norm": 1.0, "noise_multiplier": 2.0, "sample_rate": 0.04,
            "expected_batch_size": 8, "delta": 1e-5, "max_epsilon": 10.0})
        assert r.status_code == 201, r.text
        run = r.json()["id"]
        step = {"model": "mlp", "inputs": np.zeros((2, 784)).tolist(), "targets": [0, 1],
                "outputs": ["clipped_mean"], "dp_run": run}
        r = await c.post("/per-sample-grads", json=step)
        assert r.status_code == 200 and r.json()["dp"]["steps"] == 1, r.text

        remount(volume, "ro")
        r = await c.post("/per-sample-grads", json=step)
        assert r.status_code == 507, r.text
        error = r.json()["error"]
        assert error["code"] == "insufficient_storage" and "read-only" in error["message"]
        assert "clipped_mean" not in r.text  # nothing released
        assert (await c.get(f"/dp-runs/{run}")).json()["steps"] == 1

        remount(volume, "rw")
        r = await c.post("/per-sample-grads", json=step)
        assert r.status_code == 200 and r.json()["dp"]["steps"] == 2, r.text
        assert (volume / ".dp-runs" / run / "steps.log").read_text().count("\n") == 2
