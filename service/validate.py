"""Turn a decoded request (JSON values and numpy arrays) into checked engine arguments.

Every refusal here is a typed error with a message that says what to change; nothing reaches the
engine that could fail inside ``vmap`` for a reason the client could have been told about.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from psgrad._errors import (
    BadRequest,
    DtypeMismatch,
    EmptyBatch,
    InvalidInput,
    LossNotSupported,
    NonFinite,
    ShapeMismatch,
    TargetOutOfRange,
    TooLarge,
    UnknownParameter,
)
from psgrad._wire import ANSWER_DTYPES, array_from_json
from service.dp.steps import bind
from service.engine import Batch, Options
from service.losses import get_loss
from service.outputs import get_output
from service.registry import LoadedModel, ModelRegistry

if TYPE_CHECKING:
    from service.dp.runs import RunStore

TENSOR_FIELDS = ("inputs", "targets", "next_inputs", "rewards", "dones")
TENSOR_DICT_FIELDS = ("weights", "reference")
SCALAR_FIELDS = ("model", "loss", "outputs", "params", "clip_norm", "noise_multiplier", "seed",
                 "gamma", "dp_run", "answer_dtype")
KNOWN_FIELDS = frozenset(TENSOR_FIELDS + TENSOR_DICT_FIELDS + SCALAR_FIELDS)


@dataclass
class ParsedRequest:
    model: LoadedModel
    opts: Options
    batch: Batch
    answer_dtype: str = "float32"  # the answer's floating tensors: float32, float16, bfloat16

    def group_key(self) -> tuple[Any, ...]:
        """Requests with equal keys can run as one engine call on the concatenated batch."""
        b = self.batch
        return (
            self.model.ref, self.opts,
            _digest(b.weights), _digest(b.reference),
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
        if fields.get(name) is not None:
            fields[name] = array_from_json(fields[name], name=name, max_elements=max_elements)
    for name in TENSOR_DICT_FIELDS:
        group = fields.get(name)
        if group is None:
            continue
        if not isinstance(group, dict):
            raise BadRequest(f"'{name}' must be an object mapping parameter names to tensors")
        fields[name] = {
            k: array_from_json(v, name=f"{name}.{k}", max_elements=max_elements)
            for k, v in group.items()
        }
    return fields


def parse_request(fields: dict[str, Any], registry: ModelRegistry, *,
                  max_batch_size: int | None = None,
                  dp_runs: RunStore | None = None) -> ParsedRequest:
    """Check a decoded request against its model and build the engine's arguments.

    ``dp_runs`` holds the DP runs a ``dp_run`` field may name (:mod:`service.dp`).
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
    model = registry.get(ref)
    opts = _options(fields, model, dp_runs)
    loss = get_loss(opts.loss)
    raw = fields.get("inputs")
    if isinstance(raw, np.ndarray) and raw.ndim and raw.shape[0] == 0:  # `[]` has shape [0]
        raise EmptyBatch("the batch is empty: send at least one sample")
    inputs = _inputs(raw, model, "inputs")
    size = int(inputs.shape[0])
    if max_batch_size is not None and size > max_batch_size:
        raise TooLarge(
            f"the batch has {size} samples; the limit is {max_batch_size}: split it into "
            "smaller batches (the SDK does this for you)", limit=max_batch_size, size=size,
        )
    batch = Batch(inputs=inputs)
    if "targets" in loss.needs:
        batch.targets = _targets(fields.get("targets"), model, loss.classification, size)
    if opts.loss == "td0":
        batch.next_inputs = _inputs(fields.get("next_inputs"), model, "next_inputs")
        if batch.next_inputs.shape[0] != size:
            raise ShapeMismatch(f"'next_inputs' has {batch.next_inputs.shape[0]} samples, "
                                f"'inputs' has {size}")
        batch.rewards = _vector(fields.get("rewards"), "rewards", size, model.dtype)
        dones = fields.get("dones")
        batch.dones = (torch.zeros(size, dtype=model.dtype) if dones is None
                       else _vector(dones, "dones", size, model.dtype))
        if not bool(((batch.dones == 0) | (batch.dones == 1)).all()):
            raise InvalidInput("'dones' must hold only 0 and 1 (or false and true)")
    batch.weights = _param_tensors(fields.get("weights"), model, "weights")
    batch.reference = _param_tensors(fields.get("reference"), model, "reference")
    if "dot" in opts.outputs:
        missing = [p for p in opts.params if p not in batch.reference]
        if missing:
            raise InvalidInput(
                f"output 'dot' needs 'reference' for every selected parameter; missing: "
                f"{', '.join(missing)}", missing=missing,
            )
    batch.reference = {k: v for k, v in batch.reference.items() if k in opts.params}
    return ParsedRequest(model, opts, batch, _answer_dtype(fields.get("answer_dtype")))


def _answer_dtype(value: Any) -> str:
    """The answer's floating dtype; the group key leaves it out (each job is cast alone)."""
    if value is None:
        return "float32"
    if value not in ANSWER_DTYPES:
        raise InvalidInput(f"'answer_dtype' must be one of {', '.join(ANSWER_DTYPES)}; "
                           f"got {value!r}", accepted=list(ANSWER_DTYPES))
    return str(value)


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
    outputs = fields.get("outputs") or ["grads"]
    if isinstance(outputs, str):
        outputs = [outputs]
    if not isinstance(outputs, list) or not all(isinstance(o, str) for o in outputs):
        raise BadRequest("'outputs' must be a list of output names")
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
        _check_names(params, model, "params")
        selected = tuple(p for p in model.params if p in set(params))
    gamma = _gamma(fields.get("gamma"))
    if fields.get("dp_run") is not None:  # the run sets clip, noise and divisor (service.dp)
        plain = Options(loss=loss_name, outputs=tuple(dict.fromkeys(outputs)), params=selected,
                        gamma=1.0 if gamma is None else gamma)
        return bind(fields, plain, model.id, dp_runs)
    clip_norm = _number(fields.get("clip_norm"), "clip_norm")
    noise = _number(fields.get("noise_multiplier"), "noise_multiplier") or 0.0
    if "clipped_mean" in outputs and (clip_norm is None or clip_norm <= 0):
        raise InvalidInput("output 'clipped_mean' needs 'clip_norm' > 0")
    if noise < 0:
        raise InvalidInput("'noise_multiplier' must be >= 0")
    seed = fields.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)
                             or not 0 <= seed < 2**63):
        raise BadRequest("'seed' must be an integer in [0, 2**63)")
    return Options(
        loss=loss_name, outputs=tuple(dict.fromkeys(outputs)), params=selected,
        clip_norm=clip_norm, noise_multiplier=noise, seed=seed,
        gamma=1.0 if gamma is None else gamma,
    )


def _gamma(value: Any) -> float | None:
    """td0's discount, in [0, 1]: beyond 1 the target r + gamma V(s') grows without bound and
    below 0 it flips the future's sign. NaN and the infinities are outside too, so they are the
    same 422 as -3 or 1e30 (not the 400 of the other options' non-finite numbers)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value <= 1:
        raise InvalidInput(f"'gamma' must be a discount in [0, 1]; got {value!r}")
    return _number(value, "gamma")


def _number(value: Any, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number")
    return float(value)


def _check_names(names: Any, model: LoadedModel, field: str) -> None:
    unknown = [n for n in names if n not in model.params]
    if unknown:
        raise UnknownParameter(
            f"unknown parameter(s) in '{field}': {', '.join(map(str, unknown))}; "
            f"'{model.id}' has: {', '.join(model.params)}",
            unknown=unknown, known=list(model.params),
        )


def _array(value: Any, name: str) -> np.ndarray:
    if value is None:
        raise BadRequest(f"'{name}' is required")
    if not isinstance(value, np.ndarray):
        raise BadRequest(f"'{name}' must be a tensor")
    return value


def _to_tensor(arr: np.ndarray, dtype: torch.dtype, name: str) -> torch.Tensor:
    t = torch.tensor(np.asarray(arr, order="C")).to(dtype)  # ascontiguousarray makes 0-d 1-d
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise NonFinite(f"'{name}' contains NaN or infinity")
    return t


def _inputs(value: Any, model: LoadedModel, name: str) -> torch.Tensor:
    arr = _array(value, name)
    spec = model.input
    if arr.ndim != len(spec.shape) + 1 or tuple(arr.shape[1:]) != spec.shape:
        raise ShapeMismatch(
            f"'{name}' has shape {list(arr.shape)}; '{model.id}' takes a batch of samples of "
            f"shape {list(spec.shape)}, i.e. [B, {', '.join(map(str, spec.shape))}]",
            expected=[None, *spec.shape], got=list(arr.shape),
        )
    if spec.dtype.startswith("int"):
        if arr.dtype.kind not in "iu":
            raise DtypeMismatch(
                f"'{name}' has dtype {arr.dtype}; '{model.id}' takes integer tokens ({spec.dtype})"
            )
        high = spec.high or 2**62
        if arr.size and (arr.min() < 0 or arr.max() >= high):
            raise InvalidInput(f"'{name}' holds token ids outside [0, {high})")
        return torch.tensor(arr.astype(np.int64))
    if arr.dtype.kind not in "iuf":
        raise DtypeMismatch(f"'{name}' has dtype {arr.dtype}; '{model.id}' takes {spec.dtype}")
    if arr.dtype.kind == "f" and arr.dtype.itemsize > torch.finfo(model.dtype).bits // 8:
        raise DtypeMismatch(
            f"'{name}' has dtype {arr.dtype}; '{model.id}' computes in "
            f"{str(model.dtype).removeprefix('torch.')}: send that dtype",
        )
    return _to_tensor(arr, model.dtype, name)


def _targets(value: Any, model: LoadedModel, classification: bool, size: int) -> torch.Tensor:
    arr = _array(value, "targets")
    if arr.shape[:1] != (size,):
        raise ShapeMismatch(f"'targets' has {arr.shape[0] if arr.ndim else 0} entries for "
                            f"{size} samples: send one target per sample")
    if classification:
        n_classes = model.output_shape[-1] if model.output_shape else 1
        if arr.ndim != 1:
            raise ShapeMismatch(f"'targets' must be class indices of shape [B]; got "
                                f"{list(arr.shape)}")
        if arr.dtype.kind == "f":
            if not np.all(np.isfinite(arr)) or not np.all(arr == np.round(arr)):
                raise DtypeMismatch("'targets' must be integer class indices")
        elif arr.dtype.kind not in "iub":
            raise DtypeMismatch("'targets' must be integer class indices")
        if arr.min() < 0 or arr.max() >= n_classes:
            raise TargetOutOfRange(
                f"'targets' must be class indices in [0, {n_classes}) for '{model.id}'; got "
                f"values from {int(arr.min())} to {int(arr.max())}", classes=n_classes,
            )
        return torch.tensor(arr.astype(np.int64))
    want = (size, *model.output_shape)
    if math.prod(arr.shape) != math.prod(want) or (arr.ndim > 1 and tuple(arr.shape) != want):
        raise ShapeMismatch(f"'targets' has shape {list(arr.shape)}; '{model.id}' outputs "
                            f"{list(want)}")
    return _to_tensor(arr, model.dtype, "targets").reshape(want)


def _vector(value: Any, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
    arr = _array(value, name)
    if arr.shape != (size,):
        raise ShapeMismatch(f"'{name}' must have shape [{size}] (one per sample); got "
                            f"{list(arr.shape)}")
    return _to_tensor(arr, dtype, name)


def _param_tensors(value: Any, model: LoadedModel, field: str) -> dict[str, torch.Tensor]:
    if not value:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"'{field}' must map parameter names to tensors")
    _check_names(value, model, field)
    out = {}
    for name, arr in value.items():
        arr = _array(arr, f"{field}.{name}")
        want = tuple(model.params[name].shape)
        if tuple(arr.shape) != want:
            raise ShapeMismatch(f"'{field}.{name}' has shape {list(arr.shape)}; the parameter "
                                f"has {list(want)}", parameter=name)
        out[name] = _to_tensor(arr, model.dtype, f"{field}.{name}")
    return out
