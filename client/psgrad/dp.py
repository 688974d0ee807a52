"""DP-SGD with psgrad: a run with a privacy budget on the server, helpers for the training loop.

    import psgrad
    from psgrad import dp

    with psgrad.Client() as client:
        run = dp.create_run(client, "mlp", clip_norm=1.0, target_epsilon=3.0, delta=1e-5,
                            expected_batch_size=64, dataset_size=len(x), epochs=10)
        for batch in dp.poisson_batches(len(x), run.sample_rate, steps=run.planned_steps):
            step = run.step(x[batch], y[batch], weights=weights)
            weights = {k: w - lr * step.clipped_mean[k] for k, w in weights.items()}
        print(step.steps, step.epsilon)

Each :meth:`Run.step` is one ``clipped_mean`` request with ``dp_run``: the server clips with the
run's clip norm, adds noise from its own CSPRNG, divides by the run's expected batch size, counts
the step and answers the epsilon spent so far; past the budget it answers
:class:`psgrad.PrivacyBudgetExhausted`. The accounting assumes Poisson sampling at the run's
rate, which :func:`poisson_batches` does. :class:`DPOptimizer` drives a torch optimizer and
imports torch only when it is used.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from psgrad._base import resource_path
from psgrad._client import Client
from psgrad._constants import IDEMPOTENCY_KEY
from psgrad._types import GradsResult

__all__ = ["DPOptimizer", "Run", "Step", "create_run", "get_run", "poisson_batches"]


@dataclass
class Step:
    """One DP-SGD step's answer: the noisy mean gradient and the privacy spent so far."""

    clipped_mean: dict[str, Any]
    steps: int
    epsilon: float
    result: GradsResult


class Run:
    """A DP run on the server (``/dp-runs/{id}``); its fields as of the last fetch in ``doc``."""

    def __init__(self, client: Client, doc: Mapping[str, Any]) -> None:
        self.client = client
        self.doc = dict(doc)

    def __repr__(self) -> str:
        return (f"Run({self.id!r}, model={self.model!r}, steps={self.doc.get('steps')}, "
                f"max_steps={self.doc.get('max_steps')})")

    @property
    def id(self) -> str:
        return str(self.doc["id"])

    @property
    def model(self) -> str:
        return str(self.doc["model"])

    @property
    def noise_multiplier(self) -> float:
        return float(self.doc["noise_multiplier"])

    @property
    def sample_rate(self) -> float:
        return float(self.doc["sample_rate"])

    @property
    def planned_steps(self) -> int | None:
        steps = self.doc.get("planned_steps")
        return None if steps is None else int(steps)

    def refresh(self) -> dict[str, Any]:
        """Fetch the run again: steps, epsilon under each accountant, budget left."""
        self.doc = self.client._send("GET", resource_path("dp-runs", "DP run", self.id)).json()
        return self.doc

    def step(self, inputs: Any, targets: Any = None, *, weights: Mapping[str, Any] | None = None,
             loss: str | None = None, params: Sequence[str] | None = None,
             as_torch: bool = False) -> Step:
        """One step on one batch with the current ``weights``: the run's noisy clipped mean.

        The batch goes in one request (a step is never split: the server counts requests),
        under an ``Idempotency-Key`` of its own: sent again after a lost answer, it names the
        same job, counted once, and answers the same noisy mean.

        Raises:
            psgrad.PrivacyBudgetExhausted: the run has no step left; nothing was released.
            ValueError: an empty batch (the server computes nothing for it).
        """
        if len(inputs) == 0:
            raise ValueError("an empty batch cannot be sent; Poisson sampling gives one with "
                             "probability (1 - q)^N: skip it or draw the next")
        started = time.perf_counter()
        fields = self.client._grads_fields(self.model, inputs, targets, loss=loss,
                                           outputs=["clipped_mean"], params=params,
                                           weights=weights)
        fields["dp_run"] = self.id
        answer = self.client._decode(self.client._post_fields("/per-sample-grads", fields))
        result = self.client._result(answer, as_torch=as_torch, started=started)
        dp = answer.get("dp") or {}
        return Step(result.clipped_mean, int(dp.get("steps", 0)),
                    float(dp.get("epsilon", float("nan"))), result)


def create_run(client: Client, model: str, *, clip_norm: float, delta: float,
               noise_multiplier: float | None = None, target_epsilon: float | None = None,
               sample_rate: float | None = None, expected_batch_size: float | None = None,
               dataset_size: int | None = None, max_epsilon: float | None = None,
               steps: int | None = None, epochs: float | None = None, accountant: str = "rdp",
               clip_form: str = "exact") -> Run:
    """``POST /dp-runs``: give ``noise_multiplier`` or ``target_epsilon`` (with ``steps`` or
    ``epochs``), and two of ``sample_rate``, ``expected_batch_size``, ``dataset_size``. It goes
    under an ``Idempotency-Key`` of its own, so it is sent again after a lost answer and makes
    one run."""
    body = {"model": model, "clip_norm": clip_norm, "delta": delta,
            "noise_multiplier": noise_multiplier, "target_epsilon": target_epsilon,
            "sample_rate": sample_rate, "expected_batch_size": expected_batch_size,
            "dataset_size": dataset_size, "max_epsilon": max_epsilon, "steps": steps,
            "epochs": epochs, "accountant": accountant, "clip_form": clip_form}
    doc = client._send("POST", "/dp-runs", json={k: v for k, v in body.items() if v is not None},
                       headers={IDEMPOTENCY_KEY: uuid.uuid4().hex}).json()
    return Run(client, doc)


def get_run(client: Client, run_id: str) -> Run:
    """An existing run (``GET /dp-runs/{id}``)."""
    return Run(client, client._send("GET", resource_path("dp-runs", "DP run", run_id)).json())


def poisson_batches(n: int, sample_rate: float, steps: int | None = None, *,
                    rng: np.random.Generator | None = None) -> Iterator[np.ndarray]:
    """Index batches of Poisson sampling: each of ``n`` records joins each batch independently
    with probability ``sample_rate`` (what the accounting assumes). ``steps`` defaults to one
    epoch, ``round(1 / sample_rate)`` batches. Batch sizes vary; one may be empty."""
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate is a probability in (0, 1]; got {sample_rate!r}")
    rng = rng or np.random.default_rng()
    for _ in range(round(1 / sample_rate) if steps is None else steps):
        yield np.flatnonzero(rng.random(n) < sample_rate)


class DPOptimizer:
    """A torch optimizer driven by a DP run: :meth:`step` sends the module's current weights
    and a batch, sets each parameter's ``.grad`` to the run's noisy clipped mean, and steps the
    optimizer. The module's parameter names must be the server model's (same architecture)."""

    def __init__(self, run: Run, module: Any, optimizer: Any) -> None:
        self.run = run
        self.module = module
        self.optimizer = optimizer

    def step(self, inputs: Any, targets: Any = None, **kwargs: Any) -> Step:
        import torch  # only here: the SDK itself never needs torch

        params = dict(self.module.named_parameters())
        weights = {k: p.detach().cpu().numpy() for k, p in params.items()}
        out = self.run.step(inputs, targets, weights=weights, **kwargs)
        for name, p in params.items():
            if name in out.clipped_mean:
                p.grad = torch.as_tensor(np.asarray(out.clipped_mean[name]), dtype=p.dtype,
                                         device=p.device)
        self.optimizer.step()
        return out
