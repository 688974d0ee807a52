"""The outputs a request can ask for, registered by name with what they need and their shape."""

from __future__ import annotations

from dataclasses import dataclass

from psgrad._errors import UnknownOutput


@dataclass(frozen=True)
class Output:
    name: str
    description: str
    per_sample: bool  # one value (or tensor) per sample, split back per job
    per_param: bool = False  # a dict keyed by parameter name
    per_param_tensor: bool = False  # ... whose values have the parameter's shape
    td0_only: bool = False


OUTPUTS: dict[str, Output] = {}


def register_output(name: str, description: str, *, per_sample: bool, per_param: bool = False,
                    per_param_tensor: bool = False, td0_only: bool = False) -> None:
    OUTPUTS[name] = Output(name, description, per_sample, per_param or per_param_tensor,
                           per_param_tensor, td0_only)


register_output("grads", "{param: [B, *shape]} per-sample gradient of the per-sample loss",
                per_sample=True, per_param_tensor=True)
register_output("losses", "[B] per-sample loss", per_sample=True)
register_output("norms", "[B] L2 norm of each sample's whole gradient (selected parameters)",
                per_sample=True)
register_output("layer_norms", "{param: [B]} L2 norm per sample per parameter",
                per_sample=True, per_param=True)
register_output("mean", "{param: shape} mean of the per-sample gradients", per_sample=False,
                per_param_tensor=True)
register_output("variance", "{param: shape} per-element population variance across samples",
                per_sample=False, per_param_tensor=True)
register_output("clipped_mean", "{param: shape} DP-SGD clipped, noised mean (clip_norm, "
                "noise_multiplier, seed)", per_sample=False, per_param_tensor=True)
register_output("dot", "[B] per-sample dot product with `reference`", per_sample=True)
register_output("cosine_mean", "[B] cosine of each sample's gradient with the batch mean gradient",
                per_sample=True)
register_output("td_errors", "[B] td0 only: delta_i", per_sample=True, td0_only=True)
register_output("updates", "{param: [B, *shape]} td0 only: delta_i * grad V(s_i)",
                per_sample=True, per_param_tensor=True, td0_only=True)


def get_output(name: str) -> Output:
    try:
        return OUTPUTS[name]
    except KeyError:
        raise UnknownOutput(
            f"unknown output '{name}'; known: {', '.join(OUTPUTS)}", known=list(OUTPUTS)
        ) from None
