"""The client's arrays: numpy from whatever the caller holds, in the dtypes the server computes in.

torch is never imported here unless the caller asks for tensors back: a tensor can only be
passed in if torch is already imported, and ``sys.modules`` tells.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from psgrad._errors import BadRequest
from psgrad._types import ModelInfo
from psgrad._wire import bfloat16_values, widened_load

__all__ = [
    "cast_floats",
    "float_dtype",
    "needs_model_dtype",
    "param_arrays",
    "state_dict_bytes",
    "to_numpy",
    "to_torch",
    "weights_from_bytes",
]

Fields = dict[str, Any]  # a request's or an answer's fields (psgrad._merge's too)
_SENT_AS_IS = np.dtype(np.float32)  # the models' usual dtype: sending it needs no question


def to_numpy(value: Any, name: str) -> np.ndarray:
    """A numpy array from numpy, a torch tensor (torch is never imported here) or nested lists.

    Lists carry no dtype: their floats become float32, the models' own dtype (as the server does
    for JSON lists); numpy arrays and tensors keep theirs.
    """
    if isinstance(value, np.ndarray):
        return numbers(value, name)
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return np.asarray(tensor.numpy())
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"'{name}' is not a rectangular array of numbers: {exc}") from exc
    numbers(arr, name)
    if arr.dtype == np.float64 and not isinstance(value, np.generic):
        arr = arr.astype(np.float32)
    return arr


def numbers(arr: np.ndarray, name: str) -> np.ndarray:
    """``arr``, where it holds numbers or booleans; else a 400 naming it (strings, objects,
    complex numbers: no request field holds them)."""
    if arr.dtype.kind not in "biuf":
        raise BadRequest(f"'{name}' must hold numbers or booleans; got {arr.dtype}")
    return arr


BFLOAT16_MODEL = "bfloat16"  # numpy has no such dtype: its values travel as float32


def float_dtype(info: ModelInfo) -> np.dtype | str | None:
    """The dtype the model of ``info`` computes in (its first parameter's, as the server takes
    it): a numpy dtype, :data:`BFLOAT16_MODEL`, or None where the document names no float."""
    for spec in info.parameters.values():
        name = str(spec.get("dtype", "")) if isinstance(spec, Mapping) else ""
        if name == BFLOAT16_MODEL:
            return BFLOAT16_MODEL
        return np.dtype(name) if name in ("float16", "float32", "float64") else None
    return None


def _arrays(fields: Fields) -> Iterator[tuple[str, str | None, np.ndarray]]:
    for key, value in fields.items():
        if isinstance(value, np.ndarray):
            yield key, None, value
        elif isinstance(value, Mapping):
            yield from ((key, p, a) for p, a in value.items() if isinstance(a, np.ndarray))


def needs_model_dtype(fields: Fields, *, float32: bool = False) -> bool:
    """Whether a floating array of the request is in a dtype other than float32 (any floating
    array, with ``float32``), so that the model's own dtype must be known before it is sent."""
    return any(a.dtype.kind == "f" and (float32 or a.dtype != _SENT_AS_IS)
               for _, _, a in _arrays(fields))


def cast_floats(fields: Fields, dtype: np.dtype | str | None) -> Fields:
    """``fields`` with every floating array cast to ``dtype`` (to :func:`bfloat16_values` for a
    bfloat16 model); integer and boolean arrays (class targets, token ids, dones) as they are.
    The server refuses a floating array wider than its model computes in, and converts a
    narrower one itself."""
    if dtype is None:
        return fields
    out = dict(fields)
    for key, param, arr in _arrays(fields):
        if arr.dtype.kind != "f" or arr.dtype == dtype:
            continue
        cast = bfloat16_values(arr) if dtype == BFLOAT16_MODEL else arr.astype(dtype)
        out[key] = cast if param is None else {**out[key], param: cast}
    return out


def param_arrays(value: Mapping[str, Any] | None, name: str) -> dict[str, np.ndarray] | None:
    """{parameter: array} (``weights``, ``reference``), or None."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise BadRequest(f"'{name}' must map parameter names to arrays")
    return {str(k): to_numpy(v, f"{name}.{k}") for k, v in value.items()}


def to_torch(value: Any) -> Any:
    """numpy -> torch, recursively through dicts; imports torch only when asked for."""
    import torch

    if isinstance(value, Mapping):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value


def weights_from_bytes(body: bytes, as_torch: bool = False) -> dict[str, Any]:
    """A safetensors weights file as {name: array}, or {name: tensor} with ``as_torch`` (never
    a pickle). numpy has no bfloat16: as arrays, bfloat16 weights are widened to float32
    (exactly); as tensors they stay bfloat16."""
    try:
        if as_torch:
            from safetensors.torch import load as load_tensors

            return dict(load_tensors(body))
        return widened_load(body)
    except Exception as exc:  # SafetensorError and friends: the answer is corrupt
        raise BadRequest(f"the weights are not a valid safetensors file: {exc}") from exc


def state_dict_bytes(state_dict: Mapping[str, Any]) -> bytes:
    """A state dict (numpy arrays or torch tensors) as a safetensors file; a bfloat16 tensor
    stays bfloat16 (safetensors' own BF16, which numpy cannot hold)."""
    if not isinstance(state_dict, Mapping):
        raise BadRequest(f"the weights are a mapping {{name: array}} (a file's: "
                         f"safetensors.numpy.load_file(path)); got {type(state_dict).__name__}")
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and any(isinstance(v, torch.Tensor) and v.dtype == torch.bfloat16
                                 for v in state_dict.values()):
        from safetensors.torch import save as save_tensors

        return bytes(save_tensors({
            str(k): (v.detach().cpu() if isinstance(v, torch.Tensor)
                     else torch.from_numpy(np.array(to_numpy(v, f"state_dict.{k}")))).contiguous()
            for k, v in state_dict.items()}))
    from safetensors.numpy import save

    arrays = {
        str(k): np.asarray(to_numpy(v, f"state_dict.{k}"), order="C")  # 0-d stays 0-d
        for k, v in state_dict.items()
    }
    return bytes(save(arrays))
