"""An independent reference for the summary outputs: a per-sample loop, statistics in float64.

Each sample runs alone (batch of one) through the model with ``torch.autograd.grad`` and the loss
written out here (not :mod:`service.losses`); every statistic is then computed from the stacked
per-sample gradients in float64, the obviously correct slow way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

from service.engine import Batch, Options
from service.registry import LoadedModel

TOL = {"atol": 3e-3, "rtol": 1e-5}  # the PyTorch tutorial's tolerance
SUMMARY = (
    "losses",
    "norms",
    "layer_norms",
    "mean",
    "variance",
    "clipped_mean",
    "dot",
    "cosine_mean",
)


def _loss(
    model: LoadedModel,
    loss: str,
    params: dict[str, torch.Tensor],
    batch: Batch,
    i: int,
    gamma: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = functional_call(model.module, (params, model.buffers), (x[i : i + 1],))
        return out

    if loss == "td0":
        assert batch.next_inputs is not None and batch.rewards is not None
        value = run(batch.inputs).reshape(())
        with torch.no_grad():
            nxt = run(batch.next_inputs).reshape(())
        done = batch.dones[i] if batch.dones is not None else 0.0
        delta = batch.rewards[i] + gamma * (1 - done) * nxt - value
        return delta**2, delta.detach()
    out = run(batch.inputs)
    assert batch.targets is not None
    y = batch.targets[i : i + 1]
    if loss == "cross_entropy":
        value = F.cross_entropy(out, y)
    elif loss == "nll":
        value = F.nll_loss(out, y)
    else:
        value = F.mse_loss(out, y.reshape(out.shape))
    return value, value.detach()


def loop_grads(
    model: LoadedModel, batch: Batch, opts: Options
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """Per-sample gradients of the selected parameters, losses and aux values, one by one."""
    base = {**model.params, **batch.weights}
    grads: dict[str, list[torch.Tensor]] = {k: [] for k in opts.params}
    losses, aux = [], []
    for i in range(batch.size):
        params = {k: v.detach().clone().requires_grad_(k in opts.params) for k, v in base.items()}
        value, extra = _loss(model, opts.loss, params, batch, i, opts.gamma)
        chosen = [params[k] for k in opts.params]
        found = torch.autograd.grad(value, chosen, allow_unused=True)
        for k, p, g in zip(opts.params, chosen, found, strict=True):
            grads[k].append(torch.zeros_like(p) if g is None else g)
        losses.append(value.detach())
        aux.append(extra)
    return {k: torch.stack(v) for k, v in grads.items()}, torch.stack(losses), torch.stack(aux)


def reference(
    model: LoadedModel, batch: Batch, opts: Options, segments: Sequence[int]
) -> list[dict[str, Any]]:
    """Every summary output per segment, from the loop's gradients, in float64."""
    grads, losses, aux = loop_grads(model, batch, opts)
    return summarize(grads, losses, aux, batch, opts, segments)


def summarize(
    grads: dict[str, torch.Tensor],
    losses: torch.Tensor,
    aux: torch.Tensor,
    batch: Batch,
    opts: Options,
    segments: Sequence[int],
) -> list[dict[str, Any]]:
    """The summary outputs per segment from stacked per-sample gradients, in float64."""
    g64 = {k: v.to(torch.float64) for k, v in grads.items()}
    sq = {k: v.reshape(v.shape[0], -1).pow(2).sum(1) for k, v in g64.items()}
    norms = torch.stack(list(sq.values())).sum(0).sqrt()
    results = []
    start = 0
    for n in segments:
        rows = slice(start, start + n)
        start += n
        part = {k: v[rows] for k, v in g64.items()}
        mean = {k: v.mean(0) for k, v in part.items()}
        out: dict[str, Any] = {
            "losses": losses[rows],
            "td_errors": aux[rows],
            "norms": norms[rows],
            "layer_norms": {k: v[rows].sqrt() for k, v in sq.items()},
            "mean": mean,
            "variance": {k: v.var(0, unbiased=False) for k, v in part.items()},
        }
        if opts.clip_norm is not None:
            factor = (opts.clip_norm / norms[rows]).clamp(max=1.0).nan_to_num(1.0)
            out["clipped_mean"] = {
                k: torch.tensordot(factor, v, dims=1) / n for k, v in part.items()
            }
        if batch.reference:
            ref = {k: v.to(torch.float64).flatten() for k, v in batch.reference.items()}
            out["dot"] = sum(v.reshape(v.shape[0], -1) @ ref[k] for k, v in part.items())
        mean_norm = torch.stack([v.pow(2).sum() for v in mean.values()]).sum().sqrt()
        dots = sum(v.reshape(v.shape[0], -1) @ mean[k].flatten() for k, v in part.items())
        out["cosine_mean"] = (dots / (norms[rows] * mean_norm)).nan_to_num(0.0)
        results.append(out)
    return results


def assert_close(got: Any, want: Any, where: str = "", **tol: float) -> None:
    """Tensors and dicts of tensors, compared in the dtype of ``got``."""
    tol = tol or TOL
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_close(got[k], want[k], f"{where}/{k}", **tol)
        return
    assert isinstance(got, torch.Tensor), where
    torch.testing.assert_close(got, want.to(got.dtype), msg=lambda m: f"{where}: {m}", **tol)
