"""Distributed mode end to end: the api (``create_app`` with a RedisBroker) and real ``psgrad
worker`` processes on loopback, sharing a real Redis.

Every answer is checked against ``engine.compute`` run here, on the request alone. Each test has
its own key prefix (deleted after) and its own workers; the outage test has its own Redis.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import save as st_save

from psgrad._wire import SAFETENSORS, fields_from_safetensors
from service.config import Settings
from service.model_store import make_store
from service.registry import ModelRegistry, make_registry
from tests.support.cluster import (
    check_answer,
    cluster,
    job_done,
    mixed_request,
    post_all,
    settings_for,
    wait_until,
)
from tests.support.redis import (
    SHARED_URL,
    OwnRedis,
    fresh_prefix,
    metric,
)

prefix = pytest.fixture(fresh_prefix)


@pytest.fixture
def registry(prefix: str) -> Any:
    """The in-process reference: the same zoo and the same Redis model store as the workers."""
    reg = registry_of(settings_for(SHARED_URL, prefix))
    yield reg
    reg.store.close()


async def test_concurrent_mixed_requests_and_sigterm_drain(tmp_path: Path, prefix: str,
                                                          registry: Any) -> None:
    async with cluster(tmp_path, SHARED_URL, prefix) as c:
        requests = [mixed_request(i) for i in range(100)]
        answers = await post_all(c.client, requests)
        for request, answer in zip(requests, answers, strict=True):
            assert answer.status_code == 200, answer.text
            check_answer(answer.json(), request, registry)
        assert max(a.json()["meta"]["batch_jobs"] for a in answers) > 1  # cross-request batches
        # each worker serves its own metrics; together they counted every job and sample
        scraped = [httpx.get(f"http://127.0.0.1:{port}/metrics").text
                   for port in c.metrics_ports]
        assert all("psgrad_compute_seconds_bucket" in text for text in scraped)
        assert sum(metric(t, 'psgrad_jobs_total{status="succeeded"}') for t in scraped) == 100
        assert sum(metric(t, "psgrad_samples_total") for t in scraped) == sum(
            a.json()["batch_size"] for a in answers)

        # SIGTERM while a worker holds a running job: it finishes and acknowledges it, exits 0
        ids = [(await c.client.post("/jobs", json=mixed_request(4))).json()["job_id"]
               for _ in range(30)]
        doomed = c.workers[0]
        mark = f"-{doomed.pid}-"
        running: list[str] = []

        def one_running() -> bool:
            running[:] = [j for j in ids if mark in c.job_hash(j).get("worker", "")]
            return bool(running)

        await wait_until(one_running, 30, "a job running on the first worker")
        doomed.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(doomed.wait, 30) == 0, c.dump()
        views = [await job_done(c.client, j) for j in ids]
        assert [v["status"] for v in views] == ["succeeded"] * len(ids)
        assert c.job_hash(running[0])["attempts"] == "1"  # drained, not redelivered
        for v in views:
            check_answer(v["result"], mixed_request(4), registry)
        assert await c.broker.queue_depth() == 0
        assert c.stop_all()[1] == 0


async def test_kill9_worker_loses_nothing(tmp_path: Path, prefix: str, registry: Any) -> None:
    # The vmap path on the tutorial CNN makes a batch last long enough to be caught running.
    async with cluster(tmp_path, SHARED_URL, prefix, fast_stats=False) as c:
        victim, survivor = c.workers
        mark = f"-{victim.pid}-"
        # Pause the survivor so the victim surely holds jobs when it dies (a paused worker may
        # still be handed what its blocked read asked for; it finishes that once resumed).
        survivor.send_signal(signal.SIGSTOP)
        try:
            rng = np.random.default_rng(3)
            heavy = [{"model": "simple-cnn", "outputs": ["norms", "losses"],
                      "inputs": rng.standard_normal((16, 1, 28, 28)).round(3).tolist(),
                      "targets": rng.integers(0, 10, 16).tolist()} for _ in range(8)]
            requests = heavy + [mixed_request(i) for i in range(32)]
            ids = [(await c.client.post("/jobs", json=r)).json()["job_id"] for r in requests]
            await wait_until(lambda: any(mark in c.job_hash(j).get("worker", "") and
                                         c.job_hash(j).get("status") == "running" for j in ids),
                             120, "a job running on the victim")
            victim.kill()  # kill -9: no drain, no ack
        finally:
            survivor.send_signal(signal.SIGCONT)
        views = [await job_done(c.client, j, timeout=120) for j in ids]
        assert [v["status"] for v in views] == ["succeeded"] * len(ids), c.dump()
        for request, view in zip(requests, views, strict=True):
            check_answer(view["result"], request, registry)
        redelivered = [j for j in ids if int(c.job_hash(j)["attempts"]) > 1]
        assert redelivered, "no job of the killed worker was taken over"


async def test_poison_job_fails_alone(tmp_path: Path, prefix: str, registry: Any) -> None:
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1) as c:
        good = [mixed_request(i) for i in range(10)]
        poison = {"model": "mlp", "inputs": [[0.0] * 5], "targets": [0]}  # wrong sample shape
        bad_target = {**mixed_request(4), "targets": [99] * len(mixed_request(4)["inputs"])}
        answers = await post_all(c.client, [poison, *good, bad_target])
        assert answers[0].status_code == 422
        err = answers[0].json()["error"]
        assert err["code"] == "shape_mismatch" and "[B, 784]" in err["message"]
        assert answers[-1].status_code == 422
        assert answers[-1].json()["error"]["code"] == "target_out_of_range"
        for request, answer in zip(good, answers[1:-1], strict=True):
            assert answer.status_code == 200, answer.text
            check_answer(answer.json(), request, registry)
        job = (await c.client.post("/jobs", json=poison)).json()["job_id"]
        view = await job_done(c.client, job)
        assert view["status"] == "failed" and view["error"]["code"] == "shape_mismatch"


async def test_async_job_life_cancel_and_expiry(tmp_path: Path, prefix: str, registry: Any) -> None:
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1, result_ttl_s=3) as c:
        request = mixed_request(0)
        created = await c.client.post("/jobs", json=request)
        assert created.status_code == 202
        job_id = created.json()["job_id"]
        assert created.json()["status"] == "queued"
        view = await job_done(c.client, job_id)
        assert view["status"] == "succeeded"
        check_answer(view["result"], request, registry)
        binary = await c.client.get(f"/jobs/{job_id}", headers={"Accept": SAFETENSORS})
        fields = fields_from_safetensors(binary.content, "response")
        np.testing.assert_allclose(fields["td_errors"], np.asarray(view["result"]["td_errors"]))

        worker = c.workers[0]
        worker.send_signal(signal.SIGSTOP)  # nobody takes jobs now: this one stays queued
        try:
            queued = (await c.client.post("/jobs", json=request)).json()["job_id"]
            assert (await c.client.get(f"/jobs/{queued}")).json()["status"] == "queued"
            canceled = await c.client.delete(f"/jobs/{queued}")
            assert canceled.json()["status"] == "canceled"
        finally:
            worker.send_signal(signal.SIGCONT)
        await wait_until(lambda: c.xlen() == 0, 30, "the worker to skip the canceled job")
        assert (await c.client.get(f"/jobs/{queued}")).json()["status"] == "canceled"
        removed = (await c.client.post("/jobs", json=request)).json()["job_id"]
        assert (await job_done(c.client, removed))["status"] == "succeeded"
        assert (await c.client.delete(f"/jobs/{removed}")).json()["status"] == "succeeded"
        assert (await c.client.get(f"/jobs/{removed}")).status_code == 404
        # results expire after PSGRAD_RESULT_TTL_S
        await asyncio.sleep(c.settings.result_ttl_s + 0.5)
        for gone in (job_id, queued):
            expired = await c.client.get(f"/jobs/{gone}")
            assert expired.status_code == 404 and expired.json()["error"]["code"] == "unknown_job"


async def test_registered_model_served_by_both_workers(tmp_path: Path, prefix: str,
                                                       registry: Any) -> None:
    async with cluster(tmp_path, SHARED_URL, prefix, admin_keys="admin",
                       batch_max_samples=4) as c:
        spec = {"architecture": "sequential", "input": {"shape": [4]},
                "layers": [{"type": "Linear", "args": [4, 3]}], "default_loss": "cross_entropy"}
        v1 = await c.client.put("/models/shared-lin", json=spec)
        assert v1.status_code == 200, v1.text
        rng = np.random.default_rng(7)
        requests: list[dict[str, Any]] = []
        ids: list[str] = []
        # Each worker in turn serves while the other is paused, so both must resolve the model.
        for serving, paused in (c.workers, c.workers[::-1]):
            paused.send_signal(signal.SIGSTOP)
            try:
                wave = [{"model": "shared-lin", "inputs": rng.standard_normal((4, 4)).tolist(),
                         "targets": rng.integers(0, 3, 4).tolist(), "outputs": ["grads", "norms"]}
                        for _ in range(8)]
                wave_ids = [(await c.client.post("/jobs", json=r)).json()["job_id"] for r in wave]
                mark = f"-{serving.pid}-"
                await wait_until(
                    lambda ids=wave_ids, mark=mark: any(  # type: ignore[misc]
                        mark in c.job_hash(j).get("worker", "")
                        and c.job_hash(j).get("status") == "succeeded" for j in ids),
                    120, f"a job served by worker {serving.pid}")
            finally:
                paused.send_signal(signal.SIGCONT)
            requests += wave
            ids += wave_ids
        views = [await job_done(c.client, j, timeout=120) for j in ids]
        served = {c.job_hash(j)["worker"].split("-")[-3] for j in ids}
        assert served == {str(w.pid) for w in c.workers}, served
        for request, view in zip(requests, views, strict=True):
            assert view["status"] == "succeeded", view
            assert view["result"]["model"] == f"shared-lin@{v1.json()['version']}"
            check_answer(view["result"], request, registry)

        new = {"0.weight": torch.full((3, 4), 0.25), "0.bias": torch.tensor([1.0, 0.0, -1.0])}
        v2 = await c.client.put("/models/shared-lin/weights", content=st_save(new),
                                headers={"Content-Type": SAFETENSORS})
        assert v2.status_code == 200, v2.text
        answers = await post_all(c.client, requests[:4])
        for request, answer in zip(requests[:4], answers, strict=True):
            assert answer.json()["model"] == f"shared-lin@{v2.json()['version']}"
            check_answer(answer.json(), request, registry)


async def test_redis_outage_503_then_recovery(tmp_path: Path) -> None:
    own = OwnRedis(tmp_path)
    own.start()
    try:
        async with cluster(tmp_path, own.url, "outage", n_workers=1,
                           worker_redis_grace_s=3.0) as c:
            request = mixed_request(0)
            assert (await c.client.post("/per-sample-grads", json=request)).status_code == 200
            own.kill()
            started = time.monotonic()
            down = await c.client.post("/per-sample-grads", json=request)
            assert down.status_code == 503, down.text
            assert down.json()["error"]["code"] == "overloaded"
            assert int(down.headers["Retry-After"]) >= 1
            assert (await c.client.get("/readyz")).status_code == 503
            assert (await c.client.post("/jobs", json=request)).status_code == 503
            assert time.monotonic() - started < 15  # answers, not hangs
            # the worker cannot make progress: it exits non-zero for its supervisor to restart
            assert await asyncio.to_thread(c.workers[0].wait, 30) == 1, c.dump()

            own.start()
            c.start_worker()  # what the supervisor does
            await c.live(1)
            assert (await c.client.get("/readyz")).status_code == 200
            answer = await c.client.post("/per-sample-grads", json=request)
            assert answer.status_code == 200, answer.text
            reference = registry_of(c.settings)
            check_answer(answer.json(), request, reference)
            reference.store.close()
    finally:
        own.kill()


async def test_answers_over_one_redis_value_travel_in_pieces(tmp_path: Path) -> None:
    """Redis cuts the connection on a value over proto-max-bulk-len (512 MiB by default, 1 MiB
    here): answers travel in pieces and have no such cap (200 on both routes); a request that
    would not fit in one value is still a 413 that says so; the worker goes on serving."""
    own = OwnRedis(tmp_path, "--proto-max-bulk-len", "1mb")
    own.start()
    try:
        async with cluster(tmp_path, own.url, "bulk", n_workers=1) as c:
            rng = np.random.default_rng(0)
            small = {"model": "mlp", "inputs": rng.standard_normal((1, 784)).tolist(),
                     "targets": [3]}  # grads: 669,706 float32 = 2.7 MB
            reference = registry_of(c.settings)
            answer = await c.client.post("/per-sample-grads", json=small)
            assert answer.status_code == 200, answer.text
            check_answer(answer.json(), small, reference)
            created = await c.client.post("/jobs", json=small)
            assert created.status_code == 202, created.text
            view = await job_done(c.client, created.json()["job_id"])
            assert view["status"] == "succeeded", view
            check_answer(view["result"], small, reference)
            reference.store.close()

            big = {"model": "mlp", "inputs": rng.standard_normal((400, 784)).tolist(),
                   "targets": [0] * 400, "outputs": ["norms"]}  # 1.25 MB of inputs
            refused = await c.client.post("/per-sample-grads", json=big)
            assert refused.status_code == 413, refused.text
            err = refused.json()["error"]
            assert "proto-max-bulk-len" in err["message"] and err["details"]["limit"] == 1 << 20

            fits = {**small, "outputs": ["norms", "losses"]}
            answer = await c.client.post("/per-sample-grads", json=fits)
            assert answer.status_code == 200, answer.text
            reference = registry_of(c.settings)
            check_answer(answer.json(), fits, reference)
            reference.store.close()
            assert c.workers[0].poll() is None, c.dump()
    finally:
        own.kill()


async def test_exported_gpt2_with_named_inputs_served_by_a_worker_process(
        tmp_path: Path, prefix: str) -> None:
    """The program kept in Redis, rebuilt by a ``psgrad worker`` through the same loader."""
    pytest.importorskip("transformers")
    from tests.support.export import TOL as EXPORT_TOL
    from tests.support.export import exported_hf, token_batch
    from tests.support.reference import per_sample_loop

    module, data = exported_hf("gpt2")
    ids, mask = token_batch(2, 5)
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=1) as c:
        r = await c.client.put("/models/gpt", content=data, params={"default_loss": "next_token"},
                               headers={"Content-Type": "application/x-torch-export"})
        assert r.status_code == 200, r.text
        r = await c.client.post("/per-sample-grads", json={
            "model": "gpt", "inputs": {"input_ids": ids.tolist(), "attention_mask": mask.tolist()},
            "targets": ids.tolist(), "mask": mask.tolist(), "outputs": ["grads", "norms"]})
        assert r.status_code == 200, r.text
    want = per_sample_loop(module, {"inputs": {"input_ids": ids, "attention_mask": mask},
                                    "targets": ids, "mask": mask}, "next_token")
    np.testing.assert_allclose(r.json()["norms"], want.norms.numpy(), **EXPORT_TOL)
    for k, g in want.grads.items():
        np.testing.assert_allclose(np.asarray(r.json()["grads"][k]), g.numpy(), **EXPORT_TOL,
                                   err_msg=k)


async def test_more_waiting_requests_than_a_default_pool_all_get_their_answers(
        tmp_path: Path, prefix: str, registry: Any) -> None:
    """Every sync request waits on a Redis connection of its own (BLPOP): 150 waiting at once,
    more than redis-py's default pool of 100, all get their answers (none a 503)."""
    async with cluster(tmp_path, SHARED_URL, prefix, n_workers=0) as c:
        requests = [{"model": "value-mlp", "loss": "mse", "inputs": [[0.1 * (i % 7)] * 8],
                     "targets": [0.5], "outputs": ["norms"]} for i in range(150)]
        posting = asyncio.ensure_future(post_all(c.client, requests))
        await wait_until(lambda: c.xlen() >= 150, 60, "150 jobs queued, their requests waiting")
        c.start_worker()
        answers = await asyncio.wait_for(posting, 120)
        assert [a.status_code for a in answers] == [200] * 150, answers[0].text
        check_answer(answers[-1].json(), requests[-1], registry)


def registry_of(settings: Settings) -> ModelRegistry:
    """A registry over the deployment's Redis model store (as a worker process reads it)."""
    return make_registry(settings, make_store(settings))
