"""The synchronous client: ``psgrad.Client``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar

import httpx

from psgrad._base import ANSWER, BaseClient, Call, ProgressArg, upload
from psgrad._constants import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT
from psgrad._errors import TooLarge
from psgrad._jobs import Job
from psgrad._merge import Fields, Plan, PlanResult
from psgrad._models import Models
from psgrad._receive import receive_answer
from psgrad._reference_sets import ReferenceSets
from psgrad._stores import Stores
from psgrad._types import GradsResult, JobStatus

__all__ = ["Client"]

T = TypeVar("T")


class Client(BaseClient):
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

    # -- transport -----------------------------------------------------------------------------

    def _send(
        self,
        method: str,
        path: str,
        *,
        content: bytes | None = None,
        json: Any = None,
        headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        """One HTTP exchange with retries; a non-2xx answer raises its typed error."""
        for attempt in itertools.count():
            try:
                response = self._exchange(method, path, content, json, headers)
            except httpx.TransportError as exc:
                delay = self._after_failure(attempt, exc=exc)
            else:
                if response.is_success:
                    return response
                delay = self._after_failure(attempt, response=response)
            time.sleep(delay)
        raise AssertionError("unreachable")

    def _exchange(self, method: str, path: str, content: bytes | None, json: Any,
                  headers: Mapping[str, str] | None) -> httpx.Response:
        """One request; a safetensors answer is read into its arrays as it arrives."""
        content, headers, pieces = upload(content, headers)
        request = self._http.build_request(method, path, content=content or pieces, json=json,
                                           headers=headers)
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

    def _call(self, call: Call[T]) -> T:
        """Send a described exchange and read its answer."""
        response = self._send(
            call.method, call.path, content=call.content, json=call.json, headers=call.headers
        )
        return call.read(response)

    def _prepare(self, fields: Fields) -> Fields:
        """``fields`` with its floating arrays in the model's dtype (asked for once a model)."""
        model = self._dtype_unknown(fields)
        return self._cast(fields, None if model is None else self.models.get(model))

    def _post_fields(self, path: str, fields: Fields) -> httpx.Response:
        body, headers = self._encode(fields)
        return self._send("POST", path, content=body, headers=headers)

    def _run_plan(self, plan: Plan) -> PlanResult:
        """Drive a chunking plan: send each request it yields, feed back answers or a 413."""
        try:
            fields = next(plan)
            while True:
                try:
                    answer = self._decode(self._post_fields("/per-sample-grads", fields))
                except TooLarge as exc:
                    fields = plan.throw(exc)
                else:
                    fields = plan.send(answer)
        except StopIteration as stop:
            return stop.value
        finally:
            plan.close()

    def _compute(
        self, fields: Fields, *, as_torch: bool, progress: ProgressArg, chunk_size: int | None
    ) -> GradsResult:
        started = time.perf_counter()
        fields = self._prepare(fields)
        with self._plan(fields, progress, chunk_size) as plan:
            out = self._run_plan(plan)
        return self._planned(out, chunk_size, as_torch=as_torch, started=started)

    # -- gradients -----------------------------------------------------------------------------

    def per_sample_grads(
        self,
        model: str,
        inputs: Any,
        targets: Any = None,
        *,
        loss: str | None = None,
        outputs: Sequence[str] | str = ("grads",),
        params: Sequence[str] | None = None,
        weights: Mapping[str, Any] | None = None,
        clip_norm: float | None = None,
        noise_multiplier: float | None = None,
        seed: int | None = None,
        reference: Mapping[str, Any] | None = None,
        projection_dim: int | None = None,
        projection_seed: int | None = None,
        projection_kind: str | None = None,
        reference_sketches: Any = None,
        reference_set: str | None = None,
        answer_dtype: str | None = None,
        verify: int | None = None,
        verify_seed: int | None = None,
        as_torch: bool = False,
        progress: ProgressArg = False,
        chunk_size: int | None = None,
    ) -> GradsResult:
        """Per-sample gradients of ``model`` on a batch, or statistics of them.

        Args:
            model: a model id, or ``id@version`` to pin weights.
            inputs: the batch [B, ...]: a numpy array, a torch tensor or nested lists; floating
                arrays in the model's dtype (see above), integer ones (token ids) as they are.
            targets: labels or regression targets [B, ...] for supervised losses.
            loss: ``cross_entropy``, ``nll``, ``mse``, ...; default: the model's own.
            outputs: any of ``grads``, ``losses``, ``norms``, ``layer_norms``, ``mean``,
                ``variance``, ``clipped_mean``, ``dot``, ``cosine_mean``, ``projection``,
                ``dots``, ``influence``, ``self_influence``.
            params: restrict every output to these parameters.
            weights: {parameter: array} used for this call instead of the registered ones.
            clip_norm, noise_multiplier, seed: for ``clipped_mean`` (DP-SGD).
            reference: {parameter: array} for ``dot``, or {parameter: [M, *shape]} for
                ``dots`` (exact dot products with M gradients).
            projection_dim, projection_seed: the sketch of ``projection`` (k up to 8192; the
                same seed and k give comparable sketches across requests and processes).
            projection_kind: ``tensorsketch`` (default: a dense projection's accuracy) or
                ``kronecker`` (the earlier kind, for sketches made with it).
            reference_sketches: [M, k] sketches for ``dots``, made with the same projection.
            reference_set: the id of a ``client.reference_sets`` set, for ``influence``.
            answer_dtype: ``float16`` or ``bfloat16``: the server answers floating tensors in
                half the bytes (relative rounding error at most 2^-11 / 2^-8); float16 arrays
                come back as float16, bfloat16 ones widened exactly to float32 (numpy has no
                bfloat16).
            verify, verify_seed: the server recomputes ``verify`` samples of each request
                (up to 64; the batch may be split into several) one at a time with the
                per-sample loop and compares the outputs: ``result.meta["verify"]`` reports the
                samples (indices into this batch) and the largest difference, and a wrong answer
                raises ``VerificationFailed`` instead of being returned. ``verify_seed`` picks
                the samples (default: each request's job id).
            as_torch: return torch tensors instead of numpy arrays.
            progress: draw a progress bar on stderr (tqdm if installed), or a callable
                ``f(done, total)`` called after each request.
            chunk_size: the most samples per request; default: the client's
                ``max_batch_size``, else what the server accepts.

        A batch larger than one request may hold is split into chunks and combined exactly:
        per-sample outputs are concatenated; ``mean`` and ``variance`` merged with Chan's
        formula; ``clipped_mean`` as the sum of the chunks' noiseless clipped sums with the
        noise added once by the client (seeded with ``seed``; drawn by the client even for one
        chunk, so the result never depends on the split); ``cosine_mean`` in two passes (the
        chunks' means first, then ``dot`` with the combined mean and the norms). See
        :mod:`psgrad._merge`.

        Returns:
            A :class:`GradsResult`: ``result.norms``, ``result.grads["fc1.weight"]``, ...

        Raises:
            PsgradError: the subclass of the server's error code (``UnknownModel``,
                ``ShapeMismatch``, ...), or ``APIConnectionError`` if it cannot be reached.
        """
        fields = self._grads_fields(
            model,
            inputs,
            targets,
            loss=loss,
            outputs=outputs,
            params=params,
            weights=weights,
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            seed=seed,
            reference=reference,
            projection_dim=projection_dim,
            projection_seed=projection_seed,
            projection_kind=projection_kind,
            reference_sketches=reference_sketches,
            reference_set=reference_set,
            answer_dtype=answer_dtype,
            verify=verify,
            verify_seed=verify_seed,
        )
        return self._compute(fields, as_torch=as_torch, progress=progress, chunk_size=chunk_size)

    def td0(
        self,
        model: str,
        states: Any,
        rewards: Any,
        next_states: Any,
        *,
        dones: Any = None,
        gamma: float = 1.0,
        weights: Mapping[str, Any] | None = None,
        outputs: Sequence[str] | str = ("updates", "td_errors"),
        params: Sequence[str] | None = None,
        answer_dtype: str | None = None,
        verify: int | None = None,
        verify_seed: int | None = None,
        as_torch: bool = False,
        progress: ProgressArg = False,
        chunk_size: int | None = None,
    ) -> GradsResult:
        """Per-sample TD(0) of a value function: ``updates`` (delta_i grad V(s_i)), ``td_errors``.

        target_i = r_i + gamma (1 - done_i) V(s'_i), gradient stopped through it;
        delta_i = target_i - V(s_i). ``grads`` (of the pseudo-loss (target_i - V(s_i))^2) and
        every statistic of :meth:`per_sample_grads` may be asked for too, and large batches are
        split and combined the same way.
        """
        fields = self._grads_fields(
            model,
            states,
            loss="td0",
            outputs=outputs,
            params=params,
            weights=weights,
            next_inputs=next_states,
            rewards=rewards,
            dones=dones,
            gamma=gamma,
            answer_dtype=answer_dtype,
            verify=verify,
            verify_seed=verify_seed,
        )
        return self._compute(fields, as_torch=as_torch, progress=progress, chunk_size=chunk_size)

    # -- jobs ----------------------------------------------------------------------------------

    def submit(
        self,
        model: str,
        inputs: Any,
        targets: Any = None,
        *,
        loss: str | None = None,
        outputs: Sequence[str] | str = ("grads",),
        params: Sequence[str] | None = None,
        weights: Mapping[str, Any] | None = None,
        clip_norm: float | None = None,
        noise_multiplier: float | None = None,
        seed: int | None = None,
        reference: Mapping[str, Any] | None = None,
        next_inputs: Any = None,
        rewards: Any = None,
        dones: Any = None,
        gamma: float | None = None,
        answer_dtype: str | None = None,
        verify: int | None = None,
        verify_seed: int | None = None,
    ) -> Job:
        """Queue the request (``POST /jobs``) and return at once with a :class:`Job`.

        A job is one request: it is not split, so a batch above the server's limit raises
        ``TooLarge``; the server's own noise is used for ``clipped_mean``.
        """
        fields = self._grads_fields(
            model,
            inputs,
            targets,
            loss=loss,
            outputs=outputs,
            params=params,
            weights=weights,
            clip_norm=clip_norm,
            noise_multiplier=noise_multiplier,
            seed=seed,
            reference=reference,
            next_inputs=next_inputs,
            rewards=rewards,
            dones=dones,
            gamma=gamma,
            answer_dtype=answer_dtype,
            verify=verify,
            verify_seed=verify_seed,
        )
        doc = self._post_fields("/jobs", self._prepare(fields)).json()
        return Job(
            self,
            str(doc["job_id"]),
            JobStatus(doc.get("status", "queued")),
            outputs=fields["outputs"],
        )

    def job(self, job_id: str) -> Job:
        """A handle on a job submitted earlier (by id)."""
        return Job(self, job_id, JobStatus.QUEUED)
