"""What the sync and the async client share: configuration, encoding, errors, retry decisions.

Nothing here does I/O; ``Client`` and ``AsyncClient`` only add the send loop (with ``sleep`` or
``await asyncio.sleep``) and drive the chunking plan of :mod:`psgrad._merge`.
"""

from __future__ import annotations

import email.utils
import json
import math
import os
import random
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np

from psgrad._constants import (
    DEFAULT_BASE_URL,
    DEFAULT_MAX_RETRIES,
    DEFAULT_TIMEOUT,
    ENV_API_KEY,
    ENV_URL,
    INITIAL_RETRY_DELAY,
    JOB_STATUS_HEADER,
    MAX_RETRY_AFTER,
    MAX_RETRY_DELAY,
    REQUEST_ID_HEADER,
    RETRY_STATUSES,
    USER_AGENT,
)
from psgrad._errors import _BY_CODE as ERRORS_BY_CODE
from psgrad._errors import (
    APIConnectionError,
    APITimeoutError,
    BadRequest,
    InvalidInput,
    JobCanceled,
    JobFailed,
    Overloaded,
    PsgradError,
    error_from_body,
)
from psgrad._merge import Fields, PlanResult
from psgrad._types import OUTPUT_NAMES, GradsResult, JobStatus
from psgrad._wire import (
    JSON,
    REQUEST_KEY,
    RESPONSE_KEY,
    SAFETENSORS,
    array_from_json,
    fields_from_safetensors,
    fields_to_json,
    fields_to_safetensors,
)

__all__ = ["BaseClient", "to_numpy", "to_torch"]

_MAX_DECODE_ELEMENTS = 2**62  # our own server's answers: it enforces its limits itself


def to_numpy(value: Any, name: str) -> np.ndarray:
    """A numpy array from numpy, a torch tensor (torch is never imported here) or nested lists.

    Lists carry no dtype: their floats become float32, the models' own dtype (as the server does
    for JSON lists); numpy arrays and tensors keep theirs.
    """
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")  # a tensor can only exist if torch is already imported
    if torch is not None and isinstance(value, torch.Tensor):
        tensor = value.detach().cpu()
        if tensor.dtype == torch.bfloat16:
            tensor = tensor.float()
        return np.asarray(tensor.numpy())
    try:
        arr = np.asarray(value)
    except (ValueError, TypeError) as exc:
        raise BadRequest(f"'{name}' is not a rectangular array of numbers: {exc}") from exc
    if arr.dtype.kind not in "biuf":
        raise BadRequest(f"'{name}' must hold numbers or booleans; got {arr.dtype}")
    if arr.dtype == np.float64 and not isinstance(value, np.generic):
        arr = arr.astype(np.float32)
    return arr


def to_torch(value: Any) -> Any:
    """numpy -> torch, recursively through dicts; imports torch only when asked for."""
    import torch

    if isinstance(value, Mapping):
        return {k: to_torch(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return torch.from_numpy(value if value.flags.writeable else value.copy())
    return value


def _param_arrays(value: Mapping[str, Any] | None, name: str) -> dict[str, np.ndarray] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise BadRequest(f"'{name}' must map parameter names to arrays")
    return {str(k): to_numpy(v, f"{name}.{k}") for k, v in value.items()}


def _number(value: Any, name: str) -> float | None:
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise BadRequest(f"'{name}' must be a number; got {value!r}") from None
    if not math.isfinite(number):
        raise BadRequest(f"'{name}' must be finite")
    return number


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


class BaseClient:
    """Options common to ``Client`` and ``AsyncClient``; see ``Client`` for their meaning."""

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
    ) -> None:
        self.base_url = (base_url or os.environ.get(ENV_URL) or DEFAULT_BASE_URL).rstrip("/")
        self.api_key = api_key if api_key is not None else os.environ.get(ENV_API_KEY) or None
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

    def __repr__(self) -> str:
        return f"{type(self).__name__}(base_url={self.base_url!r})"

    # -- encoding ------------------------------------------------------------------------------

    def _encode(self, fields: Fields) -> tuple[bytes, dict[str, str]]:
        """The body and headers of a gradients or job request, binary unless ``binary=False``."""
        if self.binary:
            body = fields_to_safetensors(fields, REQUEST_KEY)
            return body, {"Content-Type": SAFETENSORS, "Accept": SAFETENSORS}
        body = json.dumps(fields_to_json(fields, binary=True)).encode()
        return body, {"Content-Type": JSON, "Accept": JSON}

    @staticmethod
    def _decode(response: httpx.Response) -> Fields:
        """A result body (safetensors or JSON) as fields with numpy arrays."""
        ctype = response.headers.get("content-type", "").split(";")[0].strip()
        if ctype == SAFETENSORS:
            return fields_from_safetensors(response.content, RESPONSE_KEY)
        return decode_json_result(response.json())

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

    def _retry_delay(self, attempt: int, response: httpx.Response | None) -> float | None:
        """Seconds to wait before retry ``attempt`` (0-based), or None to give up.

        Only connection errors (``response`` None), 408, 429 and 5xx are retried. A
        ``Retry-After`` is honoured as it is; without one the delay is exponential with jitter.
        """
        if attempt >= self.max_retries:
            return None
        if response is not None and not (
            response.status_code in RETRY_STATUSES or response.status_code >= 500
        ):
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
    ) -> float:
        """The delay before the next try, or raise the typed error when there is none."""
        delay = self._retry_delay(attempt, response)
        if delay is not None:
            return delay  # the body was read already: the connection is free
        if response is not None:
            raise self._error(response)
        if isinstance(exc, httpx.TimeoutException):
            raise APITimeoutError(
                f"no answer from {self.base_url} within the timeout ({exc!r}) after "
                f"{attempt + 1} attempt(s): raise timeout= or send smaller batches"
            ) from exc
        raise APIConnectionError(
            f"could not reach psgrad at {self.base_url} ({exc!r}) after {attempt + 1} "
            f"attempt(s): is the server running? (set base_url= or {ENV_URL})"
        ) from exc

    # -- request building ----------------------------------------------------------------------

    def _grads_fields(
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
    ) -> Fields:
        if not isinstance(model, str) or not model:
            raise BadRequest("'model' must be a model id such as 'mlp' or 'id@version'")
        outs = [outputs] if isinstance(outputs, str) else list(outputs)
        if not outs:
            raise BadRequest(f"'outputs' must name at least one of: {', '.join(OUTPUT_NAMES)}")
        noise = _number(noise_multiplier, "noise_multiplier")
        if noise is not None and noise < 0:
            raise InvalidInput("'noise_multiplier' must be >= 0")
        if seed is not None and (
            isinstance(seed, bool)
            or not isinstance(seed, (int, np.integer))
            or not 0 <= int(seed) < 2**63
        ):
            raise BadRequest("'seed' must be an integer in [0, 2**63)")
        fields: Fields = {"model": model, "inputs": to_numpy(inputs, "inputs"), "outputs": outs}
        optional: dict[str, Any] = {
            "targets": None if targets is None else to_numpy(targets, "targets"),
            "next_inputs": None if next_inputs is None else to_numpy(next_inputs, "next_inputs"),
            "rewards": None if rewards is None else to_numpy(rewards, "rewards"),
            "dones": None if dones is None else to_numpy(dones, "dones"),
            "loss": loss,
            "params": None if params is None else [str(p) for p in params],
            "weights": _param_arrays(weights, "weights"),
            "reference": _param_arrays(reference, "reference"),
            "clip_norm": _number(clip_norm, "clip_norm"),
            "noise_multiplier": noise,
            "seed": None if seed is None else int(seed),
            "gamma": _number(gamma, "gamma"),
        }
        fields.update({k: v for k, v in optional.items() if v is not None})
        return fields

    def _limit(self, chunk_size: int | None) -> int | None:
        if chunk_size is not None and chunk_size < 1:
            raise ValueError("chunk_size must be >= 1")
        return chunk_size or self.max_batch_size

    def _learn(self, plan_result: PlanResult, chunk_size: int | None) -> None:
        """Remember a batch limit the server revealed, unless the caller chose the chunk size."""
        if plan_result.limit is not None and chunk_size is None:
            self.max_batch_size = plan_result.limit

    @staticmethod
    def _result(
        fields: Fields, *, as_torch: bool, started: float, order: Sequence[str] = ()
    ) -> GradsResult:
        names = [*order, *(k for k in fields if k in OUTPUT_NAMES and k not in order)]
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

    @staticmethod
    def _model_path(model_id: str, suffix: str = "") -> str:
        if not isinstance(model_id, str) or not model_id:
            raise BadRequest("a model id is required")
        return f"/models/{quote(model_id, safe='@')}{suffix}"

    @staticmethod
    def _register_body(
        architecture: str,
        config: Mapping[str, Any] | None,
        layers: Sequence[Mapping[str, Any]] | None,
        input: Mapping[str, Any] | None,
        default_loss: str | None,
        losses: Sequence[str] | None,
        weights: Mapping[str, Any] | None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"architecture": architecture}
        extra = {
            "config": None if config is None else dict(config),
            "layers": None if layers is None else [dict(x) for x in layers],
            "input": None if input is None else dict(input),
            "default_loss": default_loss,
            "losses": None if losses is None else list(losses),
        }
        body.update({k: v for k, v in extra.items() if v is not None})
        state = _param_arrays(weights, "weights")
        if state is not None:
            body["weights"] = fields_to_json({"w": state}, binary=True)["w"]
        return body


def decode_json_result(doc: Any) -> Fields:
    """A JSON result: the tensors of each output (nested lists or base64) become numpy arrays."""
    if not isinstance(doc, dict):
        raise BadRequest("the server answered something that is not a JSON object")
    fields = dict(doc)
    for name in OUTPUT_NAMES:
        value = fields.get(name)
        if value is None:
            continue
        if isinstance(value, dict) and not {"dtype", "shape", "data"} <= set(value):
            fields[name] = {
                k: array_from_json(v, name=f"{name}.{k}", max_elements=_MAX_DECODE_ELEMENTS)
                for k, v in value.items()
            }
        else:
            fields[name] = array_from_json(value, name=name, max_elements=_MAX_DECODE_ELEMENTS)
    return fields


def job_state(response: httpx.Response) -> tuple[JobStatus, Fields | None, PsgradError | None]:
    """A job document (``GET``/``DELETE /jobs/{id}``): its status, result fields or error.

    JSON: ``{"job_id", "status", "result": {...}, "error": {"code", "message", ...}}``; a
    finished job asked for with ``Accept: application/x-safetensors`` is the result itself, as a
    safetensors answer, with the status in the ``X-Psgrad-Job-Status`` header.
    """
    ctype = response.headers.get("content-type", "").split(";")[0].strip()
    result: Fields | None = None
    doc: dict[str, Any]
    if ctype == SAFETENSORS:
        result = fields_from_safetensors(response.content, RESPONSE_KEY)
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


def weights_from_bytes(body: bytes) -> dict[str, np.ndarray]:
    """A safetensors weights file as {name: array} (never a pickle)."""
    from safetensors.numpy import load

    try:
        return dict(load(body))
    except Exception as exc:  # SafetensorError and friends: the answer is corrupt
        raise BadRequest(f"the weights are not a valid safetensors file: {exc}") from exc


def state_dict_bytes(state_dict: Mapping[str, Any]) -> bytes:
    """A state dict (numpy arrays or torch tensors) as a safetensors file."""
    from safetensors.numpy import save

    arrays = {
        str(k): np.asarray(to_numpy(v, f"state_dict.{k}"), order="C")  # 0-d stays 0-d
        for k, v in state_dict.items()
    }
    return bytes(save(arrays))
