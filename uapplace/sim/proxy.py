"""A fake of the proxy's two internal placement routes (docs/http-contract.md §3), for tests,
``uapplace demo`` and ``bench/bench_swap.py``.

- ``GET /internal/placement/inflight`` → ``{"targets": {target_id: [request…]}}``;
  a target once seen stays with an empty list. With ``unavailable`` set it
  answers 503 (the daemon must then count every target as busy).
- ``POST /internal/placement/refresh`` → ``{"ok": true, "cleared": [...]}``;
  counted in :attr:`FakeProxy.refreshes`. With ``refresh_fails`` set: 500.

Control (for humans and the demo): ``POST /_sim/inflight`` with
``{"target": ..., "requests": [{"id", "client"}...]}`` replaces a target's list;
``POST /_sim/unavailable`` with ``{"on": bool}``.

Command line: ``python -m uapplace.sim.proxy --port P`` (prints
``uapplace-sim-proxy listening on http://127.0.0.1:P`` once bound).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from uapplace.core.model import iso
from uapplace.sim import serving

READY_PREFIX = "uapplace-sim-proxy listening on "


class FakeProxy:
    def __init__(self) -> None:
        self.targets: dict[str, list[dict[str, Any]]] = {}
        self.unavailable = False
        self.refresh_fails = False
        self.refreshes = 0
        self.inflight_calls = 0

    def set_inflight(self, target: str, *clients: str) -> None:
        """Replace ``target``'s in-flight list with one request per client."""
        self.targets[target] = [
            {"id": f"req-{index}", "client": client, "started_at": iso(0)}
            for index, client in enumerate(clients, start=1)
        ]

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/internal/placement/inflight", self._inflight)
        app.router.add_post("/internal/placement/refresh", self._refresh)
        app.router.add_post("/_sim/inflight", self._set_inflight)
        app.router.add_post("/_sim/unavailable", self._set_unavailable)
        return app

    async def _inflight(self, request: web.Request) -> web.Response:
        self.inflight_calls += 1
        if self.unavailable:
            return web.json_response({"error": "unavailable (simulated)"}, status=503)
        return web.json_response({"targets": self.targets})

    async def _refresh(self, request: web.Request) -> web.Response:
        self.refreshes += 1
        if self.refresh_fails:
            return web.json_response({"error": "refresh failed (simulated)"}, status=500)
        return web.json_response({"ok": True, "cleared": ["upstream_model_ids"]})

    async def _set_inflight(self, request: web.Request) -> web.Response:
        body = await request.json()
        target = body.get("target") if isinstance(body, dict) else None
        requests = body.get("requests", []) if isinstance(body, dict) else None
        if not isinstance(target, str) or not isinstance(requests, list):
            return web.json_response({"error": "want {target: str, requests: [...]}"}, status=400)
        self.targets[target] = [r for r in requests if isinstance(r, dict)]
        return web.json_response({"ok": True})

    async def _set_unavailable(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.unavailable = bool(body.get("on")) if isinstance(body, dict) else False
        return web.json_response({"ok": True, "unavailable": self.unavailable})


async def start(proxy: FakeProxy, port: int = 0) -> tuple[web.AppRunner, str]:
    """Serve ``proxy`` on 127.0.0.1 (``port`` 0: a free one); the runner and base URL."""
    return await serving.start(proxy.app(), port)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m uapplace.sim.proxy",
        description="A fake of the proxy's /internal/placement/{inflight,refresh} routes.",
    )
    parser.add_argument("--port", type=int, default=0, help="TCP port on 127.0.0.1; 0 picks one")
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error("--port: out of range")
    return asyncio.run(serving.serve_until_signalled(FakeProxy().app(), args.port, READY_PREFIX))


if __name__ == "__main__":
    sys.exit(main())
