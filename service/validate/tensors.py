"""The tensors of a request: inputs (one or several, named, with dynamic lengths), targets,
masks, per-sample vectors and per-parameter tensors, each checked against its model.

Part of validation (:mod:`service.validate`): every refusal is a typed error that says what to
change, so nothing reaches the engine that could fail inside ``vmap``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from models import TensorSpec
from psgrad._errors import (
    BadRequest,
    DtypeMismatch,
    EmptyBatch,
    InvalidInput,
    LossNotSupported,
    NonFinite,
    ShapeMismatch,
    TargetOutOfRange,
    UnknownParameter,
)
from service.registry import LoadedModel
from service.strategies.base import Batch


def check_names(names: Any, model: LoadedModel, field: str) -> None:
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


# torch dtypes numpy has too: a request's arrays are cast and checked there
_NUMPY_DTYPES = {torch.float16: np.float16, torch.float32: np.float32,
                 torch.float64: np.float64, torch.int64: np.int64}


def _to_tensor(arr: np.ndarray, dtype: torch.dtype, name: str) -> torch.Tensor:
    """A C-ordered copy of ``arr`` in ``dtype``, refused when a float in it is not finite after
    the cast (a float64 beyond float32's range becomes inf). Cast and checked in numpy where it
    has the dtype: on a request's small arrays torch's conversion and check took five times as
    long (a seventh of the worker thread's work in a DP-SGD step of a small MLP)."""
    np_dtype = _NUMPY_DTYPES.get(dtype)
    if np_dtype is None:  # bfloat16: numpy has no such dtype
        t = torch.tensor(np.asarray(arr, order="C")).to(dtype)
        finite = not t.is_floating_point() or bool(torch.isfinite(t).all())
    else:
        with np.errstate(over="ignore"):  # an overflow becomes inf, refused below
            copy = np.array(arr, dtype=np_dtype, order="C")
        finite = copy.dtype.kind != "f" or bool(np.isfinite(copy).all())
        t = torch.from_numpy(copy)
    if not finite:
        raise NonFinite(f"'{name}' contains NaN or infinity")
    return t


def sample_inputs(value: Any, model: LoadedModel, name: str,
            spec: TensorSpec | None = None) -> torch.Tensor:
    arr = _array(value, name)
    spec = spec or model.input
    if spec.dynamic:
        return _dynamic(arr, spec, model, name)
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
        return _to_tensor(arr, torch.int64, name)
    if arr.dtype.kind not in "iuf":
        raise DtypeMismatch(f"'{name}' has dtype {arr.dtype}; '{model.id}' takes {spec.dtype}")
    if arr.dtype.kind == "f" and model.dtype == torch.bfloat16:
        return _bfloat16_values(arr, model, name)
    if arr.dtype.kind == "f" and arr.dtype.itemsize > torch.finfo(model.dtype).bits // 8:
        raise DtypeMismatch(
            f"'{name}' has dtype {arr.dtype}; '{model.id}' computes in "
            f"{str(model.dtype).removeprefix('torch.')}: send that dtype (in JSON, as "
            "{dtype, shape, data}: nested lists are read as float32)",
        )
    return _to_tensor(arr, model.dtype, name)


def _bfloat16_values(arr: np.ndarray, model: LoadedModel, name: str) -> torch.Tensor:
    """A bfloat16 model's floating input: numpy and JSON have no bfloat16, so its values travel
    in another float (float32 holds every one; the client sends a bfloat16 tensor so, as
    answers come back), taken where each is a bfloat16 value and refused where one would
    round."""
    t = _to_tensor(arr, torch.bfloat16, name)
    if not np.array_equal(t.float().numpy(), arr):  # exact: numpy widens the narrower side
        raise DtypeMismatch(
            f"'{name}' holds {arr.dtype} values that bfloat16 cannot hold exactly; "
            f"'{model.id}' computes in bfloat16: round them first (torch: "
            "x.to(torch.bfloat16)) and send them as float32, which holds every bfloat16 value "
            "(the client does both for a bfloat16 tensor or a float64 array)",
        )
    return t


def batch_inputs(raw: Any, model: LoadedModel) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The first input and the others by name: ``inputs`` is one tensor, or an object of
    tensors named as the model's inputs (required when it takes several)."""
    specs = model.inputs or (model.input,)
    if isinstance(raw, dict):
        names = [s.name for s in specs]
        if set(raw) != set(names):
            raise InvalidInput(f"'inputs' names {', '.join(sorted(map(str, raw))) or 'nothing'}; "
                             f"'{model.id}' takes {', '.join(names)}", expected=names)
        arrays = [raw[n] for n in names]
    elif len(specs) > 1:
        raise InvalidInput(f"'{model.id}' takes several inputs: send 'inputs' as an object "
                         f"{{{', '.join(s.name for s in specs)}}} of tensors")
    else:
        arrays = [raw]
    first = arrays[0]
    if isinstance(first, np.ndarray) and first.ndim and first.shape[0] == 0:  # `[]`: shape [0]
        raise EmptyBatch("the batch is empty: send at least one sample")
    where = ["inputs"] if len(specs) == 1 else [f"inputs.{s.name}" for s in specs]
    tensors = [sample_inputs(a, model, w, s) for a, w, s in zip(arrays, where, specs, strict=True)]
    sizes: dict[str, tuple[str, int]] = {}
    for t, w, spec in zip(tensors, where, specs, strict=True):
        if t.shape[0] != tensors[0].shape[0]:
            raise ShapeMismatch(f"'{w}' has {t.shape[0]} samples, '{where[0]}' has "
                                f"{tensors[0].shape[0]}")
        for dim, _, _, symbol in spec.dynamic:
            seen = sizes.setdefault(symbol, (w, int(t.shape[dim + 1])))
            if seen[1] != t.shape[dim + 1]:
                raise ShapeMismatch(f"'{w}' and '{seen[0]}' must have the same size in the "
                                    f"dimension they share; got {t.shape[dim + 1]} and {seen[1]}")
    return tensors[0], {s.name: t for s, t in zip(specs[1:], tensors[1:], strict=True)}


def _dynamic(arr: np.ndarray, spec: TensorSpec, model: LoadedModel, name: str) -> torch.Tensor:
    """An input with dimensions sized by the request, each within its exported range."""
    free = {d: (lo, hi) for d, lo, hi, _ in spec.dynamic}
    shown = [f"{free[i][0]}..{free[i][1]}" if i in free else str(n)
             for i, n in enumerate(spec.shape)]
    ok = arr.ndim == len(spec.shape) + 1 and all(
        (free[i][0] <= n <= free[i][1]) if i in free else n == spec.shape[i]
        for i, n in enumerate(arr.shape[1:]))
    if not ok:
        raise ShapeMismatch(f"'{name}' has shape {list(arr.shape)}; '{model.id}' takes "
                            f"[B, {', '.join(shown)}]", got=list(arr.shape))
    return sample_inputs(arr, model, name, TensorSpec(tuple(arr.shape[1:]), spec.dtype, spec.high))


def token_targets(value: Any, model: LoadedModel, batch: Batch) -> torch.Tensor:
    """Token ids [B, T] for scores [T, V] per sample (T as the request's sequence length)."""
    arr = _array(value, "targets")
    if len(model.output_shape) != 2:
        raise LossNotSupported(f"the token losses need scores of shape [T, V] per sample; "
                               f"'{model.id}' gives {list(model.output_shape)}")
    length, vocab = _sequence_length(model, batch), model.output_shape[1]
    if arr.shape != (batch.size, length) or arr.dtype.kind not in "iu":
        raise ShapeMismatch(f"'targets' must be integer token ids of shape [{batch.size}, "
                            f"{length}]; got {arr.dtype} {list(arr.shape)}")
    if arr.size and (arr.min() < 0 or arr.max() >= vocab):
        raise TargetOutOfRange(f"'targets' must be token ids in [0, {vocab})", classes=vocab)
    return _to_tensor(arr, torch.int64, "targets")


def _sequence_length(model: LoadedModel, batch: Batch) -> int:
    """The output's T: the exported one, or the request's size of a dynamic input dimension
    that had that size when the program was exported."""
    length = model.output_shape[0]
    sent_inputs = (batch.inputs, *batch.named.values())  # in the model's order
    for spec, sent in zip(model.inputs or (model.input,), sent_inputs, strict=True):
        for dim, _, _, _ in spec.dynamic:
            if spec.shape[dim] == length:
                return int(sent.shape[dim + 1])
    return length


def mask_of(value: Any, batch: Batch, model: LoadedModel) -> torch.Tensor:
    arr = _array(value, "mask")
    want = tuple(batch.targets.shape) if batch.targets is not None else None
    wrong = arr[~np.isin(arr, (0, 1))] if arr.dtype.kind in "biuf" else arr.ravel()
    if want is None or arr.shape != want or wrong.size:
        got = (f"shape {list(arr.shape)}" if want is None or arr.shape != want else
               f"{wrong.size} other value{'s' if wrong.size > 1 else ''} (first: "
               f"{wrong.ravel()[0]!s})")
        raise InvalidInput(f"'mask' must hold 0 or 1 per target token, shape "
                           f"{list(want or ())}; got {got}")
    return _to_tensor(arr, model.dtype, "mask")


def targets_of(value: Any, model: LoadedModel, classification: bool, size: int) -> torch.Tensor:
    arr = _array(value, "targets")
    if arr.shape[:1] != (size,):
        raise ShapeMismatch(f"'targets' has {arr.shape[0]} entries for {size} samples: send "
                            "one target per sample" if arr.ndim else f"'targets' is one number for "
                            f"{size} samples: send a list, one target per sample")
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
        return _to_tensor(arr, torch.int64, "targets")
    want = (size, *model.output_shape)
    if math.prod(arr.shape) != math.prod(want) or (arr.ndim > 1 and tuple(arr.shape) != want):
        raise ShapeMismatch(f"'targets' has shape {list(arr.shape)}; '{model.id}' outputs "
                            f"{list(want)}")
    return _to_tensor(arr, model.dtype, "targets").reshape(want)


def vector(value: Any, name: str, size: int, dtype: torch.dtype) -> torch.Tensor:
    arr = _array(value, name)
    if arr.shape != (size,):
        raise ShapeMismatch(f"'{name}' must have shape [{size}] (one per sample); got "
                            f"{list(arr.shape)}")
    return _to_tensor(arr, dtype, name)


def tensor_of(value: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
    """A required tensor field as sent, in ``dtype``, refused when not finite."""
    return _to_tensor(_array(value, name), dtype, name)


def param_tensors(value: Any, model: LoadedModel, field: str, *, stacked: bool = False
                  ) -> dict[str, torch.Tensor]:
    """``{param: tensor}`` in the parameters' shapes (``stacked``: shapes are checked later)."""
    if not value:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(f"'{field}' must map parameter names to tensors")
    check_names(value, model, field)
    out = {}
    for name, arr in value.items():
        arr = _array(arr, f"{field}.{name}")
        want = tuple(model.params[name].shape)
        if tuple(arr.shape) != want and not stacked:
            raise ShapeMismatch(f"'{field}.{name}' has shape {list(arr.shape)}; the parameter "
                                f"has {list(want)}", parameter=name)
        out[name] = _to_tensor(arr, model.dtype, f"{field}.{name}")
    return out
