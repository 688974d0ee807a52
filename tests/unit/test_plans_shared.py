"""Fast statistics' plans kept beyond one process (service/fast_stats/_shared.py).

A plan made once is loaded by a process that never saw the model (the in-memory cache cleared
stands for a new process here; tests/integration/test_plans_redis.py runs real ones), a new
batch size or sequence length reuses it without a probe, a new sequence of ops plans once more,
and nothing in the store can change an answer: every answer is held to the per-sample loop.
Probes are counted (``SharedPlans.stats``), never timed.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from models import TensorSpec
from service import engine
from service.engine import Batch, Options
from service.fast_stats import FileBackend, SharedPlans
from service.fast_stats._outer import OuterSource
from service.fast_stats._plan import PLANS, PROBE, _finish
from service.fast_stats._run import Setup
from service.fast_stats._shared import _canonical, _name, _sign, plan_key, signature_digest
from service.registry import LoadedModel
from tests.support.api import app_of, open_client
from tests.support.reference import assert_close, reference

OUTPUTS = ("norms", "clipped_mean", "variance")


class Positions(nn.Module):
    """A linear layer over positions ``[B, T, 4]``; past ``branch_at`` positions another layer
    joins (control flow on the input's shape: a new sequence of ops)."""

    def __init__(self, branch_at: int = 1 << 30) -> None:
        super().__init__()
        self.inner = nn.Linear(4, 6)
        self.extra = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)
        self.branch_at = branch_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        if x.shape[1] > self.branch_at:
            h = torch.tanh(self.extra(h))
        return self.head(h.mean(1))


def model_of(module: nn.Module, key: str) -> LoadedModel:
    module.eval().requires_grad_(False)
    return LoadedModel(
        id=key, version="0", architecture="custom", config={}, module=module,
        params={k: v.detach() for k, v in module.named_parameters()},
        buffers={k: v.detach() for k, v in module.named_buffers()},
        input=TensorSpec((5, 4), "float32", None), output_shape=(3,),
        default_loss="cross_entropy", losses=("cross_entropy",), activation_numel=10_000,
        structure=f"test-plans-{key}")


def batch_of(n: int, length: int, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    return Batch(inputs=torch.randn(n, length, 4, generator=gen),
                 targets=torch.randint(0, 3, (n,), generator=gen))


def answered(model: LoadedModel, batch: Batch, shared: SharedPlans) -> dict[str, Any]:
    """The engine's answer through ``shared``, held to the per-sample loop; its meta."""
    opts = Options(loss="cross_entropy", outputs=OUTPUTS, params=tuple(model.params),
                   clip_norm=0.5)
    got = engine.compute(model, batch, opts, plans=shared)[0]
    want = reference(model, batch, opts, [batch.size])[0]
    for name in OUTPUTS:
        assert_close(got[name], want[name], name)
    assert got["meta"]["route"] == "fast_stats"
    meta: dict[str, Any] = got["meta"]
    return meta


def restart(model: LoadedModel) -> None:
    """What a new process starts without: this model's plans in memory."""
    PLANS.drop(lambda key: key[0] != model.structure)


@pytest.fixture
def model(request: pytest.FixtureRequest) -> Any:
    made = model_of(Positions(), request.node.name)
    yield made
    restart(made)


def store(folder: Path, secret: str = "") -> SharedPlans:
    return SharedPlans(FileBackend(folder), secret)


def entry_path(folder: Path) -> Path:
    (path,) = folder.glob("*.json")
    return path


def test_a_plan_made_once_is_loaded_not_probed_after_a_restart(
        model: LoadedModel, tmp_path: Path) -> None:
    first = store(tmp_path)
    answered(model, batch_of(4, 5), first)
    assert (first.stats.probes, first.stats.stored, first.stats.loaded) == (1, 1, 0)
    entry = json.loads(entry_path(tmp_path).read_bytes())
    assert entry["key"]["structure"] == model.structure and entry["seal"].startswith("sha256:")
    restart(model)
    second = store(tmp_path)
    answered(model, batch_of(4, 5, seed=1), second)
    # unsigned: checked once before its first use, never probed
    assert (second.stats.probes, second.stats.loaded, second.stats.checks) == (0, 1, 1)
    assert second.stats.check_s > 0  # and timed (benchmarks/coldstart.py reads it)


def test_a_signed_plan_is_taken_without_a_check(model: LoadedModel, tmp_path: Path) -> None:
    answered(model, batch_of(4, 5), store(tmp_path, "s3cret"))
    assert json.loads(entry_path(tmp_path).read_bytes())["seal"].startswith("hmac:")
    restart(model)
    second = store(tmp_path, "s3cret")
    answered(model, batch_of(4, 5), second)
    assert (second.stats.probes, second.stats.checks, second.stats.loaded) == (0, 0, 1)
    assert second.stats.check_s == 0


def test_a_new_batch_size_or_length_reuses_the_plan(model: LoadedModel, tmp_path: Path) -> None:
    shared = store(tmp_path, "s3cret")
    answered(model, batch_of(4, 5), shared)
    for n, length in ((7, 5), (2, 9), (5, 16)):
        answered(model, batch_of(n, length, seed=n), shared)
    # a batch size alone is the same plan in memory; each length reads the store once
    assert (shared.stats.probes, shared.stats.loaded) == (1, 2)


def test_a_length_with_other_ops_plans_once_more_and_shares_that_too(tmp_path: Path) -> None:
    model = model_of(Positions(branch_at=6), "branching")
    try:
        shared = store(tmp_path, "s3cret")
        answered(model, batch_of(4, 5), shared)
        answered(model, batch_of(4, 8), shared)  # past 6 positions: the extra layer runs
        assert shared.stats.probes == 2
        assert len(json.loads(entry_path(tmp_path).read_bytes())["classes"]) == 2
        restart(model)
        again = store(tmp_path, "s3cret")
        answered(model, batch_of(3, 12), again)
        answered(model, batch_of(3, 3), again)
        assert (again.stats.probes, again.stats.loaded) == (0, 2)
    finally:
        restart(model)


@pytest.mark.parametrize("damage", ["corrupt", "truncated", "foreign", "unknown module",
                                    "bad seal", "other secret"])
def test_a_damaged_or_foreign_entry_is_ignored(
        model: LoadedModel, tmp_path: Path, damage: str) -> None:
    answered(model, batch_of(4, 5), store(tmp_path, "s3cret"))
    path = entry_path(tmp_path)
    entry = json.loads(path.read_bytes())
    if damage == "corrupt":
        path.write_bytes(b"\x80not json{")
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    elif damage == "foreign":  # another model's entry under this model's name, resealed
        entry["key"] = {**entry["key"], "structure": "another"}
        path.write_bytes(_resealed(entry))
    elif damage == "unknown module":
        entry["classes"] = {k: [["no.such.module", ["head.weight"]]]
                            for k in entry["classes"]}
        path.write_bytes(_resealed(entry))
    elif damage == "bad seal":
        entry["unsupported"] = "no plan"
        path.write_bytes(_canonical(entry))
    restart(model)
    again = store(tmp_path, "another-secret" if damage == "other secret" else "s3cret")
    answered(model, batch_of(4, 5), again)
    assert (again.stats.ignored, again.stats.probes, again.stats.loaded) == (1, 1, 0)


@pytest.mark.parametrize("damage", ["nested", "replays a module never called", "unsupported",
                                    "fifo", "link"])
def test_an_entry_made_by_hand_costs_a_probe_never_a_failure(
        model: LoadedModel, tmp_path: Path, damage: str) -> None:
    """Entries anyone who can write the store could leave, unsigned: JSON nested past Python's
    recursion limit (a RecursionError, every request a 500), a replay of a module the model
    never calls under its true digest (an AssertionError in the check, every request a 500),
    'unsupported' (taken unchecked: every request sent to vmap), a FIFO or a link where the
    file was (a FIFO blocked its reader for good). Each is planned afresh, and the answer is
    the loop's."""
    answered(model, batch_of(4, 5), store(tmp_path))
    path = entry_path(tmp_path)
    entry = json.loads(path.read_bytes())
    if damage == "nested":
        path.write_bytes(b"[" * 100_000)
    elif damage == "replays a module never called":
        replays = {"extra": ["extra.weight", "extra.bias"]}
        opts = Options(loss="cross_entropy", outputs=OUTPUTS, params=tuple(model.params))
        entry["classes"] = {_digest_of(model, batch_of(4, 5), opts, replays): [
            [m, p] for m, p in replays.items()]}
        path.write_bytes(_resealed(entry))
    elif damage == "unsupported":
        entry["classes"], entry["unsupported"] = {}, "poisoned"
        path.write_bytes(_resealed(entry))
    elif damage == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:
        path.unlink()
        path.symlink_to("/dev/zero")
    restart(model)
    again = store(tmp_path)
    answered(model, batch_of(4, 5), again)  # fast_stats, the loop's answer
    assert (again.stats.probes, again.stats.loaded) == (1, 0)


@pytest.mark.parametrize("length", [5, 16])  # 16: checked at 8 positions (_plan.SHORT)
def test_a_tampered_plan_never_changes_an_answer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, length: int) -> None:
    """A layer family whose written gradients are wrong: the check sends its parameter to the
    replay, and the stored plan says so. An entry tampered to capture it op by op again, its
    digest recomputed (anyone can), is checked before use, fails, and the answer stays right,
    whether or not this process holds a secret (an unsigned entry is checked either way)."""

    def wrong(self: OuterSource, rows: int | None = None) -> dict[str, torch.Tensor]:
        n = self.batch if rows is None else rows
        return {self.names[0]: torch.zeros((n, *self.shapes[self.names[0]]))}

    monkeypatch.setattr(OuterSource, "answer", wrong)
    model = model_of(Positions(), f"tampered-{length}")
    opts = Options(loss="cross_entropy", outputs=("grads",), params=tuple(model.params))
    batch = batch_of(4, length)
    want = reference(model, batch, opts, [batch.size])[0]["grads"]
    try:
        for secret in ("", "s3cret"):
            folder = tmp_path / (secret or "unsigned")
            got = engine.compute(model, batch, opts, plans=store(folder, secret))[0]
            assert_close(got["grads"], want)
            entry = json.loads(entry_path(folder).read_bytes())
            assert any(owner == "" for cls in entry["classes"].values() for owner, _ in cls)
            # every parameter tracked, under the digest that plan's ops really have
            entry["classes"] = {_digest_of_tracking_all(model, batch, opts): []}
            entry_path(folder).write_bytes(_resealed(entry))
            restart(model)
            again = store(folder, secret)
            got = engine.compute(model, batch, opts, plans=again)[0]
            assert_close(got["grads"], want)
            assert (again.stats.ignored, again.stats.loaded, again.stats.probes) == (1, 0, 1)
            restart(model)
    finally:
        restart(model)


def test_a_model_without_a_plan_is_remembered_as_such(tmp_path: Path) -> None:
    class TwoOutputs(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> Any:
            return self.lin(x.mean(1)), x

    model = model_of(TwoOutputs(), "two-outputs")
    opts = Options(loss="cross_entropy", outputs=("norms",), params=tuple(model.params))
    try:
        first = store(tmp_path, "s3cret")
        with pytest.raises(Exception):  # noqa: B017  (vmap refuses it too: the point is the store)
            engine.compute(model, batch_of(2, 5), opts, plans=first)
        entry = json.loads(entry_path(tmp_path).read_bytes())
        assert "one tensor" in entry["unsupported"]
        restart(model)
        second = store(tmp_path, "s3cret")
        with pytest.raises(Exception):  # noqa: B017
            engine.compute(model, batch_of(2, 5), opts, plans=second)
        assert (second.stats.probes, second.stats.loaded) == (0, 1)
    finally:
        restart(model)


def test_the_key_holds_no_batch_size_or_length() -> None:
    key = plan_key("abc", torch.float32, "cross_entropy", ["w"],
                   iter([("inputs", torch.float32, 2)]), torch.device("cpu"), "auto")
    assert key["fields"] == [["inputs", "torch.float32", 2]]
    assert _name(key) == _name(dict(reversed(list(key.items()))))


def _digest_of_tracking_all(model: LoadedModel, batch: Batch, opts: Options) -> str:
    return _digest_of(model, batch, opts, {})


def _digest_of(model: LoadedModel, batch: Batch, opts: Options,
               replays: dict[str, list[str]]) -> str:
    """The digest of the ops a plan with these module ``replays`` sees on the probe."""
    call = engine.prepare(model, batch, opts, [batch.size])
    probe = Setup(model, call.params, {k: v[:PROBE] for k, v in call.samples.items()},
                  opts.loss, opts.gamma, call.selected)
    digest = signature_digest(_finish(probe, replays).signature)
    assert digest is not None
    return digest


def _resealed(entry: dict[str, Any]) -> bytes:
    """What anyone can write: the content changed and its plain digest recomputed."""
    body = {k: v for k, v in entry.items() if k != "seal"}
    return _sign(body, b"")


async def test_an_embedded_restart_reads_the_data_directorys_plans(tmp_path: Path) -> None:
    """Two apps on one data directory, one after the other: the second serves the first's
    model without a probe or a check (its plans signed with the folder's own key)."""
    body = {"model": "mlp", "outputs": ["norms"], "inputs": torch.randn(3, 784).tolist(),
            "targets": [0, 1, 2]}
    counts = []
    for _ in range(2):
        async with open_client(data_dir=str(tmp_path)) as client:
            state = app_of(client).state.psgrad
            restart(state.registry.get("mlp"))
            r = await client.post("/per-sample-grads", json=body)
            assert r.status_code == 200, r.text
            assert r.json()["meta"]["route"] == "fast_stats"
            stats = state.storage.plans.stats
            counts.append((stats.probes, stats.checks, stats.loaded))
    assert counts == [(1, 1, 0), (0, 0, 1)]
    assert (tmp_path / "plans" / ".secret").stat().st_mode & 0o077 == 0


def test_threads_that_warm_up_and_plan_at_once_all_answer(tmp_path: Path) -> None:
    """Embedded workers are threads of one process, and forward mode's levels are the
    process's: warm-ups and plan checks (each a jvp) running at once failed with "a forward
    AD level with an invalid index" until every jvp took one lock."""
    from service.strategies import per_sample

    models = [model_of(Positions(), f"threads-{i}") for i in range(4)]
    failures: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(25):
                per_sample.warm_up()
            answered(models[i], batch_of(PROBE + 1, 5, seed=i), store(tmp_path / str(i)))
        except BaseException as exc:  # reported below, thread by thread
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(models))]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
    finally:
        for made in models:
            restart(made)
    assert not failures, failures
