"""A store's curvature: the K-FAC factors fitted over the batches sent to ``POST
/stores/{id}/factors``, and the ``kfac`` and ``ekfac`` scores' preconditioning of a query
(:mod:`service.curvature` holds the math)::

    stores/<key>/factors.safetensors   ``inputs/<w>``, ``grads/<w>`` per linear layer (by
                                       weight name): sum_t a a^T and sum_t g g^T summed over
                                       the fitting samples (float64); ``tokens/<w>``; ``rows``
                                       [n, P]: the fitting samples' gradients, flattened as the
                                       store's rows (float32); metadata ``samples`` and
                                       ``writes`` (batches added), read from the header alone

A batch's factors are the workers' ``kfac_inputs`` output and its ``grads``. Each batch is added
under the store's lock (an ensemble's: every checkpoint's) and the file written whole (beside
it, then renamed over it), so a reader sees every batch or none of one. EK-FAC's eigenvalues
are second moments in the bases of every batch's factors together, so they are computed from
the kept rows when a query first needs them, once per written state (eigendecompositions and
that pass), and kept until the next write. The file holds 4 bytes per parameter per fitting
sample: fit over thousands of samples, not millions (``PSGRAD_MAX_FACTORS_BYTES`` bounds it).

A query's gradient is preconditioned in full parameter space, per layer. A store of full
gradients scores it against its rows exactly; a store of sketches projects it with the
store's own projection first and scores that against its sketches, an unbiased estimate of
the exact score (``E[<R x, R g>] = <x, g>``; docs/attribution.md gives its LDS beside
``trak``'s). Either way the factors are fitted from full gradients.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from psgrad._errors import Conflict, InvalidInput, TooLarge
from service import curvature
from service.config import raise_setting
from service.curvature import Covariances, Curvature, Kind, Linear
from service.stores.files import StoreFiles
from service.stores.spec import StoreSpec
from service.strategies.projection import Projection

FILE = "factors.safetensors"


@dataclass(frozen=True)
class Fitted:
    """What a store's factors file says of itself (its safetensors header): the samples
    fitted, how many batches wrote it, the layers covered."""

    samples: int
    writes: int
    layers: list[str]


def fitted(files: StoreFiles, key: str) -> Fitted | None:
    """The store's factors as written now, from the file's header alone (a ``GET`` and every
    query read it; the tensors only when the curvature is made), or None before a fit."""
    head = files.read_file(key, FILE, 0, 8)
    if head is None or len(head) < 8:
        return None
    return _described(files.read_file(key, FILE, 8, 8 + int.from_bytes(head, "little")) or b"")


def _described(header: bytes) -> Fitted:
    """:class:`Fitted` of a factors file's safetensors header."""
    entries = json.loads(header)
    meta = entries.get("__metadata__", {})
    return Fitted(int(meta["samples"]), int(meta["writes"]),
                  sorted(k.removeprefix("inputs/") for k in entries if k.startswith("inputs/")))


def _tensors(files: StoreFiles, key: str, store_id: str) -> tuple[Fitted, dict[str, np.ndarray]]:
    """The whole file: what it says of itself and its tensors (409 before a fit)."""
    raw = files.read_file(key, FILE)
    if raw is None:
        raise _unfitted(store_id)
    return _described(raw[8:8 + int.from_bytes(raw[:8], "little")]), st_load(raw)


def _unfitted(store_id: str) -> Conflict:
    return Conflict(f"store '{store_id}' has no factors: fit them with POST "
                    f"/stores/{store_id}/factors (a batch, as for /samples) first")


def check_fits(spec: StoreSpec, store_id: str) -> None:
    """The store knows its parameters' shapes, which its factors need."""
    if not spec.shapes:
        raise Conflict(f"store '{store_id}' was made before stores recorded their parameters' "
                       "shapes, which its factors need: make it again (PUT /stores/{id} after "
                       "DELETE) and add its samples")


def add(files: StoreFiles, parts: list[tuple[str, StoreSpec, dict[str, Any], np.ndarray]],
        max_bytes: int) -> Fitted:
    """Add one batch's factors to each store of ``parts`` (an ensemble's checkpoints: key,
    definition, the workers' answer with ``kfac_inputs``, ``kfac_grads`` and ``kfac_tokens``
    as means over its samples, and its gradient ``rows``), all of them or none: every store's
    lock held, every new file made and checked (at most ``max_bytes``, else 413) before the
    first is written. Answers the first's :class:`Fitted`."""
    with contextlib.ExitStack() as held:
        for key, _, _, _ in parts:
            held.enter_context(files.locks.hold(key))
        made = [_merged(files, key, spec, answer, rows) for key, spec, answer, rows in parts]
        for (_, spec, _, rows), (raw, done) in zip(parts, made, strict=True):
            _within(spec, len(raw), done.samples, rows.shape[1], max_bytes)
        for (key, _, _, _), (raw, _) in zip(parts, made, strict=True):
            files.write_file(key, FILE, raw)
    return made[0][1]


def check_room(files: StoreFiles, key: str, spec: StoreSpec, samples: int, width: int,
               max_bytes: int) -> None:
    """Refuse (413) before any worker runs a batch whose gradients alone, ``samples`` more rows
    of ``width`` values, would take the store's factors file past ``max_bytes``; :func:`add`
    checks the whole file again once the factors are made."""
    old = fitted(files, key)
    total = samples + (0 if old is None else old.samples)
    _within(spec, total * width * 4, total, width, max_bytes, "at least ")


def _within(spec: StoreSpec, size: int, samples: int, width: int, max_bytes: int,
            bound: str = "") -> None:
    if size > max_bytes:
        raise TooLarge(
            f"store '{spec.id}''s factors would hold {bound}{size} bytes ({samples} fitting "
            f"samples' gradients of {width} values, 4 bytes each, and the factors); the limit is "
            f"{max_bytes}: fit over fewer samples (thousands are enough) or parameters, or "
            f"{raise_setting('max_factors_bytes', max_bytes)}", limit=max_bytes, size=size)


def _merged(files: StoreFiles, key: str, spec: StoreSpec, answer: dict[str, Any],
            rows: np.ndarray) -> tuple[bytes, Fitted]:
    """The store's factors file with one batch added (its bytes), and what it says."""
    n = len(rows)
    sums = {f"{part}/{w}": np.atleast_1d(np.asarray(v, np.float64)) * n
            for part, field in (("inputs", "kfac_inputs"), ("grads", "kfac_grads"),
                                ("tokens", "kfac_tokens"))
            for w, v in answer[field].items()}
    old = fitted(files, key)
    tensors: dict[str, np.ndarray]
    if old is None:
        tensors, samples, writes = {**sums, "rows": rows.astype(np.float32)}, n, 1
    else:
        _, kept = _tensors(files, key, spec.id)
        if sorted(kept.keys() - {"rows"}) != sorted(sums):
            raise Conflict(f"store '{spec.id}''s factors cover the layers "
                           f"{', '.join(old.layers)}; this batch's cover others: fit with "
                           "batches of the same inputs' shapes")
        tensors = {k: kept[k] + v for k, v in sums.items()}
        tensors["rows"] = np.concatenate([kept["rows"], rows.astype(np.float32)])
        samples, writes = old.samples + n, old.writes + 1
    raw = st_save(tensors, metadata={"samples": str(samples), "writes": str(writes)})
    return raw, Fitted(samples, writes, sorted(w.removeprefix("inputs/") for w in sums
                                               if w.startswith("inputs/")))


def curvature_of(files: StoreFiles, key: str, spec: StoreSpec, store_id: str) -> Curvature:
    """The store's :class:`~service.curvature.Curvature` as fitted now (409 before a fit)."""
    found = fitted(files, key)
    if found is None:
        raise _unfitted(store_id)
    epoch = files.manifest(key).epoch
    made: Curvature = files.kept_at("curvature", key, (epoch, found.writes),
                                    lambda: _curvature(spec, *_tensors(files, key, store_id)))
    return made


def _curvature(spec: StoreSpec, found: Fitted, t: dict[str, np.ndarray]) -> Curvature:
    """Kept under the writes count its header read; a write in between only makes the kept
    curvature newer than its key, and the next query reads the next count."""
    layers = {w: _layer(spec, w, t[f"inputs/{w}"].shape[0], t[f"grads/{w}"].shape[0])
              for w in found.layers}
    sums = Covariances({w: torch.from_numpy(t[f"inputs/{w}"]) for w in layers},
                       {w: torch.from_numpy(t[f"grads/{w}"]) for w in layers},
                       {w: round(float(t[f"tokens/{w}"].sum())) for w in layers}, found.samples)
    bases = curvature.bases(sums)
    grads = as_grads(spec, t["rows"])
    return curvature.curvature(layers, bases, curvature.corrections_of(layers, bases, grads))


def _layer(spec: StoreSpec, weight: str, columns: int, rows: int) -> Linear:
    """The layer of a weight's factors, by their widths: its bias (``...bias``) a column of
    ones where the inputs' side is one wider than the weight's columns, a row where the
    output gradients' side is one longer than its rows (a transposed weight), else none."""
    shape, bias = spec.shapes[weight], curvature.bias_of(weight)
    if columns == math.prod(shape[1:]) + 1:
        return Linear(weight, bias)
    if rows == shape[0] + 1:
        return Linear(weight, bias, transposed=True)
    return Linear(weight, None)


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
    default damping where ``damping`` is None), as rows of the store: flattened, or sketched
    with its projection where it keeps sketches; and the damping used."""
    used = curv.default_damping(kind) if damping is None else damping
    if not used > 0:
        raise InvalidInput("'damping' must be > 0 (leave it out for the default, a tenth of "
                           "the Fisher's mean eigenvalue)")
    pre = curv.precondition(as_grads(spec, rows), used, kind)
    if not spec.exact:
        out = torch.zeros(len(rows), spec.projection_dim, dtype=torch.float64)
        Projection(spec.projection_dim, spec.projection_seed, spec.projection_kind
                   ).project_many({p: pre[p] for p in spec.params}, out)
        return out.numpy(), used
    return np.concatenate([pre[p].reshape(len(rows), -1).numpy() for p in spec.params],
                          axis=1), used
