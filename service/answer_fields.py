"""A job's answer as the wire carries it: numpy arrays (views of the tensors where they can
be), floating ones in the request's ``answer_dtype``, in the documented order."""

from __future__ import annotations

from typing import Any

import torch

from psgrad._contract import answer_fields
from psgrad._wire import BFLOAT16
from service.validate import ParsedRequest

HALF = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # answer_dtypes of 2 bytes


def to_wire(value: Any, answer_dtype: str = "float32") -> Any:
    """Tensors as numpy arrays (views where they can be), floating ones in ``answer_dtype``."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to("cpu")
        half = HALF.get(answer_dtype)
        if half is None or not tensor.is_floating_point():
            if tensor.dtype == torch.bfloat16:  # a bfloat16 model's: numpy has none, so widened
                tensor = tensor.float()  # exactly
            return tensor.numpy()
        tensor = tensor.to(half)  # round to nearest even, as torch casts
        if half is torch.bfloat16:  # numpy has no bfloat16: its bits, named
            return tensor.view(torch.int16).numpy().view(BFLOAT16)
        return tensor.numpy()
    if isinstance(value, dict):
        return {k: to_wire(v, answer_dtype) for k, v in value.items()}
    return value


def result_fields(parsed: ParsedRequest, out: dict[str, Any]) -> dict[str, Any]:
    """The response fields of one job: JSON values and numpy arrays, in the documented order."""
    result: dict[str, Any] = {
        "model": parsed.model.ref,
        "batch_size": parsed.batch.size,
        "loss": parsed.opts.loss,
    }
    for name in answer_fields(parsed.opts.outputs):
        result[name] = to_wire(out[name], parsed.answer_dtype)
    # what the floating tensors are in: JSON numbers carry no dtype, and a reader casts them
    held = parsed.answer_dtype if parsed.answer_dtype in HALF else str(parsed.model.dtype)
    result["meta"] = {**out.get("meta", {}), "dtype": held.removeprefix("torch.")}
    return result
