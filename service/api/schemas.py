"""Pydantic models of the JSON bodies: they document the api in OpenAPI.

Requests are parsed by :mod:`service.api.body` (JSON or safetensors, size-limited, decoded off the
event loop) and checked by :mod:`service.validate`; these models describe the same fields so that
``/docs`` and ``/openapi.json`` show every field with its meaning.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from psgrad._wire import MAX_VERIFY
from service.dp.runs import RUN_ID_RE
from service.losses import LOSSES
from service.model_store import ID_RE, REF_RE
from service.outputs import OUTPUTS
from service.strategies.projection import KINDS

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
MODEL_ID = f"^{ID_RE.pattern}$"
MODEL_REF = f"^{REF_RE.pattern}$"
LossName = Literal[tuple(LOSSES.names())]  # type: ignore[valid-type]
OutputName = Literal[tuple(OUTPUTS.names())]  # type: ignore[valid-type]
TENSOR_DOC = "a tensor: nested lists of numbers, or {dtype, shape, data} with base64 data"


class GradsRequest(BaseModel):
    """The body of ``POST /per-sample-grads`` and ``POST /jobs`` (JSON form).

    The safetensors form (``Content-Type: application/x-safetensors``) carries the tensor fields as
    tensors (``inputs``, ``targets``, ``next_inputs``, ``rewards``, ``dones``,
    ``weights/<param>``, ``reference/<param>``) and the other fields as JSON in the metadata key
    ``request``.
    """

    model_config = ConfigDict(extra="forbid")
    model: str = Field(
        description="a model id (see GET /models), or 'id@version'",
        examples=["mlp"],
        pattern=MODEL_REF,
    )
    inputs: Tensor | dict[str, Tensor] = Field(
        description=f"the batch, first dimension B; {TENSOR_DOC}; for a model with several "
        "inputs (GET /models/{id} lists them), an object {input name: tensor}"
    )
    targets: Tensor | None = Field(
        None, description="labels (class indices) or regression targets, first dimension B"
    )
    loss: LossName | Literal[""] | None = Field(  # type: ignore[valid-type]
        None, description="the loss; default (absent, null or ''): the model's default loss"
    )
    outputs: list[OutputName] | OutputName | None = Field(  # type: ignore[valid-type]
        None,
        description="what to return, a list or one name (default, also for []: ['grads']): "
        "grads, losses, norms, layer_norms, mean, variance, clipped_mean, dot, cosine_mean, "
        "td_errors, updates, projection, dots, influence, self_influence",
    )
    params: list[str] | None = Field(
        None,
        min_length=1,
        description="restrict every output to these parameters (names as in GET /models/{id})",
    )
    weights: dict[str, Tensor] | None = Field(
        None, description="{param: tensor}: parameter values to use for this call only"
    )
    clip_norm: float | None = Field(
        None, gt=0.0, description="clipped_mean: per-sample clipping norm (> 0)"
    )
    noise_multiplier: float | None = Field(
        None,
        ge=0.0,
        description="clipped_mean: Gaussian noise std as a multiple of clip_norm (>= 0)",
    )
    seed: int | None = Field(
        None, ge=0, lt=2**63, description="clipped_mean: noise seed (echoed in meta)"
    )
    mask: Tensor | None = Field(
        None, description="token losses: 1 for the positions that count, 0 for padding, [B, T]"
    )
    dp_run: str | None = Field(
        None,
        pattern=f"^{RUN_ID_RE.pattern}$",
        description="a DP run id (POST /dp-runs): this request is one DP-SGD step. "
        "outputs must be ['clipped_mean']; the run's clip_norm and noise_multiplier are used, the "
        "noise N(0, (noise_multiplier * clip_norm)^2) is drawn from the server's CSPRNG (no "
        "seed), the noisy sum is divided by the run's expected batch size, and the step is "
        "counted (409 privacy_budget_exhausted when the run has no step left)",
    )
    reference: dict[str, Tensor] | None = Field(
        None,
        description="{param: tensor} for the output dot: one tensor per selected parameter, of "
        "its shape",
    )
    next_inputs: Tensor | None = Field(None, description="td0: next states s', first dimension B")
    rewards: Tensor | None = Field(None, description="td0: rewards r, shape [B]")
    dones: Tensor | None = Field(None, description="td0: 1 where the episode ended, shape [B]")
    gamma: float | None = Field(
        None, ge=0.0, le=1.0, description="td0: discount in [0, 1] (default 1.0)"
    )
    projection_dim: int | None = Field(
        None, ge=1, le=8192, description="projection (and a projected self_influence): k"
    )
    projection_seed: int | None = Field(None, ge=0, description="the projection's seed (0)")
    projection_kind: Literal[KINDS] | None = Field(  # type: ignore[valid-type]
        None, description="the sketch: 'tensorsketch' (default; within 2x a dense Gaussian "
        "projection's error) or 'kronecker' (P_out (x) P_in, for sketches made with it)"
    )
    reference_sketches: Tensor | None = Field(
        None, description="dots: [M, k] sketches made with the same projection"
    )
    reference_set: str | None = Field(
        None, pattern=MODEL_ID, description="influence: a PUT /reference-sets id"
    )
    answer_dtype: Literal["float32", "float16", "bfloat16"] | None = Field(
        None,
        description="the answer's floating tensors: float32 (default), or float16 / bfloat16 for "
        "half the bytes (relative rounding error at most 2^-11 / 2^-8; float16 overflows past "
        "65504 and loses precision below 6.1e-5)",
    )
    verify: int | None = Field(
        None,
        ge=0,
        le=MAX_VERIFY,
        description="recompute this many samples (all, if the batch has fewer) one at a time "
        "with the per-sample loop and compare every output that can be compared; the report is "
        "meta.verify, and a difference beyond the tolerance fails the request with 500 "
        "verification_failed instead of answering. 0 or absent: the server's "
        "PSGRAD_VERIFY_FRACTION decides",
    )
    verify_seed: int | None = Field(
        None, ge=0, lt=2**63, description="picks the verified samples (default: the job id)"
    )


class Timing(BaseModel):
    queue_ms: float = Field(description="time the job waited in the queue")
    compute_ms: float = Field(
        description="time of the engine call that computed it (shared by the jobs batched with it)"
    )


class GradsResponse(BaseModel):
    """The JSON answer; with ``Accept: application/x-safetensors`` the tensors are named
    ``grads/<param>``, ``norms``, ``layer_norms/<param>``, ``mean/<param>``, ... and the other
    fields are JSON in the metadata key ``response``."""

    model_config = ConfigDict(extra="allow")
    model: str = Field(description="the model version that computed it: 'id@version'")
    batch_size: int = Field(description="B, the number of samples")
    loss: str = Field(description="the loss used")
    grads: dict[str, Tensor] | None = Field(None, description="{param: [B, *shape]}")
    losses: Tensor | None = Field(None, description="[B] per-sample loss")
    norms: Tensor | None = Field(None, description="[B] L2 norm of each sample's gradient")
    layer_norms: dict[str, Tensor] | None = Field(None, description="{param: [B]}")
    mean: dict[str, Tensor] | None = Field(None, description="{param: shape} mean gradient")
    variance: dict[str, Tensor] | None = Field(None, description="{param: shape} variance (1/B)")
    clipped_mean: dict[str, Tensor] | None = Field(
        None, description="{param: shape} DP-SGD mean of the clipped gradients, noised when "
        "noise_multiplier > 0"
    )
    dot: Tensor | None = Field(None, description="[B] dot product with 'reference'")
    cosine_mean: Tensor | None = Field(None, description="[B] cosine with the batch mean gradient")
    td_errors: Tensor | None = Field(None, description="td0: [B] TD errors delta")
    updates: dict[str, Tensor] | None = Field(
        None, description="td0: {param: [B, *shape]} delta_i * grad V(s_i)"
    )
    projection: Tensor | None = Field(None, description="[B, k] each sample's gradient sketch")
    dots: Tensor | None = Field(None, description="[B, M] dot products with the references")
    influence: Tensor | None = Field(None, description="[B, M] against the reference set")
    self_influence: Tensor | None = Field(None, description="[B] squared gradient norm")
    timing: Timing
    dp: dict[str, Any] | None = Field(
        None, description="dp_run requests: run, steps (counted so far, this one included), "
        "epsilon (spent so far under the run's accountant), delta, accountant, max_epsilon",
    )
    meta: dict[str, Any] = Field(
        description="how it was computed: route, chunk_size, method per parameter, path and "
        "form (fast statistics only), batch_jobs and batch_samples of the engine call, seed "
        "(clipped_mean: the noise seed), verify (when verified: samples, seed, source, "
        "max_abs_diff, tolerance {atol, rtol}, checked {output: max_abs_diff}, ms)"
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
    result: GradsResponse | None = Field(None, description="once succeeded")
    error: ErrorInfo | None = Field(None, description="once failed")


class JobDeleted(JobView):
    deleted: Literal["canceled", "removed"] = Field(
        description="canceled: it was queued or running and is now canceled (readable until "
        "PSGRAD_RESULT_TTL_S); removed: it had finished (perhaps during this call: its status "
        "says how) and is gone with its result (GET answers 404 from now on)")


class TensorInfo(BaseModel):
    shape: list[int]
    dtype: str


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
    }.items()
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {c: ERRORS[c] for c in codes}
