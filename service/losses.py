"""Per-sample losses, registered by name.

A loss sees one sample at a time (inside ``vmap``): ``forward(x)`` runs the model on one
unbatched input, ``sample`` holds that sample's tensors. It returns the scalar loss and an
auxiliary value (``td0``: the TD error delta; others: the loss itself). Facts that belong to one
loss live with it: ``td0``'s ``updates`` output is ``-0.5 *`` its gradient (delta_i grad V(s_i)).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from psgrad._errors import InvalidInput, UnknownLoss
from service.plugins import Registry

Forward = Callable[[torch.Tensor], torch.Tensor]
LossFn = Callable[[Forward, dict[str, torch.Tensor], float], tuple[torch.Tensor, torch.Tensor]]
# Optional: every sample's loss at once from the batched outputs, the same numbers as ``fn``
# one sample at a time (the fast statistics path); None when this call does not fit it.
BatchedFn = Callable[
    [torch.Tensor, dict[str, torch.Tensor]], "tuple[torch.Tensor, torch.Tensor] | None"
]


@dataclass(frozen=True)
class Loss:
    name: str
    fn: LossFn
    needs: tuple[str, ...]  # request fields besides inputs
    classification: bool = False  # targets are class indices into the output
    scalar_output: bool = False  # the model must give one value per sample
    tokens: bool = False  # scores [T, V] per sample, targets [T] token ids, optional mask [T]
    batched: BatchedFn | None = None
    # the per-sample ``updates`` output from the per-sample gradients (None: not offered)
    updates: Callable[[torch.Tensor], torch.Tensor] | None = None


LOSSES: Registry[str, Loss] = Registry("loss", UnknownLoss)


def register_loss(name: str, *, needs: tuple[str, ...] = ("targets",), classification: bool = False,
                  scalar_output: bool = False, tokens: bool = False,
                  batched: BatchedFn | None = None,
                  updates: Callable[[torch.Tensor], torch.Tensor] | None = None
                  ) -> Callable[[LossFn], LossFn]:
    def decorate(fn: LossFn) -> LossFn:
        LOSSES.add(name, Loss(name, fn, needs, classification, scalar_output, tokens, batched,
                              updates))
        return fn

    return decorate


def rows_of(fn: Callable[..., torch.Tensor]) -> BatchedFn:
    """A classification loss over [B, C] scores and [B] targets, one row per sample."""

    def batched(out: torch.Tensor, samples: dict[str, torch.Tensor]) -> Any:
        targets = samples["targets"]
        if out.dim() != 2 or targets.dim() != 1:
            return None
        loss = fn(out, targets, reduction="none")
        return loss, loss.detach()

    return batched


@register_loss("cross_entropy", classification=True, batched=rows_of(F.cross_entropy))
def cross_entropy(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    loss = F.cross_entropy(forward(sample["inputs"]).unsqueeze(0), sample["targets"].unsqueeze(0))
    return loss, loss.detach()


@register_loss("nll", classification=True, batched=rows_of(F.nll_loss))
def nll(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    loss = F.nll_loss(forward(sample["inputs"]).unsqueeze(0), sample["targets"].unsqueeze(0))
    return loss, loss.detach()


def _margins(out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log(p_y / (1 - p_y))`` of scores ``[..., C]`` and class ids ``[...]``, computed as
    ``out_y - logsumexp(out_c, c != y)``: no ``p`` near 0 or 1 is ever formed, and the same
    for logits and log-probabilities (a constant added to a row cancels)."""
    mine = torch.arange(out.shape[-1], device=out.device) == targets.unsqueeze(-1)
    correct = torch.where(mine, out, torch.zeros_like(out)).sum(-1)
    return correct - torch.logsumexp(out.masked_fill(mine, float("-inf")), -1)


def _margin_rows(out: torch.Tensor, samples: dict[str, torch.Tensor]) -> Any:
    targets = samples["targets"]
    if out.dim() != 2 or targets.dim() != 1 or out.shape[1] < 2:
        return None
    value = _margins(out, targets)
    return value, value.detach()


@register_loss("margin", classification=True, batched=_margin_rows)
def margin(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    """TRAK's output function for classifiers: the correct class's log-odds ``log(p / (1 - p))``.
    Not minimised by training: its gradients are what TRAK featurises (with cross-entropy's a
    user had to rescale by ``1 - p`` by hand)."""
    out = forward(sample["inputs"])
    if out.dim() != 1 or out.shape[0] < 2:
        raise InvalidInput(f"loss 'margin' needs one score per class (at least two) per "
                           f"sample; the model gives shape {list(out.shape)}")
    value = _margins(out, sample["targets"])
    return value, value.detach()


@register_loss("mse")
def mse(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    out = forward(sample["inputs"])
    loss = F.mse_loss(out, sample["targets"].reshape(out.shape))
    return loss, loss.detach()


def _td0_updates(grads: torch.Tensor) -> torch.Tensor:
    """delta_i grad V(s_i): the pseudo-loss's gradient is -2 delta_i grad V(s_i)."""
    return -0.5 * grads


@register_loss("td0", needs=("next_inputs", "rewards", "dones"), scalar_output=True,
               updates=_td0_updates)
def td0(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    """TD(0) pseudo-loss (target - V(s))^2 with the gradient stopped through the target."""
    value = forward(sample["inputs"]).reshape(())
    next_value = forward(sample["next_inputs"]).reshape(()).detach()
    done = sample.get("dones")  # optional: a batch built without dones has none done
    target = sample["rewards"] + (gamma * next_value if done is None
                                  else gamma * (1 - done) * next_value)
    delta = target - value
    return delta**2, delta.detach()


def _tokens(scores: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None) -> Any:
    """Mean cross-entropy of [T, V] scores against [T] ids over the positions ``mask`` keeps."""
    each = F.cross_entropy(scores, ids, reduction="none")
    loss = each.mean() if mask is None else (each * mask).sum() / mask.sum().clamp(min=1)
    return loss, loss.detach()


@register_loss("token_cross_entropy", needs=("targets", "mask"), tokens=True)
def token_cross_entropy(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    """Each position's scores against the target token at that position (tagging, MLM)."""
    return _tokens(forward(sample["inputs"]), sample["targets"], sample.get("mask"))


@register_loss("next_token", needs=("targets", "mask"), tokens=True)
def next_token(forward: Forward, sample: dict[str, torch.Tensor], gamma: float) -> Any:
    """A language model's loss: the scores at t predict token t + 1 (``scores[:-1]`` against
    ``targets[1:]``, usually the input ids themselves); the mask drops padded positions."""
    mask = sample.get("mask")
    return _tokens(forward(sample["inputs"])[:-1], sample["targets"][1:],
                   None if mask is None else mask[1:])
