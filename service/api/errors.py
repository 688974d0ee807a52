"""One place where errors become the JSON error body; no traceback ever reaches a client.

:class:`psgrad.PsgradError` carries its code and status; FastAPI's validation errors and
Starlette's HTTP errors (unknown route, wrong method) are mapped to the same body; anything
unexpected is logged here and answered as ``internal_error`` by :class:`CatchAllMiddleware`.
"""

from __future__ import annotations

import json
import logging
import math
import re
import uuid
from collections.abc import Collection, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from psgrad._contract import shown
from psgrad._errors import (
    BadRequest,
    InvalidInput,
    Overloaded,
    PsgradError,
    Unauthorized,
    UnsupportedMediaType,
)
from psgrad._version import VERSION_HEADER, __version__
from psgrad._wire import JSON, media_type
from service.broker.redis.common import RETRY_AFTER_DOWN_S, redis_unavailable

log = logging.getLogger("psgrad.api")

_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    413: "too_large",
    415: "unsupported_media_type",
}


def error_response(exc: PsgradError) -> JSONResponse:
    headers: dict[str, str] = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    if isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(jsonable_encoder(exc.to_dict()), status_code=exc.status, headers=headers)


def body(code: str, message: str, **details: Any) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "details": details}}


OIP_PREFIX = "/v2/"  # the Open Inference Protocol's routes: errors are {"error": "<message>"}


def _shaped(request: Request, response: JSONResponse) -> JSONResponse:
    """``response`` in the Open Inference Protocol's error shape on its routes (the message
    only, the status and headers kept), as it is elsewhere."""
    if not (request.url.path + "/").startswith(OIP_PREFIX):
        return response
    message = json.loads(bytes(response.body))["error"]["message"]
    headers = {k: v for k, v in response.headers.items()
               if k.lower() not in ("content-length", "content-type")}
    return JSONResponse({"error": message}, status_code=response.status_code, headers=headers)


async def _psgrad(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, PsgradError)
    return _shaped(request, error_response(exc))


# A schema's refusals that mean the body cannot be read as sent (400), not a value out of its
# range or choices (422): the request contract's rule (psgrad._contract.Field.check)
_UNREADABLE = frozenset({"missing", "extra_forbidden", "json_invalid", "int_from_float"})


def schema_refusal(errors: Sequence[Any], known: Collection[str] = (),
                   what: str = "the request") -> BadRequest:
    """A body its schema refused (pydantic's ``errors``, their ``loc`` within the body), in the
    contract's words and status: 400 when a field is missing, unknown or of the wrong type or
    the body is no JSON object, else 422 (a value out of its range or choices). Names the
    first five fields, each with what was sent; ``known``: the body's fields, for a typo."""
    problems, unreadable = [], False
    for e in errors:
        kind, loc = str(e.get("type", "")), [str(x) for x in e.get("loc", ())]
        name = ".".join(loc)
        # pydantic's "Input should be ...", "String should have ...": the field is named before
        said = re.sub(r"^(Input|String|List|Dictionary|Tuple|Set) should", "should",
                      str(e.get("msg", "")))
        unreadable |= kind in _UNREADABLE or kind.endswith(("_type", "_parsing")) or not loc
        if kind == "json_invalid":
            problems.append(f"the body is not valid JSON: {e.get('ctx', {}).get('error', said)}")
        elif not loc:
            problems.append("the body must be a JSON object")
        elif kind == "missing":
            problems.append(f"'{name}' is required")
        elif kind == "extra_forbidden":
            problems.append(f"'{name}' is not a field of this body" + (
                f" (it takes {', '.join(sorted(known))})" if known else ""))
        else:
            problems.append(f"'{name}' {said}; got {shown(e.get('input'))}")
    error = BadRequest if unreadable else InvalidInput
    return error(f"{what} is invalid: {'; '.join(problems[:5])}", errors=[
        {"loc": list(e.get("loc", ())), "msg": str(e.get("msg", ""))} for e in errors])


def unsupported_type(ctype: str, accepted: list[str]) -> UnsupportedMediaType:
    """The 415 of a body in a media type (``ctype``, without parameters) the route does not
    read, naming the ones it does."""
    return UnsupportedMediaType(f"unsupported Content-Type {ctype or '(none)'!r}: send "
                                f"{' or '.join(accepted)}", content_type=ctype, accepted=accepted)


async def _validation(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's refusal of a route's parameters in :func:`schema_refusal`'s words and status,
    a body's, a query's or a path's alike (an unknown query parameter such as ``?tennant=`` is
    refused before: :mod:`service.api.deps`)."""
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    places = {tuple(e.get("loc", ()))[:1] for e in errors}
    known: list[str] = []
    if places == {("body",)}:
        ctype = media_type(request.headers.get("content-type"))
        if ctype != JSON and not ctype.endswith("+json"):  # all FastAPI reads as JSON
            return _shaped(request, error_response(unsupported_type(ctype, [JSON])))
        field = getattr(request.scope.get("route"), "body_field", None)
        schema = getattr(getattr(field, "field_info", None), "annotation", None)
        known = list(schema.model_fields) if isinstance(schema, type) and issubclass(
            schema, BaseModel) else []
    place = places.pop() if len(places) == 1 else ()
    what = {("query",): "the query", ("path",): "the path", ("header",): "a header"}.get(
        place, "the request")
    inside = [{**e, "loc": tuple(e.get("loc", ()))[1:]} for e in errors]
    return _shaped(request, error_response(schema_refusal(inside, known, what)))


async def _http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "error")
    headers = dict(getattr(exc, "headers", None) or {})
    if exc.status_code == 405:
        headers["Allow"] = ", ".join(_allowed(request))
    return _shaped(request, JSONResponse(body(code, str(exc.detail)), status_code=exc.status_code,
                                         headers=headers))


def _allowed(request: Request) -> list[str]:
    """Every method of every route at this path: Starlette names only the first route's."""
    methods: set[str] = set()
    for route in request.app.router.routes:
        match, _ = route.matches(request.scope)
        if match is not Match.NONE:
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


async def _redis(_request: Request, exc: Exception) -> JSONResponse:
    """A store in Redis (DP runs, models, reference sets) that cannot answer now: 503 with
    Retry-After, as the queue's own calls answer; any other Redis error is a bug (500)."""
    if not redis_unavailable(exc):
        raise exc
    # what Redis said (its address among it) is the operator's, in the log; the client is told
    # the kind of failure only
    log.warning("a store (Redis) is unavailable: %s: %s", type(exc).__name__, exc)
    return error_response(Overloaded(
        f"a store (Redis) is unavailable ({type(exc).__name__}); retry shortly",
        retry_after=RETRY_AFTER_DOWN_S))


def install(app: FastAPI) -> None:
    app.add_exception_handler(PsgradError, _psgrad)
    app.add_exception_handler(RedisError, _redis)
    app.add_exception_handler(RequestValidationError, _validation)
    app.add_exception_handler(StarletteHTTPException, _http)


REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id(scope: Scope) -> str:
    """The client's ``X-Request-ID`` when it sent a plain one (ids, dots, dashes), else new."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id":
            sent = value.decode("latin-1")
            if REQUEST_ID.fullmatch(sent):
                return sent
    return uuid.uuid4().hex


_VERSION = (VERSION_HEADER.encode(), __version__.encode())


class CatchAllMiddleware:
    """Gives every request an id, answered in ``X-Request-ID`` (the client's own, if it sent
    one) and logged with any unexpected exception, which it answers with ``internal_error``
    (the traceback stays in the log, the id ties the two together); a client that left before
    its body was read is logged as such and counted as 499, not 500. Every answer also names
    the server's version in ``psgrad-version`` (the client warns when it is older)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = request_id(scope)
        started = False

        async def tagged_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = [h for h in message.get("headers", []) if h[0] != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", rid.encode()),
                                                  _VERSION]}
            await send(message)

        try:
            await self.app(scope, receive, tagged_send)
        except ClientDisconnect:  # its client left before its body was read: not a failure
            log.info("the client of %s %s left before its body was read (request %s)",
                     scope.get("method"), scope.get("path"), rid)
            if not started:  # nobody reads it; the metrics count it as nginx's 499
                await JSONResponse(body("client_closed", "the client closed the request"),
                                   status_code=499)(scope, receive, tagged_send)
        except Exception:
            method, path = scope.get("method"), scope.get("path")
            log.exception("unexpected error on %s %s (request %s)", method, path, rid)
            if started:
                raise
            response = JSONResponse(
                body(
                    "internal_error",
                    f"the server failed unexpectedly; the error is logged on the server with "
                    f"request id {rid}",
                ),
                status_code=500,
            )
            await response(scope, receive, tagged_send)
