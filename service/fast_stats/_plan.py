"""The per-structure plan a call's pass follows, made once by a probe and checked, and shared.

The plan says which parameters are captured op by op and which fall back to a module replay.
It is made once per model structure, loss, selection and sample shape by a *probe* on a few
samples (the forward pass with the module stack recorded), then *checked* against plain
autograd (:func:`_check`), and a parameter that fails is moved to the whole-model replay.
Every later call must read the parameters in the same sequence of ops, or it takes the ``vmap``
path.

With a :class:`~._shared.SharedPlans` the verdict outlives the process: a new sample shape (a
batch size, a sequence length) of a model planned before costs one forward of the probe, no
probe and no check, when its sequence of ops is one seen before; a worker that never saw the
model loads the verdict another made (:mod:`._shared` says when it is checked first).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch.func import functional_call, jvp
from torch.overrides import TorchFunctionMode

from service.config import get_settings
from service.fast_stats._budget import Budget
from service.fast_stats._build import build_sources
from service.fast_stats._kernels import NARROW, sums_and_dots
from service.fast_stats._records import Pass1, Pass1Need, Unsupported
from service.fast_stats._run import (
    Plan,
    Run,
    Setup,
    forward_backward,
    model_inputs,
    setup_losses,
)
from service.fast_stats._shared import SharedPlans, Stored, plan_key, signature_digest
from service.fast_stats._source import Source, answers
from service.fast_stats._tuning import TUNING
from service.lru import LockedLRU
from service.strategies.base import NORM_BLOCK, Tensors, squared_norms
from service.strategies.per_sample import FORWARD_AD

PROBE = 3  # samples in the probe batch (drawn cyclically from the first call's batch)
SHORT = 8  # positions the check runs at, where the model's ops are the same there
SPATIAL = 32  # an image's height and width there (ResNet-18's last maps are then 1x1)
PLANS: LockedLRU[tuple[Any, ...], Plan | None] = LockedLRU(256)


def plan_for(setup: Setup, shared: SharedPlans | None = None,
             planning: Callable[[bool], None] | None = None) -> Plan | None:
    """The cached plan for this structure, loss, selection and sample shapes (None: use vmap);
    ``planning`` is told True before a plan is made or loaded here and False after."""
    model = setup.model
    key = (
        model.structure or model.ref,
        str(model.dtype),
        setup.loss,
        setup.selected,
        tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in setup.samples.items()),
        str(model.device),
    )
    return PLANS.get_or_make(key, lambda: _told(planning, lambda: _plan(setup, shared)))


def _told(planning: Callable[[bool], None] | None, make: Callable[[], Plan | None]
          ) -> Plan | None:
    if planning is None:
        return make()
    planning(True)
    try:
        return make()
    finally:
        planning(False)


def _plan(setup: Setup, shared: SharedPlans | None) -> Plan | None:
    idx = torch.arange(PROBE) % setup.size
    probe = replace(setup, samples={k: v[idx] for k, v in setup.samples.items()})
    model = setup.model
    if shared is None or not model.structure:
        return _probe(probe, shared)[0]
    key = plan_key(model.structure, model.dtype, setup.loss, setup.selected,
                   ((k, v.dtype, v.dim() - 1) for k, v in setup.samples.items()),
                   model.device, get_settings().fast_stats_form)
    stored = shared.load(key, model.module)
    if stored is not None:
        if stored.unsupported is not None and stored.trusted:  # else the probe says anew
            shared.stats.loaded += 1
            return None
        plan = _adopt(probe, stored, shared)
        if plan is not None:
            return plan
    plan, reason = _probe(probe, shared)
    if plan is None:
        shared.save(key, None, None, unsupported=reason)
    else:
        shared.save(key, signature_digest(plan.signature), plan.modules)
    return plan


def _adopt(probe: Setup, stored: Stored, shared: SharedPlans) -> Plan | None:
    """The stored plan whose sequence of ops this shape repeats (one forward of the probe), or
    None: a new class of calls, planned afresh."""
    for replays in dict.fromkeys(stored.classes.values()):
        try:
            plan = _finish(probe, dict(replays))
            if stored.classes.get(signature_digest(plan.signature) or "") != replays:
                continue
            wrong = [] if stored.trusted else _check(probe, plan, shared)
        except Unsupported:
            continue
        except Exception as exc:  # a replay this model cannot run (an entry made by hand)
            shared.refused(f"a stored plan of {probe.model.ref} could not run "
                           f"({type(exc).__name__}: {str(exc)[:200]}): planning afresh")
            return None
        if wrong:
            shared.refused(f"a stored plan of {probe.model.ref} failed its check on "
                           f"{', '.join(wrong[:5])}: planning afresh")
            return None
        shared.stats.loaded += 1
        return plan
    return None


def _probe(probe: Setup, shared: SharedPlans | None) -> tuple[Plan | None, str | None]:
    """The plan worked out by the probe and its check, or None and why."""
    if shared is not None:
        shared.stats.probes += 1
    try:
        return _make(probe, shared), None
    except Unsupported as exc:
        return None, str(exc) or "unsupported"


def _make(probe: Setup, shared: SharedPlans | None = None) -> Plan:
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
    wrong = _check(probe, plan, shared)
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


def _same_run(setup: Setup | None, plan: Plan) -> Run | None:
    """``setup``'s run where it reads the parameters in the plan's sequence of ops, else None."""
    if setup is None:
        return None
    try:
        run = forward_backward(setup, plan)
    except Exception:  # the model takes only its size (an MLP's features, a fixed export)
        return None
    same = signature_digest(tuple(u.signature for u in run.uses))
    return run if same is not None and same == signature_digest(plan.signature) else None


def _widened(probe: Setup) -> Setup:
    """The probe with its bfloat16 and float16 tensors (parameters, buffers, samples) in
    float32; the probe itself where it has none."""
    model = probe.model
    if not any(v.dtype in NARROW for v in probe.params.values()):
        return probe
    wide: dict[int, torch.Tensor] = {}  # a tensor the call and the model share, widened once

    def widened(tensors: Tensors) -> Tensors:
        for v in tensors.values():
            if v.dtype in NARROW and id(v) not in wide:
                wide[id(v)] = v.float()
        return {k: wide.get(id(v), v) for k, v in tensors.items()}

    return replace(probe, params=widened(probe.params), samples=widened(probe.samples),
                   model=replace(model, params=widened(model.params),
                                 buffers=widened(model.buffers)))


class InFloat32(TorchFunctionMode):
    """Every torch call asking for bfloat16 or float16 (a cast such as ``x.to(torch.bfloat16)``
    or ``x.half()``, a factory's ``dtype``) gets float32 instead: with its tensors widened
    (:func:`_widened`), a model whose graph casts to a narrow dtype itself runs in float32."""

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: Mapping[str, Any] | None = None) -> Any:
        if func in (torch.Tensor.bfloat16, torch.Tensor.half):
            func = torch.Tensor.float
        return func(*map(_wide, args), **{k: _wide(v) for k, v in (kwargs or {}).items()})


def _wide(arg: Any) -> Any:
    return torch.float32 if isinstance(arg, torch.dtype) and arg in NARROW else arg


def _check(probe: Setup, plan: Plan, shared: SharedPlans | None = None) -> list[str]:
    """Parameters whose probe statistics or gradients differ from an independent path's
    (counted, and timed, in ``shared``'s stats)."""
    start = time.perf_counter()
    try:
        return _checked(probe, plan)
    finally:
        if shared is not None:
            shared.stats.checks += 1
            shared.stats.check_s += time.perf_counter() - start


def _cut(probe: Setup) -> Setup | None:
    """The probe with every field cut alike: an image's (``[B, C, H, W]``) height and width to
    :data:`SPATIAL`, else a sequence's length (dimension 1) to :data:`SHORT`; None where the
    inputs are no longer than that."""
    inputs = probe.samples["inputs"]
    if inputs.dim() == 4:
        size = inputs.shape[2:]
        if max(size) <= SPATIAL:
            return None
        return replace(probe, samples={
            k: v[..., :SPATIAL, :SPATIAL] if v.dim() >= 3 and v.shape[-2:] == size else v
            for k, v in probe.samples.items()})  # a dense target [B, H, W] alike
    if inputs.dim() < 2 or inputs.shape[1] <= SHORT:
        return None
    length = inputs.shape[1]
    return replace(probe, samples={
        k: v[:, :SHORT] if v.dim() >= 2 and v.shape[1] == length else v
        for k, v in probe.samples.items()})


def _checked(probe: Setup, plan: Plan) -> list[str]:
    """:func:`_check`'s work: :func:`_verdict` on the probe in float32 where some of its
    parameters are narrower (:func:`_widened`, under :class:`InFloat32`), cut short
    (:func:`_cut`), each where the model reads its parameters in the plan's sequence of ops
    there; else on the probe as it is.

    Cut short: the check's cost follows the sample's size (GPT-2 small at 64 positions: 17 s;
    at 8: a few; ResNet-18 at 224x224: 3 steady calls), and what it checks, how each op's
    parameters are captured, does not. In float32: the check's bounds are float32's rounding,
    which a plan right in bfloat16 misses by far (a small bfloat16 network's written gradient
    was 7.5% off its first pass's; a float32 layer before a bfloat16 one failed too), and how
    each op's parameters are captured does not change with the dtype."""
    wide = _widened(probe)
    if wide is not probe:
        with InFloat32():
            for setup in (_cut(wide), wide):
                run = _same_run(setup, plan)
                if setup is not None and run is not None:
                    return _verdict(setup, run, plan)
    short = _cut(probe)
    run = _same_run(short, plan)
    if short is not None and run is not None:
        return _verdict(short, run, plan)
    return _verdict(probe, forward_backward(probe, plan), plan)


def _verdict(probe: Setup, run: Run, plan: Plan) -> list[str]:
    """The parameters whose statistics or written gradients on ``probe`` (``run`` its captured
    pass) differ from an independent path's.

    With a random direction ``r`` (the dots' reference), two checks, neither a plain backward:

    - the first sample alone: the gradient the probe's sources write for it (as a ``grads``
      answer does, a group of sources at a time, ``TUNING.check_bytes`` each) must have,
      parameter by parameter, the squared norm and the dot with ``r`` that the probe's first
      pass found for that sample: the written form, the norm's closed form and the dot's
      agree.
    - every probe sample: the forward-mode derivative of each sample's loss along ``r`` scaled
      per parameter (``torch.func.jvp``: no capture, no backward, an independent path) is
      ``sum_k s_k <g_ik, r_k>``, which the sources' dots, scaled alike, must sum to. The
      scales ``s_k`` (:func:`_balanced`) make every parameter's largest term as large as the
      largest parameter's, so a wrong small parameter (a bias) is not lost in the rounding of
      a large one's; a capture that mixes samples fails it too.

    Only where the second fails (or an op has no forward derivative) does one plain backward of
    ``sum_i c_i loss_i`` with random weights ``c`` find the parameter, by each parameter's dots,
    weighted alike, against its dot with ``r``. So a plan that holds costs one captured pass of
    the probe (forward, backward, the sources' first pass), one forward-mode pass and one
    sample's written gradients (GPT-2 small's check with two plain backwards and an
    element-wise comparison cost 2 steady calls; a ``vmap`` per sample and group took its
    first call 33-126 s).
    """
    model, params = probe.model, probe.params
    selected = list(plan.tracked) + [k for v in plan.modules.values() for k in v]
    gen = torch.Generator().manual_seed(0)
    weights = (torch.rand(PROBE, generator=gen, dtype=torch.float64) + 0.5).to(model.dtype)
    # random values repeated with a period of 64 Ki: drawing 124 M of them took 1.5 s
    pattern = torch.empty(1 << 16, dtype=model.dtype).uniform_(-1, 1, generator=gen)
    reference = {k: _tiled(pattern, params[k]) for k in selected}
    need = Pass1Need(sq=True, reference=reference, bounds=((0, PROBE),),
                     sums_dtype=model.dtype)
    first: dict[str, Pass1] = {}
    with torch.no_grad():
        sources = build_sources(probe, run, plan, Budget(64 << 20))
        del run
        for source in sources:
            first.update(source.pass1(need))
        wrong = _written_differ(sources, selected, params, reference, first)
        del sources
    if not _totals_match(probe, reference, first):
        want = _weighted_gradient(probe, selected, weights.to(model.device))
        wrong |= {k for k in selected if not _weighted_dots_match(
            first[k].dot, weights, _dots(want[k].reshape(1, -1), reference[k])[0])}
        del want
    return [k for k in selected if k in wrong]


def _balanced(dots: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter, the power of two that brings its largest dot up to within 2x of the
    largest of all (at most 2^20): a parameter's share of the forward-mode check is then about
    as large as any other's, and scaling a direction by it and back is exact."""
    peaks = {k: float(d.abs().max()) if d.numel() else 0.0 for k, d in dots.items()}
    top = max(peaks.values(), default=0.0)
    if not math.isfinite(top) or top <= 0:
        return dict.fromkeys(dots, 1.0)
    return {k: 2.0 ** min(20, math.floor(math.log2(top / peak))) if peak > 0 else 2.0**20
            for k, peak in peaks.items()}


def _totals_match(probe: Setup, direction: Tensors, first: Mapping[str, Pass1]) -> bool:
    """Whether each probe sample's dots with ``direction``, scaled per parameter by
    :func:`_balanced` and summed over the parameters, equal the forward-mode derivative of its
    loss along ``direction`` scaled alike (scaled in place, and left so where they match);
    False also where a dot is missing or the model has an op without a forward derivative (the
    caller then checks parameter by parameter, ``direction`` as it was)."""
    model = probe.model
    dots = {k: first[k].dot for k in direction}
    if any(d is None for d in dots.values()):
        return False
    scales = _balanced({k: d for k, d in dots.items() if d is not None})
    _scale(direction, scales)
    fixed = {k: v.detach() for k, v in probe.params.items() if k not in direction}

    def losses(moved: Tensors) -> torch.Tensor:
        out = functional_call(model.module, ({**fixed, **moved}, model.buffers),
                              model_inputs(probe))
        return setup_losses(probe, out)[0]

    primals = {k: probe.params[k].detach() for k in direction}
    try:
        with FORWARD_AD:  # one jvp at a time in a process (embedded workers are threads)
            derivative = jvp(losses, (primals,), (dict(direction),))[1]
        match = _sums_match(torch.stack([d.double() * scales[k] for k, d in dots.items()
                                         if d is not None]),
                            derivative.detach().double())
    except (RuntimeError, NotImplementedError):
        match = False
    if not match:  # the caller reads it again; else it is left scaled (a pass saved)
        _scale(direction, {k: 1 / v for k, v in scales.items()})
    return match


def _scale(direction: Tensors, scales: Mapping[str, float]) -> None:
    """``direction`` scaled in place, parameter by parameter (powers of two: exact)."""
    for k, v in direction.items():
        if scales[k] != 1:
            v.mul_(scales[k])


def _weighted_dots_match(dots: torch.Tensor | None, weights: torch.Tensor,
                         want: torch.Tensor) -> bool:
    """Whether ``sum_i weights_i dots_i`` equals ``want`` to the dots' own rounding."""
    assert dots is not None
    return _sums_match(weights.to(dots) * dots, want)


def _sums_match(terms: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether ``terms`` summed over their first dimension equal ``want`` to the terms' own
    rounding (relative to the sum of their magnitudes), everywhere and finite."""
    got = terms.sum(0)
    size = terms.abs().sum(0) + want.abs()
    return bool((torch.isfinite(got) & ((got - want).abs() <= 1e-3 * size + 1e-6)).all())


def _written_differ(sources: Sequence[Source], selected: Sequence[str], params: Tensors,
                    reference: Tensors, first: Mapping[str, Pass1]) -> set[str]:
    """Parameters whose gradient as ``sources`` write it for their first sample has another
    squared norm or dot with ``reference`` than their first pass (``first``) found for it."""
    wrong: set[str] = set()
    for group in _groups(sources, set(selected), params):
        written = answers(group, rows=1)
        for k in (k for s in group for k in s.names if k in written and k in selected):
            rows = written[k].reshape(1, -1)
            want_sq, want_dot = first[k].sq, first[k].dot
            assert want_sq is not None and want_dot is not None
            sq = squared_norms(rows)
            scale = 1 + float(sq.max())
            if not (_close(sq, want_sq[:1], 1e-3, 1e-5 * scale)
                    and _close(_dots(rows, reference[k]), want_dot[:1], 1e-3,
                               1e-3 * scale**0.5)):
                wrong.add(k)
        del written
    return wrong


def _tiled(pattern: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    n = like.numel()
    return pattern.repeat(-(-n // pattern.numel()))[:n].reshape(like.shape).to(like)


def _weighted_gradient(probe: Setup, selected: Sequence[str], weights: torch.Tensor) -> Tensors:
    """``sum_i weights_i grad loss_i`` over the probe batch, by one plain backward."""
    model = probe.model
    live = {k: v.detach().requires_grad_(k in selected) for k, v in probe.params.items()}
    with torch.enable_grad():
        out = functional_call(model.module, (live, model.buffers), model_inputs(probe))
        losses, _ = setup_losses(probe, out)
        found = torch.autograd.grad((losses * weights).sum(), [live[k] for k in selected],
                                    allow_unused=True)
    return {k: torch.zeros_like(live[k]) if g is None else g
            for k, g in zip(selected, found, strict=True)}


def _dots(rows: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """Each row's dot with ``reference``, summed by blocks as the sources sum theirs (one BLAS
    dot over GPT-2's 38.6 M-element embedding erred by 1.2e-3, past the tolerance), each
    block's in one read of both (:func:`~._kernels.sums_and_dots`: on the CPU 0.7 ms per 2.4 M
    elements, where an ``einsum`` of the blocks took 4.8 ms)."""
    flat = reference.reshape(-1)
    n = flat.numel()
    body = n - n % NORM_BLOCK
    out = torch.zeros(rows.shape[0], dtype=torch.float64, device=rows.device)
    if body:
        blocks = flat[:body].reshape(-1, NORM_BLOCK)
        part = rows.new_empty((len(blocks), 2))
        for i, row in enumerate(rows):
            out[i] += sums_and_dots(row[:body].reshape(-1, NORM_BLOCK), blocks, part).double().sum()
    if body < n:
        out += (rows[:, body:] * flat[body:]).double().sum(1)
    return out.to(rows.dtype)


def _close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> bool:
    """``torch.allclose``'s test ``|got - want| <= atol + rtol |want|`` element-wise, by plain
    element-wise ops, most in place (``allclose`` took 3.8 s of BERT-base's 9.6 s check at
    T=64, 4x these ops' time on a 3072x768 pair); NaN or infinity anywhere is not close."""
    diff = torch.sub(got, want).abs_()
    return bool(diff.sub_(want.abs().mul_(rtol)).le_(atol).all())


def _groups(sources: Sequence[Source], selected: set[str], params: Tensors
            ) -> list[list[Source]]:
    """Consecutive sources whose selected parameters' gradients of one sample take at most
    ``TUNING.check_bytes`` (a source larger than that alone is a group of its own)."""
    groups: list[list[Source]] = []
    size = TUNING.check_bytes
    for source in sources:
        nbytes = sum(params[k].numel() * params[k].element_size()
                     for k in source.names if k in selected)
        if size + nbytes > TUNING.check_bytes:
            groups.append([])
            size = 0
        groups[-1].append(source)
        size += nbytes
    return groups
