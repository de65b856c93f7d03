"""One upstream replica stream as the gateway reads it, and the client response that always cleans up.

Every way an upstream stream can fail (stall, reset, early end, error frame, bad JSON) comes out of
:class:`Upstream` as an :class:`UpstreamError`, in this one place."""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import orjson
from fastapi.responses import Response

from controlplane.gateway.errors import UpstreamError
from controlplane.gateway.upstream_http import StreamClient, StreamResponse, TransportError
from controlplane.replicas import ReplicaEndpoint

logger = logging.getLogger(__name__)

# ---- one upstream stream ---------------------------------------------------------------------
class Upstream:
    """A replica's SSE response; every way it can fail comes out as :class:`UpstreamError`.

    Reads are timed without a timer per read: one timer per stream, armed when the first read waits,
    wakes when the oldest wait could have run out, and re-arms itself for the wait under way; a wait
    that reached the timeout cancels the reading task, which the read turns into a ``stall``. Time the
    reader spends elsewhere (writing to a slow client) is not silence."""

    def __init__(self, endpoint: ReplicaEndpoint, response: StreamResponse,
                 on_close: Callable[[str], None]) -> None:
        self.endpoint = endpoint
        self.response = response
        self._pieces = aiter(response.aiter_bytes())
        self._partial = b""  # the start of a line whose end has not arrived
        self._payloads: collections.deque[bytes] = collections.deque()  # data of events not yet read
        self._primed: dict[str, Any] | None = None
        self._on_close = on_close
        self._closed = False
        self._done = False  # [DONE] read: the connection may serve another request
        self._loop = asyncio.get_running_loop()
        self._timer: asyncio.TimerHandle | None = None
        self._reader: asyncio.Task[Any] | None = None
        self._waiting_since: float | None = None  # loop time the read under way started
        self._timeout = 0.0
        self._timed_out = False

    @property
    def replica_id(self) -> str:
        return self.endpoint.replica_id

    async def prime(self, timeout: float) -> None:
        """Wait for the first event (the first token), so failures before it can still be retried."""
        self._primed = await self.next_event(timeout)

    async def next_event(self, timeout: float) -> dict[str, Any] | None:
        """The next ``data:`` payload; None for ``[DONE]``. ``timeout``: the longest silence allowed."""
        if self._primed is not None:
            event, self._primed = self._primed, None
            return event
        while not self._payloads:
            await self._read(timeout)
        data = self._payloads.popleft()
        if data == b"[DONE]":
            self._done = True
            return None
        return self._event(data)

    @property
    def has_buffered(self) -> bool:
        """Whether an event has arrived that :meth:`next_event` returns without waiting."""
        return self._primed is not None or bool(self._payloads)

    async def _read(self, timeout: float) -> None:
        """One piece of the body, split into events."""
        rid = self.replica_id
        self._timeout, self._waiting_since = timeout, self._loop.time()
        self._reader = asyncio.current_task()  # the task the timer cancels: whichever reads now
        due = self._waiting_since + timeout
        if self._timer is None or self._timer.when() > due:  # none yet, or set by a longer timeout
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self._loop.call_at(due, self._check_silence)
        try:
            piece = await anext(self._pieces)
        except asyncio.CancelledError:
            if self._timed_out and self._reader is not None and self._reader.uncancel() == 0:
                raise UpstreamError(rid, "stall", f"no data for {timeout:g}s") from None
            raise
        except StopAsyncIteration as exc:
            raise UpstreamError(rid, "closed", "the stream ended before [DONE]") from exc
        except TransportError as exc:
            raise UpstreamError(rid, "broken", str(exc)) from exc
        finally:
            self._waiting_since = None
        lines = (self._partial + piece).split(b"\n")
        self._partial = lines.pop()
        self._payloads.extend(line[5:].strip() for line in lines if line.startswith(b"data:"))

    def _check_silence(self) -> None:
        self._timer = None
        since = self._waiting_since
        if self._closed or since is None:
            return  # no read waits now: the next one arms the timer again
        if self._loop.time() - since >= self._timeout and self._reader is not None:
            self._timed_out = True
            self._reader.cancel()
        else:
            self._timer = self._loop.call_at(since + self._timeout, self._check_silence)

    def _event(self, data: bytes) -> dict[str, Any]:
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(self.replica_id, "bad_frame", f"not JSON: {data[:80]!r}") from exc
        if not isinstance(event, dict):
            raise UpstreamError(self.replica_id, "bad_frame", f"not a JSON object: {data[:80]!r}")
        if "error" in event:
            message = (event.get("error") or {}).get("message", "error frame")
            raise UpstreamError(self.replica_id, "error_frame", str(message), body=event)
        return event

    async def aclose(self) -> None:
        """Idempotent; the bookkeeping first, then the socket (shielded: this runs during cancellation)."""
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._on_close(self.replica_id)
        with anyio.CancelScope(shield=True):
            await self.response.aclose(reuse=self._done)


class EventStreamResponse(Response):
    """A server-sent event stream written straight to the ASGI server, in the task that serves the
    request, and always closed with ``on_close``, whether it ended, failed or the client left.

    Starlette's StreamingResponse runs every response in an anyio task group of two tasks (the stream
    and a disconnect listener): per request that costs more than relaying the tokens does. Here the
    stream runs in the request's own task, and one plain callback on a pending ``receive()`` cancels it
    when the client disconnects."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], *, on_close: Callable[[], Awaitable[None]],
                 headers: Mapping[str, str]) -> None:
        self.content = content
        self.on_close = on_close
        self.status_code = 200
        self.background = None
        self.init_headers(dict(headers))

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        task = asyncio.current_task()
        assert task is not None
        state = {"done": False, "left": False}

        def on_receive(message: asyncio.Future[Any]) -> None:
            if state["done"] or message.cancelled() or message.exception() is not None:
                return
            if message.result().get("type") == "http.disconnect":
                state["left"] = True
                task.cancel()

        listener = asyncio.ensure_future(receive())
        listener.add_done_callback(on_receive)
        ended = False
        try:
            start = {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
            await send(start)
            async for chunk in self.content:
                last = chunk.endswith(DONE_EVENT)  # the end of the body goes in the same write
                if last:
                    state["done"] = True
                await send({"type": "http.response.body", "body": chunk, "more_body": not last})
                if last:
                    break
            else:
                state["done"] = True
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            ended = True
        except asyncio.CancelledError:
            if not state["left"] or task.uncancel() > 0:  # cancelled for another reason: go on with it
                raise
        finally:
            state["done"] = True
            listener.cancel()
            if ended:
                await self.on_close()
            else:
                with anyio.CancelScope(shield=True):
                    await self.on_close()


DONE_EVENT = b"data: [DONE]\n\n"  # OpenAI's last event of a stream


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def open_stream(streams: StreamClient, endpoint: ReplicaEndpoint, path: str, body: dict[str, Any], *,
                      wait_s: float, refusal_timeout_s: float,
                      headers: Mapping[str, str] | None = None) -> StreamResponse:
    """POST (with ``headers``: a traceparent) and wait for the status line (at most ``wait_s``);
    transport failures and refusals become :class:`UpstreamError`, a refusal carrying the replica's
    OpenAI-shaped body."""
    rid = endpoint.replica_id
    try:
        async with asyncio.timeout(wait_s):
            response = await streams.post(endpoint.host, endpoint.port, path, orjson.dumps(body),
                                          headers=headers)
    except TimeoutError as exc:
        raise UpstreamError(rid, "timeout", f"no response within {wait_s:g}s") from exc
    except TransportError as exc:
        raise UpstreamError(rid, "connect", str(exc)) from exc
    if response.status_code == 200:
        return response
    raise await _refusal(rid, response, refusal_timeout_s)


async def _refusal(replica_id: str, response: StreamResponse, timeout_s: float) -> UpstreamError:
    status = response.status_code
    try:
        async with asyncio.timeout(timeout_s):
            raw = await response.aread()
        body: Any = orjson.loads(raw)
    except (TimeoutError, TransportError, ValueError):
        body = None
    finally:
        await response.aclose()
    return UpstreamError(replica_id, f"status_{status}", f"HTTP {status} {error_message(body)}".strip(),
                         status=status, body=body, retry_after=response.headers.get("retry-after"))


def error_message(body: Any) -> str:
    """The message of an OpenAI-shaped error body ("" when it is not one)."""
    error = body.get("error") if isinstance(body, dict) else None
    return str(error.get("message", "")) if isinstance(error, dict) else ""
