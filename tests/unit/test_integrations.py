"""psgrad beside a training loop: the Monitor in a plain loop, the Trainer callback, a server
that stops mid-training. The statistics logged are held to the per-sample loop at the weights of
the step they were sent with."""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import psgrad
from psgrad.integrations import Monitor, StoreWriter
from psgrad.integrations._monitor import Background, outliers
from service.api import create_app
from service.config import Settings
from service.registry import ModelRegistry
from tests.support.api import serving, settings
from tests.support.client import running_app
from tests.support.reference import loop_noise_scales, per_sample_loop

MODEL = "value-mlp"  # 8 -> 64 -> 64 -> 1, mse


@pytest.fixture(scope="module")
def client() -> Iterator[psgrad.Client]:
    """A client of a real server over HTTP: a monitor's child process can reach it too."""
    app = create_app(Settings(workers=1, batch_max_delay_ms=0.0))
    with serving(app) as url, psgrad.Client(url) as c:
        yield c


def trainable() -> nn.Module:
    """A copy of the served model's module, its parameters trainable."""
    return copy.deepcopy(ModelRegistry().get(MODEL).module).train().requires_grad_(True)


def batches(steps: int, n: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [(torch.randn(n, 8, generator=gen), torch.randn(n, generator=gen))
            for _ in range(steps)]


def train(module: nn.Module, data: list[tuple[torch.Tensor, torch.Tensor]], each: Any) -> None:
    """Plain SGD on the mean mse; ``each(step, x, y)`` after every optimizer step."""
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        F.mse_loss(module(x).reshape(-1), y).backward()
        opt.step()
        each(step, x, y)


@pytest.mark.parametrize("process", [True, False], ids=["child process", "thread"])
def test_a_plain_loops_statistics_equal_the_loops_at_each_steps_weights(
        client: psgrad.Client, process: bool) -> None:
    module = trainable()
    monitor = Monitor(client, MODEL, outputs=["norms", "losses", "gns"], every=2, loss="mse",
                      max_pending=8, process=process)
    sent: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]] = {}

    def each(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
        weights = {k: v.detach().clone() for k, v in module.named_parameters()}
        if monitor.observe(step, x, y, weights=dict(module.named_parameters())):
            sent[step] = (weights, x, y)

    train(module, batches(6), each)
    counts = monitor.close(timeout=60)
    assert counts == {"sent": 3, "answered": 3, "failed": 0, "dropped": 0}
    assert [r["step"] for r in monitor.records] == sorted(sent) == [0, 2, 4]
    for record in monitor.records:
        weights, x, y = sent[record["step"]]
        loop = per_sample_loop(module, {"inputs": x, "targets": y}, "mse", weights=weights)
        np.testing.assert_allclose(record["psgrad/norm_max"], float(loop.norms.max()),
                                   rtol=1e-4)
        np.testing.assert_allclose(record["psgrad/loss_mean"], float(loop.losses.mean()),
                                   rtol=1e-4)
        at = copy.deepcopy(module)
        at.load_state_dict(weights, strict=False)
        want = loop_noise_scales(at, {"inputs": x, "targets": y}, "mse")
        trace, grad_sq = float(want["gns_trace"]), float(want["gns_grad_sq"])
        assert record["psgrad/gns"] == pytest.approx(trace / grad_sq, rel=1e-3)
    assert monitor.noise_scale.steps == 3 and monitor.records[-1]["psgrad/gns_ema"] == \
        monitor.noise_scale.value


def test_training_finishes_when_the_server_stops_midway(caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    """The server goes away after the third step: later steps fail or are dropped, no step of
    the loop waits on it, and the monitor says what it lost."""
    module = trainable()
    app = create_app(Settings(workers=1, batch_max_delay_ms=0.0))
    waits: list[float] = []
    with ExitStack() as server, caplog.at_level(logging.INFO, "psgrad.integrations"):
        url = server.enter_context(serving(app))
        with psgrad.Client(url, max_retries=0, timeout=5.0) as c:
            monitor = Monitor(c, MODEL, outputs=["norms"], loss="mse", max_pending=1)

            def each(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
                if step == 3:
                    deadline = time.monotonic() + 60
                    while not monitor.answered and time.monotonic() < deadline:
                        time.sleep(0.05)  # one answer at least, then the server stops
                    server.close()
                started = time.perf_counter()
                monitor.observe(step, x, y, weights=dict(module.named_parameters()))
                waits.append(time.perf_counter() - started)

            train(module, batches(12), each)
            counts = monitor.close(timeout=10)
    assert counts["answered"] >= 1 and counts["failed"] >= 1
    assert counts["sent"] == counts["answered"] + counts["failed"]
    assert counts["sent"] + counts["dropped"] == 12  # every step is accounted for
    assert max(waits) < 0.5  # a copy of the batch, never the network
    assert "not answered (APIConnectionError" in caplog.text
    assert f"psgrad monitor closed: sent {counts['sent']}" in caplog.text


def test_a_child_that_exits_is_started_again(client: psgrad.Client) -> None:
    """The sending process is killed between two batches: the next batch starts a new one,
    and every batch is answered. The child runs at the lowest priority, so that it takes only
    what the training leaves idle."""
    x, y = batches(1)[0]
    monitor = Monitor(client, MODEL, outputs=["norms"], loss="mse", max_pending=4)
    first = monitor._sender._proc  # type: ignore[union-attr]
    assert first is not None
    assert monitor.observe(0, x, y)
    deadline = time.monotonic() + 60
    while not monitor.answered and time.monotonic() < deadline:
        time.sleep(0.02)
    assert os.getpriority(os.PRIO_PROCESS, first.pid) == 19  # it lowered itself first
    first.kill()
    first.wait()
    assert monitor.observe(1, x, y) and monitor.observe(2, x, y)
    deadline = time.monotonic() + 60
    while monitor.answered < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    second = monitor._sender._proc  # type: ignore[union-attr]
    assert second is not None and second.pid != first.pid
    assert monitor.close(timeout=60) == {"sent": 3, "answered": 3, "failed": 0, "dropped": 0}
    assert second.poll() is not None  # closing stops it
    assert [r["step"] for r in monitor.records] == [0, 1, 2]


def test_a_monitor_refused_for_its_arguments_starts_no_process(client: psgrad.Client) -> None:
    before = set(psutil.Process().children())
    with pytest.raises(ValueError, match="every and max_pending must be at least 1"):
        Monitor(client, MODEL, every=0)
    assert set(psutil.Process().children()) == before


def test_a_client_of_an_app_in_this_process_sends_from_a_thread() -> None:
    """A child process cannot reach an app served in this one: the monitor says so at once,
    and ``process=False`` sends from its thread instead."""
    app = create_app(Settings(workers=1, batch_max_delay_ms=0.0))
    with running_app(app) as transport, \
            psgrad.Client(base_url="http://app", transport=transport) as c:
        threads = threading.active_count()
        with pytest.raises(ValueError, match="pass process=False"):
            Monitor(c, MODEL, outputs=["norms"], loss="mse")
        deadline = time.monotonic() + 5
        while threading.active_count() > threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threading.active_count() == threads  # the refused monitor's thread ended
        monitor = Monitor(c, MODEL, outputs=["norms"], loss="mse", process=False)
        x, y = batches(1)[0]
        assert monitor.observe(0, x, y)
        assert monitor.close(timeout=60)["answered"] == 1


def test_a_step_that_finds_the_queue_full_is_dropped_before_it_is_copied(
        client: psgrad.Client) -> None:
    """At one batch a step, a slow server fills the queue; the steps that find it full cost
    the loop no copy of their batch (half of them at every step in benchmarks/callback.py)."""
    release = threading.Event()
    copies: list[int] = []

    class Held(Background):
        def _send(self, step: int, batch: dict[str, Any]) -> None:
            release.wait(30)  # the server, answering slowly

    class Tensor:
        """A tensor as _copy sees one, counting its copies."""

        def detach(self) -> Tensor:
            copies.append(1)
            return self

        def to(self, *args: Any, **kwargs: Any) -> Tensor:
            return self

    held = Held(client, every=1, max_pending=1)
    assert held._put(0, {"inputs": Tensor()})
    deadline = time.monotonic() + 30
    while not held.sent and time.monotonic() < deadline:
        time.sleep(0.01)  # the thread holds step 0; step 1 fills the queue
    queued = [held._put(step, {"inputs": Tensor()}) for step in range(1, 6)]
    release.set()
    counts = held.close(timeout=30)
    assert queued == [True, False, False, False, False]
    assert len(copies) == 2 and counts == {"sent": 2, "answered": 2, "failed": 0, "dropped": 4}


def test_a_run_fills_one_store_per_checkpoint_at_its_weights(tmp_path: Path) -> None:
    """Checkpoints at steps 0 and 3: two versions of the run's model with the weights of those
    steps, two stores, each holding the batches of its checkpoint's steps, sketched at its
    weights."""
    app = create_app(settings(data_dir=str(tmp_path / "data"), batch_max_delay_ms=0.0))
    data = batches(6, 4)
    module = trainable()
    snapshots: dict[int, dict[str, torch.Tensor]] = {}
    with running_app(app) as transport, \
            psgrad.Client(base_url="http://app", transport=transport) as c:
        writer = StoreWriter(c, "run-a", architecture=MODEL, projection_dim=16, loss="mse",
                             checkpoint_every=3, max_pending=8, dtype="float32")

        def each(step: int, x: torch.Tensor, y: torch.Tensor) -> None:
            if step % 3 == 0:
                snapshots[step] = {k: v.detach().clone() for k, v in module.named_parameters()}
            writer.observe(step, x, y, ids=[f"s{step}-{i}" for i in range(len(x))],
                           parameters=module.named_parameters)

        train(module, data, each)
        assert writer.close(timeout=120) == {"sent": 6, "answered": 6, "failed": 0,
                                             "dropped": 0}
        assert writer.stores == ["run-a-0", "run-a-3"]
        for first in (0, 3):
            store = c.stores.get(f"run-a-{first}")
            assert store.info["samples"] == 12
            version = store.info["model"]
            served = c.models.download_weights(version)
            for k, v in snapshots[first].items():
                np.testing.assert_array_equal(served[k], v.numpy())
            x = torch.cat([data[s][0] for s in range(first, first + 3)])
            y = torch.cat([data[s][1] for s in range(first, first + 3)])
            sketches = c.per_sample_grads(version, x, y, loss="mse", outputs=["projection"],
                                          projection_dim=16).projection
            top = store.query(score="self_influence", k=12)
            ids = [f"s{s}-{i}" for s in range(first, first + 3) for i in range(4)]
            want = dict(zip(ids, (np.asarray(sketches, np.float64) ** 2).sum(1), strict=True))
            got = dict(zip(top.ids[0].tolist(), top.scores[0].tolist(), strict=True))
            assert set(got) == set(want)
            for i, score in got.items():
                assert score == pytest.approx(want[i], rel=1e-4), i


def test_outliers_are_the_norms_far_above_the_batchs() -> None:
    norms = np.array([1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0, 1.02, 0.98, 9.0])
    assert outliers(norms, 2.5) == [9]
    assert outliers(np.ones(5), 1.0) == [] and outliers(norms[:2], 0.1) == []


# ----------------------------------------------------------------------------- the Trainer


class Classifier(nn.Module):
    """The zoo's value-mlp as a Trainer's model: forward(input_ids, labels) -> {"loss"}."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.net(input_ids).reshape(-1), labels)}


def test_the_trainer_callback_logs_each_steps_statistics(client: psgrad.Client,
                                                         tmp_path: Any) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from psgrad.integrations.transformers import PsgradCallback

    model = Classifier(trainable())
    xs, ys = batches(1, 8)[0]
    data = [{"input_ids": xs[i], "labels": ys[i]} for i in range(8)]
    callback = PsgradCallback(client, MODEL, outputs=["norms", "gns"], loss="mse", max_pending=8,
                              weights=lambda m: {k.removeprefix("net."): v
                                                 for k, v in m.named_parameters()})
    seen: dict[int, tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]] = {}

    class Snapshot(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None,
                        **kwargs: Any) -> None:
            seen[state.global_step] = ({k.removeprefix("net."): v.detach().clone()
                                        for k, v in model.named_parameters()},
                                       dict(callback._batch))

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True, learning_rate=0.05)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   callbacks=[Snapshot()])
    callback.attach(trainer)
    trainer.train()
    assert [r["step"] for r in callback.monitor.records] == [1, 2, 3, 4]
    for record in callback.monitor.records:
        weights, batch = seen[record["step"]]
        loop = per_sample_loop(model.net, {"inputs": batch["input_ids"],
                                           "targets": batch["labels"]}, "mse", weights=weights)
        np.testing.assert_allclose(record["psgrad/norm_mean"], float(loop.norms.mean()),
                                   rtol=1e-4)
    logged = [h for h in trainer.state.log_history if "psgrad/norm_mean" in h]
    assert [h["psgrad/norm_mean"] for h in logged] == [r["psgrad/norm_mean"]
                                                        for r in callback.monitor.records]
    assert callback._hook is None  # removed at the end of training
