"""One batched forward pass with capture, and one backward pass for the captured outputs.

The forward pass runs the model once over the batch under :class:`~._capture.Capture` (the uses
of the tracked parameters) and :class:`_ModuleHooks` (the calls of the modules the plan
replays, and during the probe the module stack). The backward pass of the summed per-sample
losses then gives the gradient at each captured output: row i is sample i's own, samples being
independent in eval mode. What leaves is an immutable :class:`Run`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.func import functional_call, vmap
from torch.utils.hooks import RemovableHandle

from service.fast_stats._capture import Capture
from service.fast_stats._records import ModuleCall, Signature, Unsupported, Use
from service.losses import get_loss
from service.registry import LoadedModel
from service.strategies.base import NAMED_INPUT, Tensors


@dataclass(frozen=True)
class Setup:
    """What a pass runs: the model, this call's parameter values, the samples, the loss and the
    selected parameters (the probe's few samples, or the call's whole batch)."""

    model: LoadedModel
    params: Tensors
    samples: Tensors
    loss: str
    gamma: float
    selected: tuple[str, ...]

    @property
    def size(self) -> int:
        return int(self.samples["inputs"].shape[0])


@dataclass(frozen=True)
class Plan:
    """Which parameters are captured op by op, which a module replays, and the sequence of
    uses every call must repeat for the plan to hold."""

    tracked: tuple[str, ...]
    modules: Mapping[str, tuple[str, ...]]  # module name ("" is the model) -> what it replays
    signature: tuple[Signature, ...] = ()
    owners: Mapping[str, str] = field(default_factory=dict)  # parameter -> owning module


@dataclass(frozen=True)
class Run:
    """What one pass leaves: each sample's loss and aux value, every use with its output
    gradient, every call of a replayed module, and which modules take ``module(x) -> y``."""

    losses: torch.Tensor
    aux: torch.Tensor
    uses: tuple[Use, ...]
    calls: Mapping[str, tuple[ModuleCall, ...]]
    simple: Mapping[str, bool]


def batched_losses(
    loss_name: str, out: torch.Tensor, next_out: torch.Tensor | None, samples: Tensors, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's loss (and aux value) from the batched outputs, by the registered loss.

    The loss is the same function the ``vmap`` path uses; its ``forward`` answers the model's
    output for this sample (or for its next state, ``td0``) instead of running the model.
    """
    loss = get_loss(loss_name)
    if loss.batched is not None and next_out is None:
        rows = loss.batched(out, samples)
        if rows is not None:
            return rows

    def one(o: torch.Tensor, on: torch.Tensor | None, sample: Tensors) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            if x is sample["inputs"]:
                return o
            if on is not None and x is sample.get("next_inputs"):
                return on
            raise Unsupported(f"loss '{loss_name}' runs the model on a derived input")

        return loss.fn(forward, sample, gamma)

    losses, aux = vmap(one, in_dims=(0, None if next_out is None else 0, 0))(out, next_out, samples)
    return losses, aux


class _ModuleHooks:
    """Module hooks for one forward pass, on this thread only (another thread may run a model
    of the same structure): the input and output of each call of the ``replayed`` modules and,
    with ``probe``, the stack of running modules and which are only ever called batch first as
    ``module(x) -> y``."""

    def __init__(
        self, module: nn.Module, replayed: Sequence[str], batch: int, *, probe: bool
    ) -> None:
        self.named = dict(module.named_modules())
        self.replayed = tuple(replayed)
        self.batch = batch
        self.probe = probe
        self.calls: dict[str, list[tuple[tuple[torch.Tensor, ...], torch.Tensor]]] = {
            k: [] for k in replayed
        }
        self.simple: dict[str, bool] = {}
        self.stack: list[str] = []
        self._thread: int | None = None
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> _ModuleHooks:
        self._thread = threading.get_ident()
        for name in self.replayed:
            self._handles.append(self.named[name].register_forward_hook(partial(self._keep, name)))
        if self.probe:
            for name, m in self.named.items():
                self._handles.append(
                    m.register_forward_pre_hook(partial(self._push, name), with_kwargs=True))
                self._handles.append(m.register_forward_hook(partial(self._pop, name)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread = None
        for h in self._handles:
            h.remove()

    def _mine(self) -> bool:
        return threading.get_ident() == self._thread

    def _keep(self, name: str, _m: nn.Module, args: Any, out: Any) -> None:
        if self._mine() and args and isinstance(out, torch.Tensor):
            self.calls[name].append((tuple(args), out))  # several: the whole model's inputs

    def _push(self, name: str, _m: nn.Module, args: Any, kwargs: Any) -> None:
        if self._mine():
            self.stack.append(name)
            x = args[0] if len(args) == 1 else None
            self._note(name, isinstance(x, torch.Tensor) and self._batch_first(x)
                       and all(v is None for v in kwargs.values()))

    def _pop(self, name: str, _m: nn.Module, _args: Any, out: Any) -> None:
        if self._mine():
            self.stack.pop()
            self._note(name, isinstance(out, torch.Tensor) and self._batch_first(out))

    def _batch_first(self, t: torch.Tensor) -> bool:
        return t.dim() > 0 and t.shape[0] == self.batch

    def _note(self, name: str, ok: bool) -> None:
        self.simple[name] = self.simple.get(name, True) and ok


class _Outputs:
    """The captured outputs, by where each sits in the autograd graph.

    The backward pass needs only that, not their values, so the outputs themselves can go
    before it runs (the activations it saved are what it keeps).
    """

    def __init__(self) -> None:
        self.edges: list[GradientEdge] = []
        self.slots: list[tuple[int | None, torch.Size, torch.dtype, torch.device]] = []

    def add(self, out: torch.Tensor) -> int:
        """Where ``out``'s gradient will be in :meth:`grads`."""
        edge = None
        if out.requires_grad:
            edge = len(self.edges)
            self.edges.append(get_gradient_edge(out))
        self.slots.append((edge, out.shape, out.dtype, out.device))
        return len(self.slots) - 1

    def grads(self, losses: torch.Tensor) -> list[torch.Tensor]:
        """The gradient of the summed losses at each output (zeros where it does not reach)."""
        found: Sequence[torch.Tensor | None] = [None] * len(self.edges)
        if self.edges and losses.requires_grad:
            found = torch.autograd.grad(losses.sum(), self.edges, allow_unused=True)
        out = []
        for edge, shape, dtype, device in self.slots:
            g = found[edge] if edge is not None else None
            out.append(g if g is not None else torch.zeros(shape, dtype=dtype, device=device))
        return out


def forward_backward(setup: Setup, plan: Plan, *, probe: bool = False,
                     backward: bool = True) -> Run:
    """The batched forward (captured) and one backward for the captured outputs' gradients."""
    model = setup.model
    module, buffers, samples = model.module, model.buffers, setup.samples
    wanted = set(plan.tracked) | {k for v in plan.modules.values() for k in v}
    live = {
        k: v.detach().requires_grad_() if k in wanted else v.detach()
        for k, v in setup.params.items()
    }
    tracked = {id(live[k]): k for k in plan.tracked}
    consts = {id(v) for k, v in live.items() if k not in plan.tracked}
    consts |= {id(v) for v in buffers.values()}
    hooks = _ModuleHooks(module, list(plan.modules), setup.size, probe=probe)
    cap = Capture(tracked, consts, setup.size, hooks.stack if probe else None)
    inputs = (samples["inputs"], *(samples[NAMED_INPUT + s.name] for s in model.inputs[1:]))
    with hooks, cap:
        out = functional_call(module, (live, buffers), inputs)
    if not isinstance(out, torch.Tensor):
        raise Unsupported("the model does not return one tensor")
    next_out = None
    if "next_inputs" in get_loss(setup.loss).needs and "next_inputs" in samples:
        with torch.no_grad():
            next_out = functional_call(module, (setup.params, buffers), (samples["next_inputs"],))
    losses, aux = batched_losses(setup.loss, out, next_out, samples, setup.gamma)
    del out, next_out
    outputs = _Outputs()
    uses = [(replace(u, out=None), outputs.add(u.out) if backward and u.out is not None else None)
            for u in cap.uses]
    calls = {name: [(x, outputs.add(y) if backward else None) for x, y in seen]
             for name, seen in hooks.calls.items()}
    simple = dict(hooks.simple)
    del cap, hooks  # the captured outputs go here: only their graph edges are left
    grads = outputs.grads(losses) if backward else []
    return Run(
        losses.detach(),
        aux.detach(),
        tuple(u if i is None else replace(u, g=grads[i]) for u, i in uses),
        {name: tuple(ModuleCall(x, None if i is None else grads[i]) for x, i in seen)
         for name, seen in calls.items()},
        simple,
    )
