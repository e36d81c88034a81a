"""Start-up repair of an enforcement run that a crash cut short.

Entry point: :func:`recover` (``await recover(journal, host, units, timeouts=…)``).
uapplaced calls it once at start, from :func:`uapplace.wiring.attach_enforcement`,
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

The table (``new`` = the unit the run starts, or the paused resident a wake run
wakes; ``victims`` = the residents it stops or pauses; "up" = active, activating or
reloading; "down" = inactive or failed; "asleep" = unit up and ``/is_sleeping``
true; "verify" = :func:`uapplace.verify.check`, the one publication check: health,
served id, not asleep, ``metricsMustMatch``, polled within the config's own bound
:meth:`~uapplace.timeouts.Timeouts.verify_up_bound` (:meth:`~uapplace.timeouts.Timeouts.wake_bound`
for a wake)). Rows are tried in order, the first that matches decides; the outcome
is the alert's (``recovery_done`` warning, or ``recovery_needed`` critical for HUMAN).
**No row publishes a resident ``hot`` that has not just passed verify.**

==  ==============  ========  ==============  ==============================  ===========
#   journal step    new       victims         action                          outcome
==  ==============  ========  ==============  ==============================  ===========
0   none            —         —               none (pending re-planned)       no alert
1   unreadable      —         —               moved aside to ``….broken``     HUMAN
2   forward         up        stopped: down,  verify new: passes → publish    finished
                              paused: asleep  it ``hot``, drop the stopped
                                              victims, keep the paused ones
                                              ``paused`` (not woken), resolve
                                              the entry ``applied``
3   forward         up        any             fails verify, or a victim is    → row 6
                                              up and awake (two residents):
                                              stop new
4   rollback-*      up        any             stop new (the run had failed)   → row 6
5   any             stop of new fails         victims NOT restored; asleep    HUMAN
                                              ones kept ``paused``, none
                                              ``hot``
6   any             down      unit up         verify each: passes → ``hot``   nothing /
                                                                              rolled back
7   any             down      unit up,        the run paused it: wake         rolled back
                              asleep          (``/wake_up``), then verify →
                                              ``hot``; paused before the run:
                                              stays ``paused``
8   any             down      up, fails       not published: asleep →         HUMAN
                              verify or       ``paused``, else out of the
                              wake fails      ledger (the unit sync re-checks)
9   unload          none      all down        drop the victims: the unload    finished
                                              had done its unit work
10  any             down      some down       wait (verify_free_s) for the    rolled back
                                              probe to show their memory
                                              free, start each, verify
11  any             down      some down       memory not free in time         HUMAN
                                              (orphan?): victims NOT started
12  any             down      some down       a start job or verify fails     HUMAN
                                              (the others are restarted)
13  wake, …         woken:    stopped: down,  verify the woken engine         finished
                    verifies  paused: asleep  (``/is_sleeping`` false):
                                              publish it ``hot``, as row 2
14  wake, …         fails     any             put it back to sleep, seen      → row 6
                    verify                    asleep → kept ``paused``; roll
                                              back the victims
15  wake, …         cannot    any             victims NOT restored; it is     HUMAN
                    be put                    taken out of the ledger
                    to sleep
==  ==============  ========  ==============  ==============================  ===========

Rows 13-15 are tried first for a wake run (the journal's ``wake`` names the paused
resident); its unit found down, it is dropped and the victims are rolled back. A
wake run cut short before its ``wake`` step (``pause``/``stop``/``verify-free``)
never sent the wake: row 14 at once, without waiting a wake bound.

Decisions where the spec is silent:

- A run cut short before the new unit started (journal ``stop``/``verify-free``/
  ``start`` with the new unit down) is rolled back, not finished: the operator's
  approval was for a switch that would have been seen through by this daemon,
  and their pending entry is kept (re-planned) so applying again is one click.
- A run cut short after the new unit's start job (``verify-up``) is finished
  when the new unit now passes the same checks verify-up makes
  (:func:`uapplace.verify.check`), waiting up to the config's own bound
  (``Timeouts.verify_up_bound``: measured start, else ``start_timeout_s``, else
  ``verify_up_s``; a restarted victim falls back to ``rollback_up_s``).
- A victim the run paused and found asleep beside a verified new model is kept
  ``paused``, not woken: the operator approved that pause, and waking it would
  need the memory the new model now holds.
- A sleeping engine is polled like a loading one up to the wake bound: a wake the
  crashed daemon had sent may still be in progress in the engine.
- A waking victim is not gated on the probe's free memory (its unit never
  stopped; the new unit is seen down first): a wake that finds no room fails and
  the victim stays ``paused`` (row 8).
- The journal is removed after every repair, including one that needs a human:
  the alert's ``detail.journal`` holds the whole record, and a journal kept
  would make every restart try the same repair again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from uapplace import engines, verify
from uapplace.alerts import AlertKind, AlertSink, Severity
from uapplace.capacity import ServicePolicy
from uapplace.journal import (
    STEP_PAUSE,
    STEP_STOP,
    STEP_STOPPED,
    Journal,
    JournalError,
    RunRecord,
)
from uapplace.model import (
    DeviceReading,
    Model,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
    processes_text,
)
from uapplace.planner import config_of
from uapplace.registry import unit_file_name
from uapplace.topology import verify_endpoint
from uapplace.units import JobOutcome, UnitError, UnitState, outcome_text, state_text

if TYPE_CHECKING:
    from uapplace.controller import Controller
    from uapplace.timeouts import Timeouts, UpBound

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


class RecoveryHost(AlertSink, Protocol):
    """The controller as the repair sees it (:class:`ControllerRecoveryHost`; fakes in tests)."""

    def registry(self) -> Registry: ...

    def residents(self) -> Sequence[Resident]: ...

    def put_resident(self, resident: Resident) -> None: ...

    def drop_resident(self, resident: Resident) -> None: ...

    def resolve_entry(self, placement_id: str, outcome: str) -> bool: ...

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]: ...

    def service_policy(self, model: Model) -> ServicePolicy | None: ...

    async def read_devices(self) -> Mapping[str, DeviceReading]: ...

    async def replan_pending(self) -> None: ...


class UnitControl(Protocol):
    """The part of :class:`~uapplace.units.UnitManager` the repair uses."""

    async def state(self, name: str) -> UnitState: ...

    async def start_unit(self, name: str, timeout: float) -> JobOutcome: ...  # noqa: ASYNC109

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome: ...  # noqa: ASYNC109


class EngineProbe(verify.Probe, Protocol):
    """The engine endpoints of the publication check (:class:`uapplace.verify.Probe`:
    health, served ids, ``/is_sleeping``, metrics) plus the pause levers the repair
    pulls (:class:`HttpEngines`: the real HTTP calls)."""

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None: ...

    async def wake(self, endpoint: str, timeout_s: float) -> None: ...


class HttpEngines(verify.HttpProbe):
    """:class:`EngineProbe` over :mod:`uapplace.engines`."""

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None:
        await engines.sleep(endpoint, level, timeout_s)

    async def wake(self, endpoint: str, timeout_s: float) -> None:
        await engines.wake(endpoint, timeout_s)


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
        self.changed = False
        """Whether the repair changed a unit or an engine (stop, start, wake)."""
        self._asleep_seen: set[str] = set()
        """``model/config`` of every resident ``/is_sleeping`` said true for."""

    # ------------------------------------------------------------------ the table

    async def run(self) -> RecoveryReport:
        if self.record.wake is not None:
            return await self._run_wake(self.record.wake)
        record = self.record
        new_unit = _unit(record.new)
        if new_unit is not None and _up(await self._state(new_unit)):
            why_not = await self._why_not_finish(lambda: self._verify_new(new_unit))
            if why_not is None:
                return self._finish(self._published_new())
            self.actions.append(f"{new_unit} not kept: {why_not}")
            if not await self._stop_new(new_unit):
                await self._settle_left_running()
                return self.report(Outcome.NEEDS_HUMAN, "")
        elif new_unit is not None:
            self._drop_if_published(record.new)
        return await self._roll_back_victims()

    async def _run_wake(self, twin: Resident) -> RecoveryReport:
        """Rows 13-14: a wake run (the requested model was paused) cut short."""
        unit = _unit(twin)
        if unit is not None and not _up(await self._state(unit)):
            self._drop_if_published(twin)
            self.actions.append(f"{twin.signature}'s unit {unit} is down: no longer resident")
        elif twin.endpoint is not None:
            if self.record.step in (STEP_PAUSE, STEP_STOP, STEP_STOPPED):
                # The wake was never sent: nothing to verify (nor to wait a wake bound for).
                why_not: str | None = (
                    f"the run was cut short at {self.record.step}, before the wake"
                )
            else:
                why_not = await self._why_not_finish(lambda: self._verify_woken(twin))
            if why_not is None:
                return self._finish(self._published_twin(twin))
            self.actions.append(f"{twin.signature} not published: {why_not}")
            if not await self._put_back_to_sleep(twin):
                await self._settle_left_running()
                return self.report(Outcome.NEEDS_HUMAN, "")
        return await self._roll_back_victims()

    async def _why_not_finish(self, verified: Callable[[], Awaitable[str | None]]) -> str | None:
        """``None`` when the run can be finished: forward, every stopped victim down,
        every paused victim asleep, and what it serves verified (``verified``)."""
        if self.record.rolling_back:
            failed = f" ({self.record.detail})" if self.record.detail else ""
            return f"the run was already rolling back{failed}"
        awake: list[str] = []
        for victim in self.record.victims:
            if not _up(await self._victim_state(victim)):
                continue
            if self.record.action_of(victim) == "stop" or not await self._asleep(victim):
                awake.append(victim.signature)
        if awake:
            return f"victim {', '.join(awake)} is running too (two residents on one device)"
        return await verified()

    # ------------------------------------------------------------------ finish

    def _published_new(self) -> Resident | None:
        new = self.record.new
        return replace(new, state=ResidentState.HOT) if new is not None else None

    def _published_twin(self, twin: Resident) -> Resident:
        config = config_of(self.host.registry(), twin)
        if config is None:
            return replace(twin, state=ResidentState.HOT, holders=())
        return replace(
            twin,
            state=ResidentState.HOT,
            gpu_mib=config.resident_gpu_mib,
            host_rss_mib=config.host_rss_mib,
            holders=(),
        )

    def _finish(self, published: Resident | None) -> RecoveryReport:
        """Rows 2, 7, 11, 13: see the run through. A paused victim stays a resident,
        ``paused`` (it was seen asleep); every other victim is dropped."""
        record = self.record
        kept = [v for v in record.pausing if v.signature in self._asleep_seen]
        for victim in record.victims:
            self._drop_if_published(victim)
        for victim in kept:
            self.host.put_resident(_paused(self.host.registry(), victim))
        dropped = [v.signature for v in record.victims if v not in kept]
        if dropped:
            self.actions.append(f"dropped {', '.join(dropped)}")
        if kept:
            self.actions.append(
                f"kept {', '.join(v.signature for v in kept)} paused (seen asleep; not woken)"
            )
        if published is not None:
            resolved: list[str] = []
            if record.placement_id and self.host.resolve_entry(record.placement_id, "applied"):
                resolved.append(record.placement_id)
            resolved += self.host.resolve_served(published, "applied")
            self.host.put_resident(published)
            self.actions.append(
                f"published {published.signature} hot on {published.device} (verified)"
            )
            if resolved:
                self.actions.append(f"resolved {', '.join(resolved)} applied")
        return self.report(Outcome.FINISHED, "")

    # ------------------------------------------------------------------ verify

    async def _verify_new(self, unit: str) -> str | None:
        """The new unit's verify-up (:func:`uapplace.verify.check`), bounded per config."""
        new = self.record.new
        assert new is not None
        model = self.host.registry().models.get(new.model)
        if model is None:
            return f"{new.model} is no longer in the registry"
        config = model.configs.get(new.config)
        expect = verify.expectation(
            model, config, self.record.requested, self.host.service_policy(model)
        )
        expect = replace(expect, accepted=expect.accepted | set(self.record.accepted_ids))
        bound = self.timeouts.verify_up_bound(new.signature, config, self.timeouts.verify_up_s)
        return await self._await_verified(unit, self._verify_address(new), expect, bound)

    async def _verify_woken(self, twin: Resident) -> str | None:
        """A woken engine's verify-up: the publication check, ``/is_sleeping`` false."""
        expect = self._expectation(twin, self.record.requested)
        config = config_of(self.host.registry(), twin)
        bound = self.timeouts.wake_bound(twin.signature, config, self.timeouts.verify_up_s)
        return await self._await_verified(_unit(twin), self._verify_address(twin), expect, bound)

    def _verify_address(self, resident: Resident) -> str | None:
        """Where enforcement's verify-up asks: the single upstream when the registry has
        one (the address the proxy uses, issue 13), else the resident's endpoint."""
        return verify_endpoint(resident.endpoint, self.host.registry().single_upstream)

    def _expectation(self, resident: Resident, requested: str | None) -> verify.Expectation:
        """The check a resident must pass; ``/is_sleeping`` is always asked of one the
        run paused or wakes (it was put to sleep, whatever the registry says now)."""
        model = self.host.registry().models.get(resident.model)
        if model is None:
            accepted = frozenset({resident.model, resident.config})
            return verify.Expectation(resident.model, resident.model, accepted, can_sleep=True)
        config = model.configs.get(resident.config)
        expect = verify.expectation(model, config, requested, self.host.service_policy(model))
        sleeps = self.record.action_of(resident) == "pause" or resident.signature in (
            self.record.paused
        )
        return replace(expect, can_sleep=expect.can_sleep or sleeps or requested is not None)

    async def _await_verified(
        self, unit: str | None, endpoint: str | None, expect: verify.Expectation, bound: UpBound
    ) -> str | None:
        """Poll until the unit is active and :func:`uapplace.verify.check` passes (the
        one publication check: health, served id, not asleep, ``metricsMustMatch``);
        ``None`` then, else why not. A unit that goes down, a wrong id or a policy
        mismatch end the wait at once; the rest is polled within ``bound``."""
        deadline = time.monotonic() + bound.seconds
        interval = FIRST_POLL_S
        name = unit or expect.requested
        last = "never active"
        while True:
            ready = True
            if unit is not None:
                state = await self._state(unit)
                if state.active_state in _DOWN:
                    return f"{unit} is {state_text(state)}"
                ready = state.active_state == "active"
                last = f"unit {state_text(state)}"
            if ready:
                if endpoint is None:
                    return None
                verdict = await verify.check(endpoint, expect, self.timeouts.http_s, self.probe)
                if verdict.ok:
                    return None
                if verdict.is_wrong_engine:
                    return verdict.detail
                last = verdict.detail
            if time.monotonic() >= deadline:
                return f"{name} not healthy after {bound.seconds:g}s ({last}); {bound.text()}"
            await asyncio.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            interval = min(interval * 1.5, MAX_POLL_S)

    def _may_sleep(self, resident: Resident) -> bool:
        """Whether ``/is_sleeping`` means anything for ``resident``: the run paused it,
        it was paused before, or its config has a pause lever (else not asked: a
        llama.cpp engine has no such route)."""
        if (
            self.record.action_of(resident) == "pause"
            or resident.signature in self.record.paused
            or resident.state is ResidentState.PAUSED
            or (self.record.wake is not None and resident.signature == self.record.wake.signature)
        ):
            return True
        config = config_of(self.host.registry(), resident)
        return config is not None and config.sleep_level is not None

    async def _asleep(self, resident: Resident) -> bool:
        """``/is_sleeping`` says true (remembered for :meth:`_finish`)."""
        if resident.endpoint is None or not self._may_sleep(resident):
            return False
        try:
            asleep = await self.probe.is_sleeping(resident.endpoint, self.timeouts.http_s)
        except engines.EngineError:
            asleep = None
        if asleep is True:
            self._asleep_seen.add(resident.signature)
        return asleep is True

    # ------------------------------------------------------------------ roll back

    async def _stop_new(self, unit: str) -> bool:
        outcome = await self.units.stop_unit(unit, self.timeouts.stop_s)
        state = await self._state(unit)
        if outcome.ok and state.active_state in _DOWN:
            self.actions.append(f"stopped {unit}, which the run had started")
            self._drop_if_published(self.record.new)
            self.changed = True
            return True
        self.problems.append(
            f"{unit} is {state_text(state)} after its stop job ({outcome_text(outcome)}); "
            "the victims were not restarted (two residents must not share the device)"
        )
        return False

    async def _put_back_to_sleep(self, twin: Resident) -> bool:
        """Row 14: the woken resident that failed its check goes back to sleep, and must
        be *seen* asleep before a victim takes the memory back. Kept ``paused``."""
        assert twin.endpoint is not None
        if not await self._asleep(twin):
            config = config_of(self.host.registry(), twin)
            level = (config.sleep_level if config is not None else None) or 1
            try:
                await self.probe.sleep(twin.endpoint, level, self.timeouts.stop_s)
                self.changed = True
            except (engines.EngineError, ValueError) as err:
                log.warning("recovery: re-sleep of %s failed: %s", twin.signature, err)
        if await self._asleep(twin):
            self.host.put_resident(replace(twin, state=ResidentState.PAUSED))
            self.actions.append(f"{twin.signature} is asleep: kept paused")
            return True
        self._drop_if_published(twin)
        self.problems.append(
            f"{twin.signature} could not be seen asleep after the cut-short wake; the victims "
            "were not restored (two residents must not share the device)"
        )
        return False

    async def _roll_back_victims(self) -> RecoveryReport:
        """Rows 6-12: restart stopped victims, wake paused ones, re-verify the rest."""
        record = self.record
        down = await self._down_victims()
        if record.kind == "unload" and down and len(down) == len(record.victims):
            return self._finish(None)
        if down:
            self.changed = True
            await self._restart(down)
        for victim in record.victims:
            if victim not in down:
                await self._restore_running(victim)
        if self.problems:
            return self.report(Outcome.NEEDS_HUMAN, "")
        return self.report(Outcome.ROLLED_BACK if self.changed else Outcome.NOTHING_CHANGED, "")

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
            for victim in victims:
                self._drop_if_published(victim)
            return
        for victim in victims:
            unit = _unit(victim)
            assert unit is not None
            outcome = await self.units.start_unit(unit, self.timeouts.start_s)
            if not outcome.ok:
                state = await self._state(unit)
                self.problems.append(
                    f"{unit}: start job {outcome_text(outcome)}; unit {state_text(state)}"
                )
                self._drop_if_published(victim)
                continue
            why = await self._verify_victim(victim)
            if why is not None:
                self.problems.append(why)
                self._drop_if_published(victim)
                continue
            self.host.put_resident(replace(victim, state=ResidentState.HOT))
            self.actions.append(f"restarted {unit} ({victim.signature} healthy again)")

    async def _restore_running(self, victim: Resident) -> None:
        """A victim whose unit is up: published ``hot`` only once it passes the check.

        Asleep and paused before the run: stays ``paused``. Asleep because the run
        paused it (rows 11-12): woken (``/wake_up``), then checked. Failing the check:
        never ``hot`` — ``paused`` when it is asleep, otherwise taken out of the ledger
        (the unit sync re-verifies the running unit before publishing it).
        """
        before = _before_run(victim)
        if await self._asleep(victim):
            if before is ResidentState.PAUSED:
                self.host.put_resident(victim)
                return
            if not await self._wake(victim):
                return
        why = await self._verify_victim(victim)
        if why is None:
            self.host.put_resident(replace(victim, state=ResidentState.HOT))
            return
        self.problems.append(f"{victim.signature} not published: {why}")
        if await self._asleep(victim):
            self.host.put_resident(_paused(self.host.registry(), victim))
        else:
            self._drop_if_published(victim)

    async def _wake(self, victim: Resident) -> bool:
        assert victim.endpoint is not None
        config = config_of(self.host.registry(), victim)
        bound = self.timeouts.wake_bound(victim.signature, config, self.timeouts.rollback_up_s)
        try:
            await self.probe.wake(victim.endpoint, bound.seconds)
        except engines.EngineError as err:
            self.problems.append(f"{victim.signature}: wake_up: {err}; it stays paused")
            self.host.put_resident(_paused(self.host.registry(), victim))
            return False
        self.changed = True
        self.actions.append(f"woke {victim.signature} (the run had paused it)")
        return True

    async def _verify_victim(self, victim: Resident) -> str | None:
        config = config_of(self.host.registry(), victim)
        bound = self.timeouts.verify_up_bound(victim.signature, config, self.timeouts.rollback_up_s)
        expect = self._expectation(victim, None)
        return await self._await_verified(_unit(victim), victim.endpoint, expect, bound)

    async def _settle_left_running(self) -> None:
        """Rows 5 and 14 (a human must look): the victims are not restored, and none is
        left ``hot`` unverified: asleep → ``paused``, otherwise out of the ledger."""
        for victim in self.record.victims:
            if _up(await self._victim_state(victim)) and await self._asleep(victim):
                self.host.put_resident(_paused(self.host.registry(), victim))
            else:
                self._drop_if_published(victim)

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
    """:class:`RecoveryHost` over the daemon's controller (via ``enforce_host.ControllerHost``)."""

    def __init__(self, controller: Controller) -> None:
        from uapplace.enforce_host import ControllerHost

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
    rows = processes_text(reading.processes)
    held = f" (processes on it: {rows})" if rows else ""
    return f"{device} has {reading.free_mib:,.0f} MiB free, the victims need {need:,.0f} MiB{held}"


def _paused(registry: Registry, victim: Resident) -> Resident:
    """``victim`` as the ledger holds it while asleep (the enforcer's own figures)."""
    from uapplace.enforce import paused_resident

    return paused_resident(registry, victim)
