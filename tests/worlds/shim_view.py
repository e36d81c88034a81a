"""The daemon as ``uapplace-shim`` serves it, for the live worlds that run both
(:class:`tests.systemd.live_world.LiveWorld`, :class:`tests.worlds.llama.LlamaWorld`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiohttp

from tests.bus.shim_fixtures import ShimProcess


class ShimView:
    """The shim calls a live world makes; the world holds ``shim`` and ``http`` and says
    how it waits (:meth:`until`, failing with its own logs)."""

    shim: ShimProcess
    http: aiohttp.ClientSession

    async def until(self, what: str, check: Callable[[], Any]) -> Any:
        raise NotImplementedError

    async def shim_get(self, path: str) -> Any:
        async with self.http.get(self.shim.base_url + path) as reply:
            assert reply.status == 200, await reply.text()
            return await reply.json()

    async def shim_post(
        self, path: str, body: Any, token: str | None = None
    ) -> tuple[int, dict[str, Any]]:
        headers = {"x-uap-dashboard-token": token} if token is not None else {}
        async with self.http.post(self.shim.base_url + path, json=body, headers=headers) as reply:
            return reply.status, await reply.json()

    async def state(self) -> dict[str, Any]:
        """``GetState`` as the shim serves it (``/api/placement/state``)."""
        state: dict[str, Any] = await self.shim_get("/api/placement/state")
        return state

    async def resident_states(self) -> dict[str, str]:
        state = await self.state()
        return {row["model"]: row["state"] for row in state["residents"]}

    async def pending_entry(self, placement_id: str) -> dict[str, Any] | None:
        entries = (await self.shim_get("/api/placement/pending"))["pending"]
        return next((e for e in entries if e["id"] == placement_id), None)

    async def options_of(self, placement_id: str) -> list[dict[str, Any]]:
        """The park's options, once the daemon has planned them."""

        async def planned() -> list[dict[str, Any]] | None:
            entry = await self.pending_entry(placement_id)
            return entry["options"] if entry is not None and entry["options"] else None

        options: list[dict[str, Any]] = await self.until(f"options of {placement_id}", planned)
        return options
