"""``/docs`` served with local Swagger UI assets (a GPU host may have no internet)."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from psgrad._wire import JSON, SAFETENSORS

log = logging.getLogger("psgrad.api")
ASSETS = "/docs-assets"


def install_docs(app: FastAPI) -> None:
    try:
        from swagger_ui_bundle import swagger_ui_path  # type: ignore[import-untyped,unused-ignore]
    except ImportError:  # pragma: no cover - the server extra installs it
        log.warning("swagger-ui-bundle-v2 is not installed: /docs loads Swagger UI from a CDN")
        swagger_ui_path = None
    if swagger_ui_path is not None:
        app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")
    kwargs: dict[str, Any] = {}
    if swagger_ui_path is not None:
        kwargs = {
            "swagger_js_url": f"{ASSETS}/swagger-ui-bundle.js",
            "swagger_css_url": f"{ASSETS}/swagger-ui.css",
            "swagger_favicon_url": f"{ASSETS}/favicon-32x32.png",
        }

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json", title=f"{app.title} - docs", **kwargs
        )


def schema_ref(model: type[BaseModel]) -> dict[str, str]:
    """A ``$ref`` to ``model`` for ``openapi_extra``; :func:`install_openapi` adds the schema."""
    _EXTRA[model.__name__] = model
    return {"$ref": f"#/components/schemas/{model.__name__}"}


_EXTRA: dict[str, type[BaseModel]] = {}


def request_body(model: type[BaseModel], description: str, binary: bool = True
                 ) -> dict[str, Any]:
    """``openapi_extra`` for a route that reads its body itself: JSON of ``model``, and with
    ``binary`` the same fields as a safetensors file (its tensors as tensors, the rest as JSON
    in the metadata key 'request')."""
    content: dict[str, Any] = {JSON: {"schema": schema_ref(model)}}
    if binary:
        content[SAFETENSORS] = {"schema": {"type": "string", "format": "binary"}}
    return {"requestBody": {"required": True, "description": description, "content": content}}


# The headers of every answer (errors.CatchAllMiddleware sets them), stated on every response.
EVERY_ANSWER_HEADERS = {
    "psgrad-version": "The server's psgrad version, e.g. 0.2.0 (the client warns when it is "
                      "older than the client)",
    "X-Request-ID": "The request's id (the client's own X-Request-ID when it sent a plain one); "
                    "the server's log names it with any unexpected error",
}


def install_openapi(app: FastAPI) -> None:
    """The generated document plus the request models that routes only name in openapi_extra,
    and the headers every answer carries."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title, version=app.version, description=app.description, routes=app.routes
            )
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            for name, model in _EXTRA.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                for sub, sub_schema in schema.pop("$defs", {}).items():
                    schemas.setdefault(sub, sub_schema)
                schemas[name] = schema
            _state_common_errors(doc)
            _state_every_answers_headers(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


# What a route may answer beyond the statuses it lists itself, stated on each operation it
# applies to: 422 on every route, 413 where there is a body, 503 where a key is needed (every
# such route reads the broker's or Redis's state), 429 where jobs are queued (tenant quotas).
COMMON_ERRORS = {
    422: "an unknown query parameter (a route takes only those it declares; the message names "
         "them), or a request that cannot be computed",
    413: "the body is larger than the server takes (PSGRAD_MAX_BODY_BYTES; the message says)",
    429: "a tenant quota is reached (the message names it): retry after the Retry-After header",
    503: "queue full or broker down: retry after the Retry-After header",
}


def _state_common_errors(doc: dict[str, Any]) -> None:
    error = {"content": {"application/json": {
        "schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            responses = operation.setdefault("responses", {})
            codes = {422}
            if "requestBody" in operation:
                codes.add(413)
            if "503" in responses and "requestBody" in operation:  # those that queue jobs
                codes.add(429)
            if "401" in responses:
                codes.add(503)
            for code in sorted(codes):
                responses.setdefault(str(code), {"description": COMMON_ERRORS[code], **error})


def _state_every_answers_headers(doc: dict[str, Any]) -> None:
    doc["components"]["headers"] = {
        name: {"description": text, "required": True, "schema": {"type": "string"}}
        for name, text in EVERY_ANSWER_HEADERS.items()}
    refs = {name: {"$ref": f"#/components/headers/{name}"} for name in EVERY_ANSWER_HEADERS}
    for item in doc.get("paths", {}).values():
        for operation in item.values():
            for response in operation.get("responses", {}).values():
                response.setdefault("headers", {}).update(refs)
