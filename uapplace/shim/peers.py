"""Who opened a connection: the peer's uid from the kernel's socket tables, and the gate
that serves the shim's own user only (docs/http-contract.md §5).

Every user on the machine can reach a loopback port; only the user the shim runs as
(and the uids named with ``--allow-uid``) may use it. TCP carries no credentials, but on
Linux both ends of a loopback connection are sockets of this machine, and the kernel
knows who owns each: the peer's socket is the one whose *local* address is our peer's
address and whose *remote* address is our own.

- :func:`diag_uid` asks the kernel for exactly that socket (``NETLINK_SOCK_DIAG``, one
  ``SOCK_DIAG_BY_FAMILY`` request naming the four-tuple: a hash lookup, ~15 µs) and reads
  the uid from the reply. This is the path taken wherever netlink is allowed.
- :func:`peer_uid` reads ``/proc/net/tcp`` or ``/proc/net/tcp6`` (the same table as
  text): one ``bytes.find`` per chunk for the row :func:`row_key` spells, parsing only
  the matching line's uid column. The kernel walks its whole established hash to write
  the table (milliseconds, ~3–8 ms with 262,144 buckets, whatever the row count), so
  this fallback runs in a thread, never on the loop that answers admits.

The check runs once per connection, when it is accepted (:class:`UserGate`), before
aiohttp reads a byte: a keep-alive connection's peer never changes, so admits on the
proxy's pooled connections cost nothing more. A connection from another uid, or one
whose socket cannot be found (fail closed), gets ``403 {"error": …}`` naming the uid
and is closed; the refusal is logged (one line, at most one per 10 s with a count, so
a flood cannot flood the journal). Refused connections never count against the
connection cap, so another user's idle sockets cannot starve the proxy.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import ipaddress
import logging
import os
import pwd
import socket
import struct
from collections.abc import Callable, Iterable
from pathlib import Path

from uapplace.shim.responses import encode_json

log = logging.getLogger(__name__)

PROC_TABLES = {4: Path("/proc/net/tcp"), 6: Path("/proc/net/tcp6")}
"""The kernel's TCP socket tables, by IP version."""
READ_CHUNK = 1 << 16
UID_COLUMN = 6
"""In a row, after the ``sl:`` column: local, remote, st, queues, timer, retrnsmt, uid."""
REFUSED_LINGER_S = 2.0
"""How long a refused connection may stay open to read its 403 before it is closed."""
REFUSED_READ_LIMIT = 64 * 1024
REFUSAL_LOG_EVERY_S = 10.0

Address = tuple[str, int]


NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
ALL_TCP_STATES = 0xFFFFFFFF
_NLMSG_HEADER = struct.Struct("=IHHII")
_DIAG_UID_OFFSET = _NLMSG_HEADER.size + 64
"""``struct inet_diag_msg``: family, state, timer, retrans (4), the socket id (48),
expires, rqueue, wqueue (12), then ``idiag_uid``."""
DIAG_TIMEOUT_S = 0.5


class PeerUnknown(Exception):
    """The peer's socket is not in the tables (or they cannot be read): fail closed."""


def diag_request(peer: Address, ours: Address, seq: int) -> bytes:
    """The ``SOCK_DIAG_BY_FAMILY`` request for the socket at ``peer`` connected to ``ours``
    (an exact lookup: no ``NLM_F_DUMP``)."""
    peer_ip = ipaddress.ip_address(peer[0].split("%", 1)[0])
    ours_ip = ipaddress.ip_address(ours[0].split("%", 1)[0])
    family = socket.AF_INET if peer_ip.version == 4 else socket.AF_INET6
    sockid = (
        struct.pack("!HH", peer[1], ours[1])
        + peer_ip.packed.ljust(16, b"\0")
        + ours_ip.packed.ljust(16, b"\0")
        + struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    )
    body = struct.pack("=BBBxI", family, socket.IPPROTO_TCP, 0, ALL_TCP_STATES) + sockid
    header = _NLMSG_HEADER.pack(
        _NLMSG_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0
    )
    return header + body


def diag_uid(netlink: socket.socket, peer: Address, ours: Address, seq: int) -> int | None:
    """The uid owning the peer's socket (``None``: the kernel has no such socket).

    ``netlink`` is a ``NETLINK_SOCK_DIAG`` socket with a timeout; ``OSError`` when the
    kernel refuses or does not answer."""
    netlink.send(diag_request(peer, ours, seq))
    for _ in range(4):  # a stale reply to an earlier, timed-out request is skipped
        reply = netlink.recv(8192)
        if len(reply) < _NLMSG_HEADER.size + 4:
            raise OSError(f"sock_diag: a {len(reply)}-byte reply")
        _length, kind, _flags, reply_seq, _pid = _NLMSG_HEADER.unpack_from(reply)
        if reply_seq != seq:
            continue
        if kind == NLMSG_ERROR:
            code = -struct.unpack_from("=i", reply, _NLMSG_HEADER.size)[0]
            if code == errno.ENOENT:
                return None
            raise OSError(code, f"sock_diag: {os.strerror(code)}")
        if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _DIAG_UID_OFFSET + 4:
            raise OSError(f"sock_diag: unexpected reply type {kind}")
        uid: int = struct.unpack_from("=I", reply, _DIAG_UID_OFFSET)[0]
        return uid
    raise OSError("sock_diag: no reply to this request")


def open_diag_socket() -> socket.socket:
    """A ``NETLINK_SOCK_DIAG`` socket (``OSError`` where the kernel or a sandbox refuses)."""
    netlink = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
    netlink.settimeout(DIAG_TIMEOUT_S)
    return netlink


def table_address(host: str) -> tuple[int, str]:
    """``(IP version, the address as the table prints it)``: the address bytes in network
    order, read as native 32-bit words, each ``%08X``."""
    ip = ipaddress.ip_address(host.split("%", 1)[0])
    packed = ip.packed
    words = struct.unpack(f"={len(packed) // 4}I", packed)
    return ip.version, "".join(f"{word:08X}" for word in words)


def row_key(peer: Address, ours: Address) -> tuple[int, bytes]:
    """``(IP version, the bytes that start the peer's row after its slot number)``."""
    version, peer_hex = table_address(peer[0])
    _ours_version, ours_hex = table_address(ours[0])
    key = f": {peer_hex}:{peer[1]:04X} {ours_hex}:{ours[1]:04X} "
    return version, key.encode("ascii")


def peer_uid(peer: Address, ours: Address, tables: dict[int, Path] = PROC_TABLES) -> int:
    """The uid owning the socket at ``peer`` connected to ``ours`` (both loopback).

    Looks in the table of the peer's IP version first, then the other one (a dual-stack
    client socket lists a v4 connection in ``tcp6``). :class:`PeerUnknown` when no row
    matches or no table can be read."""
    version, key = row_key(peer, ours)
    order = [version, *(v for v in tables if v != version)]
    problems: list[str] = []
    for table_version in order:
        path = tables.get(table_version)
        if path is None:
            continue
        try:
            uid = scan_table(path, key)
        except OSError as err:
            problems.append(f"{path}: {err.strerror or err}")
            continue
        if uid is not None:
            return uid
    where = "; ".join(problems) or "no matching row in " + ", ".join(
        str(tables[v]) for v in order if v in tables
    )
    raise PeerUnknown(f"{peer[0]}:{peer[1]} → {ours[0]}:{ours[1]}: {where}")


def scan_table(path: Path, key: bytes) -> int | None:
    """The uid column of the row that ``key`` starts, or ``None``; reads chunk by chunk and
    stops at the match (the kernel writes the table as it is read)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        carried = b""
        while True:
            chunk = os.read(fd, READ_CHUNK)
            if not chunk:
                return None
            data = carried + chunk
            at = data.find(key)
            if at >= 0:
                return _uid_of_row(fd, data, at)
            carried = data[-len(key) :]
    finally:
        os.close(fd)


def _uid_of_row(fd: int, data: bytes, at: int) -> int:
    end = data.find(b"\n", at)
    while end < 0:
        more = os.read(fd, 4096)
        if not more:
            end = len(data)
            break
        data += more
        end = data.find(b"\n", at)
    fields = data[at + 2 : end].split()  # past the ": " the key starts with
    try:
        return int(fields[UID_COLUMN])
    except (IndexError, ValueError):
        raise OSError(f"cannot read the uid column of {data[at:end][:120]!r}") from None


# --------------------------------------------------------------------------- the gate


def forbidden_response(message: str) -> bytes:
    body = encode_json({"error": message})
    return (
        b"HTTP/1.1 403 Forbidden\r\n"
        b"Content-Type: application/json; charset=utf-8\r\n"
        b"Connection: close\r\n" + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    )


@functools.lru_cache(maxsize=64)
def user_text(uid: int) -> str:
    """``uid 1001 (alice)``, or ``uid 1001`` when no account names it."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


class UserGate:
    """Serves connections from ``allowed`` uids; refuses every other one with a ``403``.

    :meth:`protocol` wraps the server's protocol factory (the connection cap's); the
    wrapper judges the peer when the connection is made and, if it may, hands the
    transport to the real protocol (``set_protocol``: from then on the gate is out of
    the way). The judgement is :func:`diag_uid` on one netlink socket the gate keeps;
    where netlink is refused, :func:`peer_uid` in a thread, the connection's reading
    paused meanwhile."""

    def __init__(
        self,
        allowed: Iterable[int],
        tables: dict[int, Path] = PROC_TABLES,
        on_refusal: Callable[[str], None] | None = None,
    ) -> None:
        self.allowed = frozenset(allowed)
        self.tables = tables
        self.refused = 0
        self._on_refusal = on_refusal or (lambda _line: None)
        self._netlink: socket.socket | None = None
        self._netlink_refused: str | None = None
        self._seq = 0

    def protocol(self, serve: Callable[[], asyncio.BaseProtocol]) -> asyncio.BaseProtocol:
        return _Gatekeeper(self, serve)

    def close(self) -> None:
        if self._netlink is not None:
            self._netlink.close()
            self._netlink = None

    def uid_now(self, peer: Address, ours: Address) -> int | None:
        """The peer's uid over netlink (``None``: no such socket). :class:`PeerUnknown` when
        netlink cannot be used here (the caller takes the /proc path in a thread)."""
        if self._netlink_refused is not None:
            raise PeerUnknown(self._netlink_refused)
        try:
            if self._netlink is None:
                self._netlink = open_diag_socket()
            self._seq = self._seq % 0x7FFFFFFF + 1
            return diag_uid(self._netlink, peer, ours, self._seq)
        except OSError as err:
            self.close()
            self._netlink_refused = f"sock_diag unavailable ({err}); reading {self.tables[4]}"
            log.info("peer uids: %s (slower, done in a thread)", self._netlink_refused)
            raise PeerUnknown(self._netlink_refused) from None

    def uid_slowly(self, peer: Address, ours: Address) -> int:
        """Blocking (/proc): run it in a thread. :class:`PeerUnknown` when no row matches."""
        return peer_uid(peer, ours, self.tables)

    def verdict(self, uid: int | None, peer: Address, why_unknown: str = "") -> str | None:
        """Why a connection from ``uid`` may not be served, or ``None`` when it may."""
        if uid is None:
            return (
                "uapplace-shim serves its own user only and cannot tell which user opened "
                f"this connection (no socket {peer[0]}:{peer[1]} in the kernel's tables"
                f"{'; ' + why_unknown if why_unknown else ''})"
            )
        if uid in self.allowed:
            return None
        served = ", ".join(user_text(u) for u in sorted(self.allowed))
        return (
            f"uapplace-shim serves its own user only: this connection comes from "
            f"{user_text(uid)}; it serves {served}"
        )

    def note_refusal(self, message: str) -> None:
        self.refused += 1
        self._on_refusal(message)


def addresses(transport: asyncio.BaseTransport) -> tuple[Address, Address] | None:
    """``(peer, ours)`` of a TCP transport, host and port only."""
    peer = transport.get_extra_info("peername")
    ours = transport.get_extra_info("sockname")
    if not isinstance(peer, tuple) or not isinstance(ours, tuple):
        return None
    return (str(peer[0]), int(peer[1])), (str(ours[0]), int(ours[1]))


class _Gatekeeper(asyncio.Protocol):
    """One accepted connection until it is judged; then the real protocol, or a refusal
    that writes the 403, reads and drops what the client still sends (so the answer is
    not lost to a reset) and closes on the client's EOF or after
    :data:`REFUSED_LINGER_S`."""

    def __init__(self, gate: UserGate, serve: Callable[[], asyncio.BaseProtocol]) -> None:
        self.gate = gate
        self.serve = serve
        self.transport: asyncio.Transport | None = None
        self.read = 0
        self.timer: asyncio.TimerHandle | None = None
        self.judging: asyncio.Task[None] | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        pair = addresses(transport)
        if pair is None:
            self._refuse("uapplace-shim cannot tell who opened this connection (no address)")
            return
        peer, ours = pair
        try:
            uid = self.gate.uid_now(peer, ours)
        except PeerUnknown:
            transport.pause_reading()
            self.judging = asyncio.get_running_loop().create_task(self._judge_slowly(peer, ours))
            return
        self._decide(self.gate.verdict(uid, peer))

    async def _judge_slowly(self, peer: Address, ours: Address) -> None:
        try:
            uid: int | None = await asyncio.to_thread(self.gate.uid_slowly, peer, ours)
            why = ""
        except PeerUnknown as err:
            uid, why = None, str(err)
        if self.lost:
            return
        assert self.transport is not None
        self.transport.resume_reading()
        self._decide(self.gate.verdict(uid, peer, why))

    def _decide(self, refusal: str | None) -> None:
        assert self.transport is not None
        if refusal is not None:
            self._refuse(refusal)
            return
        inner = self.serve()
        self.transport.set_protocol(inner)
        inner.connection_made(self.transport)

    def _refuse(self, why: str) -> None:
        assert self.transport is not None
        self.gate.note_refusal(why)
        self.transport.write(forbidden_response(why))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, self.transport.close)

    def data_received(self, data: bytes) -> None:
        self.read += len(data)
        if self.read > REFUSED_READ_LIMIT and self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        if self.transport is not None and self.timer is not None:
            self.transport.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.timer is not None:
            self.timer.cancel()
