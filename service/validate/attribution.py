"""The data-attribution part of a request: its projection and the references it is scored against.

``projection`` (and ``self_influence`` when projected) needs ``projection_dim`` (k, up to 8192)
and takes ``projection_seed`` (0 by default) and ``projection_kind`` (``tensorsketch`` by
default, or ``kronecker``: :mod:`service.strategies.projection`). ``dots`` needs M references:
``reference`` ``{param: [M, *shape]}`` for every selected parameter (exact dot products), or
``reference_sketches`` ``[M, k]`` made with the same projection. ``influence`` reads them from a
stored reference set (``reference_set``: a small gradient store, :mod:`service.stores.sets`),
whose projection, parameters and model structure the request must share. Every refusal says what
to change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
import torch

from psgrad._contract import field
from psgrad._errors import InvalidInput, NotFound, ShapeMismatch
from service.registry import LoadedModel
from service.strategies.base import Batch, Options
from service.strategies.projection import KINDS, MAX_DIM, Projection
from service.tenants import owned_name


@dataclass(frozen=True)
class ReferenceSet:
    """What ``influence`` scores against: a set's tensors (``sketches`` [M, k], or one
    ``[M, *shape]`` per parameter) and how they were made."""

    id: str
    model: str  # the model version that computed it, id@version
    params: tuple[str, ...]
    shapes: dict[str, list[int]]  # of the parameters (empty: not recorded, not checked)
    projection: Projection | None  # None: full gradients
    tensors: dict[str, np.ndarray]


DIM, SEED = field("projection_dim"), field("projection_seed")


class ReferenceSets(Protocol):
    """Where ``influence`` finds its reference set (:class:`service.stores.sets.StoredSets`)."""

    def get(self, key: str) -> ReferenceSet | None: ...


def projection_of(fields: dict[str, Any], outputs: Sequence[str]) -> Projection | None:
    """The request's projection, or None when it names no ``projection_dim``."""
    dim, seed = fields.get("projection_dim"), fields.get("projection_seed")
    kind = fields.get("projection_kind")
    if dim is None:
        for name, value in (("projection_seed", seed), ("projection_kind", kind)):
            if value is not None:
                raise InvalidInput(f"'{name}' needs 'projection_dim' (k, up to {MAX_DIM})")
        if "projection" in outputs:
            raise InvalidInput(f"output 'projection' needs 'projection_dim' (k, 1 to {MAX_DIM})")
        return None
    k = DIM.integer(dim)
    seed = SEED.integer(seed)
    return Projection(int(k or 0), seed or 0, kind or KINDS[0])


def references(model: LoadedModel, opts: Options, batch: Batch,
               reference: dict[str, torch.Tensor], sketches: torch.Tensor | None,
               set_id: Any, sets: ReferenceSets | None) -> Options:
    """Fill ``batch`` with the references of ``dots`` or ``influence``; the options with M."""
    asked = {"dots", "influence", "dot"} & set(opts.outputs)
    if len(asked) > 1:
        raise InvalidInput(f"ask one of {', '.join(sorted(asked))} per request: each reads its "
                           "own references ('dot' is the single-reference case of 'dots')")
    if "influence" in asked:
        if reference or sketches is not None:
            raise InvalidInput("output 'influence' reads its references from 'reference_set'; "
                               "send 'reference' or 'reference_sketches' with 'dots' instead")
        found = reference_set(set_id, sets)
        opts = _match_set(model, opts, found)
        tensors = {k: torch.as_tensor(v) for k, v in found.tensors.items()}
        if found.projection is not None:
            sketches = tensors["sketches"]
        else:
            reference = tensors
    elif set_id is not None:
        raise InvalidInput("'reference_set' is read by output 'influence' only")
    if sketches is not None:
        if opts.projection is None:
            raise InvalidInput("'reference_sketches' needs the 'projection_dim' and "
                               "'projection_seed' they were made with")
        if sketches.dim() != 2 or sketches.shape[1] != opts.projection.k:
            raise ShapeMismatch(f"'reference_sketches' has shape {list(sketches.shape)}; "
                                f"expected [M, {opts.projection.k}] (M sketches of k entries)")
        batch.sketches = sketches.to(model.dtype)
        return replace(opts, reference_count=int(sketches.shape[0]), reference_sketches=True)
    return replace(opts, reference_count=_gradients(model, opts, batch, reference))


def _gradients(model: LoadedModel, opts: Options, batch: Batch,
               reference: dict[str, torch.Tensor]) -> int:
    """Check ``{param: [M, *shape]}`` references (one ``[*shape]`` is M = 1); answer M."""
    missing = [p for p in opts.params if p not in reference]
    if missing:
        raise InvalidInput("output 'dots' needs 'reference' {param: [M, *shape]} for every "
                           f"selected parameter, or 'reference_sketches' [M, k]; missing: "
                           f"{', '.join(missing)}", missing=missing)
    counts = set()
    for name in opts.params:
        ref, shape = reference[name], tuple(model.params[name].shape)
        if tuple(ref.shape) == shape:
            ref = ref.unsqueeze(0)
        if tuple(ref.shape[1:]) != shape:
            raise ShapeMismatch(f"'reference.{name}' has shape {list(ref.shape)}; expected "
                                f"[M, {', '.join(map(str, shape))}]", parameter=name)
        counts.add(int(ref.shape[0]))
        batch.references[name] = ref.to(model.dtype)
    if len(counts) != 1:
        raise ShapeMismatch(f"the parameters of 'reference' hold different numbers of "
                            f"references: {sorted(counts)}; send the same M for each")
    return counts.pop()


def reference_set(set_id: Any, sets: ReferenceSets | None) -> ReferenceSet:
    """The set that ``set_id`` (its tenant's key) names; else the 404 that says how to make
    it (another tenant's set and one that does not exist alike)."""
    if not isinstance(set_id, str) or not set_id:
        raise InvalidInput("output 'influence' needs 'reference_set': the id of a set made "
                           "with PUT /reference-sets/{id}")
    found = sets.get(set_id) if sets is not None else None
    if found is None:
        name = owned_name(set_id)  # the api sends the set's key in its tenant's namespace
        raise NotFound(f"reference set '{name}' not found: create it with "
                       f"PUT /reference-sets/{name}")
    return found


def _match_set(model: LoadedModel, opts: Options, found: ReferenceSet) -> Options:
    """The request's options under the set's projection, once its parameters are the set's."""
    if tuple(found.params) != opts.params:
        raise InvalidInput(f"reference set '{found.id}' holds parameters "
                           f"{', '.join(found.params)}; select the same ('params')")
    for name in opts.params:
        shape = found.shapes.get(name)
        if shape is not None and list(model.params[name].shape) != list(shape):
            raise ShapeMismatch(f"reference set '{found.id}' was made on a model whose "
                                f"'{name}' has shape {shape}; this one has "
                                f"{list(model.params[name].shape)}", parameter=name)
    want = found.projection
    if opts.projection is not None and opts.projection != want:
        made = ("full gradients" if want is None else f"projection_dim {want.k}, "
                f"projection_seed {want.seed}, projection_kind '{want.kind}'")
        raise InvalidInput(f"reference set '{found.id}' was made with {made}; sketches of "
                           "another projection (or kind) do not compare with its own: leave "
                           "'projection_dim', 'projection_seed' and 'projection_kind' out, or "
                           "send the set's")
    return replace(opts, projection=want)
