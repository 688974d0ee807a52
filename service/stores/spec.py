"""What a gradient store is: the record ``PUT /stores/{id}`` writes, and the checks of its ids.

A store keeps the sketches of one model version under one loss and projection, so that every
sample's row is comparable with every other's and with a test sample's sketch made the same way.
Its record pins all of it: the model as ``id@version`` (a store made on ``mlp`` keeps using the
version it was made with, even after new weights are registered), the loss, the selected
parameters, ``projection_dim``, ``projection_seed``, ``projection_kind`` and the storage ``dtype``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal, get_args

import numpy as np

from psgrad._contract import MAX_PROJECTION_DIM, shown, whole
from psgrad._errors import BadRequest, Conflict, InvalidInput
from service.strategies.projection import VERSIONS
from service.tenants import DEFAULT_TENANT

Dtype = Literal["float32", "float16"]  # how a store keeps its rows
DTYPES: tuple[str, ...] = get_args(Dtype)
# the projection_kind of a store of full gradients (made without projection_dim): each row is
# a sample's gradients, flattened in ``params`` order
EXACT = "exact"
# the widest row PUT /stores keeps of full gradients: the widest sketch's (trak then factors at
# most the same [k, k] as a sketched store's; a reference set of full gradients may be wider)
MAX_EXACT_WIDTH = MAX_PROJECTION_DIM
MEMBER = "checkpoint-"  # an ensemble's checkpoint i keeps its rows in the store's folder <this>i
MAX_CHECKPOINTS = 64
MAX_ID_CHARS = 128  # a string id: short, one line
MIN_ID, MAX_ID = -(2**63), 2**63 - 1  # an integer id: a signed 64-bit integer
ID_KINDS = ("int", "str")


@dataclass(frozen=True)
class StoreSpec:
    """One store's definition, fixed when it is made."""

    id: str
    model: str  # id@version: pinned
    loss: str
    params: tuple[str, ...]
    projection_dim: int
    projection_seed: int
    projection_kind: str
    dtype: str  # float32 or float16: how rows are kept on disk
    tenant: str = DEFAULT_TENANT
    created: float = field(default_factory=time.time)
    shapes: dict[str, list[int]] = field(default_factory=dict)  # of ``params`` (recorded since
    # reference sets became stores; empty in a store made before)
    # the definition of the kind's numbers (``VERSIONS``); 1 in records made before versions
    projection_version: int = 1
    index: str | None = None  # a FAISS factory string: the store keeps an approximate index
    # an ensemble's model versions (``id@version``, ``model`` the first): each checkpoint's
    # rows are a store of their own inside this one (:meth:`members`); () for one model
    checkpoints: tuple[str, ...] = ()

    @property
    def exact(self) -> bool:
        """Rows of full gradients (``projection_dim`` is then their length), not sketches."""
        return self.projection_kind == EXACT

    def same_as(self, other: StoreSpec) -> bool:
        """Both describe one store (all but the creation time, and the shapes, which the pinned
        model version fixes): a repeated PUT is a no-op."""
        same = {"created": 0, "shapes": {}}
        return asdict(self) | same == asdict(other) | same

    def to_json(self) -> bytes:
        return json.dumps({**asdict(self), "params": list(self.params)}, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StoreSpec:
        d = json.loads(raw)
        return cls(**{**d, "params": tuple(d["params"]),
                      "checkpoints": tuple(d.get("checkpoints", ()))})

    def members(self, key: str) -> list[tuple[str, StoreSpec]]:
        """(store key, definition) of each checkpoint's rows: the store itself for one model;
        for an ensemble, a store per model version under its folder, in ``checkpoints``
        order, each this definition with that version."""
        if not self.checkpoints:
            return [(key, self)]
        return [(f"{key}/{MEMBER}{i}", replace(self, model=ref, checkpoints=(), index=None))
                for i, ref in enumerate(self.checkpoints)]

    @property
    def itemsize(self) -> int:
        return int(np.dtype(self.dtype).itemsize)

    def check_version(self) -> None:
        """Refuses a store whose sketches this server no longer makes: the kind's numbers
        changed since (``VERSIONS``), and rows of two definitions do not compare."""
        now = VERSIONS.get(self.projection_kind, 1)  # exact rows: always 1
        if self.projection_version != now:
            raise Conflict(
                f"store '{self.id}' keeps {self.projection_kind} sketches of version "
                f"{self.projection_version}; this server makes version {now}, whose numbers "
                "differ, so new rows and queries would not compare with the store's: make a new "
                f"store (DELETE /stores/{self.id}, then PUT it again and add the samples)",
                projection_version=self.projection_version, current_version=now)

    def doc(self) -> dict[str, Any]:
        """The definition as ``GET /stores/{id}`` shows it."""
        return {**asdict(self), "params": list(self.params),
                "checkpoints": list(self.checkpoints) or None}


def check_dtype(value: Any) -> str:
    if value is None:
        return DTYPES[0]
    if value not in DTYPES:
        raise InvalidInput(f"'dtype' must be one of {', '.join(DTYPES)} (how the store keeps its "
                           f"rows; float16 halves the bytes); got {value!r}", accepted=list(DTYPES))
    return str(value)


def id_kind(value: Any) -> str | None:
    """``int`` or ``str`` for a valid sample id, else None."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return "int" if MIN_ID <= int(value) <= MAX_ID else None
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and value.isprintable():
        return "str"
    return None


def sample_ids(raw: list[Any]) -> tuple[list[int | str], list[str]]:
    """The sample ids of ``raw`` and each one's :func:`id_kind`; the first entry that is no
    sample id refused by the request contract's rule: 400 for one of another type (``true``,
    ``null``, ``1.5``, a list), 422 for an integer past 64 bits or written as ``2.0`` (an
    integer to JSON Schema) or a string empty, too long or not printable."""
    kinds = [id_kind(v) for v in raw]
    bad = [i for i, k in enumerate(kinds) if k is None]
    if not bad:
        return [int(v) if k == "int" else str(v) for v, k in zip(raw, kinds, strict=True)], [
            str(k) for k in kinds]
    typed = [i for i in bad if isinstance(raw[i], bool) or not isinstance(
        whole(raw[i]), (int, np.integer, str))]
    first = (typed or bad)[0]
    raise (BadRequest if typed else InvalidInput)(
        f"'ids' entry {first} ({shown(raw[first])}) is not a sample id: send 64-bit integers "
        f"or strings of 1 to {MAX_ID_CHARS} printable characters", positions=(typed or bad)[:20])


def checked_ids(raw: Any, count: int) -> tuple[list[int | str], str]:
    """The batch's sample ids (one per sample, unique, all integers or all short strings) and
    their kind; a JSON list or, in a safetensors body, an integer tensor."""
    if isinstance(raw, np.ndarray):
        if raw.ndim != 1 or raw.dtype.kind not in "iu":
            raise InvalidInput(f"'ids' as a tensor must be one integer per sample; got dtype "
                               f"{raw.dtype} and shape {list(raw.shape)}")
        raw = [int(v) for v in raw]
    if not isinstance(raw, list):
        what = "is required" if raw is None else f"must be a list (got {shown(raw)})"
        raise BadRequest(f"'ids' {what}: one id per sample (integers, or strings of 1 to "
                         f"{MAX_ID_CHARS} printable characters), the names queries answer with")
    if len(raw) != count:
        raise InvalidInput(f"'ids' has {len(raw)} entries; the batch has {count} samples: send "
                           "one id per sample", ids=len(raw), samples=count)
    ids, kinds = sample_ids(raw)
    if len(set(kinds)) > 1:
        raise InvalidInput("'ids' mixes integers and strings: use one kind per store")
    seen: set[int | str] = set()
    twice = [v for v in ids if v in seen or seen.add(v)]  # type: ignore[func-returns-value]
    if twice:
        raise InvalidInput(f"'ids' repeats {len(twice)} ids within the batch (first: "
                           f"{twice[0]!r}): each sample needs its own id",
                           duplicates=sorted(set(twice), key=str)[:20])
    return ids, kinds[0] or "int" if kinds else "int"
