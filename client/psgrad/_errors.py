"""One error tree for the server and the client.

The server raises these in the engine, worker and api; one exception handler turns them into the
JSON error body, and the worker serialises them through the broker with :meth:`to_dict`. The
client parses the same body back into the same class with :func:`error_from_body`, so a user
catches ``psgrad.UnknownModel`` whether it was raised on this machine or on the GPU host::

    PsgradError                      every error of psgrad; .code, .status, .message, .details
    ├── APIConnectionError           the server could not be reached (client side only)
    │   └── APITimeoutError          no answer within the timeout
    ├── BadRequest (400)             malformed body, a field of the wrong type, bad base64, ...
    │   ├── InvalidArchive (400)     a .pt2 archive that is not a well-formed torch.export file
    │   └── InvalidInput (422)       a value out of its range or choices, or the request
    │       cannot be computed; subclasses:
    │       UnknownLoss, UnknownOutput, UnknownParameter, ShapeMismatch, DtypeMismatch,
    │       NonFinite, EmptyBatch, TargetOutOfRange, LossNotSupported, BatchCoupling,
    │       InvalidModelSpec, RefusedProgram (an exported program psgrad will not run)
    ├── Unauthorized (401), Forbidden (403)
    ├── NotFound (404)               UnknownModel, UnknownJob, UnknownDPRun
    ├── Conflict (409)               JobCanceled, PrivacyBudgetExhausted
    ├── RequestTimeout (408)         the request was not received in time (client side only)
    ├── TooLarge (413)
    ├── Overloaded (503)             queue full or broker down; carries retry_after
    │   └── RateLimited (429)        too many requests from this client
    ├── DeadlineExceeded (504)
    ├── InsufficientStorage (507)    the data directory is full or read-only; nothing written
    ├── JobFailed (500)              a job ended failed without a more precise error
    └── InternalError (500)          a bug: the message never carries a traceback
        └── VerificationFailed (500) ``verify``: the answer differed from the per-sample loop
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "APIConnectionError",
    "APITimeoutError",
    "BadRequest",
    "BatchCoupling",
    "Conflict",
    "DeadlineExceeded",
    "DtypeMismatch",
    "EmptyBatch",
    "Forbidden",
    "InsufficientStorage",
    "InternalError",
    "InvalidArchive",
    "InvalidInput",
    "InvalidModelSpec",
    "JobCanceled",
    "JobFailed",
    "LossNotSupported",
    "NonFinite",
    "NotFound",
    "Overloaded",
    "PrivacyBudgetExhausted",
    "PsgradError",
    "RateLimited",
    "RefusedProgram",
    "RequestTimeout",
    "ShapeMismatch",
    "TargetOutOfRange",
    "TooLarge",
    "Unauthorized",
    "UnknownDPRun",
    "UnknownJob",
    "UnknownLoss",
    "UnknownModel",
    "UnknownOutput",
    "UnknownParameter",
    "UnsupportedMediaType",
    "VerificationFailed",
    "error_from_body",
]

_BY_CODE: dict[str, type[PsgradError]] = {}


class PsgradError(Exception):
    """Base of every psgrad error.

    Args:
        message: what is wrong and what to do about it; shown to the user as it is.
        details: JSON-serialisable facts for programs (limits, known names, ...).
    """

    code: ClassVar[str] = "error"
    status: ClassVar[int] = 500

    def __init__(self, message: str, *, request_id: str | None = None, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        self.request_id = request_id
        self.http_status = self.status  # the status actually received, set by error_from_body

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _BY_CODE.setdefault(cls.code, cls)

    def to_dict(self) -> dict[str, Any]:
        """The JSON error body of the HTTP contract."""
        return {"error": {"code": self.code, "message": self.message, "details": self.details}}


class APIConnectionError(PsgradError):
    code = "connection_error"
    status = 0


class APITimeoutError(APIConnectionError):
    code = "timeout"


class BadRequest(PsgradError):
    code = "bad_request"
    status = 400


class UnsupportedMediaType(BadRequest):
    """The body's ``Content-Type`` is not one the route reads (415)."""

    code = "unsupported_media_type"
    status = 415


class InvalidArchive(BadRequest):
    """A ``.pt2`` body that is not a well-formed torch.export archive (zip, entries, JSON)."""

    code = "invalid_archive"


class InvalidInput(BadRequest):
    code = "invalid_input"
    status = 422


class UnknownLoss(InvalidInput):
    code = "unknown_loss"


class UnknownOutput(InvalidInput):
    code = "unknown_output"


class UnknownParameter(InvalidInput):
    code = "unknown_parameter"


class ShapeMismatch(InvalidInput):
    code = "shape_mismatch"


class DtypeMismatch(InvalidInput):
    code = "dtype_mismatch"


class NonFinite(InvalidInput):
    code = "non_finite"


class EmptyBatch(InvalidInput):
    code = "empty_batch"


class TargetOutOfRange(InvalidInput):
    code = "target_out_of_range"


class LossNotSupported(InvalidInput):
    code = "loss_not_supported"


class BatchCoupling(InvalidInput):
    code = "batch_coupling"


class InvalidModelSpec(InvalidInput):
    code = "invalid_model_spec"


class RefusedProgram(InvalidModelSpec):
    """An exported program with an op, argument or entry outside psgrad's allow-list."""

    code = "refused_program"


class Unauthorized(PsgradError):
    code = "unauthorized"
    status = 401


class Forbidden(PsgradError):
    code = "forbidden"
    status = 403


class NotFound(PsgradError):
    code = "not_found"
    status = 404


class UnknownModel(NotFound):
    code = "unknown_model"


class UnknownJob(NotFound):
    code = "unknown_job"


class Conflict(PsgradError):
    code = "conflict"
    status = 409


class JobCanceled(Conflict):
    code = "job_canceled"


class UnknownDPRun(NotFound):
    code = "unknown_dp_run"


class PrivacyBudgetExhausted(Conflict):
    """One more step of the DP run would spend more than its ``max_epsilon``."""

    code = "privacy_budget_exhausted"


class RequestTimeout(PsgradError):
    code = "request_timeout"
    status = 408


class TooLarge(PsgradError):
    code = "too_large"
    status = 413


class Overloaded(PsgradError):
    """The server is busy or its broker is down; retry after ``retry_after`` seconds."""

    code = "overloaded"
    status = 503

    def __init__(self, message: str, *, retry_after: float = 1.0, **details: Any) -> None:
        super().__init__(message, retry_after=retry_after, **details)
        self.retry_after = retry_after


class RateLimited(Overloaded):
    code = "rate_limited"
    status = 429


class DeadlineExceeded(PsgradError):
    code = "deadline_exceeded"
    status = 504


class InsufficientStorage(PsgradError):
    """The server's data directory (gradient stores, reference sets) or a DP run's ledger
    folder cannot take a write: full, read-only or not writable (``details["reason"]``).
    Nothing of the request was written; retry once the operator has made room or remounted
    the volume read-write."""

    code = "insufficient_storage"
    status = 507


class JobFailed(PsgradError):
    code = "job_failed"
    status = 500


class InternalError(PsgradError):
    code = "internal_error"
    status = 500


class StoreDamaged(InternalError):
    """A gradient store's files on the server do not agree (a file changed or lost outside
    psgrad, or an ensemble's checkpoints apart): the message names what, and what to do."""

    code = "store_damaged"


class VerificationFailed(InternalError):
    """A verified answer (``verify``) differed from the per-sample loop beyond the tolerance.

    The answer is withheld: it is wrong (a bug or a faulty device), never served as right.
    ``details`` say which output, sample and difference; retrying may land on another worker.
    """

    code = "verification_failed"


def error_from_body(
    body: Any, status: int, *, request_id: str | None = None
) -> PsgradError:
    """Rebuild the typed error from a JSON error body (or anything else a server answered)."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        plain = _class_for_status(status)(f"HTTP {status}: {str(body)[:500]}",
                                          request_id=request_id)
        plain.http_status = status
        return plain
    code = str(error.get("code", ""))
    cls = _BY_CODE.get(code) or _class_for_status(status)
    raw_details = error.get("details")
    details: dict[str, Any] = raw_details if isinstance(raw_details, dict) else {}
    exc = cls.__new__(cls)
    PsgradError.__init__(exc, str(error.get("message", "")), request_id=request_id, **details)
    exc.http_status = status
    if isinstance(exc, Overloaded):
        exc.retry_after = float(details.get("retry_after", 1.0))
    return exc


def _class_for_status(status: int) -> type[PsgradError]:
    for cls in (BadRequest, InvalidInput, UnsupportedMediaType, Unauthorized, Forbidden,
                NotFound, RequestTimeout, Conflict, TooLarge, RateLimited, Overloaded,
                DeadlineExceeded, InsufficientStorage):
        if cls.status == status:
            return cls
    return BadRequest if 400 <= status < 500 else InternalError
