"""The stale-measurement gate kept current, and said out loud (docs/placement-rules.md
§4.1.1, "A measurement goes stale"; issue 21 items 3 and 7).

:class:`LaunchGate` hands what the units run now (:class:`~uapplace.core.staleness.LiveLaunch`)
to :class:`~uapplace.controller.configstate.LiveConfig`, which makes a stale measurement
unknown, and reports the change: one ``stale_measurement`` warning per stale config while
it is stale (subject ``model/config``), and an ``info`` on the same alert once it counts
again (re-measured, or its unit runs as measured again).

When it reads: at every reload (start, ``measure``, ``validate``, SIGHUP: :meth:`swap`),
and when a resident is published ``hot`` after its unit (re)started
(:meth:`resident_published`: a new resident, one that was not ``hot``, or a new main PID).
So an engine upgraded and restarted by hand, or a unit restarted after its drop-in
changed, is caught as soon as it answers (its build is readable only then), not at the
next reload; whoever started it (the unit sync, a run's ``verify-up``, the ledger
publication) publishes through the controller. That re-read reads only that unit and
runs in the background (systemd through the unit worker, the engine over HTTP with the
probe timeout): Admit never waits for it.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection, Mapping

from uapplace.controller.configstate import ConfigState, LiveConfig
from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.model import Registry, Resident, ResidentState
from uapplace.core.staleness import LiveLaunch, Staleness
from uapplace.core.unitnames import unit_file_name

log = logging.getLogger(__name__)

LaunchReader = Callable[[Registry, Collection[str] | None], Awaitable[Mapping[str, LiveLaunch]]]
"""``(registry, only these unit files or all)`` → unit file → what it runs now."""


class LaunchGate:
    """Reads the live launch and gates the registry on it (module doc)."""

    def __init__(
        self,
        config: LiveConfig,
        board: AlertBoard,
        read: LaunchReader,
        on_regated: Callable[[], None],
        spawn: Callable[[Awaitable[None], str], None],
    ) -> None:
        self._config = config
        self._board = board
        self._read = read
        self._on_regated = on_regated
        """Called when a background re-read changed which configs are stale."""
        self._spawn = spawn
        self._reading: set[str] = set()

    async def swap(self, state: ConfigState) -> None:
        """A reload: ``state`` in force, gated on every unit's launch read again."""
        before = self._config.stale
        self._config.swap(state)
        self.apply(await self._read(state.registry, None), before)

    def apply(
        self, live: Mapping[str, LiveLaunch], before: tuple[Staleness, ...] | None = None
    ) -> bool:
        """Gate on ``live`` and raise or clear the alerts; ``True`` when the stale set
        changed (since ``before``, else since now)."""
        before = self._config.stale if before is None else before
        self._config.use_launch(live)
        after = self._config.stale
        report_stale(before, after, self._board)
        return _keys(before) != _keys(after)

    def resident_published(self, old: Resident | None, new: Resident) -> None:
        """``new`` replaces ``old``: when it turned ``hot`` after a (re)start, re-read its
        unit's launch in the background."""
        if new.state is not ResidentState.HOT or not new.unit:
            return
        if old is not None and old.state is ResidentState.HOT and old.main_pid == new.main_pid:
            return
        unit = unit_file_name(new.unit)
        if unit in self._reading:
            return
        self._reading.add(unit)
        self._spawn(self._reread(unit), f"launch-{unit}")

    async def _reread(self, unit: str) -> None:
        try:
            fresh = await self._read(self._config.registry(), (unit,))
        finally:
            self._reading.discard(unit)
        live = {name: seen for name, seen in self._config.live.items() if name != unit}
        live.update(fresh)
        if self.apply(live):
            log.info("%s (re)started: the stale-measurement gate changed", unit)
            self._on_regated()


def report_stale(
    before: tuple[Staleness, ...], after: tuple[Staleness, ...], board: AlertBoard
) -> None:
    """A warning for each stale config (once while open), an ``info`` for each that
    was stale and is not any more: stale in ``before``, or still warned of on the board
    (a warning restored from the ledger after a restart has no ``before`` to be in)."""
    now = _keys(after)
    for stale in after:
        board.raise_unless_open(
            AlertKind.STALE_MEASUREMENT,
            Severity.WARNING,
            _subject(stale.model, stale.config),
            f"{stale.model}/{stale.config} counts as unknown: {stale.message}",
            {
                "model": stale.model,
                "config": stale.config,
                "field": stale.field,
                "stale": True,
                "reason": stale.message,
            },
        )
    for (model, config), (field, reason) in _was_stale(before, board).items():
        if (model, config) in now:
            continue
        board.raise_alert(
            AlertKind.STALE_MEASUREMENT,
            Severity.INFO,
            _subject(model, config),
            f"{model}/{config} counts again: its measurement matches what its "
            f"unit runs now (it was stale: {reason})",
            {"model": model, "config": config, "field": field, "stale": False},
        )


def _was_stale(
    before: tuple[Staleness, ...], board: AlertBoard
) -> dict[tuple[str, str], tuple[str, str]]:
    """``(model, config)`` → ``(field, reason)`` for each config stale before this check."""
    was = {(s.model, s.config): (s.field, s.message) for s in before}
    for alert in board.active():
        if alert.kind is not AlertKind.STALE_MEASUREMENT or alert.severity is not Severity.WARNING:
            continue
        model, config = alert.detail.get("model"), alert.detail.get("config")
        if not isinstance(model, str) or not isinstance(config, str):
            continue
        reason = alert.detail.get("reason")
        if not isinstance(reason, str):  # raised before the reason was kept in the detail
            reason = alert.message.removeprefix(f"{model}/{config} counts as unknown: ")
        was.setdefault((model, config), (str(alert.detail.get("field", "")), reason))
    return was


def _subject(model: str, config: str) -> str:
    return f"{model}/{config}"


def _keys(stale: tuple[Staleness, ...]) -> frozenset[tuple[str, str]]:
    return frozenset((s.model, s.config) for s in stale)
