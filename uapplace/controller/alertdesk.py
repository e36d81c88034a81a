"""The controller's alerts: each one recorded (deduped on ``(kind, subject)``),
counted, logged, signalled, shown as a desktop notification and persisted.

Owned by :class:`~uapplace.controller.controller.Controller` (``controller.alerts``). Its
``board`` (the controller's ``alert_board``) is the :class:`~uapplace.core.alerts.AlertBoard`
enforcement, recovery and unit sync report to; the desk is the board's
``on_raised`` hook and does everything that follows a raise.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence

from uapplace.controller.configstate import ConfigState
from uapplace.controller.ports import ControllerEvents, Notifications
from uapplace.core.alerts import Alert, AlertBoard, AlertKind, Severity
from uapplace.core.errors import NotFound
from uapplace.files.jsonfile import ConfigFileError
from uapplace.io.counters import DaemonCounters

log = logging.getLogger(__name__)

POLICY_KEPT = "the last good policy stays"
POLICY_NONE = "verify-up refuses"


def policy_kept(has_policy: bool) -> str:
    """What stays in force when the capacity policy file is broken."""
    return POLICY_KEPT if has_policy else POLICY_NONE


def files_not_taken(state: ConfigState) -> list[tuple[ConfigFileError, str]]:
    """The config files ``state`` could not take, each with what stays in force: the
    machine-local registry (its last good version, or the repo figures) and the capacity
    policy (the last good one, or none: verify-up refuses)."""
    local_kept = (
        "the last good version read before stays in force until it is fixed"
        if state.registry_load.local_kept
        else "it is ignored whole: its measurements do not count until it is fixed"
    )
    taken = [(err, local_kept) for err in state.registry_load.errors[:1]]
    if state.policy_error is not None:
        taken.append((state.policy_error, policy_kept(state.policy is not None)))
    return taken


def file_not_taken(board: AlertBoard, problem: ConfigFileError, kept: str) -> Alert:
    """The ``config_error`` alert for a file uapplaced could not take, once while open
    (a reload and SIGHUP's own check both report it: one raise, one notification)."""
    return board.raise_unless_open(
        AlertKind.CONFIG_ERROR,
        Severity.WARNING,
        str(problem.file),
        f"{problem.file} was not taken ({problem.json_path}: {problem.message}); {kept}",
    )


class AlertDesk:
    def __init__(
        self,
        clock: Callable[[], float],
        counters: DaemonCounters,
        events: ControllerEvents,
        notifier: Notifications,
        spawn: Callable[[Awaitable[None], str], None],
        mark_dirty: Callable[[], None],
    ) -> None:
        self.board = AlertBoard(clock, self._announce)
        self._counters = counters
        self._events = events
        self._notifier = notifier
        self._spawn = spawn
        self._mark_dirty = mark_dirty

    def active(self) -> list[Alert]:
        return self.board.active()

    def restore(self, alerts: Sequence[Alert]) -> None:
        """From the ledger at start (nothing to signal or write back)."""
        self.board.restore(alerts)

    def _announce(self, alert: Alert) -> None:
        """Count, log, signal, notify (unless info) and persist a raised alert."""
        self._counters.alert(alert.kind.value, alert.severity.value)
        level = logging.ERROR if alert.severity is Severity.CRITICAL else logging.WARNING
        log.log(
            level, "alert %s [%s] %s: %s", alert.id, alert.kind.value, alert.subject, alert.message
        )
        self._events.on_alert(alert)
        if alert.severity is not Severity.INFO:
            self._spawn(self._notifier.alert(alert), f"alert-{alert.id}")
        self._mark_dirty()

    def token_rejected(self, proxy_url: str, message: str) -> None:
        """The proxy answered 401 on an internal route: a critical ``token_mismatch``
        alert, raised once while it is open (every preview and drain asks the proxy;
        one notification is enough, the log has each)."""
        if any(a.key == (AlertKind.TOKEN_MISMATCH.value, proxy_url) for a in self.active()):
            log.warning("%s", message)
            return
        detail = {"proxy_url": proxy_url}
        self.board.raise_alert(
            AlertKind.TOKEN_MISMATCH, Severity.CRITICAL, proxy_url, message, detail
        )

    def acknowledge(self, ids: Sequence[str]) -> list[str]:
        """Drop the named alerts (all when ``ids`` is empty); unknown ids are ``NotFound``."""
        unknown = [i for i in ids if i not in {a.id for a in self.active()}]
        if unknown:
            raise NotFound(f"no open alert {', '.join(unknown)} (see `uapplace status`)")
        gone = self.board.acknowledge(ids)
        if gone:
            self._mark_dirty()
        return gone
