"""Queued requests: the job document, and the handles ``submit`` returns (``Job``, ``AsyncJob``).

A handle describes its exchanges, reads their answers and polls, once (:class:`_JobHandle`, the
polling as one of the client's steps, :data:`psgrad._base.Steps`); the sync and async forms only
hand them to their client.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from psgrad._base import ANSWER, BaseClient, Call, Steps, decode_json_result
from psgrad._constants import JOB_POLL_INITIAL, JOB_POLL_MAX, JOB_STATUS_HEADER, REQUEST_ID_HEADER
from psgrad._errors import _BY_CODE as ERRORS_BY_CODE
from psgrad._errors import (
    APITimeoutError,
    BadRequest,
    JobCanceled,
    JobFailed,
    PsgradError,
    error_from_body,
)
from psgrad._merge import Fields
from psgrad._types import GradsResult, JobStatus
from psgrad._wire import JSON, RESPONSE_KEY, SAFETENSORS, fields_from_safetensors, media_type

if TYPE_CHECKING:
    from psgrad._async_client import AsyncClient
    from psgrad._client import Client

__all__ = ["AsyncJob", "Job", "JobState", "job_state"]

JobState = tuple[JobStatus, Fields | None, PsgradError | None]


def job_state(response: httpx.Response) -> JobState:
    """A job document (``GET``/``DELETE /jobs/{id}``): its status, result fields or error.

    JSON: ``{"job_id", "status", "result": {...}, "error": {"code", "message", ...}}``; a
    finished job asked for with ``Accept: application/x-safetensors`` is the result itself, as a
    safetensors answer, with the status in the ``X-Psgrad-Job-Status`` header.
    """
    ctype = media_type(response.headers.get("content-type"))
    result: Fields | None = None
    doc: dict[str, Any]
    if ctype == SAFETENSORS:
        streamed = response.extensions.pop(ANSWER, None)  # the response may outlive it
        result = (dict(streamed) if streamed is not None
                  else fields_from_safetensors(response.content, RESPONSE_KEY))
        doc = {"status": response.headers.get(JOB_STATUS_HEADER, JobStatus.SUCCEEDED.value)}
    else:
        doc = response.json()
        if isinstance(doc.get("result"), dict):
            result = decode_json_result(doc["result"])
    try:
        status = JobStatus(doc.get("status"))
    except ValueError:
        raise BadRequest(
            f"the server answered an unknown job status {doc.get('status')!r}"
        ) from None
    request_id = response.headers.get(REQUEST_ID_HEADER)
    error: PsgradError | None = None
    if status is JobStatus.FAILED:
        body = doc.get("error")
        body = body if isinstance(body, dict) and "error" in body else {"error": body}
        code = (body.get("error") or {}).get("code") if isinstance(body["error"], dict) else None
        error = error_from_body(body, _status_for_code(code), request_id=request_id)
    elif status is JobStatus.CANCELED:
        error = JobCanceled(f"job {doc.get('job_id', '')} was canceled", request_id=request_id)
    return status, (result if status is JobStatus.SUCCEEDED else None), error


def _status_for_code(code: Any) -> int:
    cls = ERRORS_BY_CODE.get(str(code)) if code else None
    return cls.status if cls is not None else JobFailed.status


class _Poll:
    """The waits of ``result()``: fast at first (small jobs finish in milliseconds), doubling
    up to a calm rate, never past the caller's deadline."""

    def __init__(self, job_id: str, timeout: float | None) -> None:
        self.job_id = job_id
        self.timeout = timeout
        self.started = time.perf_counter()
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.delay = JOB_POLL_INITIAL

    def wait(self, status: JobStatus) -> float:
        """Seconds to sleep before the next poll; raises once the deadline has passed."""
        if self.deadline is None:
            wait = self.delay
        else:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise APITimeoutError(
                    f"job {self.job_id} is still {status.value} after {self.timeout} s"
                )
            wait = min(self.delay, left)
        self.delay = min(self.delay * 2, JOB_POLL_MAX)
        return wait


class _JobHandle:
    """What ``Job`` and ``AsyncJob`` share: the exchanges, and reading their answers."""

    def __init__(
        self, client: BaseClient, job_id: str, status: JobStatus, *, outputs: Sequence[str] = ()
    ) -> None:
        self._client = client
        self.id = job_id
        self.last_status = status
        self._outputs = list(outputs)  # the order to list the result's outputs in

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, status={self.last_status.value!r})"

    def _fetch(self) -> Call[JobState]:
        accept = SAFETENSORS if self._client.binary else JSON
        return Call("GET", f"/jobs/{self.id}", self._read, headers={"Accept": accept})

    def _cancel(self) -> Call[JobState]:
        return Call("DELETE", f"/jobs/{self.id}", self._read)

    def _read(self, response: httpx.Response) -> JobState:
        state = job_state(response)
        self.last_status = state[0]
        return state

    def _awaiting(self, timeout: float | None, as_torch: bool) -> Steps[GradsResult]:
        """``result()``: the job polled (:class:`_Poll`) until it finished; its result, or
        its error raised."""
        poll = _Poll(self.id, timeout)
        while True:
            _, fields, error = yield from self._client._calling(self._fetch())
            if error is not None:
                raise error
            if fields is not None:
                return self._client._result(fields, as_torch=as_torch, started=poll.started,
                                            order=self._outputs)
            yield "sleep", poll.wait(self.last_status)


class Job(_JobHandle):
    """A queued gradients request: ``status()``, ``result(timeout=...)``, ``cancel()``."""

    _client: Client

    def status(self) -> JobStatus:
        """The job's state now: queued, running, succeeded, failed or canceled."""
        return self._client._call(self._fetch())[0]

    def result(self, *, timeout: float | None = None, as_torch: bool = False) -> GradsResult:
        """Wait for the job and return its result, or raise its error (``JobCanceled``, ...).

        Raises:
            APITimeoutError: not finished within ``timeout`` seconds (the job keeps running).
        """
        return self._client._drive(self._awaiting(timeout, as_torch))

    def cancel(self) -> JobStatus:
        """Ask the server to cancel the job (``DELETE /jobs/{id}``); returns the new state."""
        return self._client._call(self._cancel())[0]


class AsyncJob(_JobHandle):
    """``Job`` for ``AsyncClient``: the same methods, awaited."""

    _client: AsyncClient

    async def status(self) -> JobStatus:
        """The job's state now: queued, running, succeeded, failed or canceled."""
        return (await self._client._call(self._fetch()))[0]

    async def result(self, *, timeout: float | None = None, as_torch: bool = False) -> GradsResult:
        """Wait for the job and return its result, or raise its error; see ``Job.result``."""
        return await self._client._drive(self._awaiting(timeout, as_torch))

    async def cancel(self) -> JobStatus:
        """Ask the server to cancel the job (``DELETE /jobs/{id}``); returns the new state."""
        return (await self._client._call(self._cancel()))[0]
