"""The client's arrays: numpy from whatever the caller holds, in the dtypes the server computes in.

torch is never imported here unless the caller asks for tensors back: a tensor can only be
passed in if torch is already imported, and ``sys.modules`` tells.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from psgrad._errors import BadRequest

__all__ = [
    "WIRE_FLOAT",
    "param_arrays",
    "request_array",
    "state_dict_bytes",
    "to_numpy",
    "to_torch",
    "weights_from_bytes",
]

# Every model the server holds computes in float32 (``GET /models/{id}`` lists each parameter's
# dtype), and the server reads JSON lists as float32 too.
WIRE_FLOAT = np.dtype(np.float32)


def to_numpy(value: Any, name: str) -> np.ndarray:
    """A numpy array from numpy, a torch tensor (torch is never imported here) or nested lists.

    Lists carry no dtype: their floats become float32, the models' own dtype (as the server does
    for JSON lists); numpy arrays and tensors keep theirs.
    """
    if isinstance(value, np.ndarray):
        return value
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
    if arr.dtype.kind not in "biuf":
        raise BadRequest(f"'{name}' must hold numbers or booleans; got {arr.dtype}")
    if arr.dtype == np.float64 and not isinstance(value, np.generic):
        arr = arr.astype(np.float32)
    return arr


def request_array(value: Any, name: str) -> np.ndarray:
    """An array of a gradients request: floating arrays in the models' float32, the rest as is.

    The server refuses a floating array wider than the model computes in (float64 inputs would
    otherwise be a ``DtypeMismatch``), so the SDK casts every floating dtype (float64, float16,
    bfloat16 tensors, ...) to float32, as the server does with JSON lists. Integer and boolean
    arrays are sent unchanged: class targets and token ids stay integers, and the server
    converts integers to the model's float where it expects floats.
    """
    arr = to_numpy(value, name)
    return arr.astype(WIRE_FLOAT) if arr.dtype.kind == "f" and arr.dtype != WIRE_FLOAT else arr


def param_arrays(
    value: Mapping[str, Any] | None,
    name: str,
    convert: Callable[[Any, str], np.ndarray] = request_array,
) -> dict[str, np.ndarray] | None:
    """{parameter: array} (``weights``, ``reference``), or None.

    Weights registered with a model keep their dtypes (``convert=to_numpy``): the server checks
    them against the architecture's own.
    """
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise BadRequest(f"'{name}' must map parameter names to arrays")
    return {str(k): convert(v, f"{name}.{k}") for k, v in value.items()}


def to_torch(value: Any) -> Any:
    """numpy -> torch, recursively through dicts; imports torch only when asked for."""
    import torch

    if isinstance(value, Mapping):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value


def weights_from_bytes(body: bytes) -> dict[str, np.ndarray]:
    """A safetensors weights file as {name: array} (never a pickle)."""
    from safetensors.numpy import load

    try:
        return dict(load(body))
    except Exception as exc:  # SafetensorError and friends: the answer is corrupt
        raise BadRequest(f"the weights are not a valid safetensors file: {exc}") from exc


def state_dict_bytes(state_dict: Mapping[str, Any]) -> bytes:
    """A state dict (numpy arrays or torch tensors) as a safetensors file."""
    from safetensors.numpy import save

    arrays = {
        str(k): np.asarray(to_numpy(v, f"state_dict.{k}"), order="C")  # 0-d stays 0-d
        for k, v in state_dict.items()
    }
    return bytes(save(arrays))
