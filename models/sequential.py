"""``sequential``: a model sent as JSON, built only from an allow-list of ``torch.nn`` layers.

A client registers an architecture without the host ever running code it sent: each layer is a
``{"type", "args", "kwargs"}`` entry whose type must be in :data:`LAYERS` and whose arguments
are JSON numbers, booleans, nulls and lists of them, bound by name to the arguments that type
accepts (``device``, ``dtype`` and anything that names a callable are not among them). The few
string arguments are enum-like and checked against their values (``activation`` of
``TransformerEncoderLayer``, ``padding_mode``, ...). Layers see batch-first tensors, as in
``nn.Sequential``; three adaptations make every allowed type a one-input, one-output layer:

- ``Bilinear(n, n, out)`` gets its input as both arguments: ``y = x^T A x + b``.
- ``RNN``/``GRU``/``LSTM`` are always ``batch_first`` and pass on their output sequence only
  (``[B, T, hidden * directions]``); follow them with ``SelectStep`` or ``Mean``. Their forward
  is the hand-unrolled cell of :mod:`models.recurrent` so that ``vmap`` can batch it.
- ``SelectStep(index)`` takes one step of a sequence (``x[:, index]``), ``Mean(dim)`` averages.

The model runs in eval mode: ``Dropout`` is the identity and ``BatchNorm`` uses its running
statistics (sent with the weights), so samples never influence each other.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from models.base import ModelFamily, TensorSpec, register_model
from models.recurrent import SequenceGRU, SequenceLSTM, SequenceRNN
from psgrad._errors import InvalidModelSpec, TooLarge

INPUT_DTYPES = ("float32", "int64")
MAX_INPUT_ELEMENTS = 1 << 22
MAX_ARG_ITEMS = 16
MAX_RECURRENT_STEPS = 1024


class SelfBilinear(nn.Bilinear):
    """``Bilinear`` fed its single input twice, so it fits in a sequence of layers.

    Computed with ``einsum`` rather than ``F.bilinear``: same parameters and result, and vmap
    batches it (``aten::_trilinear`` has no batching rule in torch 2.13: a slow fallback).
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        y = torch.einsum("...i,oij,...j->...o", x, self.weight, x)
        return y + self.bias if self.bias is not None else y


class SelectStep(nn.Module):
    """One step of a batch-first sequence: ``x[:, index]`` (``-1`` is the last step)."""

    def __init__(self, index: int) -> None:
        super().__init__()
        if not isinstance(index, int) or isinstance(index, bool):
            raise TypeError(f"index must be an integer; got {index!r}")
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, self.index]

    def extra_repr(self) -> str:
        return f"index={self.index}"


class Mean(nn.Module):
    """Average over ``dim`` (an int or a list; batch-first, so dim 0 is refused)."""

    def __init__(self, dim: int | list[int], keepdim: bool = False) -> None:
        super().__init__()
        dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, tuple) else dim
        if not isinstance(dims, list) or not dims or not all(
            isinstance(d, int) and not isinstance(d, bool) for d in dims
        ):
            raise TypeError(f"dim must be an integer or a list of integers; got {dim!r}")
        if 0 in dims:
            raise ValueError("dim 0 is the batch dimension: averaging over it couples samples")
        self.dim = tuple(dims)
        self.keepdim = bool(keepdim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=self.dim, keepdim=self.keepdim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, keepdim={self.keepdim}"


@dataclass(frozen=True)
class LayerRule:
    """How one allowed type is built: its accepted arguments, in positional order."""

    make: Callable[..., nn.Module]
    params: tuple[str, ...]
    enums: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)  # always passed; others refused
    check: Callable[[dict[str, Any]], str | None] | None = None


_CONV = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "dilation", "groups",
         "bias", "padding_mode")
_CONV_T = ("in_channels", "out_channels", "kernel_size", "stride", "padding", "output_padding",
           "groups", "bias", "dilation", "padding_mode")
_PADDING_MODES = ("zeros", "reflect", "replicate", "circular")
_POOL_MAX = ("kernel_size", "stride", "padding", "dilation", "ceil_mode")
_POOL_AVG = ("kernel_size", "stride", "padding", "ceil_mode", "count_include_pad")
_RNN = ("input_size", "hidden_size", "num_layers", "bias", "batch_first", "dropout",
        "bidirectional")


def _same_features(named: dict[str, Any]) -> str | None:
    if named.get("in1_features") != named.get("in2_features"):
        return ("in1_features and in2_features must be equal: Bilinear receives its one input "
                "as both arguments")
    return None


LAYERS: dict[str, LayerRule] = {
    "Linear": LayerRule(nn.Linear, ("in_features", "out_features", "bias")),
    "Bilinear": LayerRule(SelfBilinear, ("in1_features", "in2_features", "out_features", "bias"),
                          check=_same_features),
    **{f"Conv{d}d": LayerRule(getattr(nn, f"Conv{d}d"), _CONV,
                              enums={"padding": ("same", "valid"),
                                     "padding_mode": _PADDING_MODES}) for d in (1, 2, 3)},
    **{f"ConvTranspose{d}d": LayerRule(getattr(nn, f"ConvTranspose{d}d"), _CONV_T,
                                       enums={"padding_mode": ("zeros",)}) for d in (1, 2)},
    "Embedding": LayerRule(nn.Embedding, ("num_embeddings", "embedding_dim", "padding_idx")),
    "LayerNorm": LayerRule(nn.LayerNorm, ("normalized_shape", "eps", "elementwise_affine",
                                          "bias")),
    "GroupNorm": LayerRule(nn.GroupNorm, ("num_groups", "num_channels", "eps", "affine")),
    **{f"InstanceNorm{d}d": LayerRule(getattr(nn, f"InstanceNorm{d}d"),
                                      ("num_features", "eps", "momentum", "affine",
                                       "track_running_stats")) for d in (1, 2)},
    "RMSNorm": LayerRule(nn.RMSNorm, ("normalized_shape", "eps", "elementwise_affine")),
    **{f"BatchNorm{d}d": LayerRule(getattr(nn, f"BatchNorm{d}d"),
                                   ("num_features", "eps", "momentum", "affine"),
                                   fixed={"track_running_stats": True}) for d in (1, 2)},
    "ReLU": LayerRule(nn.ReLU, ()),
    "LeakyReLU": LayerRule(nn.LeakyReLU, ("negative_slope",)),
    "ELU": LayerRule(nn.ELU, ("alpha",)),
    "GELU": LayerRule(nn.GELU, ("approximate",), enums={"approximate": ("none", "tanh")}),
    "SiLU": LayerRule(nn.SiLU, ()),
    "Tanh": LayerRule(nn.Tanh, ()),
    "Sigmoid": LayerRule(nn.Sigmoid, ()),
    "Softplus": LayerRule(nn.Softplus, ("beta", "threshold")),
    "Softmax": LayerRule(nn.Softmax, ("dim",),
                         check=lambda n: None if "dim" in n else "dim is required"),
    "LogSoftmax": LayerRule(nn.LogSoftmax, ("dim",),
                            check=lambda n: None if "dim" in n else "dim is required"),
    "Dropout": LayerRule(nn.Dropout, ("p",)),
    "MaxPool1d": LayerRule(nn.MaxPool1d, _POOL_MAX),
    "MaxPool2d": LayerRule(nn.MaxPool2d, _POOL_MAX),
    "AvgPool1d": LayerRule(nn.AvgPool1d, _POOL_AVG),
    "AvgPool2d": LayerRule(nn.AvgPool2d, (*_POOL_AVG, "divisor_override")),
    "AdaptiveAvgPool1d": LayerRule(nn.AdaptiveAvgPool1d, ("output_size",)),
    "AdaptiveAvgPool2d": LayerRule(nn.AdaptiveAvgPool2d, ("output_size",)),
    "Flatten": LayerRule(nn.Flatten, ("start_dim", "end_dim")),
    "Unflatten": LayerRule(nn.Unflatten, ("dim", "unflattened_size")),
    "Identity": LayerRule(nn.Identity, ()),
    "RNN": LayerRule(SequenceRNN, (*_RNN[:3], "nonlinearity", *_RNN[3:]),
                     enums={"nonlinearity": ("tanh", "relu")}, fixed={"batch_first": True}),
    "GRU": LayerRule(SequenceGRU, _RNN, fixed={"batch_first": True}),
    "LSTM": LayerRule(SequenceLSTM, (*_RNN, "proj_size"), fixed={"batch_first": True}),
    "TransformerEncoderLayer": LayerRule(
        nn.TransformerEncoderLayer,
        ("d_model", "nhead", "dim_feedforward", "dropout", "activation", "layer_norm_eps",
         "batch_first", "norm_first", "bias"),
        enums={"activation": ("relu", "gelu")}, fixed={"batch_first": True},
    ),
    "SelectStep": LayerRule(SelectStep, ("index",)),
    "Mean": LayerRule(Mean, ("dim", "keepdim")),
}


def _refuse(index: int, kind: str, problem: str, **details: Any) -> InvalidModelSpec:
    return InvalidModelSpec(f"layer {index} ({kind}): {problem}", layer=index, type=kind,
                            **details)


def _check_value(value: Any, index: int, kind: str, name: str, depth: int = 0) -> None:
    """Only JSON null, booleans, finite numbers and short lists of them reach a constructor."""
    if value is None or isinstance(value, (bool, int)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _refuse(index, kind, f"'{name}' must be finite")
        return
    if isinstance(value, list) and depth == 0 and len(value) <= MAX_ARG_ITEMS:
        for item in value:
            _check_value(item, index, kind, name, depth + 1)
        return
    raise _refuse(index, kind, f"'{name}' must be a number, boolean, null or a short list of "
                  f"them; got {type(value).__name__}", argument=name)


def _tuples(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def bind_layer(index: int, layer: Any) -> tuple[str, dict[str, Any]]:
    """Check one layer entry and bind its arguments by name; the normalised entry is kept."""
    if not isinstance(layer, dict):
        raise _refuse(index, "?", "each layer must be an object {type, args, kwargs}")
    unknown = sorted(set(layer) - {"type", "args", "kwargs"})
    kind = layer.get("type")
    if unknown:
        raise _refuse(index, str(kind), f"unknown keys {unknown}; a layer has type, args, kwargs")
    if not isinstance(kind, str) or kind not in LAYERS:
        raise InvalidModelSpec(
            f"layer {index}: type {kind!r} is not allowed; allowed: {', '.join(LAYERS)}",
            layer=index, allowed=list(LAYERS),
        )
    rule = LAYERS[kind]
    args, kwargs = layer.get("args", []), layer.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise _refuse(index, kind, "args must be a list and kwargs an object")
    if len(args) > len(rule.params):
        raise _refuse(index, kind, f"takes at most {len(rule.params)} positional arguments "
                      f"({', '.join(rule.params) or 'none'}); got {len(args)}")
    named = dict(zip(rule.params, args, strict=False))
    for name, value in kwargs.items():
        if name not in rule.params:
            raise _refuse(index, kind, f"unknown argument '{name}'; accepted: "
                          f"{', '.join(rule.params) or 'none'}", argument=name)
        if name in named:
            raise _refuse(index, kind, f"argument '{name}' is given twice", argument=name)
        named[name] = value
    for name, value in named.items():
        if name in rule.fixed and value != rule.fixed[name]:
            raise _refuse(index, kind, f"'{name}' must be {json.dumps(rule.fixed[name])} here "
                          "(layers see batch-first tensors, in eval mode)", argument=name)
        if isinstance(value, str) and name in rule.enums:
            if value not in rule.enums[name]:
                raise _refuse(index, kind, f"'{name}' must be one of "
                              f"{', '.join(rule.enums[name])}; got {value!r}", argument=name)
            continue
        _check_value(value, index, kind, name)
    problem = rule.check(named) if rule.check else None
    if problem:
        raise _refuse(index, kind, problem)
    return kind, {**named, **rule.fixed}


def build_layer(index: int, layer: dict[str, Any]) -> nn.Module:
    kind, named = bind_layer(index, layer)
    try:
        return LAYERS[kind].make(**{k: _tuples(v) for k, v in named.items()})
    except (TypeError, ValueError, RuntimeError, AssertionError, ZeroDivisionError) as exc:
        reason = str(exc).strip().split("\n")[0][:300]  # not torch's C++ stack after it
        raise _refuse(index, kind, f"cannot be built from these arguments: {reason}") from exc


def _input(spec: Any, layers: list[dict[str, Any]]) -> dict[str, Any]:
    if not isinstance(spec, dict) or not set(spec) <= {"shape", "dtype", "high"}:
        raise InvalidModelSpec("'input' must be an object {shape, dtype, high (int64 only)}")
    shape, dtype = spec.get("shape"), spec.get("dtype", "float32")
    if (not isinstance(shape, list) or len(shape) > 6
            or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)):
        raise InvalidModelSpec("input.shape must be a list of at most 6 positive integers "
                               "(one sample, no batch dimension)")
    if math.prod(shape) > MAX_INPUT_ELEMENTS:
        raise InvalidModelSpec(f"input.shape has {math.prod(shape)} elements per sample; the "
                               f"limit is {MAX_INPUT_ELEMENTS}")
    if dtype not in INPUT_DTYPES:
        raise InvalidModelSpec(f"input.dtype must be one of {', '.join(INPUT_DTYPES)}; "
                               f"got {dtype!r}")
    out: dict[str, Any] = {"shape": shape, "dtype": dtype}
    if dtype == "int64":
        high = spec.get("high")
        first = layers[0] if layers else {}
        if high is None and first.get("type") == "Embedding":
            _, named = bind_layer(0, first)
            high = named.get("num_embeddings")
        if not isinstance(high, int) or isinstance(high, bool) or high < 1:
            raise InvalidModelSpec("integer inputs need input.high (token ids are in "
                                   "[0, high)); it defaults to an Embedding's num_embeddings")
        out["high"] = high
    elif "high" in spec:
        raise InvalidModelSpec("input.high is only for int64 inputs")
    return out


@register_model
class SequentialFamily(ModelFamily):
    """Layers from the allow-list, in order; registered through ``PUT /models/{id}`` only."""

    name = "sequential"
    standalone = False  # no default config: not addressable as a zoo model by its name
    default_config: ClassVar[dict[str, Any]] = {
        "layers": [], "input": {}, "default_loss": "cross_entropy", "losses": None,
    }

    def config(self, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
        """Check the spec's structure and every layer's arguments; answer it normalised."""
        spec = super().config(overrides)
        layers = spec["layers"]
        if not isinstance(layers, list) or not layers:
            raise InvalidModelSpec("'layers' must be a non-empty list of {type, args, kwargs}")
        normal = []
        for i, layer in enumerate(layers):
            bind_layer(i, layer)
            normal.append({"type": layer["type"], "args": list(layer.get("args", [])),
                           "kwargs": dict(layer.get("kwargs", {}))})
        default_loss = spec["default_loss"]
        losses = spec["losses"] if spec["losses"] is not None else [default_loss]
        if not isinstance(default_loss, str) or not isinstance(losses, list) or not all(
            isinstance(x, str) for x in losses
        ):
            raise InvalidModelSpec("'default_loss' must be a loss name and 'losses' a list of "
                                   "loss names")
        if default_loss not in losses:
            losses = [default_loss, *losses]
        return {"layers": normal, "input": _input(spec["input"], normal),
                "default_loss": default_loss, "losses": losses}

    def build(self, config: dict[str, Any]) -> nn.Module:
        return nn.Sequential(OrderedDict(
            (str(i), build_layer(i, layer)) for i, layer in enumerate(config["layers"])
        ))

    def input_spec(self, config: dict[str, Any]) -> TensorSpec:
        spec = config["input"]
        return TensorSpec(tuple(spec["shape"]), spec["dtype"], spec.get("high"))

    def loss_info(self, config: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
        return config["default_loss"], tuple(config["losses"])


def trace(config: dict[str, Any], module: nn.Module, max_activations: int | None = None
          ) -> tuple[tuple[int, ...], int]:
    """Run ``module`` built on the meta device layer by layer: output shape, activation count.

    Nothing is allocated, so a spec whose activations would exhaust memory is measured, not run
    (and refused at the first layer past ``max_activations``); a shape error names its layer.
    """
    spec = config["input"]
    x = torch.zeros((1, *spec["shape"]), device="meta",
                    dtype=torch.int64 if spec["dtype"] == "int64" else torch.float32)
    numel = 0
    module.eval()
    for (name, layer), entry in zip(module.named_children(), config["layers"], strict=True):
        steps = x.shape[1] if x.dim() > 2 else 1
        if isinstance(layer, nn.RNNBase) and steps > MAX_RECURRENT_STEPS:
            raise _refuse(int(name), entry["type"], f"{steps} steps; recurrent layers take at "
                          f"most {MAX_RECURRENT_STEPS} (they are unrolled step by step)")
        if isinstance(layer, nn.TransformerEncoderLayer):  # the attention matrix, per head
            numel += layer.self_attn.num_heads * steps * steps
        try:
            x = layer(x)
        except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as exc:
            raise _refuse(int(name), entry["type"], f"fails on its input of shape "
                          f"{list(x.shape)} (batch first): {exc}") from exc
        numel += x.numel()
        if max_activations is not None and numel > max_activations:
            raise TooLarge(f"one sample makes more than {max_activations} activation elements "
                           f"by layer {name} ({entry['type']}); the limit is {max_activations}: "
                           f"raise PSGRAD_MAX_MODEL_ACTIVATIONS (now {max_activations})",
                           limit=max_activations, layer=int(name))
    return tuple(x.shape[1:]), numel
