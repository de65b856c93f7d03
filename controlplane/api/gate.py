"""The REST API's front door: authentication first, then a body cap (a pure ASGI middleware).

Where it sits: in front of the FastAPI app that ``create_api`` builds, inside Starlette's server-error
middleware. For each request it finds the route FastAPI's router will pick and runs that route's guard
(``controlplane.auth.guard``: a role, a gateway's service token, or public) on the headers alone, so a
caller without a valid token, or with too small a role, gets its 401 or 403 before a byte of the body is
read; FastAPI would read and parse the body first. Then the body: a declared ``Content-Length`` over
``max_body_bytes`` is a 413 before reading, and a chunked body is counted as it is read and cut off with a
413 once over the cap. Both answers use the OpenAI error shape the whole API answers.

:func:`route_table` is the one list of routes with their guards: the gate matches requests against it,
and the spec publishes each operation's guard from it as ``x-access`` (``controlplane.api.spec``).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.dependencies.models import Dependant
from fastapi.responses import JSONResponse
from fastapi.routing import iter_route_contexts
from starlette.concurrency import run_in_threadpool
from starlette.routing import BaseRoute, compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.errors import error_response
from controlplane.api.guards import GUARDED_KEY, AuthError, access_of
from controlplane.errors import ControlPlaneError
from inference.protocol import error_body

logger = logging.getLogger(__name__)

class BodyTooLarge(HTTPException):
    """413 in the OpenAI error shape; raised while reading a body that grew over the cap (FastAPI passes
    an HTTPException from the body read through to the error handlers)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, detail=error_body(message, type_="invalid_request_error",
                                                code="request_too_large"))


@dataclass(frozen=True, slots=True)
class GuardedRoute:
    """One route as the gate sees it: its path template and methods, and its guard (None: it has none)."""

    path: str  # as the spec writes it: /api/v1/drills/{drill_id}
    methods: frozenset[str]
    pattern: re.Pattern[str]
    guard: Any | None

    @property
    def access(self) -> str | None:
        return access_of(self.guard)

    def matches(self, path: str, method: str) -> bool:
        return method in self.methods and self.pattern.match(path) is not None


def route_table(routes: Sequence[BaseRoute]) -> list[GuardedRoute]:
    """Every route the app serves (those included from routers too, with their full path), in the order
    the router tries them, with its guard."""
    table = []
    for context in iter_route_contexts(routes):
        path, methods = context.path, context.methods
        if path is None or not methods:
            continue
        pattern, spec_path, _ = compile_path(path)  # /{drill_id:int}: a pattern for digits, {drill_id}
        table.append(GuardedRoute(spec_path, frozenset(methods), pattern,
                                  _guard_of(getattr(context, "dependant", None))))
    return table


def _guard_of(dependant: Dependant | None) -> Any | None:
    pending = list(dependant.dependencies) if dependant is not None else []
    while pending:
        dependency = pending.pop()
        if access_of(dependency.call) is not None:
            return dependency.call
        pending.extend(dependency.dependencies)
    return None


class Gate:
    """Runs the matched route's guard on the headers, then lets at most ``max_body_bytes`` of body in."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._table: list[GuardedRoute] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = await self._guard(scope) or self._declared_size(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        await self._limited(scope, receive, send)

    async def _guard(self, scope: Scope) -> JSONResponse | None:
        table = self._routes(scope)
        path, method = scope["path"], scope["method"]
        route = next((r for r in table if r.matches(path, method)), None)
        if route is None:
            return _not_allowed(table, path)  # or None: the router answers 404 without reading the body
        if route.guard is None:
            return None
        request = Request({**scope, "route": route})  # the guard audits a refused mutation by its path
        try:  # a token lookup reads the store: off the event loop, as FastAPI runs the dependency
            principal = await run_in_threadpool(route.guard, request)
        except AuthError as exc:
            return JSONResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
        except ControlPlaneError as exc:  # the store could not be read: the one mapping answers
            return error_response(exc)
        scope[GUARDED_KEY] = (route.guard, principal)
        return None

    def _routes(self, scope: Scope) -> list[GuardedRoute]:
        app = scope.get("app")
        if not isinstance(app, FastAPI):
            return []
        if self._table is None:  # built at the first request: every router is included by then
            self._table = route_table(app.routes)
        return self._table

    def _declared_size(self, scope: Scope) -> JSONResponse | None:
        declared = _header(scope, b"content-length")
        if declared is None or not declared.isdigit() or int(declared) <= self.max_body_bytes:
            return None
        return _too_large(f"request body is {declared} bytes; the limit is {self.max_body_bytes}")

    async def _limited(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit, size, started = self.max_body_bytes, 0, False

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    raise BodyTooLarge(f"request body exceeds the limit of {limit} bytes")
            return message

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, tracked)
        except BodyTooLarge as exc:  # read outside a route's handlers; answered here when still possible
            if started:
                raise
            await JSONResponse(exc.detail, status_code=413)(scope, receive, send)


def _not_allowed(table: list[GuardedRoute], path: str) -> JSONResponse | None:
    """405 naming every method of the path in ``Allow`` (the router names only the first route's)."""
    allowed = sorted({m for r in table if r.pattern.match(path) for m in r.methods})
    if not allowed:
        return None
    return JSONResponse(error_body(f"method not allowed; {path} takes {', '.join(allowed)}",
                                   type_="invalid_request_error", code="method_not_allowed"),
                        status_code=405, headers={"Allow": ", ".join(allowed)})


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value).decode("latin-1").strip()
    return None


def _too_large(message: str) -> JSONResponse:
    return JSONResponse(BodyTooLarge(message).detail, status_code=413)
