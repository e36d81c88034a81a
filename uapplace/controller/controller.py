"""The one object that owns placement state while ``uapplaced`` runs.

It holds the configuration in force (:class:`~uapplace.controller.configstate.LiveConfig`), the
admission table, the residents, the bus holds, usage clocks and cooldowns, and the
alerts, and writes all of them itself. Everyone else changes them through its methods
(and those of the small state objects it owns: ``usage``, ``cooldowns``, ``alerts``),
which mark the ledger dirty themselves: the auto runner (``replace_pending``,
``cooldowns.start``), the idle sweep (``usage.touch``), enforcement and recovery
(through ``enforce_host.ControllerHost``). Its state sits in private attributes behind
read-only properties (the residents a ``Sequence``, the holds a ``Mapping``), so nothing
else can rebind or mutate it; ``tests/unit/test_structure.py`` checks that this holds for
every public name and that only this module calls the admission table's writers.

Its collaborators come in one :class:`~uapplace.controller.ports.Collaborators` at construction.
The enforcer, measurer and auto runner are the exception, and the only late-bound
part: they need the controller as their host (a cycle), and they exist only with a
systemd user manager. ``wiring`` builds them over a host on this controller and hands
them over once through :attr:`Controller.enforcement` (``attach``), or says why there
are none (``unavailable``); until then Apply/Load/Unload/Measure answer the typed
``Unavailable`` (:mod:`uapplace.controller.door`).

Three rules shape the code:

- **``admit`` never blocks.** It is dictionary look-ups (``Admission.decide``)
  plus bookkeeping. Everything slow a new park needs (the proxy's in-flight
  list, a probe, the planner, the ledger, the notification) runs after the
  answer has been sent, scheduled with ``loop.call_soon``.
- **The ledger is written behind** (:mod:`uapplace.controller.persist`).
- **A bad reload keeps the last good registry.** The error is kept and shown
  by ``Validate`` and ``GetState``; placement goes on with what was loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from uapplace import __version__
from uapplace.controller.alertdesk import AlertDesk, file_not_taken, files_not_taken
from uapplace.controller.configstate import (
    ConfigState,
    LiveConfig,
    measured_footprint,
    report_topology,
)
from uapplace.controller.door import EnforcementDoor
from uapplace.controller.drift import DriftWatch
from uapplace.controller.dropins import ManagerReload, no_manager_to_reload
from uapplace.controller.holds import BusHold, HoldTable
from uapplace.controller.launchgate import LaunchGate
from uapplace.controller.leases import ForwardLeases
from uapplace.controller.misfiled import report_misfiled
from uapplace.controller.pending import PendingPlanning
from uapplace.controller.persist import (
    DEFAULT_DEBOUNCE_S,
    DEFAULT_USAGE_FLUSH_S,
    LedgerWriter,
    repair_report,
)
from uapplace.controller.ports import (
    Collaborators,
    ControllerEvents,
    InflightSource,
    ResidentRow,
    standalone_collaborators,
)
from uapplace.controller.reserve import ReserveWatch
from uapplace.controller.standing import Cooldowns, UsageClocks
from uapplace.core.admission import (
    DEFAULT_TTL_SECONDS,
    TRIM_AFTER_EXPIRED,
    Admission,
    return_freed_memory_soon,
)
from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.errors import Busy, InvalidArgument, no_pending
from uapplace.core.model import (
    DEFAULT_CELLS,
    Decision,
    DeviceReading,
    Holder,
    Model,
    ParkReason,
    PendingEntry,
    Plan,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.files.capacity import ServicePolicy
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.ledger import Ledger, LedgerDoc
from uapplace.files.paths import Paths
from uapplace.io.counters import DaemonCounters
from uapplace.io.engines import ProxyTokenRejected
from uapplace.io.rails import RailsCache

log = logging.getLogger(__name__)

DEFAULT_TICK_S = 5.0
DEFAULT_SHUTDOWN_WAIT_S = 30.0
DEADLINE_PASSED = "deadline_passed"
"""The reason of an ``AdmitBy`` answered after its caller's deadline (no entry, no id)."""
FAILED = "failed"
"""The ``Resolved`` outcome of an entry whose switch failed and could not be rolled back."""
GONE = "gone"
"""The ``ResidentChanged`` state of a resident that is no longer loaded."""


class Controller:
    def __init__(
        self,
        config: LiveConfig,
        ledger: Ledger,
        collaborators: Collaborators,
        *,
        clock: Callable[[], float] = time.time,
        debounce_s: float = DEFAULT_DEBOUNCE_S,
        usage_flush_s: float = DEFAULT_USAGE_FLUSH_S,
        tick_s: float = DEFAULT_TICK_S,
    ) -> None:
        self._config = config
        self._ledger = ledger
        self._collaborators = collaborators
        self._events: ControllerEvents = collaborators.events
        ttl = config.paths.test_pending_ttl_s or DEFAULT_TTL_SECONDS
        self._admission = Admission(config.registry(), ttl=ttl)
        self._residents: list[Resident] = []
        self._usage = UsageClocks(self.mark_dirty)
        self._cooldowns = Cooldowns(self.mark_dirty)
        self._holds = HoldTable()
        self._leases = ForwardLeases()
        self._held_resolved: list[tuple[str, str]] | None = None
        """While a run resolves (:meth:`durable_resolutions`): the ``Resolved`` to announce
        once the ledger without those entries is on disk."""
        self._counters = DaemonCounters()
        self._alerts = AlertDesk(
            clock, self._counters, self._events, collaborators.notifier, self.spawn, self.mark_dirty
        )
        self._reserve = ReserveWatch(self._alerts.board)
        self._drift = DriftWatch(self._alerts.board)
        self._rails = RailsCache()
        self._reload_error: ConfigFileError | None = None
        self._enforcement = EnforcementDoor(
            self.flush, self.live_pending_entry, self.model_named, self.mark_failed
        )
        self._launch = LaunchGate(
            config,
            self._alerts.board,
            self._enforcement.live_launch,
            self._launch_regated,
            self.spawn,
        )
        self._clock = clock
        self._tick_s = tick_s
        self._writer = LedgerWriter(
            ledger,
            lambda: self.document({}, self.residents_with_holders(None)),
            lambda: self._config.state.probe,
            debounce_s=debounce_s,
            usage_flush_s=usage_flush_s,
            alerts=self._alerts.board,
        )
        self._usage_keys: dict[str, str] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._planning = PendingPlanning(
            self._admission,
            self.plan_for,
            self.plan_input,
            self.replace_pending,
            self._after_planned,
            self.spawn,
        )

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(
        cls,
        paths: Paths,
        *,
        events: ControllerEvents | None = None,
        proxy: InflightSource | None = None,
        reload_units: ManagerReload = no_manager_to_reload,
        **kwargs: Any,
    ) -> Controller:
        """A controller on the files ``paths`` names, without a bus (tests, tools).

        Blocking; raises :class:`~uapplace.files.jsonfile.ConfigFileError` for an invalid
        repo registry. The daemon is assembled by :func:`uapplace.daemon.wiring.build`."""
        config = LiveConfig(ConfigState.read(paths))
        parts = standalone_collaborators(config, events, proxy, reload_units)
        return cls(config, Ledger(paths.ledger), parts, **kwargs)

    async def start(self) -> None:
        """Restore from the ledger, then start the writer and the expiry tick."""
        await self.restore_from_ledger()
        report_topology(self._config.state.registry_load, self._alerts.board)
        self.start_background()

    def start_background(self) -> None:
        """The write-behind task and the expiry tick; the first write lands right away."""
        self._tasks = [
            asyncio.create_task(self._writer.run(), name="ledger-writer"),
            asyncio.create_task(self._tick(), name="expiry-tick"),
            asyncio.create_task(self._planning.run(), name="pending-replanner"),
        ]
        self.mark_dirty()
        self._planning.request_replan()

    def restore(self, doc: LedgerDoc) -> None:
        """Residents, usage, cooldowns and live pending entries from the ledger."""
        now = self._clock()
        # Holders and sleep are live facts (connections, requests, an engine's idle
        # sleep); none survives a restart.
        # Publication (docs/invariants.md, invariant 2): a resident is forwarded to only after a
        # verify-up passed in this daemon's life, so every restored resident that was
        # serving is ``warming`` until the unit sync (or LedgerPublication) verifies it.
        # Its footprint is the registry's measurement now (a re-measure while the daemon
        # was down included: configstate.measured_footprint).
        self._residents = [
            measured_footprint(
                self.registry,
                replace(r, holders=(), asleep=False, state=ResidentState.WARMING)
                if r.state is ResidentState.HOT
                else replace(r, holders=(), asleep=False),
            )
            for r in doc.residents
        ]
        self._admission.set_residents(self._residents)
        self._usage.restore(doc.usage)
        self._cooldowns.restore(doc.cooldowns, now)
        self._alerts.restore(doc.alerts)
        dropped = self._admission.restore(doc.pending, now)
        log.info(
            "restored %d resident(s), %d pending (%d dropped as expired or superseded)",
            len(self._residents),
            len(self._admission.pending),
            len(dropped),
        )

    async def restore_from_ledger(self) -> None:
        """Read the ledger (a corrupt one is moved aside by :class:`Ledger`) and restore."""
        doc = await asyncio.to_thread(self._ledger.read)
        moved = self._writer.take_error()
        self.restore(doc)
        repaired = repair_report(moved, doc.dropped)
        if repaired is not None:  # moved aside or items dropped alone: a human should know
            kind, severity = AlertKind.CONFIG_ERROR, Severity.WARNING
            self._alerts.board.raise_alert(kind, severity, str(self._ledger.path), *repaired)

    async def shutdown(self, wait_s: float = DEFAULT_SHUTDOWN_WAIT_S) -> None:
        """Refuse new enforcement, let a running one end (bounded), flush the ledger."""
        await self._enforcement.close(wait_s)
        for task in [*self._tasks, *self._background]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self._tasks = []
        try:
            self._writer.flush_blocking()
        except Exception as err:  # a flush failure must not turn a clean stop into a crash
            log.error("could not flush the ledger at shutdown: %s", err)

    # ------------------------------------------------------------------ the hot path

    def admit(self, model: str, client: str, session: str, cells: int, deadline_us: int = 0) -> Any:
        """Forward or park; O(1), never blocks, never awaits the ledger.

        ``deadline_us`` (``AdmitBy``; CLOCK_MONOTONIC µs, 0 = none): an admit handled
        after its caller's deadline changes nothing and answers a park without an id
        (reason ``deadline_passed``): the caller has gone, and a pending entry whose id
        no client received would be a ghost (issue 13).
        """
        if deadline_us and time.monotonic_ns() // 1000 > deadline_us:
            self._counters.admit("dropped", DEADLINE_PASSED)
            log.info(
                "admit of %r for %r arrived after its caller's deadline: no pending entry",
                model,
                client,
            )
            return Decision("park", reason=DEADLINE_PASSED)
        now = self._clock()
        decision, entry = self._admission.decide(
            model, client, session or None, cells or DEFAULT_CELLS, now
        )
        self._counters.admit(decision.decision, decision.reason)
        if decision.decision == "forward":
            self._usage.touch(self.model_key(model), now)
            self._leases.granted(decision.target_id)
        elif entry is not None:
            asyncio.get_running_loop().call_soon(self._after_park, entry)
        return decision

    def model_key(self, requested: str) -> str:
        """The registry key a requested id names (itself when no model has it); cached."""
        key = self._usage_keys.get(requested)
        if key is None:
            resolved = self.registry.lookup(requested)
            key = resolved[0].key if resolved is not None else requested
            self._usage_keys[requested] = key
        return key

    def _after_park(self, entry: PendingEntry) -> None:
        for pushed_out in self._admission.take_evicted():  # the pending caps (admission.py)
            self._planning.forget(pushed_out.id)
            self.resolve_pending(pushed_out, "expired", already_removed=True)
        self._events.on_parked(entry)
        self._events.on_pending_count(self.pending_count)
        self.mark_dirty()
        self._planning.queue(entry)

    async def _after_planned(self, entry: PendingEntry, found: Plan) -> None:
        """A new park has its options: the auto runner's turn, else the operator's."""
        reason = await self._enforcement.schedule_auto(entry, found)
        if reason is ParkReason.AUTO_LOADING:
            return  # no operator decision to ask for: the load is under way
        entry = self._admission.get(entry.id) or entry
        # The bubble names who asked; the victims' own clients are in its body.
        await self._collaborators.notifier.parked(entry, found, [entry.client])

    # ------------------------------------------------------------------ planning

    async def plan_for(self, model: str, cells: int, inp: PlanInput | None = None) -> Plan:
        """The one "plan with fresh input": the planner (in a thread) on ``inp``, or on
        the residents, holders and readings now (:meth:`plan_input`)."""
        if inp is None:
            inp = await self.plan_input()
        return await asyncio.to_thread(plan, inp, model, cells)

    async def plan_input(self) -> PlanInput:
        """Residents with their holders (bus holds + the proxy's in-flight), and fresh readings."""
        inflight = await self.inflight()
        readings = await self.read_devices()
        residents = self.residents_with_holders(inflight)
        return PlanInput(self.registry, residents, readings, inflight_known=inflight is not None)

    async def inflight(
        self, *, raise_token_rejected: bool = False
    ) -> Mapping[str, Sequence[Holder]] | None:
        """The proxy's in-flight list now (its client's timeout bounds the wait);
        ``None`` when there is no proxy answer: unknown, which counts as busy.
        A 401 raises the ``token_mismatch`` alert (once while open); with
        ``raise_token_rejected`` it is raised too: a drain stops on it at once."""
        try:
            return await self._collaborators.proxy.inflight()
        except ProxyTokenRejected as err:
            self._alerts.token_rejected(self.paths.proxy_url, str(err))
            if raise_token_rejected:
                raise
            log.warning("proxy in-flight list unavailable: %s", err)
            return None
        except Exception as err:  # unknown counts as busy; never guess idle
            log.warning("proxy in-flight list unavailable: %s", err)
            return None

    def holders_for(self, resident: Resident) -> list[Holder]:
        """The bus holds on ``resident``."""
        return self._holds.holders_for(resident)

    def forward_age(self, target_id: str) -> float | None:
        """Seconds since admission last answered ``forward`` to ``target_id`` (the drain's
        forward lease, :mod:`uapplace.controller.leases`); ``None``: never."""
        return self._leases.age(target_id)

    def residents_with_holders(
        self, inflight: Mapping[str, Sequence[Holder]] | None
    ) -> list[Resident]:
        """The residents now; with ``None`` their holders are the bus holds only."""
        out = []
        for resident in self._residents:
            holders = self.holders_for(resident)
            if inflight is not None:
                holders.extend(inflight.get(resident.target_id, ()))
            out.append(replace(resident, holders=tuple(holders)))
        return out

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        """A fresh probe of every device (the blocking probe runs in a thread)."""
        return await asyncio.to_thread(self._config.state.probe.read)

    # ------------------------------------------------------------------ reads

    # The state and the parts it owns, read-only: only the controller rebinds them. The
    # state objects' own methods are how others change them (``usage.touch``,
    # ``cooldowns.start``, ``alerts.acknowledge``, ``enforcement.attach``); the residents
    # and the holds are handed out as read-only types.

    @property
    def config(self) -> LiveConfig:
        """The configuration in force (registry, capacity policy, device probe)."""
        return self._config

    @property
    def ledger(self) -> Ledger:
        return self._ledger

    @property
    def collaborators(self) -> Collaborators:
        return self._collaborators

    @property
    def events(self) -> ControllerEvents:
        return self._events

    @property
    def admission(self) -> Admission:
        """The admission table; only the controller calls its writers (``replace``, …)."""
        return self._admission

    @property
    def residents(self) -> Sequence[Resident]:
        """The residents now, without holders (the controller replaces the list whole)."""
        return self._residents

    @property
    def usage(self) -> UsageClocks:
        """Model key → its last gated forward (the idle sweep's clock; in the ledger)."""
        return self._usage

    @property
    def cooldowns(self) -> Cooldowns:
        """Model → until when automation leaves it alone after a failed run (in the ledger)."""
        return self._cooldowns

    @property
    def holds(self) -> Mapping[int, BusHold]:
        """The bus holds by cookie (taken and released through :meth:`hold`/:meth:`release`)."""
        return self._holds

    @property
    def counters(self) -> DaemonCounters:
        """Admits, runs, steps, alerts however they arrived (``GetState.counters``)."""
        return self._counters

    @property
    def alerts(self) -> AlertDesk:
        return self._alerts

    @property
    def alert_board(self) -> AlertBoard:
        """Where every safety path reports (:class:`~uapplace.core.alerts.AlertBoard`)."""
        return self._alerts.board

    @property
    def rails(self) -> RailsCache:
        """Per-target rails of the residents (``GetState.targets``, issue 13)."""
        return self._rails

    @property
    def version(self) -> str:
        return __version__

    @property
    def reload_error(self) -> ConfigFileError | None:
        """Why the last reload kept the last good registry; ``None`` after a good one."""
        return self._reload_error

    @property
    def enforcement(self) -> EnforcementDoor:
        """Apply/Load/Unload/Measure; the one late-bound part (see the module docstring)."""
        return self._enforcement

    @property
    def planning(self) -> PendingPlanning:
        return self._planning

    @property
    def paths(self) -> Paths:
        return self._config.paths

    @property
    def registry(self) -> Registry:
        return self._config.registry()

    @property
    def pending_count(self) -> int:
        return len(self._admission.pending)

    def resident_rows(self) -> list[ResidentRow]:
        return [(r.model, r.config, r.device, r.state.value) for r in self._residents]

    def pending_entries(self) -> list[PendingEntry]:
        return sorted(self._admission.pending.values(), key=lambda e: e.created_at)

    def pending_entry(self, placement_id: str) -> PendingEntry | None:
        """The entry, expired or not (the tick drops and announces expired ones)."""
        return self._admission.get(placement_id)

    def live_pending_entry(self, placement_id: str) -> PendingEntry | None:
        """The entry unless it expired (an expired one is dropped now)."""
        return self._admission.get(placement_id, self._clock())

    def model_named(self, model: str) -> Model:
        return self._config.state.model_named(model)

    def service_policy(self, model: Model) -> ServicePolicy | None:
        return self._config.state.service_policy(model)

    def resident(self, model: str, config: str, device: str) -> Resident | None:
        return next(
            (
                r
                for r in self._residents
                if (r.model, r.config, r.device) == (model, config, device)
            ),
            None,
        )

    # ------------------------------------------------------------------ writes: pending

    def dismiss(self, placement_id: str) -> bool:
        """Resolve the entry ``dismissed``; its client's retries are ``refused`` for a
        while, not parked and prompted again (core/admission.py, "Clean fallbacks")."""
        entry = self._admission.get(placement_id)
        if entry is None:
            raise no_pending(placement_id)
        self._enforcement.refuse_dismiss_while_applied(placement_id)
        self.resolve_pending(entry, "dismissed")
        self._admission.refuse(entry, self._clock())
        return True

    def mark_failed(self, placement_id: str) -> None:
        """The switch approved for this entry failed or was refused: the entry stays,
        reason ``failed`` (its client's retries say so; issue 21)."""
        if self._admission.mark_failed(placement_id) is not None:
            self.mark_dirty()

    def resolve_pending(
        self, entry: PendingEntry, outcome: str, already_removed: bool = False
    ) -> None:
        """Drop a pending entry and say so (``Resolved``, notifier, ledger)."""
        if not already_removed:
            self._admission.remove(entry.id)
            if outcome == FAILED:  # an incomplete rollback: retries say so, not a new prompt
                self._admission.refuse(entry, self._clock(), ParkReason.FAILED)
        self.mark_dirty()
        if self._held_resolved is not None:
            self._held_resolved.append((entry.id, outcome))
            return
        self._announce_resolved(entry.id, outcome)

    def _announce_resolved(self, placement_id: str, outcome: str) -> None:
        self._events.on_resolved(placement_id, outcome)
        self._events.on_pending_count(self.pending_count)
        self.spawn(
            self._collaborators.notifier.resolved(placement_id, outcome), f"resolved-{placement_id}"
        )

    @contextlib.asynccontextmanager
    async def durable_resolutions(self) -> AsyncIterator[None]:
        """Entries resolved inside (synchronously) are announced only once the ledger
        without them is on disk: a crash right after a run's ``resolve`` then leaves either
        the entry in the ledger and no ``Resolved`` sent (the start-up repair sends the one),
        or neither, never two ``Resolved`` for one placement (issue 20)."""
        held: list[tuple[str, str]] = []
        self._held_resolved = held
        try:
            yield
        finally:
            self._held_resolved = None
            if held:
                try:
                    await self.flush()
                except Exception as err:  # announce anyway: the clients are waiting
                    log.warning("could not write the ledger before announcing: %s", err)
            for placement_id, outcome in held:
                self._announce_resolved(placement_id, outcome)

    def resolve_pending_id(self, placement_id: str, outcome: str) -> bool:
        """Resolve entry ``placement_id`` (if still there) with ``outcome``."""
        entry = self._admission.get(placement_id)
        if entry is None:
            return False
        self.resolve_pending(entry, outcome)
        return True

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        """Resolve every pending entry ``resident`` serves with ``outcome``; their ids."""
        entries = self._admission.resolved_by(resident)
        for entry in entries:
            self.resolve_pending(entry, outcome)
        return [e.id for e in entries]

    def set_auto_loading(self, models: frozenset[str]) -> None:
        """The auto runner's scheduled runs changed (new parks of them say ``auto_loading``)."""
        self._admission.set_auto_loading(models)

    def replace_pending(self, entry: PendingEntry) -> None:
        """Store a changed pending entry (options, reason, expiry) and persist it."""
        self._admission.replace(entry)
        self.mark_dirty()

    # ------------------------------------------------------------------ operator writes

    # ------------------------------------------------------------------ config

    async def reload(self) -> bool:
        """Re-read registry and policy; a bad repo registry keeps the last good one running."""
        try:
            state = await asyncio.to_thread(self._config.state.reread, self._clock)
        except ConfigFileError as err:
            self._reload_error = err
            log.error("registry reload failed, keeping the last good one: %s", err)
            # The operator's edit is being ignored: say so where they look (status
            # banner, a notification), not only in the log and `validate`.
            self._alerts.board.raise_alert(
                AlertKind.CONFIG_ERROR,
                Severity.WARNING,
                str(err.file),
                f"the registry does not load ({err}); uapplaced keeps placing with the last "
                "good one until it is fixed",
            )
            return False
        self._reload_error = None
        # A measurement taken under another ExecStart or engine build than the units and
        # engines show now is unknown, with an alert (docs/placement-rules.md §4.1.1;
        # issue 21 items 3 and 7).
        await self._launch.swap(state)
        for problem, kept in files_not_taken(state):  # the last good one stays: say so
            file_not_taken(self.alert_board, problem, kept)
        self._admission.set_registry(self._config.registry())
        self._usage_keys.clear()
        self._refresh_footprints()
        # New figures, devices or configs change every pending entry's options (a park
        # that had none may have some now): re-plan them all (issue 19).
        self._planning.request_replan()
        self.mark_dirty()
        report_topology(self._config.state.registry_load, self._alerts.board)
        await self._collaborators.unit_writer.refresh()
        return True

    def _launch_regated(self) -> None:
        """A unit (re)started under another launch (or back to the measured one): the
        gated registry changed outside a reload (:mod:`uapplace.controller.launchgate`)."""
        self._admission.set_registry(self._config.registry())
        self._usage_keys.clear()
        self._refresh_footprints()
        self._planning.request_replan()
        self.mark_dirty()

    def _refresh_footprints(self) -> None:
        """Residents take the footprints the registry now records for their configs
        (:func:`~uapplace.controller.configstate.measured_footprint`)."""
        refreshed = [measured_footprint(self.registry, r) for r in self._residents]
        changed = [
            (old, new)
            for old, new in zip(self._residents, refreshed, strict=True)
            if new is not old
        ]
        for old, new in changed:
            log.info(
                "%s on %s: footprint follows its measurement: GPU %s → %s MiB, host %s → %s MiB",
                new.signature,
                new.device,
                old.gpu_mib,
                new.gpu_mib,
                old.host_rss_mib,
                new.host_rss_mib,
            )
        if changed:
            self._set_residents(refreshed)
        report_misfiled(self.registry, refreshed, self._alerts.board)

    # ------------------------------------------------------------------ holds

    async def hold(self, model: str, reason: str, app_id: str, sender: str) -> int:
        """Pin ``model``: while held, a resident serving it is never a victim."""
        key = self.model_named(model).key
        if not reason.strip():
            raise InvalidArgument("a hold needs a reason (shown to the operator next to the pin)")
        self._enforcement.refuse_hold_while_drained(key)
        if self._writer.refusing is not None:  # a hold grows the ledger (its holders)
            raise Busy(
                f"Hold: no new hold while the ledger cannot be written: {self._writer.refusing}"
            )
        held = self._holds.take(key, reason, app_id, sender, self._clock())
        log.info("hold %d on %s by %s (%s): %s", held.cookie, key, app_id or "-", sender, reason)
        self._holds_changed()
        if sender and not await self._collaborators.peer_connected(sender):
            self.drop_holds_of(sender)  # it disconnected before we could watch it
        return held.cookie

    def hold_owner(self, cookie: int) -> str:
        """The bus connection that took hold ``cookie`` (``NotFound`` when there is none)."""
        return self._holds.existing(cookie).sender

    def release(self, cookie: int, sender: str, *, may_release_others: bool = False) -> None:
        """End a hold. Only the connection that took it may, unless the caller was
        authorized for ``org.uap.placement.release-others`` (``may_release_others``)."""
        held = self._holds.release(cookie, sender, may_release_others=may_release_others)
        log.info("hold %d on %s released by %s", cookie, held.model, sender or "-")
        self._holds_changed()

    def drop_holds_of(self, sender: str) -> None:
        """``sender`` left the bus: its holds end with it."""
        gone = self._holds.drop_sender(sender)
        for held in gone:
            log.info("hold %d on %s ended: %s left the bus", held.cookie, held.model, sender)
        if gone:
            self._holds_changed()

    def _holds_changed(self) -> None:
        self.mark_dirty()
        self._planning.request_replan()  # a held resident is never a victim: options change

    # ------------------------------------------------------------------ residents

    def upsert_resident(self, resident: Resident) -> None:
        """Add a resident or replace the one with the same model/config/device."""
        key = (resident.model, resident.config, resident.device)
        old = next((r for r in self._residents if (r.model, r.config, r.device) == key), None)
        others = [r for r in self._residents if (r.model, r.config, r.device) != key]
        self._set_residents([*others, resident])
        self._events.on_resident_changed(
            (resident.model, resident.config, resident.device, resident.state.value)
        )
        self.resolve_served(resident, "forwarded")
        self._launch.resident_published(old, resident)  # (re)started: its launch again

    def drop_resident(self, model: str, config: str, device: str) -> Resident | None:
        current = self.resident(model, config, device)
        if current is None:
            return None
        self._set_residents([r for r in self._residents if r is not current])
        self._events.on_resident_changed((model, config, device, GONE))
        return current

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        """For the enforcer: one ``EnforcementStep`` signal."""
        self._counters.step(run_id, step, ok)
        self._events.on_enforcement_step(run_id, step, ok, detail)

    def _set_residents(self, residents: list[Resident]) -> None:
        self._residents = residents
        self._admission.set_residents(residents)
        self._rails.invalidate()  # a resident turned hot answers /slots now: probe again
        self._events.on_residents(self.resident_rows())
        self.mark_dirty()
        self._planning.request_replan()

    # ------------------------------------------------------------------ persistence

    def mark_dirty(self, urgent: bool = True) -> None:
        """Schedule a ledger write: soon when ``urgent``, within ``usage_flush_s`` otherwise."""
        self._writer.mark_dirty(urgent)

    async def flush(self) -> None:
        """Write the ledger now (in a thread)."""
        await self._writer.flush()

    def document(
        self, readings: Mapping[str, DeviceReading], residents: list[Resident]
    ) -> LedgerDoc:
        """The ledger document of this state with ``readings`` and ``residents``."""
        return LedgerDoc(
            updated_at=self._clock(),
            devices=dict(readings),
            residents=residents,
            pending=self.pending_entries(),
            usage=dict(self._usage),
            cooldowns=dict(self._cooldowns),
            alerts=self._alerts.active(),
        )

    # ------------------------------------------------------------------ background

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            self.expire()
            await self.check_reserve()

    async def check_reserve(self) -> frozenset[str]:
        """A fresh probe against the reserves: the host below its reserve raises one
        ``below_reserve`` alert per crossing (:mod:`uapplace.controller.reserve`), a GPU
        whose memory in use drifted from its residents' footprints one
        ``footprint_drift`` (:mod:`uapplace.controller.drift`); the devices below now."""
        try:
            readings = await self.read_devices()
        except Exception as err:  # the probe failing must not end the tick
            log.warning("reserve check: cannot read the devices: %s", err)
            return self._reserve.below
        self._drift.check(self.registry, self._residents, readings, self._clock())
        return self._reserve.check(self.registry, self._residents, readings)

    def expire(self) -> list[PendingEntry]:
        """Drop expired entries (``Resolved(id, "expired")``) and lapsed cooldowns."""
        now = self._clock()
        gone = self._admission.expire(now)
        for entry in gone:
            self.resolve_pending(entry, "expired", already_removed=True)
            self._admission.refuse(entry, now)
        self._admission.forget_refusals(now)
        if len(gone) >= TRIM_AFTER_EXPIRED:  # after a flood: let RSS come back down
            self.spawn(return_freed_memory_soon(), "return-freed-memory")
        self._cooldowns.lapse(now)
        return gone

    async def background_done(self) -> None:
        """Wait until the after-answer work spawned so far (and what it spawns) ended."""
        while self._background:
            await asyncio.gather(*self._background)

    def spawn(self, work: Awaitable[None], name: str) -> None:
        """Run ``work`` in the background; its failure is logged; shutdown cancels it."""
        task = asyncio.ensure_future(_logged(work, name))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _logged(work: Awaitable[None], name: str) -> None:
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background work %s failed", name)
