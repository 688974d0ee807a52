"""Turning one pass's captured uses into sources, one per parameter or replayed module.

A parameter read by every use in one family and role (same payload key) gets that family's
source; one read only by ops no family claims gets an op replay; one read in several ways
(tied weights) gets the sum of those parts; one never read gets zeros. The plan's module
replays are added after them.
"""

from __future__ import annotations

from collections.abc import Collection, Hashable, Sequence
from typing import Any

from service.fast_stats._budget import Budget
from service.fast_stats._dense import Zero
from service.fast_stats._family import Family
from service.fast_stats._records import Use
from service.fast_stats._replay import ModuleReplay, OpReplay
from service.fast_stats._run import Plan, Run, Setup
from service.fast_stats._source import Source, SourceContext
from service.fast_stats._tied import summed


def context(setup: Setup, budget: Budget) -> SourceContext:
    model, params = setup.model, setup.params
    return SourceContext(
        batch=setup.size,
        budget=budget,
        shapes={k: v.shape for k, v in params.items()},
        params=params,
        buffers=model.buffers,
        dtype=model.dtype,
        device=model.device,
        activation_numel=model.activation_numel,
    )


def build_sources(setup: Setup, run: Run, plan: Plan, budget: Budget,
                  formed: Collection[str] = ()) -> list[Source]:
    """Every source of a call, in the order of ``plan.tracked`` then the module replays, but
    for the parameters whose sources were ``formed`` in the backward pass (:mod:`._stream`)."""
    model, ctx = setup.model, context(setup, budget)
    tracked = [k for k in plan.tracked if k not in formed]
    out = [source_for(name, found, ctx) for name, found in _uses_per_param(run.uses, tracked)]
    named = dict(model.module.named_modules()) if plan.modules else {}
    for name, replayed in plan.modules.items():
        same = all(plan.owners.get(k) == name for k in replayed)
        method = "direct" if same and name else "vmap"
        out.append(ModuleReplay(replayed, name, named[name], run.calls[name], method, ctx))
    return out


def _uses_per_param(
    uses: Sequence[Use], names: Sequence[str]
) -> list[tuple[str, list[tuple[Use, str]]]]:
    per: dict[str, list[tuple[Use, str]]] = {k: [] for k in names}
    for use in uses:
        for name, role in use.roles.items():
            if name in per:
                per[name].append((use, role))
    return list(per.items())


def source_for(name: str, found: list[tuple[Use, str]], ctx: SourceContext) -> Source:
    if not found:
        return Zero(name, ctx.shapes[name], ctx.batch, ctx.dtype, ctx.device, ctx.budget)
    groups: dict[tuple[Family[Any] | None, Hashable, str], list[Use]] = {}
    for use, role in found:
        key = (use.family, use.payload.key, role) if use.family is not None else (None, None, "")
        groups.setdefault(key, []).append(use)
    parts = [
        family.source(name, role, group, ctx) if family is not None
        else OpReplay(name, group, ctx)
        for (family, _, role), group in groups.items()
    ]
    if len(parts) == 1:
        return parts[0]
    return summed(name, parts, ctx.shapes[name], ctx.batch, ctx.budget)
