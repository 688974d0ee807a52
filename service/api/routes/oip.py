"""The Open Inference Protocol (v2: KServe's, Triton's, MLServer's) beside psgrad's own routes.

A client that speaks the protocol (``tritonclient``, KServe's) calls psgrad unchanged:

- ``GET /v2/health/live``, ``GET /v2/health/ready``, ``GET /v2`` (server metadata),
  ``GET /v2/models/{name}[/versions/{version}]`` (model metadata) and ``.../ready``;
- ``POST /v2/models/{name}[/versions/{version}]/infer``: the request's input tensors are the
  gradients request's tensor fields by name (``inputs``, ``targets``, ``mask``, a named input,
  ``weights/<param>``, ``reference/<param>``, as in a safetensors body), its ``parameters`` the
  other fields (``loss``, ``clip_norm``, ``noise_multiplier``, ``seed``, ``outputs`` as a list
  or a comma-separated string, ...). The outputs asked for by name (``norms``, ``gns``,
  ``grads/<param>``, ``clipped_mean/<param>``, ...) say what is computed; without them,
  ``parameters.outputs`` does (default ``norms``) and every field of those outputs is answered.
  Tensors travel as JSON ``data`` (flat, row-major) or, with Triton's binary-data extension
  (``Inference-Header-Content-Length``), as raw bytes after the JSON header, both ways.

The request runs exactly as ``POST /per-sample-grads`` runs it (the same checks, queue, keys and
tenants); errors are the protocol's ``{"error": "<message>"}`` with psgrad's status codes.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, ValidationError
from starlette.concurrency import run_in_threadpool

from psgrad import __version__
from psgrad._contract import KNOWN, OUTPUTS, answer_fields, shown
from psgrad._errors import BadRequest, InvalidInput, TooLarge
from psgrad._wire import widen_answers
from service.api.body import INLINE_BYTES, TENSORS, dumps, loads, read_body, tensors_where_taken
from service.api.deps import IdempotencyKey, StateDep, TenantDep
from service.api.docs import schema_ref
from service.api.errors import schema_refusal
from service.api.routes.grads import answer_of, submit_fields
from service.api.schemas import ERRORS
from service.config import raise_setting
from service.losses import LOSSES
from service.outputs import OUTPUTS as SERVED

router = APIRouter(prefix="/v2", tags=["open inference protocol"])

HEADER_LENGTH = "Inference-Header-Content-Length"
DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "INT8": np.int8, "INT16": np.int16,
             "INT32": np.int32, "INT64": np.int64, "UINT16": np.uint16, "UINT32": np.uint32,
             "UINT64": np.uint64, "FP16": np.float16, "FP32": np.float32, "FP64": np.float64}
NAMES = {np.dtype(t): name for name, t in DATATYPES.items()}
DEFAULT_OUTPUTS = ["norms"]


class ProtocolError(BaseModel):
    """An error, as the protocol shapes it."""

    error: str = Field(description="what went wrong and what to do")


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: {"model": ProtocolError, "description": ERRORS[c]["description"]} for c in codes}


class InferTensor(BaseModel):
    """One input tensor: its values in ``data`` (flat, row-major) or, with Triton's
    binary-data extension, ``parameters.binary_data_size`` bytes after the JSON header."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="a gradients request's tensor field: inputs, targets, mask, "
                      "a named input, weights/<param>, reference/<param>, ...")
    shape: list[Annotated[int, Field(ge=0, le=2**63 - 1)]]
    datatype: Literal["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "UINT16", "UINT32",
                      "UINT64", "FP16", "FP32", "FP64"]
    data: list[Any] | None = None
    parameters: TensorParameters | None = None


class TensorParameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    binary_data_size: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = Field(
        None, description="the tensor's bytes after the JSON header (binary-data extension)")


class OutputParameters(BaseModel):
    model_config = ConfigDict(extra="allow")
    binary_data: StrictBool | None = Field(None, description="true: answer it as bytes")


class RequestParameters(BaseModel):
    """A gradients request's fields (checked as that request's), and the protocol's own."""

    model_config = ConfigDict(extra="allow")
    binary_data_output: StrictBool = Field(False, description="true: answer every output as "
                                           "bytes unless it says otherwise")


class RequestedOutput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(description="an output (norms, gns, ...) or <output>/<param>")
    parameters: OutputParameters | None = None


class InferRequest(BaseModel):
    """The protocol's inference request; ``parameters`` are psgrad's request fields (loss,
    clip_norm, noise_multiplier, seed, outputs, ...) and ``binary_data_output``."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    inputs: list[InferTensor]
    outputs: list[RequestedOutput] | None = None
    parameters: RequestParameters | None = None


INFER: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "the protocol's inference request: JSON, or with Triton's binary-data "
        "extension its JSON header (Inference-Header-Content-Length bytes) and the tensors' "
        "bytes after it",
        "content": {"application/json": {"schema": schema_ref(InferRequest)},
                    "application/octet-stream": {"schema": {"type": "string",
                                                            "format": "binary"}}},
    }
}


@router.get("/health/live", summary="Open Inference Protocol: the process is up")
async def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready", summary="Open Inference Protocol: ready (as /readyz)",
            responses=_errors(503))
async def ready(state: StateDep) -> JSONResponse:
    up = await _ready(state)
    return JSONResponse({"ready": up}, status_code=200 if up else 503)


@router.get("", summary="Open Inference Protocol: server metadata")
async def server_metadata() -> dict[str, Any]:
    return {"name": "psgrad", "version": __version__,
            "extensions": ["binary_tensor_data", "parameters"]}


@router.get("/models/{name}", summary="Open Inference Protocol: model metadata",
            responses=_errors(401, 403, 404, 422))
async def model_metadata(name: str, state: StateDep, _tenant: TenantDep) -> dict[str, Any]:
    """The model's tensors in the protocol's terms: the gradients request's tensor fields in,
    every output's fields out (``-1``: the batch)."""
    return _metadata(state, name, None)


@router.get("/models/{name}/versions/{version}", include_in_schema=False)
async def version_metadata(name: str, version: str, state: StateDep, _tenant: TenantDep
                           ) -> dict[str, Any]:
    return _metadata(state, name, version)


@router.get("/models/{name}/ready", summary="Open Inference Protocol: model ready",
            responses=_errors(401, 403, 404, 422, 503))
async def model_ready(name: str, state: StateDep, _tenant: TenantDep) -> JSONResponse:
    return await _model_ready(state, name, None)


@router.get("/models/{name}/versions/{version}/ready", include_in_schema=False)
async def version_ready(name: str, version: str, state: StateDep, _tenant: TenantDep
                        ) -> JSONResponse:
    return await _model_ready(state, name, version)


@router.post("/models/{name}/infer", summary="Open Inference Protocol: per-sample gradients",
             openapi_extra=INFER, responses={
                 200: {"description": "the protocol's inference response: JSON, or its JSON "
                       "header and the binary outputs' bytes",
                       "content": {"application/octet-stream": {
                           "schema": {"type": "string", "format": "binary"}}}},
                 **_errors(400, 401, 403, 404, 409, 413, 415, 422, 500, 503, 504)})
async def infer(name: str, request: Request, state: StateDep, tenant: TenantDep,
                key: IdempotencyKey = None) -> Response:
    """One gradients request in the protocol's form; see the module's description. With an
    ``Idempotency-Key`` (a DP step's, whose answer cannot be computed again), as for
    ``POST /per-sample-grads``: a try sent again answers the first's job, kept until ``DELETE``
    of the ``Content-Location`` it names."""
    return await _infer(name, None, request, state, tenant, key)


@router.post("/models/{name}/versions/{version}/infer", include_in_schema=False)
async def version_infer(name: str, version: str, request: Request, state: StateDep,
                        tenant: TenantDep, key: IdempotencyKey = None) -> Response:
    return await _infer(name, version, request, state, tenant, key)


def _metadata(state: StateDep, name: str, version: str | None) -> dict[str, Any]:
    doc = state.registry.describe(_ref(name, version))
    return {"name": name, "versions": doc.get("versions", [doc["version"]]),
            "platform": "psgrad", "inputs": _inputs(doc), "outputs": _outputs(doc)}


async def _model_ready(state: StateDep, name: str, version: str | None) -> JSONResponse:
    state.registry.describe(_ref(name, version))  # 404 for an unknown model or version
    up = await _ready(state)
    return JSONResponse({"name": name, "ready": up}, status_code=200 if up else 503)


async def _infer(name: str, version: str | None, request: Request, state: StateDep,
                 tenant: TenantDep, key: str | None) -> Response:
    body = await read_body(request, state.settings.max_body_bytes)
    if len(body) > INLINE_BYTES:  # a large body is parsed off the event loop
        doc, fields, asked = await run_in_threadpool(_read, body, request, state)
    else:
        doc, fields, asked = _read(body, request, state)
    fields["model"] = _ref(name, version)
    job, queued = await submit_fields(fields, state, tenant, key=key)
    result = await answer_of(state, job, kept=key is not None, fresh=queued and key is None)
    response = _response(name, doc, result, asked, fields["outputs"])
    if key is not None:  # kept: its caller DELETEs it once the answer is in hand
        response.headers["Content-Location"] = f"/jobs/{job.id}"
    return response


async def _ready(state: StateDep) -> bool:
    try:
        return await state.ready()
    except Exception:
        return False


def _ref(name: str, version: str | None) -> str:
    return name if version is None else f"{name}@{version}"


def _inputs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc["input"]
    named = spec.get("inputs")
    inputs = ([{"name": k, "datatype": _datatype(v.get("dtype", "float32")),
                "shape": [-1, *v["shape"]]} for k, v in named.items()] if isinstance(named, dict)
              else [{"name": "inputs", "datatype": _datatype(spec.get("dtype", "float32")),
                     "shape": [-1, *spec["shape"]]}])
    loss = LOSSES[doc["default_loss"]]
    if "targets" in loss.needs:
        targets = ([-1, -1] if loss.tokens else [-1] if loss.classification
                   else [-1, *doc["output"]["shape"]])
        inputs.append({"name": "targets", "shape": targets,
                       "datatype": "INT64" if loss.classification or loss.tokens else "FP32"})
    if loss.tokens:
        inputs.append({"name": "mask", "datatype": "FP32", "shape": [-1, -1]})
    if "next_inputs" in loss.needs:  # td0: the next states, rewards and episode ends
        inputs += [{**inputs[0], "name": "next_inputs"},
                   {"name": "rewards", "datatype": "FP32", "shape": [-1]},
                   {"name": "dones", "datatype": "FP32", "shape": [-1]}]
    return inputs


def _outputs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    params = {k: v["shape"] for k, v in doc["parameters"].items()}
    held = str(next(iter(doc["parameters"].values()), {"dtype": "float32"})["dtype"])
    kind = "FP32" if held == "bfloat16" else _datatype(held)  # bfloat16's: widened, exactly
    out = []
    for o in OUTPUTS:
        if o.td0_only and "td0" not in doc["losses"]:
            continue
        wide = [-1] if SERVED[o.name].width is not None else []  # [B, k], [B, M]
        for field in answer_fields([o.name]):
            batch = [-1] if o.per_sample else []
            if not o.per_param:
                out.append({"name": field, "datatype": kind, "shape": [*batch, *wide]})
                continue
            for param, shape in params.items():
                out.append({"name": f"{field}/{param}", "datatype": kind,
                            "shape": [*batch, *(shape if o.per_param_tensor else [])]})
    return out


def _datatype(dtype: str) -> str:
    return NAMES.get(np.dtype(dtype), "FP32")


def _read(body: bytes, request: Request, state: StateDep
          ) -> tuple[dict[str, Any], dict[str, Any], dict[str, bool]]:
    """The request's JSON header, the gradients request's fields and the outputs asked for
    by name."""
    doc, binary = _split(body, request.headers.get(HEADER_LENGTH))
    return doc, *_fields(doc, binary, state.settings.max_elements)


def _split(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """The JSON header and the binary tensor data after it (Triton's extension)."""
    if header_length is None:
        header, binary = body, b""
    else:
        try:
            n = int(header_length)
        except ValueError:
            raise BadRequest(f"{HEADER_LENGTH} must be a byte count; got {shown(header_length)}"
                             ) from None
        if not 0 <= n <= len(body):
            raise BadRequest(f"{HEADER_LENGTH} is {n} but the body has {len(body)} bytes")
        header, binary = body[:n], body[n:]
    try:  # what is read below is as InferRequest reads it (a shape's 8.0 as 8), what was set
        doc = InferRequest.model_validate(loads(header)).model_dump(exclude_unset=True)
    except ValidationError as exc:
        raise schema_refusal(exc.errors(), InferRequest.model_fields, "the inference request"
                             ) from None
    return doc, binary


def _fields(doc: dict[str, Any], binary: bytes, max_elements: int
            ) -> tuple[dict[str, Any], dict[str, bool]]:
    """The gradients request's fields, and the outputs asked for by name (binary or not)."""
    params = dict(doc.get("parameters") or {})
    binary_default = params.pop("binary_data_output", False)
    fields: dict[str, Any] = {k: v for k, v in params.items() if k != "binary_data_size"}
    offset = 0
    for spec in doc["inputs"]:
        arr, used = _tensor(spec, binary, offset, max_elements)
        offset += used
        field, _, param = spec["name"].partition("/")
        twice = not isinstance(fields.setdefault(field, {}), dict) if param else field in fields
        if twice:
            raise BadRequest(f"input '{spec['name']}': '{field}' is sent twice (as a parameter "
                             "or another input)")
        if param:
            fields[field][param] = arr
        else:
            fields[field] = arr
    tensors_where_taken(fields, KNOWN, TENSORS)  # 'seed' as an input: a parameter
    if offset != len(binary):
        raise InvalidInput(f"the inputs' binary_data_size add up to {offset} bytes; the body has "
                           f"{len(binary)} after the JSON header")
    asked: dict[str, bool] = {}
    for spec in doc.get("outputs") or []:
        out_params = spec.get("parameters") or {}
        binary_data = out_params.get("binary_data")
        asked[spec["name"]] = binary_default if binary_data is None else binary_data
    outputs = fields.get("outputs")
    if isinstance(outputs, str):
        outputs = [o.strip() for o in outputs.split(",") if o.strip()]
    if outputs is not None and not (isinstance(outputs, list)
                                    and all(isinstance(o, str) for o in outputs)):
        raise BadRequest(f"parameters.outputs must be a list of output names or a "
                         f"comma-separated string of them; got {shown(outputs)}")
    named = list(dict.fromkeys(_output_of(n) for n in asked))
    fields["outputs"] = list(dict.fromkeys([*(outputs or []), *named])) or DEFAULT_OUTPUTS
    if not asked and binary_default:
        asked = {"*": True}
    return fields, asked


def _output_of(field: str) -> str:
    """The output a requested tensor belongs to: ``grads/fc1.weight`` to ``grads``,
    ``gns_trace`` to ``gns``."""
    name = field.partition("/")[0]
    for o in OUTPUTS:
        if name == o.name or name in o.also:
            return o.name
    raise InvalidInput(f"unknown output tensor '{field}': an output's name, or "
                       f"'<output>/<param>' for one per parameter; see GET /v2/models/{{name}}")


def _tensor(spec: Any, binary: bytes, offset: int, max_elements: int
            ) -> tuple[np.ndarray, int]:
    """One input tensor from its JSON ``data`` or its bytes at ``offset``; the bytes used."""
    name, shape, datatype = spec["name"], spec["shape"], spec["datatype"]
    count = math.prod(shape)  # Python's integers: a huge shape does not wrap around
    if count > max_elements:
        raise TooLarge(f"input '{name}' has {count} elements; the limit is {max_elements}: "
                       f"{raise_setting('max_elements', max_elements)}", limit=max_elements)
    dtype = np.dtype(DATATYPES[datatype])
    size = (spec.get("parameters") or {}).get("binary_data_size")
    if size is not None:
        if size != count * dtype.itemsize or offset + size > len(binary):
            raise InvalidInput(f"input '{name}': binary_data_size {size} does not hold {shape} "
                               f"{datatype} ({count * dtype.itemsize} bytes) in the "
                               f"{len(binary) - offset} bytes left after the JSON header")
        return np.frombuffer(binary, dtype.newbyteorder("<"), count, offset).reshape(shape), size
    try:
        arr = np.asarray(spec.get("data"), dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise InvalidInput(f"input '{name}': its data are not {datatype} numbers (each within "
                           f"{datatype}'s range)") from exc
    if arr.size != count:
        raise InvalidInput(f"input '{name}': {arr.size} values for shape {shape}")
    return arr.reshape(shape), 0


def _response(name: str, doc: dict[str, Any], result: dict[str, Any], asked: dict[str, bool],
              outputs: list[str]) -> Response:
    tensors: dict[str, np.ndarray] = {}
    result = widen_answers(result)  # bfloat16 answers as the float32 numbers they are
    for field in answer_fields(outputs):
        value = result.get(field)
        for key, arr in (value.items() if isinstance(value, dict) else [(None, value)]):
            if isinstance(arr, np.ndarray):
                tensors[field if key is None else f"{field}/{key}"] = arr
    wanted = [n for n in asked if n != "*"] or list(tensors)
    missing = [n for n in wanted if n not in tensors]
    if missing:
        raise InvalidInput(f"no output tensor named {', '.join(map(repr, missing))}; this answer "
                           f"has {', '.join(tensors)}")
    blobs: list[bytes] = []
    described = []
    for n in wanted:
        arr = np.asarray(tensors[n], order="C")  # ascontiguousarray makes 0-d 1-d
        out: dict[str, Any] = {"name": n, "datatype": NAMES.get(arr.dtype, "FP32"),
                               "shape": list(arr.shape)}
        if asked.get(n, asked.get("*", False)):
            data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
            out["parameters"] = {"binary_data_size": len(data)}
            blobs.append(data)
        else:
            out["data"] = arr.reshape(-1).tolist()
        described.append(out)
    model = str(result.get("model", name))
    parameters = {"batch_size": result.get("batch_size"), "loss": result.get("loss"),
                  "model": model}
    seed = (result.get("meta") or {}).get("seed")
    if seed is not None:  # the clipped mean's noise seed
        parameters["seed"] = seed
    for k, v in (result.get("dp") or {}).items():  # a DP step's: the privacy spent so far
        parameters[f"dp_{k}"] = v
    body: dict[str, Any] = {"model_name": name, "model_version": model.partition("@")[2],
                            "parameters": parameters, "outputs": described}
    if "id" in doc:
        body["id"] = doc["id"]
    header = dumps(body)  # a value that is not finite as null, as POST /per-sample-grads does
    if not blobs:
        return Response(header, media_type="application/json")
    return Response(header + b"".join(blobs), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(header))})
