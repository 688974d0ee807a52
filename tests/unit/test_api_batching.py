"""Dynamic batching: concurrent clients get exactly their own answers, batched or not."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from service.api.body import decode_json_body
from service.broker.embedded import EmbeddedBroker
from service.jobs import Job, JobStatus, new_job_id
from service.registry import ModelRegistry
from service.storage import open_storage
from service.worker.loop import Worker
from tests.support.api import TD0, assert_outputs, in_process, open_client, settings


def _requests(n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Different models, batch sizes, weights and outputs, several sharing a group key."""
    rng = np.random.default_rng(seed)
    docs: list[dict[str, Any]] = []
    for i in range(n):
        b = int(rng.integers(1, 6))
        kind = i % 4
        if kind in (0, 1):  # value-mlp, mse: same options, so these can merge
            docs.append(
                {
                    "model": "value-mlp",
                    "loss": "mse",
                    "inputs": rng.standard_normal((b, 8)).astype(np.float32).tolist(),
                    "targets": rng.standard_normal(b).astype(np.float32).tolist(),
                    "outputs": ["grads", "mean", "variance", "norms", "cosine_mean"],
                }
            )
        elif kind == 2:  # linear-value td0, per-request weights on half of them
            doc = {
                "model": "linear-value",
                "outputs": ["updates", "td_errors", "mean"],
                "inputs": rng.standard_normal((b, 3)).astype(np.float32).tolist(),
                "next_inputs": rng.standard_normal((b, 3)).astype(np.float32).tolist(),
                "rewards": rng.standard_normal(b).astype(np.float32).tolist(),
                "dones": rng.integers(0, 2, b).tolist(),
                "gamma": 0.9,
            }
            if i % 8 == 2:
                doc["weights"] = {"theta": rng.standard_normal(3).astype(np.float32).tolist()}
            docs.append(doc)
        else:  # value-mlp as a value function (td0) with clipped_mean per job
            docs.append(
                {
                    "model": "value-mlp",
                    "loss": "td0",
                    "outputs": ["clipped_mean", "losses"],
                    "clip_norm": 0.5,
                    "inputs": rng.standard_normal((b, 8)).astype(np.float32).tolist(),
                    "next_inputs": rng.standard_normal((b, 8)).astype(np.float32).tolist(),
                    "rewards": rng.standard_normal(b).astype(np.float32).tolist(),
                }
            )
    return docs


async def test_twenty_concurrent_clients_get_their_own_results() -> None:
    docs = _requests(20)
    registry = ModelRegistry()
    want = [in_process(doc, registry) for doc in docs]
    async with open_client(batch_max_delay_ms=20, workers=2) as c:
        answers = await asyncio.gather(*[c.post("/per-sample-grads", json=d) for d in docs])
    for doc, r, ref in zip(docs, answers, want, strict=True):
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["batch_size"] == len(doc["inputs"])
        assert body["model"].split("@")[0] == doc["model"]
        assert_outputs(body, ref)


async def test_batching_on_and_off_give_identical_results() -> None:
    docs = _requests(12, seed=1)
    results = {}
    for delay in (0.0, 50.0):
        async with open_client(batch_max_delay_ms=delay) as c:
            answers = await asyncio.gather(*[c.post("/per-sample-grads", json=d) for d in docs])
        assert all(r.status_code == 200 for r in answers)
        results[delay] = [r.json() for r in answers]
    assert all(r["meta"]["batch_jobs"] == 1 for r in results[0.0])
    for off, on, doc in zip(results[0.0], results[50.0], docs, strict=True):
        ref = {
            k: (
                np.asarray(v, np.float32)
                if not isinstance(v, dict)
                else {p: np.asarray(t, np.float32) for p, t in v.items()}
            )
            for k, v in off.items()
            if k in doc["outputs"]
        }
        assert_outputs(on, ref)


async def test_one_round_merges_groups_and_keeps_statistics_per_job() -> None:
    """Deterministic: queue jobs with no worker running, then process them as one round."""
    docs = _requests(8, seed=2)
    s = settings(workers=0, batch_max_delay_ms=10)
    registry = ModelRegistry()
    broker = EmbeddedBroker(s)
    await broker.start()
    jobs = [
        Job(new_job_id(), decode_json_body(d, max_elements=1 << 20), time.time() + 60) for d in docs
    ]
    for job in jobs:
        await broker.submit(job)
    taken = broker.take(100, 10_000, 0.0, 0.0)
    assert [j.id for j in taken] == [j.id for j in jobs]
    await asyncio.to_thread(Worker(broker, registry, s, storage=open_storage(s)).process, taken)
    states = [await broker.state(j.id) for j in jobs]
    await broker.close()
    sizes = {}
    for doc, st in zip(docs, states, strict=True):
        assert st.status is JobStatus.SUCCEEDED, st.error
        assert st.result is not None
        sizes[(doc["model"], doc.get("loss"), tuple(doc["outputs"]), "weights" in doc)] = st.result[
            "meta"
        ]["batch_jobs"]
        assert_outputs(st.result, in_process(doc, registry))  # mean, variance, ... per job
    # the two value-mlp/mse jobs merged into one engine call; so did the td0 value-mlp ones
    assert (
        sizes[("value-mlp", "mse", ("grads", "mean", "variance", "norms", "cosine_mean"), False)]
        == 4
    )
    assert sizes[("value-mlp", "td0", ("clipped_mean", "losses"), False)] == 2


async def test_canceled_and_bad_jobs_in_a_round() -> None:
    s = settings(workers=0)
    registry = ModelRegistry()
    broker = EmbeddedBroker(s)
    await broker.start()
    good = Job(new_job_id(), decode_json_body(TD0, max_elements=100), time.time() + 60)
    canceled = Job(new_job_id(), decode_json_body(TD0, max_elements=100), time.time() + 60)
    late = Job(new_job_id(), decode_json_body(TD0, max_elements=100), time.time() - 1)
    bad = Job(
        new_job_id(),
        decode_json_body({**TD0, "rewards": [1.0, 2.0]}, max_elements=100),
        time.time() + 60,
    )
    for job in (good, canceled, late, bad):
        await broker.submit(job)
    taken = broker.take(10, 100, 0.0, 0.0)
    await broker.cancel(canceled.id)
    await asyncio.to_thread(Worker(broker, registry, s, storage=open_storage(s)).process, taken)
    status = {j.id: await broker.state(j.id) for j in (good, canceled, late, bad)}
    await broker.close()
    assert status[good.id].status is JobStatus.SUCCEEDED
    assert status[canceled.id].status is JobStatus.CANCELED
    assert status[late.id].error and status[late.id].error["error"]["code"] == "deadline_exceeded"
    assert status[bad.id].error and status[bad.id].error["error"]["code"] == "shape_mismatch"
