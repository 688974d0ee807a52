"""One batched forward pass with capture, and one backward pass for the captured outputs.

The forward pass runs the model once over the batch under :class:`~._capture.Capture` (the uses
of the tracked parameters) and :class:`_ModuleHooks` (the calls of the modules the plan
replays, and during the probe the module stack). The backward pass of the summed per-sample
losses then gives the gradient at each captured output: row i is sample i's own, samples being
independent in eval mode. What leaves is an immutable :class:`Run`.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import Node
from torch.func import functional_call, vmap
from torch.utils.hooks import RemovableHandle

from service.fast_stats._capture import Capture
from service.fast_stats._records import ModuleCall, Output, Signature, Unsupported, Use
from service.losses import LOSSES
from service.registry import LoadedModel
from service.strategies.base import NAMED_INPUT, Tensors

Reduce = Callable[[torch.Tensor], torch.Tensor]  # an output gradient -> what its family keeps
# a use -> how to take in its output gradient as the backward pass reaches it, or None: the use
# then leaves with the run, its gradient set
Early = Callable[[Use], Reduce | None]


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


def widened(run: Run, dtype: torch.dtype) -> Run:
    """``run`` with every floating tensor it kept (activations, output gradients, replayed
    modules' inputs) in ``dtype``: a forward and backward under ``torch.autocast`` leave some in
    bfloat16, and the statistics are formed in the model's dtype."""
    uses = tuple(widened_use(u, dtype) for u in run.uses)
    calls = {name: tuple(ModuleCall(_widen(c.xs, dtype), _widen(c.g, dtype)) for c in seen)
             for name, seen in run.calls.items()}
    return replace(run, uses=uses, calls=calls)


def widened_use(use: Use, dtype: torch.dtype) -> Use:
    """``use`` with its payload's floating tensors and its output gradient in ``dtype``."""
    return replace(use, payload=_widen(use.payload, dtype), g=_widen(use.g, dtype))


def _widen(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with its floating tensors in ``dtype``, through tuples, lists, dicts and
    dataclasses (a family's payload)."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_widen(v, dtype) for v in value)
    if isinstance(value, Mapping):
        return {k: _widen(v, dtype) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: _widen(getattr(value, f.name), dtype)
            for f in dataclasses.fields(value) if f.init})
    return value


def batched_losses(
    loss_name: str, out: torch.Tensor, next_out: torch.Tensor | None, samples: Tensors, gamma: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's loss (and aux value) from the batched outputs, by the registered loss.

    The loss is the same function the ``vmap`` path uses; its ``forward`` answers the model's
    output for this sample (or for its next state, ``td0``) instead of running the model.
    """
    loss = LOSSES[loss_name]
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


def model_inputs(setup: Setup) -> tuple[torch.Tensor, ...]:
    """The model's positional inputs: the samples' ``inputs``, then its named inputs."""
    samples = setup.samples
    return (samples["inputs"], *(samples[NAMED_INPUT + s.name] for s in setup.model.inputs[1:]))


def setup_losses(setup: Setup, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's loss and aux value from the model's batched output ``out`` (the next
    states ``td0`` reads run here, without a gradient)."""
    model, samples = setup.model, setup.samples
    next_out = None
    if "next_inputs" in LOSSES[setup.loss].needs and "next_inputs" in samples:
        with torch.no_grad():
            next_out = functional_call(model.module, (setup.params, model.buffers),
                                       (samples["next_inputs"],))
    return batched_losses(setup.loss, out, next_out, samples, setup.gamma)


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
        self.calls: dict[str, list[tuple[tuple[torch.Tensor, ...], Output]]] = {
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
            self.calls[name].append((tuple(args), Output.of(out)))  # several: a model's inputs

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

    The backward pass needs only that (an :class:`~._records.Output`), not their values. An
    output whose family reduces
    its gradient (``reduce``: a batch norm's per-sample sums, ``[B, C, 2]`` for ``[B, C, H,
    W]``) gets it reduced as the backward pass reaches it, by a hook on the node that reads it,
    where that node runs: the full gradient is then never held to the end of the pass
    (ResNet-18 held every convolution's and batch norm's output gradient at once, 1.6x a
    plain step's memory).
    """

    def __init__(self) -> None:
        self.slots: list[tuple[Output, Reduce | None]] = []

    def add(self, out: Output, reduce: Reduce | None = None) -> int:
        """Where ``out``'s gradient (or its reduction) will be in :meth:`grads`."""
        self.slots.append((out, reduce))
        return len(self.slots) - 1

    def grads(self, losses: torch.Tensor) -> list[torch.Tensor]:
        """The gradient of the summed losses at each output (zeros where it does not reach),
        or its reduction."""
        root = losses.sum()
        edges = {i: o.edge for i, (o, _) in enumerate(self.slots) if o.edge is not None}
        early = [i for i in edges if self.slots[i][1] is not None]
        asked = [i for i in edges if i not in early]
        if early and root.grad_fn is not None:
            running = _running(root.grad_fn, {edges[i].node for i in asked})
            idle = [i for i in early if edges[i].node not in running]  # nothing asked below
            # ask for the lowest of those: every other one then has one below it and runs
            above = _running(root.grad_fn, {edges[i].node for i in idle})
            asked += [i for i in idle if edges[i].node not in above]
            early = [i for i in early if i not in asked]
        reduced: dict[int, torch.Tensor] = {}
        handles = [edges[i].node.register_prehook(partial(self._keep, reduced, i))
                   for i in early]
        found: dict[int, torch.Tensor | None] = {}
        try:
            if asked and losses.requires_grad:
                got = torch.autograd.grad(root, [edges[i] for i in asked], allow_unused=True)
                found = dict(zip(asked, got, strict=True))
        finally:
            for h in handles:
                h.remove()
        out = []
        for i, (o, reduce) in enumerate(self.slots):
            if i in reduced:
                out.append(reduced[i])
                continue
            g = _or_zeros(found.get(i), o)
            out.append(g if reduce is None else reduce(g))
        return out

    def _keep(self, reduced: dict[int, torch.Tensor], i: int,
              grads: tuple[torch.Tensor | None, ...]) -> None:
        """A prehook: slot i's gradient reduced as its node is about to run."""
        o, reduce = self.slots[i]
        assert o.edge is not None and reduce is not None
        with torch.no_grad():
            reduced[i] = reduce(_or_zeros(grads[o.edge.output_nr], o))
        self.slots[i] = (o, None)  # what it read can go now


def _or_zeros(g: torch.Tensor | None, out: Output) -> torch.Tensor:
    """``g``, or the zeros it stands for where the gradient does not reach ``out``."""
    return g if g is not None else torch.zeros(out.shape, dtype=out.dtype, device=out.device)


def _reduction(use: Use) -> Reduce | None:
    """How ``use``'s family reduces its output gradient as it arrives, if it does."""
    if use.family is None or not use.family.reduces:
        return None
    return partial(use.family.reduce, use)


def _running(root: Node, asked: set[Node]) -> set[Node]:
    """The nodes a backward pass from ``root`` runs to reach the ``asked`` nodes: those with
    one of them below (an asked node itself runs only if another is below it)."""
    above: dict[Node, bool] = {}
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        below = [n for n, _ in node.next_functions if n is not None]
        if done:
            above[node] = any(n in asked or above.get(n, False) for n in below)
        elif node not in above:
            above[node] = False  # a DAG: every node below is done before this one
            stack.append((node, True))
            stack.extend((n, False) for n in below if n not in above)
    return {n for n, yes in above.items() if yes}


def _slots(captured: Sequence[Use], outputs: _Outputs, early: Early | None
           ) -> list[tuple[Use, int | None]]:
    """Each use's record without its output, and where its gradient will be in
    :meth:`_Outputs.grads` (None: the output does not require grad); a use that ``early`` takes
    is in neither, what takes it holds it alone (no frame here keeps one: its layer's input
    goes as the backward pass passes it)."""
    uses: list[tuple[Use, int | None]] = []
    for u in captured:
        kept = replace(u, out=None)
        if u.out is None:
            uses.append((kept, None))
            continue
        taken = early(kept) if early is not None else None
        reduce = taken or _reduction(kept)
        slot = outputs.add(u.out, reduce)
        if taken is not None:
            continue  # what it answers holds the use
        if reduce is not None and u.family is not None:  # the reduction keeps what it reads
            kept = replace(kept, payload=u.family.spent(u.payload))
        uses.append((kept, slot))
    return uses


def forward_backward(setup: Setup, plan: Plan, *, probe: bool = False,
                     backward: bool = True, check: bool = False,
                     early: Early | None = None) -> Run:
    """The batched forward (captured) and one backward for the captured outputs' gradients.

    ``check``: the forward pass must read the parameters as the plan's probe did, or
    :class:`Unsupported`. A use that ``early`` takes hands its output gradient to what it
    answers as the backward pass reaches it, and leaves no record in the run.
    """
    model = setup.model
    module, buffers = model.module, model.buffers
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
    with hooks, cap:
        out = functional_call(module, (live, buffers), model_inputs(setup))
    if not isinstance(out, torch.Tensor):
        raise Unsupported("the model does not return one tensor")
    losses, aux = setup_losses(setup, out)
    del out
    if check and tuple(u.signature for u in cap.uses) != plan.signature:
        raise Unsupported("the model read its parameters differently from the probe")
    outputs = _Outputs()
    uses = _slots(cap.uses, outputs, early) if backward else [
        (replace(u, out=None), None) for u in cap.uses]
    calls = {name: [(x, outputs.add(y) if backward else None) for x, y in seen]
             for name, seen in hooks.calls.items()}
    simple = dict(hooks.simple)
    del cap, hooks  # the capture's records go here: what ``early`` took, it holds alone
    grads = outputs.grads(losses) if backward else []
    return Run(
        losses.detach(),
        aux.detach(),
        tuple(u if i is None else replace(u, g=grads[i]) for u, i in uses),
        {name: tuple(ModuleCall(x, None if i is None else grads[i]) for x, i in seen)
         for name, seen in calls.items()},
        simple,
    )
