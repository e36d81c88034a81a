"""One ``Resolved`` per placement, even with a kill right after the run's ``resolve`` (issue 20).

The machine of :mod:`tests.systemd.test_crash_recovery` (``alpha`` resident, ``beta``
parked, applying ``beta`` displaces ``alpha``; every part real). The test SIGKILLs
``uapplaced`` from its own signal handler the moment the ``Resolved`` of the applied
placement arrives, the narrowest a crash can hit after ``resolve``, then starts it
again. Before issue 20 the ledger (written behind) still held the entry, so the
restarted daemon resolved it a second time; now ``resolve`` announces only once the
ledger without the entry is on disk.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.systemd import test_crash_recovery as crash
from tests.systemd.test_crash_recovery import (
    WIRED,
    Case,
    CrashWorld,
    park_beta,
    resident_states,
    wait_for_log,
)
from uapplace.bus.client import PlacementError
from uapplace.bus.util import add_match
from uapplace.files.paths import INTERFACE

pytestmark = pytest.mark.systemd

world = crash.world
"""The crash-recovery machine (parametrized by a :class:`Case`)."""

SETTLE_S = 1.0
"""After the restart has wired and published: room for a late, second ``Resolved``."""


class KillOnResolved:
    """Every ``Resolved`` on the bus; SIGKILLs the daemon at the first one for ``placement``."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []
        self.placement = ""
        self.pid = 0

    def on_message(self, message: Message) -> None:
        if message.message_type is not MessageType.SIGNAL or message.interface != INTERFACE:
            return
        if message.member != "Resolved":
            return
        placement_id, outcome = message.body
        self.seen.append((placement_id, outcome))
        if placement_id == self.placement and self.pid:
            os.kill(self.pid, signal.SIGKILL)
            self.pid = 0


@pytest.mark.parametrize(
    "world", [pytest.param(Case("resolve", (), "finished", "beta"), id="resolve")], indirect=True
)
async def test_a_kill_right_after_resolve_leaves_one_resolved(world: CrashWorld) -> None:
    watcher = KillOnResolved()
    bus = await MessageBus(bus_address=world.uap.bus_address).connect()
    try:
        bus.add_message_handler(watcher.on_message)
        await add_match(bus, f"type='signal',interface='{INTERFACE}',member='Resolved'")
        client = await world.start_daemon(None)
        try:
            await world.until_alpha_hot(client)
            placement_id, index, signature = await park_beta(world, client)
            assert world.daemon is not None
            watcher.placement, watcher.pid = placement_id, world.daemon.pid
            apply = asyncio.ensure_future(client.apply(placement_id, index, signature))
            await world.until_killed()
            with contextlib.suppress(PlacementError):  # the reply may or may not have left
                await apply
        finally:
            client.disconnect()

        client = await world.start_daemon(None)
        try:
            assert world.daemon is not None
            await wait_for_log(world.daemon, WIRED)

            async def beta_hot() -> bool:
                return await resident_states(client) == {"beta": "hot"}

            await world.until("beta the only resident, hot", beta_hot)
            await asyncio.sleep(SETTLE_S)
            pending = [e["id"] for e in (await client.list_pending())["pending"]]
        finally:
            client.disconnect()
    finally:
        bus.disconnect()

    assert placement_id not in pending
    assert [s for s in watcher.seen if s[0] == placement_id] == [(placement_id, "applied")]
