"""psgrad.dp against the real app in-process: a run, its steps, the torch optimizer wrapper,
the Poisson sampler, and the typed 409 at the budget; over real HTTP, a step whose answer was
lost, sent again and counted once, and a training loop that loses every other answer."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

import psgrad
from psgrad import dp
from psgrad._wire import RESPONSE_KEY, fields_from_safetensors
from service.api import create_app
from service.worker import loop as worker_loop
from tests.support.api import serving, settings
from tests.support.client import running_app


@pytest.fixture
def client() -> Iterator[psgrad.Client]:
    app = create_app(settings())
    with running_app(app) as transport, psgrad.Client(transport=transport,
                                                      base_url="http://psgrad.test") as c:
        yield c


def test_run_steps_until_the_budget(client: psgrad.Client) -> None:
    client.models.register("dp-sdk", architecture="mlp",
                           config={"sizes": [6, 8, 3], "activation": "tanh"})
    run = dp.create_run(client, "dp-sdk", clip_norm=1.0, noise_multiplier=2.0, delta=1e-5,
                        expected_batch_size=4, dataset_size=100, max_epsilon=0.45)
    assert run.sample_rate == pytest.approx(0.04) and run.id.startswith("dp-")
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 6)).astype(np.float32), rng.integers(0, 3, 100)
    weights = client.models.download_weights("dp-sdk")
    taken = 0
    with pytest.raises(psgrad.PrivacyBudgetExhausted) as err:
        for batch in dp.poisson_batches(100, run.sample_rate, steps=1000, rng=rng):
            if len(batch) == 0:
                continue
            step = run.step(x[batch], y[batch], weights=weights)
            taken += 1
            assert step.steps == taken and 0 < step.epsilon <= 0.45
            assert set(step.clipped_mean) == set(weights)
            weights = {k: w - 0.1 * step.clipped_mean[k] for k, w in weights.items()}
    assert err.value.http_status == 409
    doc = dp.get_run(client, run.id).refresh()
    assert doc["steps"] == taken == doc["max_steps"]
    with pytest.raises(ValueError):
        run.step(x[:0], y[:0], weights=weights)


def test_a_step_whose_answer_is_lost_is_sent_again_and_counted_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over real HTTP, the worker slowed on the first step past the client's timeout (1 s
    against 0.5 s): the client sends the step again under its key, the second try waits for
    the job the first queued, and the run counts one step, computed once. (Before keys the
    client raised, not sending a step again.)"""
    real, calls = worker_loop.count_dp_step, []

    def first_slow(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == 1:
            time.sleep(1.0)
        return real(*args, **kwargs)

    monkeypatch.setattr(worker_loop, "count_dp_step", first_slow)
    app = create_app(settings(data_dir=str(tmp_path / "data")))
    x, y = np.ones((3, 8), np.float32), np.zeros(3, np.float32)
    with serving(app) as url, psgrad.Client(url) as client, psgrad.Client(
            url, timeout=httpx.Timeout(0.5, connect=5.0), max_retries=3) as hasty:
        run = dp.create_run(client, "value-mlp", clip_norm=1.0, noise_multiplier=1.0,
                            delta=1e-5, expected_batch_size=4, dataset_size=100,
                            max_epsilon=10.0)
        step = dp.get_run(hasty, run.id).step(x, y, loss="mse")
        assert step.steps == 1 and len(calls) == 1
        assert run.refresh()["steps"] == 1
        second = run.step(x, y, loss="mse")
        assert second.steps == 2 and second.clipped_mean["net.fc1.weight"].shape == (64, 8)


class LosingAnswers(httpx.BaseTransport):
    """Real HTTP that loses the answer of every other gradients request once the server sent
    it, as a timeout or a dropped connection does, keeping what was lost."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent = 0
        self.lost: list[bytes] = []
        self.kept: list[str] = []  # where each answer lost was kept

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.url.path == "/per-sample-grads":
            self.sent += 1
            if self.sent % 2:
                self.lost.append(response.read())
                self.kept.append(response.headers["content-location"])
                response.close()
                raise httpx.ReadTimeout("the answer was lost", request=request)
        return response

    def close(self) -> None:
        self.inner.close()


def test_a_training_loop_that_loses_every_other_answer_takes_each_step_once(
        tmp_path: Path) -> None:
    """Eight steps, the first try of each answered by the server and lost on the way: each
    step is sent again under its key and answers the noisy mean its lost try carried, the
    client releases the kept answer once it has it, and the run counts eight steps."""
    app = create_app(settings(data_dir=str(tmp_path / "data")))
    rng = np.random.default_rng(0)
    losing = LosingAnswers()
    with serving(app) as url, psgrad.Client(url, transport=losing) as client:
        run = dp.create_run(client, "value-mlp", clip_norm=1.0, noise_multiplier=1.0,
                            delta=1e-5, expected_batch_size=4, dataset_size=100,
                            max_epsilon=10.0)
        for i in range(8):
            x = rng.normal(size=(4, 8)).astype(np.float32)
            step = run.step(x, rng.normal(size=4).astype(np.float32), loss="mse")
            lost = fields_from_safetensors(losing.lost[-1], RESPONSE_KEY)
            assert step.steps == lost["dp"]["steps"] == i + 1
            for name, value in step.clipped_mean.items():
                np.testing.assert_array_equal(value, lost["clipped_mean"][name])
            with pytest.raises(psgrad.UnknownJob):  # released by the client once in hand
                client.job(losing.kept[-1].removeprefix("/jobs/")).status()
        assert losing.sent == 16 and run.refresh()["steps"] == 8


def test_torch_optimizer_wrapper_moves_the_weights(client: psgrad.Client) -> None:
    client.models.register("dp-torch", architecture="mlp",
                           config={"sizes": [6, 8, 3], "activation": "relu"})
    run = dp.create_run(client, "dp-torch", clip_norm=1.0, target_epsilon=2.0, delta=1e-5,
                        sample_rate=0.1, dataset_size=50, steps=10, clip_form="opacus")
    module = torch.nn.Sequential(OrderedDict(fc1=torch.nn.Linear(6, 8), act1=torch.nn.ReLU(),
                                             fc2=torch.nn.Linear(8, 3)))
    before = {k: v.clone() for k, v in module.state_dict().items()}
    opt = dp.DPOptimizer(run, module, torch.optim.SGD(module.parameters(), lr=0.1))
    step = opt.step(np.ones((5, 6), np.float32), np.array([0, 1, 2, 0, 1]))
    assert step.steps == 1 and step.epsilon > 0
    for k, v in module.state_dict().items():
        assert not torch.equal(v, before[k]), k


def test_a_run_id_is_sent_quoted(client: psgrad.Client) -> None:
    """``get_run`` quotes the id into its path, as the other namespaces do: an id with a '?'
    is an unknown run (it was sent as the id 'dp-a' and a query parameter 'b': a 422)."""
    with pytest.raises(psgrad.UnknownDPRun, match="dp-a"):
        dp.get_run(client, "dp-a?b")


def test_poisson_batches_sample_each_record_at_the_rate() -> None:
    rng = np.random.default_rng(0)
    batches = list(dp.poisson_batches(1000, 0.05, rng=rng))
    assert len(batches) == 20  # one epoch: 1 / q batches
    sizes = np.array([len(b) for b in batches])
    assert abs(sizes.mean() - 50) < 6 and len(set(sizes.tolist())) > 1
    assert all(np.all(np.diff(b) > 0) and b.max() < 1000 for b in batches)
