"""Who may call a route of the REST API: the FastAPI side of :mod:`controlplane.auth`.

Each route declares its guard with ``Depends(require(Role.X))`` after ``install(app, authority, auditor)``
(or another :func:`guard`, such as the gateways' service tokens, or :func:`public`); the guard is the
route's one declaration of who may call it: the API's gate (:mod:`controlplane.api.gate`) runs it before a
byte of the body is read, and publishes it as the operation's ``x-access`` in the OpenAPI spec. Refusals
are 401 or 403 in the OpenAI error shape; a refused mutation is audited.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response

from controlplane.auth import SAFE_METHODS, Auditor, Principal, Role, TokenAuthority


class AuthError(HTTPException):
    """401 or 403 with an OpenAI-shaped body; ``install`` registers the handler that renders it."""

    def __init__(self, status_code: int, message: str, *, type_: str, code: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(status_code, detail=openai_error(message, type_=type_, code=code), headers=headers)


def openai_error(message: str, *, type_: str, param: str | None = None, code: str | None = None
                 ) -> dict[str, Any]:
    """The OpenAI error body, as the replicas and the gateway also answer."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def install(app: FastAPI, authority: TokenAuthority, auditor: Auditor | None = None) -> None:
    """Make ``require`` work on ``app``: the authority that checks tokens, the auditor that records
    refused mutations, and the handler that renders :class:`AuthError` in the OpenAI error shape."""
    app.state.token_authority = authority
    app.state.auditor = auditor
    app.add_exception_handler(AuthError, _render_auth_error)


def bearer_token(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


# ---- guards: who may call a route -------------------------------------------------------------
ACCESS = ("public", "viewer", "operator", "admin", "gateway", "gateway-or-viewer")
GUARDED_KEY = "controlplane.guarded"  # in the ASGI scope: (guard, principal) once the gate has run it
G = TypeVar("G", bound=Callable[[Request], Any])


def guard(access: str) -> Callable[[G], G]:
    """Mark a FastAPI dependency ``check(request)`` as a route's guard: who may call the route
    (``access``, one of :data:`ACCESS`). It returns the caller's :class:`Principal` (None on a public
    route) or raises :class:`AuthError`. The gate runs it before reading the body; when FastAPI calls it
    again as the route's dependency, the gate's answer is reused."""
    if access not in ACCESS:
        raise ValueError(f"access must be one of {', '.join(ACCESS)}, got {access!r}")

    def mark(check: G) -> G:
        def guarded(request: Request) -> Any:
            done = request.scope.get(GUARDED_KEY)
            if done is not None and done[0] is guarded:
                return done[1]
            return check(request)

        guarded.__name__ = getattr(check, "__name__", "guard")
        guarded.access = access  # type: ignore[attr-defined]
        return cast(G, guarded)

    return mark


def access_of(dependency: object) -> str | None:
    """The access a guard declares; None for any other callable."""
    access = getattr(dependency, "access", None)
    return access if access in ACCESS else None


@guard("public")
def public(request: Request) -> None:
    """The guard of a route anyone may call (``/health``, the login): ``dependencies=[Depends(public)]``."""
    return None


def require(role: Role) -> Callable[[Request], Principal]:
    """A FastAPI dependency: the caller's :class:`Principal`, or 401 (no valid token) / 403 (role too
    small). A refused mutation (any method but GET, HEAD, OPTIONS) is audited as "denied"."""

    def dependency(request: Request) -> Principal:
        authority: TokenAuthority | None = getattr(request.app.state, "token_authority", None)
        if authority is None:
            raise RuntimeError("controlplane.api.guards.install(app, authority) was not called for this app")
        principal = authority.verify(bearer_token(request))
        if principal is None:
            raise AuthError(401, "missing, unknown, revoked or expired bearer token",
                            type_="invalid_request_error", code="invalid_token",
                            headers={"WWW-Authenticate": "Bearer"})
        if not principal.may(role):
            _audit_denied(request, principal, role)
            raise AuthError(403, f"role {principal.role.value} may not do this: it needs {role.value}",
                            type_="permission_error", code="insufficient_role")
        return principal

    dependency.__name__ = f"require_{role.value}"
    return guard(role.value)(dependency)


def _audit_denied(request: Request, principal: Principal, needed: Role) -> None:
    auditor: Auditor | None = getattr(request.app.state, "auditor", None)
    if auditor is None or request.method in SAFE_METHODS:
        return
    route = request.scope.get("route")
    template = getattr(route, "path", request.url.path)
    auditor.record(principal, f"{request.method} {template}", request.url.path, {}, "denied",
                   detail=f"needs role {needed.value}")


def _render_auth_error(_: Request, exc: Exception) -> Response:
    assert isinstance(exc, AuthError)
    return JSONResponse(exc.detail, status_code=exc.status_code, headers=exc.headers)
