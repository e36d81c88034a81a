"""The forward steps of the docs/placement-rules.md §4.6 sequence, after revalidation.

Each step is a function ``step(ctx, run, target)`` (:class:`~uapplace.enforce.run.RunContext`,
:class:`~uapplace.enforce.run.Run`, :class:`~uapplace.enforce.run.Target`): it
records itself on the run (``ok`` or not, with a detail naming what it saw and
the bound it used) and raises :class:`~uapplace.enforce.run.StepFailed` when the
run must roll back. :mod:`uapplace.enforce.enforcer` calls them in order; the pause and
wake steps are :mod:`uapplace.enforce.pause`, the undoing ones :mod:`uapplace.enforce.rollback`.

- **preflight** checks that what is about to start can start, before anything
  stops (:func:`~uapplace.enforce.preflight.preflight_problems`): the new unit is
  ``LoadState=loaded``, its ``ExecStart=`` binaries exist and are executable, its
  config is measured for this machine on the target device
  (``Config.is_measured``: machine-local figures, see the registry) and the
  host-RAM gate passes on a fresh reading. A refusal is a failed run (``ok``
  false, ``error`` naming the unit, field and why) with no victim touched: no
  mark, no stop, nothing to roll back.
- **mark-draining** marks the victims ``draining``: admission stops forwarding
  to them. The marks (:class:`~uapplace.publish.unitsync.EnforcementMarks`) are the
  truth, so a concurrent unit sync keeps them mid-drain; the resident's published
  ``draining`` is derived from them (``marks.overlay``). They are cleared when the
  run ends, whatever the outcome.
- **drain** waits (polling) until no victim has in-flight work at the proxy or
  a bus hold. The proxy not answering is unknown, which counts as busy. At the
  drain timeout the run rolls back rather than cut anyone off.
- **stop** awaits each victim unit's stop job; anything but ``done`` rolls back.
- **verify-free** waits until the device's free memory (the probe, not the
  ledger) covers the new config's cost and no victim PID holds memory there.
  On failure it names every compute process on the device that is not a
  staying resident: the orphan case of docs/placement-rules.md §4.6 step 4.
- **start** and **verify-up**: the start job, then the unit active, ``/health``
  200 (polled from 50 ms with backoff; a unit that turns ``failed`` or
  ``inactive`` ends the wait at once), ``/v1/models`` serving the requested id
  or one the model advertises, and the capacity policy's ``metricsMustMatch``.
- **refresh-proxy** invalidates the proxy's cached upstream view. A failure is
  a failed step, never a failed run.
- **resolve**: the new resident ``hot``, the victims gone, the pending entries
  the new resident serves resolved ``applied``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import replace

from uapplace.core.model import (
    Config,
    DeviceReading,
    ProbeSource,
    Resident,
    ResidentState,
    iso,
    processes_text,
    resident_key,
)
from uapplace.core.steps import (
    DRAIN,
    MARK_DRAINING,
    PREFLIGHT,
    REFRESH_PROXY,
    RESOLVE,
    START,
    STOP,
    VERIFY_FREE,
    VERIFY_UP,
)
from uapplace.core.topology import verify_endpoint
from uapplace.core.unitnames import unit_file_name
from uapplace.enforce.journaling import journal_step
from uapplace.enforce.preflight import (
    PreflightFacts,
    executable_problems,
    preflight_problems,
    preflight_summary,
)
from uapplace.enforce.run import (
    APPLIED,
    Run,
    RunContext,
    Target,
    paused_resident,
)
from uapplace.io.engines import ProxyTokenRejected
from uapplace.io.units import UnitError, UnitState, outcome_text, units_of
from uapplace.publish import verify

# --------------------------------------------------------------------------- preflight


async def preflight(ctx: RunContext, run: Run, target: Target) -> str | None:
    """Check that what starts can start, before anything stops; why not, or ``None``.

    Recorded as the ``preflight`` step either way. Nothing is marked, drained or
    stopped before it passes (:func:`~uapplace.enforce.preflight.preflight_problems` decides).
    """
    if target.new_unit is None or target.config is None:
        stopping = ", ".join(v.signature for v in target.victims) or "nothing"
        run.record(PREFLIGHT, True, f"nothing starts ({target.kind}); {stopping} stops")
        return None
    facts = await _preflight_facts(ctx, target, target.new_unit, target.config)
    problems = preflight_problems(facts)
    if problems:
        detail = "; ".join(problems)
        run.record(PREFLIGHT, False, detail)
        return detail
    run.record(PREFLIGHT, True, preflight_summary(facts))
    return None


async def _preflight_facts(
    ctx: RunContext, target: Target, unit: str, config: Config
) -> PreflightFacts:
    # The unit (user manager's worker thread) and the host (probe thread) at once.
    (state, unit_error, binaries), (host_reading, host_error) = await asyncio.gather(
        _unit_facts(ctx, unit), _host_facts(ctx)
    )
    return PreflightFacts(
        unit=unit,
        state=state,
        unit_error=unit_error,
        binaries=binaries,
        label=target.label,
        config=config,
        device=target.device,
        host=ctx.host.registry().host(),
        host_reading=host_reading,
        victims=target.victims,
        host_error=host_error,
    )


async def _unit_facts(ctx: RunContext, unit: str) -> tuple[UnitState | None, str, dict[str, str]]:
    """The unit's state (or why it cannot be read) and its ``ExecStart=`` binaries."""
    try:
        state = await ctx.units.state(unit)
    except UnitError as err:
        return None, str(err), {}
    ctx.follower.remember(unit, state)
    if not state.exec_paths:
        return state, "", {}
    return state, "", await asyncio.to_thread(executable_problems, state.exec_paths)


async def _host_facts(ctx: RunContext) -> tuple[DeviceReading | None, str]:
    """A fresh host-RAM reading, or why there is none (the gate then fails closed)."""
    host = ctx.host.registry().host()
    try:
        readings = await ctx.host.read_devices()
    except Exception as err:  # a probe that fails is no reading, never a pass
        return None, f"the probe failed: {type(err).__name__}: {err}"
    return (readings.get(host.key) if host is not None else None), ""


# --------------------------------------------------------------------------- drain


def mark_draining(ctx: RunContext, run: Run, target: Target) -> None:
    """Mark the victims (the marks are the truth) and publish them as the marks say."""
    run.victims = target.victims
    if not target.victims:
        run.record(MARK_DRAINING, True, "no victims")
        return
    for victim in target.victims:
        ctx.marks.mark_draining(resident_key(victim), run.run_id)
        ctx.host.put_resident(ctx.marks.overlay(victim))
    names = ", ".join(f"{v.signature} on {v.device}" for v in target.victims)
    run.record(MARK_DRAINING, True, f"{names}: admission stops forwarding to them")


async def drain(ctx: RunContext, run: Run, target: Target) -> None:
    if not target.victims:
        run.record(DRAIN, True, "no victims")
        return
    started = time.monotonic()
    labelled = (target.label, target.config) if target.config is not None else None
    bound = ctx.timeouts.drain_bound(labelled, [ctx.victim_config(v) for v in target.victims])
    deadline = started + bound.seconds
    while True:
        try:
            busy = await _busy(ctx, target.victims)
        except ProxyTokenRejected as err:
            # Waiting cannot fix a wrong token: fail now, before anything stops.
            raise run.fail(DRAIN, f"{err}; nothing was stopped") from None
        if not busy:
            waited = time.monotonic() - started
            run.record(
                DRAIN, True, f"no in-flight work or holds (waited {waited:.2f}s; {bound.text()})"
            )
            return
        if time.monotonic() >= deadline:
            raise run.fail(
                DRAIN,
                f"still busy after {bound.seconds:g}s: {'; '.join(busy)} "
                f"(nothing was cut off; {bound.text()})",
            )
        await asyncio.sleep(min(ctx.timeouts.drain_poll_s, max(0.0, deadline - time.monotonic())))


async def _busy(ctx: RunContext, victims: Sequence[Resident]) -> list[str]:
    """Why each victim is still busy; empty when all are idle."""
    inflight = await ctx.host.inflight()
    reasons: list[str] = []
    if inflight is None:
        reasons.append("the proxy's in-flight list is unavailable (unknown counts as busy)")
    for victim in victims:
        requests = list(inflight.get(victim.target_id, ())) if inflight is not None else []
        if requests:
            clients = ", ".join(sorted({h.client for h in requests}))
            reasons.append(f"{victim.target_id}: {len(requests)} in flight ({clients})")
        holds = ctx.host.holds(victim)
        if holds:
            who = ", ".join(h.client for h in holds)
            reasons.append(f"{victim.signature}: held on the bus by {who}")
    return reasons


# --------------------------------------------------------------------------- stop / verify-free


async def stop(ctx: RunContext, run: Run, target: Target) -> None:
    units = units_of(target.stopping)
    if not units:
        run.record(STOP, True, "paused instead" if target.pausing else "no victims")
        if target.pausing:  # the sleeps are done: recovery must know the victims sleep
            await journal_step(ctx, run, target, VERIFY_FREE)
        return
    run.victim_pids = frozenset(await ctx.follower.pids_of(units))
    await journal_step(ctx, run, target, STOP, units)
    for unit in units:
        run.stopped_units.append(unit)
        outcome = await ctx.units.stop_unit(unit, ctx.timeouts.stop_s)
        if not outcome.ok:
            state = await ctx.follower.state_text(unit)
            raise run.fail(STOP, f"{unit}: stop job {outcome_text(outcome)}; unit {state}")
    run.record(STOP, True, f"stopped {', '.join(units)}")
    await journal_step(ctx, run, target, VERIFY_FREE)


async def verify_free(ctx: RunContext, run: Run, target: Target) -> None:
    need = _free_need(target)
    bound = ctx.timeouts.verify_free_bound([ctx.victim_config(v) for v in target.victims])
    deadline = time.monotonic() + bound.seconds
    while True:
        readings = await ctx.host.read_devices()
        reading = readings.get(target.device)
        problem = _free_problem(reading, target.device, need, run.victim_pids)
        if problem is None:
            assert reading is not None
            what = f"{need:,.0f} MiB needed" if need else "victims released their memory"
            run.record(
                VERIFY_FREE,
                True,
                f"{target.device}: {reading.free_mib:,.0f} MiB free, {what}; {bound.text()}",
            )
            return
        if time.monotonic() >= deadline:
            orphans = await _unexpected_processes(ctx, reading, target)
            raise run.fail(
                VERIFY_FREE, f"after {bound.seconds:g}s: {problem}; {orphans} ({bound.text()})"
            )
        await asyncio.sleep(ctx.timeouts.verify_free_poll_s)


def _free_need(target: Target) -> float:
    """MiB the device must show free before the start (or wake): the new config's cost;
    for a wake, less what the paused engine still holds (its residual)."""
    if target.config is None:
        return 0.0
    if target.wake is not None:
        return max(0.0, target.cost_mib - (target.wake.gpu_mib or 0.0))
    return target.cost_mib


def _free_problem(
    reading: DeviceReading | None, device: str, need: float, victim_pids: frozenset[int]
) -> str | None:
    if reading is None:
        return f"{device} is not in the probe's readings"
    if reading.source is ProbeSource.ABSENT:
        return f"{device} cannot be read: {reading.error or 'absent'}"
    lingering = [p for p in reading.processes if p.pid in victim_pids and p.used_mib > 0]
    if lingering:
        held = ", ".join(f"pid {p.pid} {p.used_mib:,.0f} MiB" for p in lingering)
        return f"a stopped victim's process still holds memory on {device}: {held}"
    if reading.free_mib + 1e-6 < need:
        return f"{device} has {reading.free_mib:,.0f} MiB free, {need:,.0f} MiB needed"
    return None


async def _unexpected_processes(
    ctx: RunContext, reading: DeviceReading | None, target: Target
) -> str:
    """Every compute process on the device that is not a staying resident's."""
    if reading is None or not reading.processes:
        return "no compute process is listed on the device (the memory is unattributed)"
    victims = {resident_key(v) for v in target.victims}
    staying = [
        r.unit
        for r in ctx.host.residents()
        if r.device == target.device and resident_key(r) not in victims and r.unit
    ]
    expected = await ctx.follower.pids_of(unit_file_name(u) for u in staying)
    unexpected = [p for p in reading.processes if p.pid not in expected]
    if not unexpected:
        return "every process on the device belongs to a staying resident"
    rows = processes_text(unexpected)
    return f"processes on {target.device} that are not an expected resident: {rows}"


# --------------------------------------------------------------------------- start / verify-up


async def start(ctx: RunContext, run: Run, target: Target) -> None:
    unit = target.new_unit
    key = target.new_key
    assert unit is not None and key is not None
    ctx.marks.expect_unit(unit, key, run.run_id)
    run.started_unit = unit
    await journal_step(ctx, run, target, START)
    ctx.follower.watch(unit)
    outcome = await ctx.units.start_unit(unit, ctx.timeouts.start_s)
    if not outcome.ok:
        state = await ctx.follower.state_text(unit)
        raise run.fail(START, f"{unit}: start job {outcome_text(outcome)}; unit {state}")
    run.record(START, True, f"started {unit}")
    await journal_step(ctx, run, target, VERIFY_UP)


async def verify_up(ctx: RunContext, run: Run, target: Target) -> None:
    unit = target.new_unit
    assert unit is not None and target.config is not None
    # Behind a single-upstream proxy, the address the proxy will use (issue 13).
    endpoint = verify_endpoint(
        target.model.endpoint_for(target.config), ctx.host.registry().single_upstream
    )
    bound = ctx.timeouts.verify_up_bound(target.label, target.config, ctx.timeouts.verify_up_s)
    run.verify_up_bound = bound
    healthy = await verify.wait_up(unit, endpoint, bound.seconds, ctx.follower.up_watch(unit))
    if healthy is not None:
        # The bound passed (or the unit went down): roll back at once, never wait more.
        raise run.fail(VERIFY_UP, f"{healthy}; {bound.text()}")
    if endpoint is None:
        run.record(
            VERIFY_UP, True, f"{unit} active; no endpoint in the registry to probe; {bound.text()}"
        )
        return
    http_s = ctx.timeouts.http_s
    # /v1/models must list the requested id, the model, its config or an advertised id.
    expect = verify.expectation(target.model, target.config, target.requested)
    problem = await verify.served_problem(endpoint, expect, http_s, ctx.engines)
    if problem is not None:
        raise run.fail(VERIFY_UP, problem)
    policy = ctx.host.service_policy(target.model)
    checked = ""
    if policy is not None and policy.metrics_must_match:
        problem = await verify.metrics_problem(policy, endpoint, http_s, ctx.engines)
        if problem is not None:
            raise run.fail(VERIFY_UP, problem)
        checked = f"; metricsMustMatch {', '.join(policy.metrics_must_match)} as policy"
    run.record(
        VERIFY_UP,
        True,
        f"{unit} active, {endpoint} healthy, serves {target.requested}{checked}; {bound.text()}",
    )


# --------------------------------------------------------------------------- refresh / resolve


async def refresh_proxy(ctx: RunContext, run: Run) -> None:
    if ctx.refresher is None:
        run.record(REFRESH_PROXY, True, "skipped: no proxy configured")
        return
    try:
        ok, detail = await ctx.refresher.refresh()
    except Exception as err:  # not fatal: the swap itself succeeded
        ok, detail = False, f"{type(err).__name__}: {err}"
    run.record(REFRESH_PROXY, ok, detail if ok else f"{detail} (not fatal)")


def resolve(ctx: RunContext, run: Run, target: Target) -> None:
    ctx.marks.clear_run(run.run_id)
    registry = ctx.host.registry()
    for victim in target.stopping:
        ctx.host.drop_resident(victim)
    for victim in target.pausing:
        ctx.host.put_resident(paused_resident(registry, victim))
    parts = []
    if target.stopping:
        parts.append(f"removed {', '.join(v.signature for v in target.stopping)}")
    if target.pausing:
        parts.append(f"paused {', '.join(v.signature for v in target.pausing)}")
    served = target.reuse
    if served is None and target.wake is not None and target.config is not None:
        served = replace(
            target.wake,
            state=ResidentState.HOT,
            gpu_mib=target.config.resident_gpu_mib,
            host_rss_mib=target.config.host_rss_mib,
            since=iso(ctx.clock()),
            holders=(),
        )
    elif served is None and target.config is not None:
        served = ctx.new_resident(target, target.config)
    # Resolve before publishing the resident: publishing would resolve them as
    # "forwarded", and these entries were resolved by this enforcement.
    resolved: list[str] = []
    if target.entry is not None and ctx.host.resolve_entry(target.entry.id, APPLIED):
        resolved.append(target.entry.id)
    if served is not None:
        resolved += ctx.host.resolve_served(served, APPLIED)
        ctx.host.put_resident(served)
        parts.append(f"{served.signature} {served.state.value} on {served.device}")
    parts.append(f"resolved {', '.join(resolved)}" if resolved else "no pending entry to resolve")
    run.record(RESOLVE, True, "; ".join(parts))
