"""Alerts: what uapplaced must tell a human until a human says "seen".

An alert is raised when a promise of docs/invariants.md could not be kept by the
daemon alone: a rollback that left a device emptier than before, a half-done
run repaired (or not) after a crash, a resident dropped because its unit is
gone, an engine serving the wrong id, the proxy refusing our token. Alerts

- live in :class:`AlertBoard` (owned by the controller) and in the ledger, so a
  restart does not forget them;
- show in ``GetState`` (``alerts``), ``uapplace status`` (a red banner), the
  ``AlertRaised`` signal, a critical desktop notification and ``/metrics``;
- stay until acknowledged (``AcknowledgeAlerts`` / ``uapplace status --ack``).

Raising the same ``(kind, subject)`` again while one is open updates that alert
(message, detail, count) instead of stacking copies: a crash loop yields one
alert with a count, not a thousand.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any

from uapplace.core.model import iso

MAX_ALERTS = 200
"""Open alerts kept at most; the oldest acknowledged-or-not beyond this are dropped."""


class AlertKind(StrEnum):
    ROLLBACK_INCOMPLETE = "rollback_incomplete"
    """A failed run could not restore every victim: a device is emptier than before."""
    RECOVERY_DONE = "recovery_done"
    """After a crash, a half-done run was finished or rolled back automatically."""
    RECOVERY_NEEDED = "recovery_needed"
    """After a crash, a half-done run could not be repaired: a human must look."""
    RESIDENT_DROPPED = "resident_dropped"
    """The ledger named a resident whose unit is unknown or not running."""
    WRONG_MODEL = "wrong_model"
    """An engine answers but does not serve the id it was started for: never published."""
    PROBE_MISMATCH = "probe_mismatch"
    """At a reconcile, device memory is held by processes that belong to no resident's unit."""
    TOKEN_MISMATCH = "token_mismatch"
    """The proxy answered 401 to our token on its internal routes."""
    CONFIG_ERROR = "config_error"
    """A configuration file is broken; the last good one stays in force."""
    ENFORCEMENT_FAILED = "enforcement_failed"
    """An unattended run (auto, idle, notification click) failed and was rolled back."""
    BELOW_RESERVE = "below_reserve"
    """The host's memory went below its reserve: the probe reads less free than
    ``reserved_mib``, or the residents' measured footprints leave less (an engine that
    slept and woke took back what it had given; docs/placement-rules.md §4.4)."""
    FORCED_STOP = "forced_stop"
    """A unit a run stopped ignored SIGTERM and was SIGKILLed after its stop timeout:
    in-flight work may have been cut (docs/placement-rules.md §4.6, "Forced stops")."""
    NOT_SERVING = "not_serving"
    """A ``hot`` resident's engine was seen asleep (not waking on a request), gone or
    serving another id and was unpublished; ``info`` once it serves again
    (docs/placement-rules.md §4.2, "Serving is re-checked")."""

    FOOTPRINT_DRIFT = "footprint_drift"
    """A GPU's memory in use, as the probe reads it, differs from what its residents'
    measured footprints account for, beyond its reserve and a tolerance, for a minute
    (:mod:`uapplace.controller.drift`)."""
    MISFILED = "misfiled"
    """A resident is listed on another device than its config's measurement says it runs
    on (``measured_on``), and was not moved there (:mod:`uapplace.controller.misfiled`)."""
    STALE_MEASUREMENT = "stale_measurement"
    """A machine-local measurement was taken under another ``ExecStart`` or engine build
    than its unit runs now: it counts as unknown until re-measured; ``info`` once it counts
    again (:mod:`uapplace.controller.launchgate`; docs/placement-rules.md §4.1.1)."""


class Severity(StrEnum):
    CRITICAL = "critical"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Alert:
    id: str
    kind: AlertKind
    severity: Severity
    subject: str
    """What it is about (a model, a unit, a device, a run id); with ``kind`` the dedupe key."""
    message: str
    raised_at: float
    updated_at: float
    count: int = 1
    detail: Mapping[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> tuple[str, str]:
        return (self.kind.value, self.subject)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind.value,
            "severity": self.severity.value,
            "subject": self.subject,
            "message": self.message,
            "raised_at": iso(self.raised_at),
            "updated_at": iso(self.updated_at),
            "count": self.count,
            "detail": dict(self.detail),
        }


def new_alert_id() -> str:
    return "alr-" + secrets.token_hex(4)


class AlertBoard:
    """The open alerts, newest last, and the one place every safety path reports to.

    Enforcement, recovery, unit sync and the controller's own checks all call
    :meth:`raise_alert` on the board their host hands them (``alert_board``).
    The board only records; ``on_raised`` is told of each raised alert, and in
    the daemon that is the controller's :class:`~uapplace.controller.alertdesk.AlertDesk`,
    which counts, logs, signals, notifies and persists. A test passes a board
    of its own (with a list-appending hook) rather than a fake of it.
    """

    def __init__(
        self, clock: Callable[[], float], on_raised: Callable[[Alert], None] | None = None
    ) -> None:
        self._clock = clock
        self._on_raised = on_raised
        self._alerts: dict[str, Alert] = {}

    def raise_alert(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any] | None = None,
    ) -> Alert:
        now = self._clock()
        existing = next((a for a in self._alerts.values() if a.key == (kind.value, subject)), None)
        if existing is not None:
            alert = replace(
                existing,
                severity=severity,
                message=message,
                updated_at=now,
                count=existing.count + 1,
                detail=dict(detail or {}),
            )
        else:
            alert = Alert(
                new_alert_id(), kind, severity, subject, message, now, now, 1, dict(detail or {})
            )
        self._alerts[alert.id] = alert
        self._trim()
        if self._on_raised is not None:
            self._on_raised(alert)
        return alert

    def raise_unless_open(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any] | None = None,
    ) -> Alert:
        """:meth:`raise_alert`, unless the same alert (kind, subject and message) is open:
        a problem two paths report (a reload, then SIGHUP's own check) is one raise and
        one notification."""
        for alert in self._alerts.values():
            if alert.key == (kind.value, subject) and alert.message == message:
                return alert
        return self.raise_alert(kind, severity, subject, message, detail)

    def acknowledge(self, ids: Iterable[str]) -> list[str]:
        """Drop the named alerts (all of them when ``ids`` is empty); returns the ids dropped."""
        wanted = list(ids)
        gone = list(self._alerts) if not wanted else [i for i in wanted if i in self._alerts]
        for alert_id in gone:
            del self._alerts[alert_id]
        return gone

    def active(self) -> list[Alert]:
        return sorted(self._alerts.values(), key=lambda a: (a.raised_at, a.id))

    def restore(self, alerts: Iterable[Alert]) -> None:
        self._alerts = {a.id: a for a in alerts}
        self._trim()

    def __len__(self) -> int:
        return len(self._alerts)

    def _trim(self) -> None:
        while len(self._alerts) > MAX_ALERTS:
            oldest = min(self._alerts.values(), key=lambda a: a.updated_at)
            del self._alerts[oldest.id]
