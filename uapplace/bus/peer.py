"""A peer-to-peer D-Bus socket for ``Admit`` only: the shim's short way to ``uapplaced``.

Every admit the proxy sends is one bus round trip, and on the user bus that
trip crosses ``dbus-daemon`` twice (shim → bus → daemon → bus → shim). The
daemon therefore also listens on a private socket, ``$XDG_RUNTIME_DIR/
uapplace/bus`` (:attr:`uapplace.files.paths.Paths.peer_socket`), that speaks plain
D-Bus without a bus in between. The user bus stays the API: this socket
answers ``org.uap.Placement1.Admit`` and nothing else.

Who may connect (the daemon's side, :class:`PeerListener`):

- the directory is ``0700`` and the socket ``0600``, both owned by the daemon's
  uid (an existing directory with other owner or mode turns the socket off);
- each connection's kernel credentials (``SO_PEERCRED``) must be the daemon's
  uid, and the SASL ``EXTERNAL`` identity the client claims must be that same
  uid; anything else is refused before a single message is read;
- ``Admit`` is the one method served; every other call gets
  ``org.freedesktop.DBus.Error.AccessDenied`` naming the user bus. ``Admit`` is
  not authorized on the bus either (docs/http-contract.md §1: loopback proxies admit), so the
  socket gives no one anything the bus would not.

Whom the shim trusts (:meth:`uapplace.bus.peerlink.PeerAdmitLink.open`, the shim's own
lean client; :func:`connect_peer` for a dbus-fast connection, as benches and tests use):
a socket in a ``0700`` directory owned by its own uid, whose listening process
(``SO_PEERCRED``) is the process that owns ``org.uap.Placement1`` on the bus the shim
was given. Anything else, or any failure, and the shim stays on the user bus.

Wire details: the client speaks first (a NUL byte, then ``AUTH EXTERNAL
<hex uid>``, ``BEGIN``), as with any bus; lines are read with ``MSG_PEEK`` so
not one byte of the first message is consumed by the handshake. The client's
``Hello`` (which dbus-fast always sends) is answered with a local name. The
accepted socket is then driven by dbus-fast's own message reader and writer
(:class:`PeerConnection`), as its client connections are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.aio.message_reader import build_message_reader

from uapplace.bus.connection import Bus, OrderedWriter, connect
from uapplace.bus.frames import NO_REPLY_EXPECTED, admit_return
from uapplace.files.paths import INTERFACE

log = logging.getLogger(__name__)


class AdmitAnswer(Protocol):
    """``(model, client, session, cells[, deadline_us])`` → the reply body; raises
    ``DBusError``. ``Admit`` calls it without the deadline, ``AdmitBy`` with it
    (CLOCK_MONOTONIC µs)."""

    def __call__(
        self, model: str, client: str, session: str, cells: int, deadline_us: int = ...
    ) -> tuple[str, str, str, str]: ...


ADMIT_SIGNATURE = "sssu"
ADMIT_BY_SIGNATURE = "sssut"
ADMIT_CALLS = frozenset({("Admit", ADMIT_SIGNATURE), ("AdmitBy", ADMIT_BY_SIGNATURE)})
"""``(member, signature)`` of the two admit calls, as every fast admit path matches them."""
BUS_DRIVER = "org.freedesktop.DBus"
ACCESS_DENIED = "org.freedesktop.DBus.Error.AccessDenied"
LOCAL_NAME = ":uapplace.bus.peer"
AUTH_LINE_MAX = 512
AUTH_LINES_MAX = 8
AUTH_TIMEOUT_S = 5.0
STALE_PROBE_S = 1.0
_UCRED = struct.Struct("3i")


class PeerRefused(Exception):
    """A connection or a socket that the rules above do not allow."""


def peer_credentials(sock: socket.socket) -> tuple[int, int]:
    """The other end's ``(pid, uid)`` as the kernel saw it connect."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, _gid = _UCRED.unpack(raw)
    return pid, uid


def check_private_dir(directory: Path) -> None:
    """``directory`` must be a real directory owned by us with mode ``0700``."""
    info = directory.lstat()
    mode = stat.S_IMODE(info.st_mode)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or mode != 0o700:
        raise PeerRefused(
            f"{directory}: must be a directory owned by uid {os.getuid()} with mode 0700 "
            f"(it is uid {info.st_uid}, mode {mode:04o})"
        )


# --------------------------------------------------------------------------- the daemon's side


class PeerConnection(Bus):
    """A dbus-fast bus object over a socket we accepted (we are the server end).

    dbus-fast only ever connects out; this adopts an authenticated socket and
    hands it to dbus-fast's own reader and to the writer of :mod:`uapplace.bus.connection`
    (dbus-fast's, with a full send buffer waited out instead of ending the
    connection), so messages are framed and written as on our client
    connections. That leans on dbus-fast's internals (``_MessageWriter``,
    ``build_message_reader``, the socket attributes), which ``pyproject.toml``
    pins to ``dbus-fast<6`` and ``tests/unit/test_peer.py`` exercises; should
    they change, the connection is refused (and logged) and the shim stays on
    the bus.
    """

    def adopt(self, sock: socket.socket) -> None:
        self._sock = sock
        self._stream = sock.makefile("rwb")
        self._fd = sock.fileno()
        self._writer = OrderedWriter(self)
        # The writer sends at once only on a connection that has a name.
        self.unique_name = LOCAL_NAME
        self._loop.add_reader(
            self._fd,
            build_message_reader(sock, self._process_message, self._finalize, False),
        )


def reply_to_admit(bus: Bus, message: Message, answer: AdmitAnswer) -> bool:
    """Answer an ``Admit`` (four arguments) or ``AdmitBy`` (five, the deadline last) call
    that came in on ``bus``: the decision goes back framed by hand
    (:func:`uapplace.bus.frames.admit_return`), none when the caller asked for no reply.
    ``True``: handled. A ``DBusError`` from ``answer`` propagates, and dbus-fast turns it
    into the error reply. The peer socket and the daemon's bus handler
    (:func:`uapplace.daemon.service.track_senders`) both answer through this."""
    decision = answer(*message.body)
    if not int(message.flags) & NO_REPLY_EXPECTED:
        bus.send_frame(admit_return(bus.next_serial(), message.serial, message.sender, decision))
    return True


def admit_only(answer: AdmitAnswer, peer: Bus) -> Callable[[Message], Message | bool | None]:
    """The message handler of a peer connection: ``Hello``, ``Admit``, and refusals."""

    def on_message(message: Message) -> Message | bool | None:
        if message.message_type is not MessageType.METHOD_CALL:
            return None
        # The hot path first: every message but the first is an admit.
        if message.interface == INTERFACE and (message.member, message.signature) in ADMIT_CALLS:
            return reply_to_admit(peer, message, answer)
        if message.interface == BUS_DRIVER and message.member == "Hello":
            return Message.new_method_return(message, "s", [f"{LOCAL_NAME}.{os.getpid()}"])
        return Message.new_error(
            message,
            ACCESS_DENIED,
            f"this peer-to-peer socket answers {INTERFACE}.Admit({ADMIT_SIGNATURE}) and "
            f"AdmitBy({ADMIT_BY_SIGNATURE}) only; "
            f"call {message.interface}.{message.member} on the user bus",
        )

    return on_message


class PeerListener:
    """Listens on ``path`` and serves ``Admit`` (through ``answer``) to same-uid peers."""

    def __init__(self, path: Path, answer: AdmitAnswer) -> None:
        self.path = path
        self.answer = answer
        self.guid = secrets.token_hex(16)
        self._server: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._peers: set[PeerConnection] = set()
        self._welcomes: set[asyncio.Task[None]] = set()
        self._bound: tuple[int, int] | None = None
        """The socket file we bound (device, inode): only that one is removed at close."""

    @property
    def peers(self) -> int:
        return len(self._peers)

    async def start(self) -> None:
        """Bind and listen; :class:`PeerRefused` or ``OSError`` when it cannot (safely)."""
        self._server = await asyncio.to_thread(self._bind)
        self._accepting = asyncio.ensure_future(self._accept_loop(self._server))

    def _bind(self) -> socket.socket:
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        check_private_dir(directory)
        self._remove_stale()
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # No umask games (the umask is process-wide, other threads write files):
            # the 0700 directory already keeps everyone else out until the chmod.
            server.bind(str(self.path))
            os.chmod(self.path, 0o600)
            self._bound = _file_identity(self.path)
            server.listen(16)
            server.setblocking(False)
        except BaseException:
            server.close()
            raise
        return server

    def _remove_stale(self) -> None:
        """A socket left by a daemon that is gone is removed; a live one is not ours to take."""
        try:
            info = self.path.lstat()
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(info.st_mode):
            raise PeerRefused(f"{self.path}: exists and is not a socket; not touching it")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(STALE_PROBE_S)
            try:
                probe.connect(str(self.path))
            except (ConnectionRefusedError, FileNotFoundError):
                self.path.unlink(missing_ok=True)
                return
            except TimeoutError:
                pass  # a backlog that full means someone is listening
        raise PeerRefused(f"{self.path}: another process is listening on it")

    async def close(self) -> None:
        """Stop accepting, drop every peer, remove the socket (if it is still ours)."""
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
            self._accepting = None
        for task in list(self._welcomes):
            task.cancel()
        self.drop_peers()
        if self._server is not None:
            with contextlib.suppress(OSError):
                if _file_identity(self.path) == self._bound:
                    self.path.unlink()
            self._server.close()
            self._server = None

    def drop_peers(self) -> None:
        """Hang up on every connected peer (each reconnects, or falls back to the bus)."""
        for peer in list(self._peers):
            peer.disconnect()
        self._peers.clear()

    async def _accept_loop(self, server: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, _ = await loop.sock_accept(server)
            except OSError as err:
                log.warning("peer socket %s: accept failed: %s", self.path, err)
                await asyncio.sleep(0.5)
                continue
            task = asyncio.ensure_future(self._welcome(sock))
            self._welcomes.add(task)
            task.add_done_callback(self._welcomes.discard)
            task.add_done_callback(_log_unexpected)

    async def _welcome(self, sock: socket.socket) -> None:
        peer = await self._authenticate(sock)
        if peer is None:
            return
        peer.add_message_handler(admit_only(self.answer, peer))
        self._peers.add(peer)
        try:
            await peer.wait_for_disconnect()  # type: ignore[no-untyped-call]
        except Exception as err:  # how dbus-fast reports the other end going away (EOFError)
            log.debug("peer socket %s: a peer left (%s)", self.path, type(err).__name__)
        finally:
            self._peers.discard(peer)

    async def _authenticate(self, sock: socket.socket) -> PeerConnection | None:
        """The connection as a dbus-fast bus once the rules allow it; else closed, ``None``."""
        sock.setblocking(False)
        peer: PeerConnection | None = None
        try:
            pid, uid = peer_credentials(sock)
            if uid != os.getuid():
                raise PeerRefused(f"pid {pid} runs as uid {uid}, not {os.getuid()}")
            async with asyncio.timeout(AUTH_TIMEOUT_S):
                await ServerHandshake(sock, uid, self.guid).run()
            connection = PeerConnection(bus_address=f"unix:path={self.path}")
            connection.adopt(sock)
            peer = connection
            log.debug("peer socket %s: pid %d connected", self.path, pid)
            return peer
        except (PeerRefused, OSError, TimeoutError) as err:
            log.warning("peer socket %s: refused a connection: %s", self.path, err)
            return None
        except Exception:
            log.exception(
                "peer socket %s: cannot serve a connection; it will use the bus", self.path
            )
            return None
        finally:
            if peer is None:
                sock.close()


def _file_identity(path: Path) -> tuple[int, int]:
    info = path.lstat()
    return info.st_dev, info.st_ino


def _log_unexpected(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("peer socket: a connection failed", exc_info=task.exception())


class ServerHandshake:
    """The server half of D-Bus SASL, ``EXTERNAL`` only (D-Bus specification, "Authentication")."""

    def __init__(self, sock: socket.socket, uid: int, guid: str) -> None:
        self.sock = sock
        self.expected = str(uid).encode().hex()
        self.guid = guid
        self.authenticated = False
        self.awaiting_data = False

    async def run(self) -> None:
        if await self._read(1) != b"\0":
            raise PeerRefused("the client did not start with a NUL byte")
        for _ in range(AUTH_LINES_MAX):
            words = (await self._line()).split(" ")
            reply = self._answer(words)
            if reply is None:
                return
            await asyncio.get_running_loop().sock_sendall(self.sock, reply.encode() + b"\r\n")
        raise PeerRefused(f"no BEGIN within {AUTH_LINES_MAX} lines")

    def _answer(self, words: list[str]) -> str | None:
        """The reply to one command; ``None`` on ``BEGIN`` after a successful ``AUTH``."""
        command, args = words[0], words[1:]
        if command == "BEGIN" and self.authenticated:
            return None
        if command == "AUTH" and args[:1] == ["EXTERNAL"] and not self.authenticated:
            if len(args) == 1:
                self.awaiting_data = True
                return "DATA"
            return self._identity(args[1])
        if command == "DATA" and self.awaiting_data:
            self.awaiting_data = False
            return self._identity(args[0] if args else "")
        if command == "NEGOTIATE_UNIX_FD" and self.authenticated:
            return "ERROR file descriptors are not passed on this socket"
        if command in ("AUTH", "CANCEL", "DATA") and not self.authenticated:
            return "REJECTED EXTERNAL"
        raise PeerRefused(f"unexpected SASL command {command[:32]!r}")

    def _identity(self, claimed_hex: str) -> str:
        # An empty identity means "the credentials the socket carries", already checked.
        if claimed_hex and claimed_hex.lower() != self.expected:
            raise PeerRefused("the EXTERNAL identity is not the connecting uid")
        self.authenticated = True
        return f"OK {self.guid}"

    async def _wait_readable(self) -> None:
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[None] = loop.create_future()
        fd = self.sock.fileno()

        def readable() -> None:
            if not ready.done():
                ready.set_result(None)

        loop.add_reader(fd, readable)
        try:
            await ready
        finally:
            loop.remove_reader(fd)

    async def _read(self, count: int, flags: int = 0) -> bytes:
        while True:
            try:
                data = self.sock.recv(count, flags)
            except BlockingIOError:
                await self._wait_readable()
                continue
            if not data:
                raise PeerRefused("the client closed the connection during authentication")
            return data

    async def _line(self) -> str:
        """One ``\\r\\n``-terminated line, consuming nothing after it."""
        while True:
            seen = await self._read(AUTH_LINE_MAX, socket.MSG_PEEK)
            end = seen.find(b"\r\n")
            if end >= 0:
                line = await self._read(end + 2)
                try:
                    return line[:-2].decode("ascii")
                except UnicodeDecodeError:
                    raise PeerRefused("a SASL line that is not ASCII") from None
            if len(seen) >= AUTH_LINE_MAX:
                raise PeerRefused(f"a SASL line over {AUTH_LINE_MAX} bytes")
            await self._wait_readable()


# --------------------------------------------------------------------------- the shim's side


async def connect_peer(path: Path, owner_pid: int) -> MessageBus:
    """A connection to the peer socket at ``path``, if it is ``owner_pid``'s and private.

    ``owner_pid`` is the pid of the bus name's owner (``GetConnectionUnixProcessID``).
    Raises :class:`PeerRefused` (or ``OSError``/dbus-fast's errors from the
    connect) when the socket must not or cannot be used.
    """
    check_private_dir(path.parent)
    bus = await connect(f"unix:path={path}")
    try:
        sock = bus._sock  # dbus-fast's socket for this connection (a public Cython attribute)
        if not isinstance(sock, socket.socket):
            raise PeerRefused(f"{path}: dbus-fast did not expose the connection's socket")
        pid, uid = peer_credentials(sock)
        if uid != os.getuid() or pid != owner_pid:
            raise PeerRefused(
                f"{path}: listened on by pid {pid} (uid {uid}), but uapplaced on the bus "
                f"is pid {owner_pid} (uid {os.getuid()})"
            )
    except BaseException:
        bus.disconnect()
        raise
    return bus
