"""Serving a simulator's aiohttp app on loopback until a signal, for the sim command lines.

Owns binding 127.0.0.1 (bind first, serve later: a caller may need the URL before
the app exists), starting the runner on that socket, and the ``… listening on URL``
line that tests and the demo wait for before they connect. Used by
:mod:`uapplace.sim.proxy` and :mod:`uapplace.sim.gateproxy`, and by tests that need
a proxy's URL before they build it.
"""

from __future__ import annotations

import asyncio
import signal
import socket

from aiohttp import web


def bind_loopback(port: int = 0) -> socket.socket:
    """A listening-ready socket on 127.0.0.1 (``port`` 0: a free one).

    Bind first, serve later: the controller may need the proxy's URL before the
    proxy can know the controller's (the daemon reads ``UAP_PROXY_URL`` at start).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.setblocking(False)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{host}:{port}"


async def start(
    app: web.Application, port: int = 0, *, sock: socket.socket | None = None
) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on ``sock``, else on 127.0.0.1:``port``; the runner and base URL."""
    sock = sock or bind_loopback(port)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    return runner, url_of(sock)


async def serve_until_signalled(app: web.Application, port: int, ready_prefix: str) -> int:
    """Serve ``app``, print ``ready_prefix`` + its URL, and stop on SIGTERM or SIGINT."""
    runner, url = await start(app, port)
    print(f"{ready_prefix}{url}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0
