"""One batched forward and backward with capture, and the per-structure plan it follows.

The plan says which parameters are captured op by op and which fall back to a module replay.
It is made once per model structure, loss, selection and sample shape by a *probe* on a few
samples (the forward pass with the module stack recorded), then *checked*: the probe samples'
per-sample squared norms and dot products with a random reference must equal the ``vmap``
path's, and a parameter that does not is moved to the whole-model replay. Every later call must
read the parameters in the same sequence of ops, or it takes the ``vmap`` path.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge
from torch.func import functional_call, vmap

from service.fast_stats._core import Budget, Capture, Need, Source, Tensors, Unsupported, Use
from service.fast_stats._sources import ModuleReplay, SourceContext, build
from service.losses import get_loss
from service.registry import LoadedModel

PROBE = 3  # samples in the probe batch (drawn cyclically from the first call's batch)


@dataclass
class Plan:
    tracked: tuple[str, ...]  # parameters captured op by op
    modules: dict[str, list[str]]  # module name ("" is the model) -> parameters it replays
    signature: list[tuple[Any, ...]] = field(default_factory=list)
    owners: dict[str, str] = field(default_factory=dict)  # parameter -> owning module


@dataclass
class Run:
    losses: torch.Tensor
    aux: torch.Tensor
    uses: list[Use]
    calls: dict[str, list[list[Any]]]  # module -> [input, output, output gradient] per call
    simple: dict[str, bool]


_PLANS: OrderedDict[tuple[Any, ...], Plan | None] = OrderedDict()
_LOCK = threading.Lock()


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


def forward_backward(
    model: LoadedModel,
    params: Tensors,
    samples: Tensors,
    loss: str,
    gamma: float,
    plan: Plan,
    *,
    probe: bool = False,
    backward: bool = True,
) -> Run:
    """The batched forward (captured) and one backward for the captured outputs' gradients."""
    module, buffers = model.module, model.buffers
    inputs = samples["inputs"]
    batch = inputs.shape[0]
    wanted = set(plan.tracked) | {k for v in plan.modules.values() for k in v}
    live = {
        k: v.detach().requires_grad_() if k in wanted else v.detach() for k, v in params.items()
    }
    tracked = {id(live[k]): k for k in plan.tracked}
    consts = {id(v) for k, v in live.items() if k not in plan.tracked}
    consts |= {id(v) for v in buffers.values()}
    calls: dict[str, list[list[Any]]] = {k: [] for k in plan.modules}
    simple: dict[str, bool] = {}
    stack: list[str] = []
    state = {"on": True, "thread": threading.get_ident()}
    named = dict(module.named_modules())
    hooks = []

    def mine() -> bool:
        return bool(state["on"]) and threading.get_ident() == state["thread"]

    def keep(name: str) -> Any:
        def hook(_m: nn.Module, args: Any, out: Any) -> None:
            if mine() and args and isinstance(out, torch.Tensor):
                calls[name].append([args[0], out, None])

        return hook

    def push(name: str) -> Any:
        def hook(_m: nn.Module, args: Any, kwargs: Any) -> None:
            if mine():
                stack.append(name)
                ok = (
                    len(args) == 1
                    and isinstance(args[0], torch.Tensor)
                    and args[0].dim() > 0
                    and args[0].shape[0] == batch
                    and all(v is None for v in kwargs.values())
                )
                simple[name] = simple.get(name, True) and ok

        return hook

    def pop(name: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            if mine():
                stack.pop()
                ok = isinstance(out, torch.Tensor) and out.dim() > 0 and out.shape[0] == batch
                simple[name] = simple.get(name, True) and ok

        return hook

    try:
        for name in plan.modules:
            hooks.append(named[name].register_forward_hook(keep(name)))
        if probe:
            for name, m in named.items():
                hooks.append(m.register_forward_pre_hook(push(name), with_kwargs=True))
                hooks.append(m.register_forward_hook(pop(name)))
        cap = Capture(tracked, consts, batch, stack if probe else None)
        with cap:
            out = functional_call(module, (live, buffers), (inputs,))
        state["on"] = False
    finally:
        for h in hooks:
            h.remove()
    if not isinstance(out, torch.Tensor):
        raise Unsupported("the model does not return one tensor")
    next_out = None
    if "next_inputs" in get_loss(loss).needs and "next_inputs" in samples:
        with torch.no_grad():
            next_out = functional_call(module, (params, buffers), (samples["next_inputs"],))
    losses, aux = batched_losses(loss, out, next_out, samples, gamma)
    uses = cap.uses
    del out, next_out
    # The backward needs only where each captured output sits in the graph, not its values:
    # hand it gradient edges and let the outputs go (the saved activations are what it keeps).
    slots: list[tuple[Any, Any, torch.Size, torch.dtype]] = []
    edges = []
    for u in uses:
        if u.out is not None:
            if backward and u.out.requires_grad:
                edges.append(get_gradient_edge(u.out))
                slots.append((u, None, u.out.shape, u.out.dtype))
            elif backward:
                u.g = torch.zeros_like(u.out)
            u.out = None
    for v in calls.values():
        for c in v:
            if backward and c[1].requires_grad:
                edges.append(get_gradient_edge(c[1]))
                slots.append((None, c, c[1].shape, c[1].dtype))
            elif backward:
                c[2] = torch.zeros_like(c[1])
            c[1] = None
    if backward:
        grads: Sequence[torch.Tensor | None] = [None] * len(edges)
        if edges and losses.requires_grad:
            grads = torch.autograd.grad(losses.sum(), edges, allow_unused=True)
        for (u, c, shape, dtype), g in zip(slots, grads, strict=True):
            if g is None:
                g = torch.zeros(shape, dtype=dtype, device=inputs.device)
            if u is not None:
                u.g = g
            else:
                c[2] = g
    return Run(losses.detach(), aux.detach(), uses, calls, simple)


def sources(
    model: LoadedModel, params: Tensors, run: Run, plan: Plan, batch: int, budget: Budget
) -> list[Source]:
    ctx = SourceContext(
        batch,
        budget,
        {k: v.shape for k, v in params.items()},
        params,
        model.buffers,
        model.dtype,
        next(iter(params.values())).device,
        model.activation_numel,
    )
    out = build(run.uses, plan.tracked, ctx)
    named = dict(model.module.named_modules())
    for name, replayed in plan.modules.items():
        same = all(plan.owners.get(k) == name for k in replayed)
        method = "direct" if same and name else "vmap"
        out.append(ModuleReplay(replayed, name, named[name], run.calls[name], method, ctx))
    run.uses.clear()  # each source holds what it still needs; the rest (LayerNorm inputs,
    run.calls.clear()  # gradients already reduced to per-sample values) can go now
    return out


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _enclosing(stacks: list[tuple[str, ...]], simple: dict[str, bool]) -> str:
    """The deepest module on every stack whose every call is ``module(x) -> y``, batch first."""
    common: list[str] = []
    for level in zip(*stacks, strict=False):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    for name in reversed(common):
        if simple.get(name):
            return name
    return ""


def plan_for(
    model: LoadedModel,
    params: Tensors,
    samples: Tensors,
    loss: str,
    gamma: float,
    selected: Sequence[str],
) -> Plan | None:
    """The cached plan for this structure, loss, selection and sample shapes (None: use vmap)."""
    key = (
        model.structure or model.ref,
        str(model.dtype),
        loss,
        tuple(selected),
        tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in samples.items()),
        str(next(iter(params.values())).device),
    )
    with _LOCK:
        if key in _PLANS:
            _PLANS.move_to_end(key)
            return _PLANS[key]
    idx = torch.arange(PROBE) % samples["inputs"].shape[0]
    probe = {k: v[idx] for k, v in samples.items()}
    try:
        plan: Plan | None = _make(model, params, probe, loss, gamma, selected)
    except Unsupported:
        plan = None
    with _LOCK:
        _PLANS[key] = plan
        while len(_PLANS) > 256:
            _PLANS.popitem(last=False)
    return plan


def _make(
    model: LoadedModel,
    params: Tensors,
    probe: Tensors,
    loss: str,
    gamma: float,
    selected: Sequence[str],
) -> Plan:
    first = Plan(tuple(selected), {})
    run = forward_backward(model, params, probe, loss, gamma, first, probe=True, backward=False)
    stacks: dict[str, list[tuple[str, ...]]] = {}
    for use in run.uses:
        if use.kind == "opaque":
            for name in use.roles:
                stacks.setdefault(name, [])
    for use in run.uses:
        for name in use.roles:
            if name in stacks:
                stacks[name].append(use.stack)
    modules: dict[str, list[str]] = {}
    for name in selected:
        if name in stacks:
            modules.setdefault(_enclosing(stacks[name], run.simple), []).append(name)
    plan = _finish(model, params, probe, loss, gamma, selected, modules)
    wrong = _check(model, params, probe, loss, gamma, plan)
    if wrong:
        for name in wrong:
            for replayed in modules.values():
                if name in replayed:
                    replayed.remove(name)
            modules.setdefault("", []).append(name)
        modules = {k: v for k, v in modules.items() if v}
        plan = _finish(model, params, probe, loss, gamma, selected, modules)
    return plan


def _finish(
    model: LoadedModel,
    params: Tensors,
    probe: Tensors,
    loss: str,
    gamma: float,
    selected: Sequence[str],
    modules: dict[str, list[str]],
) -> Plan:
    replayed = {k for v in modules.values() for k in v}
    plan = Plan(
        tuple(k for k in selected if k not in replayed),
        modules,
        owners={k: _owner(k) for k in selected},
    )
    run = forward_backward(model, params, probe, loss, gamma, plan, backward=False)
    plan.signature = [u.signature() for u in run.uses]
    return plan


def _check(
    model: LoadedModel, params: Tensors, probe: Tensors, loss: str, gamma: float, plan: Plan
) -> list[str]:
    """Parameters whose probe statistics differ from the ``vmap`` path's."""
    from service.engine import per_sample_fn

    selected = list(plan.tracked) + [k for v in plan.modules.values() for k in v]
    gen = torch.Generator().manual_seed(0)
    reference = {k: torch.randn(params[k].shape, generator=gen).to(params[k]) for k in selected}
    run = forward_backward(model, params, probe, loss, gamma, plan)
    need = Need(True, reference, False, False, [(0, PROBE)], model.dtype)
    got = {}
    for source in sources(model, params, run, plan, PROBE, Budget(64 << 20)):
        got.update(source.pass1(need))
    chosen = {k: params[k] for k in selected}
    others = {k: v for k, v in params.items() if k not in chosen}
    fn = per_sample_fn(model, loss, gamma)
    grads, _ = fn(chosen, others, model.buffers, probe)
    wrong = []
    for k in selected:
        flat = grads[k].reshape(PROBE, -1)
        sq, dot = flat.pow(2).sum(1), flat @ reference[k].reshape(-1)
        scale = 1 + float(sq.max())
        got_sq, got_dot = got[k].sq, got[k].dot
        assert got_sq is not None and got_dot is not None
        same_sq = torch.allclose(got_sq, sq, rtol=1e-3, atol=1e-5 * scale)
        if not (same_sq and torch.allclose(got_dot, dot, rtol=1e-3, atol=1e-3 * scale**0.5)):
            wrong.append(k)
    return wrong
