"""Pause and wake: the steps that free an engine's memory without stopping its unit.

Two levers (docs/placement-rules.md §4.2, "What paused is"):

- **vLLM's sleep** (issue 12). A victim the approved option pauses (its signature
  ``model/config@pause``) is put to sleep in the **pause** step (after drain, before
  stop): ``POST /sleep?level=N``, then ``/is_sleeping`` must say true; its unit stays
  active and verify-free checks the freed memory on the probe. A ``wake`` option
  replaces start and verify-up with **wake** (``POST /wake_up``) and the same verify-up
  plus ``/is_sleeping`` false (a sleeping vLLM answers ``/health`` 200).
- **A llama.cpp router's unload** (issue 19). One model of a router
  (``pause_lever: llamacpp-router``) pauses by ``POST /models/unload``: the step waits
  until the router's ``GET /models`` says ``unloaded`` and the model's child process
  (the one with ``--alias ID`` among the unit's processes) is gone, so its whole
  footprint is back. A *stopped* router victim is unloaded the same way (in the
  ``stop`` step, :func:`unload_stopped`) and then leaves the ledger: the router's unit,
  which hosts its other models, is never stopped for one of them. A router model that
  starts is **loaded** (:func:`load`): ``POST /models/load`` in the running router (its
  unit started first only when it is not running, never restarted), then the wait for
  ``loaded`` (a load that fails shows ``failed`` and the exit code at once), then
  verify-up (the router healthy, the model ``loaded`` there, its id served). A wake of
  a paused router model is the same load.

At resolve a paused victim stays a resident, ``paused``
(:func:`~uapplace.enforce.run.paused_resident`), and a woken one turns ``hot``.

Rollback: a woken resident is put back to sleep (or unloaded) and seen so
(**rollback-sleep**, :func:`resleep`), a router model this run loaded is unloaded
(**rollback-stop**, :func:`unload_loaded`), before the paused (and router-unloaded)
victims are woken (loaded) again, each with its verify-up (**rollback-wake**,
:func:`rewake_victims`); a victim that cannot be woken stays ``paused`` and the
rollback is incomplete. Each of these steps is journaled first, with every victim's
action (stop/pause) and the resident a wake run wakes, so the start-up repair
(:mod:`uapplace.recovery.recover`) wakes or keeps paused what a crash left asleep.

Every engine call goes through ``ctx.engines`` (:class:`~uapplace.io.seams.EngineProbe`),
every router call through ``ctx.routers`` (:class:`~uapplace.io.router.RouterProbe`).
Called by :mod:`uapplace.enforce.enforcer` (pause, wake, load), :mod:`uapplace.enforce.steps`
(the stopped router victims) and :mod:`uapplace.enforce.rollback`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from uapplace.core.model import Config, Model, Resident, resident_key
from uapplace.core.steps import (
    PAUSE,
    ROLLBACK_SLEEP,
    ROLLBACK_STOP,
    ROLLBACK_WAKE,
    START,
    STOP,
    VERIFY_UP,
    WAKE,
)
from uapplace.core.topology import verify_endpoint
from uapplace.core.unitnames import unit_file_name
from uapplace.core.victims import config_of, model_of
from uapplace.enforce.journaling import journal_step
from uapplace.enforce.run import (
    Restore,
    Run,
    RunContext,
    Target,
)
from uapplace.files.timeouts import UpBound
from uapplace.io import router
from uapplace.io.engines import EngineError
from uapplace.io.router import RouterError, RouterSlot
from uapplace.io.units import RUNNING_STATES, outcome_text, unit_of
from uapplace.publish import verify

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- pause


async def pause(ctx: RunContext, run: Run, target: Target) -> None:
    """Put each paused victim's engine to sleep (or unload it from its router) and see
    it so.

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
        if resident_key(victim) in target.routed:
            done.append(await _unload_victim(ctx, run, victim, PAUSE))
            continue
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


async def unload_stopped(ctx: RunContext, run: Run, target: Target) -> str:
    """Unload the *stopped* victims that are router models (their unit, the router, keeps
    running its other models); what was done, or ``""`` when there were none. Called by
    the ``stop`` step, which records it."""
    victims = [v for v in target.stopping if resident_key(v) in target.routed]
    if not victims:
        return ""
    await journal_step(ctx, run, target, STOP)
    done = [await _unload_victim(ctx, run, victim, STOP) for victim in victims]
    return "; ".join(done) + " (the router keeps running)"


def victim_slot(ctx: RunContext, victim: Resident) -> RouterSlot | None:
    """Where a router-model resident lives: its unit, endpoint and router model id."""
    model = model_of(ctx.host.registry(), victim)
    unit = unit_of(victim)
    if model is None or unit is None or victim.endpoint is None:
        return None
    return RouterSlot(unit_file_name(unit), victim.endpoint, router.router_model_id(model))


async def _unload_victim(ctx: RunContext, run: Run, victim: Resident, step: str) -> str:
    """``POST /models/unload``, then wait until it is unloaded and its child is gone."""
    slot = victim_slot(ctx, victim)
    if slot is None:
        raise run.fail(
            step,
            f"{victim.signature}: a router model without a registry model, unit or "
            "endpoint; nothing was unloaded",
        )
    run.paused.append(victim)  # the rollback loads it again
    started = time.monotonic()
    children = await _children(ctx, slot)
    run.victim_pids = run.victim_pids | frozenset(children)
    try:
        await _unload_and_wait(ctx, slot, children, ctx.timeouts.stop_s)
    except RouterError as err:
        raise run.fail(step, f"{victim.signature}: unload from {slot.label}: {err}") from None
    pids = ", ".join(map(str, children)) or "none seen"
    return (
        f"{victim.signature} unloaded from {slot.label} in {time.monotonic() - started:.2f}s "
        f"(its process {pids} gone)"
    )


async def _children(ctx: RunContext, slot: RouterSlot) -> list[int]:
    """The router model's child processes among its unit's."""
    pids = await ctx.follower.pids_of([unit_file_name(slot.unit)])
    return await ctx.routers.children(sorted(pids), slot.model_id)


def _polling(ctx: RunContext) -> router.Polling:
    timeouts = ctx.timeouts
    return router.Polling(timeouts.health_first_poll_s, timeouts.health_max_poll_s, timeouts.http_s)


async def _unload_and_wait(
    ctx: RunContext, slot: RouterSlot, children: Iterable[int], limit_s: float
) -> None:
    """Unload ``slot``; return once the router says ``unloaded`` and none of
    ``children`` (nor any process with its ``--alias``) is left. Raises
    :class:`RouterError` at ``limit_s``."""
    deadline = time.monotonic() + limit_s
    await ctx.routers.unload(slot.endpoint, slot.model_id, ctx.timeouts.http_s)
    await router.wait_for(
        ctx.routers,
        slot.endpoint,
        slot.model_id,
        frozenset({router.UNLOADED}),
        limit_s,
        _polling(ctx),
    )
    before = set(children)
    while True:
        pids = await ctx.follower.pids_of([unit_file_name(slot.unit)])
        left = sorted(before & pids) or await ctx.routers.children(sorted(pids), slot.model_id)
        if not left:
            return
        if time.monotonic() >= deadline:
            raise RouterError(
                f"{slot.model_id} is unloaded but its process {', '.join(map(str, left))} "
                f"is still there after {limit_s:g}s"
            )
        await asyncio.sleep(ctx.timeouts.health_first_poll_s)


# --------------------------------------------------------------------------- load (router model)


async def load(ctx: RunContext, run: Run, target: Target, slot: RouterSlot) -> None:
    """Start a router model: its router's unit first only when it is not running, then
    ``POST /models/load`` (**start**), then the wait for ``loaded`` and verify-up
    (**verify-up**). Never a restart of a running router."""
    assert target.config is not None and target.new_key is not None
    unit = unit_file_name(slot.unit)
    bound = ctx.timeouts.verify_up_bound(target.label, target.config, ctx.timeouts.verify_up_s)
    run.verify_up_bound = bound
    ctx.marks.expect_unit(unit, target.new_key, run.run_id)  # the unit sync leaves it to us
    await journal_step(ctx, run, target, START)
    how = await _router_up(ctx, run, unit, slot, bound)
    run.loaded = slot
    try:
        await ctx.routers.load(slot.endpoint, slot.model_id, ctx.timeouts.http_s)
    except RouterError as err:
        raise run.fail(START, f"{how}; {err}") from None
    run.record(START, True, f"{how}; asked it to load {slot.model_id} (POST /models/load)")
    await journal_step(ctx, run, target, VERIFY_UP)
    ok, detail = await verify_loaded(
        ctx, slot, target.model, target.config, target.requested, bound
    )
    if not ok:
        raise run.fail(VERIFY_UP, detail)
    run.record(VERIFY_UP, True, detail)


async def _router_up(ctx: RunContext, run: Run, unit: str, slot: RouterSlot, bound: UpBound) -> str:
    """The router's unit running and healthy: started when it is not; what was done."""
    state = await ctx.follower.fresh(unit)
    if state is not None and state.active_state in RUNNING_STATES:
        return f"the router {unit} is already {state.active_state} (no unit start)"
    ctx.follower.watch(unit)
    run.started_unit = unit
    outcome = await ctx.units.start_unit(unit, ctx.timeouts.start_s)
    if not outcome.ok:
        now = await ctx.follower.state_text(unit)
        raise run.fail(START, f"{unit}: start job {outcome_text(outcome)}; unit {now}")
    endpoint = verify_endpoint(slot.endpoint, ctx.host.registry().single_upstream)
    why = await verify.wait_up(unit, endpoint, bound.seconds, ctx.follower.up_watch(unit))
    if why is not None:
        raise run.fail(START, f"the router: {why}; {bound.text()}")
    return f"started the router {unit}"


async def verify_loaded(
    ctx: RunContext,
    slot: RouterSlot,
    model: Model,
    config: Config | None,
    requested: str | None,
    bound: UpBound,
) -> tuple[bool, str]:
    """A router model's verify-up: the router says ``loaded`` (waited for, within
    ``bound``), then the publication check (router healthy, the model loaded there,
    its id served, the metrics policy)."""
    started = time.monotonic()
    try:
        seen = await router.wait_for(
            ctx.routers, slot.endpoint, slot.model_id, router.SERVING, bound.seconds, _polling(ctx)
        )
    except RouterError as err:
        return False, f"{err}; {bound.text()}"
    unit = unit_file_name(slot.unit)
    endpoint = verify_endpoint(slot.endpoint, ctx.host.registry().single_upstream)
    expect = verify.expectation(model, config, requested, ctx.host.service_policy(model))
    left = max(0.5, bound.seconds - (time.monotonic() - started))
    verdict = await verify.verify_up(unit, endpoint, expect, left, ctx.follower.up_watch(unit))
    if not verdict.ok:
        return False, f"{verdict.detail}; {bound.text()}"
    took = time.monotonic() - started
    return True, f"{seen.id} {seen.status} in {slot.label} ({took:.2f}s): {verdict.detail}; " + (
        bound.text()
    )


async def unload_loaded(ctx: RunContext, run: Run, target: Target, restore: Restore) -> bool:
    """Rollback: unload the router model this run loaded; ``True`` once it is seen
    unloaded and its process gone (only then may the victims take the memory back)."""
    slot = run.loaded
    assert slot is not None
    children = await _children(ctx, slot)
    try:
        await _unload_and_wait(ctx, slot, children, ctx.timeouts.stop_s)
    except RouterError as err:
        observed = f"{slot.model_id}, which this run loaded, is not unloaded: {err}"
        run.record(ROLLBACK_STOP, False, f"{observed}: the victims stay down")
        restore.problems.append(f"{observed}; the victims were not restored")
        restore.blocker = observed
        return False
    run.record(ROLLBACK_STOP, True, f"{slot.model_id} unloaded from {slot.label} again")
    if target.new_key is not None:
        stale = next((r for r in ctx.host.residents() if resident_key(r) == target.new_key), None)
        if stale is not None:
            ctx.host.drop_resident(stale)
    return True


# --------------------------------------------------------------------------- wake


async def wake(ctx: RunContext, run: Run, target: Target, twin: Resident) -> None:
    """Wake the paused resident a ``wake`` option names, then its verify-up: unit
    active, ``/health`` 200, served id, metrics policy, and ``/is_sleeping`` false
    (a sleeping vLLM answers ``/health`` 200, so health alone proves nothing). A paused
    router model wakes by being loaded in its router again."""
    assert target.config is not None and twin.endpoint is not None
    label = target.label
    bound = ctx.timeouts.wake_bound(label, target.config, ctx.timeouts.verify_up_s)
    run.verify_up_bound = bound
    await journal_step(ctx, run, target, WAKE)
    run.woke = True
    started = time.monotonic()
    slot = victim_slot(ctx, twin) if target.config.is_router_model else None
    try:
        if slot is not None:
            await ctx.routers.load(slot.endpoint, slot.model_id, ctx.timeouts.http_s)
        else:
            await ctx.engines.wake(twin.endpoint, bound.seconds)
    except EngineError as err:
        what = "POST /models/load" if slot is not None else "wake_up"
        raise run.fail(WAKE, f"{label} at {twin.endpoint}: {what}: {err}") from None
    how = f"asked {slot.label} to load it" if slot is not None else "woke"
    run.record(WAKE, True, f"{label} {how} ({time.monotonic() - started:.2f}s)")
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
    """A woken engine's verify-up (the same check as a start, plus not asleep; for a
    router model, loaded in its router)."""
    slot = victim_slot(ctx, resident) if config is not None and config.is_router_model else None
    if slot is not None:
        return await verify_loaded(ctx, slot, model, config, requested, bound)
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


# --------------------------------------------------------------------------- undoing


async def resleep(ctx: RunContext, run: Run, twin: Resident, restore: Restore) -> bool:
    """Put the resident this run tried to wake back to sleep (a router model: unload
    it again); ``True`` once it is seen asleep (only then may paused victims take the
    memory back)."""
    assert twin.endpoint is not None
    config = config_of(ctx.host.registry(), twin)
    slot = victim_slot(ctx, twin) if config is not None and config.is_router_model else None
    if slot is not None:
        asleep = await _reunload(ctx, run, slot)
    else:
        asleep = await _resleep_engine(ctx, run, twin, config)
    if asleep:
        run.record(ROLLBACK_SLEEP, True, f"{twin.signature} is asleep again (paused)")
        return True
    observed = f"{twin.signature} not seen asleep after the failed wake"
    run.record(ROLLBACK_SLEEP, False, f"{observed}: the paused victims stay paused")
    restore.problems.append(observed)
    restore.blocker = observed
    return False


async def _reunload(ctx: RunContext, run: Run, slot: RouterSlot) -> bool:
    try:
        await _unload_and_wait(ctx, slot, await _children(ctx, slot), ctx.timeouts.stop_s)
    except RouterError as err:
        log.warning("%s: re-unload of %s failed: %s", run.run_id, slot.label, err)
        return False
    return True


async def _resleep_engine(ctx: RunContext, run: Run, twin: Resident, config: Config | None) -> bool:
    assert twin.endpoint is not None
    level = (config.sleep_level if config is not None else None) or 1
    asleep = await ctx.engines.is_sleeping(twin.endpoint, ctx.timeouts.http_s)
    if asleep is not True:
        try:
            await ctx.engines.sleep(twin.endpoint, level, ctx.timeouts.stop_s)
        except (EngineError, ValueError) as err:
            log.warning("%s: re-sleep of %s failed: %s", run.run_id, twin.signature, err)
        asleep = await ctx.engines.is_sleeping(twin.endpoint, ctx.timeouts.http_s)
    return asleep is True


async def rewake_victims(ctx: RunContext, run: Run, restore: Restore, safe: bool) -> None:
    """Wake every victim this run paused (or tried to), each with its verify-up; a
    router model (paused or stopped) is loaded in its router again."""
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
        model = registry.models.get(victim.model)
        try:
            await _wake_victim(ctx, victim, config, bound)
        except EngineError as err:
            why = f"{victim.signature}: {'load' if _routed(config) else 'wake_up'}: {err}"
            run.record(ROLLBACK_WAKE, False, why)
            restore.fail(unit, why)
            continue
        if model is None:
            ok, detail = False, f"{victim.model} is no longer in the registry"
        else:
            ok, detail = await verify_awake(ctx, victim, model, config, None, bound)
        run.record(ROLLBACK_WAKE, ok, detail)
        if ok:
            restore.restored.add(unit)
        else:
            restore.fail(unit, detail)


def _routed(config: Config | None) -> bool:
    return config is not None and config.is_router_model


async def _wake_victim(
    ctx: RunContext, victim: Resident, config: Config | None, bound: UpBound
) -> None:
    """Ask a paused victim's engine (or router) to bring it back. Raises EngineError."""
    assert victim.endpoint is not None
    slot = victim_slot(ctx, victim) if _routed(config) else None
    if slot is not None:
        await ctx.routers.load(slot.endpoint, slot.model_id, ctx.timeouts.http_s)
        return
    if await ctx.engines.is_sleeping(victim.endpoint, ctx.timeouts.http_s) is not False:
        await ctx.engines.wake(victim.endpoint, bound.seconds)
