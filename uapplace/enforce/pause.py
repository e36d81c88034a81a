"""Pause and wake (issue 12): the steps that put engines to sleep instead of stopping units.

A victim the approved option pauses (its signature ``model/config@pause``) is
put to sleep in the **pause** step (after drain, before stop): vLLM's
``POST /sleep?level=N``, then ``/is_sleeping`` must say true; its unit stays
active and verify-free checks the freed memory on the probe. A ``wake`` option
replaces start and verify-up with **wake** (``POST /wake_up``) and the same
verify-up plus ``/is_sleeping`` false (a sleeping vLLM answers ``/health`` 200).
At resolve a paused victim stays a resident, ``paused``
(:func:`~uapplace.enforce.run.paused_resident`), and a woken one turns ``hot``.

Rollback: a woken resident is put back to sleep and seen asleep
(**rollback-sleep**, :func:`resleep`) before the paused victims are woken
again, each with its verify-up (**rollback-wake**, :func:`rewake_victims`); a
victim that cannot be woken stays ``paused`` and the rollback is incomplete.
Each of these steps is journaled first, with every victim's action (stop/pause)
and the resident a wake run wakes, so the start-up repair
(:mod:`uapplace.recovery.recover`) wakes or keeps paused what a crash left asleep.

Every engine call goes through ``ctx.engines`` (:class:`~uapplace.io.seams.EngineProbe`).
Called by :mod:`uapplace.enforce.enforcer` (pause, wake) and :mod:`uapplace.enforce.rollback`.
"""

from __future__ import annotations

import logging
import time

from uapplace.core.model import Config, Model, Resident
from uapplace.core.steps import PAUSE, ROLLBACK_SLEEP, ROLLBACK_WAKE, VERIFY_UP, WAKE
from uapplace.core.topology import verify_endpoint
from uapplace.core.victims import config_of
from uapplace.enforce.journaling import journal_step
from uapplace.enforce.run import (
    Restore,
    Run,
    RunContext,
    Target,
)
from uapplace.files.timeouts import UpBound
from uapplace.io.engines import EngineError
from uapplace.io.units import unit_of
from uapplace.publish import verify

log = logging.getLogger(__name__)


async def pause(ctx: RunContext, run: Run, target: Target) -> None:
    """Put each paused victim's engine to sleep and see it asleep.

    The sleep is vLLM's ``POST /sleep?level=N`` (answered once the memory is
    released); ``/is_sleeping`` must then say ``true``. The unit stays active:
    only the memory goes, which verify-free then checks on the probe. A sleep
    that fails rolls back, and the rollback wakes every victim this step touched.
    """
    victims = target.pausing
    if not victims:
        return
    registry = ctx.host.registry()
    done: list[str] = []
    await journal_step(ctx, run, target, PAUSE)
    for victim in victims:
        config = config_of(registry, victim)
        level = config.sleep_level if config is not None else None
        if level is None or victim.endpoint is None:
            raise run.fail(
                PAUSE,
                f"{victim.signature}: no executable pause lever or no endpoint "
                "(registry pause_lever / endpoint); nothing was paused",
            )
        run.paused.append(victim)
        started = time.monotonic()
        try:
            await ctx.engines.sleep(victim.endpoint, level, ctx.timeouts.stop_s)
        except (EngineError, ValueError) as err:
            raise run.fail(
                PAUSE, f"{victim.signature} at {victim.endpoint}: sleep level {level}: {err}"
            ) from None
        asleep = await ctx.engines.is_sleeping(victim.endpoint, ctx.timeouts.http_s)
        if asleep is not True:
            seen = "unknown" if asleep is None else "false"
            raise run.fail(
                PAUSE, f"{victim.signature}: the sleep was answered but /is_sleeping is {seen}"
            )
        elapsed = time.monotonic() - started
        done.append(f"{victim.signature} asleep at level {level} in {elapsed:.2f}s")
    run.record(PAUSE, True, "; ".join(done) + " (units stay active)")


async def wake(ctx: RunContext, run: Run, target: Target, twin: Resident) -> None:
    """Wake the paused resident a ``wake`` option names, then its verify-up: unit
    active, ``/health`` 200, served id, metrics policy, and ``/is_sleeping`` false
    (a sleeping vLLM answers ``/health`` 200, so health alone proves nothing)."""
    assert target.config is not None and twin.endpoint is not None
    label = target.label
    bound = ctx.timeouts.wake_bound(label, target.config, ctx.timeouts.verify_up_s)
    run.verify_up_bound = bound
    await journal_step(ctx, run, target, WAKE)
    run.woke = True
    started = time.monotonic()
    try:
        await ctx.engines.wake(twin.endpoint, bound.seconds)
    except EngineError as err:
        raise run.fail(WAKE, f"{label} at {twin.endpoint}: wake_up: {err}") from None
    run.record(WAKE, True, f"{label} woke in {time.monotonic() - started:.2f}s")
    ok, detail = await verify_awake(ctx, twin, target.model, target.config, target.requested, bound)
    if not ok:
        raise run.fail(VERIFY_UP, detail)
    run.record(VERIFY_UP, True, detail)


async def verify_awake(
    ctx: RunContext,
    resident: Resident,
    model: Model,
    config: Config | None,
    requested: str | None,
    bound: UpBound,
) -> tuple[bool, str]:
    """A woken engine's verify-up (the same check as a start, plus not asleep)."""
    unit = unit_of(resident) or resident.signature
    endpoint = verify_endpoint(resident.endpoint, ctx.host.registry().single_upstream)
    expect = verify.expectation(model, config, requested, ctx.host.service_policy(model))
    verdict = await verify.verify_up(
        unit, endpoint, expect, bound.seconds, ctx.follower.up_watch(unit)
    )
    if not verdict.ok:
        return False, f"{verdict.detail}; {bound.text()}"
    asleep = await ctx.engines.is_sleeping(resident.endpoint or "", ctx.timeouts.http_s)
    if asleep is not False:
        seen = "true" if asleep else "unknown"
        return False, f"{resident.signature} answered the wake but /is_sleeping is {seen}"
    return True, f"{resident.signature} awake and serving: {verdict.detail}; {bound.text()}"


async def resleep(ctx: RunContext, run: Run, twin: Resident, restore: Restore) -> bool:
    """Put the resident this run tried to wake back to sleep; ``True`` once it is
    seen asleep (only then may paused victims take the memory back)."""
    assert twin.endpoint is not None
    config = config_of(ctx.host.registry(), twin)
    level = (config.sleep_level if config is not None else None) or 1
    asleep = await ctx.engines.is_sleeping(twin.endpoint, ctx.timeouts.http_s)
    if asleep is not True:
        try:
            await ctx.engines.sleep(twin.endpoint, level, ctx.timeouts.stop_s)
        except (EngineError, ValueError) as err:
            log.warning("%s: re-sleep of %s failed: %s", run.run_id, twin.signature, err)
        asleep = await ctx.engines.is_sleeping(twin.endpoint, ctx.timeouts.http_s)
    if asleep is True:
        run.record(ROLLBACK_SLEEP, True, f"{twin.signature} is asleep again (paused)")
        return True
    observed = f"{twin.signature} not seen asleep after the failed wake"
    run.record(ROLLBACK_SLEEP, False, f"{observed}: the paused victims stay paused")
    restore.problems.append(observed)
    restore.blocker = observed
    return False


async def rewake_victims(ctx: RunContext, run: Run, restore: Restore, safe: bool) -> None:
    """Wake every victim this run paused (or tried to), each with its verify-up."""
    registry = ctx.host.registry()
    for victim in run.paused:
        unit = unit_of(victim) or victim.signature
        if not safe:
            why = f"left paused: {restore.blocker}"
            run.record(ROLLBACK_WAKE, False, f"{victim.signature} {why}")
            restore.fail(unit, why)
            continue
        assert victim.endpoint is not None
        config = config_of(registry, victim)
        bound = ctx.timeouts.wake_bound(victim.signature, config, ctx.timeouts.rollback_up_s)
        try:
            if await ctx.engines.is_sleeping(victim.endpoint, ctx.timeouts.http_s) is not False:
                await ctx.engines.wake(victim.endpoint, bound.seconds)
        except EngineError as err:
            why = f"{victim.signature}: wake_up: {err}"
            run.record(ROLLBACK_WAKE, False, why)
            restore.fail(unit, why)
            continue
        model = registry.models.get(victim.model)
        if model is None:
            ok, detail = False, f"{victim.model} is no longer in the registry"
        else:
            ok, detail = await verify_awake(ctx, victim, model, config, None, bound)
        run.record(ROLLBACK_WAKE, ok, detail)
        if ok:
            restore.restored.add(unit)
        else:
            restore.fail(unit, detail)
