"""The shim's end of the Admit-only peer socket: ``AdmitBy`` calls framed by hand on one stream.

Every client request of every agent is one admit, so the shim's side of the peer socket
(:mod:`uapplace.bus.peer`) is kept to what an ``AdmitBy`` needs: dbus-fast's client
builds a ``Message``, marshals it by its signature, parses every reply into another
``Message`` and routes it through its handler tables and its Python writer
(docs/performance.md, "The shim's peer link"). :class:`PeerAdmitLink` writes the
call from a header built once (only the length and the serial change) and a body of
four strings, a ``u`` and a ``t``; it reads back ``METHOD_RETURN`` and ``ERROR``
messages whose header fields and body are strings or integers, which is all the
daemon's peer socket sends (D-Bus specification, "Message Format"). Anything else on
the stream is a broken link: every call in flight fails with :class:`PeerLinkLost` and
the gateway takes the bus, as it does when dbus-fast's connection drops.

Who is trusted is decided as for :func:`uapplace.bus.peer.connect_peer`: a socket in a
``0700`` directory of our uid whose listener (``SO_PEERCRED``) is the given owner pid.
The handshake is SASL ``EXTERNAL`` with our uid; no ``Hello`` is sent (the peer
socket names the connection itself). Replies are matched to calls by serial, so any
number of admits may be in flight on the one link.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from pathlib import Path

from uapplace.bus.client import PlacementError
from uapplace.bus.frames import (
    ERROR,
    HEADER_ERROR_NAME,
    HEADER_REPLY_SERIAL,
    HEADER_SIGNATURE,
    METHOD_RETURN,
    admit_by_message,
)
from uapplace.bus.peer import PeerRefused, check_private_dir, peer_credentials

__all__ = [
    "MalformedMessage",
    "PeerAdmitLink",
    "PeerLinkLost",
    "Reply",
    "ReplyReader",
    "admit_by_message",
]

HANDSHAKE_LINE_MAX = 512
READ_BUFFER = 64 * 1024


class PeerLinkLost(ConnectionError):
    """The link ended (or sent what no daemon's peer socket sends): the call did not complete."""


# --------------------------------------------------------------------------- reading

MESSAGE_MAX = 1 << 20
"""The largest message read (an ``AdmitBy`` reply is four short strings); more ends the link."""


class MalformedMessage(Exception):
    """Bytes that are not a message this link reads."""


class Reply:
    """One ``METHOD_RETURN`` or ``ERROR``: the serial it answers, and its strings."""

    __slots__ = ("error_name", "reply_serial", "values")

    def __init__(self, reply_serial: int, error_name: str | None, values: list[str]) -> None:
        self.reply_serial = reply_serial
        self.error_name = error_name
        self.values = values


_U32_IN = {"<": struct.Struct("<I"), ">": struct.Struct(">I")}
_HEAD_IN = {"<": struct.Struct("<III"), ">": struct.Struct(">III")}
_ORDER = {0x6C: "<", 0x42: ">"}


def parse_reply(data: bytes, start: int, end: int, order: str) -> Reply | None:
    """The reply in ``data[start:end]`` (one whole message); ``None`` for other message types.

    Written flat, with offsets instead of a reader object: it runs once per admit."""
    u32 = _U32_IN[order].unpack_from
    body_length, _serial, fields_length = _HEAD_IN[order].unpack_from(data, start + 4)
    pos = start + 16
    fields_end = pos + fields_length
    reply_serial = 0
    error_name = b""
    signature = b""
    while pos < fields_end:
        pos += -(pos - start) % 8
        code = data[pos]
        kind = data[pos + 2 : pos + 2 + data[pos + 1]]
        pos += 3 + len(kind)
        if kind == b"u":
            pos += -(pos - start) % 4
            (number,) = u32(data, pos)
            pos += 4
            if code == HEADER_REPLY_SERIAL:
                reply_serial = number
        elif kind == b"s" or kind == b"o":
            pos += -(pos - start) % 4
            (length,) = u32(data, pos)
            if code == HEADER_ERROR_NAME:
                error_name = data[pos + 4 : pos + 4 + length]
            pos += 5 + length
        elif kind == b"g":
            if code == HEADER_SIGNATURE:
                signature = data[pos + 1 : pos + 1 + data[pos]]
            pos += 2 + data[pos]
        else:
            raise MalformedMessage(f"a header field of type {kind!r}")
        if pos > fields_end:
            raise MalformedMessage("a header field runs past the header")
    message_type = data[start + 1]
    if message_type != METHOD_RETURN and message_type != ERROR:
        return None
    if not reply_serial:
        raise MalformedMessage("a reply without a reply serial")
    if signature.strip(b"s"):
        raise MalformedMessage(f"a reply of signature {signature!r} (strings only are read)")
    pos = end - body_length
    values: list[str] = []
    try:
        for _ in signature:
            pos += -(pos - start) % 4
            (length,) = u32(data, pos)
            pos += 5 + length
            if pos > end or data[pos - 1] != 0:
                raise MalformedMessage("a string runs past its message or has no NUL")
            values.append(data[pos - 1 - length : pos - 1].decode("utf-8"))
        name = error_name.decode("utf-8") if message_type == ERROR else None
    except (UnicodeDecodeError, struct.error) as err:
        raise MalformedMessage(f"an unreadable value ({err})") from None
    return Reply(reply_serial, name, values)


class ReplyReader:
    """The replies in a byte stream, however it is cut; other messages are passed over."""

    def __init__(self) -> None:
        self._rest = b""

    def feed(self, data: bytes) -> list[Reply]:
        """Every reply that ``data`` completes; :class:`MalformedMessage` on a broken stream."""
        buffer = self._rest + data if self._rest else bytes(data)
        replies: list[Reply] = []
        start = 0
        size = len(buffer)
        while size - start >= 16:
            order = _ORDER.get(buffer[start])
            if order is None or buffer[start + 3] != 1:
                raise MalformedMessage("not a D-Bus message (byte order or version)")
            body_length, _serial, fields_length = _HEAD_IN[order].unpack_from(buffer, start + 4)
            total = 16 + fields_length + -fields_length % 8 + body_length
            if total > MESSAGE_MAX:
                raise MalformedMessage(f"a message of {total} bytes")
            if size - start < total:
                break
            try:
                reply = parse_reply(buffer, start, start + total, order)
            except IndexError:
                raise MalformedMessage("a header field runs past its message") from None
            if reply is not None:
                replies.append(reply)
            start += total
        self._rest = buffer[start:] if start < size else b""
        return replies


# --------------------------------------------------------------------------- the link


class PeerAdmitLink(asyncio.BufferedProtocol):
    """One authenticated stream to the daemon's peer socket, carrying ``AdmitBy`` calls.

    Read into one buffer of its own (:data:`READ_BUFFER` bytes): asyncio's plain protocol
    allocates 256 KiB for every read (docs/performance.md, "Reads of 256 KiB")."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._reader = ReplyReader()
        self._serial = 0
        self._waiting: dict[int, asyncio.Future[Reply]] = {}
        self._lost: Exception | None = None
        self._outbox: list[bytes] = []
        """Calls made in this turn of the loop, sent together at its end (:meth:`_flush`)."""
        self._buffer = bytearray(READ_BUFFER)

    @classmethod
    async def open(cls, path: Path, owner_pid: int) -> PeerAdmitLink:
        """A link to ``path`` if it is ``owner_pid``'s and private; raises :class:`PeerRefused`
        (or ``OSError``) when it must not or cannot be used."""
        check_private_dir(path.parent)
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, str(path))
            pid, uid = peer_credentials(sock)
            if uid != os.getuid() or pid != owner_pid:
                raise PeerRefused(
                    f"{path}: listened on by pid {pid} (uid {uid}), but uapplaced on the bus "
                    f"is pid {owner_pid} (uid {os.getuid()})"
                )
            await _authenticate(loop, sock)
            link = cls()
            await loop.create_unix_connection(lambda: link, sock=sock)
        except BaseException:
            sock.close()
            raise
        return link

    @property
    def connected(self) -> bool:
        return self._lost is None and self._transport is not None

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._end(PeerLinkLost("the peer link was closed"))

    async def admit(
        self, model: str, client: str, session: str, cells: int, deadline_us: int | None = None
    ) -> dict[str, str]:
        """``AdmitBy`` (``deadline_us`` 0 when none): the answer as
        :meth:`uapplace.bus.client.PlacementClient.admit` gives it."""
        reply = await self.call_admit_by(model, client, session, cells, deadline_us or 0)
        if reply.error_name is not None:
            raise PlacementError(reply.error_name, reply.values[0] if reply.values else "")
        if len(reply.values) != 4:
            raise MalformedMessage(f"AdmitBy answered {len(reply.values)} values, not 4")
        decision, target_id, placement_id, reason = reply.values
        if decision == "forward":
            return {"decision": "forward", "target_id": target_id}
        return {"decision": decision, "placement_id": placement_id, "reason": reason}

    async def call_admit_by(
        self, model: str, client: str, session: str, cells: int, deadline_us: int
    ) -> Reply:
        if self._lost is not None or self._transport is None:
            raise PeerLinkLost(f"the peer link is down ({self._lost})")
        self._serial = serial = self._serial % 0xFFFFFFFF + 1  # 1 to 2**32 − 1, never 0
        message = admit_by_message(serial, model, client, session, cells, deadline_us)
        waiter: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        if not self._waiting:  # nothing in flight (always so when sequential): send now
            self._transport.write(message)
        else:
            if not self._outbox:
                waiter.get_loop().call_soon(self._flush)
            self._outbox.append(message)
        self._waiting[serial] = waiter
        try:
            return await waiter
        finally:
            self._waiting.pop(serial, None)

    def _flush(self) -> None:
        """Send every call queued in the last turn of the loop with one write.

        A call made while none is in flight is written at once (no wait when sequential);
        under load, the calls of all the requests read in one turn leave in one ``send``
        and reach the daemon in one read (docs/performance.md "The shim's peer link")."""
        outbox, self._outbox = self._outbox, []
        if self._lost is None and self._transport is not None and outbox:
            self._transport.write(outbox[0] if len(outbox) == 1 else b"".join(outbox))

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self._buffer)

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(bytes(self._buffer[:nbytes]))

    def data_received(self, data: bytes) -> None:
        try:
            replies = self._reader.feed(data)
        except MalformedMessage as err:
            self._end(PeerLinkLost(f"the peer socket sent what no Admit reply is: {err}"))
            if self._transport is not None:
                self._transport.close()
            return
        for reply in replies:
            waiter = self._waiting.pop(reply.reply_serial, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(reply)

    def eof_received(self) -> bool:
        self._end(PeerLinkLost("the daemon closed the peer link"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(PeerLinkLost(f"the peer link was lost ({exc or 'closed'})"))

    def _end(self, why: Exception) -> None:
        if self._lost is None:
            self._lost = why
        waiting = list(self._waiting.values())
        self._waiting.clear()
        for waiter in waiting:
            if not waiter.done():
                waiter.set_exception(self._lost)


async def _authenticate(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """SASL ``EXTERNAL`` with our uid; raises :class:`PeerRefused` unless the answer is ``OK``."""
    uid_hex = str(os.getuid()).encode().hex().encode()
    await loop.sock_sendall(sock, b"\0AUTH EXTERNAL " + uid_hex + b"\r\n")
    line = b""
    while not line.endswith(b"\r\n"):
        chunk = await loop.sock_recv(sock, HANDSHAKE_LINE_MAX)
        if not chunk:
            raise PeerRefused("the peer socket closed during authentication")
        line += chunk
        if len(line) > HANDSHAKE_LINE_MAX:
            raise PeerRefused("the peer socket's SASL answer is too long")
    if not line.startswith(b"OK "):
        raise PeerRefused(f"the peer socket refused EXTERNAL: {line[:64]!r}")
    await loop.sock_sendall(sock, b"BEGIN\r\n")
