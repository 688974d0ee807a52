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


def install_openapi(app: FastAPI) -> None:
    """The generated document plus the request models that routes only name in openapi_extra."""

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
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
