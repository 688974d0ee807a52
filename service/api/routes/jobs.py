"""``/jobs``: the same computation as ``POST /per-sample-grads``, without holding a connection.

Results stay for ``PSGRAD_RESULT_TTL_S`` after the job finishes (or until ``DELETE``), then
``GET`` answers 404. A body is checked against the OpenAPI schema, and its model and reference
set against what exists, before it is queued (what the document forbids, or a model, version or
set that does not exist, is refused, not answered 202); what needs the model (shapes, names) is
the worker's to check, and a job it refuses ends ``failed`` with the error.

A job is its tenant's: another tenant's key gets the very 404 of a job that does not exist; an
admin key reads and deletes any.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from psgrad._errors import UnknownJob
from psgrad._wire import SAFETENSORS
from service.api.answers import answer_response
from service.api.body import encode_result, json_response, wants_safetensors
from service.api.deps import ApiKey, IdempotencyKey, StateDep, TenantDep
from service.api.routes.grads import REQUEST_BODY, new_job
from service.api.schemas import JobCreated, JobDeleted, JobView, errors
from service.jobs import JobState, JobStatus, read_answer
from service.tenants import Tenant
from service.validate import asked_outputs
from service.validate.attribution import reference_set

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[ApiKey])

JOB_ID = r"^[A-Za-z0-9_-]{1,64}$"
# Documented, not checked by FastAPI: an id off the pattern is a job that does not exist (404).
JobId = Annotated[str, Path(json_schema_extra={"pattern": JOB_ID})]


@router.post(
    "",
    status_code=202,
    response_model=JobCreated,
    openapi_extra=REQUEST_BODY,
    responses=errors(400, 401, 404, 409, 413, 415, 422, 503),
    summary="Queue a computation",
)
async def create_job(request: Request, state: StateDep, tenant: TenantDep,
                     key: IdempotencyKey = None) -> JSONResponse:
    """Queue the same body as ``POST /per-sample-grads``; poll ``GET /jobs/{job_id}``.

    The job waits for a worker up to ``PSGRAD_JOB_TIMEOUT_S`` (an hour) from now, past
    ``PSGRAD_REQUEST_TIMEOUT_S``: long enough for a worker to start where none runs. What the
    schema forbids, and a model or version that does not exist, is refused at once
    (4xx); what needs the model (shapes, names) fails the job. With an ``Idempotency-Key``,
    the request sent again (its answer lost) names the same job, queued once, while that job
    is kept (its result ``PSGRAD_RESULT_TTL_S``); the key sent with another body is a 422.
    """
    job, queued = await new_job(request, state, tenant, check=_exists, key=key,
                                timeout_s=state.settings.job_timeout_s)
    status = JobStatus.QUEUED if queued else (await state.broker.state(job.id)).status
    return JSONResponse(
        {"job_id": job.id, "status": status.value},
        status_code=202,
        headers={"Location": f"/jobs/{job.id}"},
    )


@router.get(
    "/{job_id}",
    response_model=JobView,
    summary="Status and, once done, the result",
    responses={
        200: {"content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}}},
        **errors(400, 401, 404),
    },
)
async def get_job(job_id: JobId, request: Request, state: StateDep,
                  tenant: TenantDep) -> Response:
    """The status; once succeeded the result (a safetensors file when ``Accept`` asks for it,
    else JSON under ``result``), once failed the error under ``error``."""
    st = await _state(state, job_id, tenant)
    if st.status is JobStatus.SUCCEEDED and st.answer is not None:  # Redis: read in pieces
        if wants_safetensors(request):
            return await answer_response(
                request, st.answer, headers={"X-Psgrad-Job-Status": st.status.value})
        return await json_response({**_view(st), "result": await read_answer(st.answer)})
    if st.result is None:
        return JSONResponse(_view(st))
    if wants_safetensors(request):
        return await encode_result(
            request, st.result, headers={"X-Psgrad-Job-Status": st.status.value}
        )
    return await json_response({**_view(st), "result": st.result})


@router.delete(
    "/{job_id}",
    response_model=JobDeleted,
    responses=errors(400, 401, 404),
    summary="Cancel a queued or running job; remove a finished one",
)
async def cancel_job(job_id: JobId, state: StateDep, tenant: TenantDep) -> JSONResponse:
    """A queued or running job becomes ``canceled`` (readable until ``PSGRAD_RESULT_TTL_S``):
    ``deleted`` is ``canceled``. A finished one (succeeded, failed or canceled), also one that
    finished while this call ran, is removed with its result (``GET`` answers 404 after):
    ``deleted`` is ``removed`` and the rest is the job as it finished."""
    broker = state.broker
    before = await _state(state, job_id, tenant)
    if not before.status.done:
        asked = time.time()
        try:
            after = await broker.cancel(job_id)  # atomic: cancels only a queued or running job
        except UnknownJob:  # forgotten meanwhile (its sync request took its answer)
            raise _unknown(job_id, state) from None
        if after.status is JobStatus.CANCELED and (after.finished_at or 0.0) >= asked:
            return JSONResponse({**_view(after), "deleted": "canceled"})
        before = after  # it finished meanwhile: removed, as any finished job
    await broker.forget(job_id)
    return JSONResponse({**_view(before), "deleted": "removed"})


async def _exists(fields: dict[str, Any], state: StateDep) -> None:
    """404 now, as the sync route answers: a model or version, or a reference set that
    'influence' reads, that does not exist (or is another tenant's)."""
    await run_in_threadpool(state.registry.check, fields["model"])
    key = fields.get("reference_set")  # scoped to the caller already
    if isinstance(key, str) and "influence" in asked_outputs(fields):
        await run_in_threadpool(reference_set, key, state.storage.sets)


def _unknown(job_id: str, state: StateDep) -> UnknownJob:
    """One answer for a job that never existed, expired, or is another tenant's."""
    return UnknownJob(f"unknown job '{job_id[:80]}': it never existed, or it finished more "
                      f"than {state.settings.result_ttl_s} s ago (PSGRAD_RESULT_TTL_S) and "
                      "was removed", job_id=job_id[:80])


async def _state(state: StateDep, job_id: str, tenant: Tenant) -> JobState:
    """The job's state, if it is the caller's (or the caller is an admin); else 404, the
    answer for a job that does not exist."""
    if not re.fullmatch(JOB_ID, job_id):
        raise _unknown(job_id, state)
    try:
        st = await state.broker.state(job_id)
    except UnknownJob:
        raise _unknown(job_id, state) from None
    if st.tenant != tenant.name and not tenant.admin:
        raise _unknown(job_id, state)
    return st


def _view(st: JobState) -> dict[str, Any]:
    error = (st.error or {}).get("error") if st.error else None
    view: dict[str, Any] = {
        "job_id": st.id,
        "status": st.status.value,
        "enqueued_at": st.enqueued_at,
        "finished_at": st.finished_at,
        "planning_s": round(st.planning_s, 3),
        "result": None,
        "error": error,
    }
    return view
