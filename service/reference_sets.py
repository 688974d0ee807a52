"""``PUT /reference-sets/{id}``: the gradients request that makes a set.

A set is made by an ordinary job (so it is computed by whichever worker takes it, batched and
limited like any request): ``projection`` when the body names ``projection_dim``, else
``grads``. Its size is checked before the job runs (``PSGRAD_MAX_REFERENCE_SET_BYTES``: full
gradients of M samples are M copies of the selected parameters), and the answer is kept as a
small gradient store (:mod:`service.stores.sets`), which every process of a deployment reads.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from psgrad._contract import SAMPLE_FIELDS, answer_fields
from psgrad._errors import BadRequest, Conflict, InvalidInput, TooLarge
from psgrad._merge import merge_moments
from service.config import raise_setting
from service.model_store import is_safe_id
from service.registry import LoadedModel
from service.strategies.base import Options
from service.tenants import owned_key

# A body that brings a batch to a set or a store: the batch, and how its rows are made (which a
# store fixes when it is made)
BATCH_FIELDS = (*SAMPLE_FIELDS, "model", "verify", "verify_seed")
FIXED_FIELDS = ("loss", "params", "projection_dim", "projection_seed", "projection_kind")
SET_FIELDS = frozenset((*BATCH_FIELDS, *FIXED_FIELDS))


def checked_id(given: str, what: str = "reference set") -> str:
    """``given`` if it is a safe id; else a 400 naming ``what`` it was to be and what was sent."""
    if not is_safe_id(given):
        raise BadRequest(f"a {what} id is 1-64 of a-z 0-9 . _ -, not starting with . _ -; "
                         f"got {given[:80]!r}", id=given[:80])
    return given


def scope_reference(fields: dict[str, Any], tenant: str) -> None:
    """A request's ``reference_set`` names a set of its own tenant: the field becomes that
    set's store key (:func:`service.tenants.owned_key`), so no request reads another
    tenant's set."""
    name = fields.get("reference_set")
    if isinstance(name, str):  # anything else: the request validation says what is wrong
        fields["reference_set"] = owned_key(tenant, checked_id(name))


def set_request(set_id: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The job's fields: the body's batch and how its rows are made, asking for sketches or
    gradients (checked next by the request validation, before the size of the set); any other
    field of a gradients request (an output, ``weights``, ``clip_norm``, ...) is refused, as an
    append to a store refuses it, since the set would not say it was made so."""
    checked_id(set_id)
    extra = sorted(k for k, v in fields.items() if k not in SET_FIELDS and v is not None)
    if extra:
        raise InvalidInput(f"a reference set is made from a batch ({', '.join(BATCH_FIELDS)}) "
                           f"and how its rows are made ({', '.join(FIXED_FIELDS)}); leave out: "
                           f"{', '.join(extra)}", fields=extra)
    dim = fields.get("projection_dim")
    return {**fields, "outputs": ["projection"] if dim is not None else ["grads"]}


def check_size(model: LoadedModel, opts: Options, count: int, max_bytes: int) -> None:
    """Refuse a set above ``PSGRAD_MAX_REFERENCE_SET_BYTES`` before computing it."""
    per = (opts.projection.k if opts.projection is not None
           else sum(model.params[p].numel() for p in opts.params))
    size = count * per * model.dtype.itemsize
    if size > max_bytes:
        raise TooLarge(f"the reference set would hold {size} bytes; the limit is {max_bytes}: "
                       "send 'projection_dim' to keep sketches, or fewer samples or "
                       f"parameters, or {raise_setting('max_reference_set_bytes', max_bytes)}",
                       limit=max_bytes, size=size)


def split(fields: dict[str, Any], limit: int) -> list[dict[str, Any]]:
    """The job fields of ``limit`` samples at most each: a set may hold more samples than one
    request (``PSGRAD_MAX_BATCH_SIZE``); the body size limit still bounds it."""
    inputs = fields.get("inputs")
    if not isinstance(inputs, np.ndarray) or not inputs.ndim or not inputs.shape[0]:
        return [fields]  # the worker's validation says what is wrong with it
    n = int(inputs.shape[0])
    per_sample = [k for k in SAMPLE_FIELDS if isinstance(fields.get(k), np.ndarray)
                  and fields[k].ndim and fields[k].shape[0] == n]
    return [{**fields, **{k: fields[k][a : a + limit] for k in per_sample}}
            for a in range(0, n, max(1, limit))]


def joined(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The answers of :func:`split`'s jobs as one (same model version: checked): rows
    concatenated, K-FAC's factors and the gradients' mean and variance merged as moments."""
    first = parts[0]
    if len({str(p["model"]) for p in parts}) != 1:
        raise Conflict("the model changed version while the set was computed; send it again")
    out = {**first, "batch_size": sum(int(p["batch_size"]) for p in parts)}
    counts = [int(p["batch_size"]) for p in parts]
    def each(name: str) -> list[Mapping[str, np.ndarray]]:
        return [{k: np.asarray(v) for k, v in p[name].items()} for p in parts]

    for name in answer_fields(["kfac_inputs"]) if "kfac_inputs" in first else ():
        out[name] = merge_moments(counts, each(name))[0]  # means: n-weighted
    if "variance" in first:  # with its mean: Chan's formula
        out["mean"], out["variance"] = merge_moments(counts, each("mean"), each("variance"))
    if "projection" in first:
        out["projection"] = np.concatenate([np.asarray(p["projection"]) for p in parts])
    elif "grads" in first:
        out["grads"] = {k: np.concatenate([np.asarray(p["grads"][k]) for p in parts])
                        for k in first["grads"]}
    return out
