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
- **drain** waits (polling) until no victim has a forward lease running (admission
  answered ``forward`` to it within ``forward_lease_s``: the proxy may not list that
  request yet, docs/placement-rules.md §4.6, "Forward leases"), in-flight work at the
  proxy, a bus hold, or work its engine reports (:mod:`uapplace.io.busy`: ``/props``
  ``is_sleeping``, then ``/slots`` ``is_processing``, then the ``/metrics``
  request gauges; a request sent straight to the engine is not in the proxy's
  list). The proxy not answering, or an engine not answering, is unknown, which
  counts as busy; an engine that answers without any busy signal does not block
  and is named so. The detail says what each source said, and what the first look
  found busy when the drain had to wait (``waited for: …``). At the drain timeout
  the run rolls back rather than cut anyone off.
- **stop** awaits each victim unit's stop job; anything but ``done`` rolls back.
  A ``done`` stop that systemd had to force (``Result=timeout``, the main process
  ``SIGKILL``ed: :func:`~uapplace.io.units.forced_stop_text`) is recorded not ok,
  with a ``forced_stop`` warning alert, and the run goes on: the victim is down,
  and restarting it would not give back the work that was cut
  (docs/placement-rules.md §4.6, "Forced stops").
- **verify-free** waits until the device's free memory (the probe, not the
  ledger) covers the new config's cost and no victim PID holds memory there.
  On failure it names every compute process on the device that is not a
  staying resident: the orphan case of docs/placement-rules.md §4.6 step 4.
  On the host (a ``cpu`` device) free memory moves with everything else on the
  machine, so it proves nothing: there verify-free waits until every stopped
  victim unit has no process left (its cgroup is empty) and the host reading is
  sane (docs/placement-rules.md §4.6, "Verify-free on the host").
- **start** and **verify-up**: the start job, then the unit active, ``/health``
  200 (polled every 10 ms at first, slowing with the wait to 50 ms:
  :func:`~uapplace.publish.verify.backoff`; a unit that turns ``failed`` or
  ``inactive`` ends the wait at once), ``/v1/models`` serving the requested id
  or one the model advertises, and the capacity policy's ``metricsMustMatch``.
  A start job that fails, or a unit that goes down (or is not healthy in time), is
  failed with the unit's own last lines below the detail (:func:`failed_unit_text`,
  :mod:`uapplace.io.unitlogs`: ``failed to load model`` …; docs/placement-rules.md §4.6,
  "Failed start").
- **refresh-proxy** invalidates the proxy's cached upstream view. A failure is
  a failed step, never a failed run.
- **resolve**: the new resident ``hot``, the victims gone, the pending entries
  the new resident serves resolved ``applied``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.model import (
    Config,
    DeviceKind,
    DeviceReading,
    Option,
    OptionKind,
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
from uapplace.core.unitnames import unit_file_name, valid_unit_name
from uapplace.enforce.journaling import journal_progress, journal_step, progress_journaled
from uapplace.enforce.pause import unload_stopped, victim_slot
from uapplace.enforce.preflight import (
    PreflightFacts,
    executable_problems,
    preflight_problems,
    preflight_summary,
)
from uapplace.enforce.run import (
    APPLIED,
    PreflightReads,
    Run,
    RunContext,
    Target,
    paused_resident,
)
from uapplace.io import busy, unitlogs
from uapplace.io.engines import ProxyTokenRejected
from uapplace.io.router import model_query
from uapplace.io.units import (
    UnitError,
    UnitState,
    forced_stop_text,
    outcome_text,
    state_text,
    stop_wait_s,
    unit_of,
    units_of,
)
from uapplace.publish import verify

T = TypeVar("T")

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
    facts = await _preflight_facts(ctx, target, target.new_unit, target.config, run)
    problems = preflight_problems(facts)
    if problems:
        detail = "; ".join(problems)
        run.record(PREFLIGHT, False, detail)
        return detail
    run.record(PREFLIGHT, True, preflight_summary(facts))
    return None


def prefetch_preflight(ctx: RunContext, run: Run, option: Option) -> None:
    """Start preflight's reads for the unit ``option`` starts while revalidate runs (issue
    23: the two wait on different processes). Both are reads, taken a few milliseconds
    earlier than preflight itself; preflight uses them only when revalidate kept that
    unit (:func:`_preflight_facts`), and never marks, drains or stops before it passed."""
    if option.kind not in (OptionKind.DISPLACE, OptionKind.LOAD_ALONGSIDE):
        return
    model = ctx.host.registry().models.get(option.model)
    config = model.configs.get(option.config) if model is not None else None
    unit = model.unit_for(config) if model is not None and config is not None else None
    if unit is None or not valid_unit_name(unit) or (config and config.is_router_model):
        return
    run.prefetched = PreflightReads(
        unit_file_name(unit),
        _retrieved(asyncio.ensure_future(_unit_facts(ctx, unit_file_name(unit)))),
        _retrieved(asyncio.ensure_future(_host_facts(ctx))),
    )


def _retrieved(future: asyncio.Future[T]) -> asyncio.Future[T]:
    """``future``, its outcome retrieved even when nobody awaits it (a refused run)."""
    future.add_done_callback(lambda done: done.cancelled() or done.exception())
    return future


async def _preflight_facts(
    ctx: RunContext, target: Target, unit: str, config: Config, run: Run
) -> PreflightFacts:
    # The unit (user manager's worker process) and the host (probe thread) at once,
    # started while revalidate ran when it kept the unit the option named.
    early, run.prefetched = run.prefetched, None
    if early is not None and early.unit == unit:
        unit_facts, host_facts = early.unit_facts, early.host_facts
    else:
        unit_facts = asyncio.ensure_future(_unit_facts(ctx, unit))
        host_facts = asyncio.ensure_future(_host_facts(ctx))
    (state, unit_error, binaries), (host_reading, host_error) = await asyncio.gather(
        unit_facts, host_facts
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
    pauses = verify.backoff(
        min(verify.FIRST_POLL_S, ctx.timeouts.drain_poll_s), ctx.timeouts.drain_poll_s
    )
    waited_for: list[str] = []  # what the first look found busy: why the drain waited
    while True:
        try:
            look = await _look(ctx, target)
        except ProxyTokenRejected as err:
            # Waiting cannot fix a wrong token: fail now, before anything stops.
            raise run.fail(DRAIN, f"{err}; nothing was stopped") from None
        if not look.busy:
            waited = time.monotonic() - started
            why = f"waited for: {'; '.join(waited_for)}; " if waited_for else ""
            run.record(
                DRAIN,
                True,
                f"no in-flight work or holds (waited {waited:.2f}s; {bound.text()}); "
                f"{why}asked: {'; '.join(look.asked)}",
            )
            return
        waited_for = waited_for or look.busy
        if time.monotonic() >= deadline:
            raise run.fail(
                DRAIN,
                f"still busy after {bound.seconds:g}s: {'; '.join(look.busy)} "
                f"(nothing was cut off; {bound.text()})",
            )
        await asyncio.sleep(min(next(pauses), max(0.0, deadline - time.monotonic())))


@dataclass(frozen=True)
class DrainLook:
    """One look at the victims: why each is still busy (empty: all idle), and what each
    source said (the proxy's list, each victim's engine)."""

    busy: list[str]
    asked: list[str]


async def _look(ctx: RunContext, target: Target) -> DrainLook:
    """The forward leases, the proxy's list and bus holds (as before issue 19), then each
    victim's engine."""
    victims = target.victims
    # Before the list is asked: a lease seen run out here means the list asked below was
    # asked after it ran out, so a forward answered before the mark is in it if sent.
    leased = _leased(ctx, victims)
    # The list and the engines at once (issue 23): neither answer depends on the other.
    # The list is asked first, as before, the engines while it answers.
    listed = asyncio.ensure_future(ctx.host.inflight())
    try:
        works = await asyncio.gather(*(_engine_work(ctx, target, v) for v in victims))
    finally:
        inflight = await listed
    reasons: list[str] = []
    asked: list[str] = []
    if inflight is None:
        reasons.append("the proxy's in-flight list is unavailable (unknown counts as busy)")
        asked.append("proxy list unavailable")
    for victim, work in zip(victims, works, strict=True):
        requests = list(inflight.get(victim.target_id, ())) if inflight is not None else []
        if inflight is not None:
            asked.append(f"proxy list: {len(requests)} in flight for {victim.target_id}")
        if requests:
            clients = ", ".join(sorted({h.client for h in requests}))
            reasons.append(f"{victim.target_id}: {len(requests)} in flight ({clients})")
        holds = ctx.host.holds(victim)
        if holds:
            who = ", ".join(h.client for h in holds)
            reasons.append(f"{victim.signature}: held on the bus by {who}")
        if work is None:
            asked.append(f"{victim.signature} engine: no endpoint to ask")
            continue
        asked.append(f"{victim.signature} engine: {_work_text(work)}")
        if work.blocks_drain:
            reasons.append(f"{victim.signature}: its engine says {_work_text(work)}")
    return DrainLook(reasons + leased, asked)


def _leased(ctx: RunContext, victims: Sequence[Resident]) -> list[str]:
    """A victim admission answered ``forward`` for within the lease is busy: the proxy may
    not have put that request in its list yet (docs/placement-rules.md §4.6, "Forward
    leases"). Admission forwards to no victim once it is marked, so each lease only runs
    out."""
    lease_s = ctx.timeouts.forward_lease_s
    out = []
    for target_id in sorted({v.target_id for v in victims}):
        age = ctx.host.forward_age(target_id)
        if age is not None and age < lease_s:
            out.append(
                f"{target_id}: forward lease (a forward answered {age * 1000:.0f} ms before "
                f"this look may not be in the proxy's list yet; lease {lease_s:g}s)"
            )
    return out


async def _engine_work(ctx: RunContext, target: Target, victim: Resident) -> busy.EngineWork | None:
    """What the victim's engine says of its own work; ``None`` when it has no endpoint.

    A llama.cpp router model is asked through its router, per model and never loading it
    (``?model=ID&autoload=false``: the router's own routes know no model's work)."""
    endpoint = victim.endpoint
    if endpoint is None:
        return None
    slot = victim_slot(ctx, victim) if resident_key(victim) in target.routed else None
    query = f"?{model_query(slot.model_id)}" if slot is not None else ""

    async def fetch(route: str) -> tuple[int | None, str]:
        return await ctx.engines.get_reply(endpoint, f"{route}{query}", ctx.timeouts.http_s)

    return await busy.ask(fetch)


def _work_text(work: busy.EngineWork) -> str:
    if work.verdict is busy.Verdict.UNREACHABLE:
        return f"{work.text()}: unknown counts as busy"
    if work.verdict is busy.Verdict.NO_SIGNAL:
        return f"{work.text()}: it cannot tell; the proxy's list and bus holds decide"
    return work.text()


# --------------------------------------------------------------------------- stop / verify-free


async def stop(ctx: RunContext, run: Run, target: Target) -> None:
    # A stopped llama.cpp router model is unloaded in its router, whose unit (hosting
    # its other models) is never stopped for it (docs/placement-rules.md §4.2).
    unloaded = await unload_stopped(ctx, run, target)
    units = units_of(target.unit_stopping)
    if not units:
        idle = "paused instead" if target.pausing else "no victims"
        run.record(STOP, True, unloaded or idle)
        if target.pausing or unloaded:  # recovery must know the victims sleep (or are out)
            await journal_step(ctx, run, target, VERIFY_FREE)
        return
    # Issue 23: the victims' processes and stop timeouts are read while the record that
    # must be durable before the stop is written; none of the three changes a unit.
    pids, states, _ = await asyncio.gather(
        ctx.follower.pids_of(units),
        asyncio.gather(*(ctx.follower.fresh(unit) for unit in units)),
        journal_step(ctx, run, target, STOP, units),
    )
    run.victim_pids = run.victim_pids | frozenset(pids)
    done: list[str] = []
    failed = ""
    for unit, state in zip(units, states, strict=True):
        run.stopped_units.append(unit)
        outcome = await ctx.units.stop_unit(unit, stop_wait_s(state, ctx.timeouts.stop_s))
        if not outcome.ok:
            seen = await ctx.follower.state_text(unit)
            failed = f"{unit}: stop job {outcome_text(outcome)}; unit {seen}"
            break
        done.append(unit)
    # How each stop ended (a forced one raises its alert), read for all of them at once.
    hows = await asyncio.gather(*(forced_stop(ctx, run, target, unit) for unit in done))
    if failed:
        raise run.fail(STOP, failed)
    forced = [f"{unit} {how}" for unit, how in zip(done, hows, strict=True) if how is not None]
    stopped = f"stopped {', '.join(units)}" + (f"; {unloaded}" if unloaded else "")
    if forced:
        # Not fatal: the victim is down, and restarting it would not give the cut work back.
        run.record(
            STOP,
            False,
            f"{stopped}; {'; '.join(forced)} (not fatal: the victims are down, the switch "
            "goes on; a forced_stop alert says so)",
        )
    else:
        run.record(STOP, True, stopped)
    journal_progress(ctx, run, target, VERIFY_FREE)


async def forced_stop(ctx: RunContext, run: Run, target: Target, unit: str) -> str | None:
    """How ``unit``'s ``done`` stop was forced (read from systemd now), or ``None`` for a
    clean one; a forced one raises a ``forced_stop`` warning alert (the rollback's stop of
    the new unit calls it too)."""
    state = await ctx.follower.fresh(unit)
    how = forced_stop_text(state) if state is not None else None
    if how is None:
        return None
    victim = next((v for v in target.victims if unit_of(v) == unit), None)
    what = f"{unit} ({victim.signature})" if victim is not None else unit
    ctx.raise_safely(
        AlertKind.FORCED_STOP,
        Severity.WARNING,
        unit,
        f"{what} {how}, during {run.what} ({run.run_id}). It ignored SIGTERM until "
        "TimeoutStopSec= passed (llama-server does while it generates).",
        {
            "runId": run.run_id,
            "run": run.what,
            "unit": unit,
            "result": state.result if state is not None else "",
            "execMainCode": state.exec_main_code if state is not None else 0,
            "execMainStatus": state.exec_main_status if state is not None else 0,
        },
    )
    return how


async def verify_free(ctx: RunContext, run: Run, target: Target) -> None:
    device = ctx.host.registry().devices.get(target.device)
    if device is not None and device.kind is DeviceKind.CPU:
        await _verify_host_free(ctx, run, target)
        return
    need = _free_need(target)
    bound = ctx.timeouts.verify_free_bound([ctx.victim_config(v) for v in target.victims])
    deadline = time.monotonic() + bound.seconds
    pauses = _free_pauses(ctx)
    while True:
        readings = await ctx.host.read_devices()
        reading = readings.get(target.device)
        problem = _free_problem(reading, target.device, need, run.victim_pids)
        if problem is None:
            assert reading is not None
            what = f"{need:,.0f} MiB needed" if need else "victims released their memory"
            await progress_journaled(run, VERIFY_FREE)
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
        await asyncio.sleep(next(pauses))


def _free_pauses(ctx: RunContext) -> Iterator[float]:
    """verify-free's polls: soon after the stop, backing off to ``verify_free_poll_s``."""
    longest = ctx.timeouts.verify_free_poll_s
    return verify.backoff(min(verify.FIRST_POLL_S, longest), longest)


async def _verify_host_free(ctx: RunContext, run: Run, target: Target) -> None:
    """verify-free on the host: no process left in any stopped victim unit, a sane reading.

    Free host memory is not the test: it swings with everything else on a shared machine
    (and mmap'ed weights sit in the page cache), so "enough free" would pass or fail for
    reasons that are not the victim's. Preflight's host-RAM gate already judged the fit.
    """
    units = list(dict.fromkeys(run.stopped_units))
    bound = ctx.timeouts.verify_free_bound([ctx.victim_config(v) for v in target.victims])
    deadline = time.monotonic() + bound.seconds
    pauses = _free_pauses(ctx)
    while True:
        # The reading (probe thread) and the units' processes (unit worker) at once.
        readings, leftover = await asyncio.gather(
            ctx.host.read_devices(), _leftover_processes(ctx, units)
        )
        reading = readings.get(target.device)
        problem = _host_reading_problem(reading, target.device) or leftover
        if problem is None:
            assert reading is not None
            await progress_journaled(run, VERIFY_FREE)
            run.record(VERIFY_FREE, True, _host_freed_text(target, units, reading, bound.text()))
            return
        if time.monotonic() >= deadline:
            raise run.fail(VERIFY_FREE, f"after {bound.seconds:g}s: {problem} ({bound.text()})")
        await asyncio.sleep(next(pauses))


def _host_reading_problem(reading: DeviceReading | None, device: str) -> str | None:
    """Why the host reading cannot be trusted, or ``None`` for a sane one."""
    if reading is None:
        return f"{device} is not in the probe's readings"
    if reading.source is ProbeSource.ABSENT:
        return f"{device} cannot be read: {reading.error or 'absent'}"
    total, free = reading.total_mib, reading.free_mib
    if not (total > 0 and 0 <= free <= total):  # NaN fails too
        return f"{device} reading is not sane: {free:,.0f} MiB free of {total:,.0f} MiB"
    return None


async def _leftover_processes(ctx: RunContext, units: Sequence[str]) -> str | None:
    """The stopped victim units that still have processes (or cannot be listed)."""
    problems: list[str] = []
    for unit in units:
        try:
            pids = await ctx.units.pids(unit)
        except UnitError as err:
            problems.append(f"the processes of {unit} cannot be listed: {err}")
            continue
        if pids:
            listed = ", ".join(str(pid) for pid in sorted(pids))
            problems.append(f"{unit} still has processes (its cgroup is not empty): pid {listed}")
    return "; ".join(problems) or None


def _host_freed_text(
    target: Target, units: Sequence[str], reading: DeviceReading, bound: str
) -> str:
    seen = (
        f"{target.device} reads {reading.free_mib:,.0f} MiB free of {reading.total_mib:,.0f} "
        "(not relied on: host memory moves with the rest of the machine)"
    )
    if not target.stopping:
        paused = ", ".join(v.signature for v in target.pausing) or "none"
        return f"host: no victim stopped here (paused: {paused}); {seen}; {bound}"
    # A router model's child was seen gone by its unload (the stop step); a unit, here.
    routed = [v.signature for v in target.stopping if v not in target.unit_stopping]
    gone = [f"{unit} empty" for unit in units] + [f"{r}'s router child ended" for r in routed]
    footprint = sum(v.host_rss_mib or 0.0 for v in target.stopping)
    return (
        f"host: victim processes gone ({footprint:,.0f} MiB measured footprint released; "
        f"{', '.join(gone)}); {seen}; {bound}"
    )


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
        state = await ctx.follower.fresh(unit)
        seen = state_text(state) if state is not None else "state unknown"
        detail = f"{unit}: start job {outcome_text(outcome)}; unit {seen}"
        raise run.fail(START, await unitlogs.with_last_lines(detail, unit, state))
    run.record(START, True, f"started {unit}")
    journal_progress(ctx, run, target, VERIFY_UP)


async def _none() -> None:
    return None


async def failed_unit_text(ctx: RunContext, unit: str, text: str) -> str:
    """``text`` and, below it, the last lines ``unit`` wrote in its latest run: a unit
    that failed to come up says why on its own stderr, systemd only that it ended
    (docs/placement-rules.md §4.6, "Failed start"). Unchanged where nothing is known of
    where it writes."""
    return await unitlogs.with_last_lines(text, unit, await ctx.follower.fresh(unit))


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
        detail = await failed_unit_text(ctx, unit, f"{healthy}; {bound.text()}")
        raise run.fail(VERIFY_UP, detail)
    if endpoint is None:
        await progress_journaled(run, VERIFY_UP)
        run.record(
            VERIFY_UP, True, f"{unit} active; no endpoint in the registry to probe; {bound.text()}"
        )
        return
    http_s = ctx.timeouts.http_s
    # /v1/models must list the requested id, the model, its config or an advertised id;
    # the policy's metrics are asked at the same time (issue 23: both GETs at once).
    expect = verify.expectation(target.model, target.config, target.requested)
    policy = ctx.host.service_policy(target.model)
    if policy is not None and not policy.metrics_must_match:
        policy = None
    served, measured = await asyncio.gather(
        verify.served_problem(endpoint, expect, http_s, ctx.engines),
        verify.metrics_problem(policy, endpoint, http_s, ctx.engines) if policy else _none(),
    )
    problem = served or measured
    if problem is not None:
        raise run.fail(VERIFY_UP, problem)
    checked = ""
    if policy is not None:
        checked = f"; metricsMustMatch {', '.join(policy.metrics_must_match)} as policy"
    await progress_journaled(run, VERIFY_UP)
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


async def resolve(ctx: RunContext, run: Run, target: Target) -> None:
    """The ledger's side of the switch. The entries it resolves are announced once the
    ledger without them is on disk, so a crash right after cannot make the start-up
    repair resolve them a second time (one ``Resolved`` per placement, issue 20)."""
    async with ctx.host.durable_resolutions():
        parts = _resolve(ctx, run, target)
    run.record(RESOLVE, True, "; ".join(parts))


def _resolve(ctx: RunContext, run: Run, target: Target) -> list[str]:
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
    # "forwarded", and these entries were resolved by this enforcement. A reuse of a
    # resident not ``hot`` yet resolves nothing: admission still parks its requests
    # (``warming``), and the entry resolves ``forwarded`` once it is published (issue 21).
    resolved: list[str] = []
    reused = target.reuse
    if reused is not None and reused.state is not ResidentState.HOT:
        parts.append(
            f"{reused.signature} is {reused.state.value}: the entry stays until it is published"
        )
    elif target.entry is not None and ctx.host.resolve_entry(target.entry.id, APPLIED):
        resolved.append(target.entry.id)
    if served is not None:
        resolved += ctx.host.resolve_served(served, APPLIED)
        ctx.host.put_resident(served)
        parts.append(f"{served.signature} {served.state.value} on {served.device}")
    parts.append(f"resolved {', '.join(resolved)}" if resolved else "no pending entry to resolve")
    return parts
