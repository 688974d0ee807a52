"""A store's curvature: the K-FAC factors fitted over the batches sent to ``POST
/stores/{id}/factors``, EK-FAC's eigenvalues over those sent to ``POST
/stores/{id}/factors/eigenvalues`` after them, and the ``kfac`` and ``ekfac`` scores'
preconditioning of a query (:mod:`service.curvature` holds the math)::

    stores/<key>/factors.safetensors   the first pass, ``POST .../factors``: ``inputs/<w>``,
                                       ``grads/<w>``, ``tokens/<w>`` per linear layer (by
                                       weight name): sum_t a a^T, sum_t g g^T and the tokens,
                                       summed over the fitting samples; ``diagonal/<p>`` per
                                       other parameter: sum_i g_i^2;
                                       the second, ``POST .../factors/eigenvalues``:
                                       ``eigen/<w>``: sum_i (Q_S^T G_i Q_A)^2 in the bases of
                                       the first pass's sums as they were (all float64);
                                       metadata ``samples``, ``eigenvalues`` (each pass's
                                       samples), ``writes`` (batches added), ``basis`` (the
                                       writes when the first pass last added one), and
                                       ``batches``, ``eigen_batches`` (JSON lists: the ids of
                                       each pass's last :data:`RECENT` batches)

A first-pass batch's factors are the workers' ``kfac_inputs`` output, with the gradients'
``mean`` and ``variance`` for the diagonal (``sum_i g_i^2 = n (variance + mean^2)``); a
second-pass batch's, its ``grads`` rotated into the bases of the first pass's sums. A
first-pass batch changes the bases, so it drops the eigenvalues fitted in the old ones: fit
them after the factors. Each batch is added under the store's lock (an ensemble's: every
checkpoint's), the file written whole (beside it, then renamed over it), so a reader sees
every batch or none of one. A batch sent with a ``batch_id`` that its pass has counted
(among its last :data:`RECENT`) is refused whole (409, ``details.counted``), so a client that
lost an answer sends the batch again safely. Its size does not grow with the samples
fitted: the factors (``(in + 1)^2 + out^2`` values per layer) and two values per parameter, at
most (``PSGRAD_MAX_FACTORS_BYTES`` bounds it). The bases (eigendecompositions) are made once per
first-pass state, the curvature once per write, and kept until the next.

A query's gradient is preconditioned in full parameter space, per layer. A store of full
gradients scores it against its rows exactly; a store of sketches projects it with the
store's own projection first and scores that against its sketches, an unbiased estimate of
the exact score (``E[<R x, R g>] = <x, g>``; docs/attribution.md gives its LDS beside
``trak``'s). Either way the factors are fitted from full gradients.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from psgrad._contract import shown
from psgrad._errors import BadRequest, Conflict, InvalidInput, NonFinite, TooLarge
from service import curvature
from service.config import raise_setting
from service.curvature import Basis, Covariances, Curvature, Kind, Linear
from service.registry import LoadedModel
from service.stores.files import StoreFiles
from service.stores.spec import MAX_ID_CHARS, StoreSpec, id_kind
from service.strategies.projection import Projection

FILE = "factors.safetensors"
FIRST = ("inputs", "grads", "tokens")  # the first pass's factors, per layer
# what the workers answer for it: the factors, and the gradients' mean and variance, whence
# the diagonal Fisher of every other parameter (no per-sample gradients)
FIRST_OUTPUTS = ("kfac_inputs", "mean", "variance")
ENTRY_BYTES = 256  # a tensor's entry in the file's header, at most (its name, shape, offsets)
CHUNK_BYTES = 256 << 20  # a query's gradients preconditioned at once, in float64
RECENT = 1024  # the batch ids a pass remembers: a lost batch is sent again soon after


@dataclass(frozen=True)
class Fitted:
    """What a store's factors file says of itself (its safetensors header): the samples of
    each pass, how many batches wrote it and at which write the first pass last did (the
    bases' version), the layers covered, and each pass's last :data:`RECENT` batch ids."""

    samples: int
    writes: int
    layers: list[str]
    eigenvalues: int = 0
    basis: int = 0
    batches: tuple[str, ...] = ()
    eigen_batches: tuple[str, ...] = ()


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
                  sorted(k.removeprefix("inputs/") for k in entries if k.startswith("inputs/")),
                  int(meta.get("eigenvalues", 0)), int(meta.get("basis", -1)),
                  tuple(json.loads(meta.get("batches", "[]"))),
                  tuple(json.loads(meta.get("eigen_batches", "[]"))))


def check_batch_id(files: StoreFiles, key: str, store_id: str, batch_id: Any, second: bool
                   ) -> str | None:
    """A batch's ``batch_id`` (None: not sent), refused before any worker runs where it is not
    an id (a string of 1 to ``MAX_ID_CHARS`` printable characters) or where the pass (the
    ``second``'s eigenvalues, else the factors) counted it."""
    if batch_id is None:
        return None
    if id_kind(batch_id) != "str":
        error = InvalidInput if isinstance(batch_id, str) else BadRequest
        raise error(f"'batch_id' must be a string of 1 to {MAX_ID_CHARS} printable characters "
                    f"(the client's name for this batch); got {shown(batch_id)}")
    found = fitted(files, key)
    if found is not None:
        _counted(store_id, batch_id, found.eigen_batches if second else found.batches,
                 "eigenvalues" if second else "factors")
    return str(batch_id)


def _counted(store_id: str, batch_id: str | None, held: tuple[str, ...], route: str
             ) -> tuple[str, ...]:
    """The pass's batch ids with ``batch_id`` added (the last :data:`RECENT`); 409 where the
    pass counted it already."""
    if batch_id is None:
        return held
    if batch_id in held:
        raise Conflict(f"store '{store_id}''s {route} counted batch {batch_id!r} already (its "
                       "answer was lost?): nothing was added again; send other samples under "
                       "a new 'batch_id'", batch_id=batch_id, counted=True)
    return (*held, batch_id)[-RECENT:]


def _tensors(files: StoreFiles, key: str, store_id: str) -> tuple[Fitted, dict[str, np.ndarray]]:
    """The whole file: what it says of itself and its tensors (409 before a fit, and for a
    file of an earlier psgrad, which kept every fitting sample's gradient instead)."""
    raw = files.read_file(key, FILE)
    if raw is None:
        raise _unfitted(store_id)
    found = _described(raw[8:8 + int.from_bytes(raw[:8], "little")])
    if found.basis < 0:
        raise Conflict(f"store '{store_id}''s factors were fitted by an earlier psgrad, whose "
                       "file this one does not read: make the store again (DELETE, then PUT "
                       "/stores/{id}), add its samples and fit its factors")
    return found, st_load(raw)


def require(files: StoreFiles, key: str, store_id: str) -> Fitted:
    """The store's factors as written now; 409 before a fit."""
    found = fitted(files, key)
    if found is None:
        raise _unfitted(store_id)
    return found


def check_scores(files: StoreFiles, key: str, store_id: str, kind: Kind) -> None:
    """Before any worker computes a query's gradients: the store has the passes ``kind``
    needs (409 naming the route of the one missing)."""
    found = require(files, key, store_id)
    if kind == "ekfac" and found.layers and not found.eigenvalues:
        raise _no_eigenvalues(store_id)


def _no_eigenvalues(store_id: str) -> Conflict:
    return Conflict(f"store '{store_id}''s factors have no EK-FAC eigenvalues (or none since "
                    "their last batch, which changed the bases): fit them with POST "
                    f"/stores/{store_id}/factors/eigenvalues (the same samples, as for "
                    "/factors), or ask for 'kfac'")


def _unfitted(store_id: str) -> Conflict:
    return Conflict(f"store '{store_id}' has no factors: fit them with POST "
                    f"/stores/{store_id}/factors (a batch, as for /samples) first")


def check_fits(spec: StoreSpec, store_id: str) -> None:
    """The store knows its parameters' shapes, which its factors need."""
    if not spec.shapes:
        raise Conflict(f"store '{store_id}' was made before stores recorded their parameters' "
                       "shapes, which its factors need: make it again (PUT /stores/{id} after "
                       "DELETE) and add its samples")


def add(files: StoreFiles, parts: list[tuple[str, StoreSpec, dict[str, Any]]],
        max_bytes: int, batch_id: str | None = None,
        epochs: Sequence[str | None] | None = None) -> Fitted:
    """Add one batch's factors to each store of ``parts`` (an ensemble's checkpoints: key,
    definition, and the workers' answer of :data:`FIRST_OUTPUTS`), all of them or none: the
    first pass (the eigenvalues fitted before are dropped); none for a ``batch_id`` it
    counted. Answers the first's :class:`Fitted`; ``epochs``: as :func:`_written`'s."""
    return _written(files, [(key, functools.partial(_merged, files, key, spec, answer,
                                                    batch_id))
                            for key, spec, answer in parts], max_bytes, epochs)


def add_eigenvalues(files: StoreFiles, parts: list[tuple[str, StoreSpec, np.ndarray]],
                    store_id: str, max_bytes: int, batch_id: str | None = None,
                    epochs: Sequence[str | None] | None = None) -> Fitted:
    """Add one batch's gradient ``rows`` to each store's EK-FAC eigenvalues (``parts``: key,
    definition, rows), in the bases of its factors as they are now: the second pass, all of
    them or none (409 for a store without factors, or a ``batch_id`` it counted). Answers the
    first's :class:`Fitted`; ``epochs``: as :func:`_written`'s."""
    return _written(files, [(key, functools.partial(_corrected, files, key, spec, rows,
                                                    store_id, batch_id))
                            for key, spec, rows in parts], max_bytes, epochs)


def _written(files: StoreFiles, parts: list[tuple[str, Callable[[], tuple[bytes, Fitted]]]],
             max_bytes: int, epochs: Sequence[str | None] | None = None) -> Fitted:
    """Each store's factors file as ``make()`` makes it, all written or none: every store's
    lock held, each the store of its ``epoch`` still (:meth:`StoreFiles.still`), every new
    file made and checked (at most ``max_bytes``, else 413) before the first is written.
    Answers the first's :class:`Fitted`."""
    with contextlib.ExitStack() as held:
        for (key, _), epoch in zip(parts, epochs or [None] * len(parts), strict=True):
            held.enter_context(files.locks.hold(key))
            files.still(key, epoch)
        made = [make() for _, make in parts]
        for raw, _ in made:
            _within(len(raw), max_bytes)
        for (key, _), (raw, _) in zip(parts, made, strict=True):
            files.write_file(key, FILE, raw)
    return made[0][1]


def check_room(model: LoadedModel, params: Sequence[str], max_bytes: int) -> None:
    """Refuse (413) before any worker runs a fit whose file would be past ``max_bytes``: the
    :func:`estimate`; :func:`add` checks the whole file again once it is made."""
    _within(estimate(model, params), max_bytes, "at most ")


def estimate(model: LoadedModel, params: Sequence[str]) -> int:
    """The bytes of a factors file of ``params``, at most: the factors of their linear layers
    and two values per parameter, 8 bytes each, and :data:`ENTRY_BYTES` of header per tensor
    (4 per parameter at most: a layer's three factors and its eigenvalues), and each pass's
    batch ids."""
    width = sum(model.params[p].numel() for p in params)
    return 8 * (curvature.factor_numel(model, params) + 2 * width) + ENTRY_BYTES * (
        1 + 4 * len(params)) + 2 * RECENT * (4 * MAX_ID_CHARS + 4)  # batch ids, JSON-escaped


def _within(size: int, max_bytes: int, bound: str = "") -> None:
    if size > max_bytes:
        raise TooLarge(
            f"the store's factors would hold {bound}{size} bytes (the Kronecker factors of its "
            f"linear layers, (in + 1)^2 + out^2 values each, and two values per parameter, 8 "
            f"bytes each); the limit is {max_bytes}: select fewer parameters (the store's "
            f"'params'), or {raise_setting('max_factors_bytes', max_bytes)}",
            limit=max_bytes, size=size)


def _merged(files: StoreFiles, key: str, spec: StoreSpec, answer: dict[str, Any],
            batch_id: str | None) -> tuple[bytes, Fitted]:
    """The store's factors file with one first-pass batch added (its bytes), and what it
    says: the covariances and the diagonal Fisher's sums grow (``sum_i g_i^2 = n (variance +
    mean^2)``, elementwise), the eigenvalues go."""
    n = int(answer["batch_size"])
    sums = {f"{part}/{w}": np.atleast_1d(np.asarray(v, np.float64)) * n
            for part, field in (("inputs", "kfac_inputs"), ("grads", "kfac_grads"),
                                ("tokens", "kfac_tokens"))
            for w, v in answer[field].items()}
    layers = _layers(spec, sums, answer["kfac_inputs"])
    inside = curvature.covered(layers)
    sums.update({f"diagonal/{p}": n * (np.asarray(answer["variance"][p], np.float64)
                                       + np.asarray(answer["mean"][p], np.float64) ** 2)
                 for p in spec.params if p not in inside})
    old = fitted(files, key)
    batches = _counted(spec.id, batch_id, () if old is None else old.batches, "factors")
    tensors: dict[str, np.ndarray]
    if old is None:
        tensors, samples, writes = sums, n, 1
    else:
        _, kept = _tensors(files, key, spec.id)
        if sorted(k for k in kept if k.split("/")[0] in FIRST) != sorted(
                k for k in sums if k.split("/")[0] in FIRST):
            raise Conflict(f"store '{spec.id}''s factors cover the layers "
                           f"{', '.join(old.layers)}; this batch's cover others: fit with "
                           "batches of the same inputs' shapes")
        tensors = {k: kept[k] + v for k, v in sums.items()}
        samples, writes = old.samples + n, old.writes + 1
    return _saved(spec.id, tensors, Fitted(samples, writes, sorted(layers), 0, writes, batches))


def _corrected(files: StoreFiles, key: str, spec: StoreSpec, rows: np.ndarray, store_id: str,
               batch_id: str | None) -> tuple[bytes, Fitted]:
    """The store's factors file with one second-pass batch added to its eigenvalues."""
    old, kept = _tensors(files, key, store_id)
    batches = _counted(store_id, batch_id, old.eigen_batches, "eigenvalues")
    layers, found = _bases(files, key, spec, old, kept)
    squares = curvature.rotated_squares(layers, found, as_grads(spec, rows))
    for w, v in squares.items():
        kept[f"eigen/{w}"] = kept.get(f"eigen/{w}", 0) + v.numpy()
    return _saved(store_id, kept, replace(old, writes=old.writes + 1,
                                          eigenvalues=old.eigenvalues + len(rows),
                                          eigen_batches=batches))


def _saved(store_id: str, tensors: dict[str, np.ndarray], done: Fitted
           ) -> tuple[bytes, Fitted]:
    """The factors file of ``tensors``; refused (422, nothing written) where a sum is not
    finite: a file that holds one makes every kfac and ekfac query of the store fail."""
    for name, v in tensors.items():
        if not np.isfinite(v).all():
            raise NonFinite(
                f"store '{store_id}': this batch's factors are not finite ({name}: a sample's "
                "inputs or gradients overflowed their dtype, such as an input of 1e19 whose "
                "square passes float32): nothing of it was added; rescale or leave out those "
                "samples", factor=name)
    return st_save(tensors, metadata={"samples": str(done.samples), "writes": str(done.writes),
                                      "eigenvalues": str(done.eigenvalues),
                                      "basis": str(done.basis),
                                      "batches": json.dumps(done.batches),
                                      "eigen_batches": json.dumps(done.eigen_batches)}), done


def curvature_of(files: StoreFiles, key: str, spec: StoreSpec, store_id: str) -> Curvature:
    """The store's :class:`~service.curvature.Curvature` as fitted now (409 before a fit);
    without EK-FAC's eigenvalues where the second pass has not run since the first's last
    batch."""
    found = require(files, key, store_id)
    epoch = files.manifest(key).epoch
    made: Curvature = files.kept_at("curvature", key, (epoch, found.writes),
                                    lambda: _curvature(files, key, spec, store_id))
    return made


def _curvature(files: StoreFiles, key: str, spec: StoreSpec, store_id: str) -> Curvature:
    """Kept under the writes count its header read; a write in between only makes the kept
    curvature newer than its key, and the next query reads the next count."""
    found, t = _tensors(files, key, store_id)
    layers, bases = _bases(files, key, spec, found, t)
    n, m = max(found.samples, 1), max(found.eigenvalues, 1)
    corrected = {w: torch.from_numpy(t[f"eigen/{w}"]) / m for w in layers
                 } if found.eigenvalues else {}
    diagonal = {k.removeprefix("diagonal/"): torch.from_numpy(v) / n for k, v in t.items()
                if k.startswith("diagonal/")}
    return Curvature(layers, bases, corrected, diagonal, found.samples)


def _bases(files: StoreFiles, key: str, spec: StoreSpec, found: Fitted,
           t: dict[str, np.ndarray]) -> tuple[dict[str, Linear], dict[str, Basis]]:
    """The layers of the first pass's sums in ``t`` and their eigenbases, made once per
    first-pass state (``found.basis``)."""
    def make() -> tuple[dict[str, Linear], dict[str, Basis]]:
        layers = _layers(spec, t, found.layers)
        sums = Covariances({w: torch.from_numpy(t[f"inputs/{w}"]) for w in layers},
                           {w: torch.from_numpy(t[f"grads/{w}"]) for w in layers},
                           {w: round(float(t[f"tokens/{w}"].sum())) for w in layers},
                           found.samples)
        return layers, curvature.bases(sums)

    epoch = files.manifest(key).epoch
    made: tuple[dict[str, Linear], dict[str, Basis]] = files.kept_at(
        "bases", key, (epoch, found.basis), make)
    return made


def _layers(spec: StoreSpec, t: dict[str, np.ndarray], weights: Iterable[str]
            ) -> dict[str, Linear]:
    """The layer of each weight's factors in ``t``, by their widths: its bias (``...bias``) a
    column of ones where the inputs' side is one wider than the weight's columns, a row where
    the output gradients' side is one longer than its rows (a transposed weight), else none."""
    out = {}
    for w in weights:
        shape, bias = spec.shapes[w], curvature.bias_of(w)
        columns, rows = t[f"inputs/{w}"].shape[0], t[f"grads/{w}"].shape[0]
        out[w] = (Linear(w, bias) if columns == math.prod(shape[1:]) + 1
                  else Linear(w, bias, transposed=True) if rows == shape[0] + 1
                  else Linear(w, None))
    return out


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
    with its projection where it keeps sketches; and the damping used. A few rows at a time,
    :data:`CHUNK_BYTES` of them in float64, so that a large model's queries take no more."""
    if kind == "ekfac" and curv.layers and not curv.corrected:
        raise _no_eigenvalues(spec.id)  # a factors batch since the query's check
    used = curv.default_damping(kind) if damping is None else damping
    if not used > 0:
        raise InvalidInput("'damping' must be > 0 (leave it out for the default, a tenth of "
                           "the Fisher's mean eigenvalue)")
    out = _preconditioned(spec, curv, rows, kind, used)
    if not np.isfinite(out).all():
        raise InvalidInput(f"'damping' {used:g} is too small for store '{spec.id}''s factors: "
                           "the preconditioned query is not finite; raise it, or leave it out "
                           f"for the default ({curv.default_damping(kind):g})", damping=used)
    return out, used


def _preconditioned(spec: StoreSpec, curv: Curvature, rows: np.ndarray, kind: Kind,
                    used: float) -> np.ndarray:
    """:func:`preconditioned`'s rows at damping ``used``."""
    sketch = None if spec.exact else Projection(spec.projection_dim, spec.projection_seed,
                                                spec.projection_kind)
    step = max(1, CHUNK_BYTES // (8 * max(rows.shape[1], 1)))
    parts = []
    for a in range(0, len(rows), step):
        chunk = rows[a:a + step]
        pre, n = curv.precondition(as_grads(spec, chunk), used, kind), len(chunk)
        if sketch is None:
            parts.append(np.concatenate([pre[p].reshape(n, -1).numpy() for p in spec.params],
                                        axis=1))
        else:
            out = torch.zeros(n, spec.projection_dim, dtype=torch.float64)
            sketch.project_many({p: pre[p] for p in spec.params}, out)
            parts.append(out.numpy())
    return np.concatenate(parts) if parts else np.zeros((0, spec.projection_dim))
