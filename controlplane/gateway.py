"""The gateway: the OpenAI-compatible entry point that clients call, routing every request to a replica.

client -> :meth:`Gateway.handle`: authenticate, parse, admit (load shedding, per-key rate limits), route
(:mod:`controlplane.routing`), open a stream on a replica (retried on another replica before the first
byte), relay its chunks -> client; when the stream breaks mid-way (connection reset, error frame, stall),
resume on another replica from the tokens already delivered -> one :class:`TraceRecord` per request.

Every upstream request is a stream with ``return_token_ids`` and usage, whatever the client asked, so any
request can be resumed: the continuation is a ``/v1/completions`` request whose prompt is the original
prompt's token ids plus the tokens already delivered, with ``output_offset`` so that seeded sampling goes
on where it stopped; chunks of a continuation of a chat request are translated back into chat chunks.
With greedy or seeded sampling the client's stream equals an undisturbed run, text included: a
continuation starts at the last token whose text the replica had released (its detokenizer and stop-string
hold-back keep a few characters back), and the gateway drops what it regenerates up to the point already
delivered. Non-streaming requests run as streams too and are assembled at the end.

HTTP and httpx failures become an :class:`UpstreamError` in one place (:meth:`Gateway._send` and
:class:`_Upstream`); what a client is refused with is a :class:`GatewayError` in the OpenAI error shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from inference.protocol import COMPLETION_DEFAULT_MAX_TOKENS, error_body

from .config import GatewayConfig
from .replicas import ReplicaEndpoint, ReplicaLoad
from .routing import Candidate, Router, prompt_block_hashes, routable
from .traces import TraceRecord

logger = logging.getLogger(__name__)

PRIORITY_HEADER = "x-priority"
REPLICA_HEADER = "x-replica-id"
PRIORITIES = {"interactive": 0, "standard": 1, "batch": 2}  # header class -> the replica's priority field
DEFAULT_PRIORITY = "standard"
# Share of max_inflight_per_replica at which a class is shed: batch first, interactive last.
SHED_FRACTIONS = {"interactive": 1.0, "standard": 0.9, "batch": 0.5}
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}
# Fields a continuation carries over from the original request (besides prompt, limits and offsets).
CARRIED_FIELDS = ("model", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")
STAGES = ("queue", "prefill", "decode", "detokenize", "serialize")  # the replica's timings, in order

RETRY_BUDGET_WINDOW_S = 10.0  # "recent requests" for the retry budget
RETRY_BUDGET_MIN_RETRIES = 3  # retries always allowed per window, so a quiet gateway can still retry
MAX_RESUMES = 3  # mid-stream continuations per request
PROBE_TIMEOUT_S = 5.0  # an ejected replica's /ready must answer within this (it runs a forward pass)
MODELS_TIMEOUT_S = 5.0
CHARS_PER_TOKEN = 4  # prompt-size estimate for token rate limits (the gateway has no tokenizer)
CHAT_MAX_TOKENS_ESTIMATE = 256  # a chat request without max_tokens, for the token rate limit
MAX_CONNECTIONS = 1024  # one per upstream stream; the replicas' queues are the real limit
MAX_KEEPALIVE_CONNECTIONS = 256
KEY_ID_CHARS = 12  # sha256 hex prefix that stands for an API key in traces
RATE_LIMIT_BURST_S = 1.0  # a bucket holds this many seconds of its rate

Clock = Callable[[], float]
EventSink = Callable[[str, str, str], None]  # (kind, replica_id, detail)


# ---- errors ----------------------------------------------------------------------------------
class GatewayError(Exception):
    """A refusal the client gets as an OpenAI-shaped error (or as an error frame mid-stream)."""

    def __init__(self, status: int, message: str, *, type_: str, code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None,
                 body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = dict(headers or {})
        self.body = body or error_body(message, type_=type_, param=param, code=code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body, status_code=self.status, headers=self.headers)


class UpstreamError(Exception):
    """One attempt on one replica failed: connect error, timeout, HTTP error, stall, broken stream."""

    def __init__(self, replica_id: str, reason: str, message: str, *, status: int | None = None,
                 body: Any = None, retry_after: str | None = None) -> None:
        super().__init__(f"replica {replica_id}: {message}")
        self.replica_id, self.reason, self.status = replica_id, reason, status
        self.body, self.retry_after = body, retry_after

    @property
    def is_retryable(self) -> bool:
        """Another replica may succeed: transport failures, 5xx and 429 (a 4xx is the request's fault)."""
        return self.status is None or self.status >= 500 or self.status == 429

    @property
    def is_failure(self) -> bool:
        """Counts toward ejection: the replica is broken, not merely busy (429) or refusing (4xx)."""
        return self.status is None or self.status >= 500

    def to_client(self, retry_after_s: int) -> GatewayError:
        """What the client gets when no other replica is left to try."""
        if self.status is not None and isinstance(self.body, dict) and "error" in self.body:
            headers = {"Retry-After": self.retry_after} if self.retry_after else {}
            return GatewayError(self.status, str(self), type_="server_error", headers=headers, body=self.body)
        return GatewayError(503, f"no replica could serve the request; last failure: {self}",
                            type_="service_unavailable", code="upstream_unavailable",
                            headers={"Retry-After": str(retry_after_s)})


def _bad_request(param: str, message: str) -> GatewayError:
    return GatewayError(400, f"{param}: {message}", type_="invalid_request_error", param=param)


# ---- admission -------------------------------------------------------------------------------
@dataclass(slots=True)
class TokenBucket:
    """``rate`` per second, holding at most ``capacity``; a request costlier than the capacity waits
    for a full bucket and leaves it in debt, so big requests are slowed, never refused forever."""

    rate: float
    capacity: float
    level: float
    updated: float

    @classmethod
    def full(cls, rate: float, now: float) -> TokenBucket:
        capacity = max(rate * RATE_LIMIT_BURST_S, 1.0)
        return cls(rate, capacity, capacity, now)

    def seconds_until(self, cost: float, now: float) -> float:
        """0 when ``cost`` can be taken now, else how long until it can."""
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        need = min(cost, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, cost: float) -> None:
        self.level -= cost


class RateLimiter:
    """Per-API-key request and token buckets; a rate of 0 turns its bucket off."""

    def __init__(self, *, requests_per_s: float, tokens_per_s: float, clock: Clock) -> None:
        self.requests_per_s, self.tokens_per_s, self.clock = requests_per_s, tokens_per_s, clock
        self._buckets: dict[tuple[str, str], TokenBucket] = {}

    def admit(self, key: str, num_tokens: int) -> float:
        """0.0 when admitted (and charged), else the seconds to wait before asking again."""
        now = self.clock()
        costs = list(self._buckets_of(key, num_tokens, now))
        wait = max((bucket.seconds_until(cost, now) for bucket, cost in costs), default=0.0)
        if wait > 0:
            return wait
        for bucket, cost in costs:
            bucket.take(cost)
        return 0.0

    def _buckets_of(self, key: str, num_tokens: int, now: float) -> Iterable[tuple[TokenBucket, float]]:
        for kind, rate, cost in (("requests", self.requests_per_s, 1.0),
                                 ("tokens", self.tokens_per_s, float(num_tokens))):
            if rate > 0:
                yield self._buckets.setdefault((kind, key), TokenBucket.full(rate, now)), cost


class RetryBudget:
    """Retries allowed as a share of the requests of the last window (with a small floor)."""

    def __init__(self, ratio: float, *, clock: Clock, window_s: float = RETRY_BUDGET_WINDOW_S,
                 min_retries: int = RETRY_BUDGET_MIN_RETRIES) -> None:
        self.ratio, self.clock, self.window_s, self.min_retries = ratio, clock, window_s, min_retries
        self._requests: deque[float] = deque()
        self._retries: deque[float] = deque()

    def record_request(self) -> None:
        self._requests.append(self.clock())

    def try_spend(self) -> bool:
        """Take one retry from the budget; False when it is spent."""
        now = self.clock()
        for times in (self._requests, self._retries):
            while times and times[0] < now - self.window_s:
                times.popleft()
        if len(self._retries) >= max(self.min_retries, self.ratio * len(self._requests)):
            return False
        self._retries.append(now)
        return True


def shed_limit(priority: str, max_inflight: int) -> int:
    """In-flight requests per replica at which requests of ``priority`` are refused."""
    return max(1, math.ceil(SHED_FRACTIONS[priority] * max_inflight))


# ---- outlier ejection ------------------------------------------------------------------------
class OutlierDetector:
    """Consecutive failures per replica; ``eject_after`` of them eject it until a probe re-admits it."""

    def __init__(self, eject_after: int) -> None:
        self.eject_after = eject_after
        self._failures: dict[str, int] = defaultdict(int)
        self.ejected: set[str] = set()

    def record_success(self, replica_id: str) -> None:
        self._failures[replica_id] = 0

    def record_failure(self, replica_id: str) -> bool:
        """True when this failure ejected the replica."""
        self._failures[replica_id] += 1
        if replica_id in self.ejected or self._failures[replica_id] < self.eject_after:
            return False
        self.ejected.add(replica_id)
        return True

    def readmit(self, replica_id: str) -> None:
        self.ejected.discard(replica_id)
        self._failures[replica_id] = 0


# ---- metrics ---------------------------------------------------------------------------------
LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                   20.0, 40.0, 80.0)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class GatewayMetrics:
    """The gateway's own Prometheus series (plain names; the replicas export the vllm: ones)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("gateway_requests", "Requests answered, by endpoint, status and the "
                                "replica that produced the final token", ["endpoint", "status", "replica"],
                                registry=r)
        self.retries = Counter("gateway_retries", "Requests retried on another replica before the first "
                               "byte, by the replica that failed and why", ["replica", "reason"], registry=r)
        self.resumes = Counter("gateway_resumes", "Streams resumed on another replica mid-way, by the "
                               "replica that broke and why", ["replica", "reason"], registry=r)
        self.ejections = Counter("gateway_ejections", "Replicas ejected by outlier detection",
                                 ["replica"], registry=r)
        self.readmissions = Counter("gateway_readmissions", "Ejected replicas re-admitted by the probe",
                                    ["replica"], registry=r)
        self.rejected = Counter("gateway_rejected", "Requests refused before routing, by reason",
                                ["reason"], registry=r)
        self.inflight = Gauge("gateway_inflight_requests", "Upstream requests in flight, by replica",
                              ["replica"], registry=r)
        self.ejected = Gauge("gateway_ejected_replicas", "Replicas ejected now", registry=r)
        self.overhead = Histogram("gateway_overhead_seconds", "End-to-end time not spent in the replica's "
                                  "stages (routing, retries, proxying)", buckets=OVERHEAD_BUCKETS, registry=r)
        self.ttft = Histogram("gateway_time_to_first_token_seconds", "Time to the first token as the "
                              "client sees it", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("gateway_e2e_request_latency_seconds", "End-to-end request latency as the "
                             "client sees it", buckets=LATENCY_BUCKETS, registry=r)

    def page(self) -> bytes:
        return generate_latest(self.registry)


# ---- one request's parameters ----------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        return (stop,)
    return tuple(s for s in stop if isinstance(s, str)) if isinstance(stop, list) else ()


def _prompt_units(kind: str, body: dict[str, Any]) -> tuple[list[int], bool]:
    """What prefix affinity hashes, and whether it is token ids: a token-id prompt as it is; else the
    prompt's UTF-8 bytes (the gateway has no tokenizer; equal leading text still means equal leading
    blocks on the replica, up to block boundaries)."""
    if kind == "chat":
        messages = body.get("messages")
        text = json.dumps(messages, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
        return list(text.encode()), False
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        return list(prompt), True
    return list(str(prompt).encode()), False


def _is_deterministic(body: dict[str, Any]) -> bool:
    """Greedy or seeded: a continuation regenerates exactly what an undisturbed run would."""
    temperature = body.get("temperature")
    greedy = (isinstance(temperature, (int, float)) and temperature == 0) or body.get("top_k") == 1
    return greedy or _is_int(body.get("seed"))


@dataclass(slots=True, frozen=True)
class RequestParams:
    """What the gateway needs from a client's request body; the replica validates the rest."""

    kind: str  # completion | chat
    body: dict[str, Any]
    stream: bool
    include_usage: bool
    wants_token_ids: bool
    max_tokens: int | None  # None: up to the context length
    min_tokens: int
    output_offset: int
    hold: int  # characters a replica holds back for stop strings (max stop length - 1)
    is_deterministic: bool
    block_hashes: tuple[int, ...]
    num_tokens_estimate: int  # prompt + max_tokens, for the token rate limit

    @property
    def path(self) -> str:
        return PATHS[self.kind]

    @property
    def model(self) -> str:
        model = self.body.get("model")
        return model if isinstance(model, str) else ""

    @classmethod
    def parse(cls, kind: str, body: Any) -> RequestParams:
        if not isinstance(body, dict):
            raise _bad_request("body", "must be a JSON object")
        stream, options = body.get("stream"), body.get("stream_options") or {}
        if stream is not None and not isinstance(stream, bool):
            raise _bad_request("stream", f"must be true or false, got {stream!r}")
        if not isinstance(options, dict):
            raise _bad_request("stream_options", "must be an object")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None and kind == "completion":
            max_tokens = COMPLETION_DEFAULT_MAX_TOKENS
        units, are_tokens = _prompt_units(kind, body)
        prompt_estimate = len(units) if are_tokens else math.ceil(len(units) / CHARS_PER_TOKEN)
        max_tokens = max_tokens if _is_int(max_tokens) else None  # a bad value: the replica answers 400
        return cls(kind=kind, body=body, stream=bool(stream),
                   include_usage=options.get("include_usage") is True,
                   wants_token_ids=body.get("return_token_ids") is True, max_tokens=max_tokens,
                   min_tokens=_int_or_zero(body.get("min_tokens")),
                   output_offset=_int_or_zero(body.get("output_offset")),
                   hold=max((len(s) for s in _stop_strings(body.get("stop"))), default=1) - 1,
                   is_deterministic=_is_deterministic(body),
                   block_hashes=tuple(prompt_block_hashes(units)),
                   num_tokens_estimate=prompt_estimate + (max_tokens or CHAT_MAX_TOKENS_ESTIMATE))

    def upstream_body(self, priority: int) -> dict[str, Any]:
        """The client's request as a replica gets it: always a stream with token ids and usage."""
        options = {**(self.body.get("stream_options") or {}), "include_usage": True}
        return {**self.body, "stream": True, "stream_options": options, "return_token_ids": True,
                "priority": priority}

    def continuation_body(self, prompt_ids: list[int], num_done: int, priority: int) -> dict[str, Any]:
        """A /v1/completions request that goes on after ``num_done`` tokens (the last of ``prompt_ids``)."""
        body = {name: self.body[name] for name in CARRIED_FIELDS if name in self.body}
        body.update(prompt=prompt_ids, stream=True, stream_options={"include_usage": True},
                    return_token_ids=True, priority=priority, output_offset=self.output_offset + num_done)
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens - num_done
        if self.min_tokens:
            body["min_tokens"] = max(self.min_tokens - num_done, 0)
        return body


def _int_or_zero(value: Any) -> int:
    return value if _is_int(value) and value > 0 else 0


# ---- one request's stream, assembled from one or more upstream streams --------------------------
def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    return str((choice.get("delta") or {}).get("content") or "")


class StreamAssembly:
    """The client's view of one request, built from upstream chunks; plans continuations. No I/O.

    Positions are (tokens, characters) from the start of the completion. A *checkpoint* is a position
    where the replica had released the text of every token before it (a chunk with text), so a
    continuation starting there produces exactly the text that follows.
    """

    def __init__(self, params: RequestParams) -> None:
        self.params = params
        self.prompt_ids: list[int] | None = None
        self.token_ids: list[int] = []
        self.text: list[str] = []
        self.num_chars = 0
        self.checkpoints: list[tuple[int, int]] = [(0, 0)]
        self.meta: dict[str, Any] | None = None  # id, created, model of the first upstream stream
        self.finish_reason: str | None = None
        self.final_chunk: dict[str, Any] | None = None  # held until the usage chunk
        self.upstream_usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None
        self.num_resumes = 0
        self.num_mismatches = 0  # regenerated tokens that differed from those sent (nondeterminism)
        self._base = (0, 0)  # where the current upstream stream started
        self._produced = (0, 0)  # what the current upstream stream produced
        self._skip = (0, 0)  # regenerated tokens and characters still to drop
        self._sent_first = False

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def accept(self, event: dict[str, Any]) -> list[dict[str, Any]]:
        """One upstream chunk in; the client chunks it releases out."""
        if self.meta is None:
            self.meta = {k: event.get(k) for k in ("id", "created", "model")}
        if event.get("timings"):
            self.timings = event["timings"]
        choices = event.get("choices")
        if not choices:
            self.upstream_usage = event.get("usage") or self.upstream_usage
            return []
        if self.prompt_ids is None and isinstance(event.get("prompt_token_ids"), list):
            self.prompt_ids = list(event["prompt_token_ids"])
        choice = choices[0]
        ids, text = self._fresh(list(choice.get("token_ids") or []), _choice_text(choice))
        self.token_ids.extend(ids)
        self.text.append(text)
        self.num_chars += len(text)
        reason = choice.get("finish_reason")
        if reason:
            self.finish_reason = reason
        return self._client_chunks(ids, text, reason)

    def _fresh(self, ids: list[int], text: str) -> tuple[list[int], str]:
        """Records checkpoints; drops what a continuation regenerated up to the point already sent."""
        tokens, chars = self._produced[0] + len(ids), self._produced[1] + len(text)
        self._produced = (tokens, chars)
        if text:
            self.checkpoints.append((self._base[0] + tokens, self._base[1] + chars + self.params.hold))
        drop_ids, drop_chars = min(self._skip[0], len(ids)), min(self._skip[1], len(text))
        if drop_ids:
            at = self._base[0] + tokens - len(ids)
            if ids[:drop_ids] != self.token_ids[at:at + drop_ids]:
                self.num_mismatches += 1
        self._skip = (self._skip[0] - drop_ids, self._skip[1] - drop_chars)
        return ids[drop_ids:], text[drop_chars:]

    def _client_chunks(self, ids: list[int], text: str, reason: str | None) -> list[dict[str, Any]]:
        first = not self._sent_first
        if not (text or reason or first or (self.params.wants_token_ids and ids)):
            return []
        self._sent_first = True
        chunk = self._chunk([self._choice(ids, text, reason, first=first)])
        if first and self.params.wants_token_ids:
            chunk["prompt_token_ids"] = self.prompt_ids
        if reason:
            self.final_chunk = chunk
            return []
        return [chunk]

    def _choice(self, ids: list[int], text: str, reason: str | None, *, first: bool) -> dict[str, Any]:
        if self.params.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
        if self.params.wants_token_ids:
            choice["token_ids"] = ids
        return choice

    def _chunk(self, choices: list[dict[str, Any]], *, obj: str | None = None) -> dict[str, Any]:
        meta = self.meta or {}
        default = "chat.completion.chunk" if self.params.kind == "chat" else "text_completion"
        return {"id": meta.get("id"), "object": obj or default, "created": meta.get("created"),
                "model": meta.get("model"), "choices": choices}

    def closing_chunks(self) -> list[dict[str, Any]]:
        """The finish chunk, with usage the way the client asked for it."""
        final = self.final_chunk
        if final is None:
            return []
        if not self.params.include_usage:
            final["usage"] = None
            if self.timings is not None:
                final["timings"] = self.timings
            return [final]
        tail = self._chunk([])
        tail["usage"] = self.usage()
        if self.timings is not None:
            tail["timings"] = self.timings
        return [final, tail]

    def finish_locally(self, reason: str) -> None:
        """Every token was delivered but the finish chunk was lost: finish without a replica."""
        self.finish_reason = reason
        self._client_chunks([], "", reason)

    def usage(self) -> dict[str, Any]:
        """The whole request's usage: the original prompt, every completion token of every stream."""
        upstream = self.upstream_usage or {}
        if self.num_resumes == 0 and upstream:
            return upstream
        prompt = int(upstream.get("prompt_tokens", 0)) if self.prompt_ids is None else len(self.prompt_ids)
        cached = (upstream.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return {"prompt_tokens": prompt, "completion_tokens": len(self.token_ids),
                "total_tokens": prompt + len(self.token_ids),
                "prompt_tokens_details": {"cached_tokens": min(int(cached), prompt)}}

    def resume_point(self) -> tuple[int, int]:
        """Where a continuation starts: the last checkpoint within what was sent (deterministic
        sampling regenerates the rest identically); else right after the last token sent."""
        if not self.params.is_deterministic:
            return len(self.token_ids), self.num_chars
        sent = [c for c in self.checkpoints if c[0] <= len(self.token_ids) and c[1] <= self.num_chars]
        return max(sent, default=(0, 0))

    def continuation(self, priority: int) -> tuple[str, dict[str, Any]]:
        """The (path, body) of the request that goes on from the resume point."""
        num_done, chars = self.resume_point()
        self._base, self._produced = (num_done, chars), (0, 0)
        self._skip = (len(self.token_ids) - num_done, self.num_chars - chars)
        self.num_resumes += 1
        if num_done == 0 or self.prompt_ids is None:  # start over, dropping whatever was sent
            return self.params.path, self.params.upstream_body(priority)
        prompt = self.prompt_ids + self.token_ids[:num_done]
        return PATHS["completion"], self.params.continuation_body(prompt, num_done, priority)

    def is_exhausted(self) -> bool:
        """All max_tokens were delivered: nothing is left to generate."""
        return self.params.max_tokens is not None and len(self.token_ids) >= self.params.max_tokens

    def full_response(self) -> dict[str, Any]:
        """The non-streaming response body."""
        text = "".join(self.text)
        if self.params.kind == "chat":
            choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text},
                                      "logprobs": None, "finish_reason": self.finish_reason}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": self.finish_reason}
            obj = "text_completion"
        body = self._chunk([choice], obj=obj)
        body["usage"] = self.usage()
        if self.params.wants_token_ids:
            choice["token_ids"] = self.token_ids
            body["prompt_token_ids"] = self.prompt_ids
        if self.timings is not None:
            body["timings"] = self.timings
        return body


# ---- one upstream stream ---------------------------------------------------------------------
class _Upstream:
    """A replica's SSE response; every way it can fail comes out as :class:`UpstreamError`."""

    def __init__(self, endpoint: ReplicaEndpoint, response: httpx.Response,
                 on_close: Callable[[str], None]) -> None:
        self.endpoint = endpoint
        self.response = response
        self._lines = _sse_payloads(response)
        self._on_close = on_close
        self._primed: list[dict[str, Any] | None] = []
        self._closed = False

    @property
    def replica_id(self) -> str:
        return self.endpoint.replica_id

    async def prime(self, timeout: float) -> None:
        """Wait for the first event (the first token), so failures before it can still be retried."""
        self._primed.append(await self.next_event(timeout))

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next ``data:`` payload; None for ``[DONE]``."""
        if self._primed:
            return self._primed.pop()
        data = await self._line(timeout)
        if data == b"[DONE]":
            return None
        return self._event(data)

    async def _line(self, timeout: float) -> bytes:
        rid = self.replica_id
        try:
            async with asyncio.timeout(timeout):
                return await anext(self._lines)
        except TimeoutError as exc:
            raise UpstreamError(rid, "stall", f"no data for {timeout:g}s") from exc
        except StopAsyncIteration as exc:
            raise UpstreamError(rid, "closed", "the stream ended before [DONE]") from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(rid, "broken", f"{type(exc).__name__}: {exc}") from exc

    def _event(self, data: bytes) -> dict[str, Any]:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(self.replica_id, "broken", f"not JSON: {data[:80]!r}") from exc
        if not isinstance(event, dict):
            raise UpstreamError(self.replica_id, "broken", f"not a JSON object: {data[:80]!r}")
        if "error" in event:
            message = (event.get("error") or {}).get("message", "error frame")
            raise UpstreamError(self.replica_id, "error_frame", str(message), body=event)
        return event

    async def aclose(self) -> None:
        """Idempotent; the bookkeeping first, then the socket (shielded: this runs during cancellation)."""
        if self._closed:
            return
        self._closed = True
        self._on_close(self.replica_id)
        with anyio.CancelScope(shield=True):
            await self.response.aclose()


class _ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always runs ``on_close``, even if the client left before the body."""

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]],
                 headers: Mapping[str, str]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=dict(headers))
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


# ---- one request -----------------------------------------------------------------------------
@dataclass(slots=True)
class _Job:
    request_id: str
    kind: str
    started: float  # gateway clock
    started_wall: float
    key_id: str | None = None
    priority: str = DEFAULT_PRIORITY
    params: RequestParams | None = None
    assembly: StreamAssembly | None = None
    upstream: _Upstream | None = None  # the stream being relayed now
    replica: ReplicaEndpoint | None = None  # the replica that produced the latest token
    failed: set[str] = field(default_factory=set)  # replicas that failed this request
    retries: int = 0
    first_token_at: float | None = None
    done: bool = False  # its trace was emitted

    @property
    def endpoint(self) -> str:
        return PATHS[self.kind]


def _key_id(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:KEY_ID_CHARS]


def _bearer(request: Request) -> str | None:
    value = request.headers.get("authorization", "")
    return value[7:].strip() if value.lower().startswith("bearer ") else None


def _priority(request: Request) -> str:
    value = request.headers.get(PRIORITY_HEADER, DEFAULT_PRIORITY).strip().lower()
    if value not in PRIORITIES:
        raise _bad_request(PRIORITY_HEADER, f"must be one of {', '.join(PRIORITIES)}, got {value!r}")
    return value


async def _read_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise _bad_request("body", f"not valid JSON: {exc}") from exc


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message", "")) if isinstance(error, dict) else ""


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def _sse_payloads(response: httpx.Response) -> AsyncIterator[bytes]:
    """The ``data:`` payloads of a server-sent event stream, as bytes (no per-line decoding)."""
    buffer = b""
    async for piece in response.aiter_bytes():
        buffer += piece
        while (end := buffer.find(b"\n")) >= 0:
            line, buffer = buffer[:end], buffer[end + 1:]
            if line.startswith(b"data:"):
                yield line[5:].strip()


def _stage_seconds(timings: Mapping[str, Any] | None) -> dict[str, float | None]:
    """The replica's stage timings from a final chunk (None where it sent none)."""
    timings = timings or {}
    return {stage: _seconds(timings.get(stage)) for stage in STAGES}


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# ---- the gateway -----------------------------------------------------------------------------
class Gateway:
    """Routes, retries, resumes, ejects, admits and traces; :func:`create_gateway_app` serves it."""

    def __init__(self, config: GatewayConfig, *, endpoints: Callable[[], list[ReplicaEndpoint]],
                 load: Callable[[str], ReplicaLoad | None] = lambda _: None,
                 on_trace: Callable[[TraceRecord], None] = lambda _: None,
                 on_event: EventSink = lambda kind, replica_id, detail: None,
                 clock: Clock = time.monotonic, transport: httpx.AsyncBaseTransport | None = None,
                 router: Router | None = None) -> None:
        self.config = config
        self._endpoints, self._load, self._on_trace, self._on_event = endpoints, load, on_trace, on_event
        self.clock = clock
        self.router = router or Router(config.routing)
        self.metrics = GatewayMetrics()
        self.limiter = RateLimiter(requests_per_s=config.rate_limit_rps,
                                   tokens_per_s=config.rate_limit_tokens_per_s, clock=clock)
        self.budget = RetryBudget(config.retry_budget_ratio, clock=clock)
        self.outliers = OutlierDetector(config.eject_after_failures)
        self._inflight: dict[str, int] = defaultdict(int)
        self._probe_task: asyncio.Task[None] | None = None
        self._client = self._new_client(transport)

    def _new_client(self, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
        t = self.config.first_byte_timeout_s
        # Reads have no httpx timeout: the first byte and stalls are timed per event by _Upstream.
        timeout = httpx.Timeout(connect=t, read=None, write=t, pool=t)
        limits = httpx.Limits(max_connections=MAX_CONNECTIONS,
                              max_keepalive_connections=MAX_KEEPALIVE_CONNECTIONS)
        return httpx.AsyncClient(transport=transport, timeout=timeout, limits=limits, trust_env=False)

    # ---- lifecycle ----
    async def start(self) -> None:
        """Start the probe that re-admits ejected replicas (idempotent)."""
        if self._probe_task is None:
            self._probe_task = asyncio.create_task(self._probe_loop(), name="gateway-probe")

    async def stop(self) -> None:
        """Stop the probe and close every upstream connection."""
        task, self._probe_task = self._probe_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._client.aclose()

    def ejected(self) -> set[str]:
        """The replicas ejected now."""
        return set(self.outliers.ejected)

    def inflight(self) -> dict[str, int]:
        """Upstream requests in flight per replica."""
        return {rid: n for rid, n in self._inflight.items() if n}

    # ---- requests ----
    async def handle(self, request: Request, kind: str) -> Response:
        """One /v1/completions or /v1/chat/completions request, streaming or not."""
        job = _Job(uuid.uuid4().hex, kind, self.clock(), time.time())
        try:
            job.key_id = self._authenticate(request)
            job.priority = _priority(request)
            job.params = RequestParams.parse(kind, await _read_body(request))
            job.assembly = StreamAssembly(job.params)
            self._admit(job)
            self.budget.record_request()
            body = job.params.upstream_body(PRIORITIES[job.priority])
            job.upstream = await self._open(job, job.params.path, body, budgeted=True)
        except GatewayError as exc:
            self._finish(job, exc.status, str(exc))
            return exc.response()
        job.replica = job.upstream.endpoint
        if job.params.stream:
            return self._streaming_response(job)
        return await self._collected_response(job)

    def _authenticate(self, request: Request) -> str | None:
        """The key's id (a hash prefix), or None without a key; 401 when keys are required."""
        given = _bearer(request)
        keys = self.config.api_keys
        if keys and (given is None or not any(hmac.compare_digest(given.encode(), k.encode()) for k in keys)):
            self.metrics.rejected.labels("unauthorized").inc()
            raise GatewayError(401, "missing or invalid API key", type_="invalid_request_error",
                               code="invalid_api_key")
        return _key_id(given) if given else None

    def _admit(self, job: _Job) -> None:
        """Before any byte goes upstream: a routable replica, room for the priority class, rate limits."""
        assert job.params is not None
        pool = routable(self._candidates())
        if not pool:
            self.metrics.rejected.labels("no_replica").inc()
            raise GatewayError(503, "no routable replica (none ready, or all ejected)",
                               type_="service_unavailable", code="no_replica",
                               headers={"Retry-After": str(self.config.retry_after_s)})
        limit = shed_limit(job.priority, self.config.max_inflight_per_replica)
        if all(c.num_inflight >= limit for c in pool):
            self.metrics.rejected.labels(f"shed_{job.priority}").inc()
            raise GatewayError(429, f"every replica has {limit} or more requests in flight; {job.priority} "
                               "requests are shed at this load", type_="rate_limit_error", code="overloaded",
                               headers={"Retry-After": str(self.config.retry_after_s)})
        wait = self.limiter.admit(job.key_id or "anonymous", job.params.num_tokens_estimate)
        if wait > 0:
            self.metrics.rejected.labels("rate_limited").inc()
            raise GatewayError(429, "rate limit exceeded for this API key", type_="rate_limit_error",
                               code="rate_limit_exceeded", headers={"Retry-After": str(math.ceil(wait))})

    def _candidates(self) -> list[Candidate]:
        ejected = self.outliers.ejected
        return [Candidate(e, self._load(e.replica_id), self._inflight.get(e.replica_id, 0),
                          e.replica_id in ejected) for e in self._endpoints()]

    # ---- upstream attempts ----
    async def _open(self, job: _Job, path: str, body: dict[str, Any], *, budgeted: bool) -> _Upstream:
        """A primed stream on some replica: up to ``max_retries`` other replicas after a failure."""
        assert job.params is not None
        last: UpstreamError | None = None
        for attempt in range(self.config.max_retries + 1):
            candidates = self._candidates()
            decision = self.router.pick(candidates, block_hashes=job.params.block_hashes, exclude=job.failed)
            if not decision.is_routed or (attempt and budgeted and not self.budget.try_spend()):
                break
            if last is not None:
                job.retries += 1
                self.metrics.retries.labels(last.replica_id, last.reason).inc()
            endpoint = next(c.endpoint for c in candidates if c.replica_id == decision.replica_id)
            logger.debug("[%s] request %s -> %s (%s)", endpoint.replica_id, job.request_id,
                         decision.replica_id, decision.scores)
            try:
                upstream = await self._attempt(endpoint, path, body)
            except UpstreamError as exc:
                job.failed.add(endpoint.replica_id)
                self._record_failure(exc)
                if not exc.is_retryable:
                    raise exc.to_client(self.config.retry_after_s) from exc
                last = exc
                continue
            self.router.remember(endpoint.replica_id, job.params.block_hashes)
            return upstream
        if last is None:
            raise GatewayError(503, "no routable replica left for this request", type_="service_unavailable",
                               code="no_replica", headers={"Retry-After": str(self.config.retry_after_s)})
        raise last.to_client(self.config.retry_after_s) from last

    async def _attempt(self, endpoint: ReplicaEndpoint, path: str, body: dict[str, Any]) -> _Upstream:
        """Send to one replica and wait for its first event; counted in flight until closed."""
        self._acquire(endpoint.replica_id)
        upstream: _Upstream | None = None
        try:
            response = await self._send(endpoint, path, body)
            upstream = _Upstream(endpoint, response, self._release)
            await upstream.prime(self.config.first_byte_timeout_s)
            return upstream
        except BaseException:
            if upstream is None:
                self._release(endpoint.replica_id)
            else:
                await upstream.aclose()
            raise

    async def _send(self, endpoint: ReplicaEndpoint, path: str, body: dict[str, Any]) -> httpx.Response:
        """POST and wait for the status line; httpx errors and refusals become UpstreamError here."""
        rid = endpoint.replica_id
        request = self._client.build_request("POST", f"{endpoint.base_url}{path}", json=body)
        try:
            async with asyncio.timeout(self.config.first_byte_timeout_s):
                response = await self._client.send(request, stream=True)
        except TimeoutError as exc:
            raise UpstreamError(rid, "timeout", f"no response within {self.config.first_byte_timeout_s:g}s"
                                ) from exc
        except httpx.HTTPError as exc:
            raise UpstreamError(rid, "connect", f"{type(exc).__name__}: {exc}") from exc
        if response.status_code == 200:
            return response
        raise await self._refusal(rid, response)

    async def _refusal(self, replica_id: str, response: httpx.Response) -> UpstreamError:
        status = response.status_code
        try:
            async with asyncio.timeout(self.config.first_byte_timeout_s):
                raw = await response.aread()
            body: Any = json.loads(raw)
        except (TimeoutError, httpx.HTTPError, ValueError):
            body = None
        finally:
            await response.aclose()
        return UpstreamError(replica_id, f"status_{status}", f"HTTP {status} {_error_message(body)}".strip(),
                             status=status, body=body, retry_after=response.headers.get("retry-after"))

    def _acquire(self, replica_id: str) -> None:
        self._inflight[replica_id] += 1
        self.metrics.inflight.labels(replica_id).set(self._inflight[replica_id])

    def _release(self, replica_id: str) -> None:
        self._inflight[replica_id] -= 1
        self.metrics.inflight.labels(replica_id).set(self._inflight[replica_id])

    def _record_failure(self, exc: UpstreamError) -> None:
        rid = exc.replica_id
        logger.info("[%s] upstream failure: %s", rid, exc)
        if exc.is_failure and self.outliers.record_failure(rid):
            logger.warning("[%s] ejected after %d consecutive failures (last: %s)", rid,
                           self.config.eject_after_failures, exc.reason)
            self.metrics.ejections.labels(rid).inc()
            self.metrics.ejected.set(len(self.outliers.ejected))
            self._emit("ejected", rid, f"{self.config.eject_after_failures} consecutive failures; "
                       f"last: {exc}")

    def _emit(self, kind: str, replica_id: str, detail: str) -> None:
        try:
            self._on_event(kind, replica_id, detail)
        except Exception:
            logger.exception("[%s] on_event(%s) failed", replica_id, kind)

    # ---- relaying and resuming ----
    async def _chunks(self, job: _Job) -> AsyncGenerator[dict[str, Any], None]:
        """The client's chunks, resuming on another replica whenever the upstream stream breaks."""
        assert job.assembly is not None and job.upstream is not None
        while True:
            try:
                async with contextlib.aclosing(self._relay(job, job.upstream)) as relay:
                    async for chunk in relay:
                        yield chunk
                break
            except UpstreamError as exc:
                self._record_failure(exc)
                if job.assembly.is_finished:
                    break  # broken after the last token: nothing is lost
                job.upstream = await self._resume(job, exc)
                if job.upstream is None:
                    break
        for chunk in job.assembly.closing_chunks():
            yield chunk

    async def _relay(self, job: _Job, upstream: _Upstream) -> AsyncGenerator[dict[str, Any], None]:
        """One upstream stream's chunks, translated for the client, until ``[DONE]``."""
        assembly = job.assembly
        assert assembly is not None
        try:
            while (event := await upstream.next_event(self.config.stall_timeout_s)) is not None:
                chunks = assembly.accept(event)
                if event.get("choices"):
                    job.replica = upstream.endpoint
                if job.first_token_at is None and assembly.token_ids:
                    job.first_token_at = self.clock()
                for chunk in chunks:
                    yield chunk
            if not assembly.is_finished:
                raise UpstreamError(upstream.replica_id, "closed", "[DONE] before the last token")
            self.outliers.record_success(upstream.replica_id)
        finally:
            await upstream.aclose()

    async def _resume(self, job: _Job, exc: UpstreamError) -> _Upstream | None:
        """Go on elsewhere from what was delivered; None when nothing is left to generate."""
        assembly = job.assembly
        assert assembly is not None
        job.failed.add(exc.replica_id)
        if assembly.is_exhausted():
            assembly.finish_locally("length")
            return None
        if assembly.num_resumes >= MAX_RESUMES:
            raise GatewayError(503, f"the stream broke {MAX_RESUMES + 1} times; last: {exc}",
                               type_="service_unavailable", code="resume_failed") from exc
        detail = (f"request {job.request_id}: {exc.reason} after {len(assembly.token_ids)} tokens; "
                  f"continuing from token {assembly.resume_point()[0]}")
        path, body = assembly.continuation(PRIORITIES[job.priority])
        logger.warning("[%s] resuming %s", exc.replica_id, detail)
        self.metrics.resumes.labels(exc.replica_id, exc.reason).inc()
        self._emit("resumed", exc.replica_id, detail)
        return await self._open(job, path, body, budgeted=False)

    def _streaming_response(self, job: _Job) -> Response:
        assert job.upstream is not None
        stream = self._sse(job)

        async def close() -> None:
            await stream.aclose()
            if job.upstream is not None:
                await job.upstream.aclose()
            self._finish(job, 200, "client disconnected")

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                   REPLICA_HEADER: job.upstream.replica_id}
        return _ClosingStreamingResponse(stream, on_close=close, headers=headers)

    async def _sse(self, job: _Job) -> AsyncGenerator[bytes, None]:
        error: str | None = None
        try:
            async with contextlib.aclosing(self._chunks(job)) as chunks:
                async for chunk in chunks:
                    yield _sse(chunk)
            yield b"data: [DONE]\n\n"
        except GatewayError as exc:
            error = str(exc)
            logger.error("request %s failed mid-stream: %s", job.request_id, exc)
            yield _sse(exc.body)
        except Exception as exc:  # a bug must still end the stream the way an OpenAI client understands
            error = f"internal error: {type(exc).__name__}: {exc}"
            logger.exception("request %s: gateway error mid-stream", job.request_id)
            yield _sse(error_body(error, type_="server_error", code="gateway_error"))
        finally:
            self._finish(job, 200, error)

    async def _collected_response(self, job: _Job) -> Response:
        assert job.assembly is not None
        try:
            async with contextlib.aclosing(self._chunks(job)) as chunks:
                async for _ in chunks:
                    pass
        except GatewayError as exc:
            self._finish(job, exc.status, str(exc))
            return exc.response()
        finally:
            if job.upstream is not None:
                await job.upstream.aclose()
        self._finish(job, 200, None)
        rid = job.replica.replica_id if job.replica else ""
        return JSONResponse(job.assembly.full_response(), headers={REPLICA_HEADER: rid})

    # ---- traces ----
    def _finish(self, job: _Job, status: int, error: str | None) -> None:
        """Metrics and the trace of one request; once per request."""
        if job.done:
            return
        job.done = True
        e2e = max(self.clock() - job.started, 0.0)
        assembly = job.assembly
        if assembly is not None and status == 200 and not assembly.is_finished and error is None:
            error = "client disconnected"
        stages = _stage_seconds(assembly.timings if assembly else None)
        gateway_s = max(e2e - sum(v for v in stages.values() if v is not None), 0.0)
        ttft = None if job.first_token_at is None else job.first_token_at - job.started
        replica = job.replica if status == 200 else None
        self.metrics.requests.labels(job.endpoint, str(status), replica.replica_id if replica else "").inc()
        if status == 200:
            self.metrics.e2e.observe(e2e)
            self.metrics.overhead.observe(gateway_s)
            if ttft is not None and job.params is not None and job.params.stream:
                self.metrics.ttft.observe(ttft)
        self._emit_trace(self._trace(job, status=status, error=error, e2e=e2e, gateway_s=gateway_s,
                                     ttft=ttft, stages=stages, replica=replica))

    def _trace(self, job: _Job, *, status: int, error: str | None, e2e: float, gateway_s: float,
               ttft: float | None, stages: dict[str, float | None],
               replica: ReplicaEndpoint | None) -> TraceRecord:
        assembly = job.assembly
        prompt_tokens = 0
        if assembly is not None:
            prompt_tokens = int(assembly.usage().get("prompt_tokens", 0)) if assembly.meta else 0
        return TraceRecord(
            request_id=job.request_id, started_at=job.started_wall, endpoint=job.endpoint,
            model=job.params.model if job.params else "", status=status,
            replica_id=replica.replica_id if replica else None, zone=replica.zone if replica else None,
            priority=job.priority, prompt_tokens=prompt_tokens,
            output_tokens=len(assembly.token_ids) if assembly else 0, ttft_s=ttft, e2e_s=e2e,
            gateway_s=gateway_s, queue_s=stages["queue"], prefill_s=stages["prefill"],
            decode_s=stages["decode"], detokenize_s=stages["detokenize"], serialize_s=stages["serialize"],
            retries=job.retries, resumes=assembly.num_resumes if assembly else 0, error=error,
            api_key_id=job.key_id)

    def _emit_trace(self, trace: TraceRecord) -> None:
        try:
            self._on_trace(trace)
        except Exception:
            logger.exception("on_trace failed for request %s", trace.request_id)

    # ---- other endpoints ----
    async def models(self, request: Request) -> Response:
        """The models of the routable replicas, deduplicated by id."""
        try:
            self._authenticate(request)
        except GatewayError as exc:
            return exc.response()
        pool = routable(self._candidates())
        pages = await asyncio.gather(*(self._models_of(c.endpoint) for c in pool))
        seen: dict[str, dict[str, Any]] = {}
        for models in pages:
            for model in models:
                seen.setdefault(str(model.get("id")), model)
        return JSONResponse({"object": "list", "data": list(seen.values())})

    async def _models_of(self, endpoint: ReplicaEndpoint) -> list[dict[str, Any]]:
        try:
            response = await self._client.get(f"{endpoint.base_url}/v1/models", timeout=MODELS_TIMEOUT_S)
            data = response.json().get("data", []) if response.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError) as exc:
            logger.info("[%s] /v1/models failed: %s", endpoint.replica_id, exc)
            return []
        return [m for m in data if isinstance(m, dict)]

    def health(self) -> dict[str, Any]:
        """The gateway's own liveness, with what it routes to."""
        return {"status": "ok", "routable": [c.replica_id for c in routable(self._candidates())],
                "ejected": sorted(self.outliers.ejected), "inflight": self.inflight()}

    # ---- re-admission ----
    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.probe_interval_s)
            try:
                await self.probe_once()
            except Exception:
                logger.exception("ejected-replica probe failed")

    async def probe_once(self) -> None:
        """Check /ready of every ejected replica; re-admit those that pass."""
        known = {e.replica_id: e for e in self._endpoints()}
        ejected = sorted(self.outliers.ejected)
        results = await asyncio.gather(*(self._is_ready(known.get(rid)) for rid in ejected))
        for rid, ready in zip(ejected, results):
            if ready or rid not in known:  # gone from the fleet: forget it
                self._readmit(rid, "passed /ready" if ready else "left the fleet")

    async def _is_ready(self, endpoint: ReplicaEndpoint | None) -> bool:
        if endpoint is None or not endpoint.state.is_routable:
            return False
        try:
            response = await self._client.get(f"{endpoint.base_url}/ready", timeout=PROBE_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _readmit(self, replica_id: str, why: str) -> None:
        self.outliers.readmit(replica_id)
        self.router.affinity.forget(replica_id)
        self.metrics.ejected.set(len(self.outliers.ejected))
        self.metrics.readmissions.labels(replica_id).inc()
        logger.warning("[%s] re-admitted: %s", replica_id, why)
        self._emit("readmitted", replica_id, why)


# ---- the app ---------------------------------------------------------------------------------
def create_gateway_app(gateway: Gateway) -> FastAPI:
    """The gateway's HTTP surface; its lifespan starts and stops the gateway."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="LLM gateway", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.gateway = gateway

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

    return app
