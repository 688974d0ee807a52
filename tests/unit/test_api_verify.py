"""``verify`` over HTTP in embedded mode: the report in both answer forms, the same samples for
the same seed, batched jobs each verified on their own samples, a wrong answer (injected by
:mod:`tests.support.faults`) answered as ``verification_failed``, ``PSGRAD_VERIFY_FRACTION``
counted on ``/metrics``, and the field's range refused as the schema states it."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

from service.api.body import decode_json_body
from service.broker.embedded import EmbeddedBroker
from service.jobs import Job, JobStatus, new_job_id
from service.registry import ModelRegistry
from service.storage import open_storage
from service.verify import choose
from service.worker.loop import Worker
from tests.support import faults
from tests.support.api import assert_outputs, in_process, open_client, post_st, settings
from tests.support.export import CASES, exported
from tests.support.redis import metric

STATS = ["grads", "losses", "norms", "mean", "variance", "clipped_mean", "cosine_mean"]


def doc(n: int = 6, seed: int = 0, **extra: Any) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"model": "value-mlp", "loss": "mse", "outputs": STATS, "clip_norm": 0.5,
            "inputs": rng.standard_normal((n, 8)).astype(np.float32).round(3).tolist(),
            "targets": rng.standard_normal(n).astype(np.float32).round(3).tolist(), **extra}


def with_marker(d: dict[str, Any], row: int) -> dict[str, Any]:
    inputs = [list(x) for x in d["inputs"]]
    inputs[row][0] = faults.MARKER
    return {**d, "inputs": inputs}


@pytest.mark.parametrize("fast_stats", [True, False], ids=["fast_stats", "vmap"])
async def test_verified_answers_report_in_json_and_safetensors(fast_stats: bool) -> None:
    request = doc(verify=3, verify_seed=5)
    async with open_client(fast_stats=fast_stats) as c:
        r = await c.post("/per-sample-grads", json=request)
        assert r.status_code == 200, r.text
        body = r.json()
        st, fields = await post_st(c, request)
        again = (await c.post("/per-sample-grads", json=request)).json()
    report = body["meta"]["verify"]
    assert report["samples"] == choose(6, 3, 5) and report["seed"] == 5
    assert report["source"] == "request"
    assert report["tolerance"] == {"atol": 3e-3, "rtol": 1e-5}
    assert list(report["checked"]) == STATS
    assert 0 <= report["max_abs_diff"] <= 3e-3
    assert again["meta"]["verify"]["samples"] == report["samples"]  # seeded: reproducible
    assert st.status_code == 200
    assert fields["meta"]["verify"]["samples"] == report["samples"]
    assert list(fields["meta"]["verify"]["checked"]) == STATS
    assert_outputs(body, in_process({k: v for k, v in request.items()
                                     if k not in ("verify", "verify_seed")}))


async def test_an_exported_program_with_tied_weights_is_verified() -> None:
    """A TinyGPT archive (one sample at a time, head tied to the embedding, next_token)."""
    ids = CASES["gpt"].example(4)
    async with open_client() as c:
        r = await c.put("/models/gpt", content=exported("gpt")[1],
                        headers={"content-type": "application/x-torch-export"},
                        params={"default_loss": "next_token"})
        assert r.status_code == 200, r.text
        r = await c.post("/per-sample-grads", json={
            "model": "gpt", "inputs": ids.tolist(), "targets": ids.tolist(), "verify": 2,
            "outputs": ["grads", "norms", "mean", "losses"]})
    assert r.status_code == 200, r.text
    report = r.json()["meta"]["verify"]
    assert len(report["samples"]) == 2 and list(report["checked"]) == ["grads", "norms", "mean",
                                                                       "losses"]
    assert report["max_abs_diff"] <= 3e-3


@pytest.mark.parametrize("fast_stats", [True, False], ids=["fast_stats", "vmap"])
async def test_an_answer_under_autocast_is_verified_at_bfloat16s_tolerance(fast_stats: bool
                                                                            ) -> None:
    """The loop runs in float32; an answer whose forward and backward ran under bfloat16
    autocast is held to bfloat16's tolerance; another autocast dtype is refused."""
    async with open_client(fast_stats=fast_stats) as c:
        r = await c.post("/per-sample-grads", json=doc(verify=6, autocast="bfloat16"))
        full = (await c.post("/per-sample-grads", json=doc())).json()
        bad = await c.post("/per-sample-grads", json=doc(verify=2, autocast="float16"))
    assert r.status_code == 200, r.text
    body = r.json()
    report = body["meta"]["verify"]
    assert report["tolerance"] == {"atol": 5e-2, "rtol": 5e-2}
    assert list(report["checked"]) == STATS and report["max_abs_diff"] <= 5e-2
    assert body["norms"] != full["norms"]  # the forward ran in bfloat16
    assert bad.status_code == 422 and "'autocast'" in bad.json()["error"]["message"]


async def test_without_a_seed_the_job_id_picks_the_samples() -> None:
    async with open_client() as c:
        answers = await asyncio.gather(*(c.post("/per-sample-grads", json=doc(n=40, verify=4))
                                         for _ in range(3)))
    drawn = [tuple(r.json()["meta"]["verify"]["samples"]) for r in answers]
    assert all(len(d) == 4 for d in drawn) and len(set(drawn)) == 3


async def test_unverified_answers_say_nothing_and_half_answers_verify_before_the_cast() -> None:
    async with open_client() as c:
        plain = (await c.post("/per-sample-grads", json=doc())).json()
        half = await c.post("/per-sample-grads", json=doc(verify=2, answer_dtype="float16"))
    assert "verify" not in plain["meta"]
    assert half.status_code == 200 and half.json()["meta"]["verify"]["max_abs_diff"] <= 3e-3


async def test_a_wrong_answer_is_an_error_never_an_answer(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    faults.wrong_output(monkeypatch, "grads", row=4)
    request = doc(verify=6)
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json=request)
        st, _ = await post_st(c, request)
        unchecked = await c.post("/per-sample-grads", json=doc())  # not verified: not caught
        job = (await c.post("/jobs", json=request)).json()["job_id"]
        for _ in range(200):
            view = (await c.get(f"/jobs/{job}")).json()
            if view["status"] in ("succeeded", "failed"):
                break
            await asyncio.sleep(0.05)
    assert r.status_code == 500 and st.status_code == 500
    error = r.json()["error"]
    assert error["code"] == "verification_failed"
    assert error["details"]["output"].startswith("grads/") and error["details"]["sample"] == 4
    assert error["details"]["verify"]["samples"] == list(range(6))
    assert "sample 4's grads/" in error["message"] and "withheld" in error["message"]
    assert st.json()["error"]["code"] == "verification_failed"
    assert unchecked.status_code == 200
    assert view["status"] == "failed" and view["error"]["code"] == "verification_failed"


async def test_batched_jobs_are_verified_on_their_own_samples(monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """One round, one engine call for three jobs: the one whose sample is wrong fails alone."""
    faults.wrong_gradient(monkeypatch, delta=0.5)
    s = settings(workers=0, batch_max_delay_ms=10, fast_stats=False)
    docs = [doc(n=4, seed=1, verify=4), with_marker(doc(n=3, seed=2, verify=3), 1),
            doc(n=5, seed=3, verify=2, verify_seed=9)]
    broker = EmbeddedBroker(s)
    await broker.start()
    jobs = [Job(new_job_id(), decode_json_body(d, max_elements=1 << 20), time.time() + 60)
            for d in docs]
    for job in jobs:
        await broker.submit(job)
    taken = broker.take(100, 10_000, 0.0, 0.0)
    work = Worker(broker, ModelRegistry(), s, storage=open_storage(s))
    await asyncio.to_thread(work.process, taken)
    states = [await broker.state(j.id) for j in jobs]
    await broker.close()
    first, wrong, third = states
    assert wrong.status is JobStatus.FAILED and wrong.error is not None
    assert wrong.error["error"]["code"] == "verification_failed"
    assert wrong.error["error"]["details"]["verify"]["samples"] == [0, 1, 2]
    for st, want in ((first, [0, 1, 2, 3]), (third, choose(5, 2, 9))):
        assert st.status is JobStatus.SUCCEEDED and st.result is not None
        assert st.result["meta"]["batch_jobs"] == 3
        assert st.result["meta"]["verify"]["samples"] == want


async def test_the_operator_fraction_verifies_every_job_and_counts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_client(verify_fraction=1.0, verify_samples=2, batch_max_delay_ms=0) as c:
        sizes = [1, 3, 5]
        answers = [await c.post("/per-sample-grads", json=doc(n=n, seed=n)) for n in sizes]
        declined = await c.post("/per-sample-grads", json=doc(n=4, verify=0))
        metrics = (await c.get("/metrics")).text
        faults.wrong_output(monkeypatch, "norms", row=0)
        failed = await c.post("/per-sample-grads", json=doc(n=2))
        after = (await c.get("/metrics")).text
    for n, r in zip(sizes, answers, strict=True):
        report = r.json()["meta"]["verify"]
        assert report["source"] == "fraction" and len(report["samples"]) == min(n, 2)
    assert declined.json()["meta"]["verify"]["source"] == "fraction"  # 0: the server decides
    assert metric(metrics, "psgrad_verified_jobs_total") == 4
    assert metric(metrics, "psgrad_verified_samples_total") == 1 + 2 + 2 + 2
    assert metric(metrics, "psgrad_verification_failures_total") == 0
    assert metric(metrics, "psgrad_verification_seconds_count") == 4
    assert failed.status_code == 500 and failed.json()["error"]["code"] == "verification_failed"
    assert metric(after, "psgrad_verified_jobs_total") == 5
    assert metric(after, "psgrad_verification_failures_total") == 1


@pytest.mark.parametrize("value", [-1, 65, True, 2.5, "3"])
async def test_verify_out_of_its_range_is_refused(value: Any) -> None:
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json=doc(verify=value))
        j = await c.post("/jobs", json=doc(verify=value))
        seed = await c.post("/per-sample-grads", json=doc(verify=1, verify_seed=-1))
        schema = (await c.get("/openapi.json")).json()["components"]["schemas"]["GradsRequest"]
    status = 422 if isinstance(value, int) and not isinstance(value, bool) else 400  # range, type
    assert r.status_code == status and "'verify' must be an integer in [0, 64]" in r.text
    assert j.status_code == status and j.json()["error"] == r.json()["error"]
    assert seed.status_code == 422 and "'verify_seed' must be an integer in [0, 2**63)" in seed.text
    verify = next(s for s in schema["properties"]["verify"]["anyOf"] if s.get("type") == "integer")
    assert (verify["minimum"], verify["maximum"]) == (0, 64)


async def test_a_whole_number_is_an_integer_as_json_schema_reads_it() -> None:
    """``2.0`` is an integer to JSON Schema (and so to the OpenAPI document): ``verify`` and
    ``verify_seed`` take it as 2, on both routes, in the report as ints."""
    async with open_client() as c:
        r = await c.post("/per-sample-grads", json=doc(verify=2.0, verify_seed=5.0))
        again = await c.post("/per-sample-grads", json=doc(verify=2, verify_seed=5))
        j = await c.post("/jobs", json=doc(verify=2.0, verify_seed=5.0))
    assert r.status_code == 200 and j.status_code == 202, (r.text, j.text)
    report = r.json()["meta"]["verify"]
    assert report["samples"] == again.json()["meta"]["verify"]["samples"] == choose(6, 2, 5)
    assert report["seed"] == 5 and isinstance(report["seed"], int)
