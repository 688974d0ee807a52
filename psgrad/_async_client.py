"""The asynchronous client: ``psgrad.AsyncClient`` (the same API as ``Client``, awaited)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Any

import httpx

from psgrad._base import BaseClient, job_state, state_dict_bytes, to_torch, weights_from_bytes
from psgrad._constants import DEFAULT_MAX_RETRIES, DEFAULT_TIMEOUT, JOB_POLL_INITIAL, JOB_POLL_MAX
from psgrad._errors import APITimeoutError, PsgradError, TooLarge
from psgrad._merge import Fields, Plan, PlanResult, grads_plan
from psgrad._progress import Progress
from psgrad._types import GradsResult, JobStatus, ModelInfo
from psgrad._wire import JSON, SAFETENSORS

__all__ = ["AsyncClient", "AsyncJob", "AsyncModels"]

ProgressArg = bool | Callable[[int, int], None]


class AsyncClient(BaseClient):
    """A psgrad server, called from asyncio: ``Client``'s API with ``await``.

    The same arguments as ``psgrad.Client``, except that ``transport`` is an async transport
    (``httpx.ASGITransport(app)`` in tests) and ``http_client`` an ``httpx.AsyncClient``. Use
    it as an async context manager, or ``await client.close()``.
    """

    def __init__(
        self,
        *,
        base_url: str | None = None,
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

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    # -- transport -----------------------------------------------------------------------------

    async def _send(
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
                response = await self._http.request(
                    method, path, content=content, json=json, headers=headers
                )
            except httpx.TransportError as exc:
                delay = self._after_failure(attempt, exc=exc)
            else:
                if response.is_success:
                    return response
                delay = self._after_failure(attempt, response=response)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _post_fields(self, path: str, fields: Fields) -> httpx.Response:
        body, headers = self._encode(fields)
        return await self._send("POST", path, content=body, headers=headers)

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

    async def _compute(
        self, fields: Fields, *, as_torch: bool, progress: ProgressArg, chunk_size: int | None
    ) -> GradsResult:
        started = time.perf_counter()
        bar = Progress(f"psgrad {fields['model']}") if progress is True else None
        callback = bar or (progress if callable(progress) else None)
        try:
            out = await self._run_plan(
                grads_plan(fields, limit=self._limit(chunk_size), progress=callback)
            )
        finally:
            if bar is not None:
                bar.close()
        self._learn(out, chunk_size)
        return self._result(out.fields, as_torch=as_torch, started=started)

    # -- gradients -----------------------------------------------------------------------------

    async def per_sample_grads(
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
        as_torch: bool = False,
        progress: ProgressArg = False,
        chunk_size: int | None = None,
    ) -> GradsResult:
        """Per-sample gradients or their statistics; see ``Client.per_sample_grads``."""
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
        )
        return await self._compute(
            fields, as_torch=as_torch, progress=progress, chunk_size=chunk_size
        )

    async def td0(
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
        as_torch: bool = False,
        progress: ProgressArg = False,
        chunk_size: int | None = None,
    ) -> GradsResult:
        """Per-sample TD(0) updates and errors; see ``Client.td0``."""
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
        )
        return await self._compute(
            fields, as_torch=as_torch, progress=progress, chunk_size=chunk_size
        )

    # -- jobs ----------------------------------------------------------------------------------

    async def submit(
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
    ) -> AsyncJob:
        """Queue the request and return an :class:`AsyncJob`; see ``Client.submit``."""
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
        )
        doc = (await self._post_fields("/jobs", fields)).json()
        return AsyncJob(
            self,
            str(doc["job_id"]),
            JobStatus(doc.get("status", "queued")),
            outputs=fields["outputs"],
        )

    def job(self, job_id: str) -> AsyncJob:
        """A handle on a job submitted earlier (by id)."""
        return AsyncJob(self, job_id, JobStatus.QUEUED)


class AsyncJob:
    """A queued gradients request: ``status()``, ``result(timeout=...)``, ``cancel()``."""

    def __init__(
        self, client: AsyncClient, job_id: str, status: JobStatus, *, outputs: Sequence[str] = ()
    ) -> None:
        self._client = client
        self.id = job_id
        self.last_status = status
        self._outputs = list(outputs)  # the order to list the result's outputs in

    def __repr__(self) -> str:
        return f"AsyncJob(id={self.id!r}, status={self.last_status.value!r})"

    async def _fetch(self) -> tuple[JobStatus, Fields | None, PsgradError | None]:
        response = await self._client._send(
            "GET",
            f"/jobs/{self.id}",
            headers={"Accept": SAFETENSORS if self._client.binary else JSON},
        )
        state = job_state(response)
        self.last_status = state[0]
        return state

    async def status(self) -> JobStatus:
        """The job's state now: queued, running, succeeded, failed or canceled."""
        return (await self._fetch())[0]

    async def result(self, *, timeout: float | None = None, as_torch: bool = False) -> GradsResult:
        """Wait for the job and return its result, or raise its error (``JobCanceled``, ...).

        Raises:
            APITimeoutError: not finished within ``timeout`` seconds (the job keeps running).
        """
        started = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = JOB_POLL_INITIAL
        while True:
            status, fields, error = await self._fetch()
            if error is not None:
                raise error
            if fields is not None:
                return self._client._result(
                    fields, as_torch=as_torch, started=started, order=self._outputs
                )
            if deadline is not None and time.monotonic() >= deadline:
                raise APITimeoutError(f"job {self.id} is still {status.value} after {timeout} s")
            wait = delay if deadline is None else min(delay, max(0.0, deadline - time.monotonic()))
            await asyncio.sleep(wait)
            delay = min(delay * 2, JOB_POLL_MAX)

    async def cancel(self) -> JobStatus:
        """Ask the server to cancel the job (``DELETE /jobs/{id}``); returns the new state."""
        response = await self._client._send("DELETE", f"/jobs/{self.id}")
        status, _, _ = job_state(response)
        self.last_status = status
        return status


class AsyncModels:
    """``client.models``: the model registry."""

    def __init__(self, client: AsyncClient) -> None:
        self._client = client

    async def list(self) -> list[ModelInfo]:
        """Every model the server knows (``GET /models``)."""
        doc = (await self._client._send("GET", "/models")).json()
        items = doc.get("models", []) if isinstance(doc, dict) else doc
        return [ModelInfo.from_dict(m) for m in items]

    async def get(self, model_id: str) -> ModelInfo:
        """What ``model_id`` (or ``id@version``) takes: input shape, parameters, losses."""
        return ModelInfo.from_dict(
            (await self._client._send("GET", self._client._model_path(model_id))).json()
        )

    async def register(
        self,
        model_id: str,
        *,
        architecture: str,
        config: Mapping[str, Any] | None = None,
        layers: Sequence[Mapping[str, Any]] | None = None,
        input: Mapping[str, Any] | None = None,
        default_loss: str | None = None,
        losses: Sequence[str] | None = None,
        weights: Mapping[str, Any] | None = None,
    ) -> ModelInfo:
        """Register a model (``PUT /models/{id}``): a zoo ``architecture`` with ``config``, or
        ``architecture="sequential"`` with ``layers`` and ``input``; ``weights`` (numpy or torch
        state dict) are sent inline, else the architecture's initial weights are used."""
        body = self._client._register_body(
            architecture, config, layers, input, default_loss, losses, weights
        )
        response = await self._client._send("PUT", self._client._model_path(model_id), json=body)
        return ModelInfo.from_dict(response.json())

    async def upload_weights(self, model_id: str, state_dict: Mapping[str, Any]) -> ModelInfo:
        """New weights for ``model_id`` (a new version); names and shapes must match."""
        response = await self._client._send(
            "PUT",
            self._client._model_path(model_id, "/weights"),
            content=state_dict_bytes(state_dict),
            headers={"Content-Type": SAFETENSORS},
        )
        return ModelInfo.from_dict(response.json())

    async def download_weights(self, model_id: str, *, as_torch: bool = False) -> dict[str, Any]:
        """The weights of ``model_id`` (or ``id@version``) as {name: array}."""
        response = await self._client._send(
            "GET", self._client._model_path(model_id, "/weights"), headers={"Accept": SAFETENSORS}
        )
        weights = weights_from_bytes(response.content)
        return to_torch(weights) if as_torch else weights

    async def delete(self, model_id: str) -> dict[str, Any]:
        """Delete a model, or one version with ``id@version``; returns the server's answer."""
        response = await self._client._send("DELETE", self._client._model_path(model_id))
        return response.json() if response.content else {}
