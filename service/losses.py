"""Per-sample losses, registered by name.

A loss sees one sample at a time (inside ``vmap``): ``forward(x)`` runs the model on one
unbatched input, ``sample`` holds that sample's tensors. It returns the scalar loss and an
auxiliary value (``td0``: the TD error delta; others: the loss itself).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from psgrad._errors import UnknownLoss

Forward = Callable[[torch.Tensor], torch.Tensor]
LossFn = Callable[[Forward, dict[str, torch.Tensor], float], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class Loss:
    name: str
    fn: LossFn
    needs: tuple[str, ...]  # request fields besides inputs
    classification: bool = False  # targets are class indices into the output
    scalar_output: bool = False  # the model must give one value per sample


LOSSES: dict[str, Loss] = {}


def register_loss(name: str, *, needs: tuple[str, ...] = ("targets",), classification: bool = False,
                  scalar_output: bool = False) -> Callable[[LossFn], LossFn]:
    def decorate(fn: LossFn) -> LossFn:
        LOSSES[name] = Loss(name, fn, needs, classification, scalar_output)
        return fn

    return decorate


def get_loss(name: str) -> Loss:
    try:
        return LOSSES[name]
    except KeyError:
        raise UnknownLoss(
            f"unknown loss '{name}'; known: {', '.join(sorted(LOSSES))}", known=sorted(LOSSES)
        ) from None


@register_loss("cross_entropy", classification=True)
def cross_entropy(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    loss = F.cross_entropy(forward(sample["inputs"]).unsqueeze(0), sample["targets"].unsqueeze(0))
    return loss, loss.detach()


@register_loss("nll", classification=True)
def nll(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    loss = F.nll_loss(forward(sample["inputs"]).unsqueeze(0), sample["targets"].unsqueeze(0))
    return loss, loss.detach()


@register_loss("mse")
def mse(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    out = forward(sample["inputs"])
    loss = F.mse_loss(out, sample["targets"].reshape(out.shape))
    return loss, loss.detach()


@register_loss("td0", needs=("next_inputs", "rewards", "dones"), scalar_output=True)
def td0(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    """TD(0) pseudo-loss (target - V(s))^2 with the gradient stopped through the target."""
    value = forward(sample["inputs"]).reshape(())
    next_value = forward(sample["next_inputs"]).reshape(()).detach()
    done = sample.get("dones")  # optional: a batch built without dones has none done
    target = sample["rewards"] + (gamma * next_value if done is None
                                  else gamma * (1 - done) * next_value)
    delta = target - value
    return delta**2, delta.detach()
