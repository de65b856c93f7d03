"""The one place where errors become HTTP answers: the kinds of ``controlplane.errors`` and of
``chaos.errors`` mapped to a status, in the OpenAI error shape the whole API answers
(``{"error": {"message", "type", "param", "code"}}``).

The app factory calls :func:`install_error_handlers`; routers raise a kind (or a module error that derives
from one) and never build an error response themselves. An error of no kind is the control plane's own
failure: 500 ``server_error``, logged with its traceback.
"""

from __future__ import annotations

import logging
import math
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from chaos import errors as chaos_errors
from controlplane import errors
from inference.protocol import error_body  # the OpenAI error shape, as the replicas and the gateway answer

logger = logging.getLogger(__name__)

# (kind, HTTP status, OpenAI error type); the first match wins
STATUS: tuple[tuple[type[Exception], int, str], ...] = (
    (errors.Refused, 400, "invalid_request_error"),
    (chaos_errors.Refused, 400, "invalid_request_error"),
    (errors.Forbidden, 403, "permission_error"),
    (chaos_errors.Forbidden, 403, "permission_error"),
    (errors.NotFound, 404, "not_found_error"),
    (chaos_errors.NotFound, 404, "not_found_error"),
    (errors.Conflict, 409, "conflict"),
    (chaos_errors.Conflict, 409, "conflict"),
    (errors.Unavailable, 503, "service_unavailable"),
    (chaos_errors.Unavailable, 503, "service_unavailable"),
    (errors.RateLimited, 429, "rate_limit_error"),
)
# Starlette's own refusals (no route: 404, a method the route lacks: 405, a body over the cap: 413), in
# the same shape
HTTP_TYPES = {401: "invalid_request_error", 403: "permission_error", 404: "not_found_error",
              413: "invalid_request_error", 429: "rate_limit_error"}
FAILED = (500, "server_error")
_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_.]*): ")  # "load.trace: no trace file ..." names load.trace


def status_of(exc: Exception) -> tuple[int, str]:
    """The HTTP status and OpenAI error type of an error of the tree (500 for one of no kind)."""
    for kind, status, type_ in STATUS:
        if isinstance(exc, kind):
            return status, type_
    return FAILED


def field_of(message: str) -> str | None:
    """The request field a refusal's message starts with (``"load.trace: ..."``), for its ``param``."""
    named = _FIELD.match(message)
    return named.group(1) if named else None


def error_response(exc: errors.ControlPlaneError | chaos_errors.ChaosError) -> JSONResponse:
    """The answer to an error of either tree; 503s and 429s say when to retry where the error knows."""
    status, type_ = status_of(exc)
    headers = {}
    retry_after = getattr(exc, "retry_after_s", None)
    if status in (429, 503) and retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return JSONResponse(error_body(exc.message, type_=type_, param=exc.param), status_code=status,
                        headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    """Render both error trees, request validation errors (400 naming the first bad field) and Starlette's
    own HTTP errors (unknown path, wrong method, a body over the cap)."""
    app.add_exception_handler(errors.ControlPlaneError, _render)
    app.add_exception_handler(chaos_errors.ChaosError, _render)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(HTTPException, _http)


async def _render(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, errors.ControlPlaneError | chaos_errors.ChaosError)
    if status_of(exc) == FAILED:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    return error_response(exc)


async def _http(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code in (204, 304) or exc.status_code < 400:
        return Response(status_code=exc.status_code, headers=exc.headers)
    body = exc.detail if _is_error_body(exc.detail) else error_body(
        str(exc.detail), type_=HTTP_TYPES.get(exc.status_code, "invalid_request_error"))
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def _is_error_body(detail: object) -> bool:
    return isinstance(detail, dict) and isinstance(detail.get("error"), dict)


async def _invalid(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
    message = f"{param or first.get('loc', ('body',))[0]}: {first.get('msg')}"
    return JSONResponse(error_body(message, type_="invalid_request_error", param=param), status_code=400)
