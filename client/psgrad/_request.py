"""The fields of a gradients request, checked before anything is sent.

What the client can see is wrong without asking the server (an empty ``outputs``, a seed out of
range, a NaN option) is refused here, with the server's own error classes; the arrays are made
numpy (:func:`psgrad._arrays.to_numpy`) and cast to the model's dtype later, by the client that
can ask the server for it (:func:`psgrad._arrays.cast_floats`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from psgrad._arrays import param_arrays, to_numpy
from psgrad._errors import BadRequest, InvalidInput
from psgrad._merge import Fields
from psgrad._types import OUTPUT_NAMES
from psgrad._wire import ANSWER_DTYPES, MAX_VERIFY

__all__ = ["grads_fields"]


def grads_fields(
    model: str,
    inputs: Any,
    targets: Any = None,
    *,
    loss: str | None = None,
    outputs: Sequence[str] | str = ("grads",),
    params: Sequence[str] | None = None,
    weights: Mapping[str, Any] | None = None,
    clip_norm: float | None = None,
    noise_multiplier: float | None = None,
    seed: int | None = None,
    reference: Mapping[str, Any] | None = None,
    next_inputs: Any = None,
    rewards: Any = None,
    dones: Any = None,
    gamma: float | None = None,
    projection_dim: int | None = None,
    projection_seed: int | None = None,
    projection_kind: str | None = None,
    reference_sketches: Any = None,
    reference_set: str | None = None,
    answer_dtype: str | None = None,
    verify: int | None = None,
    verify_seed: int | None = None,
) -> Fields:
    """The request of ``per_sample_grads``, ``td0`` and ``submit``: unset options left out."""
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a model id such as 'mlp' or 'id@version'")
    outs = [outputs] if isinstance(outputs, str) else list(outputs)
    if not outs:
        raise BadRequest(f"'outputs' must name at least one of: {', '.join(OUTPUT_NAMES)}")
    noise = _number(noise_multiplier, "noise_multiplier")
    if noise is not None and noise < 0:
        raise InvalidInput("'noise_multiplier' must be >= 0")
    fields: Fields = {"model": model, "inputs": to_numpy(inputs, "inputs"), "outputs": outs}
    samples = {"targets": targets, "next_inputs": next_inputs, "rewards": rewards, "dones": dones}
    optional: dict[str, Any] = {
        **{k: None if v is None else to_numpy(v, k) for k, v in samples.items()},
        "loss": loss,
        "params": None if params is None else [str(p) for p in params],
        "weights": param_arrays(weights, "weights"),
        "reference": param_arrays(reference, "reference"),
        "clip_norm": _number(clip_norm, "clip_norm"),
        "noise_multiplier": noise,
        "seed": _integer(seed, "seed", 2**63 - 1, "[0, 2**63)"),
        "gamma": _number(gamma, "gamma"),
        "projection_dim": projection_dim,
        "projection_seed": projection_seed,
        "projection_kind": projection_kind,
        "reference_sketches": None if reference_sketches is None
        else to_numpy(reference_sketches, "reference_sketches"),
        "reference_set": reference_set,
        "answer_dtype": _answer_dtype(answer_dtype),
        # 0 is the server's default (its PSGRAD_VERIFY_FRACTION decides): not sent
        "verify": _integer(verify, "verify", MAX_VERIFY, f"[0, {MAX_VERIFY}]") or None,
        "verify_seed": _integer(verify_seed, "verify_seed", 2**63 - 1, "[0, 2**63)"),
    }
    fields.update({k: v for k, v in optional.items() if v is not None})
    return fields


def _integer(value: Any, name: str, high: int, shown: str) -> int | None:
    """An integer option in [0, high], or None when unset; ``shown`` is the range as told."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) \
            or not 0 <= int(value) <= high:
        raise BadRequest(f"'{name}' must be an integer in {shown}")
    return int(value)


def _answer_dtype(value: str | None) -> str | None:
    if value is None or value == "float32":
        return None  # the default: not sent
    if value not in ANSWER_DTYPES:
        raise InvalidInput(f"'answer_dtype' must be one of {', '.join(ANSWER_DTYPES)}; "
                           f"got {value!r}")
    return value


def _number(value: Any, name: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadRequest(f"'{name}' must be a number; got {value!r}") from None
    if not math.isfinite(number):
        raise BadRequest(f"'{name}' must be finite")
    return number
