"""The slow, plain reference the verification holds an answer to: one sample at a time.

Each sample runs alone (a batch of one) through the model's loss (the same
:func:`service.strategies.per_sample.sample_loss_of` the engine differentiates under ``vmap``),
and plain ``torch.autograd.grad`` differentiates it: no ``torch.func`` transform, no fast
statistics, no chunking, so a fault in any of those shows as a difference. The parameters are the
call's (per-call weights applied), fresh leaves for every sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from service import engine
from service.engine import Batch, Options
from service.registry import LoadedModel
from service.strategies.base import Tensors
from service.strategies.per_sample import sample_loss_of

__all__ = ["Loop", "per_sample_loop", "take"]


@dataclass(frozen=True)
class Loop:
    """Per-sample results of the loop, stacked over the samples, in the model's dtype."""

    grads: Tensors  # {param: [k, *shape]}, the selected parameters in the call's order
    losses: torch.Tensor  # [k]
    aux: torch.Tensor  # [k]: td0's TD errors, else the loss again


def take(batch: Batch, rows: list[int]) -> Batch:
    """The samples ``rows`` of ``batch``, with its weights and references."""
    index = torch.tensor(rows, dtype=torch.long)

    def pick(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.index_select(0, index.to(t.device))

    inputs = pick(batch.inputs)
    assert inputs is not None
    return Batch(
        inputs=inputs, targets=pick(batch.targets), next_inputs=pick(batch.next_inputs),
        rewards=pick(batch.rewards), dones=pick(batch.dones), mask=pick(batch.mask),
        weights=batch.weights, reference=batch.reference,
        named={k: v.index_select(0, index.to(v.device)) for k, v in batch.named.items()},
        references=batch.references, sketches=batch.sketches,
    )


def per_sample_loop(model: LoadedModel, batch: Batch, opts: Options) -> Loop:
    """The gradient of each sample's loss with respect to the selected parameters, by autograd.

    Holds the engine's lock of the model for the loop: ``functional_call`` swaps the module's
    parameters while it runs.
    """
    call = engine.prepare(model, batch, opts, [batch.size])
    sample_loss = sample_loss_of(model, opts.loss, opts.gamma)
    others = {k: v.detach() for k, v in call.params.items() if k not in call.selected}
    grads: dict[str, list[torch.Tensor]] = {k: [] for k in call.selected}
    losses, aux = [], []
    with engine.lock_for(model), torch.enable_grad():
        for i in range(call.size):
            leaves = {k: call.params[k].detach().requires_grad_(True) for k in call.selected}
            sample = {k: v[i] for k, v in call.samples.items()}
            value, extra = sample_loss(leaves, others, model.buffers, sample)
            found = torch.autograd.grad(value, list(leaves.values()), allow_unused=True)
            for (k, leaf), g in zip(leaves.items(), found, strict=True):
                grads[k].append(torch.zeros_like(leaf) if g is None else g)
            losses.append(value.detach())
            aux.append(extra.detach())
    return Loop(grads={k: torch.stack(v) for k, v in grads.items()},
                losses=torch.stack(losses), aux=torch.stack(aux))
