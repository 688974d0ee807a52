"""Hostile and buggy exported programs are refused or bounded, and the server keeps serving.

Sizes are checked at the sizes a request sends (a program whose size arithmetic peaks inside
its range answers 413 there, and nothing is allocated, by a factory op that names no device
included); indices out of range, held in buffers or constants or computed from the inputs, are
a 422 at registration or before the model runs, never a 500; the stored document keeps only
what psgrad reads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from psgrad._errors import PsgradError, RefusedProgram
from service import engine
from service.config import Settings
from service.export import ExportLimits, read_program
from service.export.guard import check_example
from tests.support.api import TD0, open_client
from tests.support.export import TOL, exported, program, rewrite
from tests.support.hostile import (
    GROWN_LIMIT,
    GROWN_T,
    INDEX_OPS,
    PEAK_T,
    ROWS,
    Grown,
    Pooled,
    Shifted,
    coupled,
    indexing,
    peaked,
    shifted,
    unplaced,
)
from tests.support.reference import per_sample_loop

PT2 = "application/x-torch-export"
GIB = 1 << 30


def _status_kib(field: str) -> int:
    found = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    assert found, field
    return int(found.group(1))


@contextmanager
def _rise() -> Iterator[list[int]]:
    """How far this process's resident memory rose inside the block, in bytes (in the list it
    yields). The kernel's high-water mark is reset first (``/proc/self/clear_refs``): a peak
    of an earlier test, or of the process this one was forked from, hides nothing."""
    Path("/proc/self/clear_refs").write_text("5")
    start, rose = _status_kib("VmRSS"), [0]
    yield rose
    rose[0] = (_status_kib("VmHWM") - start) * 1024


async def _serving(c: Any) -> None:
    assert (await c.get("/healthz")).status_code == 200
    r = await c.post("/per-sample-grads", json={**TD0, "outputs": ["grads"]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["grads"]["theta"], [[-7.2, -3.6, 7.2]], rtol=1e-6)


async def test_sizes_that_peak_inside_a_range_answer_413_at_the_size_sent() -> None:
    """(T - 2) * (65538 - T) zeros: none at 2 and 65536, 4 GiB at T = 32769."""
    torch.manual_seed(0)
    reference = Pooled().eval()
    async with open_client() as c:
        r = await c.put("/models/peaked", content=peaked(), headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        assert r.json()["inputs"][0]["dynamic"] == {"0": [2, 65536]}
        x = np.zeros((1, PEAK_T, 4), dtype=np.float32)
        with _rise() as rose:
            r = await c.post("/per-sample-grads", json={
                "model": "peaked", "inputs": x.tolist(), "targets": [0], "outputs": ["norms"]})
        assert r.status_code == 413, r.text
        message = r.json()["error"]["message"]
        limit = Settings().max_model_activations  # the default
        assert f"raise PSGRAD_MAX_MODEL_ACTIVATIONS (now {limit})" in message, message
        assert rose[0] < GIB  # the 4 GiB were never allocated
        x6 = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(1))
        y = torch.tensor([0, 1, 1])
        r = await c.post("/per-sample-grads", json={
            "model": "peaked", "inputs": x6.tolist(), "targets": y.tolist(), "outputs": ["norms"]})
        assert r.status_code == 200, r.text
        await _serving(c)
    loop = per_sample_loop(reference, {"inputs": x6, "targets": y}, "cross_entropy")
    np.testing.assert_allclose(np.asarray(r.json()["norms"]), loop.norms.numpy(),
                               atol=TOL["atol"], rtol=TOL["rtol"])


@pytest.mark.parametrize("device", ["absent", "none"])
async def test_a_factory_op_that_names_no_device_is_refused_without_allocating(
        device: str) -> None:
    """Issue 53, finding 2: ``zeros(T, T, 2)`` with its device left out (or None) ran on the CPU
    in the size pass, and the 413 came after 512 MiB (the peak rose 517 MiB). It is placed
    like every device argument: the pass stays on ``meta``, a refused request costs no more
    than a small one, and the program serves as exported."""
    torch.manual_seed(0)
    reference = Grown().eval()
    x6 = torch.randn(3, 6, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 1])
    small = {"model": "grown", "inputs": x6.tolist(), "targets": y.tolist(),
             "outputs": ["norms"]}
    async with open_client(max_model_activations=GROWN_LIMIT) as c:
        r = await c.put("/models/grown", content=unplaced(device), headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        with _rise() as served:
            r = await c.post("/per-sample-grads", json=small)
        assert r.status_code == 200, r.text
        x = np.zeros((1, GROWN_T, 4), dtype=np.float32)
        with _rise() as refused:
            big = await c.post("/per-sample-grads", json={
                "model": "grown", "inputs": x.tolist(), "targets": [0], "outputs": ["norms"]})
        assert big.status_code == 413, big.text
        assert f"raise PSGRAD_MAX_MODEL_ACTIVATIONS (now {GROWN_LIMIT})" in \
            big.json()["error"]["message"], big.text
        assert refused[0] <= max(served[0], 32 << 20), (refused, served)
    loop = per_sample_loop(reference, {"inputs": x6, "targets": y}, "cross_entropy")
    np.testing.assert_allclose(np.asarray(r.json()["norms"]), loop.norms.numpy(),
                               atol=TOL["atol"], rtol=TOL["rtol"])


@pytest.mark.parametrize("source", ["buffer", "constant"])
@pytest.mark.parametrize("op", INDEX_OPS)
def test_an_index_out_of_range_in_a_buffer_or_constant_is_refused_at_registration(
        op: str, source: str) -> None:
    limits = ExportLimits()
    check_example(read_program(indexing(op, source, bad=False), limits), limits)  # in range: fine
    loaded = read_program(indexing(op, source), limits)
    with pytest.raises(RefusedProgram) as info:
        check_example(loaded, limits)
    assert info.value.status == 422
    assert f"aten.{op}" in info.value.message and f"index {ROWS + 2}" in info.value.message, \
        info.value.message


async def test_a_registration_refused_for_its_indices_answers_422_and_the_server_serves() -> None:
    async with open_client() as c:
        r = await c.put("/models/oob", content=indexing("gather", "buffer"),
                        headers={"content-type": PT2})
        assert r.status_code == 422, r.text
        assert r.json()["error"]["code"] == "refused_program"
        assert "aten.gather.default" in r.json()["error"]["message"]
        assert (await c.get("/models/oob")).status_code == 404
        await _serving(c)


async def test_ids_reaching_an_embedding_through_arithmetic_are_checked_before_the_model_runs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    computed: list[torch.Tensor] = []
    real = engine.compute

    def recording(model: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        computed.append(batch.inputs.clone())
        return real(model, batch, *args, **kwargs)

    monkeypatch.setattr(engine, "compute", recording)
    torch.manual_seed(0)
    reference = Shifted().eval()
    good = torch.tensor([[1, 2, 3], [0, 4, 4]])
    y = torch.tensor([2, 0])
    async with open_client() as c:
        r = await c.put("/models/shifted", content=shifted(), headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        bad = {"model": "shifted", "inputs": [[1, 7, 0]], "targets": [0], "outputs": ["norms"]}
        r = await c.post("/per-sample-grads", json=bad)
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["code"] == "invalid_input" and "aten.embedding" in error["message"], error
        assert error["details"]["high"] == 12 and error["details"]["size"] == ROWS
        assert not computed  # refused before the engine: no kernel ever saw index 12
        r = await c.post("/per-sample-grads", json={
            "model": "shifted", "inputs": good.tolist(), "targets": y.tolist(),
            "outputs": ["norms"]})
        assert r.status_code == 200, r.text
        assert len(computed) == 1
        await _serving(c)
    loop = per_sample_loop(reference, {"inputs": good, "targets": y}, "cross_entropy")
    np.testing.assert_allclose(np.asarray(r.json()["norms"]), loop.norms.numpy(),
                               atol=TOL["atol"], rtol=TOL["rtol"])


async def test_why_a_program_runs_one_sample_at_a_time_is_reported() -> None:
    async with open_client() as c:
        r = await c.put("/models/coupled", content=coupled(), headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        config = r.json()["config"]
        assert config["batched"] is False
        assert "differ from its samples' run one at a time" in config["batch_check"], config
        r = await c.put("/models/cnn", content=exported("cnn")[1], headers={"content-type": PT2})
        assert r.json()["config"]["batched"] is True and "batch_check" not in r.json()["config"]


def _deep(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


async def test_the_stored_program_keeps_only_what_psgrad_reads() -> None:
    data = exported("cnn")[1]
    doc = program(data)
    gm = doc["graph_module"]
    gm["signature"]["junk"] = "DEEP"  # lists nested: deeper than json.dumps would write
    gm["signature"]["input_specs"][0]["parameter"]["junk"] = "x" * (40 << 20)
    gm["graph"]["nodes"][0]["inputs"][0]["junk"] = _deep(850)
    gm["graph"]["nodes"][0]["inputs"][0]["arg"]["as_tensor"]["junk"] = "y" * 1000
    gm["graph"]["tensor_values"]["x"]["junk"] = _deep(850)
    async with open_client() as c:
        text = json.dumps(doc)
        for depth in (984, 5000):  # past what the loader's JSON parser nests: a 4xx
            body = text.replace('"DEEP"', "[" * depth + "]" * depth).encode()
            r = await c.put("/models/junk", content=rewrite(data, {"models/model.json": body}),
                            headers={"content-type": PT2})
            assert 400 <= r.status_code < 500, r.text
        body = text.replace('"DEEP"', "[" * 850 + "]" * 850).encode()
        r = await c.put("/models/junk", content=rewrite(data, {"models/model.json": body}),
                        headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        registry = c.app.state.psgrad.registry  # type: ignore[attr-defined]
        record = registry.store.get("junk", r.json()["version"])
        stored = json.dumps(record.config)
        assert len(stored) < 200_000 and "junk" not in stored
        assert set(record.config["program"]["graph_module"]["signature"]) == \
            {"input_specs", "output_specs"}
        x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
        r = await c.post("/per-sample-grads", json={
            "model": "junk", "inputs": x.tolist(), "targets": [0, 2], "outputs": ["norms"]})
        assert r.status_code == 200, r.text
    loop = per_sample_loop(exported("cnn")[0], {"inputs": x, "targets": torch.tensor([0, 2])},
                           "cross_entropy")
    np.testing.assert_allclose(np.asarray(r.json()["norms"]), loop.norms.numpy(),
                               atol=TOL["atol"], rtol=TOL["rtol"])


@pytest.mark.parametrize("depth", [2, 990, 5000])
def test_nested_arguments_are_a_4xx(depth: int) -> None:
    """An optional tensor holds a tensor: nested ones are refused, however deep (past Python's
    recursion limit included: a 4xx, not a RecursionError)."""
    data = exported("cnn")[1]
    doc = program(data)
    doc["graph_module"]["graph"]["nodes"][0]["inputs"][0]["arg"] = "DEEP"
    deep = '{"as_optional_tensor": ' * depth + '{"as_tensor": {"name": "x"}}' + "}" * depth
    text = json.dumps(doc).replace('"DEEP"', deep)  # json.dumps itself would recurse
    with pytest.raises(PsgradError) as info:
        read_program(rewrite(data, {"models/model.json": text.encode()}), ExportLimits())
    assert 400 <= info.value.status < 500
