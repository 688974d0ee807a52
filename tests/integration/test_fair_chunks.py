"""Fair share inside a running job (issue 53, finding 7): a lone job larger than
``PSGRAD_FAIR_CHUNK_SAMPLES`` runs a chunk at a time, and another tenant's job queued meanwhile
runs between two chunks: it waits one chunk, not the whole job. The chunked job's answer is the
per-sample loop's. Both brokers, each with a real worker loop over its own source."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from service.broker.embedded import EmbeddedBroker
from service.config import Settings
from service.jobs import Job, JobSource, new_job_id
from service.registry import ModelRegistry
from service.storage import open_storage
from service.worker.loop import Worker
from tests.support.api import settings as embedded_settings
from tests.support.redis import prefix_on, queue, redis_or_skip
from tests.support.reference import per_sample_loop

HEAVY, CHUNK = 48, 16
OUTPUTS = ["norms", "grads"]


def _fields(n: int, seed: int, outputs: list[str]) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"model": "mlp", "inputs": rng.standard_normal((n, 784)).astype(np.float32),
            "targets": rng.integers(0, 10, n).astype(np.int64), "outputs": outputs}


@contextlib.contextmanager
def _redis_settings() -> Iterator[Settings]:
    shared = redis_or_skip()
    with prefix_on(shared) as prefix:
        yield Settings(redis_url="redis://127.0.0.1:6379/0", redis_prefix=prefix,
                       result_ttl_s=30, heartbeat_s=0.2, batch_max_delay_ms=0.0, device="cpu",
                       batch_max_samples=HEAVY, fair_chunk_samples=CHUNK)
    shared.close()


@contextlib.asynccontextmanager
async def _source(mode: str) -> AsyncIterator[tuple[Any, JobSource, Settings]]:
    """The api's side (to submit) and the worker's source of one broker."""
    if mode == "embedded":
        s = embedded_settings(workers=0, batch_max_delay_ms=0.0, batch_max_samples=HEAVY,
                              fair_chunk_samples=CHUNK)
        broker = EmbeddedBroker(s)
        await broker.start()
        try:
            yield broker, broker, s
        finally:
            await broker.close()
        return
    with _redis_settings() as s:
        async with queue(s) as (api, source):
            yield api, source, s


@pytest.mark.parametrize("mode", ["embedded", "redis"])
async def test_a_light_job_runs_between_two_chunks_of_a_heavy_one(mode: str) -> None:
    async with _source(mode) as (api, source, s):
        heavy = Job(new_job_id(), _fields(HEAVY, 1, OUTPUTS), time.time() + 120, tenant="a")
        light = Job(new_job_id(), _fields(1, 2, ["norms"]), time.time() + 120, tenant="b")
        await api.submit(heavy)
        taken = source.take(HEAVY, HEAVY, 0.0, 1.0)  # the worker starts the heavy job ...
        assert [j.id for j in taken] == [heavy.id]
        await api.submit(light)  # ... and the light one queues while it runs
        ended: list[tuple[str, dict[str, Any]]] = []
        store = source.succeed_all

        def spy(done: Any) -> None:
            ended.extend((job.id, result) for job, result in done)
            store(done)

        source.succeed_all = spy  # type: ignore[method-assign]
        registry = ModelRegistry()
        Worker(source, registry, s, storage=open_storage(s)).process(taken)
    assert [job_id for job_id, _ in ended] == [light.id, heavy.id]
    answer = ended[1][1]
    assert answer["meta"]["chunks"] == HEAVY // CHUNK
    data = heavy.fields
    want = per_sample_loop(registry.get("mlp").module,
                           {"inputs": torch.as_tensor(data["inputs"]),
                            "targets": torch.as_tensor(data["targets"])}, "cross_entropy")
    np.testing.assert_allclose(answer["norms"], want.norms.numpy(), rtol=1e-4, atol=1e-6)
    for k, g in want.grads.items():
        np.testing.assert_allclose(answer["grads"][k], g.numpy(), rtol=1e-4, atol=1e-6,
                                   err_msg=k)


@pytest.mark.parametrize("mode", ["embedded", "redis"])
async def test_a_job_whose_outputs_combine_runs_whole(mode: str) -> None:
    """A mean (or a clipped mean, a DP step) is not cut: its answer is one call's."""
    async with _source(mode) as (api, source, s):
        heavy = Job(new_job_id(), _fields(HEAVY, 1, ["norms", "mean"]), time.time() + 120,
                    tenant="a")
        light = Job(new_job_id(), _fields(1, 2, ["norms"]), time.time() + 120, tenant="b")
        await api.submit(heavy)
        taken = source.take(HEAVY, HEAVY, 0.0, 1.0)
        await api.submit(light)
        ended: list[str] = []
        store = source.succeed_all

        def spy(done: Any) -> None:
            ended.extend(job.id for job, _ in done)
            store(done)

        source.succeed_all = spy  # type: ignore[method-assign]
        Worker(source, ModelRegistry(), s, storage=open_storage(s)).process(taken)
    assert ended == [heavy.id]
