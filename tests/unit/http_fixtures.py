"""Real HTTP on the loopback for the unit tier: serve an aiohttp app, name a dead port.

Shared by the tests that talk to engines, proxies and controllers over real sockets
(``test_engines``, ``test_rails``, ``test_registry_trust``, ``test_gateproxy``,
``test_gateproxy_topology``; imported as ``from http_fixtures import ...``: tests/unit
is no package). Every server binds port 0, so tests never collide on a port.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve ``app`` on a free loopback port; its runner (the caller cleans it up) and URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """:func:`serve` for the length of a block: its URL, cleaned up when the block ends."""
    runner, url = await serve(app)
    try:
        yield url
    finally:
        await runner.cleanup()


def closed_port_url() -> str:
    """A loopback URL where nothing listens (a port bound once, then let go)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"
