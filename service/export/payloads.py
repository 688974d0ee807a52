"""Weights and constants: raw little-endian bytes viewed through literal sizes and strides.

A payload entry is a flat run of bytes; its config says which dtype it holds and, per
parameter, the view (sizes, strides, storage offset) into it. Only literal integers are read:
a symbolic size is refused, never parsed. Every view is checked to stay inside its payload
before :func:`torch.as_strided` sees it, and the result is copied out, so no tensor aliases a
client's buffer. Entries that name one payload with one view are one tensor: a tied weight
(GPT-2's ``wte``/``lm_head``) stays a single parameter.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch

from psgrad._errors import InvalidArchive, RefusedProgram, TooLarge
from service.config import raise_setting

MAX_DIMS = 8
# The schema's ScalarType numbers psgrad accepts (torch/_export/serde/schema.py).
DTYPES: dict[int, torch.dtype] = {
    1: torch.uint8, 2: torch.int8, 3: torch.int16, 4: torch.int32, 5: torch.int64,
    6: torch.float16, 7: torch.float32, 8: torch.float64, 12: torch.bool, 13: torch.bfloat16,
}
STRIDED = 7  # the schema's Layout.Strided


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    sizes: tuple[int | None, ...]  # None: a symbolic size (its expression is never read)
    hints: tuple[int, ...]  # a literal example for every size (the hint of a symbolic one)


@dataclass
class Payloads:
    """Tensors by canonical name; ``aliases`` maps every tied name to its canonical one."""

    tensors: dict[str, torch.Tensor]
    aliases: dict[str, str]


def literal_int(value: Any, where: str) -> int:
    """A JSON integer (not a bool) of sane magnitude."""
    if isinstance(value, bool) or not isinstance(value, int) or abs(value) > 1 << 48:
        raise InvalidArchive(f"{where} must be a literal integer", where=where)
    return value


def obj(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise InvalidArchive(f"{where} must be a JSON object", where=where)
    return value


def sym_int(value: Any, where: str, *, allow_symbolic: bool) -> tuple[int | None, int]:
    """``{"as_int": n}`` -> (n, n); ``{"as_expr": {..., "hint": {"as_int": h}}}`` -> (None, h)."""
    d = obj(value, where)
    if set(d) == {"as_int"}:
        n = literal_int(d["as_int"], where)
        return n, n
    if set(d) == {"as_expr"} and allow_symbolic:
        hint = obj(obj(d["as_expr"], where).get("hint"), f"{where}.hint")
        if set(hint) != {"as_int"}:
            raise InvalidArchive(f"{where}: a symbolic size needs an integer hint", where=where)
        return None, literal_int(hint["as_int"], f"{where}.hint")
    raise RefusedProgram(f"{where} must be a literal integer (symbolic expressions are never "
                         "read)", where=where)


def tensor_meta(value: Any, where: str, *, allow_symbolic: bool = False) -> TensorMeta:
    d = obj(value, where)
    code = d.get("dtype")
    dtype = DTYPES.get(code) if isinstance(code, int) else None
    if dtype is None:
        raise RefusedProgram(f"{where}: dtype {str(d.get('dtype'))[:20]} is not one psgrad "
                             "serves (floating, integer or bool)", where=where)
    if d.get("layout") != STRIDED:
        raise RefusedProgram(f"{where}: only dense (strided) tensors are read", where=where)
    sizes = d.get("sizes")
    if not isinstance(sizes, list) or len(sizes) > MAX_DIMS:
        raise InvalidArchive(f"{where}.sizes must be a list of at most {MAX_DIMS}", where=where)
    pairs = [sym_int(s, f"{where}.sizes[{i}]", allow_symbolic=allow_symbolic)
             for i, s in enumerate(sizes)]
    if any(h < 0 for _, h in pairs):
        raise InvalidArchive(f"{where}: negative size", where=where)
    return TensorMeta(dtype, tuple(s for s, _ in pairs), tuple(h for _, h in pairs))


def _view(value: Any, where: str) -> tuple[torch.dtype, list[int], list[int], int]:
    meta = tensor_meta(value, where)
    d = obj(value, where)
    strides = d.get("strides")
    if not isinstance(strides, list) or len(strides) != len(meta.sizes):
        raise InvalidArchive(f"{where}.strides must match its sizes", where=where)
    stride = [literal_int(obj(s, where).get("as_int"), f"{where}.strides[{i}]")
              for i, s in enumerate(strides)]
    offset = literal_int(obj(d.get("storage_offset"), where).get("as_int"),
                         f"{where}.storage_offset")
    if any(s < 0 for s in stride) or offset < 0:
        raise InvalidArchive(f"{where}: negative stride or offset", where=where)
    return meta.dtype, list(meta.hints), stride, offset


def read_payloads(config_doc: dict[str, Any], blobs: dict[str, torch.Tensor], names: list[str],
                  where: str, max_bytes: int) -> Payloads:
    """The tensors ``names`` of one payload config; every config entry and blob must be used."""
    if sys.byteorder != "little":  # payloads are little-endian; so must the host be
        raise RefusedProgram("this server reads exported weights on little-endian hosts only")
    config = obj(config_doc.get("config"), f"{where}.config")
    if set(config_doc) != {"config"}:
        raise InvalidArchive(f"{where} must hold only 'config'", entry=where)
    unused = sorted(set(config) - set(names))
    if unused:
        raise InvalidArchive(f"{where} lists {', '.join(unused)[:200]}, which the program "
                             "does not use", entry=where)
    seen: dict[tuple[Any, ...], str] = {}
    by_path: dict[str, tuple[Any, ...]] = {}
    out = Payloads({}, {})
    total = 0
    for name in names:
        meta = obj(config.get(name), f"{where}: '{name}'")
        if meta.get("use_pickle") is not False:
            raise RefusedProgram(f"'{name}' is stored as a pickle (use_pickle); psgrad reads "
                                 "raw tensor bytes only", parameter=name)
        path = meta.get("path_name")
        if not isinstance(path, str) or path not in blobs:
            raise InvalidArchive(f"'{name}' names payload {str(path)[:60]!r}, which the "
                                 "archive does not hold", parameter=name)
        dtype, size, stride, offset = _view(meta.get("tensor_meta"), f"'{name}'")
        key = (path, dtype, tuple(size), tuple(stride), offset, meta.get("is_param") is True)
        if key in seen:
            out.aliases[name] = seen[key]
            continue
        if path in by_path:
            raise RefusedProgram(f"'{name}' and '{seen[by_path[path]]}' read one payload "
                                 "through different views; psgrad ties entries that share a "
                                 "payload only when they are the same tensor", parameter=name)
        tensor = _materialise(blobs[path], dtype, size, stride, offset, name)
        total += tensor.numel() * tensor.element_size()
        if total > max_bytes:
            raise TooLarge(f"the program's tensors take more than {max_bytes} bytes: "
                           f"{raise_setting('max_weight_bytes', max_bytes)}", limit=max_bytes)
        seen[key], by_path[path] = name, key
        out.tensors[name] = tensor
        out.aliases[name] = name
    unread = sorted(set(blobs) - {k[0] for k in seen})
    if unread:
        raise InvalidArchive(f"payload(s) {', '.join(unread)[:200]} are not used by {where}",
                             entry=where)
    return out


def _materialise(blob: torch.Tensor, dtype: torch.dtype, size: list[int], stride: list[int],
                 offset: int, name: str) -> torch.Tensor:
    """One view into ``blob``, bounds-checked: the usual payload, a view of the whole of it, is
    ``blob``'s own memory (read for it alone); any other view is copied out (GPT-2's clones
    took 1.3 s of a 14 s registration)."""
    item = torch.empty((), dtype=dtype).element_size()
    if len(blob) % item:
        raise InvalidArchive(f"payload of '{name}' is {len(blob)} bytes, not a whole number "
                             f"of {item}-byte elements", parameter=name)
    numel = len(blob) // item
    if 0 in size:
        return torch.empty(size, dtype=dtype)
    last = offset + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    if last >= numel:
        raise InvalidArchive(f"'{name}' reads past the end of its payload (element {last} of "
                             f"{numel})", parameter=name)
    flat = blob.view(dtype) if numel else torch.empty(0, dtype=dtype)
    view = torch.as_strided(flat, size, stride, offset)
    if offset == 0 and view.numel() == numel and view.is_contiguous():
        return view
    return view.clone(memory_format=torch.contiguous_format)
