"""The per-structure plan a call's pass follows, made once by a probe and checked.

The plan says which parameters are captured op by op and which fall back to a module replay.
It is made once per model structure, loss, selection and sample shape by a *probe* on a few
samples (the forward pass with the module stack recorded), then *checked*: the probe samples'
per-sample squared norms, dot products with a random reference and gradients (as a ``grads``
answer writes them) must equal the ``vmap`` path's, and a parameter that does not is moved to
the whole-model replay. Every later call must read the parameters in the same sequence of ops,
or it takes the ``vmap`` path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from service.fast_stats._budget import Budget
from service.fast_stats._build import build_sources
from service.fast_stats._records import Pass1, Pass1Need, Unsupported
from service.fast_stats._run import Plan, Setup, forward_backward
from service.fast_stats._source import Source, answers
from service.lru import LockedLRU
from service.strategies.base import Tensors, squared_norms
from service.strategies.per_sample import per_sample_fn

PROBE = 3  # samples in the probe batch (drawn cyclically from the first call's batch)
PLANS: LockedLRU[tuple[Any, ...], Plan | None] = LockedLRU(256)


def plan_for(setup: Setup) -> Plan | None:
    """The cached plan for this structure, loss, selection and sample shapes (None: use vmap)."""
    model = setup.model
    key = (
        model.structure or model.ref,
        str(model.dtype),
        setup.loss,
        setup.selected,
        tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in setup.samples.items()),
        str(model.device),
    )
    return PLANS.get_or_make(key, lambda: _probe(setup))


def _probe(setup: Setup) -> Plan | None:
    idx = torch.arange(PROBE) % setup.size
    probe = replace(setup, samples={k: v[idx] for k, v in setup.samples.items()})
    try:
        return _make(probe)
    except Unsupported:
        return None


def _make(probe: Setup) -> Plan:
    first = Plan(probe.selected, {})
    run = forward_backward(probe, first, probe=True, backward=False)
    stacks: dict[str, list[tuple[str, ...]]] = {}
    for use in run.uses:
        if use.opaque:
            for name in use.roles:
                stacks.setdefault(name, [])
    for use in run.uses:
        for name in use.roles:
            if name in stacks:
                stacks[name].append(use.stack)
    modules: dict[str, list[str]] = {}
    for name in probe.selected:
        if name in stacks:
            modules.setdefault(_enclosing(stacks[name], run.simple), []).append(name)
    plan = _finish(probe, modules)
    wrong = _check(probe, plan)
    if wrong:
        for name in wrong:
            for replayed in modules.values():
                if name in replayed:
                    replayed.remove(name)
            modules.setdefault("", []).append(name)
        plan = _finish(probe, {k: v for k, v in modules.items() if v})
    return plan


def _owner(name: str) -> str:
    return name.rpartition(".")[0]


def _enclosing(stacks: list[tuple[str, ...]], simple: Mapping[str, bool]) -> str:
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


def _finish(probe: Setup, modules: Mapping[str, Sequence[str]]) -> Plan:
    """The plan with these module replays, and the sequence of uses it sees on the probe."""
    replayed = {k for v in modules.values() for k in v}
    plan = Plan(
        tracked=tuple(k for k in probe.selected if k not in replayed),
        modules={k: tuple(v) for k, v in modules.items()},
        owners={k: _owner(k) for k in probe.selected},
    )
    run = forward_backward(probe, plan, backward=False)
    return replace(plan, signature=tuple(u.signature for u in run.uses))


def _check(probe: Setup, plan: Plan) -> list[str]:
    """Parameters whose probe statistics or gradients differ from the ``vmap`` path's.

    The probe's per-sample gradients, both the sources' answers and ``vmap``'s, are compared a
    group of sources at a time (:data:`CHECK_BYTES` of each at most): all at once, GPT-2
    small's first request held two copies of its 124 M parameters' gradients for each of the
    probe's samples beside the model (8.2 GiB against 3.8 GiB for the requests after it).
    """
    model, params = probe.model, probe.params
    selected = list(plan.tracked) + [k for v in plan.modules.values() for k in v]
    gen = torch.Generator().manual_seed(0)
    reference = {k: torch.randn(params[k].shape, generator=gen).to(params[k]) for k in selected}
    run = forward_backward(probe, plan)
    need = Pass1Need(sq=True, reference=reference, bounds=((0, PROBE),), sums_dtype=model.dtype)
    got: dict[str, Pass1] = {}
    sources = build_sources(probe, run, plan, Budget(64 << 20))
    for source in sources:
        got.update(source.pass1(need))
    fn = per_sample_fn(model, probe.loss, probe.gamma)
    wrong = []
    for group in _groups(sources, set(selected), params):
        written = answers(group)
        names = [k for s in group for k in s.names if k in written and k in selected]
        chosen = {k: params[k] for k in names}
        others = {k: v for k, v in params.items() if k not in chosen}
        sq = {k: torch.zeros(PROBE, dtype=model.dtype, device=model.device) for k in names}
        dot = {k: torch.zeros(PROBE, dtype=model.dtype, device=model.device) for k in names}
        same = dict.fromkeys(names, True)
        for i in range(PROBE):  # one sample at a time: vmap's backward of a large embedding
            # held several dense copies of its gradient per sample
            grads, _ = fn(chosen, others, model.buffers,
                          {k: v[i:i + 1] for k, v in probe.samples.items()})
            for k in names:  # sums of products as the sources take them: a BLAS dot over
                # GPT-2's 38.6 M-element embedding erred by 1.2e-3, past the tolerance
                flat = grads[k].reshape(1, -1)
                sq[k][i] = squared_norms(flat)[0]
                dot[k][i] = (flat * reference[k].reshape(1, -1)).sum()
                scale = 1 + float(sq[k][i])
                same[k] &= _close(written[k][i], grads[k][0], 1e-3, 1e-4 * scale**0.5)
            del grads
        for k in names:
            scale = 1 + float(sq[k].max())
            got_sq, got_dot = got[k].sq, got[k].dot
            assert got_sq is not None and got_dot is not None
            same_sq = _close(got_sq, sq[k], 1e-3, 1e-5 * scale)
            same_dot = _close(got_dot, dot[k], 1e-3, 1e-3 * scale**0.5)
            if not (same_sq and same_dot and same[k]):
                wrong.append(k)
        del written
    return wrong


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> bool:
    """``torch.allclose``'s test ``|got - want| <= atol + rtol |want|`` element-wise, by plain
    element-wise ops, most in place (``allclose`` took 3.8 s of BERT-base's 9.6 s check at
    T=64, 4x these ops' time on a 3072x768 pair); NaN or infinity anywhere is not close."""
    diff = torch.sub(got, want).abs_()
    return bool(diff.sub_(want.abs().mul_(rtol)).le_(atol).all())


CHECK_BYTES = 512 << 20  # the probe's gradients of one group of sources, each way


def _groups(sources: Sequence[Source], selected: set[str], params: Tensors
            ) -> list[list[Source]]:
    """Consecutive sources whose selected parameters' probe gradients take at most
    :data:`CHECK_BYTES` (a source larger than that alone is a group of its own)."""
    groups: list[list[Source]] = []
    size = CHECK_BYTES
    for source in sources:
        nbytes = PROBE * sum(params[k].numel() * params[k].element_size()
                             for k in source.names if k in selected)
        if size + nbytes > CHECK_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(source)
        size += nbytes
    return groups
