"""Each server has a data folder of its own unless PSGRAD_DATA_DIR names one: a second server a
user starts (another port, another Redis queue) never lists the first one's tenants' stores,
while the api and workers of one queue, and a restart on one port, share theirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.config import Settings
from service.stores import data_dir
from tests.support.api import open_client


def test_one_folder_per_server(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    base = tmp_path / "psgrad"
    assert data_dir(Settings(listen_port=8000)) == str(base / "port-8000")
    assert data_dir(Settings(listen_port=8001)) == str(base / "port-8001")
    queue = Settings(redis_url="redis://a:6379/0", redis_prefix="p")
    assert data_dir(queue) == data_dir(queue.model_copy())  # its api and its workers
    assert data_dir(queue) != data_dir(queue.model_copy(update={"redis_prefix": "q"}))
    assert data_dir(Settings(data_dir="s3://bucket/x", listen_port=1)) == "s3://bucket/x"


async def test_a_second_server_does_not_list_the_first_ones_stores(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    keys = {"api_keys": "alice:alice-key", "data_dir": None}
    alice = {"authorization": "Bearer alice-key"}
    async with open_client(listen_port=8000, **keys) as first:
        r = await first.put("/stores/mine", headers=alice, json={"model": "mlp",
                                                                 "projection_dim": 16})
        assert r.status_code == 201, r.text
    async with open_client(listen_port=8001, data_dir=None) as second:  # no keys: everyone
        assert (await second.get("/stores")).json()["stores"] == []
    async with open_client(listen_port=8000, **keys) as again:  # a restart keeps its own
        assert [s["id"] for s in (await again.get("/stores", headers=alice)).json()["stores"]] \
            == ["mine"]
