"""The gateway's HTTP/1.1 client for upstream streams: keep-alive connections per replica, parsed in C.

Every request the gateway relays is one POST whose answer is a server-sent event stream. A general
client (httpx over httpcore and h11) spends more per request and per chunk than the relaying itself: it
parses each chunk in Python and, unless a stream is read to its very end, opens a new TCP connection
for the next request. This client is an :class:`asyncio.Protocol` per connection with httptools'
parser (the one uvicorn uses); it keeps connections open per replica and reuses one as soon as its
response has ended, and it stops reading a connection whose reader falls behind (flow control).

:class:`HttpxStreams` offers the same two calls over an ``httpx`` transport: the gateway uses it when
it is given one (in-process fake replicas in tests plug in that way).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
import typing
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Protocol

import httptools
import httpx

IDLE_TIMEOUT_S = 3.0  # below uvicorn's keep-alive timeout (5 s), so the replica never closes it first
MAX_IDLE_PER_HOST = 256
HIGH_WATER_BYTES = 256 * 1024  # buffered and unread: stop reading the socket until the reader catches up
LOW_WATER_BYTES = 64 * 1024
LINGER_S = 1.0  # after [DONE], how long a response may take to end before its connection is dropped


class TransportError(Exception):
    """The connection failed: refused, reset, closed early, or the peer spoke something other than HTTP."""


class StreamResponse(Protocol):
    """An upstream response whose body is read as it arrives."""

    @property
    def status_code(self) -> int: ...

    @property
    def headers(self) -> Mapping[str, str]: ...  # lower-case names

    def aiter_bytes(self) -> AsyncIterator[bytes]: ...

    async def aread(self) -> bytes: ...

    async def aclose(self, *, reuse: bool = False) -> None:
        """Release the connection; ``reuse``: the body was read to its logical end ([DONE]), so the
        connection may serve the next request once the response has ended."""


class StreamClient(Protocol):
    async def post(self, host: str, port: int, path: str, body: bytes, *,
                   headers: Mapping[str, str] | None = None) -> StreamResponse: ...

    async def aclose(self) -> None: ...


# ---- one connection ----------------------------------------------------------------------------
class _Connection(asyncio.Protocol):
    """One TCP connection to a replica; at most one request at a time."""

    def __init__(self, pool: UpstreamPool, key: tuple[str, int]) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser: httptools.HttpResponseParser | None = None
        self._status = 0
        self._headers: dict[str, str] = {}
        self._head: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False
        self._error: TransportError | None = None
        self._got_bytes = False
        self._release_on_end = False
        self._keep_alive = False
        self._linger: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol --
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = typing.cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        if self._parser is None:  # bytes with no request outstanding: the peer is confused; drop it
            self._fail(TransportError(f"unexpected {len(data)} bytes with no request"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"bad HTTP from the replica: {exc}"))

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if not self._ended:
            reason = f"{type(exc).__name__}: {exc}" if exc else "the replica closed the connection"
            self._fail(TransportError(reason))

    # -- httptools callbacks --
    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        assert self._parser is not None
        self._status = self._parser.get_status_code()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > HIGH_WATER_BYTES and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        assert self._parser is not None
        self._ended = True
        keep = self._parser.should_keep_alive()
        self._parser = None
        self._wake()
        if self._release_on_end:
            self._settle(keep)
        else:
            self._keep_alive = keep

    # -- the request --
    async def request(self, head: bytes, body: bytes) -> None:
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._status, self._headers = 0, {}
        self._chunks.clear()
        self._buffered, self._ended, self._error, self._got_bytes = 0, False, None, False
        self._release_on_end, self._keep_alive = False, False
        self._head = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        await self._head

    @property
    def status(self) -> int:
        return self._status

    @property
    def response_headers(self) -> dict[str, str]:
        return self._headers

    @property
    def got_bytes(self) -> bool:
        return self._got_bytes

    async def body(self) -> AsyncIterator[bytes]:
        while True:
            while self._chunks:
                piece = self._chunks.popleft()
                self._buffered -= len(piece)
                if self._paused and self._buffered < LOW_WATER_BYTES and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                yield piece
            if self._ended:
                return
            if self._error is not None:
                raise self._error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def release(self, *, reuse: bool) -> None:
        """Done with this response: pooled again once it has ended, else closed."""
        if self.closed:
            return
        if self._ended:
            self._settle(self._keep_alive and reuse)
        elif reuse and self._error is None:
            self._release_on_end = True  # the final chunk is on its way; wait for it a little
            self._linger = asyncio.get_running_loop().call_later(LINGER_S, self.close)
        else:
            self.close()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.closed = True
            self.transport.close()
        self.pool.forget(self)

    def _settle(self, keep: bool) -> None:
        if self._linger is not None:
            self._linger.cancel()
            self._linger = None
        if keep and not self.closed:
            self.pool.put_back(self)
        else:
            self.close()

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()
        if not self.closed:
            self.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class _PooledResponse:
    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._released = False

    @property
    def status_code(self) -> int:
        return self._conn.status

    @property
    def headers(self) -> Mapping[str, str]:
        return self._conn.response_headers

    def aiter_bytes(self) -> AsyncIterator[bytes]:
        return self._conn.body()

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self._conn.body()])

    async def aclose(self, *, reuse: bool = False) -> None:
        if not self._released:
            self._released = True
            self._conn.release(reuse=reuse)


# ---- the pool ------------------------------------------------------------------------------------
class UpstreamPool:
    """Idle keep-alive connections per (host, port), newest first; a connection per request in flight."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._idle: dict[tuple[str, int], list[_Connection]] = collections.defaultdict(list)
        self._busy: set[_Connection] = set()
        self._clock = clock
        self.opened = 0  # connections opened so far (reuse shows as requests >> opened)

    async def post(self, host: str, port: int, path: str, body: bytes, *,
                   headers: Mapping[str, str] | None = None) -> StreamResponse:
        extra = "".join(f"{name}: {value}\r\n" for name, value in headers.items()) if headers else ""
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream\r\n{extra}Content-Length: {len(body)}\r\n\r\n").encode("latin-1")
        reused = self._take_idle((host, port))
        if reused is not None:
            try:
                return await self._request(reused, head, body)
            except TransportError:
                if reused.got_bytes:  # the replica answered something: not a stale connection
                    raise
                # The replica closed this idle connection as we sent: it never saw the request.
        return await self._request(await self._open((host, port)), head, body)

    @staticmethod
    async def _request(conn: _Connection, head: bytes, body: bytes) -> StreamResponse:
        try:
            await conn.request(head, body)
        except BaseException:
            conn.close()  # no answer yet (timed out, cancelled, broken): nothing else can use it
            raise
        return _PooledResponse(conn)

    async def _open(self, key: tuple[str, int]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, conn = await loop.create_connection(lambda: _Connection(self, key), key[0], key[1])
        except OSError as exc:
            raise TransportError(f"connect to {key[0]}:{key[1]}: {exc.strerror or exc}") from exc
        self.opened += 1
        self._busy.add(conn)
        return conn

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle, cutoff = self._idle.get(key), self._clock() - IDLE_TIMEOUT_S
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since >= cutoff:
                self._busy.add(conn)
                return conn
            conn.close()
        return None

    def put_back(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle[conn.key]
        if len(idle) >= MAX_IDLE_PER_HOST:
            conn.close()
            return
        conn.idle_since = self._clock()
        idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def idle_connections(self) -> int:
        return sum(len(v) for v in self._idle.values())

    def busy_connections(self) -> int:
        return len(self._busy)

    async def aclose(self) -> None:
        for conn in [*self._busy, *(c for idle in self._idle.values() for c in idle)]:
            conn.close()
        self._idle.clear()
        self._busy.clear()


# ---- the same over httpx ---------------------------------------------------------------------------
class _HttpxResponse:
    def __init__(self, response: httpx.Response) -> None:
        self._response = response

    @property
    def status_code(self) -> int:
        return self._response.status_code

    @property
    def headers(self) -> Mapping[str, str]:
        return self._response.headers

    async def aiter_bytes(self) -> AsyncIterator[bytes]:
        try:
            async for piece in self._response.aiter_bytes():
                yield piece
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    async def aread(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self, *, reuse: bool = False) -> None:
        await self._response.aclose()


class HttpxStreams:
    """:class:`StreamClient` over an httpx client (and so over any httpx transport)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    async def post(self, host: str, port: int, path: str, body: bytes, *,
                   headers: Mapping[str, str] | None = None) -> StreamResponse:
        request = self._client.build_request("POST", f"http://{host}:{port}{path}", content=body,
                                             headers={"content-type": "application/json", **(headers or {})})
        try:
            return _HttpxResponse(await self._client.send(request, stream=True))
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.aclose()
