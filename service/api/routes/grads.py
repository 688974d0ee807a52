"""``POST /per-sample-grads``: enqueue, wait for the worker, answer in JSON or safetensors."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, Response
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from psgrad._errors import (
    DeadlineExceeded,
    JobCanceled,
    Overloaded,
    PrivacyBudgetExhausted,
    UnknownJob,
    error_from_body,
)
from psgrad._wire import SAFETENSORS
from service.api.answers import answer_response
from service.api.body import conform, decode_request, encode_result
from service.api.deps import IdempotencyKey, StateDep, TenantDep
from service.api.docs import request_body
from service.api.schemas import GradsRequest, GradsResponse, errors
from service.dp.steps import precheck as dp_precheck
from service.jobs import (
    Job,
    JobState,
    JobStatus,
    keyed_job_id,
    new_job_id,
    read_answer,
    request_digest,
)
from service.reference_sets import scope_reference
from service.tenants import Tenant, owned_name
from service.validate import parse_request

router = APIRouter(tags=["per-sample gradients"])

# a waiting request rides out an outage of the queue this long (a Redis restarted, failed over):
# its job is kept there and its worker goes on, so the answer may still come
OUTAGE_S = 10.0
OUTAGE_POLL_S = 0.25

REQUEST_BODY = request_body(GradsRequest, "JSON, or a safetensors file with the tensor fields "
                            "as tensors and the other fields as JSON in the metadata key "
                            "'request'")
RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": GradsResponse,
        "description": "the requested outputs; a safetensors file "
        "when Accept names application/x-safetensors",
        "content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}},
    },
    **errors(400, 401, 404, 409, 413, 415, 422, 500, 503, 504),
}


async def new_job(
    request: Request,
    state: StateDep,
    tenant: Tenant,
    check: Callable[[dict[str, Any], StateDep], Awaitable[None]] | None = None,
    key: str | None = None,
    timeout_s: float | None = None,
) -> tuple[Job, bool]:
    """Decode the body, hold it to :class:`GradsRequest`, ``check`` it, enqueue it as
    ``tenant``'s; the deadline is ``timeout_s`` from now (default:
    ``PSGRAD_REQUEST_TIMEOUT_S``). With an ``Idempotency-Key`` (``key``), every try of the
    request names one job, queued once. Answers the job and whether this try queued it
    (:func:`submit_fields`)."""
    fields = await decode_request(request, state.settings)
    return await submit_fields(fields, state, tenant, check, key, timeout_s)


async def submit_fields(
    fields: dict[str, Any],
    state: StateDep,
    tenant: Tenant,
    check: Callable[[dict[str, Any], StateDep], Awaitable[None]] | None = None,
    key: str | None = None,
    timeout_s: float | None = None,
) -> tuple[Job, bool]:
    """A decoded body held to :class:`GradsRequest`, ``check``-ed and enqueued as
    ``tenant``'s (every route that takes a gradients request, whatever its wire form); a
    ``key``'s job (:func:`service.jobs.keyed_job_id`) is queued by its first try alone.
    Answers the job and whether this try queued it (False: a later try of a keyed job)."""
    scope_reference(fields, tenant.name)  # `reference_set` names a set of the caller's
    named = fields.get("reference_set")  # ... checked: the schema reads the name as sent
    sent = fields if not isinstance(named, str) else {**fields, "reference_set": owned_name(named)}
    await conform(GradsRequest, sent, partial(
        parse_request, fields, state.registry, max_batch_size=state.settings.max_batch_size,
        reference_sets=state.storage.sets))  # its own error for nearly all the schema refuses
    job_id = new_job_id() if key is None else keyed_job_id(tenant.name, key)
    try:  # 404 now for another tenant's DP run, 409 for one with no step left ...
        await dp_precheck(fields, state.storage.runs, tenant.name)
    except PrivacyBudgetExhausted:  # ... but not to a try of a keyed step it held: its last
        if key is None or not await _held(state, job_id):
            raise
    if check is not None:
        await check(fields, state)
    job = Job(job_id, fields,
              deadline=time.time() + (timeout_s or state.settings.request_timeout_s),
              tenant=tenant.name,
              digest=None if key is None else await run_in_threadpool(request_digest, fields))
    # Yield once before the broker call: requests that arrive together then decode in one turn
    # of the event loop and only afterwards arm their Redis timeouts, which a whole burst's
    # decoding in between would otherwise eat (connects timed out under 100 requests at once).
    await asyncio.sleep(0)
    return job, await state.broker.submit(job, tenant.quotas)


@router.post(
    "/per-sample-grads",
    response_model=None,
    openapi_extra=REQUEST_BODY,
    responses=RESPONSES,
    summary="Per-sample gradients and their statistics",
)
async def per_sample_grads(request: Request, state: StateDep, tenant: TenantDep,
                           key: IdempotencyKey = None) -> Response:
    """Compute the requested outputs for one batch and wait for them.

    The job joins the queue and may be computed together with other clients' jobs that share
    its model, loss and options; its answer is exactly its own. Past the deadline
    (``PSGRAD_REQUEST_TIMEOUT_S``) the job is canceled and the answer is 504. With an
    ``Idempotency-Key`` (what a DP step needs, whose answer cannot be computed again), the
    request sent again waits for the job its first try queued and answers the same, while the
    job is kept: until ``DELETE /jobs/{id}`` (the answer's ``Content-Location``), which the
    caller sends once it has the answer, or ``PSGRAD_RESULT_TTL_S`` after it ends. The key with
    another body is a 422.
    """
    job, queued = await new_job(request, state, tenant, key=key)
    # a keyed job's first try is not its only waiter: it hands the job's end on, as others do
    return await answer_of(state, job, request, kept=key is not None,
                           fresh=queued and key is None)


async def answer_of(state: StateDep, job: Job, request: Request | None = None, *,
                    kept: bool = False, fresh: bool = True) -> Any:
    """Wait for ``job``'s answer; past its deadline cancel it (504). It is forgotten after,
    unless ``kept`` (a keyed job: its other tries read the same answer until it expires or is
    deleted at the ``Content-Location`` the answer names; only its deadline cancels it, not a
    caller that left). ``fresh``: this call queued it, and nobody else waits for it.

    With ``request``: the HTTP answer (an answer in pieces relayed as they land); without: the
    result's fields (an answer in pieces read whole first).
    """
    broker = state.broker
    done = relayed = False
    expired = False  # the deadline passed: canceled, kept or not
    try:
        st = await _wait(state, job, fresh=fresh)
        done = st.status.done or st.answer is not None  # an answer landing: relay it
        if not done:
            expired = True
            raise await _expired(state)
        if st.status is JobStatus.FAILED:
            raise error_from_body(st.error, 500)
        # a kept answer names where it is kept, for its caller to DELETE once in hand
        located = {"Content-Location": f"/jobs/{job.id}"} if kept else None
        if st.answer is not None:
            if request is None:
                return await read_answer(st.answer, consume=not kept)
            relayed = True  # forgotten once relayed, not before
            return await answer_response(
                request, st.answer, consume=not kept, headers=located,
                background=None if kept else BackgroundTask(broker.forget, job.id))
        if st.status is JobStatus.CANCELED or st.result is None:
            raise _canceled(job, state, keyed=kept)
        return st.result if request is None else await encode_result(request, st.result,
                                                                     headers=located)
    finally:
        if not done and (expired or not kept):
            await asyncio.shield(_cancel_quietly(state, job.id))
        if not relayed and not kept:
            await asyncio.shield(broker.forget(job.id))


async def _expired(state: StateDep) -> DeadlineExceeded:
    """The 504 of a request past its deadline: what to do, and whether any worker serves the
    queue (none: a worker is down, or workers scaled to zero are starting)."""
    timeout_s, job_timeout_s = state.settings.request_timeout_s, state.settings.job_timeout_s
    why = ("no worker serves the queue now (GET /readyz); start one, or " if not await state.ready()
           else "send smaller batches, or ")
    return DeadlineExceeded(
        f"no answer within {timeout_s:g} s (PSGRAD_REQUEST_TIMEOUT_S); the job was canceled: "
        f"{why}use POST /jobs (a job waits up to {job_timeout_s:g} s, PSGRAD_JOB_TIMEOUT_S) "
        "and poll GET /jobs/{id}", timeout_s=timeout_s)


async def _wait(state: StateDep, job: Job, *, fresh: bool) -> JobState:
    """The job's state once done, or once its deadline passed; the time its worker spent
    planning the model (up to ``PSGRAD_PLANNING_GRACE_S``) moves the deadline on. ``fresh``:
    the job was queued just now, for this waiter alone (:meth:`service.jobs.Broker.wait`).
    The queue unreachable (503) is waited through for up to ``OUTAGE_S``, within the deadline."""
    granted, lost = 0.0, None
    while True:
        try:
            st = await state.broker.wait(job.id, max(0.0, job.deadline + granted - time.time()),
                                         fresh=fresh)
        except Overloaded:
            lost = lost or time.monotonic()
            if time.monotonic() - lost > OUTAGE_S or time.time() > job.deadline + granted:
                raise
            await asyncio.sleep(OUTAGE_POLL_S)
            fresh = False  # its end may have come meanwhile: read the state first
            continue
        lost, fresh = None, False
        if st.status.done or st.answer is not None:
            return st
        more = min(st.planning_s, state.settings.planning_grace_s)
        if more <= granted:
            return st
        granted = more


def _canceled(job: Job, state: StateDep, *, keyed: bool) -> JobCanceled:
    """The answer to a try whose job was canceled before it answered: a ``DELETE
    /jobs/{id}``, a server shutting down, or a ``keyed`` request's earlier try that passed its
    deadline."""
    run = job.fields.get("dp_run")
    return JobCanceled(
        f"job {job.id} was canceled before it answered (its deadline passed: "
        f"PSGRAD_REQUEST_TIMEOUT_S {state.settings.request_timeout_s:g} s, or it was deleted, "
        f"or the server stopped): send the request again"
        + (" under a new Idempotency-Key" if keyed else "")
        + ("" if run is None else f"; the DP step may have been counted without an answer "
           f"(GET /dp-runs/{run} says)"), job_id=job.id)


async def _held(state: StateDep, job_id: str) -> bool:
    """Whether the broker holds the job ``job_id``."""
    try:
        await state.broker.state(job_id)
    except UnknownJob:
        return False
    return True


async def _cancel_quietly(state: StateDep, job_id: str) -> None:
    with contextlib.suppress(Exception):  # the broker may be gone; the deadline stops the job
        await state.broker.cancel(job_id)
