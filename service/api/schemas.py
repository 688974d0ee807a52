"""Pydantic models of the bodies: each route's one model of what it takes, and of its answers.

A body is read by :mod:`service.api.body` (JSON or safetensors, size-limited, decoded off the
event loop) and held to its route's model there, at the door (:func:`service.api.body.conform`):
the same model that ``/docs`` and ``/openapi.json`` show. What needs the model (shapes, parameter
names, a loss against the model's kind) is :mod:`service.validate`'s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from psgrad._contract import (
    ID_PATTERN,
    OUTPUTS,
    REF_PATTERN,
    REQUEST,
    TENSOR_DICT_FIELDS,
    TENSOR_FIELDS,
    field,
)
from psgrad._contract import TENSOR_DOC as TENSOR_DOC  # the stores read it here
from psgrad._contract import Field as ContractField
from service.losses import LOSSES
from service.reference_sets import BATCH_FIELDS, FIXED_FIELDS

DTYPE = Literal["float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool"]


class TensorB64(BaseModel):
    """A tensor as base64 of its little-endian row-major bytes (compact; exact for floats)."""

    model_config = ConfigDict(extra="forbid")
    dtype: DTYPE = Field(description="element type")
    shape: list[int] = Field(description="dimensions, first the batch dimension B where it has one")
    data: str = Field(
        description="base64 of the little-endian row-major bytes (prod(shape) * itemsize)"
    )


Tensor = list[Any] | TensorB64 | float | int
# What validation enforces, stated where OpenAPI can say it (patterns anchored: JSON Schema's
# ``pattern`` matches anywhere).
MODEL_ID = f"^{ID_PATTERN}$"
MODEL_REF = f"^{REF_PATTERN}$"


def contract_field(spec: ContractField, required: bool | None = None) -> tuple[Any, Any]:
    """A request field of the contract as pydantic's (type, Field): what OpenAPI documents and
    the door checks before queueing. ``required``: other than the contract says (a body
    that shares the field, e.g. a store's)."""
    kind = spec.kind
    choices = LOSSES.names() if spec.registry == "losses" else spec.choices
    typ: Any
    if kind == "inputs":
        typ = Tensor | dict[str, Tensor]
    elif kind == "tensor":
        typ = Tensor
    elif kind == "tensors":
        typ = dict[str, Tensor]
    elif kind == "names" and choices:
        one = Literal[tuple(choices)]  # type: ignore[valid-type]
        typ = list[one] | one  # type: ignore[valid-type]
    elif kind == "names":
        typ = list[str]
    elif kind == "choice":
        typ = Literal[(*choices, "") if spec.blank else tuple(choices or ())]  # type: ignore
    else:
        typ = {"ref": str, "int": int, "float": float}[kind]
    limits = {k: getattr(spec, k) for k in ("gt", "ge", "lt", "le") if getattr(spec, k) is not None}
    if kind == "names" and not choices:
        limits["min_length"] = 1
    if spec.pattern is not None:
        limits["pattern"] = f"^{spec.pattern}$"  # JSON Schema's ``pattern`` matches anywhere
    extra = None if spec.default is None else {"default": spec.default}
    if spec.required if required is None else required:
        return typ, Field(description=spec.doc, **limits)
    return typ | None, Field(None, description=spec.doc, json_schema_extra=extra, **limits)


def contract_fields(*names: str, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The contract's fields ``names`` as ``create_model`` takes them (``required``: these are,
    whatever the contract says; the others optional)."""
    return {n: contract_field(field(n), n in required) for n in names}


REQUEST_FIELDS: dict[str, Any] = {spec.name: contract_field(spec) for spec in REQUEST}
_AS_TENSORS = ", ".join([  # the safetensors form's tensors, as the contract declares them
    *(f"``{n}``" + (" or ``inputs/<name>``" if n == "inputs" else "") for n in TENSOR_FIELDS),
    *(f"``{n}/<param>``" for n in TENSOR_DICT_FIELDS)])
GradsRequest = create_model(  # the body of POST /per-sample-grads and POST /jobs (JSON form)
    "GradsRequest",
    __config__=ConfigDict(extra="forbid"),
    __doc__=f"""The body of ``POST /per-sample-grads`` and ``POST /jobs`` (JSON form).

    The safetensors form (``Content-Type: application/x-safetensors``) carries the tensor fields
    as tensors ({_AS_TENSORS}) and the other fields as JSON in the metadata key ``request``.
    Every field is declared in ``psgrad._contract``.
    """,
    **REQUEST_FIELDS,
)


class StoreRequest(BaseModel):
    """A body addressed to a store: the store fixes its model, which may be sent."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, pattern=MODEL_REF, description="the store's model, if sent")


SampleBatch = create_model(  # the batch's fields: the request contract's
    "SampleBatch",
    __base__=StoreRequest,
    __doc__="""Test or training samples; the store fixes the model version, loss, parameters
    and projection (sending them is allowed only with the store's own values); verify and
    verify_seed as in a gradients request.""",
    **contract_fields(*(f for f in BATCH_FIELDS if f != "model"), *FIXED_FIELDS),
)
ReferenceSetBody = create_model(
    "ReferenceSetBody",
    __base__=SampleBatch,
    __doc__="""A batch and how its rows are made: the sketches (``projection_dim``) or full
    gradients a reference set keeps. The safetensors form as for ``GradsRequest``.""",
    **contract_fields("model", "inputs", required=("model", "inputs")),
)


class Timing(BaseModel):
    queue_ms: float = Field(description="time the job waited in the queue")
    compute_ms: float = Field(
        description="time of the engine call that computed it (shared by the jobs batched with it)"
    )


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(description="the model version that computed it: 'id@version'")
    batch_size: int = Field(description="B, the number of samples")
    loss: str = Field(description="the loss used")


OUTPUT_FIELDS: dict[str, Any] = {
    name: ((dict[str, Tensor] if o.per_param else Tensor) | None,
           Field(None, description=o.doc if name == o.name
                 else f"answered with '{o.name}': see its description"))
    for o in OUTPUTS for name in (o.name, *o.also)
}
GradsResponse = create_model(
    "GradsResponse",
    __base__=_Answer,
    __doc__="""The JSON answer; with ``Accept: application/x-safetensors`` the tensors are
    named ``grads/<param>``, ``norms``, ``layer_norms/<param>``, ``mean/<param>``, ... and the
    other fields are JSON in the metadata key ``response``. Every output is declared in
    ``psgrad._contract``.""",
    **OUTPUT_FIELDS,
    timing=(Timing, ...),
    dp=(dict[str, Any] | None, Field(
        None, description="dp_run requests: run, steps (counted so far, this one included), "
        "epsilon (spent so far under the run's accountant), delta, accountant, max_epsilon")),
    meta=(dict[str, Any], Field(
        description="how it was computed: route (vmap: batched with torch.func; loop: the "
        "per-sample loop, for layers vmap cannot batch; fast_stats: statistics without every "
        "per-sample gradient), chunk_size, method per parameter, form (fast_stats only), "
        "batch_jobs and batch_samples of the engine call, seed (clipped_mean: the noise seed), "
        "projection and projection_kind (sketches), verify (when verified: samples, seed, "
        "source, max_abs_diff, tolerance {atol, rtol}, checked {output: max_abs_diff}, ms)")),
)


class ErrorInfo(BaseModel):
    code: str = Field(description="snake_case error code, e.g. unknown_model, too_large")
    message: str = Field(description="what is wrong and what to do")
    details: dict[str, Any] = Field(description="facts for programs: limits, known names, ...")


class ErrorBody(BaseModel):
    """Every error answer."""

    error: ErrorInfo


JobStatusName = Literal["queued", "running", "succeeded", "failed", "canceled"]


class JobCreated(BaseModel):
    job_id: str = Field(description="poll GET /jobs/{job_id}")
    status: JobStatusName


class JobView(BaseModel):
    job_id: str
    status: JobStatusName
    enqueued_at: float | None = Field(None, description="epoch seconds")
    finished_at: float | None = Field(None, description="epoch seconds")
    planning_s: float = Field(0.0, description="seconds its worker has spent planning the "
                              "model for it (a cold start; not counted against the deadline)")
    result: GradsResponse | None = Field(  # type: ignore[valid-type]
        None, description="once succeeded")
    error: ErrorInfo | None = Field(None, description="once failed")


class JobDeleted(JobView):
    deleted: Literal["canceled", "removed"] = Field(
        description="canceled: it was queued or running and is now canceled (readable until "
        "PSGRAD_RESULT_TTL_S); removed: it had finished (perhaps during this call: its status "
        "says how) and is gone with its result (GET answers 404 from now on)")


class TensorInfo(BaseModel):
    shape: list[int]
    dtype: str


class WarmupShape(BaseModel):
    batch_size: int
    length: int | None = Field(description="null: the samples' one fixed shape")
    job: str | None = Field(description="the job computing it (null: never queued, see error)")
    status: JobStatusName
    planning_s: float = Field(0.0, description="seconds its worker spent planning the model")
    error: str | None = None


class Warmup(BaseModel):
    status: Literal["running", "succeeded", "failed"]
    done: int = Field(description="shapes computed")
    total: int
    asked_at: float = Field(description="epoch seconds")
    shapes: list[WarmupShape]


class ModelDoc(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    version: str = Field(description="content digest of architecture, config and weights")
    architecture: str
    config: dict[str, Any]
    default_loss: str
    losses: list[str]
    input: dict[str, Any] = Field(description="per-sample input: {shape, dtype}")
    output: dict[str, Any] = Field(description="per-sample output: {shape}")
    parameters: dict[str, TensorInfo] = Field(description="in the module's own order")
    versions: list[str] = Field(default_factory=list)
    warmup: Warmup | None = Field(None, description="the warm-up this version's registration "
                                  "asked for (PUT ?warmup=), and how far it got")


class ModelList(BaseModel):
    models: list[ModelDoc]


class ModelDeleted(BaseModel):
    id: str
    deleted: list[str] = Field(description="the versions removed")
    versions: list[str] = Field(description="the versions that remain, oldest first")


class ReferenceSetDoc(BaseModel):
    id: str
    tenant: str = Field(description="whose set it is: ids are each tenant's own")
    model: str = Field(description="the model version that computed it: 'id@version'")
    loss: str
    params: list[str]
    shapes: dict[str, list[int]]
    projection_dim: int | None = Field(description="k of the sketches; null: full gradients")
    projection_seed: int | None
    projection_kind: str | None = Field(description="the sketch's kind; null: full gradients")
    projection_version: int | None = Field(
        None, description="the kind's definition of its numbers when the set was made")
    count: int = Field(description="M, the samples it holds")
    created: float
    bytes: int


class Health(BaseModel):
    status: str
    version: str = Field(description="the server's psgrad version, e.g. 0.2.0")


class Ready(BaseModel):
    ready: bool
    broker: str
    queue_depth: int | None = None


ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        400: "malformed body, bad base64, ragged lists, ...",
        401: "missing or invalid API key",
        403: "an admin key is needed (registering and deleting models)",
        404: "unknown model, job or DP run",
        409: "conflict: a zoo model name used as a registered id; privacy_budget_exhausted",
        413: "body, batch or result too large (the message says the limit)",
        415: "the Content-Type is not one this route reads (the message names them)",
        422: "the request cannot be computed (shapes, dtypes, losses, outputs, ...)",
        503: "queue full or broker down: retry after the Retry-After header",
        500: "verification_failed: a verified answer (verify) differed from the per-sample "
        "loop, so it was withheld; internal_error: a bug",
        504: "the deadline passed",
        507: "insufficient_storage: the data directory is full, read-only or not writable "
        "(details.reason); nothing was written",
    }.items()
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: ERRORS[c] for c in codes}
