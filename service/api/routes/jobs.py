"""``/jobs``: the same computation as ``POST /per-sample-grads``, without holding a connection.

Results stay for ``PSGRAD_RESULT_TTL_S`` after the job finishes, then ``GET`` answers 404.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from psgrad._errors import UnknownJob
from psgrad._wire import SAFETENSORS
from service.api.answers import answer_response
from service.api.body import encode_result, json_response, wants_safetensors
from service.api.deps import ApiKey, StateDep
from service.api.routes.grads import REQUEST_BODY, new_job
from service.api.schemas import JobCreated, JobView, errors
from service.jobs import JobState, JobStatus, read_answer

router = APIRouter(prefix="/jobs", tags=["jobs"], dependencies=[ApiKey])

JOB_ID = r"^[A-Za-z0-9_-]{1,64}$"


@router.post(
    "",
    status_code=202,
    response_model=JobCreated,
    openapi_extra=REQUEST_BODY,
    responses=errors(400, 401, 404, 409, 413, 415, 422, 503),
    summary="Queue a computation",
)
async def create_job(request: Request, state: StateDep) -> JSONResponse:
    """Queue the same body as ``POST /per-sample-grads``; poll ``GET /jobs/{job_id}``."""
    job = await new_job(request, state)
    return JSONResponse(
        {"job_id": job.id, "status": JobStatus.QUEUED.value},
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
async def get_job(job_id: str, request: Request, state: StateDep) -> Response:
    """The status; once succeeded the result (a safetensors file when ``Accept`` asks for it,
    else JSON under ``result``), once failed the error under ``error``."""
    st = await state.broker.state(_checked(job_id))
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
    response_model=JobView,
    responses=errors(400, 401, 404),
    summary="Cancel a queued or running job",
)
async def cancel_job(job_id: str, state: StateDep) -> JSONResponse:
    """A queued or running job becomes ``canceled``; a finished job is left as it is."""
    st = await state.broker.cancel(_checked(job_id))
    return JSONResponse(_view(st))


def _checked(job_id: str) -> str:
    if not re.fullmatch(JOB_ID, job_id):
        raise UnknownJob(f"unknown job '{job_id[:80]}'", job_id=job_id[:80])
    return job_id


def _view(st: JobState) -> dict[str, Any]:
    error = (st.error or {}).get("error") if st.error else None
    view: dict[str, Any] = {
        "job_id": st.id,
        "status": st.status.value,
        "enqueued_at": st.enqueued_at,
        "finished_at": st.finished_at,
        "result": None,
        "error": error,
    }
    return view
