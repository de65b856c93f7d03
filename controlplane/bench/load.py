"""The load of ``python -m controlplane.bench gateway``: the round plan, and the closed-loop client.

C workers each send a streaming ``/v1/completions`` request, and the next when it ends, taking
:class:`Ticket` s from one shared plan: a warm-up of C requests per route, then rounds that alternate
between the replica itself and the gateway in ABBA order. There is no barrier between rounds (a barrier
would start each round with C requests at once, whose prefills queue behind one another: a burst the
steady state never sees); instead the first C requests of a round, which start while the previous
round's still run, are not counted.

The client is the gateway's own upstream client (:class:`~controlplane.gateway.upstream_http.UpstreamPool`: a
keep-alive HTTP/1.1 connection per stream, parsed by httptools). An httpx client spends about as much
per chunk as the gateway does, and its pauses would land on whichever route runs; for the same reason
its garbage collector is off while a level runs, and it parses a stream's events only after the level
(while requests run it keeps the raw bytes and the time of the first token).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from controlplane.gateway.upstream_http import TransportError, UpstreamPool

Route = Literal["direct", "gateway"]
ROUTES: tuple[Route, Route] = ("direct", "gateway")

ROUNDS_OF_C = 4  # a round is at least this many times C requests (its first C are not counted)
PROMPT = "The gateway relays this short prompt to the replica and streams the answer back"
MODEL = "default"
REQUEST_TIMEOUT_S = 60.0  # one request, from connect to [DONE]
ERROR_CHARS = 200


@dataclass(slots=True, frozen=True)
class RequestSample:
    """One request as the client saw it, with the replica's account of its queue and prefill."""

    route: Route
    round_index: int
    counted: bool = True  # False: warm-up, or started while the previous round still ran
    ttft_s: float | None = None
    e2e_s: float | None = None
    replica_queue_s: float | None = None
    replica_prefill_s: float | None = None
    error: str | None = None

    @property
    def is_success(self) -> bool:
        return self.error is None and None not in (self.ttft_s, self.e2e_s, self.replica_queue_s,
                                                   self.replica_prefill_s)

    @property
    def overhead_s(self) -> float:
        """Client TTFT not spent in the engine: HTTP, (de)serialization, and the gateway on that route."""
        if not self.is_success:
            raise ValueError(f"request failed or lacks timings: {self.error or 'no timings'}")
        assert self.ttft_s is not None and self.replica_queue_s is not None
        assert self.replica_prefill_s is not None
        return self.ttft_s - self.replica_queue_s - self.replica_prefill_s


# ---- the plan (pure) -------------------------------------------------------------------
def round_plan(num_requests: int, *, round_size: int, concurrency: int) -> list[tuple[Route, int]]:
    """(route, requests) per round: half the requests each way (direct gets the odd one), rounds of
    max(round_size, 4 C) in ABBA order (direct, gateway, gateway, direct, ...)."""
    if num_requests < 2 or round_size < 1 or concurrency < 1:
        raise ValueError(f"need >= 2 requests, round size >= 1 and concurrency >= 1; got {num_requests}, "
                         f"{round_size}, {concurrency}")
    size = max(round_size, ROUNDS_OF_C * concurrency)
    left: dict[Route, int] = {"direct": num_requests - num_requests // 2, "gateway": num_requests // 2}
    plan: list[tuple[Route, int]] = []
    index = 0
    while any(left.values()):
        route: Route = "direct" if index % 4 in (0, 3) else "gateway"
        index += 1
        if left[route]:
            count = min(size, left[route])
            left[route] -= count
            plan.append((route, count))
    return plan


@dataclass(slots=True, frozen=True)
class Ticket:
    """One request of a level: its route, its round, and whether it counts (not a warm-up request, and
    not one of the first C of its round, which start while the previous round's requests still run)."""

    route: Route
    round_index: int
    counted: bool


def ticket_plan(num_requests: int, *, round_size: int, concurrency: int) -> list[Ticket]:
    """A warm-up of C requests per route, then :func:`round_plan`'s rounds, in the order workers take them."""
    tickets = [Ticket(route, -1, False) for route in ROUTES for _ in range(concurrency)]
    for index, (route, count) in enumerate(round_plan(num_requests, round_size=round_size,
                                                      concurrency=concurrency)):
        tickets += [Ticket(route, index, i >= concurrency) for i in range(count)]
    return tickets


# ---- the load client -------------------------------------------------------------------------
def request_body(max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}


@dataclass(slots=True)
class _Received:
    """What one request's stream left before it was read: timestamps and the raw body. The events are
    parsed after the level (:meth:`sample`), so that the client's own work while requests run is only
    what timing them needs: its CPU is the gateway's CPU too, and every microsecond it spends between
    chunks during a gateway round would be counted as the gateway's."""

    ticket: Ticket
    sent: float
    first: float | None
    done: float
    pieces: list[bytes]

    def sample(self) -> RequestSample:
        return _finished(self.ticket, sent=self.sent, first=self.first, done=self.done,
                         events=_events(b"".join(self.pieces)))


async def stream_once(pool: UpstreamPool, address: tuple[str, int], ticket: Ticket,
                      body: bytes) -> RequestSample | _Received:
    """One streaming request; failures come back as a sample with ``error``, never as an exception."""
    sent = time.perf_counter()
    first: float | None = None
    pieces: list[bytes] = []
    head = b""  # the body until the first token, parsed as it grows
    try:
        async with asyncio.timeout(REQUEST_TIMEOUT_S):
            response = await pool.post(*address, "/v1/completions", body)
            try:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")[:ERROR_CHARS]
                    return _sample(ticket, error=f"HTTP {response.status_code}: {text}")
                async for piece in response.aiter_bytes():
                    pieces.append(piece)
                    if first is None:
                        head += piece
                        if _has_token(head):
                            first = time.perf_counter()
                done = time.perf_counter()
            finally:
                await response.aclose(reuse=bool(pieces) and pieces[-1].endswith(b"data: [DONE]\n\n"))
    except (TimeoutError, TransportError) as exc:
        return _sample(ticket, error=f"{type(exc).__name__}: {exc}")
    return _Received(ticket, sent, first, done, pieces)


def _has_token(buffer: bytes) -> bool:
    """Whether a complete event with a choice has arrived (parsed only until the first one has)."""
    return any(isinstance(e, dict) and e.get("choices") for e in _events(buffer[:buffer.rfind(b"\n\n") + 2]))


def _events(buffer: bytes) -> list[Any]:
    events: list[Any] = []
    for line in buffer.split(b"\n"):
        if line.startswith(b"data:"):
            data = line[5:].strip()
            events.append("[DONE]" if data == b"[DONE]" else _json(data))
    return events


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return {"error": f"not JSON: {data[:ERROR_CHARS]!r}"}


def _sample(ticket: Ticket, **fields: Any) -> RequestSample:
    return RequestSample(ticket.route, ticket.round_index, counted=ticket.counted, **fields)


def _finished(ticket: Ticket, *, sent: float, first: float | None, done: float,
              events: list[Any]) -> RequestSample:
    errors = [e for e in events if isinstance(e, dict) and "error" in e]
    if errors:
        return _sample(ticket, error=f"error frame: {json.dumps(errors[0])[:ERROR_CHARS]}")
    if not events or events[-1] != "[DONE]":
        return _sample(ticket, error="the stream ended before [DONE]")
    timings: dict[str, Any] = {}
    for event in events:
        if isinstance(event, dict) and event.get("timings"):
            timings = event["timings"]
    queue, prefill = _number(timings.get("queue")), _number(timings.get("prefill"))
    error = None
    if first is None:
        error = "[DONE] before any chunk with a token"
    elif queue is None or prefill is None:
        error = f"no queue/prefill timings in the stream (got {sorted(timings)})"
    ttft = None if first is None else first - sent
    return _sample(ticket, ttft_s=ttft, e2e_s=done - sent, replica_queue_s=queue, replica_prefill_s=prefill,
                   error=error)


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def run_load(urls: dict[Route, str], *, concurrency: int, num_requests: int, round_size: int,
                   max_tokens: int) -> list[RequestSample]:
    """One concurrency level: every ticket's sample, warm-up included, in the order they ended."""
    body = json.dumps(request_body(max_tokens)).encode()
    addresses = {route: _address(url) for route, url in urls.items()}
    tickets = iter(ticket_plan(num_requests, round_size=round_size, concurrency=concurrency))
    samples: list[RequestSample | _Received] = []
    pool = UpstreamPool()

    async def worker() -> None:
        for ticket in tickets:  # shared: each worker takes the next until none are left
            samples.append(await stream_once(pool, addresses[ticket.route], ticket, body))

    gc.freeze()
    gc.disable()
    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        gc.enable()
        await pool.aclose()
    return [s.sample() if isinstance(s, _Received) else s for s in samples]


def _address(url: str) -> tuple[str, int]:
    parsed = httpx.URL(url)
    if parsed.host is None or parsed.port is None:
        raise ValueError(f"expected http://host:port, got {url!r}")
    return parsed.host, parsed.port
