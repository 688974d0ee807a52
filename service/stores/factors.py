"""A store's curvature: the K-FAC factors fitted over the batches sent to ``POST
/stores/{id}/factors``, and the ``kfac`` and ``ekfac`` scores' preconditioning of a query
(:mod:`service.curvature` holds the math)::

    stores/<key>/factors.safetensors   ``inputs/<w>``, ``grads/<w>`` per linear layer (by
                                       weight name): sum_t a a^T and sum_t g g^T summed over
                                       the fitting samples (float64); ``tokens/<w>``; ``rows``
                                       [n, P]: the fitting samples' gradients, flattened as the
                                       store's rows (float32); ``count`` [samples, writes]

A batch's factors are the workers' ``kfac_inputs`` output and its ``grads``. Each batch is added
under the store's lock and the file written whole (beside it, then renamed over it), so a
reader sees every batch or none of one. EK-FAC's eigenvalues are second moments in the bases
of every batch's factors together, so they are computed from the kept rows when a query first
needs them, once per written state (eigendecompositions and that pass), and kept until the
next write. Only a store of full gradients fits factors: a query's gradient is preconditioned
in full and scored against full rows, so its scores are exact (docs/attribution.md says why
sketched rows are not scored this way).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from psgrad._errors import Conflict, InvalidInput
from service import curvature
from service.curvature import Covariances, Curvature, Kind, Linear
from service.stores.files import StoreFiles
from service.stores.spec import StoreSpec

FILE = "factors.safetensors"


@dataclass(frozen=True)
class Fitted:
    """What a store's factors file holds."""

    tensors: dict[str, np.ndarray]
    samples: int
    writes: int

    @property
    def layers(self) -> list[str]:
        return sorted(k.removeprefix("inputs/") for k in self.tensors if k.startswith("inputs/"))


def fitted(files: StoreFiles, key: str) -> Fitted | None:
    """The store's factors as written now, or None before the first fit."""
    raw = files.read_file(key, FILE)
    if raw is None:
        return None
    tensors = st_load(raw)
    samples, writes = (int(v) for v in tensors.pop("count"))
    return Fitted(tensors, samples, writes)


def check_fits(spec: StoreSpec, store_id: str) -> None:
    """Factors are fitted, and ``kfac``/``ekfac`` scored, on stores of full gradients."""
    if not spec.exact:
        raise InvalidInput(
            f"store '{store_id}' keeps sketches (projection_dim {spec.projection_dim}); K-FAC "
            "and EK-FAC scores precondition full gradients: make a store without "
            "'projection_dim' (models of at most 8192 selected values) to fit factors and "
            "query 'kfac' or 'ekfac' (sketched stores: docs/attribution.md)")
    if not spec.shapes:
        raise Conflict(f"store '{store_id}' was made before stores recorded their parameters' "
                       "shapes, which its factors need: make it again (PUT /stores/{id} after "
                       "DELETE) and add its samples")


def add(files: StoreFiles, key: str, spec: StoreSpec, answer: dict[str, Any],
        rows: np.ndarray) -> Fitted:
    """Add one batch's factors (``answer``: its ``kfac_inputs``, ``kfac_grads`` and
    ``kfac_tokens``, means over its samples) and its gradient ``rows`` to the store's."""
    n = len(rows)
    sums = {f"{part}/{w}": np.atleast_1d(np.asarray(v, np.float64)) * n
            for part, field in (("inputs", "kfac_inputs"), ("grads", "kfac_grads"),
                                ("tokens", "kfac_tokens"))
            for w, v in answer[field].items()}
    with files.locks.hold(key):
        old = fitted(files, key)
        if old is None:
            new = Fitted({**sums, "rows": rows.astype(np.float32)}, n, 1)
        else:
            if sorted(old.tensors.keys() - {"rows"}) != sorted(sums):
                raise Conflict(f"store '{spec.id}''s factors cover the layers "
                               f"{', '.join(old.layers)}; this batch's cover others: fit with "
                               "batches of the same inputs' shapes")
            merged = {k: old.tensors[k] + v for k, v in sums.items()}
            merged["rows"] = np.concatenate([old.tensors["rows"], rows.astype(np.float32)])
            new = Fitted(merged, old.samples + n, old.writes + 1)
        files.write_file(key, FILE, st_save({
            **new.tensors, "count": np.array([new.samples, new.writes], np.int64)}))
    return new


def curvature_of(files: StoreFiles, key: str, spec: StoreSpec, store_id: str) -> Curvature:
    """The store's :class:`~service.curvature.Curvature` as fitted now (409 before a fit)."""
    found = fitted(files, key)
    if found is None:
        raise Conflict(f"store '{store_id}' has no factors: fit them with POST "
                       f"/stores/{store_id}/factors (a batch, as for /samples) first")
    epoch = files.manifest(key).epoch
    made: Curvature = files.kept_at("curvature", key, (epoch, found.writes),
                                    lambda: _curvature(spec, found))
    return made


def _curvature(spec: StoreSpec, found: Fitted) -> Curvature:
    t = found.tensors
    layers = {w: Linear(w, _bias(spec, w, t[f"inputs/{w}"].shape[0])) for w in found.layers}
    sums = Covariances({w: torch.from_numpy(t[f"inputs/{w}"]) for w in layers},
                       {w: torch.from_numpy(t[f"grads/{w}"]) for w in layers},
                       {w: round(float(t[f"tokens/{w}"].sum())) for w in layers}, found.samples)
    bases = curvature.bases(sums)
    grads = as_grads(spec, t["rows"])
    return curvature.curvature(layers, bases, curvature.corrections_of(layers, bases, grads))


def _bias(spec: StoreSpec, weight: str, width: int) -> str | None:
    """The layer's bias name where its inputs have a column of ones for it."""
    return (weight.removesuffix("weight") + "bias"
            if width == math.prod(spec.shapes[weight][1:]) + 1 else None)


def as_grads(spec: StoreSpec, rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Rows of full gradients ``[n, P]`` as ``{param: [n, *shape]}`` (float64)."""
    out, at = {}, 0
    for p in spec.params:
        size = math.prod(spec.shapes[p])
        out[p] = torch.from_numpy(np.asarray(rows[:, at:at + size], np.float64)).reshape(
            len(rows), *spec.shapes[p])
        at += size
    return out


def preconditioned(spec: StoreSpec, curv: Curvature, rows: np.ndarray, kind: Kind,
                   damping: float | None) -> tuple[np.ndarray, float]:
    """Query rows of full gradients ``[n, P]`` times ``(F + damping I)^-1`` (the curvature's
    default damping where ``damping`` is None), as rows; and the damping used."""
    used = curv.default_damping(kind) if damping is None else damping
    if not used > 0:
        raise InvalidInput("'damping' must be > 0 (leave it out for the default, a tenth of "
                           "the Fisher's mean eigenvalue)")
    pre = curv.precondition(as_grads(spec, rows), used, kind)
    return np.concatenate([pre[p].reshape(len(rows), -1).numpy() for p in spec.params],
                          axis=1), used
