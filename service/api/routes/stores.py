"""``/stores``: gradient stores. ``PUT`` defines one, ``POST .../samples`` adds a batch's rows
under the caller's ids, ``POST .../query`` ranks the store for test samples (or their rows),
``GET`` describes it, ``DELETE`` removes it (docs/attribution.md). A row is a sample's sketch
(``projection_dim`` k), or its full gradient flattened (a store made without ``projection_dim``,
of kind ``exact``, for models of at most ``MAX_EXACT_WIDTH`` selected values).

Sketches are computed by the workers as ordinary ``projection`` jobs, in the caller's fair share
and quotas, as ``PUT /reference-sets`` makes its jobs; the api writes and reads the files
(:mod:`service.stores`), in a thread. Store ids are each tenant's own (another tenant's store is
a 404); an admin reaches another tenant's with ``?tenant=<name>``.
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Path, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, create_model
from starlette.concurrency import run_in_threadpool

from psgrad._contract import SAMPLE_FIELDS, shown
from psgrad._errors import BadRequest, Conflict, InvalidInput, NotFound, StoreDamaged
from psgrad._wire import array_from_json
from service.api.body import conform, decode_request, fields_of, read_json
from service.api.deps import ApiKey, AppState, Scope, ScopeDep, StateDep, TenantDep
from service.api.docs import request_body
from service.api.routes.reference_sets import split_answer
from service.api.schemas import (
    MODEL_ID,
    MODEL_REF,
    SampleBatch,
    StoreRequest,
    Tensor,
    contract_field,
    contract_fields,
    errors,
)
from service.curvature import KINDS as FACTOR_SCORES
from service.reference_sets import checked_id
from service.stores import factors
from service.stores.files import Manifest, commit_all, refuse_duplicates
from service.stores.query import QUERY_NUMBERS, Score, check_k, check_score, search_all
from service.stores.requests import check_batch, make_spec, rows_requests
from service.stores.sets import set_rows
from service.stores.spec import (
    MAX_ID,
    MAX_ID_CHARS,
    MIN_ID,
    Dtype,
    StoreSpec,
    checked_ids,
    sample_ids,
)
from service.tenants import Tenant, key_owner, owned_key, owned_name
from service.validate import parse_request

StoreId = Annotated[str, Path(description="a store id", json_schema_extra={"pattern": MODEL_ID})]
SampleId = Annotated[int, Field(ge=MIN_ID, le=MAX_ID)] | Annotated[
    str, Field(min_length=1, max_length=MAX_ID_CHARS)]
router = APIRouter(prefix="/stores", tags=["data attribution"], dependencies=[ApiKey])


StoreBody = create_model(  # loss, params and the projection: the request contract's fields
    "StoreBody",
    __config__=ConfigDict(extra="forbid"),
    model=(str | None, Field(None, pattern=MODEL_REF, description="model id, or id@version; "
                             "the store pins the version")),
    checkpoints=(list[str] | None, Field(None, min_length=2, description="an ensemble: versions "
                                         "of one model (id@version), scored as the sum over "
                                         "them")),
    **contract_fields("loss", "params", "projection_dim", "projection_seed", "projection_kind"),
    dtype=(Dtype, Field("float32", description="how rows are kept")),
    index=(str | None, Field(None, description="a FAISS factory string (\"IVF1024,Flat\", "
                             "\"IVF4096,SQ4\", \"HNSW32\"): an approximate index for dot and "
                             "trak queries, kept as rows are committed")),
)


FitBody = create_model(
    "FitBody",
    __base__=SampleBatch,
    batch_id=(str | None, Field(None, min_length=1, max_length=MAX_ID_CHARS,
                                description="the client's name for this batch (printable "
                                "characters): a pass refuses a batch id it counted (409, "
                                "details.counted), so a batch whose answer was lost is sent "
                                "again safely")),
)
SamplesBody = create_model(
    "SamplesBody",
    __base__=SampleBatch,
    **contract_fields("inputs", required=("inputs",)),
    ids=(list[SampleId], Field(min_length=1, description="one per sample: integers or strings "
                                "of 1 to 128 printable characters, new to the store")),
)
RowsBody = create_model(
    "RowsBody",
    __base__=StoreRequest,
    rows=(Tensor, Field(description="[n, projection_dim] in the store's dtype: sketches made "
                        "with the store's definition, or a store of full gradients' flattened "
                        "gradients")),
    ids=(list[SampleId], Field(min_length=1, description="one per row, new to the store")),
)
_QUERY_NUMBERS: dict[str, Any] = {n: contract_field(f) for n, f in QUERY_NUMBERS.items()}
QueryBody = create_model(
    "QueryBody",
    __base__=SampleBatch,
    score=(Score, "dot"),
    sketches=(Tensor | None, Field(None, description="[queries, k] instead of a batch (a "
                                   "store of full gradients: the flattened gradients)")),
    exact=(bool | None, Field(None, description="true: score every row; default: through the "
                              "store's index where it has one (dot, trak)")),
    **_QUERY_NUMBERS,
)


def _key(scope: Scope, store_id: str) -> str:
    return owned_key(scope.owner, checked_id(store_id, "store"))


def _missing(store_id: str) -> NotFound:
    return NotFound(f"store '{store_id}' not found: create it with PUT /stores/{store_id}")


def _doc(spec: StoreSpec, manifest: Manifest, fitted: factors.Fitted | None = None
         ) -> dict[str, Any]:
    """``GET /stores/{id}``: the definition, what is committed and the factors fitted."""
    return {**spec.doc(), "samples": manifest.count, "bytes": manifest.nbytes,
            "shards": len(manifest.shards), "commits": manifest.seq,
            "state": "ready" if manifest.count else "empty",
            "indexed": manifest.trained is not None,  # an index written whole before pieces scans
            "factors": None if fitted is None else {"samples": fitted.samples,
                                                    "eigenvalues": fitted.eigenvalues,
                                                    "layers": fitted.layers}}


def _spec(state: AppState, key: str, store_id: str) -> StoreSpec:
    spec = state.storage.gradients.spec(key)
    if spec is None:
        raise _missing(store_id)
    return spec


def _shown(state: AppState, key: str, spec: StoreSpec) -> Manifest:
    """The committed state a store's description shows: its own, or an ensemble's first
    checkpoint's (every checkpoint holds the same samples)."""
    return _states(state, key, spec)[0]


def _described(state: AppState, key: str, spec: StoreSpec, manifest: Manifest | None = None
               ) -> dict[str, Any]:
    """``GET /stores/{id}``'s document of the store (as ``manifest`` commits it, else as it
    is now), its factors as fitted now."""
    first = spec.members(key)[0][0]
    return _doc(spec, manifest or _shown(state, key, spec),
                factors.fitted(state.storage.gradients, first))


def _states(state: AppState, key: str, spec: StoreSpec) -> list[Manifest]:
    """The committed state of each checkpoint's rows (one for a store of one model), as of
    one commit (:meth:`StoreFiles.states`)."""
    return state.storage.gradients.states([k for k, _ in spec.members(key)])


async def _rows(state: AppState, tenant: Tenant, spec: StoreSpec, job: dict[str, Any],
                full: bool = False) -> np.ndarray:
    """The batch's rows (sketches, or flattened gradients; ``full``: gradients either way),
    computed by the workers (several jobs past the batch limit)."""
    result = await split_answer(state, tenant, job)
    _same_model(spec, result)
    return np.asarray(set_rows(spec, result, full), dtype=np.float32)


def _same_model(spec: StoreSpec, result: dict[str, Any]) -> None:
    """The workers answered with the store's model version and projection (409 otherwise,
    naming what they answered: sketches, or full gradients)."""
    meta = result.get("meta") or {}
    kind = meta.get("projection_kind", spec.projection_kind)
    version = meta.get("projection_version", spec.projection_version)
    if (str(result["model"]) != spec.model or kind != spec.projection_kind
            or version != spec.projection_version):
        rows = "sketches" if "projection" in result else "gradients"
        raise Conflict(f"the {rows} came from {result['model']} ({kind} version {version}), "
                       f"not the store's {spec.model} ({spec.projection_kind} version "
                       f"{spec.projection_version}); send the batch again")


@router.get("", responses=errors(400, 401, 403),
            summary="The caller's stores (an admin's: every tenant's, or ?tenant=)")
async def list_stores(state: StateDep, scope: ScopeDep) -> dict[str, Any]:
    def read() -> list[dict[str, Any]]:
        out = []
        for key in state.storage.gradients.store_keys():
            if not scope.sees(key_owner(key)):  # another tenant's, even damaged, is not read
                continue
            try:
                spec = state.storage.gradients.spec(key)
                if spec is not None:
                    out.append(_described(state, key, spec))
            except StoreDamaged as exc:
                out.append({"id": owned_name(key), "tenant": key_owner(key), "state": "damaged",
                            "error": exc.message})
        return out

    return {"stores": await run_in_threadpool(read)}


@router.put("/{store_id}",
            openapi_extra=request_body(StoreBody, "the store's definition", binary=False),
            responses=errors(400, 401, 403, 404, 409, 413, 415, 422, 507),
            summary="Define a gradient store (201; the same definition again: 200)")
async def put_store(store_id: StoreId, request: Request, state: StateDep,
                    scope: ScopeDep) -> JSONResponse:
    body = await read_json(request, state.settings.max_body_bytes)
    await conform(StoreBody, body, partial(make_spec, store_id, body, state.registry,
                                           scope.owner))  # its own error for nearly all

    def make() -> tuple[dict[str, Any], bool]:
        spec, key = make_spec(store_id, body, state.registry, scope.owner), _key(scope, store_id)
        stored, created = state.storage.gradients.create(key, spec)
        for member_key, member in stored.members(key) if stored.checkpoints else ():
            state.storage.gradients.create(member_key, member)  # again: a no-op once made
        return _doc(stored, _shown(state, key, stored)), created

    doc, created = await run_in_threadpool(make)
    return JSONResponse(doc, status_code=201 if created else 200)


@router.get("/{store_id}", responses=errors(400, 401, 403, 404),
            summary="A store's definition, committed samples, bytes and state")
async def get_store(store_id: StoreId, state: StateDep, scope: ScopeDep) -> dict[str, Any]:
    key = _key(scope, store_id)

    return await run_in_threadpool(lambda: _described(state, key, _spec(state, key, store_id)))


@router.delete("/{store_id}", responses=errors(400, 401, 403, 404), summary="Delete a store")
async def delete_store(store_id: StoreId, state: StateDep, scope: ScopeDep) -> dict[str, Any]:
    if not await run_in_threadpool(state.storage.gradients.delete, _key(scope, store_id)):
        raise _missing(store_id)
    return {"id": store_id, "deleted": True}


@router.post("/{store_id}/samples",
             openapi_extra=request_body(SamplesBody, "a batch (inputs, targets, ...) and 'ids', "
                                        "one per sample: integers or short strings"),
             responses=errors(400, 401, 403, 404, 409, 413, 415, 422, 503, 504, 507),
             summary="Add a batch's rows under the caller's ids (all or nothing)")
async def add_samples(store_id: StoreId, request: Request, state: StateDep, tenant: TenantDep,
                      scope: ScopeDep) -> dict[str, Any]:
    """The batch's rows are computed by the workers with the store's model version, loss,
    parameters and projection, then committed whole: an id already in the store refuses the
    whole batch (409, listing them), so a retry of a batch that was added is refused, never
    doubled."""
    fields = await decode_request(request, state.settings, one_job=False,
                                  takes=fields_of(SamplesBody), need_model=False,
                                  tensors=("ids",))
    key, raw_ids = _key(scope, store_id), fields.pop("ids", None)

    def check() -> tuple[StoreSpec, list[dict[str, Any]], list[int | str], str, list[str]]:
        spec = _spec(state, key, store_id)
        spec.check_version()
        what = f"POST /stores/{store_id}/samples"
        jobs = rows_requests(spec, key, fields, what)
        parsed = parse_request(jobs[0], state.registry)  # the whole batch, before any job runs
        ids, kind = checked_ids(raw_ids, parsed.batch.size)
        files, states = state.storage.gradients, _states(state, key, spec)
        refuse_duplicates(spec.id, files.ids(spec.members(key)[0][0], states[0]), ids)
        return spec, jobs, ids, kind, [m.epoch for m in states]

    listed = raw_ids.tolist() if isinstance(raw_ids, np.ndarray) else raw_ids  # safetensors'
    await conform(SamplesBody, {**fields, "ids": listed}, check)
    spec, jobs, ids, kind, epochs = await run_in_threadpool(check)
    members = spec.members(key)
    rows = await asyncio.gather(*(_rows(state, tenant, member, job)
                                  for (_, member), job in zip(members, jobs, strict=True)))

    def keep() -> dict[str, Any]:
        manifest = commit_all(state.storage.gradients, [
            (member_key, member, part) for (member_key, member), part in zip(members, rows,
                                                                              strict=True)],
            ids, kind, epochs)
        return {**_described(state, key, spec, manifest), "added": len(ids)}

    return await run_in_threadpool(keep)


@router.post("/{store_id}/rows",
             openapi_extra=request_body(RowsBody, "'rows' [n, projection_dim] and 'ids', one "
                                        "per row"),
             responses=errors(400, 401, 403, 404, 409, 413, 415, 422, 507),
             summary="Import rows made elsewhere under the caller's ids (all or nothing)")
async def import_rows(store_id: StoreId, request: Request, state: StateDep,
                      scope: ScopeDep) -> dict[str, Any]:
    """Bulk import: rows a caller already has (the ``projection`` output for the store's
    fields, kept elsewhere), committed whole as an append is, with nothing computed, so a
    store fills at disk speed. The whole batch is refused, nothing written, for a shape other
    than ``[n, projection_dim]``, a value that is not finite, a tensor of another dtype than
    the store's (safetensors), an id repeated or already held (409)."""
    fields = await decode_request(request, state.settings, one_job=False, takes=fields_of(RowsBody),
                                  need_model=False, tensors=("rows", "ids"))
    key, what = _key(scope, store_id), f"POST /stores/{store_id}/rows"
    raw_rows, raw_ids = fields.pop("rows", None), fields.pop("ids", None)

    def check() -> tuple[StoreSpec, np.ndarray, list[int | str], str, str]:
        spec = _spec(state, key, store_id)
        spec.check_version()
        if spec.checkpoints:
            raise InvalidInput(f"store '{store_id}' is an ensemble of {len(spec.checkpoints)} "
                               f"checkpoints, each with rows of its own: add samples with POST "
                               f"/stores/{store_id}/samples, or import rows into a store of "
                               "one model version")
        rest = check_batch(spec, fields, what)
        batch = sorted(k for k, v in rest.items() if v is not None and k != "model")
        if batch:
            raise InvalidInput(f"{what} takes 'rows' and 'ids' only: {', '.join(batch)} make "
                               f"a batch, whose rows POST /stores/{store_id}/samples computes")
        if raw_rows is None:
            raise BadRequest(f"{what} needs 'rows' [n, {spec.projection_dim}] and 'ids'")
        if isinstance(raw_rows, np.ndarray) and raw_rows.dtype != np.dtype(spec.dtype):
            raise InvalidInput(f"'rows' is {raw_rows.dtype}; store '{store_id}' keeps "
                               f"{spec.dtype}: send {spec.dtype} rows", dtype=str(raw_rows.dtype),
                               store_dtype=spec.dtype)
        rows = _given_rows(raw_rows, spec, state.settings.max_elements, "rows")
        ids, kind = checked_ids(raw_ids, len(rows))
        files = state.storage.gradients
        manifest = files.manifest(key)
        refuse_duplicates(spec.id, files.ids(key, manifest), ids)
        return spec, rows, ids, kind, manifest.epoch

    listed = raw_ids.tolist() if isinstance(raw_ids, np.ndarray) else raw_ids
    await conform(RowsBody, {**fields, "rows": raw_rows, "ids": listed}, check)
    spec, rows, ids, kind, epoch = await run_in_threadpool(check)

    def keep() -> dict[str, Any]:
        manifest = state.storage.gradients.append(key, spec, ids, kind, rows, epoch)
        return {**_described(state, key, spec, manifest), "added": len(ids)}

    return await run_in_threadpool(keep)


@router.post("/{store_id}/factors",
             openapi_extra=request_body(FitBody, "a batch (inputs, targets, ...), as for "
                                        "/samples, and optionally its 'batch_id'"),
             responses=errors(400, 401, 403, 404, 409, 413, 415, 422, 503, 504, 507),
             summary="Fit the store's K-FAC factors over a batch (repeatable)")
async def fit_factors(store_id: StoreId, request: Request, state: StateDep, tenant: TenantDep,
                      scope: ScopeDep) -> dict[str, Any]:
    """The first pass: the workers compute the batch's K-FAC factors (``kfac_inputs``) and its
    gradients' ``mean`` and ``variance`` (no per-sample gradients: an answer's size does not
    grow with the batch) with the store's model version, loss and parameters; they are added to the
    store's (each checkpoint's own, for an ensemble), all or nothing. Each batch adds to the
    fit: send the fitting set in as many batches as suits (the store's own samples, or
    others); ``kfac`` queries need only this pass, ``ekfac`` the second one after it (``POST
    /stores/{id}/factors/eigenvalues``: a batch here changes the bases and drops the
    eigenvalues). ``GET /stores/{id}`` shows ``factors``: each pass's samples and the layers
    covered. A ``batch_id`` the pass counted (among its last 1024) is refused whole (409 with
    ``details.counted``): a batch whose answer was lost is sent again under its id safely."""
    return await _fitting(store_id, request, state, tenant, scope, second=False)


@router.post("/{store_id}/factors/eigenvalues",
             openapi_extra=request_body(FitBody, "a batch (inputs, targets, ...), as for "
                                        "/samples, and optionally its 'batch_id'"),
             responses=errors(400, 401, 403, 404, 409, 413, 415, 422, 503, 504, 507),
             summary="Fit the store's EK-FAC eigenvalues over a batch (after its factors)")
async def fit_eigenvalues(store_id: StoreId, request: Request, state: StateDep,
                          tenant: TenantDep, scope: ScopeDep) -> dict[str, Any]:
    """The second pass: the workers compute the batch's gradients, which are added to EK-FAC's
    eigenvalues in the bases of the store's factors as they are now (each checkpoint's own),
    all or nothing; 409 before any factors. Send the same fitting samples as to ``/factors``,
    in as many batches as suits."""
    return await _fitting(store_id, request, state, tenant, scope, second=True)


async def _fitting(store_id: str, request: Request, state: AppState, tenant: Tenant,
                   scope: Scope, *, second: bool) -> dict[str, Any]:
    """One batch of a fit's first or ``second`` pass, for every checkpoint of the store."""
    fields = await decode_request(request, state.settings, one_job=False,
                                  takes=fields_of(FitBody), need_model=False)
    key, batch_id = _key(scope, store_id), fields.pop("batch_id", None)
    what = f"POST /stores/{store_id}/factors{'/eigenvalues' if second else ''}"
    files, max_bytes = state.storage.gradients, state.settings.max_factors_bytes

    def check() -> tuple[StoreSpec, list[dict[str, Any]], str | None, list[str]]:
        spec = _spec(state, key, store_id)
        spec.check_version()
        factors.check_fits(spec, store_id)
        checked = factors.check_batch_id(files, spec.members(key)[0][0], store_id, batch_id,
                                         second)
        if second:
            for member_key, _ in spec.members(key):
                factors.require(files, member_key, store_id)
        jobs = [{**job, "outputs": ["grads"] if second else list(factors.FIRST_OUTPUTS)}
                for job in rows_requests(spec, key, fields, what, full=True)]
        parsed = parse_request(jobs[0], state.registry)  # the whole batch, before any job runs
        factors.check_room(parsed.model, spec.params, max_bytes)
        return spec, jobs, checked, [m.epoch for m in _states(state, key, spec)]

    await conform(FitBody, {**fields, "batch_id": batch_id}, check)
    spec, jobs, batch_id, epochs = await run_in_threadpool(check)
    members = spec.members(key)
    answers = await asyncio.gather(*(split_answer(state, tenant, job) for job in jobs))
    for (_, member), answer in zip(members, answers, strict=True):
        _same_model(member, answer)

    def keep() -> dict[str, Any]:
        parts = [(member_key, member, answer)
                 for (member_key, member), answer in zip(members, answers, strict=True)]
        done = (factors.add_eigenvalues(files, [(k, m, set_rows(m, answer, full=True))
                                                for k, m, answer in parts], store_id, max_bytes,
                                               batch_id, epochs)
                if second else factors.add(files, parts, max_bytes, batch_id, epochs))
        return {**_doc(spec, _shown(state, key, spec), done),
                "fitted": int(answers[0]["batch_size"])}

    return await run_in_threadpool(keep)


class LookupBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ids: list[SampleId] = Field(description="sample ids to look for")


def _lookup_ids(body: Any) -> list[int | str]:
    """The sample ids a lookup body asks for; else 400 for a body of another shape, and the
    first entry that is no sample id refused (:func:`service.stores.spec.sample_ids`)."""
    if not isinstance(body, dict) or set(body) != {"ids"} or not isinstance(body["ids"], list):
        raise BadRequest(f"the body is {{\"ids\": [...]}}, the sample ids to look for; got "
                         f"{shown(body)}")
    return sample_ids(body["ids"])[0]


@router.post("/{store_id}/lookup",
             openapi_extra=request_body(LookupBody, "sample ids", binary=False),
             responses=errors(400, 401, 403, 404, 413, 415, 422),
             summary="Which of these sample ids the store holds (to resume an upload)")
async def lookup(store_id: StoreId, request: Request, state: StateDep,
                 scope: ScopeDep) -> dict[str, Any]:
    """Answers ``present``, one boolean per id, over what is committed now, and ``samples``:
    a client resuming an upload sends only the ids that are not present."""
    body = await read_json(request, state.settings.max_body_bytes)
    await conform(LookupBody, body, partial(_lookup_ids, body))
    wanted = _lookup_ids(body)
    key = _key(scope, store_id)

    def run() -> dict[str, Any]:
        spec = _spec(state, key, store_id)
        first, manifest = spec.members(key)[0][0], _shown(state, key, spec)
        held = state.storage.gradients.ids(first, manifest)
        return {"present": [v in held for v in wanted], "samples": manifest.count}

    return await run_in_threadpool(run)


@router.post("/{store_id}/query",
             openapi_extra=request_body(QueryBody, "k, score, lambda, and either a batch "
                                        "(inputs, targets, ...) or its 'sketches' [queries, "
                                        "k]; no samples for score self_influence"),
             responses=errors(400, 401, 403, 404, 409, 413, 415, 422, 503, 504, 507),
             summary="The top k training samples of each test sample: ids and scores")
async def query_store(store_id: StoreId, request: Request, state: StateDep, tenant: TenantDep,
                      scope: ScopeDep) -> dict[str, Any]:
    """Answers ``ids`` and ``scores``, each ``[queries, k]`` (``[1, k]`` for
    ``self_influence``), best first, over the samples committed when the query starts."""
    fields = await decode_request(request, state.settings, one_job=False,
                                  takes=fields_of(QueryBody), need_model=False,
                                  tensors=("sketches",))
    key = _key(scope, store_id)
    sent = dict(fields)
    sent_numbers = {n: spec.check(fields.pop(n, None)) for n, spec in QUERY_NUMBERS.items()}
    k, lam, damping, probes = (sent_numbers[n] for n in ("k", "lambda", "damping", "probes"))
    k = QUERY_NUMBERS["k"].default if k is None else k
    lam, damping = (None if v is None else float(v) for v in (lam, damping))  # as echoed
    score = fields.pop("score", "dot")
    given = fields.pop("sketches", None)
    exact = fields.pop("exact", None)

    def check() -> tuple[StoreSpec, list[dict[str, Any]], list[np.ndarray | None]]:
        nonlocal score
        score = check_score(score)
        if exact is not None and not isinstance(exact, bool):
            raise InvalidInput("'exact' is true (score every row) or false (the store's index, "
                               "where it has one)")
        if lam is not None and score != "trak":
            raise InvalidInput("'lambda' is read by score 'trak' only")
        if damping is not None and score not in FACTOR_SCORES:
            raise InvalidInput("'damping' is read by scores 'kfac' and 'ekfac' only")
        spec = _spec(state, key, store_id)
        spec.check_version()
        if score in FACTOR_SCORES:
            factors.check_fits(spec, store_id)
            for member_key, _ in spec.members(key):
                factors.check_scores(state.storage.gradients, member_key, store_id, score)
        rest = check_batch(spec, fields, "this query")
        check_k(_shown(state, key, spec), k, store_id)
        batch = any(rest.get(f) is not None for f in SAMPLE_FIELDS)
        members = spec.members(key)
        if score == "self_influence":
            if batch or given is not None:
                raise InvalidInput("score 'self_influence' ranks the store by itself: send no "
                                   "samples or sketches")
            return spec, [], [None] * len(members)
        if given is not None:
            if batch:
                raise InvalidInput("send test samples (inputs, ...) or their 'sketches', not both")
            if spec.checkpoints:
                raise InvalidInput(f"store '{store_id}' is an ensemble: each checkpoint makes "
                                   "its own rows of a test sample, so send the samples (inputs, "
                                   "targets, ...), not 'sketches'")
            if score in FACTOR_SCORES and not spec.exact:
                raise InvalidInput(f"score '{score}' preconditions the test samples' full "
                                   f"gradients, which store '{store_id}''s sketches are not: "
                                   "send the samples (inputs, targets, ...)")
            return spec, [], [_given_rows(given, spec, state.settings.max_elements,
                                          "sketches")]
        if not batch:
            raise InvalidInput(f"score '{score}' needs test samples (inputs, targets, ...) or "
                               f"their 'sketches' [queries, {spec.projection_dim}]")
        jobs = rows_requests(spec, key, fields, "this query", full=score in FACTOR_SCORES)
        parse_request(jobs[0], state.registry)
        return spec, jobs, []

    await conform(QueryBody, sent, check)  # check: its own error for nearly all
    spec, jobs, queries = await run_in_threadpool(check)
    members = spec.members(key)
    if jobs:
        queries = list(await asyncio.gather(*(
            _rows(state, tenant, member, job, score in FACTOR_SCORES)
            for (_, member), job in zip(members, jobs, strict=True))))

    def run() -> dict[str, Any]:
        files = state.storage.gradients
        scored, used = score, None
        if score in FACTOR_SCORES:  # the queries preconditioned, then scored as dot
            scored, pre = "dot", [factors.preconditioned(
                member, factors.curvature_of(files, member_key, member, store_id), q, score,
                damping) for (member_key, member), q in zip(members, queries, strict=True)
                if q is not None]
            queries[:], used = [q for q, _ in pre], [d for _, d in pre]
        found = search_all(files, [m for m, _ in members], store_id, queries, k, scored, lam,
                           exact, probes)
        out = {"ids": files.id_at(members[0][0], found.manifest, found.rows),
               "scores": found.scores.tolist(), "score": score, "k": k,
               "samples": found.manifest.count, "projection_kind": spec.projection_kind,
               "exact": found.exact}
        if found.lam is not None:
            out["lambda"] = found.lam
        if used is not None:
            out["damping"] = used[0] if len(used) == 1 else used
        if spec.checkpoints:
            out["checkpoints"] = list(spec.checkpoints)
        return out

    return await run_in_threadpool(run)


def _given_rows(raw: Any, spec: StoreSpec, max_elements: int, name: str) -> np.ndarray:
    """Rows a body sends (a query's ``sketches``, an import's ``rows``) as float64 ``[n,
    projection_dim]``, every value finite."""
    arr = raw if isinstance(raw, np.ndarray) else array_from_json(
        raw, name=name, max_elements=max_elements)
    arr = np.asarray(arr, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] != spec.projection_dim or not len(arr):
        raise InvalidInput(f"'{name}' has shape {list(arr.shape)}; expected [n, "
                           f"{spec.projection_dim}] (made with the store's "
                           f"{'gradients, flattened' if spec.exact else 'projection'})",
                           shape=list(arr.shape), projection_dim=spec.projection_dim)
    if not np.isfinite(arr).all():
        raise InvalidInput(f"'{name}' holds values that are not finite")
    return arr
