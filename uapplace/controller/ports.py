"""What the controller calls out to: the Protocols of its collaborators, and the one
typed bundle (:class:`Collaborators`) it receives them in at construction.

``wiring.build`` creates the real collaborators; :func:`standalone_collaborators` the
ones of a controller without a bus (``Controller.open``: tests, tools); tests pass fakes. Each slot
has a do-nothing default where "nothing there" has a safe meaning (no proxy: in-flight
unknown, which counts as busy; no notifier: no bubbles), so no slot is ``None`` and no
caller checks for it. What really may be absent (the enforcer and the measurer, without
a systemd user manager) is not here: it is attached once to the controller's
``enforcement`` door (:meth:`uapplace.controller.door.EnforcementDoor.attach`), see there why.

Each Protocol is named for the role it plays for its caller, a noun without a ``Like``,
``Port`` or ``Protocol`` suffix (``Enforcement``, ``Measurement``, ``Notifications``,
``InflightSource``); ``…Host`` names the controller as one part sees it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from uapplace.controller.configstate import LiveConfig
from uapplace.controller.dropins import ManagerReload, UnitDropins, no_manager_to_reload
from uapplace.core.alerts import Alert
from uapplace.core.model import Holder, ParkReason, PendingEntry, Plan, Registry
from uapplace.core.staleness import LiveLaunch
from uapplace.io.seams import UnitControl

ResidentRow = tuple[str, str, str, str]
"""``(model, config, device, state)``: one element of the ``Residents`` property."""


Signature = Sequence[str]
"""An approval signature: the ``model/config`` strings of the victims shown (the bus form)."""


# --------------------------------------------------------------------------- outputs


class ControllerEvents(Protocol):
    """What the controller reports; the bus service turns each into a signal."""

    def on_parked(self, entry: PendingEntry) -> None: ...

    def on_resolved(self, placement_id: str, outcome: str) -> None: ...

    def on_resident_changed(self, row: ResidentRow) -> None: ...

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None: ...

    def on_pending_count(self, count: int) -> None: ...

    def on_residents(self, rows: list[ResidentRow]) -> None: ...

    def on_alert(self, alert: Alert) -> None: ...


class NoEvents:
    """Reports to nobody (a controller without a bus: tests, tools)."""

    def on_parked(self, entry: PendingEntry) -> None:
        pass

    def on_resolved(self, placement_id: str, outcome: str) -> None:
        pass

    def on_resident_changed(self, row: ResidentRow) -> None:
        pass

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        pass

    def on_pending_count(self, count: int) -> None:
        pass

    def on_residents(self, rows: list[ResidentRow]) -> None:
        pass

    def on_alert(self, alert: Alert) -> None:
        pass


class EventRelay:
    """:class:`ControllerEvents` that forwards to one sink attached after construction.

    The cycle it breaks: the bus interface needs the controller to answer calls, and
    the controller needs somewhere to report. The relay is built first and handed to
    the controller in :class:`Collaborators`; the interface attaches itself once made
    (``wiring.build``). Until then (the ledger restore) events go nowhere: nobody is
    on the bus to hear them yet.
    """

    def __init__(self) -> None:
        self._sink: ControllerEvents = NoEvents()

    def attach(self, sink: ControllerEvents) -> None:
        self._sink = sink

    def on_parked(self, entry: PendingEntry) -> None:
        self._sink.on_parked(entry)

    def on_resolved(self, placement_id: str, outcome: str) -> None:
        self._sink.on_resolved(placement_id, outcome)

    def on_resident_changed(self, row: ResidentRow) -> None:
        self._sink.on_resident_changed(row)

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self._sink.on_enforcement_step(run_id, step, ok, detail)

    def on_pending_count(self, count: int) -> None:
        self._sink.on_pending_count(count)

    def on_residents(self, rows: list[ResidentRow]) -> None:
        self._sink.on_residents(rows)

    def on_alert(self, alert: Alert) -> None:
        self._sink.on_alert(alert)


class Notifications(Protocol):
    """Desktop notifications (``uapplace.daemon.notify.Notifier``)."""

    async def parked(self, entry: PendingEntry, plan: Plan, clients: Sequence[str]) -> None: ...

    async def resolved(self, placement_id: str, outcome: str) -> None: ...

    async def alert(self, alert: Alert) -> None:
        """A critical (or warning) desktop notification for an alert."""
        ...


class NoNotifier:
    """No desktop notifications (a controller without a session bus)."""

    async def parked(self, entry: PendingEntry, plan: Plan, clients: Sequence[str]) -> None:
        pass

    async def resolved(self, placement_id: str, outcome: str) -> None:
        pass

    async def alert(self, alert: Alert) -> None:
        pass


# --------------------------------------------------------------------------- inputs


class InflightSource(Protocol):
    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """Target id → in-flight requests, or ``None`` when the proxy did not answer."""
        ...

    async def check(self) -> tuple[str, str] | None:
        """``(proxy URL, problem)`` when the proxy refuses us or cannot be reached."""
        ...


class NoProxy:
    """No proxy to ask: the in-flight list is unknown, which counts as busy."""

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        return None

    async def check(self) -> tuple[str, str] | None:
        return None


PeerCheck = Callable[[str], Awaitable[bool]]
"""Is this bus name still connected? Closes the race of a ``Hold`` whose caller left."""


async def assume_connected(name: str) -> bool:
    """The :data:`PeerCheck` without a bus: every caller counts as connected."""
    return True


class UnitWriter(Protocol):
    async def write_units(self) -> list[str]: ...

    async def check_units(self) -> list[str]: ...

    async def refresh(self) -> list[str]: ...


class AutoPolicyStore(Protocol):
    async def get(self) -> dict[str, Any]: ...

    async def set(self, changes: Mapping[str, Any], consent: bool) -> dict[str, Any]: ...


class Authorization(Protocol):
    """polkit / same-uid checks (``uapplace.daemon.authz.Authorizer``); used by the bus service."""

    async def check(self, sender: str, action: Any) -> None: ...

    async def check_polkit(self, sender: str, action: Any) -> None:
        """polkit's yes only (no same-uid fallback); for acting on others' state."""
        ...


@dataclass(frozen=True)
class Collaborators:
    """Everything the controller calls out to that exists from its construction on."""

    unit_writer: UnitWriter
    events: ControllerEvents = field(default_factory=NoEvents)
    proxy: InflightSource = field(default_factory=NoProxy)
    notifier: Notifications = field(default_factory=NoNotifier)
    peer_connected: PeerCheck = assume_connected


def standalone_collaborators(
    config: LiveConfig,
    events: ControllerEvents | None = None,
    proxy: InflightSource | None = None,
    reload_units: ManagerReload = no_manager_to_reload,
) -> Collaborators:
    """A controller's collaborators without a bus (tests, tools): no notifier, every
    caller connected; written drop-ins are followed by ``reload_units`` (none by default)."""
    paths = config.paths
    return Collaborators(
        unit_writer=UnitDropins(paths.user_unit_dir, config.registry, reload_units),
        events=events or NoEvents(),
        proxy=proxy or NoProxy(),
    )


# --------------------------------------------------------------------------- enforcement


class Enforcement(Protocol):
    """Apply / Load / Unload (docs/placement-rules.md §4.6): ``enforce.enforcer.Enforcer``."""

    async def apply(
        self,
        entry: PendingEntry,
        option: int,
        expected: Signature | None,
        *,
        origin: str | None = None,
    ) -> dict[str, Any]: ...

    async def load(self, model: str, expected: Signature) -> dict[str, Any]: ...

    async def unload(self, model: str, expected: Signature) -> dict[str, Any]: ...

    @property
    def running(self) -> str | None:
        """``"<run id> (<what>)"`` while a run is in progress, else ``None``."""
        ...

    @property
    def applying(self) -> str | None:
        """The placement id the run in progress resolves, else ``None``."""
        ...

    @property
    def drained(self) -> frozenset[str]:
        """The models whose residents the run in progress has drained and now stops or
        pauses (a hold on them could no longer be honoured)."""
        ...

    async def wait_idle(self) -> None:
        """Return once no enforcement runs (a running one finished or rolled back).

        The controller bounds the wait itself at shutdown."""
        ...


class Measurement(Protocol):
    """Footprints and envelopes from a live engine (``uapplace.measure.measurer.Measurer``)."""

    async def measure(self, model: str, config: str) -> dict[str, Any]: ...

    async def measure_envelope(
        self, model: str, config: str, expected: Signature
    ) -> dict[str, Any]: ...

    async def live_launch(
        self, registry: Registry, only: Collection[str] | None = None
    ) -> Mapping[str, LiveLaunch]:
        """Unit → what it runs now (``uapplace.measure.launch.read_live_launch``); only
        the unit files ``only`` names, when given."""
        ...


class AutoScheduler(Protocol):
    """``consent.auto.AutoRunner``: unattended loads under the operator's standing consent."""

    async def schedule(self, entry: PendingEntry, plan: Plan) -> ParkReason | None: ...

    async def close(self) -> None: ...


class NoAutoRuns:
    """No unattended loads: every park waits for the operator."""

    async def schedule(self, entry: PendingEntry, plan: Plan) -> ParkReason | None:
        return None

    async def close(self) -> None:
        pass


@dataclass(frozen=True)
class EnforcementParts:
    """What exists only with a systemd user manager, attached to the controller once."""

    enforcer: Enforcement
    measurer: Measurement
    auto_runner: AutoScheduler = field(default_factory=NoAutoRuns)
    units: UnitControl | None = None
    """The user manager's units, read by ``validate`` (a registry unit that does not exist)."""
