"""The server's listening socket, bound before the engine starts (``bind_socket``)."""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from detlora.entrypoints.openai.api_server import bind_socket


def _accepted_socket_options(sock: socket.socket) -> tuple[int, int]:
    """Serve ``sock`` with asyncio, as uvicorn does, and read the accepted connection's
    (protocol, TCP_NODELAY)."""

    async def run() -> tuple[int, int]:
        seen: list[tuple[int, int]] = []

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            conn = writer.get_extra_info("socket")
            seen.append((conn.proto, conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)))
            writer.close()

        server = await asyncio.start_server(handle, sock=sock)
        reader, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        await reader.read()
        writer.close()
        server.close()
        await server.wait_closed()
        return seen[0]

    return asyncio.run(run())


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_connections_to_the_bound_port_send_without_nagle(host):
    """Accepted connections are TCP with TCP_NODELAY: a streamed chunk leaves at once instead
    of waiting for the client's delayed ACK (a socket made with protocol 0 loses this)."""
    sock = bind_socket(host, 0)
    assert sock.getsockname()[1] > 0
    assert _accepted_socket_options(sock) == (socket.IPPROTO_TCP, 1)


def test_a_port_in_use_or_an_unknown_host_names_the_address():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=re.escape(f"cannot listen on 127.0.0.1:{port}: ")):
            bind_socket("127.0.0.1", port)
    with pytest.raises(ValueError,
                       match=re.escape("cannot listen on no-such-host.invalid:8000: ")):
        bind_socket("no-such-host.invalid", 8000)
