"""Who opened a connection: the peer's uid from the kernel's socket tables, and the gate
that serves the shim's own user only (docs/http-contract.md §5, "Other users").

Every user on the machine can reach a loopback port; only the user the shim runs as
(and the uids named with ``--allow-uid``) may use it. TCP carries no credentials, but on
Linux both ends of a loopback connection are sockets of this machine, listed in
``/proc/net/tcp`` (IPv4) or ``/proc/net/tcp6`` (IPv6, v4-mapped included) with the uid
that owns them. The peer's row is the one whose *local* address is our peer's address
and whose *remote* address is our own: :func:`row_key` spells exactly that pair as the
table prints it, and :func:`peer_uid` finds it with one ``bytes.find`` per chunk read,
parsing only the matching line (the uid column).

The check runs once per connection, when it is accepted (:class:`UserGate`), before
aiohttp reads a byte: a keep-alive connection's peer never changes, so admits on the
proxy's pooled connections cost nothing more. A connection from another uid, or one
whose row cannot be found (fail closed), gets ``403 {"error": …}`` naming the uid and
is closed; the refusal is logged (one line, at most one per 10 s with a count, so a
flood cannot flood the journal). Refused connections never count against the
connection cap, so another user's idle sockets cannot starve the proxy.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import pwd
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


class PeerUnknown(Exception):
    """The peer's socket is not in the tables (or they cannot be read): fail closed."""


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
    the way)."""

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

    def protocol(self, serve: Callable[[], asyncio.BaseProtocol]) -> asyncio.BaseProtocol:
        return _Gatekeeper(self, serve)

    def refusal(self, transport: asyncio.BaseTransport) -> str | None:
        """Why this connection may not be served, or ``None`` when it may."""
        peer = transport.get_extra_info("peername")
        ours = transport.get_extra_info("sockname")
        if not isinstance(peer, tuple) or not isinstance(ours, tuple):
            return "uapplace-shim cannot tell who opened this connection (no peer address)"
        try:
            uid = peer_uid((str(peer[0]), int(peer[1])), (str(ours[0]), int(ours[1])), self.tables)
        except PeerUnknown as err:
            return (
                "uapplace-shim serves its own user only and cannot tell which user opened "
                f"this connection ({err})"
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        why = self.gate.refusal(transport)
        if why is None:
            inner = self.serve()
            transport.set_protocol(inner)
            inner.connection_made(transport)
            return
        self.gate.note_refusal(why)
        self.transport = transport
        transport.write(forbidden_response(why))
        if transport.can_write_eof():
            transport.write_eof()
        self.timer = asyncio.get_running_loop().call_later(REFUSED_LINGER_S, transport.close)

    def data_received(self, data: bytes) -> None:
        self.read += len(data)
        if self.read > REFUSED_READ_LIMIT and self.transport is not None:
            self.transport.close()

    def eof_received(self) -> bool | None:
        if self.transport is not None:
            self.transport.close()
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.timer is not None:
            self.timer.cancel()
