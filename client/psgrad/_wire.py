"""The wire formats of the HTTP contract, shared by the client and the server (numpy only).

A request or a result is a flat dict: plain JSON values, numpy arrays, and dicts of arrays keyed
by parameter name (``weights``, ``reference``, ``grads``, ``mean``, ...). Two encodings:

- JSON: an array is nested lists, or ``{"dtype", "shape", "data": base64 little-endian bytes}``.
- safetensors: arrays are tensors (a dict of arrays becomes ``<field>/<param>``) and the other
  fields are a JSON string under one metadata key (``request`` or ``response``).

Nothing here unpickles, and every size is checked before anything is allocated.
"""

from __future__ import annotations

import base64
import binascii
import functools
import json
import math
import struct
from collections.abc import Mapping
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from psgrad._errors import BadRequest, TooLarge

DTYPES = ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_NDIM = 8

REQUEST_KEY = "request"
RESPONSE_KEY = "response"
ORDER_KEY = "order"  # {field: [param, ...]}: safetensors sorts tensors, a dict keeps its order

SAFETENSORS = "application/x-safetensors"
JSON = "application/json"


def media_type(value: str | None) -> str:
    """A ``Content-Type`` (or one entry of an ``Accept``) without its parameters, lower case."""
    return (value or "").split(";", 1)[0].strip().lower()


def array_from_json(value: Any, *, name: str, max_elements: int, wide: bool = False
                    ) -> np.ndarray:
    """Decode one JSON tensor (nested lists or the base64 form), refusing anything malformed;
    nested lists' floats in float32, the models' own (``wide``: float64, as JSON has them)."""
    if isinstance(value, dict):
        return _array_from_b64(value, name=name, max_elements=max_elements)
    if isinstance(value, (bool, int, float)):
        return np.asarray(value)
    if not isinstance(value, list):
        raise BadRequest(
            f"'{name}' must be nested lists of numbers or a {{dtype, shape, data}} object; "
            f"got {type(value).__name__}",
            field=name,
        )
    shape = _nested_shape(value, name)
    if math.prod(shape) > max_elements:
        raise TooLarge(
            f"'{name}' has {math.prod(shape)} elements; the limit is {max_elements}",
            field=name, limit=max_elements,
        )
    try:
        arr = np.array(value)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"'{name}' is not a rectangular array of numbers", field=name) from exc
    if arr.dtype.kind not in "biuf":
        raise BadRequest(f"'{name}' must contain only numbers or booleans", field=name)
    if arr.dtype == np.float64 and not wide:
        arr = arr.astype(np.float32)  # JSON numbers carry no dtype; float32 is the models' own
    return arr


def _nested_shape(value: list[Any], name: str) -> tuple[int, ...]:
    """Shape of nested lists, checked to be rectangular without building anything."""
    shape: list[int] = []
    level: list[Any] = [value]
    while level and isinstance(level[0], list):
        sizes = {len(item) if isinstance(item, list) else -1 for item in level}
        if len(sizes) != 1 or -1 in sizes:
            raise BadRequest(
                f"'{name}' is ragged: the lists at depth {len(shape)} differ in length or mix "
                "lists and numbers; every sample must have the same shape",
                field=name,
            )
        shape.append(sizes.pop())
        if len(shape) > MAX_NDIM + 1:
            raise BadRequest(f"'{name}' has more than {MAX_NDIM + 1} dimensions", field=name)
        level = [x for item in level for x in item]
    if any(isinstance(x, list) for x in level):
        raise BadRequest(f"'{name}' is ragged", field=name)
    return tuple(shape)


def _array_from_b64(value: dict[str, Any], *, name: str, max_elements: int) -> np.ndarray:
    dtype, shape, data = value.get("dtype"), value.get("shape"), value.get("data")
    if dtype not in DTYPES:
        raise BadRequest(
            f"'{name}': unknown dtype {dtype!r}; known: {', '.join(DTYPES)}", field=name
        )
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_NDIM + 1
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
    ):
        raise BadRequest(
            f"'{name}': shape must be a list of at most {MAX_NDIM + 1} non-negative integers",
            field=name,
        )
    count = math.prod(shape)
    if count > max_elements:
        raise TooLarge(
            f"'{name}' declares {count} elements; the limit is {max_elements}",
            field=name, limit=max_elements,
        )
    if not isinstance(data, str):
        raise BadRequest(f"'{name}': data must be a base64 string", field=name)
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadRequest(f"'{name}': data is not valid base64", field=name) from exc
    np_dtype = np.dtype(dtype).newbyteorder("<")
    if len(raw) != count * np_dtype.itemsize:
        raise BadRequest(
            f"'{name}': shape {shape} of {dtype} needs {count * np_dtype.itemsize} bytes, "
            f"data has {len(raw)}",
            field=name,
        )
    return np.frombuffer(raw, dtype=np_dtype).reshape(shape).astype(np.dtype(dtype))


def array_to_json(arr: np.ndarray, *, binary: bool = False) -> Any:
    """Encode an array as nested lists, or as the base64 form when ``binary``."""
    if not binary:
        return arr.tolist()
    little = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
    return {
        "dtype": str(arr.dtype),
        "shape": list(arr.shape),
        "data": base64.b64encode(little.tobytes()).decode("ascii"),
    }


def fields_to_json(fields: Mapping[str, Any], *, binary: bool = False) -> dict[str, Any]:
    """A request or result dict with every array encoded for JSON."""
    out: dict[str, Any] = {}
    for key, value in fields.items():
        if isinstance(value, np.ndarray):
            out[key] = array_to_json(value, binary=binary)
        elif isinstance(value, Mapping) and any(isinstance(v, np.ndarray) for v in value.values()):
            out[key] = {k: array_to_json(v, binary=binary) for k, v in value.items()}
        else:
            out[key] = value
    return out


def fields_to_safetensors(fields: Mapping[str, Any], meta_key: str) -> bytes:
    """Arrays become tensors (``field`` or ``field/param``), the rest JSON under ``meta_key``."""
    tensors, metadata = _split_fields(fields, meta_key)
    return bytes(st_save(tensors, metadata=metadata))


_ST_DTYPES = {"float32": "F32", "float64": "F64", "float16": "F16", "int64": "I64",
              "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}

# numpy has no bfloat16: the server holds bfloat16 answers as their 16 bits under this named
# dtype, written to safetensors as BF16; the client widens them to float32 (exactly).
BFLOAT16 = np.dtype([("bfloat16", "<u2")])


def st_dtype(arr: np.ndarray) -> str:
    """The safetensors name of an array's dtype (BF16 for the :data:`BFLOAT16` bits)."""
    return _st_name(arr.dtype)


@functools.cache
def _st_name(dtype: np.dtype[Any]) -> str:  # once per dtype: comparing and naming dtypes is slow
    if dtype == BFLOAT16:
        return "BF16"
    name = str(dtype.newbyteorder("="))
    if name not in _ST_DTYPES:
        raise TypeError(f"dtype {dtype} is not one of {DTYPES}")
    return _ST_DTYPES[name]


def bfloat16_values(arr: np.ndarray) -> np.ndarray:
    """``arr`` rounded to the nearest bfloat16 values (ties to even, as torch rounds), held in
    float32, which holds every one of them exactly: what a bfloat16 model takes."""
    wide = np.ascontiguousarray(arr, dtype=np.float32)
    bits = wide.view(np.uint32).astype(np.uint64)
    kept = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32).view(np.float32)
    return np.where(np.isnan(wide), wide, kept)


def widen_bfloat16(bits: np.ndarray) -> np.ndarray:
    """bfloat16 bits as float32: the same numbers (bfloat16 is float32's upper half)."""
    return (bits.view("<u2").astype("<u4") << 16).view(np.float32)


READABLE = ("F64", "F32", "F16", "BF16", "I64", "U64", "I32", "U32", "I16", "U16", "I8", "U8",
            "BOOL")  # the safetensors dtypes read (numpy's, and bfloat16 widened)


def _header(body: bytes) -> dict[str, Any]:
    """A safetensors file's JSON header; a ValueError saying what is wrong where it is no
    object of tensors described by objects of a dtype psgrad reads."""
    header = json.loads(body[8:8 + int.from_bytes(body[:8], "little")])
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"tensor '{name}' is not described by an object (dtype, shape, "
                             "data_offsets)")
        if entry.get("dtype") not in READABLE:
            raise ValueError(f"tensor '{name}' has dtype {entry.get('dtype')!r}; psgrad reads "
                             f"{', '.join(READABLE)}")
    return header


def _bfloat16_as_bits(body: bytes, header: Mapping[str, Any]) -> tuple[bytes, list[str]] | None:
    """``body`` (whose header is ``header``) with its bfloat16 tensors named as the 16-bit
    integers they are stored as (a dtype numpy has), and their names; None where it has none."""
    names = [k for k, v in header.items() if k != "__metadata__" and v.get("dtype") == "BF16"]
    if not names:
        return None
    raw = json.dumps({**header, **{k: {**header[k], "dtype": "U16"} for k in names}}).encode()
    raw += b" " * (-len(raw) % 8)
    data = body[8 + int.from_bytes(body[:8], "little"):]
    return len(raw).to_bytes(8, "little") + raw + data, names


def widened_load(body: bytes, header: Mapping[str, Any] | None = None) -> dict[str, np.ndarray]:
    """A safetensors file's tensors as numpy arrays, bfloat16 ones widened to float32 (the same
    numbers: numpy has no bfloat16); ``header``: its header, where the caller parsed it."""
    bf16 = _bfloat16_as_bits(body, _header(body) if header is None else header)
    arrays = dict(st_load(body if bf16 is None else bf16[0]))
    for name in bf16[1] if bf16 is not None else ():
        arrays[name] = widen_bfloat16(arrays[name])
    return arrays


def widen_answers(value: Any) -> Any:
    """``value`` with every :data:`BFLOAT16` array widened to float32 (for JSON and numpy)."""
    if isinstance(value, np.ndarray) and value.dtype == BFLOAT16:
        return widen_bfloat16(value)
    if isinstance(value, dict):
        return {k: widen_answers(v) for k, v in value.items()}
    return value


def safetensors_parts(fields: Mapping[str, Any], meta_key: str) -> list[bytes | memoryview]:
    """The file of :func:`fields_to_safetensors` as pieces that view the arrays (no copy).

    For streaming a large answer: the header, then each tensor's bytes in place. Same tensors,
    names and metadata; ``b"".join`` of the parts is a valid safetensors file.
    """
    tensors, metadata = _split_fields(fields, meta_key)
    header: dict[str, Any] = {"__metadata__": metadata}
    parts: list[bytes | memoryview] = []
    offset = 0
    for name, arr in tensors.items():
        little = arr.astype(arr.dtype.newbyteorder("<"), order="C", copy=False)
        header[name] = {"dtype": st_dtype(little), "shape": list(little.shape),
                        "data_offsets": [offset, offset + little.nbytes]}
        offset += little.nbytes
        if little.nbytes:
            parts.append(little.reshape(-1).data.cast("B"))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return [struct.pack("<Q", len(raw)) + raw, *parts]


def parts_size(parts: list[bytes | memoryview]) -> int:
    """Bytes of the file that :func:`safetensors_parts` cut into ``parts`` (its views are of
    bytes, so their length is their size)."""
    return sum(len(part) for part in parts)


def _split_fields(fields: Mapping[str, Any], meta_key: str
                  ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    tensors: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    order: dict[str, list[str]] = {}
    for key, value in fields.items():
        if isinstance(value, np.ndarray):
            tensors[key] = np.asarray(value, order="C")  # ascontiguousarray makes 0-d 1-d
        elif isinstance(value, Mapping) and value and all(
            isinstance(v, np.ndarray) for v in value.values()
        ):
            order[key] = list(value)
            for param, arr in value.items():
                tensors[f"{key}/{param}"] = np.asarray(arr, order="C")
        else:
            meta[key] = value
    metadata = {meta_key: json.dumps(meta), ORDER_KEY: json.dumps(order)}
    return tensors, metadata


def fields_from_safetensors(body: bytes, meta_key: str, *, max_header: int = MAX_HEADER_BYTES
                            ) -> dict[str, Any]:
    """Inverse of :func:`fields_to_safetensors`; the header is size-checked before parsing."""
    check_header_size(body, max_header)
    try:
        header = _header(body)
        tensors = widened_load(body, header)
    except (SafetensorError, ValueError, UnicodeDecodeError, KeyError, TypeError,
            AttributeError) as exc:
        raise BadRequest(f"the body is not a valid safetensors file: {exc}") from exc
    return fields_from_tensors(tensors, header.get("__metadata__") or {}, meta_key)


def check_header_size(body: bytes, max_header: int = MAX_HEADER_BYTES) -> None:
    """A 400 where a safetensors body's header length is missing, past ``max_header`` or
    past the body."""
    if len(body) < 8:
        raise BadRequest("the safetensors body is shorter than its 8-byte header length")
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > max_header or header_len > len(body) - 8:
        raise BadRequest(
            f"the safetensors header claims {header_len} bytes; the body has {len(body) - 8} "
            f"and the limit is {max_header}: the file is corrupt or truncated"
        )


def fields_from_tensors(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, Any],
                        meta_key: str) -> dict[str, Any]:
    """The fields of a safetensors file from its tensors and its metadata."""
    raw_meta = metadata.get(meta_key, "{}")
    try:
        fields: dict[str, Any] = json.loads(raw_meta)
    except ValueError as exc:
        raise BadRequest(f"safetensors metadata '{meta_key}' is not valid JSON") from exc
    if not isinstance(fields, dict):
        raise BadRequest(f"safetensors metadata '{meta_key}' must be a JSON object")
    for name, arr in tensors.items():
        field, _, param = name.partition("/")
        if param:
            group = fields.setdefault(field, {})
            if not isinstance(group, dict):
                raise BadRequest(f"tensor '{name}' clashes with metadata field '{field}'")
            group[param] = arr
        else:
            fields[field] = arr
    _restore_order(fields, metadata.get(ORDER_KEY))
    return fields


def _restore_order(fields: dict[str, Any], raw: Any) -> None:
    """Put each dict of tensors back in the order it was written (the model's parameter order)."""
    try:
        order = json.loads(raw) if isinstance(raw, str) else {}
    except ValueError:
        return
    if not isinstance(order, dict):
        return
    for field, names in order.items():
        group = fields.get(field)
        if isinstance(group, dict) and isinstance(names, list) and set(names) == set(group):
            fields[field] = {name: group[name] for name in names}
