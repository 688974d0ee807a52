"""The asynchronous client: ``psgrad.AsyncClient`` (the same API as ``Client``, awaited)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx

from psgrad._base import ANSWER, BaseClient, Call, ProgressArg, Stepping, Steps, upload
from psgrad._constants import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from psgrad._grads import Build, GradsMethods
from psgrad._jobs import AsyncJob
from psgrad._merge import Fields
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

    models: AsyncModels

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
        await self._drive(self._waiting_ready(within, need_worker))

    # -- transport -----------------------------------------------------------------------------

    async def _drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` (:data:`psgrad._base.Steps`), awaiting each exchange and sleep."""
        with Stepping(steps) as run:
            while (step := run.next()) is not None:
                kind, value = step
                try:
                    run.outcome = await (self._exchange(*value) if kind == "exchange"
                                         else asyncio.sleep(value))
                except Exception as exc:  # the steps' to handle or raise, where they stand
                    run.failed = exc
        return run.result

    async def _exchange(self, method: str, path: str, content: bytes | None, json: Any,
                        headers: Mapping[str, str] | None,
                        timeout: float | None = None) -> httpx.Response:
        """One request (``timeout``: this one's, else the client's); a safetensors answer is
        read into its arrays as it arrives."""
        content, headers, pieces = upload(content, headers)
        request = self._http.build_request(
            method, path, json=json, headers=headers,
            content=content if pieces is None else _pieces(pieces),
            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
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

    async def _send(self, method: str, path: str, *, content: bytes | None = None,
                    json: Any = None, headers: Mapping[str, str] | None = None,
                    repeat: bool | None = None) -> httpx.Response:
        """One HTTP exchange with retries (:meth:`_sending`)."""
        return await self._drive(self._sending(method, path, content=content, json=json,
                                               headers=headers, repeat=repeat))

    async def _call(self, call: Call[T]) -> T:
        """Send a described exchange and read its answer."""
        return await self._drive(self._calling(call))

    async def _post_fields(self, path: str, fields: Fields) -> httpx.Response:
        return await self._drive(self._posting(path, fields))

    async def _compute(self, build: Build, *, as_torch: bool, progress: ProgressArg,
                       chunk_size: int | None) -> GradsResult:
        return await self._drive(self._computing(build(), as_torch=as_torch, progress=progress,
                                                 chunk_size=chunk_size))

    async def _queue(self, build: Build) -> AsyncJob:
        fields = build()
        doc = await self._drive(self._queueing(fields))
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
