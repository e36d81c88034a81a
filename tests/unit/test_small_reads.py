"""Reads of at most 16 KiB: the shim's client connections and the gate's admit link.

asyncio's socket transport reads with ``recv(max_size)`` (256 KiB), allocating that much
per read; both the shim (``uapplace.shim.app.small_reads``) and the gate's
``AdmitLink`` lower it on their connections (docs/performance.md, "Reads of 256 KiB").
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from uapplace.gate import READ_SIZE as GATE_READ_SIZE
from uapplace.gate import AdmitLink
from uapplace.shim.app import READ_SIZE, small_reads


async def test_a_transport_reads_in_small_pieces_after_the_first_request() -> None:
    ours, theirs = socket.socketpair()
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=ours)
    try:
        assert getattr(transport, "max_size", 0) > READ_SIZE  # asyncio's own default
        small_reads(transport)
        assert getattr(transport, "max_size", 0) == READ_SIZE == 16 * 1024
        small_reads(None)  # a request whose connection is already gone: nothing to do
    finally:
        transport.close()
        theirs.close()


async def test_the_gates_admit_link_reads_in_small_pieces(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answer = b'{"decision":"forward","target_id":"t"}'
    transports: list[asyncio.BaseTransport] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(answer), answer))
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = AdmitLink("127.0.0.1", port, f"127.0.0.1:{port}", "/api/placement/admit")
    real_open = asyncio.open_connection

    async def watched_open(
        *args: object, **kwargs: object
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await real_open(*args, **kwargs)  # type: ignore[arg-type]
        transports.append(writer.transport)
        return reader, writer

    monkeypatch.setattr(asyncio, "open_connection", watched_open)
    try:
        assert await link.post(b"{}") == (200, answer)
    finally:
        await link.close()
        server.close()
    assert [getattr(t, "max_size", 0) for t in transports] == [GATE_READ_SIZE]
