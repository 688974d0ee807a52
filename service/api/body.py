"""Reading requests and writing answers: size limits, content negotiation, decoding off the loop.

A body is streamed and refused as soon as it passes ``PSGRAD_MAX_BODY_BYTES`` (or before reading
when ``Content-Length`` already says so). JSON and safetensors decode in a thread when large, so
the event loop never parses a 300 MB body. Answers are JSON by default and safetensors when the
client's ``Accept`` names ``application/x-safetensors``.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import AsyncIterator, Callable, Generator, Mapping
from typing import Any

import numpy as np
import orjson
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope, Send

from psgrad._contract import FIELDS, KNOWN, TENSOR_DICT_FIELDS, TENSOR_FIELDS, model_of
from psgrad._errors import BadRequest, InvalidInput, TooLarge, UnsupportedMediaType
from psgrad._wire import (
    JSON,
    REQUEST_KEY,
    RESPONSE_KEY,
    SAFETENSORS,
    array_from_json,
    fields_from_safetensors,
    media_type,
    parts_size,
    safetensors_parts,
    widen_answers,
)
from service.api.errors import schema_refusal, unsupported_type
from service.api.status_data import note_model
from service.config import Settings, naming_setting, raise_setting
from service.losses import LOSSES
from service.outputs import OUTPUTS
from service.validate import asked_outputs

STREAM_CHUNK = 1 << 20  # bytes per write of a streamed safetensors answer
JSON_CHUNK = 1 << 20  # array bytes per piece of a streamed JSON answer
INLINE_BYTES = 64 * 1024  # smaller bodies decode on the loop (a thread hop costs more)


async def read_body(request: Request, limit: int,
                    setting: tuple[str, int] | None = None) -> bytes:
    """The body, refused with 413 as soon as it is known to pass ``limit`` bytes.

    ``setting``: the setting behind ``limit`` and its value, when it is not
    ``max_body_bytes`` itself (a model archive's limit follows from its weights' limit).
    """
    return b"".join([chunk async for chunk in body_chunks(request, limit, setting)])


async def read_json(request: Request, limit: int) -> Any:
    """A JSON body, parsed: a 415 for another media type (or none), a 413 past ``limit``
    bytes, a 400 for JSON that is not valid."""
    ctype = media_type(request.headers.get("content-type"))
    if ctype != JSON:
        raise unsupported_type(ctype, [JSON])
    return loads(await read_body(request, limit))


def body_chunks(request: Request, limit: int, setting: tuple[str, int] | None = None
                ) -> AsyncIterator[bytes]:
    """The body's chunks as they arrive: refused with 413 at once where its declared length
    passes ``limit``, else as soon as the chunks do (``setting``: :func:`read_body`'s)."""
    field, value = setting or ("max_body_bytes", limit)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):  # read as it is, a compressed body is no JSON
        raise UnsupportedMediaType(f"the body is sent with Content-Encoding {encoding[:40]}, "
                                   "which the server does not take: send it uncompressed")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit, field, value)

    async def chunks() -> AsyncIterator[bytes]:
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, field, value, at_least=True)
            yield chunk

    return chunks()


def _too_large(size: int, limit: int, field: str, value: int, *,
               at_least: bool = False) -> TooLarge:
    advice = ("send smaller batches, or the binary safetensors form instead of JSON lists, or "
              if field == "max_body_bytes" else "")
    return TooLarge(
        f"the body is {'at least ' if at_least else ''}{size} bytes; the limit is {limit}: "
        f"{advice}{raise_setting(field, value)}",
        limit=limit,
        size=size,
    )


async def decode_request(request: Request, settings: Settings, *, one_job: bool = True,
                         takes: frozenset[str] = KNOWN, need_model: bool = True,
                         tensors: tuple[str, ...] = ()) -> dict[str, Any]:
    """The request fields (JSON values and numpy arrays) from a JSON or safetensors body;
    ``one_job=False`` for a body the route splits into jobs itself (no batch-size limit);
    ``takes``: the fields the route reads (:func:`precheck`; default: a gradients request's);
    ``need_model=False``: the route knows the model (a store's); ``tensors``: the route's own
    fields that a safetensors body may send as tensors, beside a gradients request's."""
    ctype = media_type(request.headers.get("content-type"))
    if ctype not in (JSON, SAFETENSORS):
        raise unsupported_type(ctype, [JSON, SAFETENSORS])
    body = await read_body(request, settings.max_body_bytes)
    decode = _decode_safetensors if ctype == SAFETENSORS else _decode_json
    if len(body) > INLINE_BYTES:
        fields: dict[str, Any] = await run_in_threadpool(decode, body, settings)
    else:
        fields = decode(body, settings)
    if ctype == SAFETENSORS:
        tensors_where_taken(fields, takes | KNOWN, TENSORS.union(tensors))
    note_model(request.scope, fields.get("model"))  # the status page counts by model
    precheck(fields, takes, need_model)
    inputs = fields.get("inputs")
    if isinstance(inputs, dict):  # named inputs: the first one's batch
        inputs = next(iter(inputs.values()), None)
    if (one_job and isinstance(inputs, np.ndarray) and inputs.ndim
            and inputs.shape[0] > settings.max_batch_size):
        raise TooLarge(
            f"the batch has {inputs.shape[0]} samples; the limit is {settings.max_batch_size}: "
            "split it into smaller batches (the SDK does this for you), or "
            f"{raise_setting('max_batch_size', settings.max_batch_size)}",
            limit=settings.max_batch_size,
            size=int(inputs.shape[0]),
        )
    return fields


def precheck(fields: dict[str, Any], takes: frozenset[str] = KNOWN,
             need_model: bool = True) -> None:
    """What can be refused without the model, refused before queueing (the rest: the worker):
    a field that is neither a gradients request's nor among those the route ``takes`` is a 400
    listing what the route takes (a gradients request's field that the route does not read:
    the route's own 422 says to leave it out)."""
    unknown = sorted(set(fields) - KNOWN - takes)
    if unknown:
        raise BadRequest(
            f"unknown fields: {', '.join(unknown)}; known: {', '.join(sorted(takes))}",
            unknown=unknown,
        )
    if need_model:
        model_of(fields)


@functools.cache  # a route's body schema: read once, not on every request
def fields_of(schema: type[BaseModel]) -> frozenset[str]:
    """The fields a body of ``schema`` may send, by the names sent (an alias: ``lambda``)."""
    return frozenset(f.alias or name for name, f in schema.model_fields.items())


def held_to_contract(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Each request field of ``fields`` held to the contract (its type, range or choices:
    :meth:`psgrad._contract.Field.check`), each loss and output named known, 'clip_norm' sent
    where 'clipped_mean' needs it, and no reference field sent that no output asked reads; the
    error names the field and says what it takes. The fields as checked come back (a whole
    number such as ``3.0`` for an integer field as an int, as JSON Schema's integers: the schema
    reads them so). After this, :mod:`service.validate` reads the fields as typed and checks
    what needs the model."""
    checked = dict(fields)
    for name, value in fields.items():
        spec = FIELDS.get(name)
        if spec is not None and spec.kind not in _TENSOR_KINDS:
            checked[name] = spec.check(value)
    if fields.get("loss"):
        LOSSES[fields["loss"]]
    outputs = asked_outputs(fields)
    for name in outputs:
        OUTPUTS[name]
    if "clipped_mean" in outputs and fields.get("clip_norm") is None \
            and fields.get("dp_run") is None:  # a DP run's step: the run's clip_norm
        raise InvalidInput("output 'clipped_mean' needs 'clip_norm' > 0")
    for name, reader in (("reference_set", "influence"), ("reference_sketches", "dots")):
        if fields.get(name) is not None and not {"dots", "influence"} & set(outputs):
            raise InvalidInput(f"'{name}' is read by output '{reader}' only; ask for it")
    return checked


_TENSOR_KINDS = ("inputs", "tensor", "tensors")  # read against the model (service.validate)


async def conform(schema: type[BaseModel], fields: Mapping[str, Any],
                  specific: Callable[[], object] | None = None) -> None:
    """The decoded body (JSON or safetensors alike) against the route's one model ``schema``,
    at the door: the schema's word on every field but tensor contents, each tensor (already
    decoded) stood in for by the JSON type it came as. A refused body gets the route's own error
    where ``specific`` (its checks, run off the event loop) finds one (``unknown_loss``, ...),
    else ``invalid_input`` naming the fields."""
    if isinstance(fields, Mapping):  # else the schema refuses it, in the route's words
        fields = held_to_contract(fields)
    try:
        schema.model_validate(_as_sent(fields), strict=True)  # no "0.5" for 0.5: as sent
    except ValidationError as exc:
        if specific is not None:
            await run_in_threadpool(specific)
        raise schema_refusal(exc.errors(), schema.model_fields) from None


def _as_sent(value: Any) -> Any:
    """A decoded body with each tensor as the JSON type it came as: a list, or a scalar
    (``false`` stays one); {name: tensor} fields alike."""
    if isinstance(value, np.ndarray):
        return value.item() if value.ndim == 0 else []
    if isinstance(value, Mapping):
        return {k: _as_sent(v) for k, v in value.items()}
    return value


def decode_json_body(body: Any, *, max_elements: int) -> dict[str, Any]:
    """Decode the tensor fields of a JSON request body into numpy arrays."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    fields = dict(body)
    try:
        for name in TENSOR_FIELDS:
            value = fields.get(name)
            # a model's named inputs: an object of tensors (a tensor's {dtype, shape, data}
            # object is told apart by its dtype, a string where named inputs hold tensors)
            if (name == "inputs" and isinstance(value, dict)
                    and not isinstance(value.get("dtype"), str)):
                fields[name] = {k: array_from_json(v, name=f"inputs.{k}", max_elements=max_elements)
                                for k, v in value.items()}
            elif value is not None:
                fields[name] = array_from_json(value, name=name, max_elements=max_elements)
        for name in TENSOR_DICT_FIELDS:
            group = fields.get(name)
            if group is None:
                continue
            if not isinstance(group, dict):
                raise BadRequest(f"'{name}' must be an object mapping parameter names to tensors")
            fields[name] = {k: array_from_json(v, name=f"{name}.{k}", max_elements=max_elements)
                            for k, v in group.items()}
    except TooLarge as exc:
        raise naming_setting(exc, "max_elements", max_elements) from None
    return fields


def _decode_json(body: bytes, settings: Settings) -> dict[str, Any]:
    return decode_json_body(loads(body), max_elements=settings.max_elements)


def loads(body: bytes) -> Any:
    """orjson's parse; the standard library's only for what orjson refuses.

    The fallback keeps the extensions JSON clients commonly write (``NaN``, ``Infinity``, numbers
    past float's range) meaning what they did, so validation answers them as before. orjson
    reads an integer past 64 bits as a float: an integer field holds a whole float to its range
    as the integer (:meth:`psgrad._contract.Field.integer`).
    """
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the body is not valid JSON: {exc}"[:300]) from None


TENSORS = frozenset(TENSOR_FIELDS)  # a gradients request's fields sent as one tensor
_GROUPS = frozenset(("inputs", *TENSOR_DICT_FIELDS))  # ... or as a group: 'name/<key>'


def tensors_where_taken(fields: Mapping[str, Any], known: frozenset[str],
                        tensors: frozenset[str]) -> None:
    """A 400 for a safetensors body's tensor under a field the route ``known`` takes in
    another form: a field that is no tensor (``model``, ``seed``: JSON in the metadata), or
    one tensor sent as a group (``name/<key>``). A field no route knows: :func:`precheck`."""
    for name, value in fields.items():
        group = isinstance(value, dict)
        sent = (any(isinstance(v, np.ndarray) for v in value.values()) if group
                else isinstance(value, np.ndarray))
        if not sent or name not in known or name in (_GROUPS if group else tensors):
            continue
        tensor = f"{name}/{next(iter(value))}" if group else name
        if group and name in tensors:
            raise BadRequest(f"tensor '{tensor}': '{name}' is one tensor, not a group: name it "
                             f"'{name}'")
        raise BadRequest(
            f"tensor '{tensor}': '{name}' is not a tensor: send it as JSON in the metadata key "
            f"'{REQUEST_KEY}' (as tensors: {', '.join(sorted(tensors))}, and "
            f"{', '.join(n + '/<key>' for n in sorted(_GROUPS))})")


def _decode_safetensors(body: bytes, settings: Settings) -> dict[str, Any]:
    fields = fields_from_safetensors(body, REQUEST_KEY)
    for name, value in fields.items():
        arrays = value.values() if isinstance(value, dict) else [value]
        for arr in arrays:
            if isinstance(arr, np.ndarray) and arr.size > settings.max_elements:
                raise TooLarge(
                    f"tensor '{name}' has {arr.size} elements; the limit is "
                    f"{settings.max_elements}: "
                    f"{raise_setting('max_elements', settings.max_elements)}",
                    limit=settings.max_elements,
                )
    return fields


def wants_safetensors(request: Request) -> bool:
    accept = request.headers.get("accept", "")
    return any(media_type(part) == SAFETENSORS for part in accept.split(","))


async def encode_result(
    request: Request,
    result: dict[str, Any],
    *,
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> Response:
    """The answer in the form the client accepts (encoded in a thread: it may be 300 MB)."""
    if wants_safetensors(request):
        parts = safetensors_parts(result, RESPONSE_KEY)  # views of the arrays: no copy
        size = parts_size(parts)
        if size <= INLINE_BYTES:  # one write: a streamed body costs a task and a cancel scope
            return Response(b"".join(parts), status_code=status, media_type=SAFETENSORS,
                            headers=headers)
        return ReleasingResponse(
            _chunks(parts),
            status_code=status,
            media_type=SAFETENSORS,
            headers={**(headers or {}), "content-length": str(size)},
        )
    return await json_response(result, status=status, headers=headers)


async def json_response(
    doc: dict[str, Any], *, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    """``doc`` (arrays anywhere in it as nested lists) as JSON; a large one is streamed.

    Streaming encodes one sample row at a time (in a thread), so a large answer never holds
    the whole JSON text or all its Python floats at once. bfloat16 answers are written as the
    float32 numbers they are.
    """
    doc = widen_answers(doc)
    if _array_bytes(doc) <= INLINE_BYTES:
        return Response(
            dumps(fields_to_json_deep(doc)), status_code=status, media_type=JSON, headers=headers
        )
    return ReleasingResponse(_json_pieces(doc), status_code=status, media_type=JSON,
                             headers=headers)


class ReleasingResponse(StreamingResponse):
    """A streamed answer that lets go of its arrays as soon as it ends, however it ends.

    A client that hangs up mid-transfer ends the stream with a cancellation whose traceback
    holds the streaming frames, and asyncio keeps that exception in a reference cycle (the
    task holds it, its frames hold the task): whatever those frames reach lives until the
    cyclic collector next runs, which with nothing else allocating is the next request. So the
    body iterator is closed and dropped here, and the iterators release what they hold in a
    ``finally`` (issue 53, finding 8).
    """

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            body, self.body_iterator = self.body_iterator, _nothing()
            close = getattr(body, "aclose", None)
            if close is not None:
                await close()


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""  # pragma: no cover  (makes this an async generator)


async def _json_pieces(doc: dict[str, Any]) -> AsyncIterator[bytes]:
    """:func:`json_chunks` of ``doc``, each piece encoded in a thread.

    Starlette's own thread iteration keeps the generator (and so ``doc``) in its frame, which
    a client's hang-up leaves in a traceback; here the generator is closed on the way out.
    """
    pieces = json_chunks(doc)
    del doc
    try:
        while (piece := await run_in_threadpool(next, pieces, None)) is not None:
            yield piece
    finally:
        pieces.close()  # its frame, and the answer with it, go now


def _array_bytes(value: Any) -> int:
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, dict):
        return sum(_array_bytes(v) for v in value.values())
    return 0


def fields_to_json_deep(value: Any) -> Any:
    """``value`` with every array widened (see :func:`dumps`), ready for orjson."""
    if isinstance(value, np.ndarray):
        return _wide(value)
    if isinstance(value, dict):
        return {k: fields_to_json_deep(v) for k, v in value.items()}
    return value


def _wide(arr: np.ndarray) -> np.ndarray:
    if arr.dtype.kind == "f" and arr.dtype.itemsize < 8:
        return arr.astype(np.float64)
    return arr


def json_chunks(value: Any) -> Generator[bytes, None, None]:
    """The JSON text of ``value`` in pieces: arrays a block of rows at a time, the rest whole."""
    if isinstance(value, np.ndarray):
        if value.ndim == 0 or value.size == 0 or value.nbytes <= JSON_CHUNK:
            yield dumps(_wide(value))
            return
        rows = max(1, JSON_CHUNK * value.shape[0] // value.nbytes)
        yield b"["
        for start in range(0, value.shape[0], rows):
            # orjson encodes the block as a list of rows; its brackets are the answer's
            block = _wide(value[start : start + rows])
            yield (b"," if start else b"") + dumps(block)[1:-1]
        yield b"]"
    elif isinstance(value, dict) and _array_bytes(value):
        yield b"{"
        for i, (key, item) in enumerate(value.items()):
            yield (b"," if i else b"") + dumps(str(key)) + b":"
            yield from json_chunks(item)
        yield b"}"
    else:
        yield dumps(value)


async def _chunks(parts: list[bytes | memoryview]) -> AsyncIterator[bytes | memoryview]:
    for part in parts:
        for start in range(0, len(part), STREAM_CHUNK):
            yield part[start : start + STREAM_CHUNK]


_ORJSON = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS


def dumps(doc: Any) -> bytes:
    """``doc`` as compact JSON; NaN and infinities as ``null``; numpy arrays and scalars native.

    orjson writes numpy arrays without making Python floats, which is what makes large JSON
    answers cheap. Callers widen float32 arrays first (:func:`fields_to_json_deep`), so an answer
    reads back to the same numbers as ``tolist()`` gives; integers past 64 bits take the
    standard library.
    """
    try:
        return orjson.dumps(doc, default=_widen, option=_ORJSON)
    except orjson.JSONEncodeError:
        pass
    try:
        return json.dumps(doc, allow_nan=False, separators=(",", ":"), default=_widen).encode()
    except ValueError:
        return json.dumps(
            _finite(doc), allow_nan=False, separators=(",", ":"), default=_widen
        ).encode()


def _widen(value: Any) -> Any:
    """What orjson hands back: arrays it does not write itself (non-contiguous, float16)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, list):
        return [_finite(v) for v in value]
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (np.ndarray, np.generic)):
        return _finite(_widen(value))
    return value
