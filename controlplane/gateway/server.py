"""The gateway's HTTP surface: the OpenAI-compatible endpoints, ``/health`` and ``/metrics``.

``create_gateway_app`` builds it around a :class:`~controlplane.gateway.handler.Gateway`; its lifespan starts
and stops the gateway. The two inference endpoints bypass FastAPI's middleware (see :class:`GatewayApp`). """

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import Receive, Scope, Send

from controlplane.gateway.handler import Gateway
from inference.spec import document_openai


class GatewayApp(FastAPI):
    """The gateway's FastAPI app, with the two inference endpoints dispatched straight to the gateway
    past FastAPI's routing, error and exception middleware: every streamed chunk would otherwise pass
    through each of their ``send`` wrappers. The routes stay declared (OpenAPI, 405 for other
    methods), and the responses are the gateway's own, OpenAI-shaped errors included, either way."""

    gateway: Gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = INFERENCE_PATHS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is None or scope.get("method") != "POST":
            await super().__call__(scope, receive, send)
            return
        response = await self.gateway.handle(Request(scope, receive), kind)
        await response(scope, receive, send)


INFERENCE_PATHS = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def create_gateway_app(gateway: Gateway) -> FastAPI:
    """The gateway's HTTP surface; its lifespan starts and stops the gateway."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = GatewayApp(title="LLM gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.gateway = app.state.gateway = gateway

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gateway.handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await gateway.handle(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await gateway.models(request)

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse(gateway.health())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(gateway.metrics.page(), media_type=CONTENT_TYPE_LATEST)

    document_openai(app, ERRORS, models_errors={401: ERRORS[401]})
    return app


# What the inference endpoints may answer besides 200: the gateway's own refusals, and a replica's
# (passed through as the replica answered when no other replica could serve the request)
ERRORS = {400: "a bad body, parameter or x-priority header (`param` names it)",
          401: "missing or invalid API key",
          404: "no replica serves the model the request names",
          413: "the body is over gateway.max_body_bytes",
          429: "overloaded, or over this API key's rate limit; Retry-After says when to try again",
          500: "the replica's device failed during the request",
          503: "no replica could serve the request; Retry-After says when to try again"}
