"""``/models``: list, describe, download weights; register, replace weights and delete (admin)."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from psgrad._errors import BadRequest, PsgradError, UnsupportedMediaType
from psgrad._wire import JSON, SAFETENSORS, media_type
from service import warmup
from service.api.body import body_chunks, read_body
from service.api.deps import AdminKey, ApiKey, RegistryDep, SettingsDep, StateDep, TenantDep
from service.api.schemas import MODEL_ID, MODEL_REF, ModelDeleted, ModelDoc, ModelList, errors
from service.export.register import checking_child, next_spare
from service.registration import (
    EXPORT_MEDIA_TYPE,
    Limits,
    delete,
    export_weights,
    register,
    register_exported,
    replace_weights,
)
from service.registry import ModelRegistry

router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey])
# The patterns are documented, not checked by FastAPI: registration checks them itself (400).
RefPath = Annotated[
    str, Path(description="id, or id@version", json_schema_extra={"pattern": MODEL_REF})
]
IdPath = Annotated[str, Path(description="a model id", json_schema_extra={"pattern": MODEL_ID})]


def _describe_all(registry: ModelRegistry) -> dict[str, Any]:
    docs = []
    for model_id in registry.ids():
        try:
            docs.append(registry.describe(model_id))
        except PsgradError:  # deleted meanwhile by another process
            continue
    return {"models": docs}


@router.get(
    "", response_model=ModelList, responses=errors(400, 401), summary="Every servable model"
)
async def list_models(registry: RegistryDep) -> dict[str, Any]:
    """Zoo models (by family name, default config) and registered models (newest version)."""
    return await run_in_threadpool(_describe_all, registry)


@router.get(
    "/{model_id}",
    response_model=ModelDoc,
    responses=errors(400, 401, 404),
    summary="One model: input, parameters, losses, versions",
)
async def get_model(model_id: RefPath, state: StateDep) -> dict[str, Any]:
    """``model_id`` may be ``id`` (newest version) or ``id@version``; ``warmup``: the
    progress of the warm-up its registration asked for."""
    doc: dict[str, Any] = await run_in_threadpool(state.registry.describe, model_id)
    return await _with_warmup(state, doc)


async def _with_warmup(state: StateDep, doc: dict[str, Any]) -> dict[str, Any]:
    store = state.registry.store
    record = await run_in_threadpool(store.warmup, doc["id"], doc["version"])
    if record is None:
        return doc
    return {**doc, "warmup": await warmup.progress(state.broker, store, doc["id"],
                                                   doc["version"], record)}


@router.get(
    "/{model_id}/weights",
    response_class=Response,
    summary="Weights as safetensors",
    responses={
        200: {
            "content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}},
            "description": "a safetensors file of every parameter and buffer",
        },
        **errors(400, 401, 404),
    },
)
async def get_weights(model_id: RefPath, registry: RegistryDep) -> Response:
    """The weights of ``id`` (newest) or ``id@version``; the header X-Psgrad-Model names it."""
    ref, data = await run_in_threadpool(export_weights, registry, model_id)
    return Response(
        data,
        media_type=SAFETENSORS,
        headers={
            "X-Psgrad-Model": ref,
            "Content-Disposition": f'attachment; filename="{ref.replace("@", "-")}.safetensors"',
        },
    )


REGISTER_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "{architecture: <zoo name>, config: {...}} or {architecture: 'sequential', "
        "layers: [{type, args, kwargs}], input: {shape, dtype}, default_loss, losses}; optional "
        "weights: {param: tensor} (docs/models.md)",
        "content": {
            JSON: {"schema": {"type": "object"}},
            EXPORT_MEDIA_TYPE: {
                "schema": {"type": "string", "format": "binary"},
                "description": "a .pt2 file written by torch.export.save (a program exported "
                "with a batch of one); read by psgrad's own strict loader, never unpickled",
            },
        },
    }
}
WEIGHTS_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": "a safetensors file of every parameter and buffer (never a pickle)",
        "content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}},
    }
}


def _registered(registry: ModelRegistry, model: Any) -> dict[str, Any]:
    doc: dict[str, Any] = registry.describe(model.ref)
    return doc


@router.put(
    "/{model_id}",
    response_model=ModelDoc,
    dependencies=[AdminKey],
    responses=errors(400, 401, 403, 409, 413, 415, 422),
    openapi_extra=REGISTER_BODY,
    summary="Register a model: a new version of id (admin)",
)
async def put_model(
    model_id: IdPath,
    request: Request,
    state: StateDep,
    tenant: TenantDep,
    default_loss: str = Query(
        "cross_entropy", max_length=64, description=f"{EXPORT_MEDIA_TYPE} bodies only"
    ),
    losses: str = Query(
        "", max_length=1000, description=f"{EXPORT_MEDIA_TYPE} bodies only: comma-separated"
    ),
    description: str = Query("", max_length=2000, description=f"{EXPORT_MEDIA_TYPE} only"),
    warmup_at: str = Query(
        "", alias="warmup", max_length=400,
        description="shapes to warm the model up at, batch size x length (4x64,32x512) or "
        "batch sizes alone for samples of one shape (4,32): a worker computes each as a job "
        "(progress under 'warmup' in GET /models/{id}), and workers starting up compute them "
        "again before they report ready"),
) -> dict[str, Any]:
    """Built on the meta device, held to the limits, then built and run on an example batch.

    A ``.pt2`` body is parsed, built and dry-run on ``meta`` in a child process under memory
    and time limits; only ops on psgrad's allow-list of pure aten overloads are accepted.
    """
    registry, settings = state.registry, state.settings
    shapes = warmup.parse_shapes(warmup_at, settings.max_batch_size)  # 422 before registering
    doc = await _register(model_id, request, registry, settings, default_loss, losses,
                          description)
    if shapes:
        model = await run_in_threadpool(registry.get, f"{doc['id']}@{doc['version']}")
        await warmup.ask(state.broker, registry.store, model, shapes, settings, tenant.name)
    return await _with_warmup(state, doc)


async def _register(model_id: str, request: Request, registry: ModelRegistry,
                    settings: SettingsDep, default_loss: str, losses: str, description: str
                    ) -> dict[str, Any]:
    kind = media_type(request.headers.get("content-type"))
    if kind == EXPORT_MEDIA_TYPE:
        chunks = body_chunks(request, settings.max_weight_bytes + (64 << 20),
                             ("max_weight_bytes", settings.max_weight_bytes))
        names = [n.strip() for n in losses.split(",") if n.strip()]
        # the archive goes straight into the checking child's file as it arrives (taken on
        # the loop: the spare at once, else a process started in about 1 ms; taken in a
        # thread, a cancelled request could leave it started and never ended)
        with checking_child(settings) as child:
            try:
                async for chunk in chunks:
                    child.archive.write(chunk)
            finally:
                next_spare(settings)  # the upload is over, whole or refused

            def run_exported() -> dict[str, Any]:
                model = register_exported(registry, model_id, child, settings,
                                          default_loss=default_loss, losses=names,
                                          description=description)
                return _registered(registry, model)

            return await run_in_threadpool(run_exported)
    if kind != JSON:
        raise UnsupportedMediaType(
            f"send the spec as {JSON} or a torch.export program as {EXPORT_MEDIA_TYPE}; "
            f"weights alone go to PUT /models/{model_id}/weights as {SAFETENSORS}"
        )
    raw = await read_body(request, settings.max_body_bytes)

    def run() -> dict[str, Any]:
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError) as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}"[:300]) from None
        model = register(registry, model_id, body, Limits.from_settings(settings))
        return _registered(registry, model)

    return await run_in_threadpool(run)


@router.put(
    "/{model_id}/weights",
    response_model=ModelDoc,
    dependencies=[AdminKey],
    responses=errors(400, 401, 403, 404, 409, 413, 415, 422),
    openapi_extra=WEIGHTS_BODY,
    summary="New weights for id: a new version (admin)",
)
async def put_weights(
    model_id: IdPath, request: Request, registry: RegistryDep, settings: SettingsDep
) -> dict[str, Any]:
    """Names, shapes and dtypes must match the newest version's architecture; finite only."""
    if media_type(request.headers.get("content-type")) not in (
        SAFETENSORS,
        "application/octet-stream",
    ):
        raise UnsupportedMediaType(f"send the weights as {SAFETENSORS} (a safetensors file)")
    raw = await read_body(request, settings.max_weight_bytes + (1 << 20),
                          ("max_weight_bytes", settings.max_weight_bytes))

    def run() -> dict[str, Any]:
        model = replace_weights(registry, model_id, raw, Limits.from_settings(settings))
        return _registered(registry, model)

    return await run_in_threadpool(run)


@router.delete(
    "/{model_id}",
    response_model=ModelDeleted,
    dependencies=[AdminKey],
    responses=errors(400, 401, 403, 404, 409),
    summary="Delete id (every version) or id@version (admin)",
)
async def delete_model(model_id: RefPath, state: StateDep) -> dict[str, Any]:
    """Deleted versions answer 404 at once, in every process that shares the store; a version
    a store or reference set pins is kept (409, naming them)."""
    gone: dict[str, Any] = await run_in_threadpool(delete, state.registry, model_id,
                                                   state.storage.gradients.pinning)
    return gone
