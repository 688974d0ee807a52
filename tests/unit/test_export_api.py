"""``PUT /models/{id}`` with a torch.export archive, then served like any registered model."""

from __future__ import annotations

import io
import json
import time
from collections.abc import AsyncIterator
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from psgrad._arrays import state_dict_bytes, weights_from_bytes
from service.export.child import SPARES
from service.strategies.projection import Projection
from tests.support.api import TD0, open_client
from tests.support.export import CASES, TOL, deep, exported, program, with_program
from tests.support.reference import Loop, per_sample_loop, summarize

PT2 = "application/x-torch-export"


def _loop(name: str, x: torch.Tensor, y: torch.Tensor) -> Loop:
    """The per-sample loop on the original module (the cases' classifiers: cross-entropy)."""
    return per_sample_loop(exported(name)[0], {"inputs": x, "targets": y}, "cross_entropy")


async def test_a_resnet_registered_as_pt2_gives_the_loops_per_sample_grads() -> None:
    case = CASES["resnet"]
    x, y = case.example(3), case.target(3)
    async with open_client() as c:
        r = await c.put("/models/my-resnet", content=exported("resnet")[1],
                        headers={"content-type": PT2},
                        params={"default_loss": "cross_entropy", "description": "a resnet"})
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["architecture"] == "exported" and doc["input"]["shape"] == [3, 8, 8]
        assert doc["inputs"] == [{"name": "x", "shape": [3, 8, 8], "dtype": "float32"}]
        assert "bn.running_mean" not in doc["parameters"] and "fc.weight" in doc["parameters"]
        assert "program" not in doc["config"]
        r = await c.post("/per-sample-grads", json={
            "model": "my-resnet", "inputs": x.tolist(), "targets": y.tolist(),
            "outputs": ["grads"]})
        assert r.status_code == 200, r.text
        got = r.json()["grads"]
    for k, want in _loop("resnet", x, y).grads.items():
        np.testing.assert_allclose(np.asarray(got[k]), want.numpy(), **TOL, err_msg=k)


async def test_weights_round_trip_and_replace_as_a_new_version() -> None:
    async with open_client() as c:
        r = await c.put("/models/cnn1", content=exported("cnn")[1],
                        headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        first = r.json()["version"]
        r = await c.get("/models/cnn1/weights")
        state = st_load(r.content)
        assert set(state) == set(dict(exported("cnn")[0].state_dict()))
        state["fc.bias"] = state["fc.bias"] + 1
        r = await c.put("/models/cnn1/weights", content=st_save(state),
                        headers={"content-type": "application/x-safetensors"})
        assert r.status_code == 200, r.text
        assert r.json()["version"] != first and r.json()["versions"] == [first, r.json()["version"]]
        x, y = CASES["cnn"].example(2), torch.tensor([0, 1])
        r = await c.post("/per-sample-grads", json={
            "model": f"cnn1@{first}", "inputs": x.tolist(), "targets": y.tolist(),
            "outputs": ["norms"]})
        assert r.status_code == 200, r.text
    # the first version still holds the exported weights: its norms are the loop's
    np.testing.assert_allclose(r.json()["norms"], _loop("cnn", x, y).norms.numpy(), **TOL)


async def test_refused_archives_answer_4xx_and_the_server_keeps_serving() -> None:
    data = exported("cnn")[1]
    doc = program(data)
    doc["graph_module"]["graph"]["nodes"][0]["target"] = "torch.os.system"
    async with open_client() as c:
        for body, code in ((with_program(data, doc), "refused_program"),
                           (data[: len(data) // 3], None), (b"junk", "invalid_archive")):
            r = await c.put("/models/evil", content=body, headers={"content-type": PT2})
            assert 400 <= r.status_code < 500, r.text
            if code:
                assert r.json()["error"]["code"] == code
        assert (await c.get("/models/evil")).status_code == 404
        r = await c.put("/models/evil", content=data, headers={"content-type": PT2},
                        params={"default_loss": "nope"})
        assert r.status_code == 422 and r.json()["error"]["code"] == "unknown_loss"
        r = await c.put("/models/evil", content=json.dumps({"architecture": "exported"}),
                        headers={"content-type": "application/json"})
        assert r.status_code == 415
        assert (await c.get("/healthz")).status_code == 200


def test_a_stored_program_is_rebuilt_by_another_process_through_the_same_loader(
        tmp_path: object) -> None:
    from service.model_store import FileModelStore
    from service.registration import register_exported
    from service.registry import ModelRegistry
    from tests.support.api import settings

    cpu = torch.device("cpu")
    first = ModelRegistry(cpu, store=FileModelStore(str(tmp_path)))
    model = register_exported(first, "gpt1", exported("gpt")[1], settings(),
                              default_loss="cross_entropy", losses=[])
    other = ModelRegistry(cpu, store=FileModelStore(str(tmp_path)))  # e.g. a worker
    again = other.get("gpt1")
    assert again.version == model.version and list(again.params) == list(model.params)
    assert again.describe()["tied"] == {"head.weight": "wte.weight"}
    x = CASES["gpt"].example(1)
    with torch.no_grad():
        torch.testing.assert_close(again.module(x), exported("gpt")[0](x), **TOL)


# A chain of 60,000 relus: about 30 s of CPU to check on our machines, far above the limits
# below, so either limit stops it whatever the load (CPU time does not grow with contention).
HEAVY_NODES = 60_000


@cache
def _heavy() -> bytes:
    return deep(exported("cnn")[1], HEAVY_NODES)


async def _refused_then_serving(c: Any, setting: str) -> None:
    r = await c.put("/models/heavy", content=_heavy(), headers={"content-type": PT2})
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "too_large" and setting in error["message"], error
    assert (await c.get("/models/heavy")).status_code == 404
    assert (await c.get("/healthz")).status_code == 200
    r = await c.post("/per-sample-grads", json={**TD0, "outputs": ["grads"]})  # no child
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["grads"]["theta"], [[-7.2, -3.6, 7.2]], rtol=1e-6)


async def test_a_registration_over_the_cpu_limit_is_stopped_and_the_server_keeps_serving(
        ) -> None:
    async with open_client(max_graph_nodes=100_000, export_cpu_s=4,
                           export_timeout_s=600) as c:
        await _refused_then_serving(c, "PSGRAD_EXPORT_CPU_S")


async def test_a_registration_over_the_wall_clock_limit_is_stopped_and_the_server_keeps_serving(
        ) -> None:
    async with open_client(max_graph_nodes=100_000, export_cpu_s=600,
                           export_timeout_s=3) as c:
        started = time.monotonic()
        await _refused_then_serving(c, "PSGRAD_EXPORT_TIMEOUT_S")
    assert time.monotonic() - started < 300  # stopped, not run to its end


async def test_an_api_with_admins_keeps_a_checking_child_started_ahead() -> None:
    """The child that checks an archive is started before it is needed (torch imported by the
    time a registration comes), takes one archive, and the next spare takes its place; the
    api's end ends the spare. Each archive still gets a process of its own."""
    async with open_client(admin_keys="admin", export_spare=True) as c:
        first = SPARES._spare
        assert first is not None and first[1].proc.poll() is None
        r = await c.put("/models/cnn-spare", content=exported("cnn")[1],
                        headers={"content-type": PT2, "authorization": "Bearer admin"})
        assert r.status_code == 200, r.text
        assert first[1].proc.poll() is not None and first[1].archive.closed  # used, ended
        second = SPARES._spare
        assert second is not None and second[1].proc.pid != first[1].proc.pid
        r = await c.put("/models/cnn-spare", content=b"PK\x03\x04 not a zip",
                        headers={"content-type": PT2, "authorization": "Bearer admin"})
        assert r.status_code == 400 and second[1].proc.poll() is not None
    assert SPARES._spare is None and second[1].proc.poll() is not None


async def test_an_archive_goes_into_its_checking_child_as_it_arrives() -> None:
    """A ``.pt2`` sent in pieces with no length declared is written into the checking child's
    file as it arrives, and registers; one that passes the limit mid-way is a 413 naming the
    setting, with the child that was taking it ended, nothing registered, and the next spare
    started."""
    data = exported("cnn")[1]

    async def pieces(body: bytes, size: int) -> AsyncIterator[bytes]:
        for start in range(0, len(body), size):
            yield body[start:start + size]

    async with open_client(export_spare=True, max_weight_bytes=1 << 20) as c:
        r = await c.put("/models/cnn-pieces", content=pieces(data, 4096),
                        headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        assert r.json()["parameters"] == (await c.get("/models/cnn-pieces")).json()["parameters"]
        taking = SPARES._spare
        assert taking is not None and taking[1].proc.poll() is None
        big = b"PK\x03\x04" + bytes(65 << 20)  # past the limit: max_weight_bytes + 64 MiB
        r = await c.put("/models/too-big", content=pieces(big, 1 << 20),
                        headers={"content-type": PT2})
        assert r.status_code == 413, r.text
        assert "PSGRAD_MAX_WEIGHT_BYTES" in r.json()["error"]["message"]
        assert taking[1].proc.poll() is not None and taking[1].archive.closed
        after = SPARES._spare  # the next registration's child, started all the same
        assert after is not None and after[1] is not taking[1] and after[1].proc.poll() is None
        assert (await c.get("/models/too-big")).status_code == 404


@pytest.mark.parametrize(("keys", "ahead"), [
    ({}, True),  # open, the loopback dev mode: anyone there registers
    ({"api_keys": "user"}, False),  # keys and no admin: no registration can come
])
async def test_a_checking_child_is_started_ahead_where_a_registration_can_come(
        keys: dict[str, str], ahead: bool) -> None:
    async with open_client(export_spare=True, **keys):
        spare = SPARES._spare
        assert (spare is not None and spare[1].proc.poll() is None) is ahead
    assert SPARES._spare is None


async def test_a_bfloat16_program_takes_bfloat16_values_sent_as_float32() -> None:
    """numpy and JSON have no bfloat16: a bfloat16 model's inputs travel as float32 holding
    bfloat16 values (taken exactly; a value that would round is a 422 saying how to round it),
    and its answers come back widened to float32. Each equals the per-sample loop in float64
    on the same weights, to bfloat16's precision."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(),
                                 torch.nn.Linear(8, 3)).to(torch.bfloat16)
    x = torch.randn(4, 6).to(torch.bfloat16)
    y = torch.tensor([0, 2, 1, 2])
    archive = io.BytesIO()
    torch.export.save(torch.export.export(module, (x[:1],)), archive)
    async with open_client() as c:
        r = await c.put("/models/half", content=archive.getvalue(), headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        body = {"model": "half", "targets": y.tolist(), "outputs": ["norms", "grads"]}
        r = await c.post("/per-sample-grads", json={**body, "inputs": x.float().tolist()})
        assert r.status_code == 200, r.text
        got = r.json()
        rounding = x.float() + 1e-3  # most of these are no bfloat16 value
        r = await c.post("/per-sample-grads", json={**body, "inputs": rounding.tolist()})
        assert r.status_code == 422 and r.json()["error"]["code"] == "dtype_mismatch"
        assert "x.to(torch.bfloat16)" in r.json()["error"]["message"]
        # safetensors has BF16: a body may carry it (read as the same numbers in float32)
        sent = st_save({"inputs": x, "targets": y},
                       metadata={"request": json.dumps({"model": "half", "outputs": ["norms"]})})
        r = await c.post("/per-sample-grads", content=sent,
                         headers={"content-type": "application/x-safetensors"})
        assert r.status_code == 200 and r.json()["norms"] == got["norms"], r.text
        # its weights travel as BF16 both ways: as numpy arrays widened, as tensors kept
        stored = (await c.get("/models/half/weights")).content
        assert {k: v.dtype for k, v in weights_from_bytes(stored, as_torch=True).items()} == {
            k: torch.bfloat16 for k in module.state_dict()}
        for k, v in weights_from_bytes(stored).items():
            np.testing.assert_array_equal(v, module.state_dict()[k].float().numpy())
        moved = {k: v + 0.5 for k, v in module.state_dict().items()}
        r = await c.put("/models/half/weights", content=state_dict_bytes(moved),
                        headers={"content-type": "application/x-safetensors"})
        assert r.status_code == 200, r.text
        new = weights_from_bytes((await c.get("/models/half/weights")).content, as_torch=True)
        assert all(torch.equal(new[k], v) for k, v in moved.items())
    want = per_sample_loop(module.double(), {"inputs": x.double(), "targets": y},
                           "cross_entropy")
    np.testing.assert_allclose(got["norms"], want.norms.numpy(), rtol=2e-2)
    for k, g in want.grads.items():
        np.testing.assert_allclose(np.asarray(got["grads"][k]), g.numpy(), rtol=3e-2,
                                   atol=3e-2 * float(g.abs().max()), err_msg=k)


class _Mixed(torch.nn.Module):
    """A float32 layer feeding a bfloat16 one, as a partly cast model is."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4).to(torch.bfloat16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).to(torch.bfloat16)).float()


@pytest.mark.parametrize("fast", [True, False])
async def test_a_program_of_mixed_dtypes_answers_the_loops_statistics(fast: bool) -> None:
    """Statistics of a model whose parameters differ in dtype, on either path, each equal to
    the per-sample loop's to bfloat16's precision: the sketch formed in the model's dtype (its
    first parameter's, float32), the clipped sum, dot and cosine in each parameter's. (Each was
    a 500 where a bfloat16 gradient met a float32 sketch, reference, mean or clip factor.)"""
    torch.manual_seed(0)
    module = _Mixed()
    x, y = torch.randn(5, 8), torch.tensor([0, 3, 1, 2, 3])
    reference = {k: torch.randn(v.shape) for k, v in module.named_parameters()}
    archive = io.BytesIO()
    torch.export.save(torch.export.export(module, (x[:1],)), archive)
    outputs = ["norms", "mean", "variance", "clipped_mean", "dot", "cosine_mean", "projection"]
    async with open_client(fast_stats=fast) as c:
        r = await c.put("/models/mixed", content=archive.getvalue(), headers={"content-type": PT2})
        assert r.status_code == 200, r.text
        r = await c.post("/per-sample-grads", json={
            "model": "mixed", "inputs": x.tolist(), "targets": y.tolist(), "clip_norm": 1.0,
            "reference": {k: v.tolist() for k, v in reference.items()}, "outputs": outputs,
            "projection_dim": 16, "projection_seed": 3})
        assert r.status_code == 200, r.text
        got = r.json()
    loop = per_sample_loop(module, {"inputs": x, "targets": y}, "cross_entropy")
    sketch = torch.zeros(5, 16)
    Projection(16, 3).project_many({k: g.float() for k, g in loop.grads.items()}, sketch)
    [want] = summarize(loop, [5], clip_norm=1.0, reference=reference)
    want["projection"] = sketch
    for name in outputs:
        pairs = ([(f"{name} {k}", got[name][k], v) for k, v in want[name].items()]
                 if isinstance(want[name], dict) else [(name, got[name], want[name])])
        for what, answer, expected in pairs:
            np.testing.assert_allclose(answer, expected.numpy(), rtol=2e-2,
                                       atol=2e-2 * float(expected.abs().max()), err_msg=what)
