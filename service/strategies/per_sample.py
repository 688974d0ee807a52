"""The per-sample function: ``functional_call`` + ``vmap(grad_and_value(loss))``, and its cache.

``per_sample_fn(model, loss, gamma)`` answers ``(selected, others, buffers, samples) ->
(grads, (losses, aux))`` over a batch. It is cached by model structure, device, dtype, loss,
gamma and route; parameters and buffers are arguments, so per-call weights and new versions
never rebuild it. Models whose layers vmap cannot batch (``nn.GRU``/``nn.RNN`` in torch 2.13)
get the per-sample loop instead (route ``loop``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.func import functional_call, grad_and_value, jvp, vmap

from service.losses import LOSSES
from service.lru import LockedLRU
from service.registry import LoadedModel
from service.strategies.base import NAMED_INPUT, Tensors

PerSampleFn = Callable[[Tensors, Tensors, Tensors, Tensors], Any]
SampleLoss = Callable[[Tensors, Tensors, Tensors, Tensors], Any]
FUNCTIONS: LockedLRU[tuple[Any, ...], PerSampleFn] = LockedLRU(64)  # hits/misses on /metrics


# Forward-mode AD's levels are one stack for the whole process, not one per thread: two threads
# in ``jvp`` at once fail ("a forward AD level with an invalid index"). Every jvp holds this.
FORWARD_AD = threading.Lock()


def warm_up() -> None:
    """Pay torch.func's one-time set-up before the first job, not inside it.

    The first ``grad`` of a process imports ``torch._dynamo`` (``_autograd_grad`` enters
    ``torch._dynamo.compiled_autograd._disable()``): 1 to 3 s on our CPUs, which would
    otherwise land on the first request a worker serves. The first forward-mode derivative
    (``jvp``: a plan's check) registers its decompositions: 0.4-0.8 s, a quarter of GPT-2
    small's check. Workers call this when they start.
    """
    import torch._dynamo

    vmap(grad_and_value(lambda w, x: (w * x).sum()), in_dims=(None, 0))(
        torch.ones(2), torch.ones(2, 2))
    with FORWARD_AD:
        jvp(lambda w: (w * w).sum(), (torch.ones(2),), (torch.ones(2),))


def per_sample_fn(model: LoadedModel, loss_name: str, gamma: float) -> PerSampleFn:
    """``(selected, other_params, buffers, samples) -> (grads, (losses, aux))`` over a batch."""
    key = (model.structure or model.ref, str(model.device),
           model.dtype, loss_name, gamma, model.route)
    return FUNCTIONS.get_or_make(key, lambda: _build(model, loss_name, gamma))


def sample_loss_of(model: LoadedModel, loss_name: str, gamma: float) -> SampleLoss:
    """``(selected, others, buffers, sample) -> (loss, aux)`` of ONE sample, run as a batch of
    one: what ``vmap(grad)`` differentiates here, and what :mod:`service.verify` differentiates
    with plain autograd, one sample at a time."""
    loss = LOSSES[loss_name]
    module = model.module
    named = [NAMED_INPUT + spec.name for spec in model.inputs[1:]]
    on_cuda = model.device.type == "cuda"
    switch = _without_cudnn if model.route == "loop" and on_cuda else contextlib.nullcontext

    def sample_loss(selected: Tensors, others: Tensors, buffers: Tensors,
                    sample: Tensors) -> Any:
        params = {**others, **selected}
        rest = tuple(sample[k].unsqueeze(0) for k in named)  # () for one-input models

        def forward(x: torch.Tensor) -> torch.Tensor:
            return functional_call(module, (params, buffers), (x.unsqueeze(0), *rest)).squeeze(0)

        with switch():
            return loss.fn(forward, sample, gamma)

    return sample_loss


def _without_cudnn() -> contextlib.AbstractContextManager[None]:
    """cuDNN's recurrent kernels differentiate only in training mode and read raw data pointers,
    which torch.func's gradient tensors do not have: on CUDA the loop route runs stock recurrent
    layers on torch's own kernels. The switch is process-wide, so while a loop-route job runs,
    other worker threads' convolutions on CUDA run without cuDNN too (same results, slower)."""
    cudnn = torch.backends.cudnn
    return cudnn.flags(enabled=False, benchmark=cudnn.benchmark,  # the rest as they are
                       deterministic=cudnn.deterministic, allow_tf32=cudnn.allow_tf32)


def _build(model: LoadedModel, loss_name: str, gamma: float) -> PerSampleFn:
    one = grad_and_value(sample_loss_of(model, loss_name, gamma), has_aux=True)
    return _looped(one) if model.route == "loop" else vmap(one, in_dims=(None, None, None, 0))


def _looped(one: Callable[..., Any]) -> PerSampleFn:
    """The per-sample loop, for layers vmap cannot batch (``nn.GRU``/``nn.RNN`` in torch 2.13)."""

    def fn(selected: Tensors, others: Tensors, buffers: Tensors, samples: Tensors) -> Any:
        size = next(iter(samples.values())).shape[0]
        results = [one(selected, others, buffers, {k: v[i] for k, v in samples.items()})
                   for i in range(size)]
        grads = {k: torch.stack([r[0][k] for r in results]) for k in selected}
        losses = torch.stack([r[1][0] for r in results])
        aux = torch.stack([r[1][1] for r in results])
        return grads, (losses, aux)

    return fn
