"""Async client of the ``org.uap.Placement1`` bus API, shared by the CLI, the shim and the demo.

Each method is one bus call with the signature in ``dbus/org.uap.Placement1.xml``.
Calls are sent as raw messages (no introspection round trip), and an error
reply becomes a :class:`PlacementError` carrying the D-Bus error name, so
callers can branch on ``err.short`` (``NotFound``, ``Drifted``, …).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

from dbus_fast import MessageType
from dbus_fast.aio import MessageBus

from uapplace.bus import connection as busio
from uapplace.bus.util import method_call, user_bus_address
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

ERROR_PREFIX = f"{INTERFACE}.Error."


class PlacementError(Exception):
    """An error reply from the daemon, or no daemon at all (``name`` says which)."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message

    @property
    def short(self) -> str:
        """``NotFound`` for ``org.uap.Placement1.Error.NotFound``; the full name otherwise."""
        return self.name.removeprefix(ERROR_PREFIX)

    def __str__(self) -> str:
        return f"{self.short}: {self.message}"


class PlacementClient:
    def __init__(self, bus: MessageBus, call_timeout: float | None = 30.0) -> None:
        self.bus = bus
        self.call_timeout = call_timeout
        """``None``: no deadline of its own (the caller runs one, as the shim does)."""

    @classmethod
    async def connect(
        cls, address: str | None = None, call_timeout: float | None = 30.0
    ) -> PlacementClient:
        bus = await busio.connect(address or user_bus_address())
        return cls(bus, call_timeout)

    def disconnect(self) -> None:
        self.bus.disconnect()

    async def call(self, member: str, signature: str = "", body: list[Any] | None = None) -> Any:
        """One method call; returns the reply body (a list), raises :class:`PlacementError`."""
        message = method_call(BUS_NAME, OBJECT_PATH, INTERFACE, member, signature, body)
        try:
            if self.call_timeout is None:
                reply = await self.bus.call(message)
            else:
                async with asyncio.timeout(self.call_timeout):
                    reply = await self.bus.call(message)
        except TimeoutError:
            raise PlacementError(
                "org.freedesktop.DBus.Error.Timeout", f"{member}: no reply in {self.call_timeout} s"
            ) from None
        if reply is None:
            raise PlacementError("org.freedesktop.DBus.Error.NoReply", f"{member}: no reply")
        if reply.message_type is MessageType.ERROR:
            text = reply.body[0] if reply.body else ""
            raise PlacementError(reply.error_name or "unknown", str(text))
        return reply.body

    async def _json(self, member: str, signature: str = "", body: list[Any] | None = None) -> Any:
        (text,) = await self.call(member, signature, body)
        return json.loads(text)

    async def admit(
        self, model: str, client: str, session: str, cells: int, deadline_us: int | None = None
    ) -> dict[str, str]:
        """``Admit``; with ``deadline_us`` (CLOCK_MONOTONIC µs) ``AdmitBy``, so an answer
        the caller can no longer receive leaves no pending entry."""
        if deadline_us is None:
            method, signature, body = "Admit", "sssu", [model, client, session, cells]
        else:
            method, signature = "AdmitBy", "sssut"
            body = [model, client, session, cells, deadline_us]
        decision, target_id, placement_id, reason = await self.call(method, signature, body)
        if decision == "forward":
            return {"decision": "forward", "target_id": target_id}
        return {"decision": decision, "placement_id": placement_id, "reason": reason}

    async def get_state(self) -> Any:
        return await self._json("GetState")

    async def list_pending(self) -> Any:
        return await self._json("ListPending")

    async def preview(self, model: str, cells: int) -> Any:
        return await self._json("Preview", "su", [model, cells])

    async def preview_unload(self, model: str) -> Any:
        """What ``Unload(model)`` would stop: ``{model, victims, signature, frees_mib}``."""
        return await self._json("PreviewUnload", "s", [model])

    async def apply(self, placement_id: str, option: int, expected: Sequence[str]) -> Any:
        """``expected``: the option's ``signature`` as shown (``[]``: stop nothing)."""
        return await self._json("Apply", "suas", [placement_id, option, list(expected)])

    async def dismiss(self, placement_id: str) -> bool:
        (dismissed,) = await self.call("Dismiss", "s", [placement_id])
        return bool(dismissed)

    async def load(self, model: str, expected: Sequence[str]) -> Any:
        """``expected``: the signature of ``Preview``'s first option (``[]``: stop nothing)."""
        return await self._json("Load", "sas", [model, list(expected)])

    async def unload(self, model: str, expected: Sequence[str]) -> Any:
        """``expected``: ``PreviewUnload``'s signature."""
        return await self._json("Unload", "sas", [model, list(expected)])

    async def write_units(self) -> list[str]:
        (written,) = await self.call("WriteUnits")
        return list(written)

    async def check_units(self) -> list[str]:
        (stale,) = await self.call("CheckUnits")
        return list(stale)

    async def measure(self, model: str, config: str) -> Any:
        return await self._json("Measure", "ss", [model, config])

    async def measure_envelope(self, model: str, config: str, expected: Sequence[str]) -> Any:
        """``expected``: ``PreviewUnload(model)``'s signature (the residents that stop)."""
        return await self._json("MeasureEnvelope", "ssas", [model, config, list(expected)])

    async def validate(self) -> Any:
        return await self._json("Validate")

    async def get_auto_policy(self) -> Any:
        return await self._json("GetAutoPolicy")

    async def set_auto_policy(self, changes: dict[str, Any], consent: bool) -> Any:
        return await self._json("SetAutoPolicy", "sb", [json.dumps(changes), consent])

    async def hold(self, model: str, reason: str, app_id: str) -> int:
        (cookie,) = await self.call("Hold", "sss", [model, reason, app_id])
        return int(cookie)

    async def release(self, cookie: int) -> None:
        await self.call("Release", "u", [cookie])

    async def acknowledge_alerts(self, alert_ids: list[str]) -> list[str]:
        (gone,) = await self.call("AcknowledgeAlerts", "as", [alert_ids])
        return list(gone)
