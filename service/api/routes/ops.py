"""Operations: liveness, readiness, Prometheus metrics."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from psgrad import __version__
from service.api.deps import StateDep
from service.api.schemas import Health, Ready, errors

router = APIRouter(tags=["operations"])
log = logging.getLogger("psgrad.api")


@router.get("/healthz", response_model=Health, summary="The process is up")
async def healthz() -> dict[str, str]:
    """Up, and the server's version (also in every answer's ``psgrad-version`` header)."""
    return {"status": "ok", "version": __version__}


@router.get(
    "/readyz",
    response_model=Ready,
    summary="Broker reachable and a worker alive",
    responses={503: {"model": Ready, "description": "not ready"}, **errors(400)},
)
async def readyz(state: StateDep, need_worker: bool = True) -> JSONResponse:
    """``need_worker=false``: ready once jobs can be queued, with no worker alive yet, as where
    workers scale to zero (deploy/kubernetes/: the api must take the job that wakes them)."""
    broker = type(state.broker).__name__
    try:
        ready = await state.ready(need_worker=need_worker)
        depth: int | None = await state.broker.queue_depth()
    except Exception as exc:
        log.warning("readiness check failed: %s", exc)
        ready, depth = False, None
    body = {"ready": ready, "broker": broker, "queue_depth": depth}
    return JSONResponse(
        body, status_code=200 if ready else 503, headers=None if ready else {"Retry-After": "1"}
    )


@router.get(
    "/metrics",
    response_class=Response,
    summary="Prometheus metrics",
    responses={
        200: {
            "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}},
            "description": "Prometheus text format",
        }
    },
)
async def metrics(state: StateDep) -> Response:
    try:
        depth: int | None = await state.broker.queue_depth()
    except Exception:
        depth = None
    return Response(state.metrics.render(depth), media_type=CONTENT_TYPE_LATEST)
