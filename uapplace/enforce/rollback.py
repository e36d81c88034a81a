"""Rollback of a failed run, what runs at its end, and the alerts nobody may miss.

Rollback (any failure after preflight, :func:`failed_result`): stop what this run
started (a stop systemd had to force is recorded not ok, with a ``forced_stop`` alert,
as in the forward ``stop`` step), then restart every victim this run stopped, each
with its own verify-up (health and served id, bounded like verify-up from the
victim's own start facts), and clear the marks. Two same-device residents must
never run together, so the victims are restarted only once the new unit is seen
not running: a failed stop
job alone does not block them (a unit that does not exist, or is
``inactive``/``failed`` whatever its stop job said, is safe), only a new unit
observed still up (or whose state cannot be read) does. The result says
``rolled back`` or ``ROLLBACK INCOMPLETE: <observed state>``, and
``runningAfter`` lists what runs on the run's device at the end; rollback is
tried once, never looped. Paused victims and a woken resident are undone by
:mod:`uapplace.enforce.pause` (``rollback-sleep``, ``rollback-wake``).

ROLLBACK INCOMPLETE (a victim that ran before is not running and verified
again) is raised everywhere: a critical ``rollback_incomplete`` alert per
device (``host.alert_board.raise_alert``: ``GetState.alerts``, ``AlertRaised``, the
critical notification, ``uapplace status``) naming what could not be restored
and why, and the pending entry the run applied is resolved ``failed`` so its
parked clients fall back at once (docs/placement-rules.md §4.6 step 8). After a complete
rollback the entry stays pending: the machine is as before and the operator
may pick another option. An unattended run (``wait=True``: the auto runner and
the idle sweep; or ``origin`` given, e.g. a notification click) that fails or
rolls back also raises a ``enforcement_failed`` warning (:func:`alert_unattended`),
since nobody is watching its result.

A failed step whose unit failed carries the unit's last lines below its first line
(:func:`uapplace.enforce.steps.failed_unit_text`); the run's ``error`` and both alerts
keep them last, after their own words (docs/placement-rules.md §4.6, "Failed start").

Called by :mod:`uapplace.enforce.enforcer` (the sequence driver).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import Resident, resident_key
from uapplace.core.steps import (
    ROLLBACK_CLEAR,
    ROLLBACK_SLEEP,
    ROLLBACK_START,
    ROLLBACK_STOP,
    ROLLBACK_VERIFY,
    ROLLBACK_WAKE,
)
from uapplace.enforce.journaling import journal_step
from uapplace.enforce.pause import resleep, rewake_victims, unload_loaded
from uapplace.enforce.run import (
    FAILED_OUTCOME,
    ROLLBACK_INCOMPLETE,
    ROLLED_BACK,
    EnforcementResult,
    Restore,
    Run,
    RunContext,
    RunningAfter,
    StepFailed,
    Target,
    paused_resident,
)
from uapplace.enforce.steps import failed_unit_text, forced_stop
from uapplace.files.timeouts import UpBound
from uapplace.io.unitlogs import block_lines, split_last_lines
from uapplace.io.units import DOWN_STATES, outcome_text, state_text, stop_wait_s, unit_of
from uapplace.publish import verify

# --------------------------------------------------------------------------- the rollback


async def failed_result(
    ctx: RunContext, run: Run, target: Target, placement_id: str | None, failure: StepFailed
) -> EnforcementResult:
    """Roll back; on an incomplete rollback raise it everywhere (module docstring)."""
    restore, running = await rollback(ctx, run, target)
    # The failed unit's last lines (docs/placement-rules.md §4.6, "Failed start") stay last.
    detail, last_lines = split_last_lines(failure.detail)
    error = f"{failure.step}: {detail}"
    if restore.complete:
        error += f"; {ROLLED_BACK}"
    else:
        error += f"; {ROLLBACK_INCOMPLETE}: {'; '.join(restore.problems)}"
        alert_incomplete(ctx, run, target, failure, restore, running)
        if target.entry is not None:
            ctx.host.resolve_entry(target.entry.id, FAILED_OUTCOME)
    error += last_lines
    return EnforcementResult(
        False,
        run.run_id,
        placement_id,
        tuple(run.steps),
        rolled_back=restore.complete,
        error=error,
        running_after=running,
    )


async def rollback(
    ctx: RunContext, run: Run, target: Target
) -> tuple[Restore, tuple[RunningAfter, ...]]:
    """Undo what ``run`` did: what could not be restored, and what runs at the end."""
    restore = Restore()
    safe = True
    if run.started_unit is not None:  # a router this run started: its models go with it
        await journal_step(ctx, run, target, ROLLBACK_STOP)
        safe = await _stop_started(ctx, run, target, restore)
    elif run.loaded is not None:  # a model this run loaded in a running router
        await journal_step(ctx, run, target, ROLLBACK_STOP)
        safe = await unload_loaded(ctx, run, target, restore)
    if run.woke and target.wake is not None:
        await journal_step(ctx, run, target, ROLLBACK_SLEEP)
        safe = await resleep(ctx, run, target.wake, restore) and safe
    if run.stopped_units:
        if safe:
            await journal_step(ctx, run, target, ROLLBACK_START)
            await _restart_victims(ctx, run, target, restore)
        else:
            _leave_victims_down(run, restore)
    if run.paused:
        if safe:
            await journal_step(ctx, run, target, ROLLBACK_WAKE)
        await rewake_victims(ctx, run, restore, safe)
    running = await running_after(ctx, target)
    _clear(ctx, run, restore.restored, running)
    return restore, running


async def _stop_started(ctx: RunContext, run: Run, target: Target, restore: Restore) -> bool:
    """Stop the unit this run started; ``True`` once it is *seen* not running.

    The stop job's result alone does not decide: a unit that does not exist
    (the stop job errors) or is ``inactive``/``failed`` anyway is safe, and the
    victims are restarted. Only a unit observed still up, or whose state cannot
    be read, keeps them down (two residents must never share the device).
    """
    unit = run.started_unit
    assert unit is not None
    wait_s = stop_wait_s(await ctx.follower.fresh(unit), ctx.timeouts.stop_s)
    outcome = await ctx.units.stop_unit(unit, wait_s)
    state = await ctx.follower.fresh(unit)
    job = outcome_text(outcome)
    if state is not None and state.active_state in DOWN_STATES:
        seen = "does not exist" if state.load_state == "not-found" else f"is {state_text(state)}"
        down = f"{unit}, which this run started, {seen} (stop job {job}): nothing of it runs"
        how = await forced_stop(ctx, run, target, unit) if outcome.ok else None
        if how is None:
            run.record(ROLLBACK_STOP, True, down)
        else:  # never "ok" for a forced stop; not fatal: it is down, the victims come back
            run.record(ROLLBACK_STOP, False, f"{down}; it was {how} (not fatal)")
        if target.new_key is not None:
            stale = next(
                (r for r in ctx.host.residents() if resident_key(r) == target.new_key), None
            )
            if stale is not None:
                ctx.host.drop_resident(stale)
        return True
    now = state_text(state) if state is not None else "state unknown"
    observed = f"{unit} still {now} after its stop job ({job})"
    run.record(
        ROLLBACK_STOP,
        False,
        f"{observed}: the victims stay stopped, two residents must never share {target.device}",
    )
    restore.problems.append(f"{observed}; the victims were not restarted")
    restore.blocker = observed
    return False


def _leave_victims_down(run: Run, restore: Restore) -> None:
    units = list(dict.fromkeys(run.stopped_units))
    why = f"not restarted: {restore.blocker}"
    for unit in units:
        restore.unrestored[unit] = why
    run.record(ROLLBACK_START, False, f"{', '.join(units)} {why}")


async def _restart_victims(ctx: RunContext, run: Run, target: Target, restore: Restore) -> None:
    """Start every victim unit this run stopped, each with its own verify-up."""
    for unit in dict.fromkeys(run.stopped_units):
        victim = next((v for v in target.victims if unit_of(v) == unit), None)
        label = victim.signature if victim is not None else unit
        outcome = await ctx.units.start_unit(unit, ctx.timeouts.start_s)
        if not outcome.ok:
            state = await ctx.follower.state_text(unit)
            why = f"{unit}: start job {outcome_text(outcome)}; unit {state}"
            # Its own last lines in the step; the one-line why in the ROLLBACK INCOMPLETE text.
            run.record(ROLLBACK_START, False, await failed_unit_text(ctx, unit, why))
            restore.fail(unit, why)
            continue
        run.record(ROLLBACK_START, True, f"restarted {unit} ({label})")
        ok, detail = await _verify_victim(ctx, unit, victim)
        if ok:
            run.record(ROLLBACK_VERIFY, True, detail)
            restore.restored.add(unit)
        else:
            run.record(ROLLBACK_VERIFY, False, await failed_unit_text(ctx, unit, detail))
            restore.fail(unit, detail)


async def _verify_victim(ctx: RunContext, unit: str, victim: Resident | None) -> tuple[bool, str]:
    """The victim's own verify-up: health, served id, metrics policy; bounded by its
    config's start facts (:meth:`Timeouts.verify_up_bound`, ``rollback_up_s`` else)."""
    timeouts = ctx.timeouts
    watch = ctx.follower.up_watch(unit)
    if victim is None:
        bound = UpBound(timeouts.rollback_up_s, "default rollback_up_s")
        why = await verify.wait_up(unit, None, bound.seconds, watch)
        return why is None, why or f"{unit} active again; {bound.text()}"
    model = ctx.host.registry().models.get(victim.model)
    config = model.configs.get(victim.config) if model is not None else None
    bound = timeouts.verify_up_bound(victim.signature, config, timeouts.rollback_up_s)
    if model is not None:
        expect = verify.expectation(model, config, None, ctx.host.service_policy(model))
    else:
        accepted = frozenset({victim.model, victim.config})
        expect = verify.Expectation(victim.model, victim.model, accepted)
    verdict = await verify.verify_up(unit, victim.endpoint, expect, bound.seconds, watch)
    if verdict.ok:
        return True, f"{victim.signature} healthy again: {verdict.detail}; {bound.text()}"
    return False, f"{verdict.detail}; {bound.text()}"


def _clear(ctx: RunContext, run: Run, restored: set[str], running: Sequence[RunningAfter]) -> None:
    """Clear this run's marks; put back the victims that run, drop the ones that do not."""
    cleared = ctx.marks.clear_run(run.run_id)
    stopped = set(run.stopped_units)
    paused = {resident_key(v) for v in run.paused}
    registry = ctx.host.registry()
    for victim in run.victims:
        unit = unit_of(victim)
        if unit in stopped and unit not in restored:
            ctx.host.drop_resident(victim)
        elif resident_key(victim) in paused and unit not in restored:
            # Still resident, asleep: never published as serving (issue 12).
            ctx.host.put_resident(paused_resident(registry, victim))
        else:
            ctx.host.put_resident(victim)
    names = ", ".join(f"{m}/{c}" for m, c, _ in cleared) or "none"
    now = ", ".join(r.text() for r in running) or "nothing"
    run.record(ROLLBACK_CLEAR, True, f"draining marks cleared ({names}); running now: {now}")


# --------------------------------------------------------------------------- the end of a run


def published(ctx: RunContext, target: Target) -> tuple[RunningAfter, ...]:
    """After a successful run: the residents on its device(s), as published."""
    devices = target.devices
    return tuple(
        RunningAfter(r.model, r.config, r.device, unit_of(r), r.state.value)
        for r in ctx.host.residents()
        if r.device in devices
    )


async def running_after(ctx: RunContext, target: Target) -> tuple[RunningAfter, ...]:
    """After a failed run: what runs on its device(s), read from systemd now.

    Residents there, the victims and the new unit; a unit ``inactive`` or
    ``failed`` is not running; one whose state cannot be read is listed as
    ``state unknown`` (never assumed gone).
    """
    devices = target.devices
    seen: dict[tuple[str, str, str], str | None] = {}
    for resident in [*ctx.host.residents(), *target.victims]:
        if resident.device in devices:
            seen.setdefault((resident.model, resident.config, resident.device), unit_of(resident))
    if target.config is not None and target.new_unit is not None and target.router is None:
        # (A router model's unit runs for its siblings too: its state says nothing of it.)
        seen.setdefault((target.model.key, target.config.key, target.device), target.new_unit)
    out: list[RunningAfter] = []
    for (model, config, device), unit in seen.items():
        if unit is None:
            out.append(RunningAfter(model, config, device, None, "published, no unit"))
            continue
        state = await ctx.follower.fresh(unit)
        if state is not None and state.active_state in DOWN_STATES:
            continue
        text = state_text(state) if state is not None else "state unknown"
        out.append(RunningAfter(model, config, device, unit, text))
    return tuple(out)


# --------------------------------------------------------------------------- alerts


def alert_incomplete(
    ctx: RunContext,
    run: Run,
    target: Target,
    failure: StepFailed,
    restore: Restore,
    running: Sequence[RunningAfter],
) -> None:
    """One critical ``rollback_incomplete`` alert per device left emptier than before."""
    lost_by_device: dict[str, list[Resident]] = {}
    for victim in run.victims:
        if unit_of(victim) in restore.unrestored:
            lost_by_device.setdefault(victim.device, []).append(victim)
    if not lost_by_device:  # nothing lost, but the new unit could not be stopped
        lost_by_device[target.device] = []
    detail, last_lines = split_last_lines(failure.detail)
    for device, lost in sorted(lost_by_device.items()):
        ctx.raise_safely(
            AlertKind.ROLLBACK_INCOMPLETE,
            Severity.CRITICAL,
            device,
            _incomplete_message(run, device, failure, restore, lost, running),
            {
                "runId": run.run_id,
                "run": run.what,
                "placementId": target.entry.id if target.entry is not None else None,
                "failedStep": failure.step,
                "failure": detail,
                "lastLines": block_lines(last_lines),
                "notRestored": [
                    {
                        "model": v.model,
                        "config": v.config,
                        "unit": unit_of(v),
                        "why": restore.unrestored.get(unit_of(v) or "", ""),
                    }
                    for v in lost
                ],
                "problems": list(restore.problems),
                "runningAfter": [r.to_json() for r in running if r.device == device],
            },
        )


def _incomplete_message(
    run: Run,
    device: str,
    failure: StepFailed,
    restore: Restore,
    lost: Sequence[Resident],
    running: Sequence[RunningAfter],
) -> str:
    if lost:
        what = "; ".join(
            f"{v.signature} ({unit_of(v)}): {restore.unrestored.get(unit_of(v) or '', '')}"
            for v in lost
        )
        had = ", ".join(v.signature for v in lost)
    else:
        what = "; ".join(restore.problems)
        had = "its residents"
    here = [r for r in running if r.device == device]
    now = (
        f"{device} now runs {', '.join(r.text() for r in here)}"
        if here
        else f"{device} is now EMPTY (it had {had})"
    )
    detail, last_lines = split_last_lines(failure.detail)
    return (
        f"{ROLLBACK_INCOMPLETE} on {device}: {run.what} failed at {failure.step} "
        f"({detail}) and could not restore {what}. {now}. Rollback is tried once, "
        f"never looped: start the units by hand once the cause is fixed.{last_lines}"
    )


def unattended(target: Target, wait: bool, origin: str | None) -> str | None:
    """Who runs this unattended, or ``None`` for an operator's call.

    ``origin`` when a caller names itself (a notification click); otherwise a
    queued (``wait=True``) run is a background one: the auto runner applies, the
    idle sweep unloads (the only two callers that queue).
    """
    if origin is not None:
        return origin
    if not wait:
        return None
    return {"apply": "auto-load", "unload": "idle unload"}.get(target.kind, "background run")


def alert_unattended(
    ctx: RunContext, run: Run, target: Target, result: EnforcementResult, origin: str | None
) -> None:
    """A failed unattended run is an alert: nobody is watching its result."""
    if origin is None or result.ok or result.rolled_back is False:
        return  # done, attended, or already a critical rollback_incomplete alert
    how = (
        "failed and was rolled back"
        if result.rolled_back
        else "was refused before anything stopped"
    )
    running = ", ".join(r.text() for r in result.running_after or ()) or "nothing"
    # A failed unit's last lines (docs/placement-rules.md §4.6, "Failed start") go last.
    error, last_lines = split_last_lines(result.error or "")
    ctx.raise_safely(
        AlertKind.ENFORCEMENT_FAILED,
        Severity.WARNING,
        target.requested,
        f"{origin}: {run.what} {how}: {error}. Running now: {running}.{last_lines}",
        {
            "runId": run.run_id,
            "run": run.what,
            "origin": origin,
            "error": result.error,
            "lastLines": block_lines(last_lines),
            "runningAfter": [r.to_json() for r in result.running_after or ()],
        },
    )


def release_marks(ctx: RunContext, run: Run) -> None:
    """Whatever happened (cancellation included), no mark outlives its run: a victim
    still marked gets its state from before the run back."""
    leaked = ctx.marks.clear_run(run.run_id)
    for key in leaked:
        current = next((r for r in ctx.host.residents() if resident_key(r) == key), None)
        original = next((v for v in run.victims if resident_key(v) == key), None)
        if current is not None and original is not None:
            ctx.host.put_resident(replace(current, state=original.state))
