"""One replica's HTTP server: OpenAI-compatible API, health, readiness, metrics, drain and fault hooks.

``python -m inference serve`` builds the engine, starts its loop thread (:class:`AsyncEngine`) and serves
this FastAPI app with uvicorn. Requests are checked in a fixed order before any stream starts: API key,
body size, JSON and parameters, draining, device failure, injected errors, prompt length, queue room; so
every refusal is a plain HTTP error in the OpenAI shape (:class:`~inference.http_errors.HTTPError`),
never an error frame inside a 200 stream. An admitted request's answer, streamed or not, is written by
:class:`~inference.response_writer.ResponseWriter`.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from inference.async_engine import AsyncEngine, EngineDeadError
from inference.engine import PromptTooLongError
from inference.faults import FaultSpec, ReplicaFaults, request_colour
from inference.http_errors import HTTPError
from inference.logprobs import TokenStrings
from inference.metrics import EngineGauges, ReplicaMetrics
from inference.protocol import LogprobsView, ParsedRequest, ResponseContext, parse_chat, parse_completion
from inference.response_writer import ResponseWriter
from inference.sampling_params import InvalidParameterError, SamplingParams
from inference.spec import document_openai
from inference.strict_json import BadJson, parse_strict

if TYPE_CHECKING:  # the SDK is imported only when traces are exported (inference.replica)
    from inference.tracing import ReplicaTracing

logger = logging.getLogger(__name__)

READY_PRIORITY = -(2**31)  # readiness probes jump the queue
# What /v1/completions and /v1/chat/completions may answer besides 200, in the order they are checked
ERRORS = {400: "a bad body or parameter (`param` names it), or a prompt longer than the context",
          401: "missing or invalid API key (--api-key)",
          404: "the request names a model this replica does not serve",
          413: "the body is over --max-body-bytes",
          429: "the queue is full; Retry-After says when to try again",
          500: "the device failed during the request (a device failure, or an injected fault)",
          503: "the replica is draining, its engine is dead, or its device failed"}


@dataclass(slots=True)
class ServerConfig:
    replica_id: str = "replica-0"
    zone: str = "local"
    host: str = "127.0.0.1"
    port: int = 8101
    served_model_name: str = ""
    api_key: str | None = None
    admin_token: str | None = None
    max_waiting_requests: int = 128
    max_waiting_tokens: int = 65536
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    ready_deadline_s: float = 5.0
    stall_seconds: float = 10.0
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_waiting_tokens", "max_body_bytes", "retry_after_s"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)!r}")
        for name in ("drain_timeout_s", "ready_deadline_s", "stall_seconds"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")


@dataclass
class Replica:
    """Everything the handlers share."""

    engine: AsyncEngine
    config: ServerConfig
    faults: ReplicaFaults
    metrics: ReplicaMetrics
    model_name: str
    draining: bool = False
    started_at: float = field(default_factory=time.time)
    device_kind: str = "cpu"
    tracing: ReplicaTracing | None = None  # OpenTelemetry spans (--otlp-traces-endpoint); None: off

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @functools.cached_property
    def token_strings(self) -> TokenStrings:
        """Token id -> its string in ``logprobs``, cached for the replica's life."""
        return TokenStrings(self.engine.engine.tokenizer.token_bytes)

    async def drain(self) -> int:
        """Refuse new work, let in-flight requests finish within the timeout; return how many were cut."""
        self.draining = True
        deadline = time.monotonic() + self.config.drain_timeout_s
        logger.warning("[%s] draining: %d requests in flight", self.config.replica_id,
                       self.engine.num_in_flight)
        while self.engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        aborted = self.engine.num_in_flight
        self.engine.stop()
        logger.warning("[%s] drained: %d requests aborted at the %.0fs timeout", self.config.replica_id,
                       aborted, self.config.drain_timeout_s)
        return aborted


def engine_gauges(aengine: AsyncEngine, device: Any) -> Callable[[], EngineGauges]:
    def read() -> EngineGauges:
        engine = aengine.engine
        stats = engine.block_manager.stats
        memory = device.memory_stats()
        return EngineGauges(
            num_running=engine.scheduler.num_running, num_waiting=aengine.num_queued,
            kv_cache_usage=engine.block_manager.usage, prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits, num_preemptions=engine.scheduler.num_preemptions,
            device_memory_used=memory.used_bytes, device_memory_total=memory.total_bytes,
            device_utilization=device.utilization(), kv_blocks_in_use=engine.block_manager.num_blocks_in_use,
            expert_tokens=engine.model.expert_tokens())
    return read


# ---- the app ---------------------------------------------------------------------------------
def create_app(replica: Replica) -> FastAPI:
    app = FastAPI(title=f"inference replica {replica.config.replica_id}", docs_url=None, redoc_url=None)
    app.add_middleware(_ReplicaHeaderMiddleware, replica=replica)  # type: ignore[arg-type]
    app.state.replica = replica

    @app.exception_handler(HTTPError)
    async def _http_error(_: Request, exc: HTTPError) -> JSONResponse:
        return exc.response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _read_json(request, replica)
        return await _serve(request, replica, _parsed(lambda: parse_completion(body)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _read_json(request, replica)
        render = replica.tokenizer.apply_chat_template
        return await _serve(request, replica, _parsed(lambda: parse_chat(body, render)))

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        _check_api_key(request, replica)
        engine = replica.engine.engine
        return JSONResponse({"object": "list", "data": [{
            "id": replica.model_name, "object": "model", "created": int(replica.started_at),
            "owned_by": "llm-sre", "root": str(engine.model_path), "max_model_len": engine.max_model_len}]})

    @app.get("/health")
    async def health() -> JSONResponse:
        problem = _liveness_problem(replica)
        if problem:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ok", "replica": replica.config.replica_id})

    @app.get("/ready")
    async def ready() -> JSONResponse:
        problem = await _readiness_problem(replica)
        if problem:
            return JSONResponse({"status": "not ready", "reason": problem}, status_code=503)
        return JSONResponse({"status": "ready", "replica": replica.config.replica_id,
                             "zone": replica.config.zone})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(replica.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    _admin_routes(app, replica)
    document_openai(app, ERRORS, models_errors={401: ERRORS[401]})
    return app


def _admin_routes(app: FastAPI, replica: Replica) -> None:
    @app.get("/admin/faults")
    async def list_faults(request: Request) -> JSONResponse:
        _check_admin(request, replica)
        now = replica.faults.clock()
        return JSONResponse({"faults": [f.to_json(now) for f in replica.faults.active()]})

    @app.put("/admin/faults")
    async def add_fault(request: Request) -> JSONResponse:
        _check_admin(request, replica)
        body = await _read_json(request, replica)
        try:
            spec = FaultSpec.from_json(body)
        except ValueError as exc:
            param = str(exc).split(":", 1)[0]
            raise HTTPError(400, str(exc), type_="invalid_request_error", param=param) from exc
        fault = replica.faults.add(spec)
        return JSONResponse(fault.to_json(replica.faults.clock()), status_code=201)

    @app.delete("/admin/faults")
    async def clear_faults(request: Request) -> JSONResponse:
        _check_admin(request, replica)
        return JSONResponse({"removed": replica.faults.clear()})

    @app.delete("/admin/faults/{fault_id}")
    async def remove_fault(fault_id: str, request: Request) -> JSONResponse:
        _check_admin(request, replica)
        if not replica.faults.remove(fault_id):
            raise HTTPError(404, f"no active fault {fault_id!r}", type_="not_found_error", param="fault_id")
        return JSONResponse({"removed": 1})


# ---- checks ----------------------------------------------------------------------------------
def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


def _is_bearer(request: Request, expected: str) -> bool:
    """Whether the request carries ``expected`` as its bearer token, in constant time. Compared as bytes:
    header values arrive decoded as latin-1 and may hold any byte, which ``compare_digest`` refuses in a
    str (a non-ASCII token must be a 401, not a 500)."""
    given = _bearer(request)
    if given is None:
        return False
    return hmac.compare_digest(given.encode("latin-1", errors="replace"), expected.encode("utf-8"))


def _check_api_key(request: Request, replica: Replica) -> None:
    expected = replica.config.api_key
    if expected is None:
        return
    if not _is_bearer(request, expected):
        replica.metrics.observe_rejected("unauthorized")
        raise HTTPError(401, "missing or invalid API key", type_="invalid_request_error",
                        code="invalid_api_key")


def _check_admin(request: Request, replica: Replica) -> None:
    expected = replica.config.admin_token
    if expected is None:
        raise HTTPError(403, "fault hooks are disabled: the replica was started without --admin-token",
                        type_="permission_error")
    if not _is_bearer(request, expected):
        raise HTTPError(401, "missing or invalid admin token", type_="invalid_request_error",
                        code="invalid_admin_token")


async def _read_json(request: Request, replica: Replica) -> Any:
    if request.url.path.startswith("/v1/"):
        _check_api_key(request, replica)
    limit = replica.config.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        replica.metrics.observe_rejected("body_too_large")
        raise HTTPError(413, f"request body is {declared} bytes; the limit is {limit}",
                        type_="invalid_request_error", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            replica.metrics.observe_rejected("body_too_large")
            raise HTTPError(413, f"request body exceeds the limit of {limit} bytes",
                            type_="invalid_request_error", code="request_too_large")
        chunks.append(chunk)
    return _parse_json(b"".join(chunks))


def _parse_json(raw: bytes) -> Any:
    """Strict JSON (:func:`inference.strict_json.parse_strict`); what is wrong with it is a 400."""
    try:
        return parse_strict(raw)
    except BadJson as exc:
        raise _bad_body(str(exc)) from exc


def _bad_body(message: str) -> HTTPError:
    return HTTPError(400, message, type_="invalid_request_error", param="body")


def _parsed(parse: Callable[[], ParsedRequest]) -> ParsedRequest:
    try:
        return parse()
    except InvalidParameterError as exc:
        raise HTTPError(400, str(exc), type_="invalid_request_error", param=exc.param) from exc


def _admit(replica: Replica, parsed: ParsedRequest, colour: str | None) -> list[int]:
    """Every refusal that must happen before a stream starts; returns the prompt's token ids."""
    rid = replica.config.replica_id
    if parsed.model is not None and parsed.model != replica.model_name:
        raise HTTPError(404, f"model {parsed.model!r} does not exist; this replica serves "
                             f"{replica.model_name!r}", type_="invalid_request_error", param="model",
                        code="model_not_found")
    if replica.draining:
        replica.metrics.observe_rejected("draining")
        raise HTTPError(503, f"replica {rid} is draining", type_="service_unavailable", code="draining")
    if replica.faults.device_failed() or not replica.engine.is_alive:
        replica.metrics.observe_rejected("device_failure")
        raise HTTPError(503, f"replica {rid} has a device failure", type_="service_unavailable",
                        code="device_failure")
    injected = replica.faults.injected_error(colour)
    if injected is not None:
        replica.metrics.observe_rejected("injected_error")
        raise HTTPError(injected, f"injected fault on replica {rid}", type_="server_error",
                        code="injected_fault")
    tokens = _tokens(replica, parsed)
    _check_queue_room(replica, len(tokens))
    return tokens


def _tokens(replica: Replica, parsed: ParsedRequest) -> list[int]:
    engine = replica.engine.engine
    if isinstance(parsed.prompt, str):
        tokens = engine.tokenizer.encode(parsed.prompt, add_special_tokens=parsed.kind != "chat")
    else:
        tokens = parsed.prompt
    try:
        engine.validate_prompt(tokens)
    except InvalidParameterError as exc:
        too_long = isinstance(exc, PromptTooLongError)  # not an empty prompt or an unknown token id
        replica.metrics.observe_rejected("prompt_too_long" if too_long else "invalid")
        raise HTTPError(400, str(exc), type_="invalid_request_error", param=exc.param,
                        code="context_length_exceeded" if too_long else None) from exc
    return tokens


def _check_queue_room(replica: Replica, num_tokens: int) -> None:
    cfg = replica.config
    queued = replica.engine.num_queued
    queued_tokens = replica.engine.engine.scheduler.num_waiting_tokens
    if queued >= cfg.max_waiting_requests or queued_tokens + num_tokens > cfg.max_waiting_tokens:
        reason = "queue_full" if queued >= cfg.max_waiting_requests else "queue_tokens_full"
        replica.metrics.observe_rejected(reason)
        raise HTTPError(429, f"replica {cfg.replica_id} is overloaded ({queued} requests, {queued_tokens} "
                             "tokens waiting); retry later", type_="rate_limit_error", code=reason,
                        headers={"Retry-After": str(cfg.retry_after_s)})


def _liveness_problem(replica: Replica) -> str | None:
    engine = replica.engine
    if not engine.is_alive:
        return f"engine loop is not running ({engine.error or 'stopped'})"
    if replica.faults.device_failed():
        return "device failure"
    stalled = engine.seconds_since_progress()
    if engine.num_in_flight and stalled > replica.config.stall_seconds:
        return f"engine made no progress for {stalled:.1f}s with {engine.num_in_flight} requests pending"
    return None


async def _readiness_problem(replica: Replica) -> str | None:
    if replica.draining:
        return "draining"
    problem = _liveness_problem(replica)
    if problem:
        return problem
    probe = [replica.tokenizer.bos_token_id or 0]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    gen = replica.engine.generate(f"ready-{uuid.uuid4().hex}", probe, params, priority=READY_PRIORITY)
    try:
        async with asyncio.timeout(replica.config.ready_deadline_s):
            async for out in gen:
                if out.error:
                    return out.error
    except TimeoutError:
        return f"a one-token forward pass took longer than {replica.config.ready_deadline_s:g}s"
    except EngineDeadError as exc:
        return str(exc)
    finally:
        await gen.aclose()
    return None


# ---- generation ------------------------------------------------------------------------------
async def _serve(request: Request, replica: Replica, parsed: ParsedRequest) -> Response:
    colour = request_colour(request.headers)
    tokens = _admit(replica, parsed, colour)
    ctx = ResponseContext.new(parsed.kind, replica.model_name)
    writer = ResponseWriter(replica.metrics, replica.config.replica_id, replica.config.zone, ctx, parsed,
                            LogprobsView(ctx, replica.token_strings),
                            delays=replica.faults.request_delays(colour))
    if replica.tracing is not None:
        writer.trace = replica.tracing.begin(request.headers, parsed, ctx)
    # A stream sends each token's logprobs as it goes: only a non-streamed answer needs them all at the end.
    stream = replica.engine.generate(ctx.request_id, tokens, parsed.params, priority=parsed.priority,
                                     keep_logprobs=not parsed.stream)
    if parsed.stream:
        chunks = writer.sse(stream) if writer.trace is None else writer.trace.wrap(writer.sse(stream))
        return StreamingResponse(chunks, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    task = asyncio.ensure_future(writer.collect(stream))
    while not task.done():
        await asyncio.wait({task}, timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()  # closes the stream, which aborts the request in the engine
            replica.metrics.observe_rejected("client_disconnected")
            return Response(status_code=499)
    return task.result()


# ---- middleware ------------------------------------------------------------------------------
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _ReplicaHeaderMiddleware:
    """Adds ``x-replica-id`` to every response and counts responses by path and status."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], replica: Replica) -> None:
        self.app = app
        self.replica = replica
        self.header = (b"x-replica-id", replica.config.replica_id.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_header(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
                self.replica.metrics.observe_http(_path_label(scope["path"]), message["status"])
            await send(message)

        await self.app(scope, receive, send_with_header)


def _path_label(path: str) -> str:
    known = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/ready", "/metrics")
    if path in known:
        return path
    return "/admin/faults" if path.startswith("/admin/faults") else "other"


def crash_now() -> None:
    """The crash fault: end the process the way a segfault or OOM kill would, without cleanup."""
    logger.critical("crash fault: exiting at once")
    loop = asyncio.get_event_loop()
    loop.call_later(0.05, os.kill, os.getpid(), signal.SIGKILL)
