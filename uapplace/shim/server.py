"""``uapplace-shim``'s process: the command line, the loopback-only listening sockets, and the
serve loop that runs the app until SIGTERM/SIGINT.

Entry point of the ``uapplace-shim`` command and of ``python -m uapplace.shim``
(both call :func:`main`, exported by :mod:`uapplace.shim`). The shim binds
loopback addresses only (``127.0.0.1``, ``::1``, ``localhost``) and refuses to
start on anything else. It raises its descriptor limit and caps its connections
(:mod:`uapplace.shim.overload`) before it serves.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from aiohttp import web

from uapplace.bus.util import user_bus_address
from uapplace.files.paths import Paths
from uapplace.files.token import load_or_create_token
from uapplace.shim.app import create_app
from uapplace.shim.overload import (
    ConnectionCap,
    GuardedSite,
    QuietBadRequests,
    RateLimitedWarning,
    connection_cap,
    quiet_accept_errors,
    raise_fd_limit,
)
from uapplace.shim.peers import UserGate
from uapplace.shim.settings import (
    ADMIT_DEADLINE_S,
    BODY_TIMEOUT_S,
    HEADER_TIMEOUT_S,
    MAX_CONNECTIONS,
    ShimSettings,
)

log = logging.getLogger(__name__)

LOOPBACK_BIND_HOSTS = {
    "127.0.0.1": ("127.0.0.1",),
    "::1": ("::1",),
    "localhost": ("127.0.0.1", "::1"),
}


def bind_sockets(hosts: Sequence[str], port: int) -> list[socket.socket]:
    """Listening-ready sockets on each loopback host, all on one port (``0`` picks one)."""
    bound: list[socket.socket] = []
    for host in hosts:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind((host, port))
        except OSError as err:
            sock.close()
            if bound and len(hosts) > 1:
                log.warning("not listening on %s: %s", host, err)
                continue
            for other in bound:
                other.close()
            raise OSError(
                err.errno, f"cannot listen on {host} port {port}: {err.strerror}"
            ) from None
        sock.setblocking(False)
        bound.append(sock)
        port = sock.getsockname()[1]
    return bound


async def serve(settings: ShimSettings, hosts: Sequence[str], port: int) -> None:
    app = create_app(settings)
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        # A client's malformed request is one line, not a traceback (docs/http-contract.md §5).
        logger=QuietBadRequests(logging.getLogger("aiohttp.server")),
        # aiohttp's keep-alive timer runs from the connection's start (and from each
        # response) until a complete request head arrives, and closes an idle one:
        # it is the header read timeout, so a slow-headers client is cut.
        keepalive_timeout=settings.header_timeout,
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(quiet_accept_errors(RateLimitedWarning()))
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    assert runner.server is not None
    refusals = RateLimitedWarning(logger=logging.getLogger("uapplace.shim.peers"))
    gate = UserGate(
        settings.allowed_uids,
        on_refusal=lambda why: refusals("refused a connection: %s", why),
    )
    cap = ConnectionCap(runner.server, connection_cap(settings.max_connections), gate)
    try:
        for sock in bind_sockets(hosts, port):
            await GuardedSite(runner, sock, cap).start()
            host, bound_port = sock.getsockname()[:2]
            shown_host = f"[{host}]" if ":" in host else host
            log.info("listening on http://%s:%d", shown_host, bound_port)
        await stop.wait()
    finally:
        await runner.cleanup()
        gate.close()


def build_parser(paths: Paths) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uapplace-shim",
        description="Loopback HTTP shim in front of uapplaced (the proxy's placement controller).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default), ::1 or localhost")
    parser.add_argument(
        "--port", type=int, default=paths.shim_port, help=f"default {paths.shim_port}"
    )
    parser.add_argument(
        "--bus-address",
        default=None,
        help="D-Bus address of the bus uapplaced is on (default: the user bus)",
    )
    parser.add_argument(
        "--admit-timeout", type=float, default=ADMIT_DEADLINE_S, help="admit bus deadline, seconds"
    )
    parser.add_argument(
        "--no-peer",
        action="store_true",
        help=f"admit over the bus only, never over uapplaced's peer socket ({paths.peer_socket})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=MAX_CONNECTIONS,
        help=f"HTTP connections served at once, more get a 503 (default {MAX_CONNECTIONS}; "
        "lowered to fit the descriptor limit)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        help=f"seconds a connection may take to send a request's headers, and idle "
        f"keep-alive (default {HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--allow-uid",
        type=int,
        action="append",
        default=[],
        metavar="UID",
        help="also serve connections from this uid (repeatable); by default only the shim's "
        "own user is served, every other local user gets 403",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=BODY_TIMEOUT_S,
        help=f"seconds a request body may take to arrive (default {BODY_TIMEOUT_S:g})",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    paths = Paths.from_env()
    parser = build_parser(paths)
    args = parser.parse_args(argv)
    hosts = LOOPBACK_BIND_HOSTS.get(args.host)
    if hosts is None:
        parser.exit(
            2,
            f"uapplace-shim: refusing to bind {args.host!r}: the shim binds loopback only "
            "(127.0.0.1, ::1 or localhost)\n",
        )
    if not 0 <= args.port <= 65535:
        parser.exit(2, f"uapplace-shim: --port {args.port} is not a TCP port (0-65535)\n")
    if not 0 < args.admit_timeout < 2.0:
        parser.exit(2, "uapplace-shim: --admit-timeout must be above 0 and below the proxy's 2 s\n")
    for uid in args.allow_uid:
        if not 0 <= uid < 2**32 - 1:
            parser.exit(2, f"uapplace-shim: --allow-uid {uid} is not a uid\n")
    if args.max_connections < 1:
        parser.exit(2, f"uapplace-shim: --max-connections {args.max_connections} is not >= 1\n")
    for name in ("header_timeout", "body_timeout"):
        if not 0 < getattr(args, name) <= 3600:
            flag = "--" + name.replace("_", "-")
            parser.exit(2, f"uapplace-shim: {flag} must be above 0 and at most 3600 seconds\n")
    try:
        token = load_or_create_token(paths.token_file)
    except (OSError, ValueError) as err:
        parser.exit(2, f"uapplace-shim: cannot set up the dashboard token: {err}\n")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    settings = ShimSettings(
        token=token,
        bus_address=args.bus_address or user_bus_address(),
        peer_socket=None if args.no_peer else paths.peer_socket,
        admit_deadline=args.admit_timeout,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        max_connections=args.max_connections,
        allowed_uids=frozenset({os.geteuid(), *args.allow_uid}),
    )
    raise_fd_limit()
    try:
        asyncio.run(serve(settings, hosts, args.port))
    except OSError as err:
        print(f"uapplace-shim: {err.strerror or err}", file=sys.stderr)
        sys.exit(1)
