"""From ``/stores`` bodies to stores and jobs: the spec a ``PUT`` defines, and the projection
request that computes a batch's sketches for ``samples`` and ``query``.

A store's sketches are an ordinary ``projection`` request's answer (the one ``POST
/per-sample-grads`` gives), run as jobs in the caller's fair share: the body brings the batch
(``inputs``, ``targets``, ...), the store brings everything else (its pinned model version,
loss, parameters and projection), so no batch can be sketched differently from the rest.
"""

from __future__ import annotations

import math
from typing import Any

from psgrad._contract import SAMPLE_FIELDS, model_of
from psgrad._errors import BadRequest, Conflict, InvalidInput
from service.reference_sets import BATCH_FIELDS, FIXED_FIELDS, checked_id
from service.registry import ModelRegistry
from service.stores.index import check_factory
from service.stores.spec import EXACT, MAX_CHECKPOINTS, MAX_EXACT_WIDTH, StoreSpec, check_dtype
from service.strategies.projection import VERSIONS
from service.validate import check_options
from service.validate.attribution import projection_of

SPEC_FIELDS = ("model", "loss", "params", "projection_dim", "projection_seed",
               "projection_kind", "dtype", "index", "checkpoints")


def make_spec(store_id: str, body: Any, registry: ModelRegistry, tenant: str) -> StoreSpec:
    """The store a ``PUT /stores/{id}`` body defines, checked against its model."""
    checked_id(store_id, "store")
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object: model, projection_dim, and optionally "
                         "loss, params, projection_seed, projection_kind, dtype")
    unknown = sorted(set(body) - set(SPEC_FIELDS))
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(unknown)}; a store takes "
                         f"{', '.join(SPEC_FIELDS)}", unknown=unknown)
    versions = checkpoints(body, registry)
    if not versions and body.get("model") is None:
        raise InvalidInput("a store needs 'model' (an id, or id@version), or 'checkpoints' "
                           "(versions of one model, for an ensemble)")
    model = registry.get(versions[0] if versions else model_of(body))
    asked = {k: body.get(k) for k in FIXED_FIELDS}  # held to the contract at the door
    asked["projection_kind"] = asked["projection_kind"] or None  # "": the default kind
    exact = asked["projection_dim"] is None
    output = "grads" if exact else "projection"
    opts = check_options({**asked, "outputs": [output]}, model)
    shapes = {p: list(model.params[p].shape) for p in opts.params}
    proj = projection_of(asked, [output])  # refuses a seed or kind without projection_dim
    width, seed, kind = (proj.k, proj.seed, proj.kind) if proj else (
        sum(math.prod(s) for s in shapes.values()), 0, EXACT)
    if width > MAX_EXACT_WIDTH:
        raise InvalidInput(
            f"a store of full gradients keeps at most {MAX_EXACT_WIDTH} values per sample; "
            f"{model.ref}'s selected parameters hold {width}: send 'projection_dim' (a sketch "
            f"of k values, up to {MAX_EXACT_WIDTH}), or select fewer 'params'",
            width=width, limit=MAX_EXACT_WIDTH)
    factory = body.get("index")
    return StoreSpec(id=store_id, model=model.ref, loss=opts.loss, params=opts.params,
                     projection_dim=width, projection_seed=seed, projection_kind=kind,
                     dtype=check_dtype(body.get("dtype")), tenant=tenant,
                     projection_version=VERSIONS.get(kind, 1), shapes=shapes,
                     index=None if factory is None else check_factory(factory, width),
                     checkpoints=tuple(versions))


def checkpoints(body: dict[str, Any], registry: ModelRegistry) -> list[str]:
    """An ensemble's model versions (``checkpoints``: ``id@version`` of one model, each
    registered, of the same parameters), in order; [] for a store of one model."""
    refs = body.get("checkpoints")
    if refs is None:
        return []
    if (not isinstance(refs, list) or not 2 <= len(refs) <= MAX_CHECKPOINTS
            or not all(isinstance(r, str) and "@" in r for r in refs)):
        raise InvalidInput(f"'checkpoints' lists 2 to {MAX_CHECKPOINTS} versions of one model "
                           "as 'id@version' (GET /models/{id} lists them)")
    models = [registry.get(ref) for ref in refs]
    ids = {m.ref.partition("@")[0] for m in models}
    named = body.get("model")
    if len(ids) > 1 or (named is not None and named not in ids):
        raise InvalidInput(f"'checkpoints' are versions of one model (got {sorted(ids)}"
                           f"{'' if named is None else f' for model {named!r}'})")
    if len({m.ref for m in models}) < len(models):
        raise InvalidInput("'checkpoints' lists a version twice: each once, in order")
    shapes = [{p: tuple(t.shape) for p, t in m.params.items()} for m in models]
    if any(s != shapes[0] for s in shapes):
        raise InvalidInput("'checkpoints' hold parameters of other names or shapes: an "
                           "ensemble's versions share one architecture")
    return [m.ref for m in models]


def check_fixed(spec: StoreSpec, fields: dict[str, Any], what: str) -> dict[str, Any]:
    """``fields`` without what the store fixes (loss, parameters, projection), each of which
    may be sent only with the store's own value: sketches of another kind, k or seed, or of
    another loss, are never mixed into a store or scored against it."""
    fields = dict(fields)
    for name in FIXED_FIELDS:
        given, want = fields.pop(name, None), getattr(spec, name)
        same = (given is None or (set(given) == set(want) if name == "params"
                                  and isinstance(given, list) else given == want))
        if not same:
            raise Conflict(f"store '{spec.id}' holds sketches made with {name} {want!r}; {what} "
                           f"sends {given!r}: leave '{name}' out (the store's applies), or use a "
                           f"store made with {name} {given!r}", field=name, store=want,
                           sent=given)
    return fields


def check_batch(spec: StoreSpec, fields: dict[str, Any], what: str) -> dict[str, Any]:
    """``fields`` of a body that brings a batch or its sketches to store ``spec``, checked:
    what the store fixes (:func:`check_fixed`) and its model version sent only with the store's
    own values, nothing but the batch's fields besides (``what``: the route, for the
    messages)."""
    fields = check_fixed(spec, fields, what)
    extra = sorted(k for k in fields if k not in BATCH_FIELDS and fields[k] is not None)
    if extra:
        raise InvalidInput(f"{what} takes a batch ({', '.join(SAMPLE_FIELDS)}); the store fixes "
                           f"the rest: leave out {', '.join(extra)}", fields=extra)
    asked = fields.get("model")
    model_id = spec.model.partition("@")[0]
    if asked is not None and asked not in (model_id, spec.model, *spec.checkpoints):
        raise Conflict(f"store '{spec.id}' holds sketches of model {spec.model}; {what} "
                       f"names {asked!r}: leave 'model' out or send {spec.model}",
                       store_model=spec.model, model=asked)
    return fields


def rows_requests(spec: StoreSpec, key: str, fields: dict[str, Any], what: str,
                  full: bool = False) -> list[dict[str, Any]]:
    """The requests whose answers are the rows of a body's batch under ``spec`` (the store
    ``key``), one per checkpoint (:meth:`StoreSpec.members`; one for a store of one model):
    each its ``projection``, or for a store of full gradients (or ``full``: K-FAC's fit and
    queries, which need them) its ``grads`` (:func:`service.stores.sets.set_rows` flattens
    them). The batch is checked once against the whole store (``what``: the route, for the
    messages)."""
    fields = check_batch(spec, fields, what)
    fields.pop("model", None)  # each checkpoint's own version
    return [_rows_request(member, fields, full) for _, member in spec.members(key)]


def _rows_request(spec: StoreSpec, fields: dict[str, Any], full: bool) -> dict[str, Any]:
    request = {**fields, "model": spec.model, "loss": spec.loss, "params": list(spec.params)}
    if spec.exact or full:
        return {**request, "outputs": ["grads"]}
    return {**request, "projection_dim": spec.projection_dim,
            "projection_seed": spec.projection_seed, "projection_kind": spec.projection_kind,
            "outputs": ["projection"]}
