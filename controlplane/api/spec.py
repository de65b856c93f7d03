"""What the REST API's OpenAPI spec (``/openapi.json``) says beyond what FastAPI writes: who may call each
operation, and every error it may answer.

- ``x-access`` on every operation: its guard (``public``, ``viewer``, ``operator``, ``admin``,
  ``gateway``, ``gateway-or-viewer``), read from the route table the gate enforces
  (:func:`controlplane.api.gate.route_table`), so the spec cannot say something the gate does not do.
  The access matrix test sends every operation's request as every role and compares.
- The errors, in the OpenAI shape (``ErrorResponse``) in place of FastAPI's 422 (this API answers 400):
  400 when the operation takes any input, 401 when it needs a token, 403 when a valid token may still be
  too small, 404 for an id in its path, 409 for a mutation, 413 with a body, 503 when guarded (the store or
  a dependency may be down); a route declares others with ``responses=`` (the login's 429).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from controlplane.api.gate import route_table
from inference.spec import ErrorResponse  # the OpenAI error shape, as the replicas and the gateway answer

ACCESS_EXTENSION = "x-access"
ERRORS = {400: "the request is refused: a bad parameter or body (`param` names it)",
          401: "missing, unknown, revoked or expired bearer token",
          403: "the caller's role may not do this",
          404: "nothing has the id the request names",
          409: "the request contradicts the current state",
          413: "the request body is over the cap ([api] max_body_bytes)",
          429: "too many attempts; Retry-After says when to try again",
          503: "a dependency is down or busy; retry later (Retry-After when known)"}
_METHODS = ("get", "put", "post", "delete", "patch", "head", "options")


def document(app: FastAPI) -> None:
    """Complete ``app``'s spec (built once, at its first request) with access and errors."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:  # built and completed already
            return app.openapi_schema
        spec = build()  # FastAPI's, cached in app.openapi_schema and completed here
        schemas = spec.setdefault("components", {}).setdefault("schemas", {})
        error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(error_schema.pop("$defs", {}))
        schemas["ErrorResponse"] = error_schema
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        paths = spec.get("paths", {})
        for route in route_table(app.routes):
            for method in route.methods:
                operation = paths.get(route.path, {}).get(method.lower())
                if operation is not None and route.access is not None:
                    operation[ACCESS_EXTENSION] = route.access
        for item in paths.values():
            for method in _METHODS:
                if method in item:
                    _declare_errors(method, item[method])
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def _declare_errors(method: str, operation: dict[str, Any]) -> None:
    access = operation.get(ACCESS_EXTENSION)
    guarded = access is not None and access != "public"
    parameters = operation.get("parameters", [])
    statuses = {
        400: bool(parameters or "requestBody" in operation),
        401: guarded,
        403: access in ("operator", "admin", "gateway"),
        404: any(p.get("in") == "path" for p in parameters),
        409: method != "get",
        413: "requestBody" in operation,
        503: guarded,
    }
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    for status, wanted in statuses.items():
        if wanted:
            responses.setdefault(str(status), {"description": ERRORS[status]})
    for status, response in responses.items():
        if status.isdigit() and int(status) >= 400:
            response.setdefault("description", ERRORS.get(int(status), "error"))
            response["content"] = {"application/json": {
                "schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
