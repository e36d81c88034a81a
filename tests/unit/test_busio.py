"""busio.py: dbus-fast's write path with a full send buffer, on real sockets, no bus daemon.

A :class:`uapplace.bus.connection.Bus` is put on one end of a ``socketpair`` whose send
buffer is shrunk to a few KiB, the way ``MessageBus.connect()`` sets a connection
up (socket, fd, then ``self._writer = _MessageWriter(self)``). Nothing reads the
other end until hundreds of KiB are queued, so the kernel answers ``EAGAIN``
over and over; then the other end reads everything and compares it byte for
byte, in order, with what was sent. The same scenario on dbus-fast's own
``MessageBus`` shows the bug the layer exists for (the connection is finalised).
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from dbus_fast import Message
from dbus_fast.aio import MessageBus
from dbus_fast.aio.message_bus import _MessageWriter

from uapplace.bus import connection as busio
from uapplace.bus.peer import PeerListener
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

SMALL_BUFFER = 4096
MESSAGES = 400
PAYLOAD = "x" * 1000
"""400 messages of ~1.1 KiB: ~100 times what the shrunk send buffer holds."""


def adopt(bus: MessageBus, sock: socket.socket) -> None:
    """What ``MessageBus.connect()`` does once its socket is connected and named."""
    sock.setblocking(False)
    bus._sock = sock
    bus._stream = sock.makefile("rwb")
    bus._fd = sock.fileno()
    bus._writer = _MessageWriter(bus)
    bus.unique_name = ":1.test"


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SMALL_BUFFER)
    theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SMALL_BUFFER)
    yield ours, theirs
    ours.close()
    theirs.close()


def signal(index: int) -> Message:
    return Message.new_signal("/org/uap/Test", "org.uap.Test", "Burst", "us", [index, PAYLOAD])


async def drain(sock: socket.socket, expected: int) -> bytes:
    """Read ``expected`` bytes from the far end without blocking the loop."""
    loop = asyncio.get_running_loop()
    sock.setblocking(False)
    data = bytearray()
    async with asyncio.timeout(30):
        while len(data) < expected:
            chunk = await loop.sock_recv(sock, 65536)
            if not chunk:
                break
            data += chunk
    return bytes(data)


async def test_a_full_send_buffer_is_waited_out_and_every_message_arrives_in_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    bus = busio.Bus(bus_address="unix:path=/nonexistent")
    adopt(bus, ours)
    assert busio.is_hardened(bus)  # connect()'s own assignment was turned into ours

    messages = [signal(i) for i in range(MESSAGES)]
    futures = [bus.send(message) for message in messages]
    expected = b"".join(bytes(m._marshall(False)) for m in messages)
    assert len(expected) > 50 * SMALL_BUFFER
    await asyncio.sleep(0)  # the loop has tried to write: the buffer is full by now
    assert bus.connected
    assert not futures[-1].done()

    received = await drain(theirs, len(expected))
    assert received == expected
    await asyncio.wait_for(asyncio.gather(*futures), 10)
    assert bus.connected
    bus.disconnect()


async def test_messages_sent_while_a_write_is_parked_keep_their_order(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    bus = busio.Bus(bus_address="unix:path=/nonexistent")
    adopt(bus, ours)
    first = [signal(i) for i in range(MESSAGES // 2)]
    for message in first:
        bus.send(message)
    await asyncio.sleep(0)
    later = [signal(i) for i in range(MESSAGES // 2, MESSAGES)]
    for message in later:  # queued behind a half-written message
        bus.send(message)
        await asyncio.sleep(0)
    expected = b"".join(bytes(m._marshall(False)) for m in first + later)
    assert await drain(theirs, len(expected)) == expected
    bus.disconnect()


async def test_upstream_writer_loses_the_connection_on_eagain(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The bug itself (python-dbus-next #153): if this ever fails, dbus-fast fixed it and
    busio.OrderedWriter may be retired."""
    ours, _theirs = pair
    bus = MessageBus(bus_address="unix:path=/nonexistent")
    adopt(bus, ours)
    with pytest.raises(OSError):  # once finalised, dbus-fast's send() hits the closed fd
        for i in range(MESSAGES):
            bus.send(signal(i))
    assert not bus.connected
    with pytest.raises(BlockingIOError):
        await asyncio.wait_for(bus.wait_for_disconnect(), 5)  # type: ignore[no-untyped-call]


async def test_a_real_error_still_ends_the_connection_and_fails_every_queued_send(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    ours, theirs = pair
    bus = busio.Bus(bus_address="unix:path=/nonexistent")
    adopt(bus, ours)
    futures = [bus.send(signal(i)) for i in range(MESSAGES)]
    await asyncio.sleep(0)
    theirs.close()  # the other end is gone: the next write is EPIPE/ECONNRESET
    async with asyncio.timeout(10):
        done = await asyncio.gather(*futures, return_exceptions=True)
    failed = [r for r in done if isinstance(r, OSError) and not isinstance(r, BlockingIOError)]
    assert failed, done  # no future is left pending, the unsent ones carry the error
    assert all(r is None or isinstance(r, OSError) for r in done)
    assert not bus.connected
    with pytest.raises(busio.BusClosed, match="closed; Burst not sent"):
        bus.send(signal(0))


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    # AF_UNIX paths are short: keep it under the 107-byte limit.
    runtime = Path(f"/tmp/uap-busio-{os.getpid()}-{tmp_path.name[-12:]}")
    runtime.mkdir(mode=0o700)
    yield runtime / "uapplace" / "bus"
    for item in sorted(runtime.rglob("*"), reverse=True):
        item.rmdir() if item.is_dir() else item.unlink()
    runtime.rmdir()


def echo_forward(
    model: str, client: str, session: str, cells: int, deadline_us: int = 0
) -> tuple[str, str, str, str]:
    """An admit answer that forwards and echoes what it was asked."""
    return ("forward", model, client, session)


@pytest.fixture
async def peer_socket(socket_path: Path) -> AsyncIterator[Path]:
    listener = PeerListener(socket_path, echo_forward)
    await listener.start()
    yield socket_path
    await listener.close()


async def test_connect_gives_a_hardened_connection_that_answers(peer_socket: Path) -> None:
    """``busio.connect`` over a real D-Bus handshake (the peer socket speaks SASL and Hello)."""
    bus = await busio.connect(f"unix:path={peer_socket}")
    try:
        assert busio.is_hardened(bus)
        calls = [
            bus.call(
                Message(
                    destination=BUS_NAME,
                    path=OBJECT_PATH,
                    interface=INTERFACE,
                    member="Admit",
                    signature="sssu",
                    body=[f"m{i}" + PAYLOAD, "c", "s", 1],
                )
            )
            for i in range(MESSAGES)
        ]
        replies = await asyncio.wait_for(asyncio.gather(*calls), 30)
        assert [r.body[1][: len(f"m{i}")] for i, r in enumerate(replies)] == [
            f"m{i}" for i in range(MESSAGES)
        ]
    finally:
        bus.disconnect()


def test_busio_still_finds_the_dbus_fast_internals_it_relies_on() -> None:
    assert type(vars(MessageBus)["_writer"]).__name__ == "member_descriptor"
    assert issubclass(busio.OrderedWriter, _MessageWriter)
    for attribute in ("messages", "buf", "offset", "unix_fds", "fut", "sock", "fd", "loop"):
        assert attribute in _MessageWriter.__init__.__code__.co_names, attribute
