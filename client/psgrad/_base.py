"""What the sync and the async client share: configuration, encoding, errors, retry decisions,
and the logic of every exchange, once.

Nothing here does I/O. That logic (the retry loop, the dtype asked for, the chunking plan of
:mod:`psgrad._merge` sent, a job queued) is written as steps (:data:`Steps`): generators that
yield what they need done, an exchange or a sleep, and are sent back its outcome. ``Client``
runs them with blocking I/O and ``AsyncClient`` awaits them (each its ``_drive``), so the two
differ only there. The fields of a request are built in :mod:`psgrad._request`, its
arrays in :mod:`psgrad._arrays`; the ``models`` and job handles live in :mod:`psgrad._models`
and :mod:`psgrad._jobs`.
"""

from __future__ import annotations

import contextlib
import email.utils
import itertools
import json
import math
import os
import random
import time
import uuid
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar
from urllib.parse import quote

import httpx
import numpy as np

from psgrad._answer_reader import AnswerReader
from psgrad._arrays import cast_floats, float_dtype, needs_model_dtype, to_torch
from psgrad._constants import (
    DEFAULT_BASE_URL,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    ENV_API_KEY,
    ENV_URL,
    IDEMPOTENCY_KEY,
    INITIAL_RETRY_DELAY,
    MAX_RETRY_AFTER,
    MAX_RETRY_DELAY,
    NOT_SENT,
    READY_ASK_S,
    READY_POLL_S,
    REFUSED_STATUSES,
    REQUEST_ID_HEADER,
    RETRY_STATUSES,
    USER_AGENT,
)
from psgrad._contract import ANSWER_NAMES
from psgrad._errors import (
    APIConnectionError,
    APITimeoutError,
    BadRequest,
    DtypeMismatch,
    Overloaded,
    PsgradError,
    TooLarge,
    error_from_body,
)
from psgrad._memory import AnswerMemory
from psgrad._merge import Fields, Plan, PlanResult, grads_plan
from psgrad._progress import Progress
from psgrad._request import grads_fields
from psgrad._types import GradsResult, ModelInfo
from psgrad._version import VERSION_HEADER, warn_if_older
from psgrad._wire import (
    JSON,
    REQUEST_KEY,
    RESPONSE_KEY,
    SAFETENSORS,
    array_from_json,
    fields_from_safetensors,
    fields_to_json,
    fields_to_safetensors,
    media_type,
)

if TYPE_CHECKING:
    from psgrad._models import _Registry

__all__ = ["BaseClient", "Call", "ProgressArg", "Step", "Stepping", "Steps",
           "decode_json_result"]

_MAX_DECODE_ELEMENTS = 2**62  # our own server's answers: it enforces its limits itself
_MAX_DTYPES = 256  # models whose dtype a client remembers

T = TypeVar("T")
ProgressArg = bool | Callable[[int, int], None]
# A step a client's logic yields (:class:`BaseClient`'s ``_sending`` and the rest): either
# ``("exchange", (method, path, content, json, headers[, timeout]))``, sent back the
# ``httpx.Response``, or ``("sleep", seconds)``, sent back None. What doing it raises is thrown
# in at the yield, so that an error travels up a chain of ``yield from`` as up a call stack.
Step = tuple[str, Any]
Steps = Generator[Step, Any, T]


class Stepping(Generic[T]):
    """Steps being run by a client's ``_drive``: ``next()`` is the step to do (None once they
    ended, with ``result``), after the last one's ``outcome`` or what it ``failed`` with."""

    def __init__(self, steps: Steps[T]) -> None:
        self.steps = steps
        self.outcome: Any = None
        self.failed: Exception | None = None
        self.result: T

    def __enter__(self) -> Stepping[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.steps.close()  # steps left where a driver stopped (cancelled) run their finally

    def next(self) -> Step | None:
        try:
            step = (self.steps.send(self.outcome) if self.failed is None
                    else self.steps.throw(self.failed))
        except StopIteration as stop:
            self.result = stop.value
            return None
        self.outcome, self.failed = None, None
        return step


def _url(url: object) -> str:
    """The server's URL, without its trailing slash; a ValueError saying what is wrong with
    one that is no http(s) URL (``127.0.0.1:8000``, a port that is no number), at once rather
    than as a connection that failed after the retries."""
    try:
        parsed = httpx.URL(url) if isinstance(url, str) else None
    except httpx.InvalidURL as exc:
        raise ValueError(f"the server's URL {url!r} is invalid: {exc}") from None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"the server's URL must be http://host:port or https://host:port; got "
                         f"{url!r}")
    return str(url).rstrip("/")


def _key(key: str | None) -> str | None:
    """The API key as sent in a header: printable ASCII without spaces at its ends (a key
    read from a file keeps its newline); else a ValueError that says so."""
    if not key:
        return None
    if not (key.isascii() and key.isprintable()) or key != key.strip():
        raise ValueError("the API key must be printable ASCII without spaces or a newline at "
                         "its ends (strip a key read from a file)")
    return key


@dataclass(frozen=True)
class Call(Generic[T]):
    """One HTTP exchange, described: what to send, and how to read its 2xx answer.

    The ``models`` namespace and the job handles describe their exchanges once; ``Client._call``
    sends one and ``AsyncClient._call`` awaits one, so their sync and async forms differ only in
    ``await``.
    """

    method: str
    path: str
    read: Callable[[httpx.Response], T]
    content: bytes | None = None
    json: Any = None
    headers: Mapping[str, str] | None = None


def json_doc(response: httpx.Response) -> dict[str, Any]:
    """A JSON object answer (a resource's description)."""
    doc: dict[str, Any] = response.json()
    return doc


def resource_path(collection: str, what: str, resource_id: str, tail: str = "") -> str:
    """``/<collection>/<id><tail>`` with the id quoted; ``what`` names it in the error."""
    if not isinstance(resource_id, str) or not resource_id:
        raise BadRequest(f"a {what} id is required")
    return f"/{collection}/{quote(resource_id, safe='')}{tail}"


def _retry_after(response: httpx.Response | None) -> float | None:
    """Seconds from ``Retry-After`` (seconds or an HTTP date), if the server sent one."""
    if response is None:
        return None
    raw = response.headers.get("retry-after")
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        pass
    parsed = email.utils.parsedate_tz(raw)
    if parsed is None:
        return None
    return max(0.0, email.utils.mktime_tz(parsed) - time.time())


UPLOAD_PIECE = 1 << 20


def upload(content: bytes | None, headers: Mapping[str, str] | None
           ) -> tuple[bytes | None, Mapping[str, str] | None, Iterator[bytes] | None]:
    """A large body as 1 MiB pieces with its length: httpx sent a 200 MB ``bytes`` body at
    25 MB/s over loopback and the same body in 1 MiB pieces at 250 MB/s (a 476 MiB GPT-2
    archive took 40 s to reach the server; the server refused it in 5 ms). Small bodies are
    sent as they are: (content, headers, None), else (None, headers with the length, pieces).
    """
    if content is None or len(content) <= UPLOAD_PIECE:
        return content, headers, None
    view = memoryview(content)
    pieces = (bytes(view[i:i + UPLOAD_PIECE]) for i in range(0, len(content), UPLOAD_PIECE))
    return None, {**(headers or {}), "Content-Length": str(len(content))}, pieces


ANSWER = "psgrad.answer"  # response.extensions: the safetensors answer, read as it arrived
ANSWER_PATHS = ("/per-sample-grads", "/jobs/")


class BaseClient:
    """Options common to ``Client`` and ``AsyncClient`` (see ``Client`` for their meaning),
    and the logic of their exchanges as steps, which each drives with its own I/O."""

    models: _Registry

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
    ) -> None:
        self.base_url = _url(base_url or os.environ.get(ENV_URL) or DEFAULT_BASE_URL)
        self.api_key = _key(api_key if api_key is not None else os.environ.get(ENV_API_KEY))
        if not isinstance(timeout, httpx.Timeout) and timeout is not None and not (
                isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
            raise ValueError(f"timeout must be a number of seconds > 0 (or None: no limit); "
                             f"got {timeout!r}")
        self.timeout = timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(timeout)
        if max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        self.max_retries = max_retries
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.max_batch_size = max_batch_size
        self.binary = binary
        self._headers = {"User-Agent": USER_AGENT, **(headers or {})}
        if self.api_key:
            self._headers["Authorization"] = f"Bearer {self.api_key}"
        self._dtypes: dict[str, np.dtype | str | None] = {}  # model -> the dtype it computes in
        self._memory = AnswerMemory()  # large answers' buffers, lent again once dropped
        self._version_read = False  # the server's version seen (and warned about if older)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    # -- encoding ------------------------------------------------------------------------------

    def _encode(self, fields: Fields, path: str) -> tuple[bytes, dict[str, str]]:
        """The body and headers of a gradients or job request to ``path``, binary unless
        ``binary=False``; a job's, and a DP step's, with an ``Idempotency-Key`` of its own, so
        that every try of it names one job."""
        if self.binary:
            body = fields_to_safetensors(fields, REQUEST_KEY)
            headers = {"Content-Type": SAFETENSORS, "Accept": SAFETENSORS}
        else:
            body = json.dumps(fields_to_json(fields, binary=True)).encode()
            headers = {"Content-Type": JSON, "Accept": JSON}
        if path == "/jobs" or fields.get("dp_run") is not None:
            headers[IDEMPOTENCY_KEY] = uuid.uuid4().hex
        return body, headers

    @staticmethod
    def _decode(response: httpx.Response) -> Fields:
        """A result body (safetensors or JSON) as fields with numpy arrays."""
        streamed = response.extensions.pop(ANSWER, None)  # the response may outlive it
        if streamed is not None:
            return dict(streamed)
        ctype = media_type(response.headers.get("content-type"))
        if ctype == SAFETENSORS:
            return fields_from_safetensors(response.content, RESPONSE_KEY)
        return decode_json_result(response.json())

    def _check_version(self, response: httpx.Response) -> None:
        """Warn once per client if the server is older than this client (``psgrad-version``)."""
        if not self._version_read:
            self._version_read = warn_if_older(response.headers.get(VERSION_HEADER),
                                               self.base_url)

    def _answer_reader(self, path: str, response: httpx.Response) -> AnswerReader | None:
        """A reader for a safetensors answer (read as it arrives, into arrays allocated once,
        in memory of answers the caller dropped where there is some), or None: the body is read
        whole (JSON, errors, model weights)."""
        ctype = media_type(response.headers.get("content-type"))
        if response.is_success and ctype == SAFETENSORS and path.startswith(ANSWER_PATHS):
            return AnswerReader(RESPONSE_KEY, self._memory.allocator())
        return None

    @staticmethod
    def _error(response: httpx.Response) -> PsgradError:
        try:
            body: Any = response.json()
        except ValueError:
            body = response.text
        request_id = response.headers.get(REQUEST_ID_HEADER)
        exc = error_from_body(body, response.status_code, request_id=request_id)
        after = _retry_after(response)
        if isinstance(exc, Overloaded) and after is not None:
            exc.retry_after = after
        return exc

    # -- retries -------------------------------------------------------------------------------

    def _retry_delay(self, attempt: int, response: httpx.Response | None,
                     exc: httpx.TransportError | None = None, repeat: bool = True
                     ) -> float | None:
        """Seconds to wait before retry ``attempt`` (0-based), or None to give up.

        Only connection errors (``response`` None), 408, 429 and 5xx are retried; a request
        that must not ``repeat`` (:func:`repeatable`) only where it surely was not applied: no
        connection made, or a 408, 429 or 503 (refused before any work). A ``Retry-After``
        is honoured as it is; without one the delay is exponential with jitter.
        """
        if attempt >= self.max_retries:
            return None
        if response is not None and not (
            response.status_code in RETRY_STATUSES or response.status_code >= 500
        ):
            return None
        if not repeat and not (isinstance(exc, NOT_SENT) or (
                response is not None and response.status_code in REFUSED_STATUSES)):
            return None
        after = _retry_after(response)
        if after is not None:
            return after if after <= MAX_RETRY_AFTER else None
        delay = min(INITIAL_RETRY_DELAY * 2.0**attempt, MAX_RETRY_DELAY)
        return delay * (1.0 - 0.25 * random.random())

    def _after_failure(
        self,
        attempt: int,
        *,
        response: httpx.Response | None = None,
        exc: httpx.TransportError | None = None,
        repeat: bool = True,
    ) -> float:
        """The delay before the next try, or raise the typed error when there is none."""
        delay = self._retry_delay(attempt, response, exc, repeat)
        if delay is not None:
            return delay  # the body was read already: the connection is free
        if response is not None:
            raise self._error(response)
        if not repeat and not isinstance(exc, NOT_SENT):
            raise (APITimeoutError if isinstance(exc, httpx.TimeoutException)
                   else APIConnectionError)(
                f"the answer from {self.base_url} was lost ({exc!r}), and the request was not "
                "sent again: the server may have applied it, and a second would add to it "
                "(a store's samples, rows or factors). Look at what the server holds before "
                "sending it again", maybe_applied=True) from exc
        if isinstance(exc, httpx.TimeoutException):
            raise APITimeoutError(
                f"no answer from {self.base_url} within the timeout ({exc!r}) after "
                f"{attempt + 1} attempt(s): raise timeout= or send smaller batches"
            ) from exc
        raise APIConnectionError(
            f"could not reach psgrad at {self.base_url} ({exc!r}) after {attempt + 1} "
            f"attempt(s): is the server running? (set base_url= or {ENV_URL})"
        ) from exc

    # -- readiness -----------------------------------------------------------------------------

    def _waiting_ready(self, within: float, need_worker: bool) -> Steps[None]:
        """``wait_ready``: ``GET /readyz`` until it answers 200, each ask bounded by what is
        left of ``within`` (:meth:`_not_ready` says how long to wait between)."""
        end = time.monotonic() + within
        path = "/readyz" if need_worker else "/readyz?need_worker=false"
        while True:
            response, failed = None, None
            ask = min(READY_ASK_S, max(0.1, end - time.monotonic()))
            try:
                response = yield "exchange", ("GET", path, None, None, None, ask)
            except httpx.TransportError as exc:
                failed = exc
            if response is not None and response.is_success:
                return
            yield "sleep", self._not_ready(end, within, response, failed)

    def _not_ready(self, end: float, within: float, response: httpx.Response | None,
                   exc: httpx.TransportError | None) -> float:
        """The wait before asking ``/readyz`` again; raise at ``end`` (saying what was last
        heard) or on an answer other than "not ready" (503; an unreachable server is
        waited for: it may be starting)."""
        left = end - time.monotonic()
        if response is not None and response.status_code != 503:
            raise self._error(response)
        if left <= 0:
            last = (f"it answered {response.status_code} {response.text[:200]}"
                    if response is not None else f"it could not be reached ({exc!r})")
            raise APITimeoutError(
                f"{self.base_url} was not ready within {within:g} s ({last}): a server starting "
                "warms its workers first, then says ready; wait longer (`within`) or read its log")
        return min(left, _retry_after(response) or READY_POLL_S)

    # -- gradients -----------------------------------------------------------------------------

    _grads_fields = staticmethod(grads_fields)  # the checked request: psgrad._request

    def _dtype_unknown(self, fields: Fields, *, float32: bool = False) -> str | None:
        """The model to ask ``GET /models/{id}`` about before ``fields`` can be cast, if any:
        only a floating array other than float32 needs its dtype (any floating array, with
        ``float32``: a store's batches, where a float16 or bfloat16 model would refuse each
        batch of float32 and one question costs nothing beside them, and a queued job, whose
        refusal would come only with its result, too late to cast and send again), and only
        once per model."""
        model = str(fields["model"])
        return None if model in self._dtypes or not needs_model_dtype(
            fields, float32=float32) else model

    def _cast(self, fields: Fields, info: ModelInfo | None) -> Fields:
        """``fields`` with floating arrays in the model's dtype, once ``info`` told it."""
        model = str(fields["model"])
        if info is not None:
            if len(self._dtypes) >= _MAX_DTYPES:
                self._dtypes.clear()
            self._dtypes[model] = float_dtype(info)
        return cast_floats(fields, self._dtypes.get(model))

    def _refused_unasked(self, fields: Fields, exc: PsgradError) -> str | None:
        """The model to ask ``GET /models/{id}`` about after the server refused ``fields`` for
        a dtype (``exc``) without this client knowing the model's: float32 arrays go as they
        are, and a float16 or bfloat16 model refuses those it cannot take. The call is then
        cast (:meth:`_recast`) and sent once more."""
        model = str(fields["model"])
        return model if isinstance(exc, DtypeMismatch) and model not in self._dtypes else None

    def _recast(self, fields: Fields, info: ModelInfo) -> Fields | None:
        """``fields`` cast to the dtype ``info`` tells (as :meth:`_cast`), or None where that
        changes nothing (a float32 model: the refusal stands)."""
        cast = self._cast(fields, info)
        dtype = self._dtypes.get(str(fields["model"]))
        return cast if dtype is not None and str(dtype) != "float32" else None

    @contextlib.contextmanager
    def _plan(
        self, fields: Fields, progress: ProgressArg, chunk_size: int | None
    ) -> Iterator[Plan]:
        """The chunking plan of a request, with its progress bar (if asked for) closed after."""
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
            raise ValueError(f"chunk_size must be an integer >= 1; got {chunk_size!r}")
        bar = Progress(f"psgrad {fields['model']}") if progress is True else None
        callback = bar or (progress if callable(progress) else None)
        try:
            yield grads_plan(fields, limit=chunk_size or self.max_batch_size, progress=callback)
        finally:
            if bar is not None:
                bar.close()

    def _planned(
        self, out: PlanResult, chunk_size: int | None, *, as_torch: bool, started: float
    ) -> GradsResult:
        """The result of a plan; a batch limit the server revealed is remembered, unless the
        caller chose the chunk size."""
        if out.limit is not None and chunk_size is None:
            self.max_batch_size = out.limit
        return self._result(out.fields, as_torch=as_torch, started=started)

    @staticmethod
    def _result(
        fields: Fields, *, as_torch: bool, started: float, order: Sequence[str] = ()
    ) -> GradsResult:
        names = [*order, *(k for k in fields if k in ANSWER_NAMES and k not in order)]
        outputs = {k: fields[k] for k in names if k in fields}
        if as_torch:
            outputs = {k: to_torch(v) for k, v in outputs.items()}
        timing = dict(fields.get("timing") or {})
        timing["total_ms"] = (time.perf_counter() - started) * 1000.0
        return GradsResult(
            model=str(fields.get("model", "")),
            batch_size=int(fields.get("batch_size", 0)),
            loss=fields.get("loss"),
            outputs=outputs,
            timing=timing,
            meta=dict(fields.get("meta") or {}),
        )

    # -- steps: the logic of every exchange, once; each client drives them with its own I/O ----

    def _sending(self, method: str, path: str, *, content: bytes | None = None,
                 json: Any = None, headers: Mapping[str, str] | None = None,
                 repeat: bool | None = None) -> Steps[httpx.Response]:
        """One HTTP exchange with retries; a non-2xx answer raises its typed error. ``repeat``:
        whether it may be sent again when its answer was lost (default: :func:`repeatable`)."""
        repeat = repeatable(method, path, headers=headers) if repeat is None else repeat
        for attempt in itertools.count():
            try:
                response = yield "exchange", (method, path, content, json, headers)
            except httpx.TransportError as exc:
                delay = self._after_failure(attempt, exc=exc, repeat=repeat)
            else:
                if response.is_success:
                    return response
                delay = self._after_failure(attempt, response=response, repeat=repeat)
            yield "sleep", delay
        raise AssertionError("unreachable")

    def _calling(self, call: Call[T]) -> Steps[T]:
        """A described exchange sent, and its answer read."""
        response = yield from self._sending(call.method, call.path, content=call.content,
                                            json=call.json, headers=call.headers)
        return call.read(response)

    def _model_info(self, model: str) -> Steps[ModelInfo]:
        """``GET /models/{id}``: what ``model`` takes, its dtype included."""
        info: ModelInfo = yield from self._calling(self.models._get(model))
        return info

    def _preparing(self, fields: Fields, *, float32: bool = False) -> Steps[Fields]:
        """``fields`` with its floating arrays in the model's dtype (asked for once a model;
        ``float32``: as :meth:`_dtype_unknown`)."""
        model = self._dtype_unknown(fields, float32=float32)
        info = None if model is None else (yield from self._model_info(model))
        return self._cast(fields, info)

    def _posting(self, path: str, fields: Fields) -> Steps[httpx.Response]:
        """A gradients or job request's ``fields`` sent to ``path`` (:meth:`_encode`). A kept
        answer (a keyed gradients request's: a DP step's) is released once in hand."""
        body, headers = self._encode(fields, path)
        response = yield from self._sending("POST", path, content=body, headers=headers,
                                            repeat=repeatable("POST", path, fields, headers))
        kept = response.headers.get("content-location", "")
        if path == "/per-sample-grads" and kept.startswith("/jobs/"):
            yield from self._releasing(kept)
        return response

    def _releasing(self, kept: str) -> Steps[None]:
        """``DELETE`` the job a kept answer names (``/jobs/{id}``): the server would hold it,
        for the tries of its key, until its results expire. At most a wasted call if it
        fails: the expiry drops it then."""
        with contextlib.suppress(PsgradError):
            yield from self._sending("DELETE", kept)

    def _chunked(self, plan: Plan) -> Steps[PlanResult]:
        """A chunking plan driven: each request it yields sent, its answer or 413 fed back."""
        with contextlib.closing(plan):
            try:
                fields = next(plan)
                while True:
                    try:
                        answer = self._decode((yield from self._posting("/per-sample-grads",
                                                                        fields)))
                    except TooLarge as exc:
                        fields = plan.throw(exc)
                    else:
                        fields = plan.send(answer)
            except StopIteration as stop:
                return stop.value

    def _computing(self, fields: Fields, *, as_torch: bool, progress: ProgressArg,
                   chunk_size: int | None) -> Steps[GradsResult]:
        """A gradients request, chunked as the server's limits need, cast and sent once more
        where the server refused a dtype this client had not asked about."""
        started = time.perf_counter()
        fields = yield from self._preparing(fields)
        while True:
            try:
                with self._plan(fields, progress, chunk_size) as plan:
                    out = yield from self._chunked(plan)
                return self._planned(out, chunk_size, as_torch=as_torch, started=started)
            except DtypeMismatch as exc:
                model = self._refused_unasked(fields, exc)
                cast = None if model is None else self._recast(
                    fields, (yield from self._model_info(model)))
                if cast is None:
                    raise
                fields = cast

    def _queueing(self, fields: Fields) -> Steps[dict[str, Any]]:
        """A job queued (``POST /jobs``): the server's answer."""
        prepared = yield from self._preparing(fields, float32=True)
        doc: dict[str, Any] = (yield from self._posting("/jobs", prepared)).json()
        return doc


def decode_json_result(doc: Any) -> Fields:
    """A JSON result: the tensors of each output (nested lists or base64) become numpy arrays,
    floating ones in the dtype the answer says it holds (``meta.dtype``; float32 from a server
    that does not say), as a safetensors answer's are; ``null`` (a value that is not finite)
    is NaN."""
    if not isinstance(doc, dict):
        raise BadRequest("the server answered something that is not a JSON object")
    fields = dict(doc)
    meta = fields.get("meta")
    held = meta.get("dtype") if isinstance(meta, dict) else None
    dtype = np.dtype(held if held in ("float16", "float64") else "float32")
    for name in ANSWER_NAMES:
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, dict) and not {"dtype", "shape", "data"} <= set(value):
            fields[name] = {k: _answer_array(v, f"{name}.{k}", dtype) for k, v in value.items()}
        else:
            fields[name] = _answer_array(value, name, dtype)
    return fields


def _answer_array(value: Any, name: str, dtype: np.dtype) -> np.ndarray:
    """One answer tensor of a JSON result, floating in ``dtype``."""
    if isinstance(value, dict):
        return array_from_json(value, name=name, max_elements=_MAX_DECODE_ELEMENTS)
    if value is None:
        return np.asarray(np.nan, dtype)
    try:
        arr = array_from_json(value, name=name, max_elements=_MAX_DECODE_ELEMENTS, wide=True)
    except BadRequest:  # a null among the numbers (or no tensor: refused again below)
        arr = array_from_json(_finite_or_nan(value), name=name,
                              max_elements=_MAX_DECODE_ELEMENTS, wide=True)
    return arr.astype(dtype) if arr.dtype.kind == "f" else arr


def _finite_or_nan(value: Any) -> Any:
    """JSON's ``null`` for a value that is not finite, as NaN, in nested lists."""
    if isinstance(value, list):
        return [_finite_or_nan(v) for v in value]
    return math.nan if value is None else value


def repeatable(method: str, path: str, fields: Mapping[str, Any] | None = None,
               headers: Mapping[str, str] | None = None) -> bool:
    """Whether a request may be sent again when its answer was lost (a dropped connection, a
    timeout, a 5xx): one that reads or replaces (GET, PUT, DELETE), a POST that only computes
    (gradients without a DP run, a store's query or lookup), or one with an
    ``Idempotency-Key`` (a job, a DP step, a DP run: the server makes what its first try made
    alone). Never another that adds: a DP step without a key, a store's samples, rows or
    factors (a factors batch sent twice without its ``batch_id`` is fitted twice)."""
    if method != "POST" or IDEMPOTENCY_KEY in (headers or {}):
        return True
    if path == "/per-sample-grads":
        return not (fields or {}).get("dp_run")
    return path.startswith("/stores/") and path.endswith(("/query", "/lookup"))
