"""peerlink.py: the shim's own ``AdmitBy`` client on the peer socket, byte for byte and live.

The wire format is checked against dbus-fast's own marshalling (the daemon's end reads
and writes with dbus-fast); the link is driven against a real
:class:`uapplace.bus.peer.PeerListener` in the test's loop, as the shim drives it.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from dbus_fast import Message
from dbus_fast.errors import DBusError

from tests.worlds.peer_socket import listening, short_socket_path
from uapplace.bus.client import PlacementError
from uapplace.bus.peer import PeerListener, PeerRefused
from uapplace.bus.peerlink import (
    MalformedMessage,
    PeerAdmitLink,
    PeerLinkLost,
    ReplyReader,
    admit_by_message,
)
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

TARGET = "gpu0:http://127.0.0.1:8080"


def admit_by(serial: int, body: list[object]) -> Message:
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member="AdmitBy",
        signature="sssut",
        body=body,
        serial=serial,
    )


def wire(message: Message) -> bytes:
    return bytes(message._marshall(False))


# --------------------------------------------------------------------------- the bytes


@pytest.mark.parametrize(
    "body",
    [
        ["alpha", "x-uap-client-id:bench", "bench-session", 4096, 123_456_789_012],
        ["m", "", "", 1, 0],
        ["modèle-ü", "clïent", "sé", 2**32 - 1, 2**64 - 1],
        ["a" * 1024, "b" * 128, "c" * 3, 7, 1],
    ],
)
def test_a_call_is_what_dbus_fast_would_write(body: list[object]) -> None:
    model, client, session, cells, deadline = body
    assert isinstance(model, str) and isinstance(client, str) and isinstance(session, str)
    assert isinstance(cells, int) and isinstance(deadline, int)
    ours = admit_by_message(41, model, client, session, cells, deadline)
    assert ours == wire(admit_by(41, body))


def replies() -> tuple[bytes, bytes]:
    call = admit_by(9, ["alpha", "c", "", 1, 5])
    forward = Message.new_method_return(call, "ssss", ["forward", TARGET, "", ""])
    forward.serial = 100
    failed = Message.new_error(call, "org.uap.Placement1.Error.Failed", "boom é")
    failed.serial = 101
    return wire(forward), wire(failed)


def test_replies_are_read_however_the_stream_is_cut() -> None:
    forward, failed = replies()
    stream = forward + failed
    reader = ReplyReader()
    byte_by_byte = [r for i in range(len(stream)) for r in reader.feed(stream[i : i + 1])]
    at_once = ReplyReader().feed(stream)
    for got in (byte_by_byte, at_once):
        assert [(r.reply_serial, r.error_name, r.values) for r in got] == [
            (9, None, ["forward", TARGET, "", ""]),
            (9, "org.uap.Placement1.Error.Failed", ["boom é"]),
        ]


def big_endian_return(reply_serial: int, values: list[str]) -> bytes:
    """A ``METHOD_RETURN`` of strings, written big-endian by hand (dbus-fast writes little)."""
    signature = ("s" * len(values)).encode()
    fields = b"\x05\x01u\x00" + struct.pack(">I", reply_serial)
    fields += b"\x08\x01g\x00" + bytes([len(signature)]) + signature + b"\x00"
    body = b""
    for value in values:
        raw = value.encode()
        body += b"\x00" * (-len(body) % 4) + struct.pack(">I", len(raw)) + raw + b"\x00"
    head = b"B\x02\x00\x01" + struct.pack(">III", len(body), 77, len(fields)) + fields
    return head + b"\x00" * (-len(head) % 8) + body


def test_a_big_endian_reply_and_a_signal_between() -> None:
    signal = Message.new_signal(OBJECT_PATH, INTERFACE, "Parked", "s", ["x"])
    signal.serial = 8
    stream = wire(signal) + big_endian_return(3, ["park", "", "plc-1", "nö_room"])
    reader = ReplyReader()
    assert reader.feed(stream[:-1]) == []  # a message short of its last byte waits for it
    got = reader.feed(stream[-1:])
    assert [(r.reply_serial, r.error_name, r.values) for r in got] == [
        (3, None, ["park", "", "plc-1", "nö_room"])
    ]


@pytest.mark.parametrize(
    ("stream", "why"),
    [
        (b"X" + bytes(15), "byte order"),
        (b"l\x02\x00\x01" + (2**21).to_bytes(4, "little") + bytes(8), "bytes"),
    ],
)
def test_a_stream_no_daemon_sends_is_refused(stream: bytes, why: str) -> None:
    with pytest.raises(MalformedMessage, match=why):
        ReplyReader().feed(stream)


def test_a_reply_of_other_types_is_refused() -> None:
    call = admit_by(3, ["alpha", "c", "", 1, 5])
    reply = Message.new_method_return(call, "su", ["x", 1])
    reply.serial = 4
    with pytest.raises(MalformedMessage, match="strings only"):
        ReplyReader().feed(wire(reply))


# --------------------------------------------------------------------------- live


def answer(
    model: str, client: str, session: str, cells: int, deadline_us: int = 0
) -> tuple[str, str, str, str]:
    if model == "explode":
        raise DBusError("org.uap.Placement1.Error.Failed", "internal error: boom")
    if model == "alpha":
        return ("forward", f"{TARGET}/{client}", "", "")
    return ("park", "", f"plc-{cells}", f"{client}:{session}:{deadline_us}")


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    with short_socket_path(tmp_path, "uap-link") as path:
        yield path


@pytest.fixture
async def listener(socket_path: Path) -> AsyncIterator[PeerListener]:
    async with listening(socket_path, answer) as served:
        yield served


@pytest.fixture
async def link(listener: PeerListener) -> AsyncIterator[PeerAdmitLink]:
    opened = await PeerAdmitLink.open(listener.path, os.getpid())
    yield opened
    opened.close()


async def test_forward_park_and_the_daemons_error(link: PeerAdmitLink) -> None:
    forward = await link.admit("alpha", "c1", "", 1, deadline_us=99)
    park = await link.admit("beta", "clïent", "s", 40000, deadline_us=123_456_789_012)
    no_deadline = await link.admit("beta", "c", "", 2)
    with pytest.raises(PlacementError) as raised:
        await link.admit("explode", "c", "", 1)
    assert forward == {"decision": "forward", "target_id": f"{TARGET}/c1"}
    assert park == {
        "decision": "park",
        "placement_id": "plc-40000",
        "reason": "clïent:s:123456789012",
    }
    assert no_deadline["reason"] == "c::0"
    assert (raised.value.short, raised.value.message) == ("Failed", "internal error: boom")
    assert link.connected


async def test_concurrent_admits_each_get_their_own_answer(link: PeerAdmitLink) -> None:
    clients = [f"c{i}" for i in range(64)]
    answers = await asyncio.gather(*(link.admit("alpha", c, "", 1) for c in clients))
    assert [a["target_id"] for a in answers] == [f"{TARGET}/{c}" for c in clients]
    assert link.connected


async def test_a_listener_that_is_not_the_owner_is_refused(listener: PeerListener) -> None:
    with pytest.raises(PeerRefused, match=f"but uapplaced on the bus is pid {os.getpid() + 1}"):
        await PeerAdmitLink.open(listener.path, os.getpid() + 1)


async def test_a_directory_others_can_enter_is_refused(listener: PeerListener) -> None:
    listener.path.parent.chmod(0o755)
    try:
        with pytest.raises(PeerRefused, match="mode 0700"):
            await PeerAdmitLink.open(listener.path, os.getpid())
    finally:
        listener.path.parent.chmod(0o700)


async def test_a_daemon_that_hangs_up_fails_the_calls_in_flight(
    listener: PeerListener, link: PeerAdmitLink
) -> None:
    await link.admit("alpha", "c", "", 1)
    listener.drop_peers()
    with pytest.raises(PeerLinkLost):
        async with asyncio.timeout(5):
            while True:  # the hang-up arrives on its own; the next call sees it
                await link.admit("alpha", "c", "", 1)
    assert not link.connected


async def test_closing_fails_what_waits_and_refuses_more(link: PeerAdmitLink) -> None:
    waiting = asyncio.ensure_future(link.admit("alpha", "c", "", 1))
    await asyncio.sleep(0)
    link.close()
    with pytest.raises(PeerLinkLost):
        await waiting
    with pytest.raises(PeerLinkLost, match="down"):
        await link.admit("alpha", "c", "", 1)


async def test_a_reply_that_is_not_a_reply_ends_the_link(link: PeerAdmitLink) -> None:
    waiting = asyncio.ensure_future(link.admit("alpha", "c", "", 1))
    await asyncio.sleep(0)
    link.data_received(b"X" + bytes(15))
    with pytest.raises(PeerLinkLost, match="byte order"):
        await waiting
    assert not link.connected


async def test_the_listener_serves_dbus_fast_and_the_link_alike(listener: PeerListener) -> None:
    """The handshake the link speaks (no Hello, no fd negotiation) is one the listener takes."""
    first = await PeerAdmitLink.open(listener.path, os.getpid())
    second = await PeerAdmitLink.open(listener.path, os.getpid())
    try:
        got = await asyncio.gather(
            first.admit("alpha", "one", "", 1), second.admit("alpha", "two", "", 1)
        )
        assert listener.peers == 2
    finally:
        first.close()
        second.close()
    assert [g["target_id"] for g in got] == [f"{TARGET}/one", f"{TARGET}/two"]
