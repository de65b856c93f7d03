"""The gateway's pooled upstream client against scripted HTTP servers on loopback: connections are
reused once a response has ended, never while one is in flight, and every way a connection can fail
comes out as a TransportError (and a stale idle connection is replaced without the caller noticing)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from controlplane.gateway.upstream_http import TransportError, UpstreamPool
from inference.launcher import free_port

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[bool]]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS = [b"data: {\"n\": 1}\n\n", b"data: {\"n\": 2}\n\n", b"data: [DONE]\n\n"]


async def read_request(reader: asyncio.StreamReader) -> bytes | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return await reader.readexactly(length)


class Server:
    """Counts connections and requests; ``handler`` answers one request (False: close the connection)."""

    def __init__(self, handler: Handler) -> None:
        self.handler, self.connections, self.requests = handler, 0, 0
        self.port = free_port()
        self.closed = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while await read_request(reader) is not None:
                self.requests += 1
                if not await self.handler(reader, writer, self.requests):
                    break
        finally:
            writer.close()
            self.closed.set()

    async def __aenter__(self) -> Server:
        self._server = await asyncio.start_server(self.serve, "127.0.0.1", self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()


async def stream_all(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
    writer.write(HEAD + b"".join(chunk(e) for e in EVENTS) + b"0\r\n\r\n")
    await writer.drain()
    return True


async def body_of(pool: UpstreamPool, port: int, *, reuse: bool = True) -> bytes:
    response = await pool.post("127.0.0.1", port, "/v1/completions", b'{"prompt": "x"}')
    assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
    data = b"".join([piece async for piece in response.aiter_bytes()])
    await response.aclose(reuse=reuse)
    return data


def test_sequential_streams_share_one_connection() -> None:
    async def run() -> None:
        pool = UpstreamPool()
        async with Server(stream_all) as server:
            for _ in range(5):
                assert await body_of(pool, server.port) == b"".join(EVENTS)
            assert (server.requests, server.connections, pool.opened) == (5, 1, 1)
        await pool.aclose()

    asyncio.run(run())


def test_concurrent_streams_each_get_a_connection_then_return_to_the_pool() -> None:
    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + chunk(EVENTS[0]))
        await asyncio.sleep(0.2)
        writer.write(chunk(EVENTS[2]) + b"0\r\n\r\n")
        return True

    async def run() -> None:
        pool = UpstreamPool()
        async with Server(slow) as server:
            await asyncio.gather(*(body_of(pool, server.port) for _ in range(4)))
            assert (server.connections, pool.idle_connections()) == (4, 4)
            await asyncio.gather(*(body_of(pool, server.port) for _ in range(4)))
            assert (server.connections, server.requests) == (4, 8)
        await pool.aclose()

    asyncio.run(run())


def test_a_connection_released_at_done_is_reused_once_the_final_chunk_arrives() -> None:
    async def late_end(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + b"".join(chunk(e) for e in EVENTS))
        await asyncio.sleep(0.1)  # the terminating chunk comes after the client has stopped reading
        writer.write(b"0\r\n\r\n")
        return True

    async def run() -> None:
        pool = UpstreamPool()
        async with Server(late_end) as server:
            response = await pool.post("127.0.0.1", server.port, "/v1/completions", b"{}")
            pieces = response.aiter_bytes()
            seen = b""
            while not seen.endswith(b"[DONE]\n\n"):
                seen += await anext(pieces)
            await response.aclose(reuse=True)
            assert pool.idle_connections() == 0  # not before the response has ended
            await asyncio.sleep(0.3)
            assert pool.idle_connections() == 1
            assert await body_of(pool, server.port) == b"".join(EVENTS)
            assert server.connections == 1
        await pool.aclose()

    asyncio.run(run())


def test_abandoning_a_stream_closes_its_connection() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD)
        try:
            while True:
                writer.write(chunk(EVENTS[0]))
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            return False

    async def run() -> None:
        pool = UpstreamPool()
        async with Server(endless) as server:
            response = await pool.post("127.0.0.1", server.port, "/v1/completions", b"{}")
            await anext(response.aiter_bytes())
            await response.aclose()  # a client that left mid-stream: the replica must see it
            await asyncio.wait_for(server.closed.wait(), 5)
            assert pool.idle_connections() == 0
        await pool.aclose()

    asyncio.run(run())


def test_a_request_given_up_before_its_headers_closes_its_connection() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await reader.read()  # a hung replica: reads the request, answers nothing, until the client leaves
        return False

    async def run() -> None:
        pool = UpstreamPool()
        async with Server(silent) as server:
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):  # the gateway's header timeout, or a move elsewhere
                    await pool.post("127.0.0.1", server.port, "/v1/completions", b"{}")
            await asyncio.wait_for(server.closed.wait(), 5)  # the replica sees the client gone
            assert pool.idle_connections() == pool.busy_connections() == 0
        await pool.aclose()

    asyncio.run(run())


def test_a_connection_reset_mid_body_is_a_transport_error() -> None:
    async def dies(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(HEAD + chunk(EVENTS[0]))
        await writer.drain()
        return False  # close without the rest

    async def run() -> None:
        pool = UpstreamPool()
        async with Server(dies) as server:
            response = await pool.post("127.0.0.1", server.port, "/v1/completions", b"{}")
            with pytest.raises(TransportError, match="closed the connection"):
                async for _ in response.aiter_bytes():
                    pass
            await response.aclose(reuse=True)
            assert pool.idle_connections() == 0
        await pool.aclose()

    asyncio.run(run())


def test_an_idle_connection_the_replica_closed_is_replaced_transparently() -> None:
    async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        await stream_all(reader, writer, n)
        return False  # like a keep-alive timeout: the server closes the idle connection

    async def run() -> None:
        pool = UpstreamPool()
        async with Server(one_per_connection) as server:
            for _ in range(3):
                assert await body_of(pool, server.port) == b"".join(EVENTS)
            assert server.connections == 3 and server.requests == 3
        await pool.aclose()

    asyncio.run(run())


def test_refused_and_garbled_connections_are_transport_errors() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(b"SSH-2.0-OpenSSH\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)
        return False

    async def run() -> None:
        pool = UpstreamPool()
        with pytest.raises(TransportError, match=r"connect to 127\.0\.0\.1"):
            await pool.post("127.0.0.1", free_port(), "/v1/completions", b"{}")
        async with Server(garbage) as server:
            with pytest.raises(TransportError, match="bad HTTP"):
                await pool.post("127.0.0.1", server.port, "/v1/completions", b"{}")
        await pool.aclose()

    asyncio.run(run())


def test_error_statuses_are_read_whole() -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        body = b'{"error": {"message": "busy"}}'
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\nretry-after: 3\r\ncontent-length: %d\r\n\r\n"
                     % len(body) + body)
        return True

    async def run() -> None:
        pool = UpstreamPool()
        async with Server(refuse) as server:
            response = await pool.post("127.0.0.1", server.port, "/v1/completions", b"{}")
            assert (response.status_code, response.headers["retry-after"]) == (429, "3")
            assert await response.aread() == b'{"error": {"message": "busy"}}'
            await response.aclose(reuse=True)
            assert pool.idle_connections() == 1
        await pool.aclose()

    asyncio.run(run())
