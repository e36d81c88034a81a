"""A ``ROLLBACK INCOMPLETE`` reaches every surface a human looks at (issue 10, "Must show" (f)).

The world of :mod:`tests.systemd.live_world` (real units, the real ``uapplaced``
and ``uapplace-shim``), plus python-dbusmock's ``notification_daemon`` on the
same bus. ``uapplace load beta --yes`` stops ``alpha``; the moment its stop step
reports ok, an orphan process (outside any unit) grabs ``alpha``'s VRAM on the
simulated GPU. ``beta`` cannot fit and ``alpha`` cannot come back: ``gpu0`` ends
empty. Then, on the real daemon:

- the CLI run exits 1 naming ``ROLLBACK INCOMPLETE``;
- the notification daemon gets a *critical* bubble for the alert;
- ``uapplace status`` shows it in the red banner until ``uapplace status --ack``;
- the shim's ``/metrics`` counts it (``uapplace_rollback_incomplete 1``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.bus.dbusmock_fixtures import MockService
from tests.systemd.live_world import GUARD_S, LiveWorld, cli
from tests.worlds.exposition import sample
from uapplace.bus.util import bus_daemon_message
from uapplace.daemon.notify import URGENCY_CRITICAL
from uapplace.files.paths import INTERFACE
from uapplace.sim.gpu import SimGpu, sim_uuid

pytestmark = pytest.mark.systemd

ALPHA_MIB = 14000


@pytest.fixture
def world(notifications: MockService, live: LiveWorld) -> LiveWorld:
    """The live machine, started after the notification daemon it notifies through."""
    return live


class OrphanOnStop:
    """On the run's ``stop`` step (ok), start an orphan that claims ``alpha``'s VRAM."""

    def __init__(self, sim: SimGpu) -> None:
        self.sim = sim
        self.orphans: list[subprocess.Popen[bytes]] = []

    def on_message(self, message: Message) -> None:
        if message.message_type is not MessageType.SIGNAL or message.interface != INTERFACE:
            return
        if message.member != "EnforcementStep" or self.orphans:
            return
        _run, step, ok, _detail = message.body
        if step == "stop" and ok:
            orphan = subprocess.Popen(["sleep", str(GUARD_S * 4)])
            self.orphans.append(orphan)
            self.sim.claim(sim_uuid(0), orphan.pid, ALPHA_MIB, "llama-server (orphan)")

    def kill(self) -> None:
        for orphan in self.orphans:
            orphan.kill()
            orphan.wait()


async def test_rollback_incomplete_is_notified_bannered_counted_until_acknowledged(
    world: LiveWorld, notifications: MockService
) -> None:
    orphan = OrphanOnStop(SimGpu(Path(world.uap.env["UAPPLACE_SIM_GPU"])))
    bus = await MessageBus(bus_address=world.uap.bus_address).connect()
    try:
        bus.add_message_handler(orphan.on_message)
        rule = f"type='signal',interface='{INTERFACE}',member='EnforcementStep'"
        reply = await bus.call(bus_daemon_message("AddMatch", "s", [rule]))
        assert reply is not None and reply.message_type is MessageType.METHOD_RETURN

        code, out, err = await cli(world, "load", "beta", "--yes")
        assert code == 1, out + err
        assert orphan.orphans, "the stop step was never reported"
        assert "ROLLBACK INCOMPLETE" in out, out

        state = await world.shim_get("/api/placement/state")
        (alert,) = [a for a in state["alerts"] if a["kind"] == "rollback_incomplete"]
        assert (alert["severity"], alert["subject"]) == ("critical", "gpu0")

        def bubble() -> list[Any] | None:
            calls = notifications.calls("Notify")
            return next((c for c in calls if c[3] == "uapplace: rollback incomplete"), None)

        async def notified() -> list[Any] | None:
            return bubble()

        shown = await world.until("the critical notification", notified)
        assert shown[6]["urgency"] == URGENCY_CRITICAL and shown[7] == 0  # stays until closed
        assert "gpu0" in shown[4] and "uapplace status --ack" in shown[4]

        code, out, err = await cli(world, "status")
        assert code == 0, err
        assert f"CRITICAL rollback_incomplete {alert['id']}" in out, out
        assert "uapplace status --ack" in out

        async with world.http.get(world.shim.base_url + "/metrics") as page:
            metrics = await page.text()
        assert sample(metrics, "uapplace_rollback_incomplete") == 1, metrics
        opened = "uapplace_alerts_open"
        assert sample(metrics, opened, kind="rollback_incomplete", severity="critical") == 1

        code, out, err = await cli(world, "status", "--ack", alert["id"])
        assert code == 0 and f"acknowledged {alert['id']}" in out, out + err
        code, out, _ = await cli(world, "status")
        assert "rollback_incomplete" not in out
    finally:
        bus.disconnect()
        orphan.kill()
