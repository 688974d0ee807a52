"""Typed records the client returns: a gradients result, a model description, a job status."""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from psgrad._contract import ANSWER_NAMES
from psgrad._contract import OUTPUT_NAMES as CONTRACT_OUTPUTS

__all__ = ["OUTPUT_NAMES", "GradsResult", "JobStatus", "ModelInfo"]

# numpy arrays by default, torch tensors with ``as_torch=True``.
Array = Any
ParamArrays = dict[str, Array]

OUTPUT_NAMES = CONTRACT_OUTPUTS  # the request contract's outputs (psgrad._contract)


@dataclass
class GradsResult:
    """What ``per_sample_grads`` and ``td0`` return.

    Each requested output is an attribute (``result.norms``, ``result.grads["fc1.weight"]``) and
    an item (``result["norms"]``); asking for one that was not requested raises
    ``AttributeError`` / ``KeyError`` naming the outputs that were.

    Attributes:
        model: the ``id@version`` that computed it (pin it to reproduce the result).
        batch_size: the number of samples B.
        loss: the loss used.
        outputs: output name -> array ([B] or [B, ...]) or {parameter name: array}.
        timing: ``queue_ms`` and ``compute_ms`` summed over the requests that made the result,
            plus ``total_ms`` as seen by the client.
        meta: the server's notes (``route``: ``vmap``, ``loop`` or ``fast_stats``, how it
            was computed; ``chunk_size``, ``seed`` of the noise, ...);
            ``requests`` is how many HTTP requests the client split the batch into; ``verify``
            (with ``verify=k``, or when the server's operator verifies a fraction of the
            jobs) the samples recomputed with the per-sample loop and the largest difference.
    """

    model: str
    batch_size: int
    loss: str | None
    outputs: dict[str, Any]
    timing: dict[str, float] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        try:
            return self.outputs[name]
        except KeyError:
            raise KeyError(self._missing(name)) from None

    def __contains__(self, name: object) -> bool:
        return name in self.outputs

    def __iter__(self) -> Iterator[str]:
        return iter(self.outputs)

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: the dataclass fields always win.
        if name.startswith("_") or name not in ANSWER_NAMES:
            raise AttributeError(f"'GradsResult' has no attribute {name!r}")
        outputs = self.__dict__.get("outputs", {})
        if name not in outputs:
            raise AttributeError(self._missing(name))
        return outputs[name]

    def _missing(self, name: str) -> str:
        got = ", ".join(self.__dict__.get("outputs", {})) or "none"
        return f"output {name!r} was not requested (this result has: {got}); add it to outputs="

    def __repr__(self) -> str:
        return (
            f"GradsResult(model={self.model!r}, batch_size={self.batch_size}, "
            f"loss={self.loss!r}, outputs=[{', '.join(self.outputs)}])"
        )


class JobStatus(str, enum.Enum):
    """The state of a job submitted with ``submit``."""

    QUEUED = "queued"
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELED = "canceled"

    done: bool  # succeeded, failed or canceled: nothing more will happen to the job

    def __init__(self, value: object) -> None:  # each member, as the class is made
        self.done = value in ("succeeded", "failed", "canceled")

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ModelInfo:
    """``GET /models/{id}``: what a model takes and which parameters it has."""

    id: str
    version: str
    architecture: str
    config: dict[str, Any]
    default_loss: str
    losses: list[str]
    input: dict[str, Any]
    parameters: dict[str, dict[str, Any]]
    # the warm-up its registration asked for: {status, done, total, shapes} (None: none asked)
    warmup: dict[str, Any] | None = None
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)

    @property
    def ref(self) -> str:
        """``id@version``: pins exactly these weights."""
        return f"{self.id}@{self.version}"

    @classmethod
    def from_dict(cls, doc: Mapping[str, Any]) -> ModelInfo:
        return cls(
            id=str(doc.get("id", "")),
            version=str(doc.get("version", "")),
            architecture=str(doc.get("architecture", "")),
            config=dict(doc.get("config") or {}),
            default_loss=str(doc.get("default_loss", "")),
            losses=list(doc.get("losses") or []),
            input=dict(doc.get("input") or {}),
            parameters=dict(doc.get("parameters") or {}),
            warmup=doc.get("warmup"),
            raw=dict(doc),
        )
