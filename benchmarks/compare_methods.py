"""The methods that ``benchmarks/compare.py`` times: each one computes per-sample gradients, their
norms or the DP-SGD clipped mean for the same model and seeded batch, the way a user of that
library would write it.

Every factory returns a zero-argument callable that computes one output and returns it as a dict
``{output: tensor or {param: tensor}}`` keyed by the model's own parameter names, or
:class:`NotApplicable` with the reason; :func:`first_call` turns a library's refusal of a model
(an exception on the first call) into :class:`NotApplicable` too. Importable without Opacus or
BackPACK installed (their methods then say so); tests hold each method to the per-sample loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from service import engine
from service.engine import Batch, Options
from service.registry import LoadedModel, load_model

Tensors = dict[str, torch.Tensor]
Result = dict[str, Any]
OUTPUTS = ("grads", "norms", "clipped_mean")
GAMMA = 0.99


@dataclass(frozen=True)
class Case:
    """One model and batch size of the comparison."""

    arch: str
    batch: int
    config: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def label(self) -> str:
        return f"{self.arch} B={self.batch}"


@dataclass(frozen=True)
class NotApplicable:
    """A method that does not apply to a case or output, and why."""

    reason: str


@dataclass
class Setup:
    """A loaded model and its seeded batch on one device."""

    case: Case
    model: LoadedModel
    data: Tensors
    device: torch.device

    @property
    def td0(self) -> bool:
        return self.model.default_loss == "td0"


def setup(case: Case, device: torch.device, seed: int = 0) -> Setup:
    """The zoo model (seeded initial weights, as the server builds it) and a seeded batch."""
    model = load_model(case.arch, case.arch, case.config or None, device=device)
    gen = torch.Generator().manual_seed(seed)
    spec, size = model.input, case.batch
    if spec.dtype == "int64":
        x = torch.randint(0, spec.high or 2, (size, *spec.shape), generator=gen)
    else:
        x = torch.randn((size, *spec.shape), generator=gen)
    data = {"inputs": x}
    if model.default_loss == "td0":
        data["next_inputs"] = torch.randn((size, *spec.shape), generator=gen)
        data["rewards"] = torch.randn(size, generator=gen)
        data["dones"] = (torch.rand(size, generator=gen) < 0.1).float()
    else:
        data["targets"] = torch.randint(0, model.output_shape[-1], (size,), generator=gen)
    return Setup(case, model, {k: v.to(device) for k, v in data.items()}, device)


def batch_losses(module: nn.Module, s: Setup, data: Tensors | None = None) -> torch.Tensor:
    """Per-sample losses [B] from one batched forward (the libraries hook this).

    TD(0): the target r + gamma (1 - done) V(s') comes from a forward under ``no_grad``
    (the stopped gradient) before the forward of V(s), so hooks see only V(s); the pseudo-loss
    (target - V(s))^2 is then an ordinary per-sample loss.
    """
    data = s.data if data is None else data
    if s.td0:
        with torch.no_grad():
            target = data["rewards"] + GAMMA * (1 - data["dones"]) * module(data["next_inputs"])
        return (target - module(data["inputs"])) ** 2
    out = module(data["inputs"])
    fn = F.nll_loss if s.model.default_loss == "nll" else F.cross_entropy
    return fn(out, data["targets"], reduction="none")


def norms_of(grads: Tensors) -> torch.Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def clipped_mean_of(grads: Tensors, norms: torch.Tensor, clip: float) -> Tensors:
    factor = (clip / norms).clamp(max=1.0)
    return {k: torch.tensordot(factor, g, dims=1) / norms.shape[0] for k, g in grads.items()}


def from_grads(output: str, grads: Tensors, clip: float) -> Result:
    """``output`` derived from full per-sample gradients (what a user of a grads-only API does)."""
    if output == "grads":
        return {"grads": grads}
    norms = norms_of(grads)
    if output == "norms":
        return {"norms": norms}
    return {"clipped_mean": clipped_mean_of(grads, norms, clip)}


def weighted_mean(
    per: torch.Tensor, factor: torch.Tensor, names: list[str], params: list[nn.Parameter]
) -> Result:
    """``clipped_mean`` without per-sample gradients: a second backward of the losses weighted
    by each sample's clip factor (the same graph, kept with ``retain_graph``)."""
    for p in params:
        p.grad = None
    (factor.detach() * per).sum().backward()
    return {
        "clipped_mean": {
            n: p.grad / per.shape[0]  # type: ignore[operator]
            for n, p in zip(names, params, strict=True)
        }
    }


def _trainable_copy(s: Setup) -> nn.Module:
    return copy.deepcopy(s.model.module).train().requires_grad_(True)


# --- the per-sample loop and the PyTorch tutorial's vmap(grad) ----------------------------------


def per_sample_loop(s: Setup, output: str, clip: float) -> Callable[[], Result]:
    """Batch of one, ``torch.autograd.grad``, stacked: the tutorial's reference."""
    module = _trainable_copy(s).eval()
    names = [n for n, _ in module.named_parameters()]
    params = list(module.parameters())

    def run() -> Result:
        per: list[tuple[torch.Tensor, ...]] = []
        for i in range(s.case.batch):
            sample = {k: v[i : i + 1] for k, v in s.data.items()}
            per.append(torch.autograd.grad(batch_losses(module, s, sample).sum(), params))
        grads = {n: torch.stack(g) for n, g in zip(names, zip(*per, strict=True), strict=True)}
        return from_grads(output, grads, clip)

    return run


def tutorial_vmap(s: Setup, output: str, clip: float) -> Callable[[], Result]:
    """``functional_call`` + ``vmap(grad(compute_loss), in_dims=(None, None, 0, 0))`` at once."""
    module = s.model.module
    params = {k: v.detach() for k, v in module.named_parameters()}
    buffers = {k: v.detach() for k, v in module.named_buffers()}
    if s.td0:

        def td_loss(
            params: Tensors,
            buffers: Tensors,
            state: torch.Tensor,
            reward: torch.Tensor,
            next_state: torch.Tensor,
            done: torch.Tensor,
        ) -> torch.Tensor:
            value = functional_call(module, (params, buffers), (state.unsqueeze(0),)).squeeze()
            next_value = functional_call(module, (params, buffers), (next_state.unsqueeze(0),))
            target = reward + GAMMA * (1 - done) * next_value.squeeze().detach()
            return (target - value) ** 2

        fn = vmap(grad(td_loss), in_dims=(None, None, 0, 0, 0, 0))
        args = [s.data[k] for k in ("inputs", "rewards", "next_inputs", "dones")]
    else:
        loss_fn = F.nll_loss if s.model.default_loss == "nll" else F.cross_entropy

        def compute_loss(
            params: Tensors, buffers: Tensors, sample: torch.Tensor, target: torch.Tensor
        ) -> torch.Tensor:
            batch = sample.unsqueeze(0)
            targets = target.unsqueeze(0)
            predictions = functional_call(module, (params, buffers), (batch,))
            return loss_fn(predictions, targets)

        fn = vmap(grad(compute_loss), in_dims=(None, None, 0, 0))  # type: ignore[arg-type]
        args = [s.data["inputs"], s.data["targets"]]

    return lambda: from_grads(output, fn(params, buffers, *args), clip)


# --- Opacus -------------------------------------------------------------------------------------


def opacus_hooks(s: Setup, output: str, clip: float) -> Callable[[], Result] | NotApplicable:
    """``GradSampleModule`` (forward/backward hooks, ``p.grad_sample``), sum-reduced loss."""
    try:
        from opacus import GradSampleModule
    except ImportError:
        return NotApplicable("opacus not installed")
    module = _trainable_copy(s)
    names = [n for n, _ in module.named_parameters()]
    try:
        gsm = GradSampleModule(module, loss_reduction="sum")
    except Exception as exc:
        return NotApplicable(f"GradSampleModule refuses the model: {_short(exc)}")
    params = list(module.parameters())

    def run() -> Result:
        gsm.zero_grad(set_to_none=True)
        batch_losses(gsm, s).sum().backward()
        grads = {n: _take(p, "grad_sample") for n, p in zip(names, params, strict=True)}
        return from_grads(output, grads, clip)

    return run


def opacus_ghost(s: Setup, output: str, clip: float) -> Callable[[], Result] | NotApplicable:
    """``GradSampleModuleFastGradientClipping`` (ghost clipping): norms without per-sample grads,
    then the clipped mean by a second backward of the coefficient-weighted losses."""
    if output == "grads":
        return NotApplicable("ghost clipping never forms per-sample gradients")
    try:
        import opacus  # noqa: F401
    except ImportError:
        return NotApplicable("opacus not installed")
    try:
        return ghost_clipping(_trainable_copy(s), lambda gsm: batch_losses(gsm, s), output, clip)
    except Exception as exc:
        return NotApplicable(f"ghost clipping refuses the model: {_short(exc)}")


def ghost_clipping(module: nn.Module, losses: Callable[[nn.Module], torch.Tensor], output: str,
                   clip: float) -> Callable[[], Result]:
    """Opacus ghost clipping of ``module`` (trainable) whose per-sample losses ``losses(m)``
    gives, for ``norms`` or ``clipped_mean``; raises where Opacus refuses the model."""
    from opacus.grad_sample import GradSampleModuleFastGradientClipping

    names = [n for n, _ in module.named_parameters()]
    gsm = GradSampleModuleFastGradientClipping(
        module, max_grad_norm=clip, use_ghost_clipping=True, loss_reduction="sum"
    )
    params = list(module.parameters())

    def run() -> Result:
        gsm.zero_grad(set_to_none=True)
        per = losses(gsm)
        per.sum().backward(retain_graph=output == "clipped_mean")
        norms = gsm.get_norm_sample()
        if output == "norms":
            return {"norms": norms}
        gsm.disable_hooks()
        try:
            return weighted_mean(per, gsm.get_clipping_coef(), names, params)
        finally:
            gsm.enable_hooks()

    return run


# --- BackPACK -----------------------------------------------------------------------------------


Extended = tuple[nn.Module, list[str], list[nn.Parameter]]


def _backpack_module(s: Setup) -> Extended | NotApplicable:
    try:
        from backpack import extend
    except ImportError:
        return NotApplicable("backpack-for-pytorch not installed")
    try:
        module: nn.Module = extend(_trainable_copy(s))
    except Exception as exc:
        return NotApplicable(f"BackPACK cannot extend the model: {_short(exc)}")
    return module, [n for n, _ in module.named_parameters()], list(module.parameters())


def backpack_batch_grad(s: Setup, output: str, clip: float) -> Callable[[], Result] | NotApplicable:
    """BackPACK ``BatchGrad`` (``p.grad_batch``) on a sum-reduced loss."""
    extended = _backpack_module(s)
    if isinstance(extended, NotApplicable):
        return extended
    from backpack import backpack
    from backpack.extensions import BatchGrad

    module, names, params = extended

    def run() -> Result:
        module.zero_grad(set_to_none=True)
        loss = batch_losses(module, s).sum()
        with backpack(BatchGrad()):
            loss.backward()
        grads = _saved(names, params, "grad_batch")
        return from_grads(output, grads, clip)

    return run


def backpack_l2(s: Setup, output: str, clip: float) -> Callable[[], Result] | NotApplicable:
    """BackPACK ``BatchL2Grad`` (``p.batch_l2``): norms without per-sample gradients; the
    clipped mean by a second backward of the clip-factor-weighted losses."""
    if output == "grads":
        return NotApplicable("BatchL2Grad gives squared norms only")
    extended = _backpack_module(s)
    if isinstance(extended, NotApplicable):
        return extended
    from backpack import backpack
    from backpack.extensions import BatchL2Grad

    module, names, params = extended

    def run() -> Result:
        module.zero_grad(set_to_none=True)
        per = batch_losses(module, s)
        with backpack(BatchL2Grad()):
            per.sum().backward(retain_graph=output == "clipped_mean")
        norms = torch.stack(list(_saved(names, params, "batch_l2").values())).sum(0).sqrt()
        if output == "norms":
            return {"norms": norms}
        return weighted_mean(per, (clip / norms).clamp(max=1.0), names, params)

    return run


def _saved(names: list[str], params: list[nn.Parameter], attr: str) -> Tensors:
    missing = [n for n, p in zip(names, params, strict=True) if getattr(p, attr, None) is None]
    if missing:
        raise NotImplementedError(
            f"BackPACK has no {attr} for {len(missing)} of {len(params)} parameters "
            f"({', '.join(missing[:2])}, ...): no extension for their modules"
        )
    return {n: _take(p, attr) for n, p in zip(names, params, strict=True)}


def _take(p: nn.Parameter, attr: str) -> torch.Tensor:
    """A per-sample tensor the library left on the parameter, detached from it: held there
    between calls it would keep B gradients alive per method instance."""
    value: torch.Tensor = getattr(p, attr)
    setattr(p, attr, None)
    return value


# --- psgrad in process --------------------------------------------------------------------------


def psgrad_request(s: Setup, output: str, clip: float) -> tuple[Batch, Options]:
    """The engine's batch and options for ``output`` (no noise: the clipped mean is compared)."""
    loss = s.model.default_loss
    batch = Batch(**s.data)  # type: ignore[arg-type]
    opts = Options(
        loss=loss,
        outputs=(output,),
        params=tuple(s.model.params),
        clip_norm=clip,
        noise_multiplier=0.0,
        gamma=GAMMA if loss == "td0" else 1.0,
    )
    return batch, opts


def psgrad_engine(s: Setup, output: str, clip: float) -> Callable[[], Result]:
    """``service.engine.compute`` as the worker calls it (fast statistics where they apply)."""
    from service.config import get_settings

    batch, opts = psgrad_request(s, output, clip)
    budget = get_settings().memory_budget_mb << 20

    def run() -> Result:
        out = engine.compute(s.model, batch, opts, budget_bytes=budget)[0]
        return {output: out[output]}

    return run


def _short(exc: BaseException) -> str:
    own = isinstance(exc, NotImplementedError)
    text = (str(exc) if own else f"{type(exc).__name__}: {exc}").splitlines()[0]
    return text if len(text) <= 160 else text[:157] + "..."


def first_call(fn: Callable[[], Result]) -> Result | NotApplicable:
    """The first call: a library that raises on this model does not apply (the reason is kept)."""
    try:
        return fn()
    except Exception as exc:
        return NotApplicable(_short(exc))


Factory = Callable[[Setup, str, float], "Callable[[], Result] | NotApplicable"]
IN_PROCESS: dict[str, Factory] = {
    "loop": per_sample_loop,
    "vmap": tutorial_vmap,
    "opacus": opacus_hooks,
    "opacus-ghost": opacus_ghost,
    "backpack": backpack_batch_grad,
    "backpack-l2": backpack_l2,
    "psgrad-engine": psgrad_engine,
}


def max_abs_diff(got: Result, want: Result) -> float:
    """Largest absolute difference between two results of the same output."""
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        pairs = [(g[k], w[k]) for k in w] if isinstance(w, dict) else [(g, w)]
        for a, b in pairs:
            a_t = torch.as_tensor(a).detach().to("cpu", torch.float32)
            worst = max(worst, float((a_t - b.to("cpu", torch.float32)).abs().max()))
    return worst


def agrees(got: Result, want: Result, atol: float = 3e-3, rtol: float = 1e-5) -> bool:
    """The tutorial's check: ``torch.allclose(got, want, atol=3e-3, rtol=1e-5)`` everywhere."""
    for name, w in want.items():
        g = got[name]
        pairs = [(g[k], w[k]) for k in w] if isinstance(w, dict) else [(g, w)]
        for a, b in pairs:
            a_t = torch.as_tensor(a).detach().to("cpu", torch.float32)
            if not torch.allclose(a_t, b.to("cpu", torch.float32), atol=atol, rtol=rtol):
                return False
    return True
