"""The repair of one enforcement run a crash cut short: the rows of the table in
:mod:`uapplace.recovery.recover`, as actions.

:class:`Repair` is built by :func:`uapplace.recovery.recover.recover` for the journaled run;
:meth:`Repair.run` walks the table (finish the run, or stop the new unit and roll
the victims back) and returns the :class:`RecoveryReport` the alert carries. What
it observes comes from :class:`~uapplace.recovery.checks.RunChecks`; what it changes
goes through the unit manager, the engines' pause levers (a llama.cpp router model's
through :mod:`uapplace.recovery.routed`: unload for sleep and for "stop new", load for
wake; its router's unit is never stopped while it hosts other models) and the host.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from uapplace.core.alerts import AlertKind
from uapplace.core.model import Registry, Resident, ResidentState, resident_key
from uapplace.core.steps import PAUSE, STOP, VERIFY_FREE, WAKE
from uapplace.core.unitnames import unit_file_name
from uapplace.core.victims import config_of
from uapplace.enforce.run import paused_resident
from uapplace.files.journal import RunRecord
from uapplace.io import engines
from uapplace.io.router import RouterError, RouterSlot
from uapplace.io.seams import EngineProbe, UnitControl
from uapplace.io.units import outcome_text, state_text, unit_of
from uapplace.recovery import routed
from uapplace.recovery.checks import RecoveryHost, RunChecks, is_down, is_up

if TYPE_CHECKING:
    from uapplace.files.timeouts import Timeouts

log = logging.getLogger(__name__)


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


class Repair:
    """One journaled run, reconciled with the units, the engines and the probe."""

    def __init__(self, checks: RunChecks) -> None:
        self.checks = checks
        """What the repair observes (unit states, verify, ``/is_sleeping``, free memory)."""
        self.record: RunRecord = checks.record
        self.host: RecoveryHost = checks.host
        self.units: UnitControl = checks.units
        self.timeouts: Timeouts = checks.timeouts
        self.probe: EngineProbe = checks.probe
        self.actions: list[str] = []
        self.problems: list[str] = []
        self.changed = False
        """Whether the repair changed a unit or an engine (stop, start, sleep, wake)."""
        self.found: list[str] = []
        """What the repair found that the journal alone does not say: a sleep or wake in
        flight, a unit up again that the run had stopped (the alert says it)."""

    # ------------------------------------------------------------------ the table

    async def run(self) -> RecoveryReport:
        if self.record.wake is not None:
            return await self._run_wake(self.record.wake)
        record = self.record
        new_unit = unit_of(record.new) if record.new is not None else None
        if new_unit is not None and await self._new_running(new_unit):
            why_not = await self._why_not_finish(lambda: self.checks.verify_new(new_unit))
            if why_not is None:
                return self._finish(self._published_new())
            self.actions.append(f"{new_unit} not kept: {why_not}")
            if not await self._stop_new(new_unit):
                await self._settle_left_running()
                return self.report(Outcome.NEEDS_HUMAN, "")
        elif new_unit is not None:
            self._drop_if_published(record.new)
        return await self._roll_back_victims()

    async def _new_running(self, unit: str) -> bool:
        """The new unit is up; for a router model, its router says it runs (a model the
        router says ``unloaded`` was never loaded, or its load ended: it is down)."""
        slot = self.checks.slot_of(self.record.new)
        if slot is not None:
            return await self.checks.routed_running(slot)
        return is_up(await self.checks.state(unit))

    async def _run_wake(self, twin: Resident) -> RecoveryReport:
        """Rows 13-14: a wake run (the requested model was paused) cut short."""
        unit = unit_of(twin)
        if unit is not None and not is_up(await self.checks.state(unit)):
            self._drop_if_published(twin)
            self.actions.append(f"{twin.signature}'s unit {unit} is down: no longer resident")
        elif twin.endpoint is not None:
            if self.record.step in (PAUSE, STOP, VERIFY_FREE):
                # The wake was never sent: nothing to verify (nor to wait a wake bound for).
                why_not: str | None = (
                    f"the run was cut short at {self.record.step}, before the wake"
                )
            else:
                if self.record.step == WAKE:
                    self.found.append(
                        f"{twin.signature}'s wake may have been in flight (journal step wake): "
                        "waited for its engine within the wake bound"
                    )
                why_not = await self._why_not_finish(lambda: self.checks.verify_woken(twin))
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
            slot = self.checks.slot_of(victim)
            if slot is not None:  # stopped or paused alike, its router unloads it
                if not await self.checks.asleep(victim) and await self.checks.routed_running(slot):
                    awake.append(victim.signature)
                continue
            if not is_up(await self.checks.victim_state(victim)):
                continue
            if self.record.action_of(victim) == "stop" or not await self.checks.asleep(victim):
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
        kept = [v for v in record.pausing if v.signature in self.checks.asleep_seen]
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

    # ------------------------------------------------------------------ roll back

    async def _stop_new(self, unit: str) -> bool:
        slot = self.checks.slot_of(self.record.new)
        if slot is not None and not self._router_is_the_runs(slot):
            return await self._unload_new(slot)
        outcome = await self.units.stop_unit(unit, self.timeouts.stop_s)
        state = await self.checks.state(unit)
        if outcome.ok and is_down(state):
            self.actions.append(f"stopped {unit}, which the run had started")
            self._drop_if_published(self.record.new)
            self.changed = True
            return True
        self.problems.append(
            f"{unit} is {state_text(state)} after its stop job ({outcome_text(outcome)}); "
            "the victims were not restarted (two residents must not share the device)"
        )
        return False

    def _router_is_the_runs(self, slot: RouterSlot) -> bool:
        """The run started ``slot``'s router (it was down before) and no other resident
        lives in it: stopping its unit, as the run's own rollback does, takes nothing else
        down."""
        started = self.record.started_unit
        if started is None or unit_file_name(started) != slot.unit:
            return False
        new = self.record.new
        assert new is not None
        return not any(
            r.unit is not None
            and unit_file_name(r.unit) == slot.unit
            and resident_key(r) != resident_key(new)
            for r in self.host.residents()
        )

    async def _unload_new(self, slot: RouterSlot) -> bool:
        """Stop new, for a router model the run loaded in a router that hosts others (or
        ran before the run): unload it and see it gone; the router keeps running."""
        why = await routed.unload(self.checks, slot)
        self.changed = True
        if why is None:
            self.actions.append(
                f"unloaded {slot.model_id}, which the run had loaded, from {slot.label} "
                "(the router keeps running)"
            )
            self._drop_if_published(self.record.new)
            return True
        self.problems.append(
            f"{why}; the victims were not restored (two residents must not share the device)"
        )
        return False

    async def _put_back_to_sleep(self, twin: Resident) -> bool:
        """Row 14: the woken resident that failed its check goes back to sleep, and must
        be *seen* asleep before a victim takes the memory back. Kept ``paused``."""
        assert twin.endpoint is not None
        slot = self.checks.slot_of(twin)
        if slot is not None and not await self.checks.asleep(twin):
            why = await routed.unload(self.checks, slot)
            self.changed = True
            if why is not None:
                log.warning("recovery: re-unload of %s failed: %s", twin.signature, why)
        elif not await self.checks.asleep(twin):
            config = config_of(self.host.registry(), twin)
            level = (config.sleep_level if config is not None else None) or 1
            try:
                await self.probe.sleep(twin.endpoint, level, self.timeouts.stop_s)
                self.changed = True
            except (engines.EngineError, ValueError) as err:
                log.warning("recovery: re-sleep of %s failed: %s", twin.signature, err)
        if await self.checks.asleep(twin):
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
        unsettled = await self._settle_unloads()
        down = await self._down_victims()
        if record.kind == "unload" and record.victims and await self._all_gone(down):
            return self._finish(None)
        if down:
            self.changed = True
            await self._restart(down)
        for victim in record.victims:
            if victim not in down and victim not in unsettled:
                await self._restore_running(victim)
        if self.problems:
            return self.report(Outcome.NEEDS_HUMAN, "")
        return self.report(Outcome.ROLLED_BACK if self.changed else Outcome.NOTHING_CHANGED, "")

    async def _all_gone(self, down: Sequence[Resident]) -> bool:
        """Every victim's unit is down, or (a router model) its router unloaded it."""
        for victim in self.record.victims:
            if victim in down:
                continue
            if self.checks.slot_of(victim) is None or not await self.checks.asleep(victim):
                return False
        return True

    async def _settle_unloads(self) -> list[Resident]:
        """The router victims whose unload may have been in flight (the run died at the
        step that unloads them) and whose router still says they run: the same unload is
        sent again and seen done before anything is decided (as a sleep in flight,
        :meth:`_settle_sleep`). The ones that cannot be settled are returned, never
        published ``hot``: asleep → ``paused``, else out of the ledger."""
        unsettled: list[Resident] = []
        for victim in self.record.victims:
            slot = self.checks.slot_of(victim)
            if slot is None or not self.checks.unload_in_flight(victim):
                continue
            if not await self.checks.routed_running(slot):
                continue
            why = await routed.unload(self.checks, slot)
            self.changed = True
            if why is None:
                self.found.append(
                    f"{victim.signature}'s unload may have been in flight when uapplaced died "
                    f"(journal step {self.record.step}): let it finish (unloaded from "
                    f"{slot.label} again) before deciding"
                )
                continue
            self.problems.append(
                f"{victim.signature}: its unload was in flight when uapplaced died and could "
                f"not be settled ({why}); not published"
            )
            if await self.checks.asleep(victim):
                self.host.put_resident(_paused(self.host.registry(), victim))
            else:
                self._drop_if_published(victim)
            unsettled.append(victim)
        return unsettled

    async def _down_victims(self) -> list[Resident]:
        """The victims whose unit is down now (a stop still running is awaited first)."""
        down: list[Resident] = []
        for victim in self.record.victims:
            state = await self.checks.victim_state(victim)
            if state.active_state == "deactivating":
                unit = unit_of(victim)
                assert unit is not None
                await self.units.stop_unit(unit, self.timeouts.stop_s)
                state = await self.checks.state(unit)
            if is_down(state):
                down.append(victim)
        return down

    async def _restart(self, victims: Sequence[Resident]) -> None:
        memory = await self.checks.memory_problem(victims)
        if memory is not None:
            self.problems.append(f"victims not restarted: {memory}")
            for victim in victims:
                self._drop_if_published(victim)
            return
        for victim in victims:
            unit = unit_of(victim)
            assert unit is not None
            outcome = await self.units.start_unit(unit, self.timeouts.start_s)
            if not outcome.ok:
                state = await self.checks.state(unit)
                self.problems.append(
                    f"{unit}: start job {outcome_text(outcome)}; unit {state_text(state)}"
                )
                self._drop_if_published(victim)
                continue
            if not await self._load_again(victim):
                continue
            why = await self.checks.verify_victim(victim)
            if why is not None:
                self.problems.append(why)
                self._drop_if_published(victim)
                continue
            self.host.put_resident(replace(victim, state=ResidentState.HOT))
            self.actions.append(f"restarted {unit} ({victim.signature} healthy again)")

    async def _load_again(self, victim: Resident) -> bool:
        """A router victim whose router was down and is started again: its model is loaded
        in it (a router starts empty). ``True`` for any other victim."""
        slot = self.checks.slot_of(victim)
        if slot is None:
            return True
        try:
            await routed.load(self.checks, slot)
        except RouterError as err:
            self.problems.append(f"{victim.signature}: load in {slot.label}: {err}")
            self._drop_if_published(victim)
            return False
        return True

    async def _restore_running(self, victim: Resident) -> None:
        """A victim whose unit is up: published ``hot`` only once it passes the check.

        Asleep and paused before the run: stays ``paused``. Asleep because the run
        paused it (rows 11-12): woken (``/wake_up``), then checked. Failing the check:
        never ``hot`` — ``paused`` when it is asleep, otherwise taken out of the ledger
        (the unit sync re-verifies the running unit before publishing it).
        """
        before = _before_run(victim)
        self._note_stopped_and_up(victim)
        if self.checks.sleep_in_flight(victim) and not await self._settle_sleep(victim):
            return
        wake_in_flight = self.checks.wake_in_flight(victim)
        if await self.checks.asleep(victim):
            if wake_in_flight:
                self.found.append(
                    f"{victim.signature}'s {_wake_word(self.checks, victim)} (the rollback's) "
                    "was in flight and it is still asleep"
                )
            if before is ResidentState.PAUSED:
                self.host.put_resident(victim)
                return
            if not await self._wake(victim):
                return
        elif wake_in_flight:
            self.found.append(
                f"{victim.signature}'s {_wake_word(self.checks, victim)} (the rollback's) was "
                "in flight: found it awake"
            )
        why = await self.checks.verify_victim(victim)
        if why is None:
            self.host.put_resident(replace(victim, state=ResidentState.HOT))
            self.found.append(f"{victim.signature} verified serving, published hot")
            return
        self.problems.append(f"{victim.signature} not published: {why}")
        if await self.checks.asleep(victim):
            self.host.put_resident(_paused(self.host.registry(), victim))
        else:
            self._drop_if_published(victim)

    def _note_stopped_and_up(self, victim: Resident) -> None:
        unit = unit_of(victim)
        if unit is not None and unit_file_name(unit) in {
            unit_file_name(u) for u in self.record.stopped_units
        }:
            self.found.append(
                f"{unit}, which the run was stopping (journal step stop), is running: its "
                "stop had not happened"
                if self.record.step == STOP
                else f"{unit}, which the run had stopped, is up again (started outside this repair)"
            )

    async def _settle_sleep(self, victim: Resident) -> bool:
        """The run died with ``victim``'s ``POST /sleep`` possibly in flight (journal step
        ``pause``): the engine may fall asleep after a repair that saw it awake published
        it. The same sleep is sent again (a sleep is idempotent and the engine answers it
        once it sleeps), so its state is settled and seen before anything is decided; the
        rollback then wakes it (row 7). ``False`` (a problem recorded, never ``hot``) when
        the sleep cannot be sent."""
        assert victim.endpoint is not None
        config = config_of(self.host.registry(), victim)
        level = (config.sleep_level if config is not None else None) or 1
        try:
            await self.probe.sleep(victim.endpoint, level, self.timeouts.stop_s)
        except (engines.EngineError, ValueError) as err:
            self.problems.append(
                f"{victim.signature}: its sleep was in flight when uapplaced died and could "
                f"not be settled (POST /sleep level {level}: {err}); not published"
            )
            if await self.checks.asleep(victim):
                self.host.put_resident(_paused(self.host.registry(), victim))
            else:
                self._drop_if_published(victim)
            return False
        self.changed = True
        self.found.append(
            f"{victim.signature}'s sleep was in flight when uapplaced died (journal step pause): "
            f"let it finish (POST /sleep level {level} answered) before waking it"
        )
        return True

    async def _wake(self, victim: Resident) -> bool:
        assert victim.endpoint is not None
        slot = self.checks.slot_of(victim)
        if slot is not None:
            return await self._load_unloaded(victim, slot)
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

    async def _load_unloaded(self, victim: Resident, slot: RouterSlot) -> bool:
        """A router victim the run unloaded: its wake is a load in its router."""
        try:
            await routed.load(self.checks, slot)
        except RouterError as err:
            self.problems.append(
                f"{victim.signature}: load in {slot.label}: {err}; it stays paused"
            )
            self.host.put_resident(_paused(self.host.registry(), victim))
            return False
        self.changed = True
        self.actions.append(
            f"asked {slot.label} to load {slot.model_id} again (the run had unloaded it)"
        )
        return True

    async def _settle_left_running(self) -> None:
        """Rows 5 and 14 (a human must look): the victims are not restored, and none is
        left ``hot`` unverified: asleep → ``paused``, otherwise out of the ledger."""
        for victim in self.record.victims:
            if is_up(await self.checks.victim_state(victim)) and await self.checks.asleep(victim):
                self.host.put_resident(_paused(self.host.registry(), victim))
            else:
                self._drop_if_published(victim)

    def _drop_if_published(self, resident: Resident | None) -> None:
        if resident is None:
            return
        key = resident_key(resident)
        for current in self.host.residents():
            if resident_key(current) == key:
                self.host.drop_resident(current)

    # ------------------------------------------------------------------ the report

    def report(self, outcome: Outcome, extra: str) -> RecoveryReport:
        record = self.record
        head = (
            f"{record.run_id} ({record.describe()}) was cut short at step {record.step} "
            "by a restart of uapplaced"
        )
        verdicts = {
            Outcome.NOTHING_CHANGED: "nothing to repair",
            Outcome.FINISHED: "finished",
            Outcome.ROLLED_BACK: "rolled back",
            Outcome.NEEDS_HUMAN: "could NOT be repaired: a human must look",
        }
        parts = [f"{head}: {verdicts[outcome]}"]
        if self.found:
            parts.append("found: " + "; ".join(self.found))
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


def _wake_word(checks: RunChecks, victim: Resident) -> str:
    """What waking ``victim`` is: a router model's load, else an engine's wake."""
    return "load" if checks.slot_of(victim) is not None else "wake"


def _before_run(victim: Resident) -> ResidentState:
    return ResidentState.HOT if victim.state is ResidentState.DRAINING else victim.state


def _paused(registry: Registry, victim: Resident) -> Resident:
    """``victim`` as the ledger holds it while asleep (the enforcer's own figures)."""
    return paused_resident(registry, victim)
