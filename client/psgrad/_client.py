"""The synchronous client: ``psgrad.Client``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TypeVar

import httpx

from psgrad._base import ANSWER, BaseClient, Call, ProgressArg, Stepping, Steps, upload
from psgrad._constants import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from psgrad._grads import Build, GradsMethods
from psgrad._jobs import Job
from psgrad._merge import Fields
from psgrad._models import Models
from psgrad._receive import receive_answer
from psgrad._reference_sets import ReferenceSets
from psgrad._stores import Stores
from psgrad._types import GradsResult, JobStatus

__all__ = ["Client"]

T = TypeVar("T")


class Client(BaseClient, GradsMethods[GradsResult, Job]):
    """A psgrad server, called synchronously.

    ``Client("http://gpu-host:8000")`` talks to that server; ``Client()`` with no arguments to
    ``$PSGRAD_URL`` (else ``http://127.0.0.1:8000``), with the key in ``$PSGRAD_API_KEY``. The
    URL may be given positionally or as ``base_url=``; every other option is keyword-only. Use it
    as a context manager, or call ``close()``.

    Arrays may be numpy arrays, torch tensors or nested lists. A floating array in a dtype other
    than float32 (numpy's default float64, float16) is cast to the dtype the model computes in,
    which the client asks ``GET /models/{id}`` for once per model, so float64 data works as it
    does through JSON; float32 arrays and lists (read as float32) are sent as they are, and
    integer and boolean arrays (class targets, token ids, dones) are never cast.

    Large answers (hundreds of MB of per-sample gradients) are read as they arrive straight into
    their arrays. The client keeps the large arrays of its last two answers and reads a later
    answer into those you no longer refer to (no array, view or torch tensor of them is alive):
    in a loop that asks for gradients every step, each answer lands in memory already in use,
    which on a virtual machine is several times faster than new memory. ``close()`` lets it go.

    Args:
        base_url: the server's address (the one positional argument).
        api_key: sent as ``Authorization: Bearer <key>``.
        timeout: seconds (or an ``httpx.Timeout``) per HTTP request.
        max_retries: retries of a request after a connection error, 408, 429 or 5xx, with
            jittered exponential backoff that honours ``Retry-After``.
        max_batch_size: the largest batch sent in one request; larger batches are split (see
            ``per_sample_grads``). Unset, the client learns it from the server's 413 answer.
        binary: send and receive safetensors (default); False uses JSON with base64 tensors.
        headers: extra headers for every request.
        transport: an httpx transport, e.g. ``httpx.ASGITransport(app)`` to call an app
            in-process, or ``httpx.MockTransport`` in tests.
        http_client: a ready ``httpx.Client`` instead (its base URL and timeout are used).
    """

    models: Models

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
        transport: httpx.BaseTransport | None = None,
        http_client: httpx.Client | None = None,
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
        self._http = http_client or httpx.Client(
            base_url=self.base_url,
            timeout=self.timeout,
            transport=transport,
            headers=self._headers,
        )
        if http_client is not None:
            self._http.headers.update(self._headers)
        self.models = Models(self)
        self.reference_sets = ReferenceSets(self)
        self.stores = Stores(self)

    def close(self) -> None:
        self._http.close()
        self._memory.release()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def wait_ready(self, within: float = 120.0, *, need_worker: bool = True) -> None:
        """Wait until the server says it is ready (``GET /readyz`` answers 200): its broker
        answers and a worker is warm, so that a request sent now starts now. For a script that
        starts a server, or a client that comes up beside one. ``need_worker=False``: ready once
        jobs can be queued (where workers scale from zero). A server that cannot be reached yet
        is waited for too; after ``within`` seconds, :class:`APITimeoutError` says what it last
        heard."""
        self._drive(self._waiting_ready(within, need_worker))

    # -- transport -----------------------------------------------------------------------------

    def _drive(self, steps: Steps[T]) -> T:
        """Run ``steps`` (:data:`psgrad._base.Steps`) with blocking I/O."""
        with Stepping(steps) as run:
            while (step := run.next()) is not None:
                kind, value = step
                try:
                    if kind == "exchange":
                        run.outcome = self._exchange(*value)
                    else:
                        time.sleep(value)
                except Exception as exc:  # the steps' to handle or raise, where they stand
                    run.failed = exc
        return run.result

    def _exchange(self, method: str, path: str, content: bytes | None, json: Any,
                  headers: Mapping[str, str] | None, timeout: float | None = None
                  ) -> httpx.Response:
        """One request (``timeout``: this one's, else the client's); a safetensors answer is
        read into its arrays as it arrives."""
        content, headers, pieces = upload(content, headers)
        request = self._http.build_request(
            method, path, content=content or pieces, json=json, headers=headers,
            timeout=httpx.USE_CLIENT_DEFAULT if timeout is None else timeout)
        response = self._http.send(request, stream=True)
        self._check_version(response)
        try:
            reader = self._answer_reader(path, response)
            if reader is None:
                response.read()
            else:
                receive_answer(response, reader)
                response.extensions[ANSWER] = reader.fields()
        finally:
            response.close()
        return response

    def _send(self, method: str, path: str, *, content: bytes | None = None, json: Any = None,
              headers: Mapping[str, str] | None = None, repeat: bool | None = None
              ) -> httpx.Response:
        """One HTTP exchange with retries (:meth:`_sending`)."""
        return self._drive(self._sending(method, path, content=content, json=json,
                                         headers=headers, repeat=repeat))

    def _call(self, call: Call[T]) -> T:
        """Send a described exchange and read its answer."""
        return self._drive(self._calling(call))

    def _post_fields(self, path: str, fields: Fields) -> httpx.Response:
        return self._drive(self._posting(path, fields))

    def _compute(self, build: Build, *, as_torch: bool, progress: ProgressArg,
                 chunk_size: int | None) -> GradsResult:
        return self._drive(self._computing(build(), as_torch=as_torch, progress=progress,
                                           chunk_size=chunk_size))

    def _queue(self, build: Build) -> Job:
        fields = build()
        doc = self._drive(self._queueing(fields))
        return Job(self, str(doc["job_id"]), JobStatus(doc.get("status", "queued")),
                   outputs=fields["outputs"])

    # -- gradients: per_sample_grads, td0 and submit (psgrad._grads) ----------------------------

    def job(self, job_id: str) -> Job:
        """A handle on a job submitted earlier (by id)."""
        return Job(self, job_id, JobStatus.QUEUED)
