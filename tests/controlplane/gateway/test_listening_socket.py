"""The gateway's (and the API's) listening socket: what every accepted connection inherits from it.

A socket made with protocol 0 instead of ``IPPROTO_TCP`` left Nagle on for every client connection
(asyncio sets ``TCP_NODELAY`` only on sockets whose protocol says TCP): each small write then waited for
the client's delayed ACK, and the gateway process added about 40 ms to every time-to-first-token.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from controlplane.gateway.process import listening_socket


@pytest.mark.parametrize("reuse_port", [True, False])
def test_accepted_connections_send_small_writes_at_once(reuse_port: bool) -> None:
    async def main() -> int:
        sock = listening_socket("127.0.0.1", 0, reuse_port=reuse_port)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def accepted(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            nodelay = await asyncio.wait_for(seen, 10)
            writer.close()
        return nodelay

    assert asyncio.run(main()) != 0, "Nagle is on for client connections: small writes wait for an ACK"
