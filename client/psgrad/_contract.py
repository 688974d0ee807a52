"""The request contract, declared once: every field of a gradients request and every output.

``POST /per-sample-grads`` and ``POST /jobs`` take one body. Each field is declared once, as a
key of :class:`Options` (or, for ``model``, ``inputs`` and ``targets``, of :class:`Request`)
whose annotation carries its type as the client takes it and its :class:`Field` (kind, range
or allowed values, default, meaning); :data:`REQUEST` is read from those annotations. The
outputs are :data:`OUTPUTS` (shape, and how the answers of a batch split into several requests
combine). Everything else reads these two tables, so a field exists everywhere or nowhere:

- the checks of each field's value (:meth:`Field.check`: the server's door and the client),
- the OpenAPI schema (``service.api.schemas`` builds ``GradsRequest`` and ``GradsResponse``
  from them, descriptions included) and the stores' bodies where they share fields,
- the server's output registry (``service.outputs`` takes each output's meaning from here),
- the chunk merger (:mod:`psgrad._merge`: which fields are sliced per sample, how each output
  combines),
- the client (:mod:`psgrad._request` checks a request with them; the keyword options of
  ``per_sample_grads``, ``td0`` and ``submit`` are typed by :class:`Options` itself).

Nothing here imports torch or the server. tests/unit/test_contract.py fails when a field exists
on one side only.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal, TypedDict, cast, get_type_hints

from psgrad._errors import BadRequest, InvalidInput

__all__ = ["OUTPUTS", "REQUEST", "Field", "Options", "Output", "Request", "answer_fields", "field",
           "model_of", "output", "spec"]

# Kinds of field: how a value travels (JSON or safetensors) and how it is checked.
Kind = Literal[
    "ref",  # a string matching ``pattern`` (a model id or id@version, a run or set id)
    "inputs",  # a tensor, or {input name: tensor} for a model with several inputs
    "tensor",  # a tensor: nested lists, {dtype, shape, data} in JSON, a tensor in safetensors
    "tensors",  # {parameter name: tensor}; ``field/param`` tensors in safetensors
    "choice",  # one string of ``choices`` (or of a server registry: ``registry``)
    "names",  # a non-empty list of strings (``choices`` when given); a single name for outputs
    "int",
    "float",
]
Combine = Literal["concat", "mean", "variance", "clipped_sum", "cosine", "gns"]

ID_PATTERN = r"[a-z0-9][a-z0-9._-]{0,63}"  # model ids, reference set and store ids
VERSION_PATTERN = r"[0-9a-f]{16}"
REF_PATTERN = rf"{ID_PATTERN}(@{VERSION_PATTERN})?"  # id, or id@version
RUN_ID_PATTERN = r"dp-[0-9a-f]{24}"
PROJECTION_KINDS = ("tensorsketch", "kronecker")  # the first is the default
MAX_PROJECTION_DIM = 8192
ANSWER_DTYPES = ("float32", "float16", "bfloat16")  # what a request's answer_dtype may ask
AUTOCASTS = ("off", "bfloat16")  # what a request's autocast may ask; the first is the default
MAX_VERIFY = 64  # the most samples a request's verify may recompute with the per-sample loop
MAX_SEED = 2**63  # seeds are in [0, 2**63)


@dataclass(frozen=True)
class Field:
    """One request field. ``default`` is what an absent (or null) field means; the bounds and
    ``choices`` are what the server accepts (``registry``: the server's registry of that name
    holds the choices, e.g. its losses)."""

    name: str
    kind: Kind
    doc: str
    default: Any = None
    required: bool = False
    per_sample: bool = False  # first dimension B: a batch split into requests slices it
    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    registry: str | None = None
    pattern: str | None = None
    blank: bool = False  # '' means the default too

    def integer(self, value: Any) -> int | None:
        """``value`` as an integer in this field's range, None when unset; else 400 for what is
        no integer, 422 for one outside the range (numpy integers count, and whole numbers such
        as ``3.0`` as JSON Schema's integers do, however large: a JSON integer past 64 bits,
        which orjson reads as a float, is refused as the integer it was; booleans do not)."""
        if value is None:
            return None
        value = whole(value)
        wrong = BadRequest if isinstance(value, bool) or not isinstance(
            value, numbers.Integral) else InvalidInput if not self._within(int(value)) else None
        if wrong is not None:
            raise wrong(f"'{self.name}' must be an integer {self.bounds()}; got {shown(value)}")
        return int(value)

    def check(self, value: Any) -> Any:
        """``value`` as sent, held to this field's kind and range (tensors are the server's to
        read): the server's typed error for the wrong type (400), for a number out of range
        (NaN and the infinities are out of every range) or a string not among ``choices``
        (422)."""
        kind, name = self.kind, self.name
        if value is None:  # unset (whether a body must set it is the body's to say)
            return value
        if kind == "int":
            return self.integer(value)
        if kind == "float":
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise BadRequest(f"'{name}' must be a finite number; got {shown(value)}")
            try:
                number = float(value)
            except OverflowError:  # only an integer past float's range, as JSON may write one
                number = math.inf if cast(int, value) > 0 else -math.inf
            if not math.isfinite(number) or not self._within(number):
                what = "" if math.isfinite(number) else "a finite number "
                raise InvalidInput(f"'{name}' must be {what}{self.bounds()}; got {shown(value)}")
            return value
        if kind == "names":
            one = isinstance(value, str) and self.choices is not None  # an output, alone
            if not one and (not isinstance(value, list) or not all(isinstance(v, str)
                                                                    for v in value)
                            or (not value and self.choices is None)):
                what = ("one name or a list of names" if self.choices else
                        "a non-empty list of names")
                raise BadRequest(f"'{name}' must be {what}; got {shown(value)}")
            return value
        if kind in ("choice", "ref"):
            if not isinstance(value, str):
                raise BadRequest(f"'{name}' must be a string; got {shown(value)}")
            if self.choices is not None and value not in self.choices and not (
                    self.blank and not value):
                raise InvalidInput(f"'{name}' must be one of {', '.join(self.choices)}; got "
                                   f"{shown(value)}", accepted=list(self.choices))
        return value

    def _within(self, number: float) -> bool:
        return not ((self.gt is not None and not number > self.gt)
                    or (self.ge is not None and not number >= self.ge)
                    or (self.lt is not None and not number < self.lt)
                    or (self.le is not None and not number <= self.le))

    def bounds(self) -> str:
        """The range as the messages tell it: ``in [0, 2**63)``, ``in [1, 8192]``, ``> 0``,
        ``>= 1``."""
        if self.gt is not None:
            return f"> {self.gt:g}"
        lo = "" if self.ge is None else f"in [{self.ge:g}, "
        if self.lt is not None:
            return f"{lo}{'2**63' if self.lt == MAX_SEED else f'{self.lt:g}'})"
        return f"{lo}{self.le:g}]" if self.le is not None else f">= {self.ge:g}"


def whole(value: Any) -> Any:
    """``value``, or its integer where it is a whole float: JSON Schema's integers include
    ``3.0``, and orjson reads a JSON integer past 64 bits as the nearest (whole) float."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def shown(value: Any) -> str:
    """What was sent, for a message: its repr, cut to 80 characters."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."


def spec(kind: Kind, doc: str, **how: Any) -> Field:
    """A field's declaration in :class:`Options`' annotations (its name is the key's)."""
    return Field("", kind, doc, **how)


@dataclass(frozen=True)
class Output:
    """One output: its shape, and how the answers of a split batch combine into it
    (``concat``: in sample order; ``mean``: n-weighted; ``variance``: Chan's formula;
    ``clipped_sum``: the noiseless clipped sums added, the noise drawn once; ``cosine``: a second
    pass of ``dot`` with the combined mean; ``gns``: from the chunks' squared norms and means).
    ``also`` names the answer fields that come with the output, beside its own."""

    name: str
    doc: str
    combine: Combine
    per_sample: bool  # one value (or row) per sample
    per_param: bool = False  # a dict keyed by parameter name
    per_param_tensor: bool = False  # ... whose values have the parameter's shape
    td0_only: bool = False
    also: tuple[str, ...] = ()  # answer fields that come with it (its estimates), shaped as it


OUTPUTS: tuple[Output, ...] = (
    Output("grads", "{param: [B, *shape]} per-sample gradient of the per-sample loss", "concat",
           True, per_param=True, per_param_tensor=True),
    Output("losses", "[B] per-sample loss", "concat", True),
    Output("norms", "[B] L2 norm of each sample's whole gradient (selected parameters)",
           "concat", True),
    Output("layer_norms", "{param: [B]} L2 norm per sample per parameter", "concat", True,
           per_param=True),
    Output("mean", "{param: shape} mean of the per-sample gradients", "mean", False,
           per_param=True, per_param_tensor=True),
    Output("variance", "{param: shape} per-element population variance across samples",
           "variance", False, per_param=True, per_param_tensor=True),
    Output("clipped_mean", "{param: shape} DP-SGD clipped, noised mean (clip_norm, "
           "noise_multiplier, seed)", "clipped_sum", False, per_param=True,
           per_param_tensor=True),
    Output("dot", "[B] per-sample dot product with `reference`", "concat", True),
    Output("cosine_mean", "[B] cosine of each sample's gradient with the batch mean gradient",
           "cosine", True),
    Output("td_errors", "[B] td0 only: delta_i", "concat", True, td0_only=True),
    Output("updates", "{param: [B, *shape]} td0 only: delta_i * grad V(s_i)", "concat", True,
           per_param=True, per_param_tensor=True, td0_only=True),
    Output("projection", "[B, k] each sample's gradient sketch (projection_dim k, "
           "projection_seed): comparable across requests of the same architecture", "concat",
           True),
    Output("dots", "[B, M] dot products with M references: `reference` {param: [M, *shape]} "
           "(exact) or `reference_sketches` [M, k] (projected)", "concat", True),
    Output("influence", "[B, M] dot products with the M samples of `reference_set`", "concat",
           True),
    Output("self_influence", "[B] squared gradient norm (TracIn's self-influence); of the sketch "
           "when projection_dim is given", "concat", True),
    Output("gns", "a number: the simple gradient noise scale tr(Sigma) / |G|^2 over the selected "
           "parameters, with its two unbiased estimates gns_trace = sum_i |g_i - mean|^2 / (B - 1) "
           "and gns_grad_sq = |mean|^2 - gns_trace / B (0 where gns_grad_sq is 0; B >= 2)", "gns",
           False, also=("gns_trace", "gns_grad_sq")),
    Output("layer_gns", "{param: number} gns of each parameter alone, with layer_gns_trace and "
           "layer_gns_grad_sq (B >= 2)", "gns", False, per_param=True,
           also=("layer_gns_trace", "layer_gns_grad_sq")),
    Output("kfac_inputs", "{weight: [in, in]} K-FAC's factors of each linear layer among the "
           "selected parameters, by its weight's name (the bias as a last input of ones where "
           "it is selected too): the mean over samples of sum_t a_t a_t^T over the layer's "
           "inputs, with kfac_grads {weight: [out, out]}, the mean of sum_t g_t g_t^T over the "
           "loss's gradients by its outputs, and kfac_tokens {weight: number}, the mean tokens "
           "per sample (K-FAC's A is kfac_inputs / kfac_tokens, its S kfac_grads)", "mean",
           False, per_param=True, also=("kfac_grads", "kfac_tokens")),
)
OUTPUT_NAMES = tuple(o.name for o in OUTPUTS)
# every output's field in an answer and the fields that come with it, in that order
ANSWER_NAMES = tuple(name for o in OUTPUTS for name in (o.name, *o.also))
TENSOR_DOC = "a tensor: nested lists of numbers, or {dtype, shape, data} with base64 data"

class Options(TypedDict, total=False):
    """The keyword options of ``per_sample_grads``, ``td0`` and ``submit``, and the one place a
    request field is declared: its type as the client takes it (arrays as numpy arrays, torch
    tensors or nested lists; unset means the default) and, in its :class:`Field`, how it travels
    and what the server accepts. :data:`REQUEST` is read from here."""

    loss: Annotated[str | None, spec(
        "choice",
        "the loss; default (absent, null or ''): the model's default loss",
        registry="losses", blank=True)]
    outputs: Annotated[Sequence[str] | str, spec(
        "names",
        "what to return, a list or one name (default, also for []: ['grads']): "
        f"{', '.join(OUTPUT_NAMES)}",
        default=["grads"], choices=OUTPUT_NAMES)]
    params: Annotated[Sequence[str] | None, spec(
        "names",
        "restrict every output to these parameters (names as in GET /models/{id}); default: every "
        "parameter")]
    weights: Annotated[Mapping[str, Any] | None, spec(
        "tensors",
        "{param: tensor}: parameter values to use for this call only")]
    mask: Annotated[Any, spec(
        "tensor",
        "token losses: 1 for the positions that count, 0 for padding, [B, T] (the shape of "
        "targets)",
        per_sample=True)]
    clip_norm: Annotated[float | None, spec(
        "float",
        "clipped_mean: per-sample clipping norm (> 0)",
        gt=0.0)]
    noise_multiplier: Annotated[float | None, spec(
        "float",
        "clipped_mean: Gaussian noise std as a multiple of clip_norm (>= 0)",
        default=0.0, ge=0.0)]
    seed: Annotated[int | None, spec(
        "int",
        "clipped_mean: noise seed (echoed in meta); default: drawn",
        ge=0, lt=MAX_SEED)]
    dp_run: Annotated[str | None, spec(
        "ref",
        "a DP run id (POST /dp-runs): this request is one DP-SGD step. outputs must be "
        "['clipped_mean']; the run's clip_norm and noise_multiplier are used, the noise N(0, "
        "(noise_multiplier * clip_norm)^2) is drawn from the server's CSPRNG (no seed), the noisy "
        "sum is divided by the run's expected batch size, and the step is counted (409 "
        "privacy_budget_exhausted when the run has no step left)",
        pattern=RUN_ID_PATTERN)]
    reference: Annotated[Mapping[str, Any] | None, spec(
        "tensors",
        "{param: tensor} for the output dot: one tensor per selected parameter, of its shape; for "
        "dots: {param: [M, *shape]}, M references")]
    next_inputs: Annotated[Any, spec(
        "tensor",
        "td0: next states s', first dimension B",
        per_sample=True)]
    rewards: Annotated[Any, spec(
        "tensor",
        "td0: rewards r, shape [B]",
        per_sample=True)]
    dones: Annotated[Any, spec(
        "tensor",
        "td0: 1 where the episode ended, shape [B] (default: all 0)",
        per_sample=True)]
    gamma: Annotated[float | None, spec(
        "float",
        "td0: discount in [0, 1] (default 1.0)",
        default=1.0, ge=0.0, le=1.0)]
    projection_dim: Annotated[int | None, spec(
        "int",
        "projection (and a projected self_influence): k",
        ge=1, le=MAX_PROJECTION_DIM)]
    projection_seed: Annotated[int | None, spec(
        "int",
        "the projection's seed (0)",
        default=0, ge=0, lt=MAX_SEED)]
    projection_kind: Annotated[str | None, spec(
        "choice",
        "the sketch: 'tensorsketch' (default; within 2x a dense Gaussian projection's error) or "
        "'kronecker' (P_out (x) P_in, for sketches made with it)",
        default=PROJECTION_KINDS[0], choices=PROJECTION_KINDS)]
    reference_sketches: Annotated[Any, spec(
        "tensor",
        "dots: [M, k] sketches made with the same projection")]
    reference_set: Annotated[str | None, spec(
        "ref",
        "influence: a PUT /reference-sets id",
        pattern=ID_PATTERN)]
    answer_dtype: Annotated[str | None, spec(
        "choice",
        "the answer's floating tensors: float32 (default: a float64 or float16 model answers "
        "in its own dtype, a bfloat16 model in float32), or float16 / bfloat16 for half the "
        "bytes (relative rounding error at most 2^-11 / 2^-8; float16 overflows past 65504 and "
        "loses precision below 6.1e-5)",
        default=ANSWER_DTYPES[0], choices=ANSWER_DTYPES)]
    autocast: Annotated[str | None, spec(
        "choice",
        "'bfloat16': the model's forward and backward run under torch.autocast in bfloat16, as a "
        "mixed-precision training step does (a float32 model only); the statistics are then formed"
        " in float32 from its bfloat16 activations and output gradients: a few 1e-3 from the "
        "float32 answer on GPT-2, BERT and ResNet-18, and more on small layers (up to tens of "
        "percent, autocast's own error). 'off' (default): float32 throughout",
        default=AUTOCASTS[0], choices=AUTOCASTS)]
    verify: Annotated[int | None, spec(
        "int",
        "recompute this many samples (all, if the batch has fewer) one at a time with the per-"
        "sample loop and compare every output that can be compared; the report is meta.verify, and"
        " a difference beyond the tolerance fails the request with 500 verification_failed instead"
        " of answering. 0 or absent: the server's PSGRAD_VERIFY_FRACTION decides",
        default=0, ge=0, le=MAX_VERIFY)]
    verify_seed: Annotated[int | None, spec(
        "int",
        "picks the verified samples (default: the job id)",
        ge=0, lt=MAX_SEED)]


class _Positional(TypedDict):
    """The client methods' positional arguments, first in every request."""

    model: Annotated[str, spec(
        "ref",
        "a model id (see GET /models), or 'id@version'",
        required=True, pattern=REF_PATTERN)]
    inputs: Annotated[Any, spec(
        "inputs",
        f"the batch, first dimension B; {TENSOR_DOC}; for a model with several inputs "
        "(GET /models/{id} lists them), an object {input name: tensor}",
        required=True, per_sample=True)]
    targets: Annotated[Any, spec(
        "tensor",
        "labels (class indices) or regression targets, first dimension B",
        per_sample=True)]


class Request(_Positional, Options):
    """A whole request body: the positional fields, then the options."""


def _declared(cls: type) -> tuple[Field, ...]:
    """Each key of ``cls`` with the :class:`Field` its annotation carries, named by the key."""
    hints = get_type_hints(cls, include_extras=True)
    return tuple(replace(next(m for m in hints[k].__metadata__ if isinstance(m, Field)), name=k)
                 for k in hints)


REQUEST: tuple[Field, ...] = _declared(Request)
FIELDS: dict[str, Field] = {f.name: f for f in REQUEST}
KNOWN = frozenset(FIELDS)
SAMPLE_FIELDS = tuple(f.name for f in REQUEST if f.per_sample)
TENSOR_FIELDS = tuple(f.name for f in REQUEST if f.kind in ("inputs", "tensor"))
TENSOR_DICT_FIELDS = tuple(f.name for f in REQUEST if f.kind == "tensors")
POSITIONAL = ("model", "inputs", "targets")  # the client methods' positional arguments


def field(name: str) -> Field:
    return FIELDS[name]


def model_of(body: Mapping[str, Any]) -> str:
    """A body's ``model``, which every body that names one must name: else 400."""
    model = body.get("model")
    if model is None or model == "":
        raise BadRequest(f"'model' is required: {FIELDS['model'].doc}")
    if not isinstance(model, str):
        raise BadRequest(f"'model' must be {FIELDS['model'].doc} (a string); got {shown(model)}")
    return model


def output(name: str) -> Output:
    return _OUTPUTS[name]


def answer_fields(outputs: Sequence[str]) -> list[str]:
    """The fields an answer to ``outputs`` has: each output's, then those that come with it."""
    return [name for o in outputs for name in (o, *_OUTPUTS[o].also)]


_OUTPUTS = {o.name: o for o in OUTPUTS}
