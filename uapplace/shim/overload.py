"""What keeps a flood of connections from taking the shim down (issue 11): the connection cap
that answers ``503`` without reading a byte, the descriptor limit it fits under, and warnings
that repeat once per interval instead of once per connection.

Used by :func:`uapplace.shim.server.serve`: each listening socket becomes a
:class:`GuardedSite` accepting through one :class:`ConnectionCap`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import resource
import socket
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from uapplace.shim.peers import UserGate
from uapplace.shim.responses import encode_json

log = logging.getLogger(__name__)

ACCEPT_BACKLOG = 128
FD_HEADROOM = 64
"""Descriptors kept free beside the connections (bus, peer socket, logs, listeners)."""
OVERLOAD_LOG_EVERY_S = 10.0

_OVERLOAD_BODY = encode_json({"error": "uapplace-shim is at its connection limit; retry"})
OVERLOAD_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json; charset=utf-8\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n"
    + f"Content-Length: {len(_OVERLOAD_BODY)}\r\n\r\n".encode()
    + _OVERLOAD_BODY
)
"""What a connection over the cap gets, without a byte of its request being read."""
ACCEPT_EXHAUSTED = "socket.accept() out of system resource"
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class _Refusal(asyncio.Protocol):
    """A connection over the cap: the 503 is written and the connection closed at once."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(OVERLOAD_RESPONSE)
        transport.close()

    def data_received(self, data: bytes) -> None:
        pass


class RateLimitedWarning:
    """One line per ``every_s`` (:data:`OVERLOAD_LOG_EVERY_S`) for a condition that repeats,
    with a count; a warning unless another ``level`` is given."""

    def __init__(
        self,
        every_s: float = OVERLOAD_LOG_EVERY_S,
        level: int = logging.WARNING,
        logger: logging.Logger = log,
    ) -> None:
        self.every_s = every_s
        self.level = level
        self.logger = logger
        self.logged_at = -every_s
        self.unreported = 0

    def __call__(self, message: str, *args: object) -> None:
        self.unreported += 1
        now = time.monotonic()
        if now - self.logged_at < self.every_s:
            return
        self.logger.log(
            self.level, message + " (%d time(s) since the last report)", *args, self.unreported
        )
        self.logged_at = now
        self.unreported = 0


class QuietBadRequests(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger, minus the traceback for a client's malformed request.

    aiohttp logs every request it cannot parse (a bad request line, header or chunk)
    with ``logger.exception`` and a full traceback. That is the client's mistake, not
    ours: one line (``bad HTTP request from …: 400, …``) at INFO, at most one per
    second with a count. Any other exception keeps its traceback."""

    def __init__(self, logger: logging.Logger, every_s: float = 1.0) -> None:
        super().__init__(logger, {})
        self.bad_requests = RateLimitedWarning(every_s, logging.INFO, logger)

    def exception(self, msg: object, *args: object, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            remote = args[0] if args else "?"
            self.bad_requests("bad HTTP request from %s: %s", remote, one_line(str(exc)))
            return
        self.logger.exception(msg, *args, **kwargs)


def one_line(text: str, limit: int = 200) -> str:
    """A parser's multi-line message as one line, control characters escaped, cut."""
    flat = " ".join(part.strip() for part in text.splitlines() if part.strip())
    escaped = _CONTROLS.sub(lambda found: f"\\x{ord(found.group()):02x}", flat)
    shown = escaped.encode("ascii", "backslashreplace").decode("ascii")
    return shown if len(shown) <= limit else shown[:limit] + "…"


class ConnectionCap:
    """At most ``limit`` open HTTP connections; the rest get a 503 at once and are closed.

    The count is aiohttp's own list of open connections, read as each new one is
    accepted. Connections accepted in one loop turn join that list only when
    they start, so the count can overshoot ``limit`` by at most the accept
    backlog; :func:`connection_cap` leaves that much room below the descriptor
    limit, so ``accept()`` itself does not run out of descriptors.
    """

    def __init__(self, server: web.Server, limit: int, gate: UserGate | None = None) -> None:
        self.server = server
        self.limit = limit
        self.gate = gate
        """Serves the shim's own user only (:mod:`uapplace.shim.peers`); ``None``: anyone."""
        self.refused = 0
        self._warn = RateLimitedWarning()

    def protocol(self) -> asyncio.BaseProtocol:
        """The protocol factory handed to ``loop.create_server``."""
        if len(self.server.connections) >= self.limit:
            self.refused += 1
            self._warn("%d connections open: new ones are answered 503", self.limit)
            return _Refusal()
        if self.gate is not None:
            return self.gate.protocol(self.server)
        return self.server()


class GuardedSite(web.SockSite):
    """aiohttp's ``SockSite`` accepting through a :class:`ConnectionCap`."""

    def __init__(self, runner: web.BaseRunner, sock: socket.socket, cap: ConnectionCap) -> None:
        super().__init__(runner, sock, backlog=ACCEPT_BACKLOG)
        self.cap = cap

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with the runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.cap.protocol, sock=self._sock, backlog=self._backlog
        )


def connection_cap(requested: int) -> int:
    """``requested``, lowered to fit under ``RLIMIT_NOFILE`` with the backlog and headroom."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return requested
    fits = max(1, soft - ACCEPT_BACKLOG - FD_HEADROOM)
    if fits < requested:
        log.warning(
            "serving at most %d connections, not %d: the descriptor limit is %d "
            "(raise LimitNOFILE= in the unit)",
            fits,
            requested,
            soft,
        )
    return min(requested, fits)


def raise_fd_limit() -> None:
    """Soft ``RLIMIT_NOFILE`` up to the hard one (asyncio uses epoll: no FD_SETSIZE issue)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < target:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


def quiet_accept_errors(warn: RateLimitedWarning) -> Callable[[Any, dict[str, Any]], None]:
    """A loop exception handler that reports asyncio's EMFILE-on-accept once per interval.

    asyncio logs that error once per connection waiting in the backlog, and
    re-arms the listener once per failure: thousands of lines a second. The cap
    should keep it from happening; if the process runs out of descriptors anyway
    (other files), this keeps the journal readable.
    """

    def handler(loop: Any, context: dict[str, Any]) -> None:
        if context.get("message") == ACCEPT_EXHAUSTED:
            warn("accept() failed: %s; not accepting for 1 s", context.get("exception"))
            return
        loop.default_exception_handler(context)

    return handler
