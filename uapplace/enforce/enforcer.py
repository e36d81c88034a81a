"""Enforcement: the docs/placement-rules.md §4.6 sequence, one run at a time, with rollback.

Every ``Apply``, ``Load`` and ``Unload`` goes through one sequence of named
steps, each reported as it ends (``EnforcementStep(run_id, step, ok, detail)``)
and returned in the result (docs/http-contract.md §4)::

    revalidate → preflight → mark-draining → drain → stop → verify-free → start
               → verify-up → refresh-proxy → resolve

This module is the driver: the public verbs (:meth:`Enforcer.apply`,
:meth:`~Enforcer.load`, :meth:`~Enforcer.unload`), the one-run lock, and the
order of the steps. The parts live where they are explained:

- :mod:`uapplace.enforce.revalidate`: **revalidate** (what the run does, or ``Drifted``);
- :mod:`uapplace.enforce.steps`: **preflight** … **resolve** (the forward steps);
- :mod:`uapplace.enforce.pause`: **pause** and **wake** (issue 12) and their undoing, and
  a llama.cpp router model's unload and load (issue 19: its **start** is a load in the
  running router, never a unit restart);
- :mod:`uapplace.enforce.rollback`: the rollback, ``runningAfter``, ROLLBACK INCOMPLETE and
  the unattended-run alerts;
- :mod:`uapplace.enforce.run`: the run's bookkeeping and result shapes (the step names:
  :mod:`uapplace.core.steps`);
- :mod:`uapplace.enforce.journaling`: the journal record written before each unit change;
- :mod:`uapplace.files.timeouts`: how long each step may wait.

The outside world comes in through seams (:mod:`uapplace.io.seams`): a
:class:`~uapplace.io.seams.UnitControl` for systemd and an
:class:`~uapplace.io.seams.EngineProbe` for the engines' HTTP routes, a
:class:`~uapplace.io.router.RouterProbe` for llama.cpp routers', besides the
:class:`~uapplace.enforce.host.EnforcementHost` for the controller. Wiring
(:mod:`uapplace.daemon.wiring`) passes the real ones; the unit tier passes fakes.

Concurrency: one run machine-wide. A second operator call while one runs gets
:class:`~uapplace.core.errors.Busy` at once (naming the running one), because a bus
call blocked for minutes would outlive every client timeout; background callers
(the auto runner) pass ``wait=True`` and queue behind it. Nothing here blocks
the loop: systemd work goes through the unit manager (its own worker thread),
probes run in a thread, HTTP is aiohttp.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from uapplace.controller.ports import Signature
from uapplace.core.admission import chosen_option
from uapplace.core.errors import Busy
from uapplace.core.model import DEFAULT_CELLS, PendingEntry
from uapplace.core.steps import PREFLIGHT, UNEXPECTED
from uapplace.enforce import pause as enforce_pause
from uapplace.enforce import revalidate, rollback
from uapplace.enforce import steps as enforce_steps
from uapplace.enforce.host import EnforcementHost, ProxyRefresher
from uapplace.enforce.journaling import journal_clear, journal_synced
from uapplace.enforce.run import (
    EnforcementResult,
    Run,
    RunContext,
    StepFailed,
    Target,
    UnitFollower,
    normalize_signature,
    option_text,
)
from uapplace.enforce.snapshot import RegistrySnapshot
from uapplace.files.journal import Journal
from uapplace.files.timeouts import Timeouts
from uapplace.io.counters import run_outcome
from uapplace.io.router import HTTP_ROUTER, RouterProbe
from uapplace.io.seams import HTTP_ENGINES, EngineProbe, UnitControl
from uapplace.publish.unitsync import EnforcementMarks

log = logging.getLogger(__name__)


class Enforcer:
    """Runs the §4.6 sequence. Build once per daemon; ``units`` must be connected."""

    def __init__(
        self,
        host: EnforcementHost,
        units: UnitControl,
        *,
        timeouts: Timeouts | None = None,
        refresher: ProxyRefresher | None = None,
        marks: EnforcementMarks | None = None,
        clock: Callable[[], float] = time.time,
        journal: Journal | None = None,
        engines: EngineProbe = HTTP_ENGINES,
        routers: RouterProbe = HTTP_ROUTER,
    ) -> None:
        self.host = host
        self.units = units
        self.timeouts = timeouts or Timeouts()
        self.refresher = refresher
        self.marks = marks or EnforcementMarks()
        self.journal = journal
        """Where each unit-changing step is recorded first (crash recovery); ``None``: nowhere."""
        self.ctx = RunContext(
            host=host,
            units=units,
            engines=engines,
            timeouts=self.timeouts,
            marks=self.marks,
            follower=UnitFollower(units, self.timeouts, engines, routers),
            journal=journal,
            refresher=refresher,
            clock=clock,
            routers=routers,
        )
        self._lock = asyncio.Lock()
        self._running: str | None = None
        self._applying: str | None = None
        self._drained: frozenset[str] = frozenset()
        self._clearing: asyncio.Future[None] | None = None
        """The fsync that makes the last run's journal removal durable, which its reply
        does not wait for (issue 23); whoever takes the lock next awaits it first."""

    # ------------------------------------------------------------------ public

    @property
    def running(self) -> str | None:
        """``"<run id> (<what>)"`` while a run is in progress, else ``None``."""
        return self._running

    @property
    def applying(self) -> str | None:
        """The placement id the run in progress resolves (an ``Apply``), else ``None``:
        a ``Dismiss`` of it is ``Busy`` until the run ends (issue 20)."""
        return self._applying

    @property
    def drained(self) -> frozenset[str]:
        """The models whose victims the run in progress has drained: past that point it
        stops or pauses them whatever a new hold says, so a ``Hold`` on them is ``Busy``
        (a hold during the drain is waited for, and rolls the run back at its bound)."""
        return self._drained

    async def wait_idle(self) -> None:
        async with self._lock:
            await self._journal_cleared()

    async def _journal_cleared(self) -> None:
        """Wait for the last run's journal removal to be durable (holding the lock)."""
        clearing, self._clearing = self._clearing, None
        if clearing is None:
            return
        try:
            await clearing
        except Exception:  # journal_synced logs what it expects; anything else, here
            log.exception("syncing the last run's enforcement journal removal failed")

    def use_timeouts(self, timeouts: Timeouts) -> None:
        """SIGHUP's re-read ``enforcement-timeouts.json``: the next run waits by it."""
        self.timeouts = timeouts
        self.ctx.follower.timeouts = timeouts
        self.ctx = dataclasses.replace(self.ctx, timeouts=timeouts)

    @contextlib.asynccontextmanager
    async def exclusive(self, what: str) -> AsyncIterator[None]:
        """Hold the one-run-at-a-time lock for work that takes units down outside a run
        (``measure --envelope``): :class:`~uapplace.core.errors.Busy` at once when a run is in
        progress, and no run starts until it ends."""
        if self._lock.locked():
            raise Busy(
                f"an enforcement is running ({self._running}); one runs at a time "
                "machine-wide: retry when it has finished"
            )
        async with self._lock:
            await self._journal_cleared()
            self._running = what
            try:
                yield
            finally:
                self._running = None

    async def apply(
        self,
        entry: PendingEntry,
        option: int,
        expected: Signature | None = None,
        *,
        wait: bool = False,
        origin: str | None = None,
    ) -> dict[str, Any]:
        """Enforce option ``option`` (1-based) of a pending entry.

        ``expected`` is the approval signature (``model/config`` of every victim);
        ``None`` compares against the victims of the stored option the index names,
        i.e. what ``ListPending`` showed. Raises ``InvalidArgument`` for a bad index, ``Drifted``
        when revalidation refuses, ``Busy`` when another run is in progress and
        ``wait`` is false. Returns the result JSON otherwise (``ok`` false after a
        preflight refusal or a rollback). ``origin`` names an unattended caller
        (``"notification"``, ``"auto"``): its failure also raises an alert.
        """
        approved = chosen_option(entry, option)
        signature = normalize_signature(expected)
        if signature is None:
            signature = approved.signature
        what = f"apply {entry.id} option {option} ({option_text(approved)})"

        async def target(ctx: RunContext, run: Run) -> Target:
            enforce_steps.prefetch_preflight(ctx, run, approved)
            return await revalidate.option_target(run.host, run, entry, approved, signature)

        result = await self._enforce(what, target, entry.id, wait, origin)
        return result.to_json()

    async def load(
        self,
        model: str,
        expected: Signature,
        *,
        cells: int = DEFAULT_CELLS,
        wait: bool = False,
    ) -> dict[str, Any]:
        """Load ``model`` with the planner's recommended option (operator-initiated).

        ``expected`` is the signature of the recommended option the operator saw
        (``Preview``'s first option; ``[]`` when it stops nothing): the run refuses
        with ``Drifted`` when the recommended option now stops anything else.
        """
        signature = normalize_signature(expected) or ()

        async def target(ctx: RunContext, run: Run) -> Target:
            return await revalidate.load_target(run.host, run, model, cells, signature)

        result = await self._enforce(f"load {model}", target, None, wait)
        return result.to_json()

    async def unload(
        self, model: str, expected: Signature, *, wait: bool = False
    ) -> dict[str, Any]:
        """Stop every resident serving ``model`` (drain first, rollback on failure).

        ``expected`` is the signature ``PreviewUnload`` showed (the residents that
        stop); a different set now is ``Drifted``.
        """
        signature = normalize_signature(expected) or ()

        async def target(ctx: RunContext, run: Run) -> Target:
            return await revalidate.unload_target(run.host, run, model, signature)

        result = await self._enforce(f"unload {model}", target, None, wait)
        return result.to_json()

    # ------------------------------------------------------------------ the run

    async def _enforce(
        self,
        what: str,
        target_of: Callable[[RunContext, Run], Awaitable[Target]],
        placement_id: str | None,
        wait: bool,
        origin: str | None = None,
    ) -> EnforcementResult:
        if self._lock.locked() and not wait:
            raise Busy(
                f"another enforcement is running ({self._running}); one runs at a time "
                "machine-wide: retry when it has finished"
            )
        async with self._lock:
            await self._journal_cleared()
            # One registry for the whole run, whatever a reload swaps meanwhile (issue 20;
            # uapplace.enforce.snapshot).
            ctx = dataclasses.replace(self.ctx, host=RegistrySnapshot(self.host))
            run = Run(run_id=f"run-{secrets.token_hex(4)}", what=what, host=ctx.host)
            self._running = f"{run.run_id} ({what})"
            self._applying = placement_id
            outcome = "refused"  # revalidation said no (or raised): nothing ran
            try:
                target = await target_of(ctx, run)
                result = await self._sequence(ctx, run, target, placement_id)
                outcome = run_outcome(result.ok, result.rolled_back)
                # The journal is gone before the reply; only the directory's fsync that
                # makes its removal durable follows it, awaited by the journal's next user
                # (docs/performance.md, "Swap at the shell's pace").
                await journal_clear(ctx, run, sync=False)
                self._clearing = journal_synced(ctx)
                by = rollback.unattended(target, wait, origin)
                rollback.alert_unattended(ctx, run, target, result, by)
                return result
            finally:
                rollback.release_marks(ctx, run)
                self._running = None
                self._applying = None
                self._drained = frozenset()
                self._count_run(run, what.split(" ", 1)[0], outcome)

    def _count_run(self, run: Run, verb: str, outcome: str) -> None:
        """The daemon's run counters (issue 13: ``/metrics`` counts every run, whoever
        started it)."""
        self.host.run_finished(run.run_id, verb, outcome)

    async def _sequence(
        self, ctx: RunContext, run: Run, target: Target, placement_id: str | None
    ) -> EnforcementResult:
        if target.reuse is not None:
            await enforce_steps.resolve(ctx, run, target)
            return self._succeeded(ctx, run, target, placement_id)
        refusal = await enforce_steps.preflight(ctx, run, target)
        if refusal is not None:
            return EnforcementResult(
                False,
                run.run_id,
                placement_id,
                tuple(run.steps),
                error=f"{PREFLIGHT}: {refusal}; nothing was stopped",
                running_after=await rollback.running_after(ctx, target),
            )
        try:
            enforce_steps.mark_draining(ctx, run, target)
            await enforce_steps.drain(ctx, run, target)
            self._drained = frozenset(v.model for v in target.victims)
            await enforce_pause.pause(ctx, run, target)
            await enforce_steps.stop(ctx, run, target)
            await enforce_steps.verify_free(ctx, run, target)
            if target.wake is not None:
                await enforce_pause.wake(ctx, run, target, target.wake)
            elif target.router is not None:
                await enforce_pause.load(ctx, run, target, target.router)
            elif target.new_unit is not None:
                await enforce_steps.start(ctx, run, target)
                await enforce_steps.verify_up(ctx, run, target)
        except StepFailed as failure:
            return await rollback.failed_result(ctx, run, target, placement_id, failure)
        except Exception as err:  # a bug or a dead probe mid-run must still roll back
            log.exception("%s: unexpected error mid-run; rolling back", run.run_id)
            unexpected = run.fail(UNEXPECTED, f"{type(err).__name__}: {err}")
            return await rollback.failed_result(ctx, run, target, placement_id, unexpected)
        await enforce_steps.refresh_proxy(ctx, run)
        await enforce_steps.resolve(ctx, run, target)
        return self._succeeded(ctx, run, target, placement_id)

    def _succeeded(
        self, ctx: RunContext, run: Run, target: Target, placement_id: str | None
    ) -> EnforcementResult:
        return EnforcementResult(
            True,
            run.run_id,
            placement_id,
            tuple(run.steps),
            running_after=rollback.published(ctx, target),
        )
