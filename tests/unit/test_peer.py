"""peer.py: the Admit-only peer-to-peer D-Bus socket, with real sockets and dbus-fast clients.

No bus daemon is needed: the listener runs in the test's loop, clients connect
to its socket exactly as the shim does (dbus-fast, ``EXTERNAL`` auth, ``Hello``),
or speak raw SASL bytes to check the handshake line by line.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag
from dbus_fast.errors import DBusError

from tests.worlds.peer_socket import listening, short_socket_path
from uapplace.bus.peer import PeerListener, PeerRefused, connect_peer
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

FORWARD = ("forward", "gpu0:http://127.0.0.1:8080", "", "")


def answer(
    model: str, client: str, session: str, cells: int, deadline_us: int = 0
) -> tuple[str, str, str, str]:
    if model == "explode":
        raise DBusError("org.uap.Placement1.Error.Failed", "internal error: boom")
    return FORWARD if model == "alpha" else ("park", "", "plc-0a1b2c", f"{client}:{cells}")


@pytest.fixture
def socket_path(tmp_path: Path) -> Iterator[Path]:
    with short_socket_path(tmp_path, "uap-peer") as path:
        yield path


@pytest.fixture
async def listener(socket_path: Path) -> AsyncIterator[PeerListener]:
    async with listening(socket_path, answer) as served:
        yield served


def call(member: str, signature: str = "", body: list[object] | None = None) -> Message:
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member=member,
        signature=signature,
        body=body or [],
    )


async def connected(path: Path) -> MessageBus:
    return await MessageBus(bus_address=f"unix:path={path}").connect()


# --------------------------------------------------------------------------- serving


async def test_admit_is_answered_over_the_socket(listener: PeerListener) -> None:
    bus = await connected(listener.path)
    try:
        forward = await bus.call(call("Admit", "sssu", ["alpha", "c", "", 1]))
        park = await bus.call(call("Admit", "sssu", ["beta", "cli", "s", 40000]))
    finally:
        bus.disconnect()
    assert forward is not None and park is not None
    assert forward.message_type is MessageType.METHOD_RETURN
    assert (forward.signature, forward.body) == ("ssss", list(FORWARD))
    assert park.body == ["park", "", "plc-0a1b2c", "cli:40000"]
    assert bus.unique_name is not None and bus.unique_name.startswith(":uapplace.bus.peer")


async def test_an_admit_that_asks_no_reply_is_taken_and_answered_with_nothing(
    socket_path: Path,
) -> None:
    seen: list[str] = []

    def recording(
        model: str, client: str, session: str, cells: int, deadline_us: int = 0
    ) -> tuple[str, str, str, str]:
        seen.append(model)
        return FORWARD

    async with listening(socket_path, recording) as served:
        bus = await connected(served.path)
        replies: list[Message] = []
        bus.add_message_handler(lambda m: replies.append(m) if m.reply_serial else None)
        try:
            quiet = call("Admit", "sssu", ["quiet", "c", "", 1])
            quiet.flags = MessageFlag.NO_REPLY_EXPECTED
            await bus.send(quiet)
            answered = await bus.call(call("Admit", "sssu", ["alpha", "c", "", 1]))
        finally:
            bus.disconnect()
    assert seen == ["quiet", "alpha"]  # the quiet one was taken, first
    assert answered is not None and answered.body == list(FORWARD)
    assert [r.reply_serial for r in replies] == [answered.reply_serial]  # none for "quiet"


async def test_an_error_from_admit_is_its_named_error(listener: PeerListener) -> None:
    bus = await connected(listener.path)
    try:
        reply = await bus.call(call("Admit", "sssu", ["explode", "c", "", 1]))
    finally:
        bus.disconnect()
    assert reply is not None and reply.message_type is MessageType.ERROR
    assert (reply.error_name, reply.body) == (
        "org.uap.Placement1.Error.Failed",
        ["internal error: boom"],
    )


@pytest.mark.parametrize(
    ("member", "signature", "body"),
    [
        ("Apply", "sus", ["plc-000000", 1, ""]),
        ("GetState", "", []),
        ("Admit", "ss", ["alpha", "c"]),
    ],
)
async def test_everything_but_admit_is_access_denied(
    listener: PeerListener, member: str, signature: str, body: list[object]
) -> None:
    bus = await connected(listener.path)
    try:
        reply = await bus.call(call(member, signature, body))
    finally:
        bus.disconnect()
    assert reply is not None and reply.message_type is MessageType.ERROR
    assert reply.error_name == "org.freedesktop.DBus.Error.AccessDenied"
    assert f"{INTERFACE}.{member} on the user bus" in reply.body[0]


async def test_the_socket_is_private(listener: PeerListener) -> None:
    assert listener.path.stat().st_mode & 0o777 == 0o600
    assert listener.path.parent.stat().st_mode & 0o777 == 0o700


async def test_a_peer_that_leaves_is_forgotten_quietly(
    listener: PeerListener, caplog: pytest.LogCaptureFixture
) -> None:
    bus = await connected(listener.path)
    await bus.call(call("Admit", "sssu", ["alpha", "c", "", 1]))
    assert listener.peers == 1
    bus.disconnect()
    async with asyncio.timeout(10):
        while True:  # nothing signals the listener's bookkeeping: poll it
            if listener.peers == 0:
                break
            await asyncio.sleep(0.01)
    assert [r for r in caplog.records if r.levelname in ("WARNING", "ERROR")] == []


async def test_close_drops_peers_and_removes_the_socket(listener: PeerListener) -> None:
    bus = await connected(listener.path)
    await bus.call(call("Admit", "sssu", ["alpha", "c", "", 1]))
    assert listener.peers == 1
    await listener.close()
    with pytest.raises(EOFError):  # dbus-fast's word for "the other end closed"
        async with asyncio.timeout(10):
            await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]
    assert not bus.connected
    assert not await asyncio.to_thread(listener.path.exists)


# --------------------------------------------------------------------------- where it listens


async def test_a_directory_others_can_enter_turns_it_off(socket_path: Path) -> None:
    socket_path.parent.mkdir(mode=0o755)
    socket_path.parent.chmod(0o755)
    with pytest.raises(PeerRefused, match="mode 0700"):
        await PeerListener(socket_path, answer).start()
    assert not await asyncio.to_thread(os.path.lexists, socket_path)


async def test_a_stale_socket_is_replaced(socket_path: Path) -> None:
    socket_path.parent.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as dead:
        dead.bind(str(socket_path))
    served = PeerListener(socket_path, answer)
    await served.start()
    try:
        bus = await connected(socket_path)
        reply = await bus.call(call("Admit", "sssu", ["alpha", "c", "", 1]))
        bus.disconnect()
    finally:
        await served.close()
    assert reply is not None and reply.body == list(FORWARD)


async def test_a_live_socket_is_not_taken_over(listener: PeerListener) -> None:
    with pytest.raises(PeerRefused, match="another process is listening"):
        await PeerListener(listener.path, answer).start()
    bus = await connected(listener.path)
    bus.disconnect()


@pytest.fixture
def not_a_socket(socket_path: Path) -> Path:
    socket_path.parent.mkdir(mode=0o700)
    socket_path.write_text("mine")
    return socket_path


async def test_a_file_that_is_not_a_socket_is_left_alone(not_a_socket: Path) -> None:
    with pytest.raises(PeerRefused, match="not a socket"):
        await PeerListener(not_a_socket, answer).start()
    assert await asyncio.to_thread(not_a_socket.read_text) == "mine"


# --------------------------------------------------------------------------- the handshake


class RawClient:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_unix_connection(str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.writer is not None
        self.writer.close()

    async def send(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()

    async def line(self) -> bytes:
        assert self.reader is not None
        async with asyncio.timeout(10):
            return await self.reader.readline()

    async def closed(self) -> bool:
        """The server hung up (a reset, when it left our bytes unread)."""
        assert self.reader is not None
        try:
            async with asyncio.timeout(10):
                return await self.reader.read() == b""
        except ConnectionResetError:
            return True


def uid_hex() -> bytes:
    return str(os.getuid()).encode().hex().encode()


async def test_begin_and_the_first_message_in_one_packet(listener: PeerListener) -> None:
    """Not one byte of the Hello that follows BEGIN may be eaten by the handshake."""
    hello = Message(
        destination="org.freedesktop.DBus",
        path="/org/freedesktop/DBus",
        interface="org.freedesktop.DBus",
        member="Hello",
        serial=1,
    )
    async with RawClient(listener.path) as client:
        await client.send(b"\0AUTH EXTERNAL\r\n")
        assert await client.line() == b"DATA\r\n"
        await client.send(b"DATA\r\n")
        assert await client.line() == f"OK {listener.guid}\r\n".encode()
        await client.send(b"BEGIN\r\n" + bytes(hello._marshall(False)))
        assert client.reader is not None
        async with asyncio.timeout(10):
            reply = await client.reader.read(4096)
    assert b":uapplace.bus.peer" in reply


async def test_another_mechanism_is_rejected(listener: PeerListener) -> None:
    async with RawClient(listener.path) as client:
        await client.send(b"\0AUTH ANONYMOUS 0\r\n")
        assert await client.line() == b"REJECTED EXTERNAL\r\n"
        await client.send(b"AUTH EXTERNAL " + uid_hex() + b"\r\n")
        assert (await client.line()).startswith(b"OK ")


async def test_data_before_auth_is_rejected(listener: PeerListener) -> None:
    async with RawClient(listener.path) as client:
        await client.send(b"\0DATA\r\n")
        assert await client.line() == b"REJECTED EXTERNAL\r\n"
        await client.send(b"BEGIN\r\n")
        assert await client.closed()


@pytest.mark.parametrize(
    "opening",
    [
        b"\0AUTH EXTERNAL " + b"4242".hex().encode() + b"\r\n",
        b"AUTH EXTERNAL 30\r\n",
        b"\0BEGIN\r\n",
        b"\0" + b"A" * 600,
    ],
    ids=["someone-else", "no-nul", "begin-unauthenticated", "endless-line"],
)
async def test_bad_openings_are_cut_off(listener: PeerListener, opening: bytes) -> None:
    async with RawClient(listener.path) as client:
        await client.send(opening)
        assert await client.closed()
    assert listener.peers == 0


# --------------------------------------------------------------------------- the shim's side


async def test_connect_peer_checks_who_listens(listener: PeerListener) -> None:
    bus = await connect_peer(listener.path, os.getpid())
    try:
        reply = await bus.call(call("Admit", "sssu", ["alpha", "c", "", 1]))
    finally:
        bus.disconnect()
    assert reply is not None and reply.body == list(FORWARD)
    with pytest.raises(PeerRefused, match=f"pid {os.getpid()}"):
        await connect_peer(listener.path, os.getpid() + 1)


async def test_connect_peer_refuses_a_directory_others_can_enter(listener: PeerListener) -> None:
    listener.path.parent.chmod(0o711)
    try:
        with pytest.raises(PeerRefused, match="mode 0700"):
            await connect_peer(listener.path, os.getpid())
    finally:
        listener.path.parent.chmod(0o700)
