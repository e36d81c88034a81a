"""Start-up repair of an enforcement run that a crash cut short.

Entry point: :func:`recover` (``await recover(journal, host, units, timeouts=…)``).
uapplaced calls it once at start, from :func:`uapplace.enforce.attach_enforcement`,
after the controller restored the ledger and the unit manager is connected, and
**before** the unit sync starts and before the controller gets its enforcer: so
no ``Apply``/``Load``/``Unload`` runs while a half-done one is repaired, and the
unit sync never publishes a unit the repair has not verified. A harness (the
chaos test) can call it the same way on any :class:`RecoveryHost`.

It reads the enforcement journal (:mod:`uapplace.journal`). No journal: no run
was in progress, nothing to repair (the pending entries are still re-planned).
Otherwise it reconciles the journal with the units (systemd's states), the
engines (``/health``, ``/v1/models``, ``/metrics`` as verify-up checks them) and
the probe (free memory before a victim is restarted), acts by the table below,
raises one alert naming the run and what was done, removes the journal, and
re-plans every pending entry (no option computed before the crash survives).

Principles (DESIGN §5a): never leave a device emptier than before the run when a
victim can be restarted; never publish the new unit before it passed verify-up;
never two residents on one device over its budget (the new unit must be seen
down before a victim starts, a victim seen up means the new unit stops).

The table (``new`` = the unit the run starts; ``victims`` = the units it stops;
"up" = active, activating or reloading; "down" = inactive or failed). Rows are
tried in order, the first that matches decides; the outcome is the alert's
(``recovery_done`` warning, or ``recovery_needed`` critical for HUMAN):

==  ==============  ========  ========  ===================================  ===========
#   journal step    new       victims   action                               outcome
==  ==============  ========  ========  ===================================  ===========
0   none            —         —         none (pending entries re-planned)    no alert
1   unreadable      —         —         moved aside to ``….broken``          HUMAN
2   stop…verify-up  up        all down  verify as verify-up does (health     finished
                                        within verify_up_s, served ids,
                                        metricsMustMatch): passes → publish
                                        new ``hot``, drop the victims,
                                        resolve the entry ``applied``
3   stop…verify-up  up        any       fails verify (or a victim is up:     → row 5
                                        two residents on one device): stop
                                        new
4   rollback-*      up        any       stop new (the run had failed)        → row 5
5   any             stop of new fails   victims NOT restarted                HUMAN
6   any             down      all up    lift the crashed run's ``draining``  nothing /
                                        marks (victims served as before)     rolled back
7   unload          none      all down  drop the victims: the unload had     finished
                                        done its unit work
8   any             down      some      wait (verify_free_s) until the       rolled back
                              down      probe shows the victims' memory
                                        free, start each, verify healthy
9   any             down      some      memory not free in time (orphan?):   HUMAN
                              down      victims NOT started
10  any             down      some      a start job or health check fails    HUMAN
                              down      (the others are restarted)
==  ==============  ========  ========  ===================================  ===========

Decisions where the spec is silent:

- A run cut short before the new unit started (journal ``stop``/``verify-free``/
  ``start`` with the new unit down) is rolled back, not finished: the operator's
  approval was for a switch that would have been seen through by this daemon,
  and their pending entry is kept (re-planned) so applying again is one click.
- A run cut short after the new unit's start job (``verify-up``) is finished
  when the new unit now passes the same checks verify-up makes (health, served
  ids, ``metricsMustMatch``), waiting up to ``verify_up_s`` for a slow load.
- The journal is removed after every repair, including one that needs a human:
  the alert's ``detail.journal`` holds the whole record, and a journal kept
  would make every restart try the same repair again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from uapplace import engines
from uapplace.alerts import AlertKind, Severity
from uapplace.capacity import ServicePolicy
from uapplace.journal import Journal, JournalError, RunRecord
from uapplace.model import DeviceReading, Model, ProbeSource, Registry, Resident, ResidentState
from uapplace.registry import unit_file_name
from uapplace.units import JobOutcome, UnitError, UnitState

if TYPE_CHECKING:
    from uapplace.controller import Controller
    from uapplace.enforce import Timeouts

log = logging.getLogger(__name__)

_UP = frozenset({"active", "activating", "reloading"})
_DOWN = frozenset({"inactive", "failed"})
FIRST_POLL_S = 0.05
MAX_POLL_S = 0.5
JOURNAL_SUBJECT = "enforcement-journal"


class Outcome(StrEnum):
    NOTHING_CHANGED = "nothing_changed"
    FINISHED = "finished"
    ROLLED_BACK = "rolled_back"
    NEEDS_HUMAN = "needs_human"


@dataclass(frozen=True)
class RecoveryReport:
    """What :func:`recover` found and did (also the alert's ``detail``)."""

    run_id: str
    outcome: Outcome
    message: str
    actions: tuple[str, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def alert_kind(self) -> AlertKind:
        if self.outcome is Outcome.NEEDS_HUMAN:
            return AlertKind.RECOVERY_NEEDED
        return AlertKind.RECOVERY_DONE


# --------------------------------------------------------------------------- collaborators


class RecoveryHost(Protocol):
    """The controller as the repair sees it (:class:`ControllerRecoveryHost`; fakes in tests)."""

    def registry(self) -> Registry: ...

    def residents(self) -> Sequence[Resident]: ...

    def put_resident(self, resident: Resident) -> None: ...

    def drop_resident(self, resident: Resident) -> None: ...

    def resolve_entry(self, placement_id: str, outcome: str) -> bool: ...

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]: ...

    def service_policy(self, model: Model) -> ServicePolicy | None: ...

    async def read_devices(self) -> Mapping[str, DeviceReading]: ...

    def raise_alert(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any] | None = None,
    ) -> object: ...

    async def replan_pending(self) -> None: ...


class UnitControl(Protocol):
    """The part of :class:`~uapplace.units.UnitManager` the repair uses."""

    async def state(self, name: str) -> UnitState: ...

    async def start_unit(self, name: str, timeout: float) -> JobOutcome: ...  # noqa: ASYNC109

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome: ...  # noqa: ASYNC109


class EngineProbe(Protocol):
    """The engine checks of verify-up (:class:`HttpEngines`: the real HTTP probes)."""

    async def health(self, endpoint: str, timeout_s: float) -> bool: ...

    async def served_ids(self, endpoint: str, timeout_s: float) -> list[str]: ...

    async def metrics(self, endpoint: str, timeout_s: float) -> dict[str, float | str]: ...


class HttpEngines:
    """:class:`EngineProbe` over :mod:`uapplace.engines`."""

    async def health(self, endpoint: str, timeout_s: float) -> bool:
        return await engines.health(endpoint, timeout_s=timeout_s)

    async def served_ids(self, endpoint: str, timeout_s: float) -> list[str]:
        return await engines.served_ids(endpoint, timeout_s=timeout_s)

    async def metrics(self, endpoint: str, timeout_s: float) -> dict[str, float | str]:
        return await engines.metrics(endpoint, timeout_s=timeout_s)


# --------------------------------------------------------------------------- entry point


async def recover(
    journal: Journal,
    host: RecoveryHost,
    units: UnitControl,
    *,
    timeouts: Timeouts,
    probe: EngineProbe | None = None,
) -> RecoveryReport | None:
    """Repair the run the journal names (if any), alert, clear the journal, re-plan.

    Returns the report, or ``None`` when no run was in progress. Never raises for
    what it finds: a unit manager error mid-repair becomes a ``needs human`` alert.
    """
    try:
        record = await asyncio.to_thread(journal.read)
    except JournalError as err:
        report = await _unreadable(journal, err)
        _alert(host, report, None)
        await host.replan_pending()
        return report
    if record is None:
        await host.replan_pending()
        return None
    log.warning(
        "recovering %s (%s) cut short at step %s", record.run_id, record.describe(), record.step
    )
    repair = Repair(record, host, units, timeouts, probe or HttpEngines())
    try:
        report = await repair.run()
    except (UnitError, OSError, ValueError) as err:
        report = repair.report(Outcome.NEEDS_HUMAN, f"the repair itself failed: {err}")
    _alert(host, report, record)
    try:
        await journal.clear()
    except OSError as err:
        log.error("cannot remove the enforcement journal %s: %s", journal.path, err)
    await host.replan_pending()
    return report


async def _unreadable(journal: Journal, err: JournalError) -> RecoveryReport:
    try:
        moved = await asyncio.to_thread(journal.move_aside)
        where = f"moved aside to {moved}"
    except OSError as move_err:
        where = f"could not be moved aside ({move_err})"
    message = (
        f"the enforcement journal is unreadable ({err.message}); {where}. A run may have "
        "been cut short: check `uapplace status` and the units of the registry"
    )
    return RecoveryReport(JOURNAL_SUBJECT, Outcome.NEEDS_HUMAN, message, problems=(str(err),))


def _alert(host: RecoveryHost, report: RecoveryReport, record: RunRecord | None) -> None:
    severity = Severity.CRITICAL if report.outcome is Outcome.NEEDS_HUMAN else Severity.WARNING
    detail: dict[str, Any] = {
        "run_id": report.run_id,
        "outcome": report.outcome.value,
        "actions": list(report.actions),
        "problems": list(report.problems),
    }
    if record is not None:
        detail["step"] = record.step
        detail["journal"] = record.to_json()
    host.raise_alert(report.alert_kind, severity, report.run_id, report.message, detail)


# --------------------------------------------------------------------------- the repair


class Repair:
    """One journaled run, reconciled with the units, the engines and the probe."""

    def __init__(
        self,
        record: RunRecord,
        host: RecoveryHost,
        units: UnitControl,
        timeouts: Timeouts,
        probe: EngineProbe,
    ) -> None:
        self.record = record
        self.host = host
        self.units = units
        self.timeouts = timeouts
        self.probe = probe
        self.actions: list[str] = []
        self.problems: list[str] = []

    # ------------------------------------------------------------------ the table

    async def run(self) -> RecoveryReport:
        record = self.record
        new_unit = _unit(record.new)
        stopped_new = False
        if new_unit is not None and _up(await self._state(new_unit)):
            why_not = await self._why_not_finish(new_unit)
            if why_not is None:
                return self._finish()
            self.actions.append(f"{new_unit} not kept: {why_not}")
            if not await self._stop_new(new_unit):
                return self.report(Outcome.NEEDS_HUMAN, "")
            stopped_new = True
        elif new_unit is not None:
            self._drop_if_published(record.new)
        down = await self._down_victims()
        if not down:
            self._restore_running_victims()
            outcome = Outcome.ROLLED_BACK if stopped_new else Outcome.NOTHING_CHANGED
            return self.report(outcome, "")
        if record.kind == "unload" and len(down) == len(record.victims):
            return self._finish()
        await self._restart(down)
        self._restore_running_victims()
        outcome = Outcome.NEEDS_HUMAN if self.problems else Outcome.ROLLED_BACK
        return self.report(outcome, "")

    async def _why_not_finish(self, new_unit: str) -> str | None:
        """``None`` when the run can be finished: forward, no victim up, new verified."""
        if self.record.rolling_back:
            failed = f" ({self.record.detail})" if self.record.detail else ""
            return f"the run was already rolling back{failed}"
        running = [v.signature for v in self.record.victims if _up(await self._victim_state(v))]
        if running:
            return f"victim {', '.join(running)} is running too (two residents on one device)"
        return await self._verify_new(new_unit)

    # ------------------------------------------------------------------ finish

    def _finish(self) -> RecoveryReport:
        record = self.record
        for victim in record.victims:
            self._drop_if_published(victim)
        if record.victims:
            self.actions.append(f"dropped {', '.join(v.signature for v in record.victims)}")
        new = record.new
        if new is not None:
            published = replace(new, state=ResidentState.HOT)
            resolved: list[str] = []
            if record.placement_id and self.host.resolve_entry(record.placement_id, "applied"):
                resolved.append(record.placement_id)
            resolved += self.host.resolve_served(published, "applied")
            self.host.put_resident(published)
            self.actions.append(f"published {new.signature} hot on {new.device} (verified)")
            if resolved:
                self.actions.append(f"resolved {', '.join(resolved)} applied")
        return self.report(Outcome.FINISHED, "")

    # ------------------------------------------------------------------ verify the new unit

    async def _verify_new(self, unit: str) -> str | None:
        """The checks of verify-up: healthy in time, serves an accepted id, metrics as policy."""
        new = self.record.new
        assert new is not None
        why = await self._wait_up(unit, new.endpoint, self.timeouts.verify_up_s)
        if why is not None or new.endpoint is None:
            return why
        try:
            served = await self.probe.served_ids(new.endpoint, self.timeouts.http_s)
        except engines.EngineError as err:
            return str(err)
        if not set(self.record.accepted_ids).intersection(served):
            return (
                f"{new.endpoint} serves [{', '.join(served) or 'nothing'}], "
                f"not {self.record.requested}"
            )
        return await self._metrics_problem(new)

    async def _metrics_problem(self, new: Resident) -> str | None:
        model = self.host.registry().models.get(new.model)
        if model is None:
            return f"{new.model} is no longer in the registry"
        policy = self.host.service_policy(model)
        if policy is None or not policy.metrics_must_match or new.endpoint is None:
            return None
        try:
            seen = await self.probe.metrics(new.endpoint, self.timeouts.http_s)
        except engines.EngineError as err:
            return f"metricsMustMatch of service {policy.name}: {err}"
        wrong = [
            f"{key} is {seen.get(key, 'missing')!r}, policy wants {want!r}"
            for key, want in policy.metrics_must_match.items()
            if not _metric_matches(want, seen.get(key))
        ]
        return f"metricsMustMatch of service {policy.name}: {'; '.join(wrong)}" if wrong else None

    async def _wait_up(self, unit: str, endpoint: str | None, limit: float) -> str | None:
        """Until ``unit`` is active and ``/health`` answers 200; ``None`` then, else why not."""
        deadline = time.monotonic() + limit
        interval = FIRST_POLL_S
        while True:
            state = await self._state(unit)
            if state.active_state in _DOWN:
                return f"{unit} is {_state_text(state)}"
            if state.active_state == "active":
                if endpoint is None:
                    return None
                probe_s = max(0.05, min(self.timeouts.http_s, deadline - time.monotonic()))
                if await self.probe.health(endpoint, probe_s):
                    return None
            if time.monotonic() >= deadline:
                return f"{unit} not healthy after {limit:g}s (unit {_state_text(state)})"
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(interval * 1.5, MAX_POLL_S)

    # ------------------------------------------------------------------ roll back

    async def _stop_new(self, unit: str) -> bool:
        outcome = await self.units.stop_unit(unit, self.timeouts.stop_s)
        state = await self._state(unit)
        if outcome.ok and state.active_state in _DOWN:
            self.actions.append(f"stopped {unit}, which the run had started")
            self._drop_if_published(self.record.new)
            return True
        self.problems.append(
            f"{unit} is {_state_text(state)} after its stop job ({_outcome_text(outcome)}); "
            "the victims were not restarted (two residents must not share the device)"
        )
        return False

    async def _down_victims(self) -> list[Resident]:
        """The victims whose unit is down now (a stop still running is awaited first)."""
        down: list[Resident] = []
        for victim in self.record.victims:
            state = await self._victim_state(victim)
            if state.active_state == "deactivating":
                unit = _unit(victim)
                assert unit is not None
                await self.units.stop_unit(unit, self.timeouts.stop_s)
                state = await self._state(unit)
            if state.active_state in _DOWN:
                down.append(victim)
        return down

    async def _restart(self, victims: Sequence[Resident]) -> None:
        memory = await self._memory_problem(victims)
        if memory is not None:
            self.problems.append(f"victims not restarted: {memory}")
            return
        for victim in victims:
            unit = _unit(victim)
            assert unit is not None
            outcome = await self.units.start_unit(unit, self.timeouts.start_s)
            if not outcome.ok:
                state = await self._state(unit)
                self.problems.append(
                    f"{unit}: start job {_outcome_text(outcome)}; unit {_state_text(state)}"
                )
                continue
            why = await self._wait_up(unit, victim.endpoint, self.timeouts.rollback_up_s)
            if why is not None:
                self.problems.append(why)
                continue
            self.host.put_resident(replace(victim, state=ResidentState.HOT))
            self.actions.append(f"restarted {unit} ({victim.signature} healthy again)")

    async def _memory_problem(self, victims: Sequence[Resident]) -> str | None:
        """Wait (``verify_free_s``) until the probe shows room for every victim to restart."""
        need = sum(v.gpu_mib or 0.0 for v in victims if v.device == self.record.device)
        deadline = time.monotonic() + self.timeouts.verify_free_s
        while True:
            reading = (await self.host.read_devices()).get(self.record.device)
            problem = _room_problem(reading, self.record.device, need)
            if problem is None:
                return None
            if time.monotonic() >= deadline:
                return f"after {self.timeouts.verify_free_s:g}s: {problem}"
            await asyncio.sleep(self.timeouts.verify_free_poll_s)

    def _restore_running_victims(self) -> None:
        """Lift the crashed run's ``draining`` marks: the victims are served again as before.

        A victim not published at all is left to the unit sync, which follows its unit.
        """
        current = {(r.model, r.config, r.device): r for r in self.host.residents()}
        for victim in self.record.victims:
            now = current.get((victim.model, victim.config, victim.device))
            if now is not None and now.state is ResidentState.DRAINING:
                self.host.put_resident(replace(now, state=_before_run(victim)))

    def _drop_if_published(self, resident: Resident | None) -> None:
        if resident is None:
            return
        key = (resident.model, resident.config, resident.device)
        for current in self.host.residents():
            if (current.model, current.config, current.device) == key:
                self.host.drop_resident(current)

    # ------------------------------------------------------------------ reading

    async def _state(self, unit: str) -> UnitState:
        return await self.units.state(unit)

    async def _victim_state(self, victim: Resident) -> UnitState:
        unit = _unit(victim)
        if unit is None:  # enforcement never stops a unitless resident; treat it as running
            return UnitState("active", "running", "loaded", 0, "")
        return await self._state(unit)

    # ------------------------------------------------------------------ the report

    def report(self, outcome: Outcome, extra: str) -> RecoveryReport:
        record = self.record
        head = (
            f"{record.run_id} ({record.describe()}) was cut short at step {record.step} "
            "by a restart of uapplaced"
        )
        verdicts = {
            Outcome.NOTHING_CHANGED: "no unit had changed; nothing to repair",
            Outcome.FINISHED: "finished",
            Outcome.ROLLED_BACK: "rolled back",
            Outcome.NEEDS_HUMAN: "could NOT be repaired: a human must look",
        }
        parts = [f"{head}: {verdicts[outcome]}"]
        if self.actions:
            parts.append("; ".join(self.actions))
        if self.problems:
            parts.append("problems: " + "; ".join(self.problems))
        if extra:
            parts.append(extra)
        if outcome is not Outcome.FINISHED and record.placement_id:
            parts.append(f"placement {record.placement_id} stays pending, re-planned")
        return RecoveryReport(
            record.run_id, outcome, " — ".join(parts), tuple(self.actions), tuple(self.problems)
        )


# --------------------------------------------------------------------------- the daemon's host


class ControllerRecoveryHost:
    """:class:`RecoveryHost` over the daemon's controller (via ``enforce.ControllerHost``)."""

    def __init__(self, controller: Controller) -> None:
        from uapplace.enforce import ControllerHost

        self.controller = controller
        self._host = ControllerHost(controller)

    def registry(self) -> Registry:
        return self._host.registry()

    def residents(self) -> Sequence[Resident]:
        return self._host.residents()

    def put_resident(self, resident: Resident) -> None:
        self._host.put_resident(resident)

    def drop_resident(self, resident: Resident) -> None:
        self._host.drop_resident(resident)

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        return self._host.resolve_entry(placement_id, outcome)

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        return self._host.resolve_served(resident, outcome)

    def service_policy(self, model: Model) -> ServicePolicy | None:
        return self._host.service_policy(model)

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return await self._host.read_devices()

    def raise_alert(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any] | None = None,
    ) -> object:
        return self.controller.raise_alert(kind, severity, subject, message, detail)

    async def replan_pending(self) -> None:
        await self.controller.replan_pending()


# --------------------------------------------------------------------------- helpers


def _unit(resident: Resident | None) -> str | None:
    if resident is None or not resident.unit:
        return None
    return unit_file_name(resident.unit)


def _up(state: UnitState) -> bool:
    return state.active_state in _UP


def _before_run(victim: Resident) -> ResidentState:
    return ResidentState.HOT if victim.state is ResidentState.DRAINING else victim.state


def _room_problem(reading: DeviceReading | None, device: str, need: float) -> str | None:
    if reading is None:
        return f"{device} is not in the probe's readings"
    if reading.source is ProbeSource.ABSENT:
        return f"{device} cannot be read: {reading.error or 'absent'}"
    if reading.free_mib + 1e-6 >= need:
        return None
    rows = "; ".join(
        f"pid {p.pid} `{p.command or '?'}` {p.used_mib:,.0f} MiB" for p in reading.processes
    )
    held = f" (processes on it: {rows})" if rows else ""
    return f"{device} has {reading.free_mib:,.0f} MiB free, the victims need {need:,.0f} MiB{held}"


def _state_text(state: UnitState) -> str:
    text = f"{state.active_state}/{state.sub_state}"
    if state.result and state.result != "success":
        text += f" (result {state.result})"
    return text


def _outcome_text(outcome: JobOutcome) -> str:
    return f"{outcome.result}: {outcome.detail}" if outcome.detail else outcome.result


def _metric_matches(want: str | int | float, seen: str | float | None) -> bool:
    if seen is None:
        return False
    if isinstance(want, int | float) and isinstance(seen, int | float):
        return float(want) == float(seen)
    return str(want).strip().lower() == str(seen).strip().lower()
