"""Reading a safetensors answer as it arrives, straight into arrays allocated once.

A full per-sample gradient answer is hundreds of MB to GBs. Reading the body into one ``bytes``
and then decoding it holds the answer twice; :class:`AnswerReader` instead takes the body in the
pieces the connection delivers: the header first (every tensor's dtype and shape are known up
front), then each piece's bytes are copied once, into the tensor they belong to. ``BF16`` tensors
(``answer_dtype="bfloat16"``) are widened to float32 at the end: numpy has no bfloat16, and
every bfloat16 number is a float32 number, so nothing is rounded twice.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from psgrad._errors import BadRequest
from psgrad._wire import MAX_HEADER_BYTES, MAX_NDIM, fields_from_tensors, widen_bfloat16

__all__ = ["AnswerReader"]

_NP_DTYPES = {"F32": "<f4", "F64": "<f8", "F16": "<f2", "BF16": "<u2", "I64": "<i8",
              "I32": "<i4", "I16": "<i2", "I8": "i1", "U8": "u1", "BOOL": "?"}


class AnswerReader:
    """Feed the body's pieces in order (:meth:`feed`), then take the fields (:meth:`fields`)."""

    def __init__(self, meta_key: str, empty: Callable[[list[int], str], np.ndarray] = np.empty
                 ) -> None:
        self.meta_key = meta_key
        self._empty = empty  # allocates each tensor (psgrad._memory lends dropped answers')
        self._head = bytearray()
        self._header_len: int | None = None
        self._metadata: dict[str, Any] = {}
        self._tensors: list[tuple[str, str, np.ndarray, memoryview]] = []  # name, dtype, array
        self._index = 0  # the tensor being filled
        self._filled = 0  # bytes of it written so far

    def feed(self, piece: bytes | memoryview) -> None:
        data = memoryview(piece).cast("B")
        if not self._header_done():
            data = self._take_header(data)
        while data.nbytes:
            if self._index >= len(self._tensors):
                raise BadRequest("the safetensors answer is longer than its header says")
            _, _, _, target = self._tensors[self._index]
            n = min(data.nbytes, target.nbytes - self._filled)
            target[self._filled:self._filled + n] = data[:n]
            self._filled += n
            data = data[n:]
            self._skip_full()

    def space(self) -> memoryview | None:
        """Where the body's next bytes belong: the unfilled rest of the tensor being filled.

        For receiving in place (``recv_into`` it, then :meth:`wrote`); None while the header
        is incomplete (:meth:`feed` those bytes) and once every tensor is full.
        """
        if not self._header_done() or self._index >= len(self._tensors):
            return None
        return self._tensors[self._index][3][self._filled:]

    def wrote(self, n: int) -> None:
        """``n`` bytes were written into the start of :meth:`space`."""
        self._filled += n
        self._skip_full()

    def fields(self) -> dict[str, Any]:
        """The answer's fields; refuses an answer that ended early."""
        if not self._header_done() or self._index < len(self._tensors):
            raise BadRequest("the safetensors answer ended before all its bytes arrived")
        tensors = {name: widen_bfloat16(arr) if dtype == "BF16" else arr
                   for name, dtype, arr, _ in self._tensors}
        return fields_from_tensors(tensors, self._metadata, self.meta_key)

    def _header_done(self) -> bool:
        return self._header_len is not None and len(self._head) == 8 + self._header_len

    def _take_header(self, data: memoryview) -> memoryview:
        if self._header_len is None:
            n = min(8 - len(self._head), data.nbytes)
            self._head += data[:n]
            data = data[n:]
            if len(self._head) < 8:
                return data
            (self._header_len,) = struct.unpack("<Q", self._head[:8])
            if self._header_len > MAX_HEADER_BYTES:
                raise BadRequest(f"the safetensors header claims {self._header_len} bytes; the "
                                 f"limit is {MAX_HEADER_BYTES}")
        n = min(8 + self._header_len - len(self._head), data.nbytes)
        self._head += data[:n]
        if len(self._head) == 8 + self._header_len:
            self._layout(bytes(self._head[8:]))
        return data[n:]

    def _layout(self, raw: bytes) -> None:
        try:
            header = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"the safetensors header is not valid JSON: {exc}") from None
        if not isinstance(header, dict):
            raise BadRequest("the safetensors header must be a JSON object")
        self._metadata = header.pop("__metadata__", None) or {}
        entries = sorted(header.items(), key=lambda kv: _offsets(kv)[0])
        offset = 0
        for name, spec in entries:
            start, end = _offsets((name, spec))
            dtype, shape = spec.get("dtype"), spec.get("shape")
            if dtype not in _NP_DTYPES or not isinstance(shape, list) or len(shape) > MAX_NDIM + 1 \
                    or not all(isinstance(d, int) and d >= 0 for d in shape):
                raise BadRequest(f"tensor '{name}': bad dtype or shape in the header")
            arr = self._empty(shape, _NP_DTYPES[dtype])
            if start != offset or end - start != arr.nbytes:
                raise BadRequest(f"tensor '{name}': its offsets do not match its shape")
            offset = end
            self._tensors.append((name, dtype, arr, arr.reshape(-1).data.cast("B")))
        self._skip_full()

    def _skip_full(self) -> None:
        while self._index < len(self._tensors) and (
                self._filled == self._tensors[self._index][3].nbytes):
            self._index += 1
            self._filled = 0


def _offsets(item: tuple[str, Any]) -> tuple[int, int]:
    name, spec = item
    offsets = spec.get("data_offsets") if isinstance(spec, dict) else None
    if not (isinstance(offsets, list) and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets) and 0 <= offsets[0] <= offsets[1]):
        raise BadRequest(f"tensor '{name}': bad data_offsets in the safetensors header")
    return offsets[0], offsets[1]
