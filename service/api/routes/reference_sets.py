"""``/reference-sets``: make (``PUT``), describe (``GET``) and delete (``DELETE``) a kept set of
per-sample sketches or gradients, which ``influence`` requests then score against.

A reference set is a small gradient store (:mod:`service.stores.sets`): ``PUT`` keeps the batch
as the store of that id (also ``/stores/{id}``), ``GET`` describes it as a set, ``DELETE``
removes the store. Set ids are the tenant's own: two tenants may each have a set ``train``, and
neither sees the other's (404). An admin key reaches another tenant's sets with
``?tenant=<name>``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from starlette.concurrency import run_in_threadpool

from psgrad._errors import NotFound
from service.api.body import conform, decode_request, fields_of
from service.api.deps import ApiKey, AppState, Scope, ScopeDep, StateDep, TenantDep
from service.api.docs import request_body
from service.api.routes.grads import answer_of
from service.api.schemas import MODEL_ID, ReferenceSetBody, ReferenceSetDoc, errors
from service.jobs import Job, new_job_id
from service.reference_sets import check_size, checked_id, joined, set_request, split
from service.stores.sets import keep_set, set_doc, set_rows, set_spec
from service.tenants import Tenant, owned_key
from service.validate import parse_request

# Documented, not checked by FastAPI: the store refuses another id itself (400).
SetId = Annotated[
    str, Path(description="a reference set id", json_schema_extra={"pattern": MODEL_ID})
]

router = APIRouter(prefix="/reference-sets", tags=["data attribution"], dependencies=[ApiKey])


def _key(scope: Scope, set_id: str) -> str:
    """The store key of the set ``set_id`` in the namespace the caller reaches."""
    return owned_key(scope.owner, checked_id(set_id))


def _missing(set_id: str) -> NotFound:
    return NotFound(f"reference set '{set_id}' not found: create it with "
                    f"PUT /reference-sets/{set_id}")


async def split_answer(state: AppState, tenant: Tenant, fields: dict[str, Any]) -> dict[str, Any]:
    """The answer of a batch of any size: jobs of at most ``PSGRAD_MAX_BATCH_SIZE`` samples, in
    the tenant's fair share and quotas, their answers joined (one model version: checked)."""
    deadline = time.time() + state.settings.request_timeout_s
    jobs = [Job(new_job_id(), part, deadline=deadline, tenant=tenant.name)
            for part in split(fields, state.settings.max_batch_size)]
    for job in jobs:
        await state.broker.submit(job, tenant.quotas)
    return joined(list(await asyncio.gather(*(answer_of(state, job) for job in jobs))))


@router.put(
    "/{set_id}",
    response_model=ReferenceSetDoc,
    openapi_extra=request_body(ReferenceSetBody, "a batch and how its rows are made: JSON, or "
                               "a safetensors file as for POST /per-sample-grads"),
    responses=errors(400, 401, 403, 404, 413, 415, 422, 503, 504, 507),
    summary="Compute and keep a batch's sketches (projection_dim) or gradients",
)
async def put_reference_set(
    set_id: SetId, request: Request, state: StateDep, tenant: TenantDep, scope: ScopeDep
) -> dict[str, Any]:
    """The body is a batch (model, inputs, targets, ...) and how its rows are made (loss,
    params, projection_dim, projection_seed, projection_kind); an existing set of this id is
    replaced (a gradient store larger than a set may be is not: 409). A batch larger than
    ``PSGRAD_MAX_BATCH_SIZE`` runs as several jobs."""
    fields = await decode_request(request, state.settings, one_job=False,
                                  takes=fields_of(ReferenceSetBody))
    registry, limit = state.registry, state.settings.max_reference_set_bytes

    def check() -> dict[str, Any]:
        asked = set_request(set_id, fields)
        parsed = parse_request(asked, registry)  # the whole batch, as one request would be
        check_size(parsed.model, parsed.opts, parsed.batch.size, limit)
        return asked

    await conform(ReferenceSetBody, fields, check)  # check: its own error for nearly all
    fields = await run_in_threadpool(check)
    result = await split_answer(state, tenant, fields)

    def keep() -> dict[str, Any]:
        spec = set_spec(set_id, fields, result, registry.get(str(result["model"])), scope.owner)
        manifest = keep_set(state.storage.gradients, _key(scope, set_id), spec,
                            set_rows(spec, result), limit)
        return set_doc(spec, manifest)

    return await run_in_threadpool(keep)


@router.get("/{set_id}", response_model=ReferenceSetDoc, responses=errors(400, 401, 403, 404),
            summary="How a reference set was made, without its tensors")
async def get_reference_set(set_id: SetId, state: StateDep, scope: ScopeDep) -> dict[str, Any]:
    key, files = _key(scope, set_id), state.storage.gradients

    def read() -> dict[str, Any]:
        spec = files.spec(key)
        if spec is None:
            raise _missing(set_id)
        return set_doc(spec, files.manifest(key))

    return await run_in_threadpool(read)


@router.delete("/{set_id}", responses=errors(400, 401, 403, 404),
               summary="Delete a reference set")
async def delete_reference_set(set_id: SetId, state: StateDep,
                               scope: ScopeDep) -> dict[str, Any]:
    if not await run_in_threadpool(state.storage.gradients.delete, _key(scope, set_id)):
        raise _missing(set_id)
    return {"id": set_id, "deleted": True}
