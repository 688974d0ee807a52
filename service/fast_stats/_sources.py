"""Turning captured uses into sources: the family registry, op replays and module replays.

``direct``: an op reading a parameter sample by sample (``F.layer_norm``, ``x + pos``) is
replayed per sample with ``vmap(vjp)`` on the captured input and output gradient, so only that
op runs again. ``vmap``/``direct`` for a module: a parameter read in a way no family or op replay
understands (``w.t()`` inside a custom forward, attention with masks) gets the per-sample vjp of
the smallest enclosing module called as ``module(x)`` (``direct`` when that is the module that
owns it), down to the whole model (the plain ``vmap`` path, for that parameter only).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from service.fast_stats._core import (
    Budget,
    Materialised,
    Source,
    Summed,
    Tensors,
    Use,
    Zero,
)


@dataclass
class SourceContext:
    batch: int
    budget: Budget
    shapes: dict[str, torch.Size]
    params: Tensors  # every parameter's value for this call
    buffers: Tensors
    dtype: torch.dtype
    device: torch.device
    activation_numel: int


SourceFactory = Callable[[str, str, list[Use], SourceContext], Materialised]
SOURCES: dict[str, SourceFactory] = {}


def register_source(kind: str) -> Callable[[SourceFactory], SourceFactory]:
    def decorate(factory: SourceFactory) -> SourceFactory:
        SOURCES[kind] = factory
        return factory

    return decorate


class OpReplay(Materialised):
    """Per-sample gradients of one parameter from the ops that read it, replayed per sample."""

    def __init__(self, name: str, uses: list[Use], ctx: SourceContext) -> None:
        super().__init__([name], {name: ctx.shapes[name]}, ctx.batch, ctx.budget)
        self.uses = uses
        self.value = ctx.params[name].detach()

    def chunk_size(self) -> int:
        per = max(
            self.numel,
            max((u.g.numel() // self.batch for u in self.uses if u.g is not None), default=1),
        )
        return self.budget.chunk(per * self.itemsize * 8, self.batch)

    def grads(self, lo: int, hi: int) -> Tensors:
        total: torch.Tensor | None = None
        for use in self.uses:
            part = self._replay(use, lo, hi)
            total = part if total is None else total + part
        assert total is not None
        return {self.names[0]: total}

    def _replay(self, use: Use, lo: int, hi: int) -> torch.Tensor:
        args, kwargs = use.a
        flat = [*args, *kwargs.values()]
        pattern = use.info["key"]
        name = self.names[0]
        batched = [v[lo:hi].detach() for v, k in zip(flat, pattern, strict=True) if k == "b"]
        fixed = [v.detach() if isinstance(v, torch.Tensor) else v for v in flat]
        mine = [at == name for at in use.info["names"]]
        n_args, keys, func = len(args), list(kwargs), use.func

        def op(value: torch.Tensor, rows: Sequence[torch.Tensor]) -> torch.Tensor:
            it = iter(rows)
            new = [
                value if m else (next(it).unsqueeze(0) if k == "b" else v)
                for v, k, m in zip(fixed, pattern, mine, strict=True)
            ]
            return func(*new[:n_args], **dict(zip(keys, new[n_args:], strict=True)))

        def one(rows: Sequence[torch.Tensor], g: torch.Tensor) -> torch.Tensor:
            back = vjp(lambda value: op(value, rows), self.value)[1]
            return back(g.unsqueeze(0))[0]

        assert use.g is not None
        return vmap(one)(batched, use.g[lo:hi])


class ModuleReplay(Materialised):
    """Per-sample gradients of parameters read inside ``module``, by its per-sample vjp."""

    def __init__(
        self,
        names: list[str],
        prefix: str,
        module: nn.Module,
        calls: list[list[Any]],
        method: str,
        ctx: SourceContext,
    ) -> None:
        super().__init__(names, {k: ctx.shapes[k] for k in names}, ctx.batch, ctx.budget)
        self.method = method
        self.module = module
        self.calls = calls  # (input, output, output gradient) of each call
        cut = len(prefix) + 1 if prefix else 0
        self.local = {
            k[cut:]: v.detach()
            for k, v in ctx.params.items()
            if not prefix or k.startswith(prefix + ".")
        }
        self.buffers = {
            k[cut:]: v for k, v in ctx.buffers.items() if not prefix or k.startswith(prefix + ".")
        }
        self.mine = [k[cut:] for k in names]
        self.activation_numel = ctx.activation_numel

    def chunk_size(self) -> int:
        per = 2 * self.numel + 4 * self.activation_numel
        return self.budget.chunk(per * self.itemsize, self.batch, self.budget.budget // 4)

    def grads(self, lo: int, hi: int) -> Tensors:
        values = tuple(self.local[k] for k in self.mine)
        total: list[torch.Tensor] | None = None
        for x, _, g in self.calls:

            def one(x_i: torch.Tensor, g_i: torch.Tensor) -> tuple[torch.Tensor, ...]:
                def run(*vals: torch.Tensor) -> torch.Tensor:
                    local = {**self.local, **dict(zip(self.mine, vals, strict=True))}
                    out: torch.Tensor = functional_call(
                        self.module, (local, self.buffers), (x_i.unsqueeze(0),)
                    )
                    return out

                back = vjp(run, *values)[1]
                return tuple(back(g_i.unsqueeze(0)))

            part = list(vmap(one)(x[lo:hi].detach(), g[lo:hi]))
            total = part if total is None else [a + b for a, b in zip(total, part, strict=True)]
        assert total is not None
        return dict(zip(self.names, total, strict=True))


def build(uses: list[Use], names: Sequence[str], ctx: SourceContext) -> list[Source]:
    """One source per parameter from its captured uses (module replays are added by the
    caller): a family's closed form when every use is that family in one role, an op replay
    when every use is a replayable op, else the sum of the parts (tied weights)."""
    per: dict[str, list[tuple[Use, str]]] = {k: [] for k in names}
    for use in uses:
        for name, role in use.roles.items():
            if name in per:
                per[name].append((use, role))
    sources: list[Source] = []
    for name in names:
        found = per[name]
        if not found:
            sources.append(
                Zero(name, ctx.shapes[name], ctx.batch, ctx.dtype, ctx.device, ctx.budget)
            )
            continue
        groups: dict[tuple[str, Any, str], list[Use]] = {}
        for use, role in found:
            key = (
                (use.kind, use.info.get("key"), role)
                if use.kind in SOURCES
                else ("direct", None, "")
            )
            groups.setdefault(key, []).append(use)
        parts = [_part(name, kind, role, group, ctx) for (kind, _, role), group in groups.items()]
        if len(parts) == 1:
            sources.append(parts[0])
        else:
            sources.append(
                Summed(name, [(p, name) for p in parts], ctx.shapes[name], ctx.batch, ctx.budget)
            )
    return sources


def _part(name: str, kind: str, role: str, uses: list[Use], ctx: SourceContext) -> Materialised:
    if kind in SOURCES:
        return SOURCES[kind](name, role, uses, ctx)
    return OpReplay(name, uses, ctx)
