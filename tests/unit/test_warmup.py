"""Warm-ups (service/warmup.py): a registration asks for shapes, a worker computes them as jobs
and shares the plans; a server starting up warms the same shapes, and whatever a process pays
once, before ``/readyz`` says ready.

Probes are counted (``SharedPlans.stats``), never timed; every answer is held to the per-sample
loop.
"""

from __future__ import annotations

import asyncio
import io
import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

import psgrad
from service.engine import Batch, Options
from service.fast_stats import _plan
from service.worker import loop
from tests.support.api import app_of, open_client, until_ready
from tests.support.reference import assert_close, reference

ADMIN = {"Authorization": "Bearer admin-key"}
SPEC = {"architecture": "sequential", "input": {"shape": [4]},
        "layers": [{"type": "Linear", "args": [4, 8]}, {"type": "Tanh"},
                   {"type": "Linear", "args": [8, 3]}]}


def dirs(tmp_path: Path) -> dict[str, Any]:
    return {"admin_keys": "admin-key", "model_dir": str(tmp_path / "models"),
            "data_dir": str(tmp_path / "data")}


async def finished(client: httpx.AsyncClient, ref: str) -> dict[str, Any]:
    for _ in range(600):
        doc: dict[str, Any] = (await client.get(f"/models/{ref}", headers=ADMIN)).json()
        if doc["warmup"]["status"] != "running":
            return doc
        await asyncio.sleep(0.05)
    raise AssertionError(f"the warm-up of {ref} never ended: {doc['warmup']}")


@pytest.fixture
def fresh() -> Iterator[None]:
    """No plan in this process's memory: as a new process starts."""
    _plan.PLANS.clear()
    yield
    _plan.PLANS.clear()


async def test_a_registration_warms_the_model_up(tmp_path: Path, fresh: None) -> None:
    async with open_client(**dirs(tmp_path)) as client:
        put = await client.put("/models/tiny?warmup=4,8", json=SPEC, headers=ADMIN)
        assert put.status_code == 200, put.text
        asked = put.json()["warmup"]
        assert asked["total"] == 2 and [s["batch_size"] for s in asked["shapes"]] == [4, 8]
        doc = await finished(client, "tiny")
        assert doc["warmup"]["status"] == "succeeded" and doc["warmup"]["done"] == 2, doc
        stats = app_of(client).state.psgrad.storage.plans.stats
        assert (stats.probes, stats.stored) == (1, 1)  # one plan serves both batch sizes
        x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
        r = await client.post("/per-sample-grads", headers=ADMIN, json={
            "model": "tiny", "outputs": ["norms"], "inputs": x.tolist(), "targets": y.tolist()})
        assert r.status_code == 200, r.text
        assert r.json()["meta"]["route"] == "fast_stats" and stats.probes == 1
        model = app_of(client).state.psgrad.registry.get("tiny")
    opts = Options(loss="cross_entropy", outputs=("norms",), params=tuple(model.params))
    want = reference(model, Batch(inputs=x, targets=y), opts, [8])[0]["norms"]
    assert_close(torch.tensor(r.json()["norms"]), want)


async def test_a_bfloat16_program_warms_up(tmp_path: Path, fresh: None) -> None:
    """Its random samples are bfloat16 values held in float32, as a client sends them (numpy
    has no bfloat16: asking for the warm-up was a 500)."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                 torch.nn.Linear(8, 3)).to(torch.bfloat16)
    archive = io.BytesIO()
    torch.export.save(torch.export.export(module, (torch.randn(1, 4).to(torch.bfloat16),)),
                      archive)
    async with open_client(**dirs(tmp_path)) as client:
        put = await client.put("/models/half?warmup=4", content=archive.getvalue(),
                               headers={**ADMIN, "content-type": "application/x-torch-export"})
        assert put.status_code == 200, put.text
        doc = await finished(client, "half")
        assert doc["warmup"]["status"] == "succeeded" and doc["warmup"]["done"] == 1, doc


@pytest.mark.parametrize("asked", ["4x", "0", "x8", "4;8", ",".join(map(str, range(1, 19))),
                                   "99999999999", "²", "4x²", "①", "٣"])  # '²': was a 500
async def test_a_malformed_warmup_registers_nothing(tmp_path: Path, asked: str) -> None:
    async with open_client(**dirs(tmp_path)) as client:
        r = await client.put(f"/models/tiny?warmup={asked}", json=SPEC, headers=ADMIN)
        assert r.status_code == 422 and r.json()["error"]["code"] == "invalid_input", r.text
        assert "warmup=4" in r.json()["error"]["message"] or "at most" in r.text
        assert (await client.get("/models/tiny", headers=ADMIN)).status_code == 404


async def test_a_shape_the_model_cannot_take_fails_that_shape_alone(tmp_path: Path) -> None:
    async with open_client(**dirs(tmp_path)) as client:
        r = await client.put("/models/tiny?warmup=4x16,2", json=SPEC, headers=ADMIN)
        assert r.status_code == 200, r.text
        first, second = r.json()["warmup"]["shapes"]
        assert first["status"] == "failed" and first["job"] is None and second["job"]
        assert "one shape [4]" in first["error"] and "warmup=4" in first["error"]
        doc = await finished(client, "tiny")
    assert doc["warmup"]["status"] == "failed" and doc["warmup"]["done"] == 1
    assert doc["warmup"]["shapes"][1]["status"] == "succeeded"


async def test_a_shape_past_what_a_request_may_send_fails_before_it_is_made(
        tmp_path: Path) -> None:
    """A warm-up's batch is held to the limits a request's is: past max_batch_size the
    registration is refused (nothing registered); past max_elements that shape fails, saying
    which setting to raise, and the others run."""
    async with open_client(**dirs(tmp_path), max_batch_size=64, max_elements=100) as client:
        r = await client.put("/models/tiny?warmup=65", json=SPEC, headers=ADMIN)
        assert r.status_code == 422 and "PSGRAD_MAX_BATCH_SIZE (now 64)" in r.text, r.text
        r = await client.put("/models/tiny?warmup=2,26", json=SPEC, headers=ADMIN)
        assert r.status_code == 200, r.text
        small, large = r.json()["warmup"]["shapes"]
        assert small["job"] and large["status"] == "failed" and large["job"] is None
        assert "104 elements" in large["error"] and "PSGRAD_MAX_ELEMENTS" in large["error"]
        doc = await finished(client, "tiny")
    assert [s["status"] for s in doc["warmup"]["shapes"]] == ["succeeded", "failed"]


async def test_readyz_waits_for_the_start_up_warm_up(
        tmp_path: Path, fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A restart on the same folders: not ready until the registered warm-up ran again (held
    open here by an event), then ready, having loaded the plan rather than probed."""
    async with open_client(**dirs(tmp_path)) as client:
        assert (await client.put("/models/tiny?warmup=4", json=SPEC, headers=ADMIN)).is_success
        assert (await finished(client, "tiny"))["warmup"]["status"] == "succeeded"
    _plan.PLANS.clear()
    gate, made = threading.Event(), _plan._plan

    def held(*args: Any) -> Any:
        assert gate.wait(60), "the test never let planning end"
        return made(*args)

    monkeypatch.setattr(_plan, "_plan", held)
    async with open_client(**dirs(tmp_path)) as client:
        try:  # let the warm-up end before the workers are joined, whatever fails
            for _ in range(10):
                r = await client.get("/readyz")
                assert r.status_code == 503 and r.json()["ready"] is False
                await asyncio.sleep(0.05)
        finally:
            gate.set()
        assert (await until_ready(client)).status_code == 200
        stats = app_of(client).state.psgrad.storage.plans.stats
        assert (stats.probes, stats.loaded) == (0, 1)


async def test_new_weights_keep_the_warm_up_and_a_refused_shape_is_one_line(
        tmp_path: Path, fresh: None, caplog: pytest.LogCaptureFixture) -> None:
    """New weights (a new version, which asks for no warm-up of its own) are warmed at start-up
    at the shapes the model asked for (they were not: only the newest version's record was
    read); a shape the model cannot take is skipped with one line, not an ERROR and a
    traceback at every start."""
    from safetensors.numpy import load, save

    from service import warmup

    async with open_client(**dirs(tmp_path)) as client:
        r = await client.put("/models/tiny?warmup=4,4x16", json=SPEC, headers=ADMIN)
        assert r.is_success, r.text
        await finished(client, "tiny")
        weights = load((await client.get("/models/tiny/weights", headers=ADMIN)).content)
        r = await client.put("/models/tiny/weights", headers={
            **ADMIN, "content-type": "application/x-safetensors"},
            content=save({k: v + 1 for k, v in weights.items()}))
        assert r.is_success and r.json()["warmup"] is None, r.text
        store = app_of(client).state.psgrad.registry.store
        newest = r.json()["version"]
        assert warmup.wanted(store) == [(f"tiny@{newest}", (4, None)),
                                        (f"tiny@{newest}", (4, 16))]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="psgrad.worker"):
        async with open_client(**dirs(tmp_path)) as client:
            assert (await until_ready(client)).status_code == 200
    warmed = [r.getMessage() for r in caplog.records if "warm" in r.getMessage()]
    assert any(f"warmed up tiny@{newest} at (4, None)" in m for m in warmed), warmed
    skipped = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(skipped) == 1 and "takes samples of one shape" in skipped[0].getMessage()
    assert skipped[0].levelname == "WARNING" and skipped[0].exc_info is None


async def test_readyz_waits_for_what_a_process_pays_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no model asking for a warm-up, a worker is still not ready before its process's
    start-up warm-ups (torch.func's set-up, on every device, held open here by an event):
    ready means that a job sent now starts now."""
    gate, made = threading.Event(), loop.per_sample.warm_up

    def held() -> None:
        assert gate.wait(60), "the test never let the warm-up end"
        made()

    monkeypatch.setattr(loop.per_sample, "warm_up", held)
    async with open_client() as client:
        try:  # let the warm-up end before the workers are joined, whatever fails
            for _ in range(10):
                r = await client.get("/readyz")
                assert r.status_code == 503 and r.json()["ready"] is False
                await asyncio.sleep(0.05)
        finally:
            gate.set()
        assert (await until_ready(client)).status_code == 200
        r = await client.post("/per-sample-grads", json={
            "model": "mlp", "inputs": [[0.1] * 784], "targets": [1], "outputs": ["norms"]})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("models", ["files", "memory"])
async def test_the_client_asks_for_a_warm_up(tmp_path: Path, fresh: None, models: str) -> None:
    folders = {**dirs(tmp_path), **({"model_dir": None} if models == "memory" else {})}
    async with open_client(**folders) as http, psgrad.AsyncClient(
            base_url="http://psgrad.test", api_key="admin-key",
            transport=httpx.ASGITransport(app=app_of(http))) as client:
        info = await client.models.register("tiny", architecture="sequential",
                                             layers=SPEC["layers"], input=SPEC["input"],
                                             warmup=[4, (2, 3)])
        assert info.warmup is not None and info.warmup["total"] == 2
        shapes = [(s["batch_size"], s["length"], s["status"]) for s in info.warmup["shapes"]]
        assert shapes[0][:2] == (4, None) and shapes[1] == (2, 3, "failed")
        for _ in range(600):
            warm = (await client.models.get("tiny")).warmup
            assert warm is not None
            if warm["status"] != "running":
                break
            await asyncio.sleep(0.05)
        assert (warm["status"], warm["done"]) == ("failed", 1)
