"""The one slow, obviously correct reference that every gradient in the tests is held to.

Each sample runs alone (a batch of one) through a private copy of the module, its loss is written
out here with ``torch.nn.functional`` (never :mod:`service.losses`), and ``torch.autograd.grad``
differentiates it (the loop of Opacus's ``per_sample_gradients_utils``). Every statistic is then
computed from the stacked per-sample gradients in float64, the plain way. Nothing here calls the
engine or the fast-statistics path: only their request records are read.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from psgrad._contract import output
from psgrad._types import OUTPUT_NAMES

if TYPE_CHECKING:
    from service.engine import Batch, Options
    from service.registry import LoadedModel

TOL = {"atol": 3e-3, "rtol": 1e-5}  # the PyTorch tutorial's tolerance
# variances are small (1e-3 on the test models): the tutorial's atol would pass any answer
VARIANCE_TOL = {"atol": 1e-6, "rtol": 1e-3}


def tolerance(output: str) -> dict[str, float]:
    """The tolerance an output is held to: the tutorial's, tighter for variances."""
    return VARIANCE_TOL if output == "variance" else TOL
# The outputs that summarise the batch without per-sample gradients, td0 or not (the fast path's).
# Data attribution's outputs need a projection or references: tests/unit/test_projection.py.
ATTRIBUTION = ("projection", "dots", "influence", "self_influence")
# Outputs of layer inputs and output gradients, not of per-sample gradients: held to factors
# written out by hand in tests/unit/test_curvature.py.
FACTORS = ("kfac_inputs",)
SUMMARY = tuple(n for n in OUTPUT_NAMES
                if n not in ("grads", "td_errors", "updates", *ATTRIBUTION, *FACTORS))
BATCH_FIELDS = ("inputs", "targets", "next_inputs", "rewards", "dones", "mask")

Tensor = torch.Tensor
Tensors = dict[str, torch.Tensor]
Forward = Callable[[torch.Tensor], torch.Tensor]
# A loss of one sample: (the value differentiated, its auxiliary value: the TD error for td0).
Loss = Callable[[Forward, Tensors, float], tuple[torch.Tensor, torch.Tensor]]


# ----------------------------------------------------------------------------- the losses


def cross_entropy(forward: Forward, sample: Tensors, gamma: float) -> tuple[Tensor, Tensor]:
    value = F.cross_entropy(forward(sample["inputs"]), sample["targets"])
    return value, value.detach()


def nll(forward: Forward, sample: Tensors, gamma: float) -> tuple[Tensor, Tensor]:
    value = F.nll_loss(forward(sample["inputs"]), sample["targets"])
    return value, value.detach()


def margin(forward: Forward, sample: Tensors, gamma: float) -> tuple[Tensor, Tensor]:
    """TRAK's log-odds of the correct class, ``log p - log(1 - p)``, written out."""
    out = forward(sample["inputs"])[0]
    p = torch.softmax(out.double(), 0)[int(sample["targets"][0])]
    value = (torch.log(p) - torch.log1p(-p)).to(out.dtype)
    return value, value.detach()


def mse(forward: Forward, sample: Tensors, gamma: float) -> tuple[Tensor, Tensor]:
    out = forward(sample["inputs"])
    value = F.mse_loss(out, sample["targets"].reshape(out.shape))
    return value, value.detach()


def td0(forward: Forward, sample: Tensors, gamma: float) -> tuple[Tensor, Tensor]:
    """``(r + gamma (1 - done) V(s') - V(s))^2``, the target held constant; aux is the TD error."""
    value = forward(sample["inputs"]).reshape(())
    with torch.no_grad():
        next_value = forward(sample["next_inputs"]).reshape(())
    done = sample["dones"].reshape(()) if "dones" in sample else 0.0
    delta = sample["rewards"].reshape(()) + gamma * (1 - done) * next_value - value
    return delta**2, delta.detach()


def _token_mean(scores: Tensor, ids: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """The mean over kept positions of -log softmax(scores)[t, ids[t]], written out."""
    picked = -torch.log_softmax(scores, -1).gather(1, ids[:, None])[:, 0]
    keep = torch.ones_like(picked) if mask is None else mask.to(picked.dtype)
    value = (picked * keep).sum() / keep.sum()
    return value, value.detach()


def token_cross_entropy(forward: Forward, sample: Tensors, gamma: float) -> tuple[Tensor, Tensor]:
    mask = sample.get("mask")
    return _token_mean(forward(sample["inputs"])[0], sample["targets"][0],
                       None if mask is None else mask[0])


def next_token(forward: Forward, sample: Tensors, gamma: float) -> tuple[Tensor, Tensor]:
    mask = sample.get("mask")
    return _token_mean(forward(sample["inputs"])[0, :-1], sample["targets"][0, 1:],
                       None if mask is None else mask[0, 1:])


LOSSES: dict[str, Loss] = {"cross_entropy": cross_entropy, "nll": nll, "mse": mse, "td0": td0,
                           "margin": margin,
                           "token_cross_entropy": token_cross_entropy, "next_token": next_token}


# ----------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Loop:
    """Per-sample results stacked over the batch, in the module's dtype."""

    grads: Tensors  # {param: [B, *shape]} of the loss
    losses: torch.Tensor  # [B]
    td_errors: torch.Tensor | None = None  # [B], td0 only
    value_grads: Tensors | None = None  # {param: [B, *shape]} of V(s), td0 only

    @property
    def norms(self) -> torch.Tensor:
        """The norm of each sample's whole gradient (every selected parameter)."""
        return torch.stack([_rows(g).pow(2).sum(1) for g in self.grads.values()]).sum(0).sqrt()


def per_sample_loop(
    module: nn.Module,
    data: Mapping[str, Any],
    loss: str,
    *,
    weights: Mapping[str, torch.Tensor] | None = None,
    params: Sequence[str] | None = None,
    gamma: float = 1.0,
) -> Loop:
    """Gradients of ``params`` (all by default), one sample at a time: batch of one, autograd.

    ``data`` holds the batch fields by name (``inputs``, ``targets``, ``next_inputs``, ...);
    ``inputs`` may map a module's several inputs by name, in the order it takes them;
    ``weights`` replace parameters of a copy of ``module`` first, as per-call weights do.
    """
    module = copy.deepcopy(module).eval().requires_grad_(True)
    named = dict(module.named_parameters())
    with torch.no_grad():
        for name, value in (weights or {}).items():
            named[name].copy_(value)
    wanted = list(params or named)
    chosen = [named[k] for k in wanted]
    device = next(module.parameters()).device  # the batch goes where the module is
    fields = {k: torch.as_tensor(v).to(device) for k, v in data.items()
              if v is not None and not isinstance(v, Mapping)}
    by_name = ({k: torch.as_tensor(v).to(device) for k, v in data["inputs"].items()}
               if isinstance(data["inputs"], Mapping) else {})
    if by_name:
        fields["inputs"] = by_name.pop(next(iter(by_name)))
    grads: dict[str, list[torch.Tensor]] = {k: [] for k in wanted}
    value_grads: dict[str, list[torch.Tensor]] = {k: [] for k in wanted}
    losses, aux = [], []
    for i in range(len(fields["inputs"])):
        sample = {k: v[i : i + 1] for k, v in fields.items()}
        rest = [v[i : i + 1] for v in by_name.values()]
        value, extra = LOSSES[loss](lambda x, rest=rest: module(x, *rest), sample, gamma)
        _append(grads, chosen, torch.autograd.grad(value, chosen, allow_unused=True))
        if loss == "td0":
            v_of_s = module(sample["inputs"]).reshape(())
            _append(value_grads, chosen, torch.autograd.grad(v_of_s, chosen, allow_unused=True))
        losses.append(value.detach())
        aux.append(extra)
    td0_only = loss == "td0"
    return Loop(
        grads={k: torch.stack(v) for k, v in grads.items()},
        losses=torch.stack(losses),
        td_errors=torch.stack(aux) if td0_only else None,
        value_grads={k: torch.stack(v) for k, v in value_grads.items()} if td0_only else None,
    )


def _rows(stacked: torch.Tensor) -> torch.Tensor:
    """[B, *shape] as [B, numel] (a 0-d parameter gives [B, 1])."""
    return stacked.reshape(len(stacked), -1)


def _append(
    into: dict[str, list[torch.Tensor]], chosen: list[torch.Tensor], found: Sequence[Any]
) -> None:
    """One sample's gradients onto each parameter's rows (zeros where the loss does not reach)."""
    for rows, p, g in zip(into.values(), chosen, found, strict=True):
        rows.append(torch.zeros_like(p) if g is None else g)


def loop_of(model: LoadedModel, batch: Batch, opts: Options) -> Loop:
    """The loop for one engine request: its batch, per-call weights, parameters, loss, gamma."""
    return per_sample_loop(
        model.module,
        {name: getattr(batch, name) for name in BATCH_FIELDS},
        opts.loss,
        weights=batch.weights,
        params=opts.params,
        gamma=opts.gamma,
    )


# ----------------------------------------------------------------------------- the outputs


def summarize(
    loop: Loop,
    segments: Sequence[int],
    *,
    clip_norm: float | None = None,
    reference: Mapping[str, torch.Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Every output per segment (job) from the loop, in float64.

    ``clipped_mean`` is there when ``clip_norm`` is given, ``dot`` when ``reference`` is,
    ``td_errors`` and ``updates`` for td0.
    """
    g64 = {k: v.to(torch.float64) for k, v in loop.grads.items()}
    sq = {k: _rows(v).pow(2).sum(1) for k, v in g64.items()}
    norms = torch.stack(list(sq.values())).sum(0).sqrt()
    results = []
    start = 0
    for n in segments:
        rows = slice(start, start + n)
        start += n
        part = {k: v[rows] for k, v in g64.items()}
        mean = {k: v.mean(0) for k, v in part.items()}
        out: dict[str, Any] = {
            "grads": part,
            "losses": loop.losses[rows].to(torch.float64),
            "norms": norms[rows],
            "layer_norms": {k: v[rows].sqrt() for k, v in sq.items()},
            "mean": mean,
            "variance": {k: v.var(0, unbiased=False) for k, v in part.items()},
        }
        if clip_norm is not None:
            factor = torch.minimum(torch.ones(()), clip_norm / norms[rows].clamp(min=1e-300))
            out["clipped_mean"] = {
                k: torch.tensordot(factor, v, dims=1) / n for k, v in part.items()
            }
        if reference:
            ref = {k: v.to(torch.float64).flatten() for k, v in reference.items()}
            out["dot"] = sum(_rows(v) @ ref[k] for k, v in part.items())
        if n >= 2:
            out.update(noise_scales(part, mean))
        mean_norm = torch.stack([v.pow(2).sum() for v in mean.values()]).sum().sqrt()
        dots = sum(_rows(v) @ mean[k].flatten() for k, v in part.items())
        out["cosine_mean"] = (dots / (norms[rows] * mean_norm)).nan_to_num(0.0)
        if loop.td_errors is not None and loop.value_grads is not None:
            delta = loop.td_errors[rows].to(torch.float64)
            out["td_errors"] = delta
            out["updates"] = {
                k: torch.einsum("i,i...->i...", delta, v[rows].to(torch.float64))
                for k, v in loop.value_grads.items()
            }
        results.append(out)
    return results


def noise_scales(part: Tensors, mean: Tensors) -> dict[str, Any]:
    """``gns`` and ``layer_gns`` with their estimates, by their definitions: ``tr(Sigma)`` the
    sum of squared deviations from the mean over B - 1, ``|G|^2 = |mean|^2 - tr(Sigma) / B``."""
    n = len(next(iter(part.values())))
    trace = {k: _rows(v - mean[k]).pow(2).sum() / (n - 1) for k, v in part.items()}
    grad_sq = {k: m.pow(2).sum() - trace[k] / n for k, m in mean.items()}

    def ratio(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return (t / g).nan_to_num(0.0, posinf=0.0, neginf=0.0)

    whole_trace, whole_grad_sq = sum(trace.values()), sum(grad_sq.values())
    return {
        "gns": ratio(whole_trace, whole_grad_sq),
        "gns_trace": whole_trace,
        "gns_grad_sq": whole_grad_sq,
        "layer_gns": {k: ratio(trace[k], grad_sq[k]) for k in trace},
        "layer_gns_trace": trace,
        "layer_gns_grad_sq": grad_sq,
    }


def loop_noise_scales(module: nn.Module, data: Mapping[str, Any], loss: str) -> dict[str, Any]:
    """Every noise-scale field over the whole batch by its definition, from the loop."""
    grads = {k: v.double() for k, v in per_sample_loop(module, data, loss).grads.items()}
    return noise_scales(grads, {k: v.mean(0) for k, v in grads.items()})


def attribution(loop: Loop, references: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``dots`` against ``{param: [M, *shape]}`` references and ``self_influence`` (squared
    norms), from the loop, in float64."""
    g64 = {k: _rows(v.to(torch.float64)) for k, v in loop.grads.items()}
    out = {"self_influence": sum(v.pow(2).sum(1) for v in g64.values())}
    if references:
        out["dots"] = sum(v @ _rows(references[k].to(torch.float64)).t() for k, v in g64.items())
    return out


def reference(
    model: LoadedModel, batch: Batch, opts: Options, segments: Sequence[int]
) -> list[dict[str, Any]]:
    """Every output of one engine request per segment, from the loop, in float64."""
    return summarize(
        loop_of(model, batch, opts), segments, clip_norm=opts.clip_norm, reference=batch.reference
    )


def assert_close(got: Any, want: Any, where: str = "", **tol: float) -> None:
    """Tensors and dicts of tensors, compared in the dtype and on the device of ``got``."""
    tol = tol or TOL
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), where
        for k in want:
            assert_close(got[k], want[k], f"{where}/{k}", **tol)
        return
    assert isinstance(got, torch.Tensor), where
    torch.testing.assert_close(got, want.to(got.device, got.dtype),
                               msg=lambda m: f"{where}: {m}", **tol)


# the noise scale's estimates are differences of sums of squares: held to this fraction of the
# terms they are differences of, and the ratio to what that much error in them moves it
NOISE_SCALE_REL = 1e-5


def assert_output(name: str, got: Mapping[str, Any], want: Mapping[str, Any], where: str = "",
                  *, samples: int) -> None:
    """Output ``name`` of the answer ``got`` (of ``samples`` samples) against ``want``, at its
    tolerance; a noise scale with its estimates (:func:`assert_noise_scale`), where it is
    defined (the door refuses one sample)."""
    if output(name).combine == "gns":
        if samples >= 2:
            assert_noise_scale(name, got, want, where)
        return
    assert_close(got[name], want[name], f"{where} {name}", **tolerance(name))


def assert_noise_scale(name: str, got: Mapping[str, Any], want: Mapping[str, Any],
                       where: str = "") -> None:
    """``trace`` and ``grad_sq`` are differences of terms of size ``trace + grad_sq`` (the mean
    squared norm over the samples, up to (B - 1) / B): each is held to
    :data:`NOISE_SCALE_REL` of that; the ratio, where ``grad_sq`` is near 0 a large number
    that any rounding moves, to what that much error in both moves it, and to its own estimates'
    ratio (0 where ``grad_sq`` is)."""
    ratio, trace, grad_sq = (_flat(got[k]) for k in (name, *output(name).also))
    want_trace, want_grad_sq = (_flat(want[k]) for k in output(name).also)
    err = NOISE_SCALE_REL * (want_trace.abs() + want_grad_sq.abs())
    for k, g, w in ((name + "_trace", trace, want_trace), (name + "_grad_sq", grad_sq,
                                                             want_grad_sq)):
        bad = (g - w).abs() > err
        assert not bad.any(), f"{where} {k}: {g[bad].tolist()} against {w[bad].tolist()}"
    own = (trace / grad_sq).nan_to_num(0.0, posinf=0.0, neginf=0.0)
    torch.testing.assert_close(ratio, own, rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{where} {name} is not its estimates' ratio: {m}")
    want_ratio = _flat(want[name])
    moved = err * (1 + want_ratio.abs()) / (want_grad_sq.abs() - err).clamp(min=1e-300)
    bad = ((ratio - want_ratio).abs() > moved) & (want_grad_sq.abs() > 2 * err)
    assert not bad.any(), f"{where} {name}: {ratio[bad].tolist()} vs {want_ratio[bad].tolist()}"


def _flat(value: Any) -> torch.Tensor:
    """A number, or {param: number}, as a float64 vector on the CPU (parameters in order)."""
    values = list(value.values()) if isinstance(value, Mapping) else [value]
    return torch.stack([torch.as_tensor(v).detach().cpu().double().reshape(()) for v in values])
