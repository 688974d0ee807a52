"""The compiled-function cache: padded pieces give the eager results, artifacts go through Redis
signed, and a worker without the secret (or with another) never loads them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import redis
import torch

from service import engine, redis_keys
from service.compile_cache import CompiledFunctions, pieces
from service.config import Settings
from service.registry import ModelRegistry
from service.validate import parse_request
from tests.support.redis import SHARED_URL, prefix_on, redis_or_skip


def test_pieces_cover_and_bound_the_padding() -> None:
    for n in range(1, 300):
        parts = pieces(n)
        assert sum(real for real, _ in parts) == n
        for real, padded in parts:
            assert padded & (padded - 1) == 0 and real <= padded <= real * 1.25
    assert pieces(48) == [(32, 32), (16, 16)]
    assert pieces(7) == [(7, 8)]


@pytest.fixture
def shared() -> Iterator[tuple[redis.Redis, str]]:
    client = redis_or_skip()
    with prefix_on(client) as prefix:
        yield client, prefix
    client.close()


def _request(b: int) -> dict[str, Any]:
    rng = np.random.default_rng(b)
    return {"model": "value-mlp", "loss": "td0",
            "inputs": rng.standard_normal((b, 8)).astype(np.float32),
            "next_inputs": rng.standard_normal((b, 8)).astype(np.float32),
            "rewards": rng.standard_normal(b).astype(np.float32),
            "outputs": ["grads", "norms", "mean", "variance", "td_errors"]}


def test_compiled_equals_eager_and_shares_signed_artifacts(
        shared: tuple[redis.Redis, str]) -> None:
    client, prefix = shared
    settings = Settings(redis_url=SHARED_URL, redis_prefix=prefix, compile_secret="s3cret")
    registry = ModelRegistry(torch.device("cpu"))
    parsed = parse_request(_request(7), registry)  # 7 samples run padded to 8
    writer = CompiledFunctions(settings, client, writer=True)
    eager = engine.compute(parsed.model, parsed.batch, parsed.opts, [3, 4])
    compiled = engine.compute(parsed.model, parsed.batch, parsed.opts, [3, 4], compiled=writer)
    for want, got in zip(eager, compiled, strict=True):  # padded rows dropped before statistics
        for name in parsed.opts.outputs:
            a, b = want[name], got[name]
            pairs = [(a[k], b[k]) for k in a] if isinstance(a, dict) else [(a, b)]
            for x, y in pairs:
                torch.testing.assert_close(y.detach(), x.detach(), rtol=1e-4, atol=1e-5)
    assert writer.stats.compiled == 1 and writer.stats.stored == 1
    stored = list(client.scan_iter(match=redis_keys.compile_artifact(prefix, "*")))
    assert len(stored) == 1 and 0 < client.ttl(stored[0]) <= redis_keys.COMPILE_TTL_S

    def reader(secret: str) -> CompiledFunctions:
        return CompiledFunctions(settings.model_copy(update={"compile_secret": secret}), client,
                                 writer=False)

    good, forged, unshared = reader("s3cret"), reader("other"), reader("")
    for cache in (good, forged, unshared):
        again = engine.compute(parsed.model, parsed.batch, parsed.opts, [3, 4], compiled=cache)
        torch.testing.assert_close(again[1]["norms"], eager[1]["norms"], rtol=1e-4, atol=1e-5)
    assert good.stats.loaded == 1  # warm start from the other worker's artifacts
    assert forged.stats.loaded == 0 and unshared.stats.loaded == 0  # bad signature, no secret
    assert good.stats.stored == forged.stats.stored == 0  # readers never write
