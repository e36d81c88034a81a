"""What ``wiring`` adds of its own: nothing reaches the desktop before phase 2."""

from __future__ import annotations

from collections.abc import Sequence

from uapplace.core.alerts import Alert, AlertKind, Severity
from uapplace.core.model import ParkReason, PendingEntry, Plan, PreviewReason
from uapplace.daemon.wiring import QuietUntilStarted

ENTRY = PendingEntry("plc-000001", "alpha", "c", None, 0.0, 1.0, ParkReason.NOT_RESIDENT)
PLAN = Plan("alpha", PreviewReason.OK, ())
ALERT = Alert("alr-1", AlertKind.CONFIG_ERROR, Severity.WARNING, "ledger", "repaired", 0.0, 0.0)


class Bubbles:
    def __init__(self) -> None:
        self.shown: list[str] = []

    async def parked(self, entry: PendingEntry, plan: Plan, clients: Sequence[str]) -> None:
        self.shown.append(f"parked {entry.id}")

    async def resolved(self, placement_id: str, outcome: str) -> None:
        self.shown.append(f"resolved {placement_id} {outcome}")

    async def alert(self, alert: Alert) -> None:
        self.shown.append(f"alert {alert.id}")


async def _everything(notifier: QuietUntilStarted) -> None:
    await notifier.parked(ENTRY, PLAN, ["c"])
    await notifier.resolved(ENTRY.id, "expired")
    await notifier.alert(ALERT)


async def test_the_notifier_is_silent_until_the_daemon_owns_its_name() -> None:
    bubbles = Bubbles()
    quiet = QuietUntilStarted(bubbles)
    await _everything(quiet)  # e.g. a repaired-ledger alert while restoring
    assert bubbles.shown == []
    quiet.open()
    await _everything(quiet)
    assert bubbles.shown == ["parked plc-000001", "resolved plc-000001 expired", "alert alr-1"]
