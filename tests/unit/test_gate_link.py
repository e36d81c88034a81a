"""gate.py's admit link: keep-alive HTTP/1.1 over raw streams, against a scripted server.

Each test's server reads one request at a time and writes the bytes the test gives,
so framing, reuse and the stale-connection retry are seen on the wire
(docs/http-contract.md §1: anything unreadable is *no answer*).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from uapplace.gate import BODY_LIMIT, AdmitLink, GateClient, GateDecision

FORWARD = b'{"decision":"forward","target_id":"gpu0:http://127.0.0.1:8080"}'


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%s\r\n%s" % (len(body), extra, body)


Script = Callable[[int], bytes | None]
"""Request number (from 0) → the bytes to answer; ``None`` closes without answering."""


@dataclass
class ScriptedServer:
    script: Script
    port: int = 0
    connections: int = 0
    requests: list[bytes] = field(default_factory=list)
    writers: list[asyncio.StreamWriter] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                self.requests.append(head + await reader.readexactly(length))
                answer = self.script(len(self.requests) - 1)
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def drop_connections(self) -> None:
        """Close every open connection from the server's side, as an idle timeout does."""
        for writer in self.writers:
            writer.close()


async def start(script: Script) -> tuple[asyncio.Server, ScriptedServer]:
    stub = ScriptedServer(script)
    server = await asyncio.start_server(stub.handle, "127.0.0.1", 0)
    stub.port = server.sockets[0].getsockname()[1]
    return server, stub


async def admit_through(stub: ScriptedServer, count: int = 1) -> list[GateDecision]:
    url = f"http://127.0.0.1:{stub.port}"
    async with GateClient(url, upstream_ids=lambda: ["m"]) as gate:
        return [await gate.admit("m", "c", None, None) for _ in range(count)]


async def test_the_request_on_the_wire() -> None:
    server, stub = await start(lambda _: ok(FORWARD))
    try:
        await admit_through(stub)
    finally:
        server.close()
    head, _, body = stub.requests[0].partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /api/placement/admit HTTP/1.1"
    assert b"Host: 127.0.0.1:%d" % stub.port in lines
    assert b"Content-Type: application/json" in lines
    assert json.loads(body) == {"model_id": "m", "client": "c", "session": None}


async def test_keep_alive_answers_reuse_one_connection() -> None:
    server, stub = await start(lambda _: ok(FORWARD))
    try:
        decisions = await admit_through(stub, 5)
    finally:
        server.close()
    assert {d.source for d in decisions} == {"controller"}
    assert (stub.connections, len(stub.requests)) == (1, 5)


async def test_connection_close_answers_are_not_reused() -> None:
    server, stub = await start(lambda _: ok(FORWARD, b"Connection: close\r\n"))
    try:
        decisions = await admit_through(stub, 3)
    finally:
        server.close()
    assert {d.source for d in decisions} == {"controller"}
    assert stub.connections == 3


async def test_a_pooled_connection_the_server_dropped_is_retried_on_a_new_one() -> None:
    server, stub = await start(lambda _: ok(FORWARD))
    url = f"http://127.0.0.1:{stub.port}"
    try:
        async with GateClient(url, upstream_ids=lambda: []) as gate:
            first = await gate.admit("m", "c", None, None)
            stub.drop_connections()
            await asyncio.sleep(0.05)
            second = await gate.admit("m", "c", None, None)
    finally:
        server.close()
    assert (first.source, second.source) == ("controller", "controller")
    assert stub.connections == 2


async def test_a_server_that_closes_before_answering_a_new_connection_is_no_answer() -> None:
    server, stub = await start(lambda _: None)
    try:
        (decision,) = await admit_through(stub)
    finally:
        server.close()
    assert decision == GateDecision("forward", target_id="default", source="fallback")
    assert stub.connections == 1


async def test_chunked_and_close_framed_answers_are_read() -> None:
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (
        len(FORWARD),
        FORWARD,
    )
    server, stub = await start(lambda n: chunked if n == 0 else None)
    try:
        (decision,) = await admit_through(stub)
    finally:
        server.close()
    assert decision.source == "controller"

    close_framed = b"HTTP/1.0 200 OK\r\n\r\n" + FORWARD
    link = AdmitLink("127.0.0.1", 0, "x", "/")
    server, stub = await start(lambda _: close_framed)
    link.port = stub.port
    try:
        # the scripted server keeps the connection open after a close-framed answer, so
        # the read ends only when the server's side closes
        reading = asyncio.create_task(link.post(b"{}"))
        await asyncio.sleep(0.05)
        stub.drop_connections()
        assert await reading == (200, FORWARD)
    finally:
        await link.close()
        server.close()


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (BODY_LIMIT + 1),
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"a" * 20000 + b"\r\n\r\n",
        ok(b"not json"),
    ],
    ids=["too-long", "unknown-encoding", "bad-length", "http2", "bad-header", "huge-head", "json"],
)
async def test_unreadable_answers_are_no_answer(answer: bytes) -> None:
    server, stub = await start(lambda _: answer)
    try:
        (decision,) = await admit_through(stub)
    finally:
        server.close()
    assert decision == GateDecision("forward", target_id="default", source="fallback")


def test_only_plain_http_urls_get_the_link() -> None:
    assert AdmitLink.for_url("http://127.0.0.1:3847/api/placement/admit") is not None
    assert AdmitLink.for_url("http://[::1]:3847/api/placement/admit") is not None
    for url in (
        "https://127.0.0.1:3847/api/placement/admit",
        "http://u:p@127.0.0.1:3847/api/placement/admit",
        "http://127.0.0.1:3847/api/placement/admit?x=1",
        "http://127.0.0.1:notaport/api/placement/admit",
    ):
        assert AdmitLink.for_url(url) is None, url
