"""Pending entries' options: planned after a park, re-planned on change
(:class:`PendingPlanning`), and ``ListPending``'s live view of them.

Options are planned at park time and re-planned when residents or holds change, and
after every registry reload (new measurements, devices or configs: a park that had no
option may have one now, issue 19); who
is using a victim changes far more often (every request), so the controller reads it
live (the proxy's list and the bus holds) and :func:`with_live_victims` overlays it
onto each victim instead of re-running the planner for every entry on each call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from uapplace.core.admission import Admission
from uapplace.core.model import Option, PendingEntry, Plan, Registry, Resident
from uapplace.core.planner import PlanInput
from uapplace.core.victims import pause_level, victim_of
from uapplace.files.ledger import pending_to_json

log = logging.getLogger(__name__)

ResidentKey = tuple[str, str, str]
"""``(model, config, device)``: one resident."""


def pending_listing(
    entries: Sequence[PendingEntry],
    live: Sequence[Resident],
    registry: Registry,
    inflight_known: bool,
) -> dict[str, Any]:
    """``{"pending": [entry…]}`` with each victim's holders taken from ``live``."""
    by_key = {(r.model, r.config, r.device): r for r in live}
    rows = []
    for entry in entries:
        options = tuple(
            with_live_victims(o, by_key, registry, inflight_known) for o in entry.options
        )
        row = pending_to_json(replace(entry, options=options))
        row["recommended"] = 1 if options else None
        rows.append(row)
    return {"pending": rows}


def with_live_victims(
    option: Option,
    live: Mapping[ResidentKey, Resident],
    registry: Registry,
    inflight_known: bool,
) -> Option:
    """``option`` with each victim's holders, in-flight flag, state and consequence
    taken from ``live`` (residents carrying the holders read now).

    A victim that is no longer resident keeps what was planned: the resident
    change that removed it has already asked for a re-plan, which replaces the
    option within ``REPLAN_DEBOUNCE_S``.
    """
    if not option.victims:
        return option
    victims = []
    for victim in option.victims:
        resident = live.get((victim.model, victim.config, victim.device))
        if resident is None or (
            victim.action == "pause" and pause_level(registry, resident) is None
        ):
            victims.append(victim)  # a re-plan replaces it (issue 12: no longer pausable)
            continue
        now = victim_of(registry, resident, inflight_known, victim.action)
        victims.append(
            replace(
                victim,
                holders=now.holders,
                in_flight=now.in_flight,
                state=now.state,
                consequence=now.consequence,
            )
        )
    return replace(option, victims=tuple(victims))


PARK_PLANNERS = 4
"""New parks planned at once (options attached after the admit answered)."""
REPLAN_DEBOUNCE_S = 0.1
"""How long resident changes are gathered before the pending entries are re-planned."""

PlanFor = Callable[[str, int, PlanInput | None], Awaitable[Plan]]
"""``Controller.plan_for``: the planner on ``PlanInput`` (fresh when ``None``)."""


class PendingPlanning:
    """Options for pending entries: new parks planned after the admit answered, and
    every entry re-planned when the residents, the holds or the registry change.

    Part of the controller (it builds one and is its only caller): the entries live
    in the controller's :class:`~uapplace.core.admission.Admission`, which this changes
    only through ``store`` (``Controller.replace_pending``, which persists).
    ``on_planned`` is the controller's next step for a new park (auto runner,
    notification).
    """

    def __init__(
        self,
        admission: Admission,
        plan_for: PlanFor,
        plan_input: Callable[[], Awaitable[PlanInput]],
        store: Callable[[PendingEntry], None],
        on_planned: Callable[[PendingEntry, Plan], Awaitable[None]],
        spawn: Callable[[Awaitable[None], str], None],
    ) -> None:
        self._admission = admission
        self._plan_for = plan_for
        self._plan_input = plan_input
        self._store = store
        self._on_planned = on_planned
        self._spawn = spawn
        self._to_plan: dict[str, PendingEntry] = {}
        """New parks waiting for their options, planned by at most ``PARK_PLANNERS`` tasks
        (a flood of 10,000 admits must not become 10,000 concurrent probe + plan tasks)."""
        self._planners = 0
        self._replan_wanted = asyncio.Event()
        self._generation = 0
        """Bumped by every change a plan depends on besides readings (residents,
        holds, the registry): a plan that started under an older value is stale."""
        self._replanned_generation = -1
        """``_generation`` as the last finished re-plan found it."""
        self._replan_lock = asyncio.Lock()

    @property
    def idle(self) -> bool:
        """No re-plan asked for or running (tests wait for this)."""
        return not self._replan_wanted.is_set() and not self._replan_lock.locked()

    def queue(self, entry: PendingEntry) -> None:
        """Plan a new park soon (oldest first, a few at once)."""
        self._to_plan[entry.id] = entry
        if self._planners < PARK_PLANNERS:
            self._planners += 1
            self._spawn(self._plan_queued(), "plan-parked")

    def forget(self, placement_id: str) -> None:
        """An entry pushed out by the pending caps leaves the queue too."""
        self._to_plan.pop(placement_id, None)

    async def _plan_queued(self) -> None:
        """Plan queued parks oldest first. The queue is bounded by the pending caps (an
        entry pushed out leaves it too); a few planners run at once, so one slow proxy
        answer (``plan_input`` asks it for in-flight work) does not hold up the rest."""
        try:
            while self._to_plan:
                entry = self._to_plan.pop(next(iter(self._to_plan)))
                try:
                    await self._plan_parked(entry)
                except Exception:
                    log.exception("background work plan-%s failed", entry.id)
        finally:
            self._planners -= 1

    async def _plan_parked(self, entry: PendingEntry) -> None:
        """Attach options to a new park, persist it, hand it on."""
        if self._admission.get(entry.id) is None:
            return  # already resolved, or pushed out by the pending caps in a flood
        planned_against = self._generation
        found = await self._plan_for(entry.requested_model, entry.cells, None)
        current = self._admission.get(entry.id)
        if current is None:
            return  # resolved or dismissed while we planned
        updated = replace(current, options=found.options)
        self._store(updated)
        if self._generation != planned_against:
            # Residents or holds changed while we planned (a swap under way): the
            # re-plan they asked for may have finished before this write, which
            # would leave these stale options standing. Ask for another.
            self.request_replan()
        await self._on_planned(updated, found)

    async def replan_pending(self) -> None:
        """Re-plan every pending entry against the residents and readings now.

        Options are computed once at park time; after a restart, a crash repair or
        a unit stopped by hand they name victims and free memory that no longer
        exist, and ``Apply`` would answer ``Drifted`` until the entry expired.
        One probe for all entries; entries resolved meanwhile are skipped. One
        re-plan at a time (the re-planner and ``ListPending`` both ask), so a
        later one's options are never overwritten by an earlier one's.
        """
        async with self._replan_lock:
            generation = self._generation
            entries = sorted(self._admission.pending.values(), key=lambda e: e.created_at)
            if entries:
                inp = await self._plan_input()
                for entry in entries:
                    found = await self._plan_for(entry.requested_model, entry.cells, inp)
                    current = self._admission.get(entry.id)
                    if current is not None and current.options != found.options:
                        self._store(replace(current, options=found.options))
            self._replanned_generation = generation

    async def replan_if_stale(self) -> None:
        """Re-plan now if residents or holds changed since the last re-plan started.

        The re-planner runs ``REPLAN_DEBOUNCE_S`` after a change; a ``ListPending``
        in that window (``uapplace pending`` right after a swap) would otherwise show
        options planned against the residents before it. Nothing changed (the usual
        case) costs one comparison.
        """
        if self._replanned_generation != self._generation:
            await self.replan_pending()

    def request_replan(self) -> None:
        """Ask for :meth:`replan_pending` soon; a burst of resident changes (a swap,
        a start-up reconcile) coalesces into one re-plan ``REPLAN_DEBOUNCE_S`` after
        the first request. A change during a re-plan asks again, so the last re-plan
        always starts after the last change."""
        self._generation += 1
        self._replan_wanted.set()

    async def run(self) -> None:
        """The re-planner (a task of the controller's)."""
        while True:
            await self._replan_wanted.wait()
            await asyncio.sleep(REPLAN_DEBOUNCE_S)
            self._replan_wanted.clear()
            try:
                await self.replan_pending()
            except Exception:  # a failed re-plan must not end the replanner
                log.exception("re-planning the pending entries failed")
