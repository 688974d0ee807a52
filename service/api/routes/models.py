"""``/models``: list, describe, and download weights (F adds registration and deletion here)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from psgrad._errors import PsgradError
from psgrad._wire import SAFETENSORS
from service.api.deps import ApiKey, RegistryDep
from service.api.schemas import ModelDoc, ModelList, errors
from service.registration import export_weights
from service.registry import ModelRegistry

router = APIRouter(prefix="/models", tags=["models"], dependencies=[ApiKey])


def _describe_all(registry: ModelRegistry) -> dict[str, Any]:
    docs = []
    for model_id in registry.ids():
        try:
            docs.append(registry.describe(model_id))
        except PsgradError:  # deleted meanwhile by another process
            continue
    return {"models": docs}


@router.get("", response_model=ModelList, responses=errors(401), summary="Every servable model")
async def list_models(registry: RegistryDep) -> dict[str, Any]:
    """Zoo models (by family name, default config) and registered models (newest version)."""
    return await run_in_threadpool(_describe_all, registry)


@router.get(
    "/{model_id}",
    response_model=ModelDoc,
    responses=errors(401, 404),
    summary="One model: input, parameters, losses, versions",
)
async def get_model(model_id: str, registry: RegistryDep) -> dict[str, Any]:
    """``model_id`` may be ``id`` (newest version) or ``id@version``."""
    doc: dict[str, Any] = await run_in_threadpool(registry.describe, model_id)
    return doc


@router.get(
    "/{model_id}/weights",
    response_class=Response,
    summary="Weights as safetensors",
    responses={
        200: {
            "content": {SAFETENSORS: {"schema": {"type": "string", "format": "binary"}}},
            "description": "a safetensors file of every parameter and buffer",
        },
        **errors(401, 404),
    },
)
async def get_weights(model_id: str, registry: RegistryDep) -> Response:
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
