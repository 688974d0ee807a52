"""The asynchronous client: ``psgrad.AsyncClient`` (the same API as ``Client``, awaited)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx

from psgrad._base import ANSWER, BaseClient, Call, ProgressArg, repeatable, upload
from psgrad._constants import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from psgrad._errors import DtypeMismatch, TooLarge
from psgrad._grads import Build, GradsMethods
from psgrad._jobs import AsyncJob
from psgrad._merge import Fields, Plan, PlanResult
from psgrad._models import AsyncModels
from psgrad._reference_sets import AsyncReferenceSets
from psgrad._stores import AsyncStores
from psgrad._types import GradsResult, JobStatus

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient(
    BaseClient,
    GradsMethods[Coroutine[Any, Any, GradsResult], Coroutine[Any, Any, AsyncJob]],
):
    """A psgrad server, called from asyncio: ``Client``'s API with ``await``.

    The same arguments as ``psgrad.Client`` (the URL positionally or as ``base_url=``; floating
    arrays cast to the model's dtype as there), except that ``transport`` is an async transport
    (``httpx.ASGITransport(app)`` in tests) and ``http_client`` an ``httpx.AsyncClient``. Use
    it as an async context manager, or ``await client.close()``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        timeout: float | httpx.Timeout | None = DEFAULT_TIMEOUT,
        max_retries: int = DEFAULT_MAX_RETRIES,
        max_batch_size: int | None = None,
        binary: bool = True,
        headers: Mapping[str, str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        http_client: httpx.AsyncClient | None = None,
    ) -> None:
        super().__init__(
            base_url=base_url,
            api_key=api_key,
            timeout=timeout,
            max_retries=max_retries,
            max_batch_size=max_batch_size,
            binary=binary,
            headers=headers,
        )
        self._http = http_client or httpx.AsyncClient(
            base_url=self.base_url,
            timeout=self.timeout,
            transport=transport,
            headers=self._headers,
        )
        if http_client is not None:
            self._http.headers.update(self._headers)
        self.models = AsyncModels(self)
        self.reference_sets = AsyncReferenceSets(self)
        self.stores = AsyncStores(self)

    async def close(self) -> None:
        await self._http.aclose()
        self._memory.release()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def wait_ready(self, within: float = 120.0, *, need_worker: bool = True) -> None:
        """Wait until the server says it is ready (``GET /readyz`` answers 200): its broker
        answers and a worker is warm, so that a request sent now starts now. For a script that
        starts a server, or a client that comes up beside one. ``need_worker=False``: ready once
        jobs can be queued (where workers scale from zero). A server that cannot be reached yet
        is waited for too; after ``within`` seconds, :class:`APITimeoutError` says what it last
        heard."""
        end = time.monotonic() + within
        while True:
            response, failed = None, None
            try:
                response = await self._http.get("/readyz", **self._ready_ask(need_worker, end))
            except httpx.TransportError as exc:
                failed = exc
            if response is not None and response.is_success:
                return
            await asyncio.sleep(self._not_ready(end, within, response, failed))

    # -- transport -----------------------------------------------------------------------------

    async def _send(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
        repeat: bool | None = None,
    ) -> httpx.Response:
        """One HTTP exchange with retries; a non-2xx answer raises its typed error. ``repeat``:
        whether it may be sent again when its answer was lost (default: :func:`repeatable`)."""
        repeat = repeatable(method, path, headers=headers) if repeat is None else repeat
        for attempt in itertools.count():
            try:
                response = await self._exchange(method, path, content, json, headers)
            except httpx.TransportError as exc:
                delay = self._after_failure(attempt, exc=exc, repeat=repeat)
            else:
                if response.is_success:
                    return response
                delay = self._after_failure(attempt, response=response, repeat=repeat)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _exchange(self, method: str, path: str, content: bytes | None, json: Any,
                        headers: Mapping[str, str] | None) -> httpx.Response:
        """One request; a safetensors answer is read into its arrays as it arrives."""
        content, headers, pieces = upload(content, headers)
        request = self._http.build_request(
            method, path, json=json, headers=headers,
            content=content if pieces is None else _pieces(pieces))
        response = await self._http.send(request, stream=True)
        self._check_version(response)
        try:
            reader = self._answer_reader(path, response)
            if reader is None:
                await response.aread()
            else:
                async for piece in response.aiter_bytes():
                    reader.feed(piece)
                response.extensions[ANSWER] = reader.fields()
        finally:
            await response.aclose()
        return response

    async def _call(self, call: Call[T]) -> T:
        """Send a described exchange and read its answer."""
        response = await self._send(
            call.method, call.path, content=call.content, json=call.json, headers=call.headers
        )
        return call.read(response)

    async def _prepare(self, fields: Fields, *, float32: bool = False) -> Fields:
        """``fields`` with its floating arrays in the model's dtype (asked for once a model;
        ``float32``: as :meth:`_dtype_unknown`)."""
        model = self._dtype_unknown(fields, float32=float32)
        return self._cast(fields, None if model is None else await self.models.get(model))

    async def _post_fields(self, path: str, fields: Fields) -> httpx.Response:
        body, headers = self._encode(fields, path)
        return await self._send("POST", path, content=body, headers=headers,
                                repeat=repeatable("POST", path, fields, headers))

    async def _run_plan(self, plan: Plan) -> PlanResult:
        """Drive a chunking plan: send each request it yields, feed back answers or a 413."""
        try:
            fields = next(plan)
            while True:
                try:
                    answer = self._decode(await self._post_fields("/per-sample-grads", fields))
                except TooLarge as exc:
                    fields = plan.throw(exc)
                else:
                    fields = plan.send(answer)
        except StopIteration as stop:
            return stop.value
        finally:
            plan.close()

    async def _compute(self, build: Build, *, as_torch: bool, progress: ProgressArg,
                       chunk_size: int | None) -> GradsResult:
        started = time.perf_counter()
        fields = await self._prepare(build())
        while True:
            try:
                with self._plan(fields, progress, chunk_size) as plan:
                    out = await self._run_plan(plan)
                return self._planned(out, chunk_size, as_torch=as_torch, started=started)
            except DtypeMismatch as exc:
                model = self._refused_unasked(fields, exc)
                cast = None if model is None else self._recast(fields,
                                                               await self.models.get(model))
                if cast is None:
                    raise
                fields = cast

    async def _queue(self, build: Build) -> AsyncJob:
        fields = build()
        doc = (await self._post_fields("/jobs", await self._prepare(fields, float32=True))).json()
        return AsyncJob(self, str(doc["job_id"]), JobStatus(doc.get("status", "queued")),
                        outputs=fields["outputs"])

    # -- gradients: per_sample_grads, td0 and submit (psgrad._grads), awaited -------------------

    def job(self, job_id: str) -> AsyncJob:
        """A handle on a job submitted earlier (by id)."""
        return AsyncJob(self, job_id, JobStatus.QUEUED)


async def _pieces(pieces: Iterator[bytes]) -> AsyncIterator[bytes]:
    """An upload's pieces for httpx's async client, which takes only async iterables."""
    for piece in pieces:
        yield piece
