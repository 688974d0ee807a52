"""Turn a decoded request (JSON values and numpy arrays) into checked engine arguments.

Every refusal here is a typed error with a message that says what to change; nothing reaches the
engine that could fail inside ``vmap`` for a reason the client could have been told about.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from psgrad._contract import (
    ANSWER_DTYPES,
    AUTOCASTS,
    KNOWN,
    TENSOR_DICT_FIELDS,
    TENSOR_FIELDS,
    field,
)
from psgrad._errors import (
    BadRequest,
    InvalidInput,
    LossNotSupported,
    ShapeMismatch,
    TooLarge,
)
from psgrad._wire import array_from_json
from service.attribution import ReferenceSets, projection_of, references, refuse_unread
from service.config import raise_setting, with_setting
from service.dp.steps import bind
from service.engine import Batch, Options
from service.losses import get_loss
from service.outputs import get_output
from service.registry import LoadedModel, ModelRegistry
from service.request_tensors import (
    batch_inputs,
    check_names,
    mask_of,
    param_tensors,
    sample_inputs,
    targets_of,
    tensor_of,
    token_targets,
    vector,
)

if TYPE_CHECKING:
    from service.dp.runs import RunStore

# The fields, which of them are tensors, their ranges: the request contract (psgrad._contract)
KNOWN_FIELDS = KNOWN
VERIFY, VERIFY_SEED, SEED = field("verify"), field("verify_seed"), field("seed")
CLIP, NOISE, GAMMA = field("clip_norm"), field("noise_multiplier"), field("gamma")
MIN_CLIP, MIN_NOISE = float(CLIP.gt or 0), float(NOISE.ge or 0)  # clip_norm > 0, noise >= 0
GAMMA_LOW, GAMMA_HIGH = float(GAMMA.ge or 0), float(GAMMA.le or 1)


@dataclass
class ParsedRequest:
    model: LoadedModel
    opts: Options
    batch: Batch
    answer_dtype: str = "float32"  # the answer's floating tensors: float32, float16, bfloat16
    verify: int = 0  # samples the worker recomputes with the per-sample loop (service.verify)
    verify_seed: int | None = None  # picks them; None: the job id does

    def group_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can run as one engine call on the concatenated batch."""
        b = self.batch
        return (
            self.model.ref, self.opts,
            _digest(b.weights), _digest(b.reference), _digest(b.references),
            _digest({} if b.sketches is None else {"": b.sketches}),
            tuple((k, v.dtype, tuple(v.shape[1:])) for k, v in b.samples().items()),
        )


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def decode_json_body(body: Any, *, max_elements: int) -> dict[str, Any]:
    """Decode the tensor fields of a JSON request body into numpy arrays."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    fields = dict(body)
    for name in TENSOR_FIELDS:
        value = fields.get(name)
        # a model's named inputs: an object of tensors (a tensor's {dtype, shape, data} object is
        # told apart by its dtype, a string where named inputs hold tensors)
        if name == "inputs" and isinstance(value, dict) and not isinstance(value.get("dtype"), str):
            fields[name] = {k: _array(v, f"inputs.{k}", max_elements) for k, v in value.items()}
        elif value is not None:
            fields[name] = _array(value, name, max_elements)
    for name in TENSOR_DICT_FIELDS:
        group = fields.get(name)
        if group is None:
            continue
        if not isinstance(group, dict):
            raise BadRequest(f"'{name}' must be an object mapping parameter names to tensors")
        fields[name] = {
            k: _array(v, f"{name}.{k}", max_elements)
            for k, v in group.items()
        }
    return fields


def _array(value: Any, name: str, max_elements: int) -> Any:
    return with_setting("max_elements", max_elements, array_from_json, value, name=name,
                        max_elements=max_elements)


def parse_request(fields: dict[str, Any], registry: ModelRegistry, *,
                  max_batch_size: int | None = None,
                  max_activations: int | None = None,
                  dp_runs: RunStore | None = None,
                  reference_sets: ReferenceSets | None = None) -> ParsedRequest:
    """Check a decoded request against its model and build the engine's arguments.

    ``dp_runs`` holds the DP runs a ``dp_run`` field may name (:mod:`service.dp`),
    ``reference_sets`` the reference sets a ``reference_set`` field may name. A model with a
    request check (exported programs) is held, at the sizes sent, to ``max_activations``
    (``PSGRAD_MAX_MODEL_ACTIVATIONS``) and its indices to their tables, before it runs.
    """
    unknown = sorted(set(fields) - KNOWN_FIELDS)
    if unknown:
        raise BadRequest(
            f"unknown fields: {', '.join(unknown)}; known: {', '.join(sorted(KNOWN_FIELDS))}",
            unknown=unknown,
        )
    ref = fields.get("model")
    if not isinstance(ref, str) or not ref:
        raise BadRequest("'model' is required: a model id such as 'mlp' or 'id@version'")
    checks = _verify(fields)
    model = registry.get(ref)
    opts = _options(fields, model, dp_runs)
    loss = get_loss(opts.loss)
    inputs, named = batch_inputs(fields.get("inputs"), model)
    size = int(inputs.shape[0])
    if max_batch_size is not None and size > max_batch_size:
        raise TooLarge(
            f"the batch has {size} samples; the limit is {max_batch_size}: split it into "
            f"smaller batches (the SDK does this for you) or "
            f"{raise_setting('max_batch_size', max_batch_size)}", limit=max_batch_size, size=size,
        )
    if model.check is not None:
        numel = model.check([inputs, *named.values()], max_activations or 1 << 62)
        if numel != model.activation_numel:  # chunks are sized for what these sizes take
            model = replace(model, activation_numel=numel)
    batch = Batch(inputs=inputs, named=named)
    if "targets" in loss.needs:
        batch.targets = (token_targets(fields.get("targets"), model, batch) if loss.tokens
                         else targets_of(fields.get("targets"), model, loss.classification, size))
    if fields.get("mask") is not None:
        if "mask" not in loss.needs:
            raise InvalidInput(f"'mask' is read by the token losses only, not by '{opts.loss}'")
        batch.mask = mask_of(fields["mask"], batch, model)
    if opts.loss == "td0":
        if named:
            raise LossNotSupported("loss 'td0' takes models with one input")
        batch.next_inputs = sample_inputs(fields.get("next_inputs"), model, "next_inputs")
        if batch.next_inputs.shape[0] != size:
            raise ShapeMismatch(f"'next_inputs' has {batch.next_inputs.shape[0]} samples, "
                                f"'inputs' has {size}")
        batch.rewards = vector(fields.get("rewards"), "rewards", size, model.dtype)
        dones = fields.get("dones")
        batch.dones = (torch.zeros(size, dtype=model.dtype) if dones is None
                       else vector(dones, "dones", size, model.dtype))
        if not bool(((batch.dones == 0) | (batch.dones == 1)).all()):
            raise InvalidInput("'dones' must hold only 0 and 1 (or false and true)")
    batch.weights = param_tensors(fields.get("weights"), model, "weights")
    if opts.reference_count:  # dots or influence: M references per parameter, or M sketches
        reference = param_tensors(fields.get("reference"), model, "reference", stacked=True)
        raw = fields.get("reference_sketches")
        sketches = None if raw is None else tensor_of(raw, "reference_sketches", model.dtype)
        opts = references(model, opts, batch, reference, sketches, fields.get("reference_set"),
                          reference_sets)
        return ParsedRequest(model, opts, batch, verify=checks[0], verify_seed=checks[1])
    refuse_unread(fields)
    batch.reference = param_tensors(fields.get("reference"), model, "reference")
    if "dot" in opts.outputs:
        missing = [p for p in opts.params if p not in batch.reference]
        if missing:
            raise InvalidInput(
                f"output 'dot' needs 'reference' for every selected parameter; missing: "
                f"{', '.join(missing)}", missing=missing,
            )
    batch.reference = {k: v for k, v in batch.reference.items() if k in opts.params}
    return ParsedRequest(model, opts, batch, _answer_dtype(fields.get("answer_dtype")),
                         verify=checks[0], verify_seed=checks[1])


def _verify(fields: dict[str, Any]) -> tuple[int, int | None]:
    """``verify`` (0 to MAX_VERIFY samples; more than the batch has checks them all) and
    ``verify_seed``; the group key leaves them out (each job is verified alone)."""
    k = VERIFY.integer(fields.get("verify"), ": the samples recomputed with the per-sample "
                       "loop to check the answer")
    return k or 0, VERIFY_SEED.integer(fields.get("verify_seed"))


def _answer_dtype(value: Any) -> str:
    """The answer's floating dtype; the group key leaves it out (each job is cast alone)."""
    return _choice(value, "answer_dtype", ANSWER_DTYPES)


def _choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    """One of the contract's ``choices`` for field ``name`` (absent: the first, the default)."""
    if value is None:
        return choices[0]
    if value not in choices:
        raise InvalidInput(f"'{name}' must be one of {', '.join(choices)}; got {value!r}",
                           accepted=list(choices))
    return str(value)


def check_options(fields: dict[str, Any], model: LoadedModel) -> Options:
    """A request's options (loss, outputs, parameters, projection, ...) checked against
    ``model`` without a batch: a gradient store checks its definition with it."""
    return _options(fields, model)


def _options(fields: dict[str, Any], model: LoadedModel,
             dp_runs: RunStore | None = None) -> Options:
    loss_name = fields.get("loss") or model.default_loss
    if not isinstance(loss_name, str):
        raise BadRequest("'loss' must be a string")
    loss = get_loss(loss_name)
    if loss_name not in model.losses:
        raise LossNotSupported(
            f"model '{model.id}' does not accept loss '{loss_name}'; it accepts: "
            f"{', '.join(model.losses)}", accepted=list(model.losses),
        )
    if loss.scalar_output and math.prod(model.output_shape) != 1:
        raise LossNotSupported(f"loss '{loss_name}' needs a model with one output per sample; "
                               f"'{model.id}' gives shape {list(model.output_shape)}")
    outputs = asked_outputs(fields)
    for name in outputs:
        if get_output(name).td0_only and loss_name != "td0":
            raise InvalidInput(f"output '{name}' is only defined for loss 'td0'")
    params = fields.get("params")
    if params is None:
        selected = tuple(model.params)
    else:
        if not isinstance(params, list) or not params or not all(isinstance(p, str)
                                                                 for p in params):
            raise BadRequest("'params' must be a non-empty list of parameter names")
        check_names(params, model, "params")
        selected = tuple(p for p in model.params if p in set(params))
    gamma = _gamma(fields.get("gamma"))
    autocast = _autocast(fields.get("autocast"), model)
    if fields.get("dp_run") is not None:  # the run sets clip, noise and divisor (service.dp)
        plain = Options(loss=loss_name, outputs=tuple(dict.fromkeys(outputs)), params=selected,
                        gamma=1.0 if gamma is None else gamma, autocast=autocast)
        return bind(fields, plain, model.id, dp_runs)
    clip_norm = _number(fields.get("clip_norm"), "clip_norm")
    noise = _number(fields.get("noise_multiplier"), "noise_multiplier") or 0.0
    if "clipped_mean" in outputs and clip_norm is None:
        raise InvalidInput("output 'clipped_mean' needs 'clip_norm' > 0")
    if clip_norm is not None and clip_norm <= MIN_CLIP:  # refused with any outputs, as documented
        raise InvalidInput(f"'clip_norm' must be > 0 (output 'clipped_mean' needs it); got "
                           f"{clip_norm:g}")
    if noise < MIN_NOISE:
        raise InvalidInput("'noise_multiplier' must be >= 0")
    seed = SEED.integer(fields.get("seed"))
    return Options(
        loss=loss_name, outputs=tuple(dict.fromkeys(outputs)), params=selected,
        clip_norm=clip_norm, noise_multiplier=noise, seed=seed,
        gamma=1.0 if gamma is None else gamma, projection=projection_of(fields, outputs),
        reference_count=-1 if {"dots", "influence"} & set(outputs) else 0, autocast=autocast,
    )


def asked_outputs(fields: dict[str, Any]) -> list[str]:
    """The outputs a request asks for: a list, or one name; absent, null or [] means
    ``['grads']``."""
    outputs = fields.get("outputs") or ["grads"]
    if isinstance(outputs, str):
        outputs = [outputs]
    if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        raise BadRequest("'outputs' must be a list of output names")
    return outputs


def _autocast(value: Any, model: LoadedModel) -> str:
    """The precision of the model's forward and backward: 'off' (the model's dtype) or
    'bfloat16' (torch.autocast, a float32 model only)."""
    value = _choice(value, "autocast", AUTOCASTS)
    if value != AUTOCASTS[0] and model.dtype != torch.float32:
        raise InvalidInput(f"'autocast' needs a float32 model; '{model.id}' computes in "
                           f"{str(model.dtype).removeprefix('torch.')}: leave 'autocast' out")
    return value


def _gamma(value: Any) -> float | None:
    """td0's discount, in [0, 1]: beyond 1 the target r + gamma V(s') grows without bound and
    below 0 it flips the future's sign. NaN and the infinities are outside too, so they are the
    same 422 as -3 or 1e30 (not the 400 of the other options' non-finite numbers)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and \
            not GAMMA_LOW <= value <= GAMMA_HIGH:
        raise InvalidInput(f"'gamma' must be a discount in {GAMMA.bounds()}; got {value!r}")
    return _number(value, "gamma")


def _number(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number")
    return float(value)
