"""The Redis model store against the real server: shared by processes, outlives them."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis
import torch

from service import registration
from service.model_store import ModelRecord, RedisModelStore
from service.registry import ModelRegistry
from tests.support.layers import LIMITS, MLP
from tests.support.redis import prefix_on

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture
def prefix() -> Iterator[str]:
    client = redis.Redis.from_url(REDIS_URL)
    with prefix_on(client) as name:
        yield name
    client.close()


def _registry(prefix: str) -> ModelRegistry:
    return ModelRegistry(device=torch.device("cpu"),
                         store=RedisModelStore(redis.Redis.from_url(REDIS_URL), prefix))


def test_versions_order_and_delete(prefix: str) -> None:
    store = RedisModelStore(redis.Redis.from_url(REDIS_URL), prefix)
    a = ModelRecord("m", "0" * 16, "sequential", {"k": 1}, b"\x00\x01", 1.0)
    b = ModelRecord("m", "1" * 16, "sequential", {"k": 1}, b"\x02", 2.0)
    store.put(a)
    store.put(b)
    assert store.versions("m") == [a.version, b.version]
    assert store.latest("m") == b.version and store.get("m", a.version) == a
    assert store.get("m", a.version, weights=False) == ModelRecord(
        "m", a.version, "sequential", {"k": 1}, b"", 1.0)  # the spec alone
    store.put(a)  # the same version again becomes the newest
    assert store.latest("m") == a.version
    assert store.delete("m", a.version) == [a.version]
    assert store.ids() == ["m"] and not store.has("m", a.version)
    assert store.delete("m") == [b.version]
    assert store.ids() == [] and store.delete("m") == []


def test_every_process_sees_the_models_and_they_survive_a_restart(prefix: str) -> None:
    api = _registry(prefix)
    worker = _registry(prefix)
    model = registration.register(api, "shared", {**MLP, "weights": {
        "0.weight": [[1, 2, 3, 4], [4, 3, 2, 1]], "0.bias": [0.0, 1.0]}}, LIMITS)
    assert worker.get("shared").version == model.version
    assert worker.get("shared").params["0.bias"].tolist() == [0.0, 1.0]
    newer = registration.register(api, "shared", MLP, LIMITS)
    assert worker.get("shared").version == newer.version  # the plain id follows the newest
    restarted = _registry(prefix)
    assert restarted.ids()[-1] == "shared"
    assert restarted.store.versions("shared") == [model.version, newer.version]
    torch.testing.assert_close(restarted.get(f"shared@{model.version}").params, model.params,
                               rtol=0, atol=0)
    registration.delete(restarted, "shared")
    with pytest.raises(registration.UnknownModel):
        worker.get("shared")
