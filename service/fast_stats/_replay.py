"""Per-sample gradients by replaying, sample by sample, what read a parameter.

:class:`OpReplay` (``direct``): an op no family claims but that runs sample by sample
(``F.layer_norm`` without a family, ``x * w``) is replayed per sample with ``vmap(vjp)`` on the
captured arguments and output gradient, so only that op runs again. :class:`ModuleReplay`
(``vmap``, or ``direct`` for the owning module): a parameter read in a way nothing replays
(``w.t()`` inside a custom forward, attention with masks) gets the per-sample vjp of the
smallest enclosing module called as ``module(x)``, down to the whole model (the plain ``vmap``
path, for that parameter only).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from service.fast_stats._records import DirectCall, ModuleCall, Unsupported, Use
from service.fast_stats._source import Materialised, SourceContext
from service.strategies.base import Tensors


class OpReplay(Materialised):
    """Per-sample gradients of one parameter from the ops that read it, replayed per sample."""

    def __init__(self, name: str, uses: Sequence[Use], ctx: SourceContext) -> None:
        super().__init__([name], {name: ctx.shapes[name]}, ctx.batch, ctx.budget)
        self.uses = tuple(uses)
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
        call = cast(DirectCall, use.payload)
        flat = [*call.args, *call.kwargs.values()]
        pattern = call.pattern
        batched = [v[lo:hi].detach() for v, k in zip(flat, pattern, strict=True) if k == "b"]
        fixed = [v.detach() if isinstance(v, torch.Tensor) else v for v in flat]
        mine = [at == self.names[0] for at in call.names]
        n_args, keys, func = len(call.args), list(call.kwargs), use.func

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

        return vmap(one)(batched, use.grad[lo:hi])


class ModuleReplay(Materialised):
    """Per-sample gradients of parameters read inside ``module``, by its per-sample vjp."""

    def __init__(
        self,
        names: Sequence[str],
        prefix: str,
        module: nn.Module,
        calls: Sequence[ModuleCall],
        method: str,
        ctx: SourceContext,
    ) -> None:
        super().__init__(names, {k: ctx.shapes[k] for k in names}, ctx.batch, ctx.budget)
        self.method = method
        self.module = module
        self.calls = tuple(calls)
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
        for call in self.calls:

            def one(
                xs_i: tuple[torch.Tensor, ...], g_i: torch.Tensor
            ) -> tuple[torch.Tensor, ...]:
                def run(*vals: torch.Tensor) -> torch.Tensor:
                    local = {**self.local, **dict(zip(self.mine, vals, strict=True))}
                    out: torch.Tensor = functional_call(
                        self.module, (local, self.buffers), tuple(x.unsqueeze(0) for x in xs_i)
                    )
                    return out

                back = vjp(run, *values)[1]
                return tuple(back(g_i.unsqueeze(0)))

            assert call.g is not None
            xs = tuple(x[lo:hi].detach() for x in call.xs)
            part = list(vmap(one)(xs, call.g[lo:hi]))
            total = part if total is None else [a + b for a, b in zip(total, part, strict=True)]
        if total is None:  # a plan names a module this model never calls (a stored entry's)
            raise Unsupported("a replayed module that was not called")
        return dict(zip(self.names, total, strict=True))
