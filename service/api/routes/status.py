"""``GET /status``: a live status page, and its data at ``GET /status.json``.

The page is one file shipped in the package (``service/api/status.html``: inline script and
style, nothing fetched from elsewhere, so it works on a host without internet). It holds no data
and needs no key; it polls ``/status.json`` every second, which needs a key like every data route
(an API key is enough). With keys configured the page takes the key from its address
(``/status?key=...``, then dropped from the address bar) or asks for it, keeps it in the tab's
session storage and sends it as ``Authorization: Bearer <key>``.
"""

from __future__ import annotations

from functools import cache
from importlib.resources import files
from typing import Any

from fastapi import APIRouter, Query
from fastapi.responses import HTMLResponse

from service.api.deps import ScopeDep, StateDep
from service.api.schemas import errors
from service.api.status_data import StatusView, status_view

router = APIRouter(tags=["operations"])

# the page's own script and style only; its data come from this origin
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src data:; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
    "X-Content-Type-Options": "nosniff",
}


@cache
def page() -> str:
    return files("service.api").joinpath("status.html").read_text(encoding="utf-8")


@router.get(
    "/status",
    response_class=HTMLResponse,
    summary="Live status page (HTML; its data come from /status.json)",
    responses={200: {"content": {"text/html": {"schema": {"type": "string"}}},
                     "description": "a self-contained HTML page"}},
)
async def status_page(
    key: str | None = Query(None, description="an API key for the page's script (kept in the "
                            "tab, dropped from the address bar; the server never reads it)"),
) -> HTMLResponse:
    """Workers, queue, latency, errors and gradient norm histograms, refreshed every second.

    The page needs no key; the data it polls do: open ``/status?key=<API key>`` or enter the key
    when the page asks."""
    del key  # the page's script reads it from the address bar
    return HTMLResponse(page(), headers=PAGE_HEADERS)


@router.get(
    "/status.json",
    response_model=StatusView,
    summary="The status page's data",
    responses=errors(401, 403),
)
async def status_json(state: StateDep, scope: ScopeDep) -> dict[str, Any]:
    """Each worker (alive, device, jobs and samples done, samples/s, the batch in hand), the
    queue (depth, recent waits), per-route latency, requests and errors by model and code, and
    each model's recent per-sample gradient norm histogram. In Redis mode the workers are what
    each published with its last heartbeat.

    A tenant's key sees its own requests, errors and norms; an admin key every tenant's, or
    one tenant's with ``?tenant=``."""
    viewer = scope.asked if scope.caller.admin else scope.caller.name
    return await status_view(state, viewer)
