"""Enforcement: the spec §4.6 sequence, one run at a time, with rollback.

Every ``Apply``, ``Load`` and ``Unload`` goes through one sequence of named
steps, each reported as it ends (``EnforcementStep(run_id, step, ok, detail)``)
and returned in the result (CONTRACT.md §4)::

    revalidate → preflight → mark-draining → drain → stop → verify-free → start
               → verify-up → refresh-proxy → resolve

- **revalidate** recomputes the options now (planner on fresh residents,
  readings and in-flight) and refuses with :class:`~uapplace.errors.Drifted`
  when the approved option is gone or its victim signature differs from what
  the operator approved ("victim set changed"). Nothing has been touched yet.
- **preflight** checks that what is about to start can start, before anything
  stops (:func:`preflight_problems`): the new unit is ``LoadState=loaded``, its
  ``ExecStart=`` binaries exist and are executable, its config is measured for
  this machine on the target device (``Config.is_measured``: machine-local
  figures, see the registry) and the host-RAM gate passes on a fresh reading.
  A refusal is a failed run (``ok`` false, ``error`` naming the unit, field
  and why) with no victim touched: no mark, no stop, nothing to roll back.
- **mark-draining** marks the victims ``draining``: admission stops forwarding
  to them. The marks live in :class:`EnforcementMarks` so a concurrent unit
  sync keeps them mid-drain; they are cleared when the run ends, whatever the
  outcome.
- **drain** waits (polling) until no victim has in-flight work at the proxy or
  a bus hold. The proxy not answering is unknown, which counts as busy. At the
  drain timeout the run rolls back rather than cut anyone off.
- **stop** awaits each victim unit's stop job; anything but ``done`` rolls back.
- **verify-free** waits until the device's free memory (the probe, not the
  ledger) covers the new config's cost and no victim PID holds memory there.
  On failure it names every compute process on the device that is not a
  staying resident: the orphan case of spec §4.6 step 4.
- **start** and **verify-up**: the start job, then the unit active, ``/health``
  200 (polled from 50 ms with backoff; a unit that turns ``failed`` or
  ``inactive`` ends the wait at once), ``/v1/models`` serving the requested id
  or one the model advertises, and the capacity policy's ``metricsMustMatch``.
- **refresh-proxy** invalidates the proxy's cached upstream view. A failure is
  a failed step, never a failed run.
- **resolve**: the new resident ``hot``, the victims gone, the pending entries
  the new resident serves resolved ``applied``.

Pause and wake (issue 12). A victim the approved option pauses (its signature
``model/config@pause``) is put to sleep in the **pause** step (after drain, before
stop): vLLM's ``POST /sleep?level=N``, then ``/is_sleeping`` must say true; its unit
stays active and verify-free checks the freed memory on the probe. A ``wake`` option
replaces start and verify-up with **wake** (``POST /wake_up``) and the same verify-up
plus ``/is_sleeping`` false (a sleeping vLLM answers ``/health`` 200). At resolve a
paused victim stays a resident, ``paused`` (:func:`paused_resident`), and a woken one
turns ``hot``. Rollback: a woken resident is put back to sleep and seen asleep
(**rollback-sleep**) before the paused victims are woken again, each with its
verify-up (**rollback-wake**); a victim that cannot be woken stays ``paused`` and the
rollback is incomplete. Each of these steps is journaled first, with every victim's
action (stop/pause) and the resident a wake run wakes, so the start-up repair
(:mod:`uapplace.recovery`) wakes or keeps paused what a crash left asleep.

Rollback (any failure after preflight): stop what this run started, then
restart every victim this run stopped, each with its own verify-up (health and
served id, bounded like verify-up from the victim's own start facts), and
clear the marks. Two same-device residents must never run together, so the
victims are restarted only once the new unit is seen not running: a failed
stop job alone does not block them (a unit that does not exist, or is
``inactive``/``failed`` whatever its stop job said, is safe), only a new unit
observed still up (or whose state cannot be read) does. The result says
``rolled back`` or ``ROLLBACK INCOMPLETE: <observed state>``, and
``runningAfter`` lists what runs on the run's device at the end; rollback is
tried once, never looped.

ROLLBACK INCOMPLETE (a victim that ran before is not running and verified
again) is raised everywhere: a critical ``rollback_incomplete`` alert per
device (``host.raise_alert``: ``GetState.alerts``, ``AlertRaised``, the
critical notification, ``uapplace status``) naming what could not be restored
and why, and the pending entry the run applied is resolved ``failed`` so its
parked clients fall back at once (spec §4.6 step 7). After a complete
rollback the entry stays pending: the machine is as before and the operator
may pick another option. An unattended run (``wait=True``: the auto runner and
the idle sweep; or ``origin`` given, e.g. a notification click) that fails or
rolls back also raises a ``enforcement_failed`` warning, since nobody is
watching its result.

Concurrency: one run machine-wide. A second operator call while one runs gets
:class:`~uapplace.errors.Busy` at once (naming the running one), because a bus
call blocked for minutes would outlive every client timeout; background callers
(the auto runner) pass ``wait=True`` and queue behind it. Nothing here blocks
the loop: systemd work goes through :class:`~uapplace.units.UnitManager`, probes
run in a thread, HTTP is aiohttp.

Timeouts (:class:`Timeouts`) are **unvalidated defaults** (spec §4.3: "the
timeouts have an envelope nobody has measured"): conservative guesses until a
planned switch on the real machine measures the envelope. Override any of them
in ``$UAP_HOME/enforcement-timeouts.json`` (:meth:`Timeouts.load`). The
verify-up wait comes from facts where the registry has them
(:meth:`Timeouts.verify_up_bound`): a config's measured start time beats the
operator's per-config bound, which beats the global value. Once ``uapplace measure
--envelope`` has measured a config's envelope (:class:`~uapplace.model.Envelope`),
drain, verify-free and verify-up derive from it: a documented multiple of the
measured figure plus a floor (:meth:`Timeouts.drain_bound`,
:meth:`Timeouts.verify_free_bound`, :meth:`Timeouts.verify_up_bound`,
:meth:`Timeouts.wake_bound`); each step's detail names the bound it used and why.
Without an envelope, the bounded defaults.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol

from uapplace import engines, verify
from uapplace.alerts import AlertKind, Severity
from uapplace.capacity import ServicePolicy
from uapplace.counters import DaemonCounters, run_outcome
from uapplace.enforce_host import EnforcementHost, ProxyRefresher
from uapplace.engines import ProxyTokenRejected
from uapplace.errors import Busy, Drifted, Failed, InvalidArgument, NotFound, UnknownModel
from uapplace.journal import Journal, JournalError, RunRecord
from uapplace.model import (
    DEFAULT_CELLS,
    Config,
    DeviceReading,
    Model,
    Option,
    OptionKind,
    PendingEntry,
    Plan,
    ProbeSource,
    Registry,
    Resident,
    ResidentState,
    iso,
    processes_text,
)
from uapplace.planner import config_of, pause_figures, plan
from uapplace.preflight import (
    PreflightFacts,
    executable_problems,
    preflight_problems,
    preflight_summary,
)
from uapplace.registry import unit_file_name, valid_unit_name
from uapplace.timeouts import Timeouts, UpBound
from uapplace.topology import verify_endpoint
from uapplace.units import (
    UnitError,
    UnitManager,
    UnitState,
    outcome_text,
    state_text,
    unit_of,
    units_of,
)
from uapplace.unitsync import EnforcementMarks, ResidentKey, resident_key

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)

REVALIDATE = "revalidate"
PREFLIGHT = "preflight"
MARK_DRAINING = "mark-draining"
DRAIN = "drain"
STOP = "stop"
VERIFY_FREE = "verify-free"
START = "start"
VERIFY_UP = "verify-up"
REFRESH_PROXY = "refresh-proxy"
RESOLVE = "resolve"
ROLLBACK_STOP = "rollback-stop"
ROLLBACK_START = "rollback-start"
ROLLBACK_VERIFY = "rollback-verify"
ROLLBACK_CLEAR = "rollback-clear"
PAUSE = "pause"
"""A victim's engine put to sleep (vLLM ``POST /sleep``) instead of its unit stopped."""
WAKE = "wake"
"""A paused resident's engine woken (``POST /wake_up``) instead of a unit started."""
ROLLBACK_SLEEP = "rollback-sleep"
ROLLBACK_WAKE = "rollback-wake"
UNEXPECTED = "unexpected-error"
"""The step recorded when something raised mid-run outside any step's own checks."""

ROLLED_BACK = "rolled back"
ROLLBACK_INCOMPLETE = "ROLLBACK INCOMPLETE"
APPLIED = "applied"
FAILED_OUTCOME = "failed"
"""``Resolved`` outcome of the pending entry of a run whose rollback was incomplete."""

HEALTH_BACKOFF = verify.HEALTH_BACKOFF
"""Growth of the pause between two ``/health`` polls (from ``health_first_poll_s``)."""
_DOWN_STATES = frozenset({"failed", "inactive"})


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class StepRecord:
    name: str
    ok: bool
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "detail": self.detail}


@dataclass(frozen=True)
class EnforcementResult:
    """CONTRACT.md §4: ``{ok, placementId, steps, rolledBack?, error?}`` (+ ``runId``)."""

    ok: bool
    run_id: str
    placement_id: str | None
    steps: tuple[StepRecord, ...]
    rolled_back: bool | None = None
    """``None``: no rollback was needed; ``False``: it was incomplete."""
    error: str | None = None
    running_after: tuple[RunningAfter, ...] | None = None
    """What runs on the run's device(s) when it ended (``runningAfter``); ``None`` for a
    run refused before anything was looked at."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": self.ok,
            "placementId": self.placement_id,
            "runId": self.run_id,
            "steps": [s.to_json() for s in self.steps],
        }
        if self.rolled_back is not None:
            out["rolledBack"] = self.rolled_back
        if self.error is not None:
            out["error"] = self.error
        if self.running_after is not None:
            out["runningAfter"] = [r.to_json() for r in self.running_after]
        return out


@dataclass(frozen=True)
class RunningAfter:
    """One backend running on a run's device at its end, as systemd reports its unit."""

    model: str
    config: str
    device: str
    unit: str | None
    state: str
    """``active/running`` …, or ``published`` for a resident without a readable unit."""

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "config": self.config,
            "device": self.device,
            "unit": self.unit,
            "state": self.state,
        }

    def text(self) -> str:
        unit = f", {self.unit} {self.state}" if self.unit else ""
        return f"{self.model}/{self.config} on {self.device}{unit}"


class _StepFailed(Exception):
    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"{step}: {detail}")
        self.step = step
        self.detail = detail


@dataclass
class _Run:
    """One enforcement's bookkeeping: what it touched, so rollback knows what to undo."""

    run_id: str
    what: str
    host: EnforcementHost
    steps: list[StepRecord] = field(default_factory=list)
    victims: tuple[Resident, ...] = ()
    stopped_units: list[str] = field(default_factory=list)
    """Victim units whose stop was attempted (the rollback restarts these)."""
    started_unit: str | None = None
    """The unit whose start was attempted (the rollback stops it first)."""
    victim_pids: frozenset[int] = frozenset()
    paused: list[Resident] = field(default_factory=list)
    """Victims whose sleep was attempted (the rollback wakes these)."""
    woke: bool = False
    """Whether this run asked the paused resident it wakes to wake (the rollback puts it
    back to sleep first)."""
    started_at: float = field(default_factory=time.time)
    verify_up_bound: UpBound | None = None
    """The verify-up wait this run used for its new unit, and why that long."""

    def record(self, step: str, ok: bool, detail: str) -> None:
        self.steps.append(StepRecord(step, ok, detail))
        log.info("enforcement %s %s %s: %s", self.run_id, step, "ok" if ok else "FAILED", detail)
        try:
            self.host.emit_step(self.run_id, step, ok, detail)
        except Exception:  # a signal that cannot be sent must not derail the sequence
            log.exception("could not emit EnforcementStep %s/%s", self.run_id, step)

    def fail(self, step: str, detail: str) -> _StepFailed:
        self.record(step, False, detail)
        return _StepFailed(step, detail)


@dataclass(frozen=True)
class _Target:
    """What one run does, once revalidated."""

    kind: Literal["apply", "load", "unload"]
    requested: str
    model: Model
    config: Config | None
    """``None`` for an unload: nothing starts."""
    device: str
    cost_mib: float
    victims: tuple[Resident, ...]
    new_unit: str | None
    reuse: Resident | None = None
    entry: PendingEntry | None = None
    pause: frozenset[ResidentKey] = frozenset()
    """The victims this run pauses (engine sleep) rather than stops (issue 12)."""
    wake: Resident | None = None
    """The paused resident this run wakes instead of starting a unit (a ``wake`` option)."""

    @property
    def stopping(self) -> tuple[Resident, ...]:
        return tuple(v for v in self.victims if resident_key(v) not in self.pause)

    @property
    def pausing(self) -> tuple[Resident, ...]:
        return tuple(v for v in self.victims if resident_key(v) in self.pause)

    @property
    def new_key(self) -> ResidentKey | None:
        if self.config is None:
            return None
        return (self.model.key, self.config.key, self.device)


class _SignatureRef(Protocol):
    @property
    def signature(self) -> str: ...


ExpectedVictims = Sequence[str] | Sequence[_SignatureRef]


def normalize_signature(expected: ExpectedVictims | None) -> tuple[str, ...] | None:
    """``["m/c", …]`` or objects with ``.signature`` → a sorted tuple; ``None`` stays.

    The signature is one type everywhere (bus ``as expected``, shim
    ``expected_victims``, notification buttons, auto and idle runs): the sorted
    ``model/config`` strings ``ListPending``/``Preview``/``PreviewUnload`` show.
    An empty one means "I approve stopping nothing": it is checked like any other.
    """
    if expected is None:
        return None
    out = [item if isinstance(item, str) else item.signature for item in expected]
    return tuple(sorted(out))


def _signature_drift(approved: tuple[str, ...], now: Iterable[str]) -> Drifted | None:
    """``Drifted`` naming both lists when what would stop now is not what was approved."""
    current = tuple(sorted(now))
    if current == approved:
        return None
    return Drifted(
        f"victim set changed: approved [{', '.join(approved) or 'none'}], "
        f"now [{', '.join(current) or 'none'}]; look at the preview again"
    )


# --------------------------------------------------------------------------- the enforcer


class Enforcer:
    """Runs the §4.6 sequence. Build once per daemon; ``units`` must be connected."""

    def __init__(
        self,
        host: EnforcementHost,
        units: UnitManager,
        *,
        timeouts: Timeouts | None = None,
        refresher: ProxyRefresher | None = None,
        marks: EnforcementMarks | None = None,
        clock: Callable[[], float] = time.time,
        journal: Journal | None = None,
    ) -> None:
        self.host = host
        self.journal = journal
        """Where each unit-changing step is recorded first (crash recovery); ``None``: nowhere."""
        self.units = units
        self.timeouts = timeouts or Timeouts()
        self.refresher = refresher
        self.marks = marks or EnforcementMarks()
        self._clock = clock
        self._lock = asyncio.Lock()
        self._running: str | None = None
        self._unit_events: dict[str, asyncio.Event] = {}
        self._unit_states: dict[str, UnitState] = {}
        units.on_change(self._on_unit_change)

    # ------------------------------------------------------------------ public

    @property
    def running(self) -> str | None:
        """``"<run id> (<what>)"`` while a run is in progress, else ``None``."""
        return self._running

    async def wait_idle(self) -> None:
        async with self._lock:
            return

    @contextlib.asynccontextmanager
    async def exclusive(self, what: str) -> AsyncIterator[None]:
        """Hold the one-run-at-a-time lock for work that takes units down outside a run
        (``measure --envelope``): :class:`~uapplace.errors.Busy` at once when a run is in
        progress, and no run starts until it ends."""
        if self._lock.locked():
            raise Busy(
                f"an enforcement is running ({self._running}); one runs at a time "
                "machine-wide: retry when it has finished"
            )
        async with self._lock:
            self._running = what
            try:
                yield
            finally:
                self._running = None

    async def apply(
        self,
        entry: PendingEntry | str,
        option: int,
        expected: ExpectedVictims | None = None,
        *,
        wait: bool = False,
        origin: str | None = None,
    ) -> dict[str, Any]:
        """Enforce option ``option`` (1-based) of a pending entry.

        ``expected`` is the approval signature (``model/config`` of every victim,
        or objects with ``.signature``); ``None`` compares against the victims of
        the stored option the index names, i.e. what ``ListPending`` showed.
        Raises ``NotFound``/``InvalidArgument`` for a bad id or index, ``Drifted``
        when revalidation refuses, ``Busy`` when another run is in progress and
        ``wait`` is false. Returns the result JSON otherwise (``ok`` false after a
        preflight refusal or a rollback). ``origin`` names an unattended caller
        (``"notification"``, ``"auto"``): its failure also raises an alert.
        """
        found = self._entry(entry)
        if not found.options:
            raise InvalidArgument(f"placement {found.id} has no options; nothing can be applied")
        if not 1 <= option <= len(found.options):
            raise InvalidArgument(
                f"option {option} is out of range: placement {found.id} has options "
                f"1..{len(found.options)}"
            )
        approved = found.options[option - 1]
        signature = normalize_signature(expected)
        if signature is None:
            signature = approved.signature
        what = f"apply {found.id} option {option} ({_option_text(approved)})"

        async def revalidate(run: _Run) -> _Target:
            return await self._revalidate_option(run, found, approved, signature)

        result = await self._enforce(what, revalidate, found.id, wait, origin)
        return result.to_json()

    async def load(
        self,
        model: str,
        expected: ExpectedVictims,
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

        async def revalidate(run: _Run) -> _Target:
            return await self._revalidate_load(run, model, cells, signature)

        result = await self._enforce(f"load {model}", revalidate, None, wait)
        return result.to_json()

    async def unload(
        self, model: str, expected: ExpectedVictims, *, wait: bool = False
    ) -> dict[str, Any]:
        """Stop every resident serving ``model`` (drain first, rollback on failure).

        ``expected`` is the signature ``PreviewUnload`` showed (the residents that
        stop); a different set now is ``Drifted``.
        """
        signature = normalize_signature(expected) or ()

        async def revalidate(run: _Run) -> _Target:
            return await self._revalidate_unload(run, model, signature)

        result = await self._enforce(f"unload {model}", revalidate, None, wait)
        return result.to_json()

    # ------------------------------------------------------------------ the run

    def _entry(self, entry: PendingEntry | str) -> PendingEntry:
        if isinstance(entry, PendingEntry):
            return entry
        found = self.host.pending(entry)
        if found is None:
            raise NotFound(f"no pending placement {entry} (it may have expired or been resolved)")
        return found

    async def _enforce(
        self,
        what: str,
        revalidate: Callable[[_Run], Awaitable[_Target]],
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
            run = _Run(run_id=f"run-{secrets.token_hex(4)}", what=what, host=self.host)
            self._running = f"{run.run_id} ({what})"
            outcome = "refused"  # revalidation said no (or raised): nothing ran
            try:
                target = await revalidate(run)
                result = await self._sequence(run, target, placement_id)
                outcome = run_outcome(result.ok, result.rolled_back)
                await self._journal_clear(run)
                self._alert_unattended(run, target, result, _unattended(target, wait, origin))
                return result
            finally:
                self._release_marks(run)
                self._running = None
                self._count_run(run, what.split(" ", 1)[0], outcome)

    def _count_run(self, run: _Run, verb: str, outcome: str) -> None:
        """The daemon's run counters (issue 13: ``/metrics`` counts every run, whoever
        started it). Only hosts that keep counters have ``counters``."""
        counters = getattr(getattr(self.host, "controller", None), "counters", None)
        if isinstance(counters, DaemonCounters):
            counters.run_finished(run.run_id, verb, outcome)

    async def _sequence(
        self, run: _Run, target: _Target, placement_id: str | None
    ) -> EnforcementResult:
        if target.reuse is not None:
            self._resolve(run, target)
            return EnforcementResult(
                True,
                run.run_id,
                placement_id,
                tuple(run.steps),
                running_after=self._published(target),
            )
        refusal = await self._preflight(run, target)
        if refusal is not None:
            return EnforcementResult(
                False,
                run.run_id,
                placement_id,
                tuple(run.steps),
                error=f"{PREFLIGHT}: {refusal}; nothing was stopped",
                running_after=await self._running_after(run, target),
            )
        try:
            self._mark_draining(run, target)
            await self._drain(run, target)
            await self._pause(run, target)
            await self._stop(run, target)
            await self._verify_free(run, target)
            if target.wake is not None:
                await self._wake(run, target, target.wake)
            elif target.new_unit is not None:
                await self._start(run, target)
                await self._verify_up(run, target)
        except _StepFailed as failure:
            return await self._failed(run, target, placement_id, failure)
        except Exception as err:  # a bug or a dead probe mid-run must still roll back
            log.exception("%s: unexpected error mid-run; rolling back", run.run_id)
            unexpected = run.fail(UNEXPECTED, f"{type(err).__name__}: {err}")
            return await self._failed(run, target, placement_id, unexpected)
        await self._refresh_proxy(run)
        self._resolve(run, target)
        return EnforcementResult(
            True, run.run_id, placement_id, tuple(run.steps), running_after=self._published(target)
        )

    async def _failed(
        self, run: _Run, target: _Target, placement_id: str | None, failure: _StepFailed
    ) -> EnforcementResult:
        """Roll back; on an incomplete rollback raise it everywhere (module docstring)."""
        restore, running = await self._rollback(run, target)
        error = f"{failure.step}: {failure.detail}"
        if restore.complete:
            error += f"; {ROLLED_BACK}"
        else:
            error += f"; {ROLLBACK_INCOMPLETE}: {'; '.join(restore.problems)}"
            self._alert_incomplete(run, target, failure, restore, running)
            if target.entry is not None:
                self.host.resolve_entry(target.entry.id, FAILED_OUTCOME)
        return EnforcementResult(
            False,
            run.run_id,
            placement_id,
            tuple(run.steps),
            rolled_back=restore.complete,
            error=error,
            running_after=running,
        )

    # ------------------------------------------------------------------ revalidate

    async def _fresh_plan(self, requested: str, cells: int) -> Plan:
        inp = await self.host.plan_input()
        return await asyncio.to_thread(plan, inp, requested, cells)

    async def _revalidate_option(
        self, run: _Run, entry: PendingEntry, approved: Option, signature: tuple[str, ...]
    ) -> _Target:
        fresh = await self._fresh_plan(entry.requested_model, entry.cells)
        reuse = next((o for o in fresh.options if o.kind is OptionKind.REUSE), None)
        if reuse is not None:
            return self._reuse_target(run, entry.requested_model, reuse, entry)
        same = [o for o in fresh.options if _same_placement(o, approved)]
        if not same:
            now = "; ".join(_option_text(o) for o in fresh.options) or "no option at all"
            why = f" ({'; '.join(fresh.infeasible)})" if fresh.infeasible else ""
            raise self._refuse(
                run,
                Drifted(
                    f"the approved option ({_option_text(approved)}) no longer exists; "
                    f"options now: {now}{why}"
                ),
            )
        chosen = next((o for o in same if o.signature == signature), None)
        if chosen is None:
            raise self._refuse(
                run,
                Drifted(
                    f"victim set changed: approved [{', '.join(signature) or 'none'}], "
                    f"now [{', '.join(same[0].signature) or 'none'}]; look at the preview again"
                ),
            )
        return self._option_target(run, "apply", entry.requested_model, chosen, entry)

    async def _revalidate_load(
        self, run: _Run, model: str, cells: int, signature: tuple[str, ...]
    ) -> _Target:
        registry = self.host.registry()
        if registry.resolve(model) is None:
            raise self._refuse(run, UnknownModel(f"model {model!r} is in no registry file"))
        fresh = await self._fresh_plan(model, cells)
        if not fresh.options:
            why = "; ".join(fresh.infeasible) or fresh.reason.value
            raise self._refuse(run, Failed(f"no way to load {model} now: {why}"))
        # The first placement; of its stop and pause forms (issue 12), the one approved.
        chosen = next(
            (
                o
                for o in fresh.options
                if _same_placement(o, fresh.options[0]) and o.signature == signature
            ),
            fresh.options[0],
        )
        drift = _signature_drift(signature, chosen.signature)
        if drift is not None:
            raise self._refuse(run, drift)
        if chosen.kind is OptionKind.REUSE:
            return self._reuse_target(run, model, chosen, None)
        return self._option_target(run, "load", model, chosen, None)

    async def _revalidate_unload(
        self, run: _Run, model: str, signature: tuple[str, ...]
    ) -> _Target:
        registry = self.host.registry()
        resolved = registry.resolve(model)
        if resolved is None:
            raise self._refuse(run, UnknownModel(f"model {model!r} is in no registry file"))
        found = resolved[0]
        victims = tuple(r for r in self.host.residents() if r.model == found.key)
        if not victims:
            raise self._refuse(run, NotFound(f"{found.key} is not resident: nothing to unload"))
        drift = _signature_drift(signature, (r.signature for r in victims))
        if drift is not None:
            raise self._refuse(run, drift)
        self._check_victim_units(run, victims)
        held = [h for r in victims for h in self.host.holds(r)]
        if held:
            who = ", ".join(f"{h.client} ({h.detail})" if h.detail else h.client for h in held)
            raise self._refuse(run, Busy(f"{found.key} is held on the bus by {who}"))
        devices = sorted({r.device for r in victims})
        run.record(
            REVALIDATE,
            True,
            f"unload {', '.join(r.signature for r in victims)} from {', '.join(devices)}",
        )
        return _Target(
            kind="unload",
            requested=model,
            model=found,
            config=None,
            device=devices[0],
            cost_mib=0.0,
            victims=victims,
            new_unit=None,
        )

    def _reuse_target(
        self, run: _Run, requested: str, option: Option, entry: PendingEntry | None
    ) -> _Target:
        resident = next(
            (
                r
                for r in self.host.residents()
                if (r.model, r.config, r.device) == (option.model, option.config, option.device)
            ),
            None,
        )
        if resident is None:
            raise self._refuse(
                run, Drifted(f"{option.model}/{option.config} on {option.device} went away")
            )
        run.record(
            REVALIDATE,
            True,
            f"{requested} is already served by {resident.signature} on {resident.device}: "
            "nothing to stop or start",
        )
        model = self.host.registry().models[option.model]
        return _Target(
            kind="apply",
            requested=requested,
            model=model,
            config=model.configs.get(option.config),
            device=option.device,
            cost_mib=option.cost_mib,
            victims=(),
            new_unit=None,
            reuse=resident,
            entry=entry,
        )

    def _option_target(
        self,
        run: _Run,
        kind: Literal["apply", "load"],
        requested: str,
        option: Option,
        entry: PendingEntry | None,
    ) -> _Target:
        registry = self.host.registry()
        model = registry.models.get(option.model)
        config = model.configs.get(option.config) if model is not None else None
        if model is None or config is None:
            raise self._refuse(
                run, Drifted(f"{option.model}/{option.config} is no longer in the registry")
            )
        unit = model.unit_for(config)
        if unit is None or not valid_unit_name(unit):
            raise self._refuse(
                run,
                Failed(
                    f"{model.key}/{config.key} has no usable systemd unit ({unit!r}); "
                    "enforcement only starts registry units"
                ),
            )
        wanted = {f"{v.model}/{v.config}": v.action for v in option.victims}
        victims = tuple(
            r for r in self.host.residents() if r.signature in wanted and r.device == option.device
        )
        if len(victims) != len(wanted):
            raise self._refuse(run, Drifted("a victim is no longer resident; look at the preview"))
        self._check_victim_units(run, victims)
        pause = frozenset(resident_key(r) for r in victims if wanted[r.signature] == "pause")
        wake = self._paused_twin(run, option) if option.kind is OptionKind.WAKE else None
        detail = _option_text(option)
        run.record(REVALIDATE, True, f"{detail}: still valid")
        return _Target(
            kind=kind,
            requested=requested,
            model=model,
            config=config,
            device=option.device,
            cost_mib=option.cost_mib,
            victims=victims,
            new_unit=None if wake is not None else unit_file_name(unit),
            entry=entry,
            pause=pause,
            wake=wake,
        )

    def _paused_twin(self, run: _Run, option: Option) -> Resident:
        """The paused resident a ``wake`` option wakes; ``Drifted`` when it went away."""
        twin = next(
            (
                r
                for r in self.host.residents()
                if (r.model, r.config, r.device) == (option.model, option.config, option.device)
                and r.state is ResidentState.PAUSED
            ),
            None,
        )
        if twin is None or twin.endpoint is None:
            raise self._refuse(
                run,
                Drifted(f"{option.model}/{option.config} is no longer paused on {option.device}"),
            )
        return twin

    def _check_victim_units(self, run: _Run, victims: Iterable[Resident]) -> None:
        unitless = [v.signature for v in victims if not v.unit or not valid_unit_name(v.unit)]
        if unitless:
            raise self._refuse(
                run,
                Failed(
                    f"{', '.join(unitless)} run without a systemd unit: enforcement cannot "
                    "stop them (spec §8: no unit is a distinct state, never zero cost)"
                ),
            )

    def _refuse(self, run: _Run, err: Exception) -> Exception:
        run.record(REVALIDATE, False, str(err))
        return err

    # ------------------------------------------------------------------ preflight

    async def _preflight(self, run: _Run, target: _Target) -> str | None:
        """Check that what starts can start, before anything stops; why not, or ``None``.

        Recorded as the ``preflight`` step either way. Nothing is marked, drained or
        stopped before it passes (:func:`preflight_problems` decides).
        """
        if target.new_unit is None or target.config is None:
            stopping = ", ".join(v.signature for v in target.victims) or "nothing"
            run.record(PREFLIGHT, True, f"nothing starts ({target.kind}); {stopping} stops")
            return None
        facts = await self._preflight_facts(target, target.new_unit, target.config)
        problems = preflight_problems(facts)
        if problems:
            detail = "; ".join(problems)
            run.record(PREFLIGHT, False, detail)
            return detail
        run.record(PREFLIGHT, True, preflight_summary(facts))
        return None

    async def _preflight_facts(self, target: _Target, unit: str, config: Config) -> PreflightFacts:
        # The unit (user manager's worker thread) and the host (probe thread) at once.
        (state, unit_error, binaries), (host_reading, host_error) = await asyncio.gather(
            self._unit_facts(unit), self._host_facts()
        )
        return PreflightFacts(
            unit=unit,
            state=state,
            unit_error=unit_error,
            binaries=binaries,
            label=f"{target.model.key}/{config.key}",
            config=config,
            device=target.device,
            host=self.host.registry().host(),
            host_reading=host_reading,
            victims=target.victims,
            host_error=host_error,
        )

    async def _unit_facts(self, unit: str) -> tuple[UnitState | None, str, dict[str, str]]:
        """The unit's state (or why it cannot be read) and its ``ExecStart=`` binaries."""
        try:
            state = await self.units.state(unit)
        except UnitError as err:
            return None, str(err), {}
        self._unit_states[unit] = state
        if not state.exec_paths:
            return state, "", {}
        return state, "", await asyncio.to_thread(executable_problems, state.exec_paths)

    async def _host_facts(self) -> tuple[DeviceReading | None, str]:
        """A fresh host-RAM reading, or why there is none (the gate then fails closed)."""
        host = self.host.registry().host()
        try:
            readings = await self.host.read_devices()
        except Exception as err:  # a probe that fails is no reading, never a pass
            return None, f"the probe failed: {type(err).__name__}: {err}"
        return (readings.get(host.key) if host is not None else None), ""

    # ------------------------------------------------------------------ drain

    def _mark_draining(self, run: _Run, target: _Target) -> None:
        run.victims = target.victims
        if not target.victims:
            run.record(MARK_DRAINING, True, "no victims")
            return
        for victim in target.victims:
            self.marks.mark_draining(resident_key(victim), run.run_id)
            self.host.put_resident(replace(victim, state=ResidentState.DRAINING))
        names = ", ".join(f"{v.signature} on {v.device}" for v in target.victims)
        run.record(MARK_DRAINING, True, f"{names}: admission stops forwarding to them")

    async def _drain(self, run: _Run, target: _Target) -> None:
        if not target.victims:
            run.record(DRAIN, True, "no victims")
            return
        started = time.monotonic()
        bound = self.timeouts.drain_bound(
            self._labelled(target), [self._victim_config(v) for v in target.victims]
        )
        deadline = started + bound.seconds
        while True:
            try:
                busy = await self._busy(target.victims)
            except ProxyTokenRejected as err:
                # Waiting cannot fix a wrong token: fail now, before anything stops.
                raise run.fail(DRAIN, f"{err}; nothing was stopped") from None
            if not busy:
                waited = time.monotonic() - started
                run.record(
                    DRAIN,
                    True,
                    f"no in-flight work or holds (waited {waited:.2f}s; {bound.text()})",
                )
                return
            if time.monotonic() >= deadline:
                raise run.fail(
                    DRAIN,
                    f"still busy after {bound.seconds:g}s: {'; '.join(busy)} "
                    f"(nothing was cut off; {bound.text()})",
                )
            await asyncio.sleep(
                min(self.timeouts.drain_poll_s, max(0.0, deadline - time.monotonic()))
            )

    def _victim_config(self, victim: Resident) -> tuple[str, Config | None]:
        """``(model/config, its registry config)`` for the envelope-derived bounds."""
        model = self.host.registry().models.get(victim.model)
        return victim.signature, model.configs.get(victim.config) if model else None

    @staticmethod
    def _labelled(target: _Target) -> tuple[str, Config | None] | None:
        if target.config is None:
            return None
        return f"{target.model.key}/{target.config.key}", target.config

    async def _busy(self, victims: Sequence[Resident]) -> list[str]:
        """Why each victim is still busy; empty when all are idle."""
        inflight = await self.host.inflight()
        reasons: list[str] = []
        if inflight is None:
            reasons.append("the proxy's in-flight list is unavailable (unknown counts as busy)")
        for victim in victims:
            requests = list(inflight.get(victim.target_id, ())) if inflight is not None else []
            if requests:
                clients = ", ".join(sorted({h.client for h in requests}))
                reasons.append(f"{victim.target_id}: {len(requests)} in flight ({clients})")
            holds = self.host.holds(victim)
            if holds:
                who = ", ".join(h.client for h in holds)
                reasons.append(f"{victim.signature}: held on the bus by {who}")
        return reasons

    # ------------------------------------------------------------------ stop / verify-free

    async def _stop(self, run: _Run, target: _Target) -> None:
        units = units_of(target.stopping)
        if not units:
            run.record(STOP, True, "paused instead" if target.pausing else "no victims")
            if target.pausing:  # the sleeps are done: recovery must know the victims sleep
                await self._journal_step(run, target, VERIFY_FREE)
            return
        run.victim_pids = frozenset(await self._pids_of(units))
        await self._journal_step(run, target, STOP, units)
        for unit in units:
            run.stopped_units.append(unit)
            outcome = await self.units.stop_unit(unit, self.timeouts.stop_s)
            if not outcome.ok:
                state = await self._state_text(unit)
                raise run.fail(STOP, f"{unit}: stop job {outcome_text(outcome)}; unit {state}")
        run.record(STOP, True, f"stopped {', '.join(units)}")
        await self._journal_step(run, target, VERIFY_FREE)

    # ------------------------------------------------------------------ pause / wake

    async def _pause(self, run: _Run, target: _Target) -> None:
        """Put each paused victim's engine to sleep and see it asleep (issue 12).

        The sleep is vLLM's ``POST /sleep?level=N`` (answered once the memory is
        released); ``/is_sleeping`` must then say ``true``. The unit stays active:
        only the memory goes, which verify-free then checks on the probe. A sleep
        that fails rolls back, and the rollback wakes every victim this step touched.
        """
        victims = target.pausing
        if not victims:
            return
        registry = self.host.registry()
        done: list[str] = []
        await self._journal_step(run, target, PAUSE)
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
                await engines.sleep(victim.endpoint, level, self.timeouts.stop_s)
            except (engines.EngineError, ValueError) as err:
                raise run.fail(
                    PAUSE, f"{victim.signature} at {victim.endpoint}: sleep level {level}: {err}"
                ) from None
            asleep = await engines.is_sleeping(victim.endpoint, self.timeouts.http_s)
            if asleep is not True:
                seen = "unknown" if asleep is None else "false"
                raise run.fail(
                    PAUSE,
                    f"{victim.signature}: the sleep was answered but /is_sleeping is {seen}",
                )
            elapsed = time.monotonic() - started
            done.append(f"{victim.signature} asleep at level {level} in {elapsed:.2f}s")
        run.record(PAUSE, True, "; ".join(done) + " (units stay active)")

    async def _wake(self, run: _Run, target: _Target, twin: Resident) -> None:
        """Wake the paused resident a ``wake`` option names, then its verify-up: unit
        active, ``/health`` 200, served id, metrics policy, and ``/is_sleeping`` false
        (a sleeping vLLM answers ``/health`` 200, so health alone proves nothing)."""
        assert target.config is not None and twin.endpoint is not None
        label = f"{target.model.key}/{target.config.key}"
        bound = self.timeouts.wake_bound(label, target.config, self.timeouts.verify_up_s)
        run.verify_up_bound = bound
        await self._journal_step(run, target, WAKE)
        run.woke = True
        started = time.monotonic()
        try:
            await engines.wake(twin.endpoint, bound.seconds)
        except engines.EngineError as err:
            raise run.fail(WAKE, f"{label} at {twin.endpoint}: wake_up: {err}") from None
        run.record(WAKE, True, f"{label} woke in {time.monotonic() - started:.2f}s")
        ok, detail = await self._verify_awake(
            twin, target.model, target.config, target.requested, bound
        )
        if not ok:
            raise run.fail(VERIFY_UP, detail)
        run.record(VERIFY_UP, True, detail)

    async def _verify_awake(
        self,
        resident: Resident,
        model: Model,
        config: Config | None,
        requested: str | None,
        bound: UpBound,
    ) -> tuple[bool, str]:
        """A woken engine's verify-up (the same check as a start, plus not asleep)."""
        unit = unit_of(resident) or resident.signature
        endpoint = verify_endpoint(resident.endpoint, self.host.registry().single_upstream)
        expect = verify.expectation(model, config, requested, self.host.service_policy(model))
        verdict = await verify.verify_up(
            unit,
            endpoint,
            expect,
            bound.seconds,
            changed=self._watch(unit),
            fresh_state=lambda: self._fresh_state(unit),
            cached_state=lambda: self._unit_states.get(unit),
            first_poll_s=self.timeouts.health_first_poll_s,
            max_poll_s=self.timeouts.health_max_poll_s,
            http_s=self.timeouts.http_s,
        )
        if not verdict.ok:
            return False, f"{verdict.detail}; {bound.text()}"
        asleep = await engines.is_sleeping(resident.endpoint or "", self.timeouts.http_s)
        if asleep is not False:
            seen = "true" if asleep else "unknown"
            return False, f"{resident.signature} answered the wake but /is_sleeping is {seen}"
        return True, f"{resident.signature} awake and serving: {verdict.detail}; {bound.text()}"

    async def _resleep(self, run: _Run, twin: Resident, restore: _Restore) -> bool:
        """Put the resident this run tried to wake back to sleep; ``True`` once it is
        seen asleep (only then may paused victims take the memory back)."""
        assert twin.endpoint is not None
        config = config_of(self.host.registry(), twin)
        level = (config.sleep_level if config is not None else None) or 1
        asleep = await engines.is_sleeping(twin.endpoint, self.timeouts.http_s)
        if asleep is not True:
            try:
                await engines.sleep(twin.endpoint, level, self.timeouts.stop_s)
            except (engines.EngineError, ValueError) as err:
                log.warning("%s: re-sleep of %s failed: %s", run.run_id, twin.signature, err)
            asleep = await engines.is_sleeping(twin.endpoint, self.timeouts.http_s)
        if asleep is True:
            run.record(ROLLBACK_SLEEP, True, f"{twin.signature} is asleep again (paused)")
            return True
        observed = f"{twin.signature} not seen asleep after the failed wake"
        run.record(ROLLBACK_SLEEP, False, f"{observed}: the paused victims stay paused")
        restore.problems.append(observed)
        restore.blocker = observed
        return False

    async def _rewake_victims(self, run: _Run, restore: _Restore, safe: bool) -> None:
        """Wake every victim this run paused (or tried to), each with its verify-up."""
        registry = self.host.registry()
        for victim in run.paused:
            unit = unit_of(victim) or victim.signature
            if not safe:
                why = f"left paused: {restore.blocker}"
                run.record(ROLLBACK_WAKE, False, f"{victim.signature} {why}")
                restore.fail(unit, why)
                continue
            assert victim.endpoint is not None
            config = config_of(registry, victim)
            bound = self.timeouts.wake_bound(victim.signature, config, self.timeouts.rollback_up_s)
            try:
                if await engines.is_sleeping(victim.endpoint, self.timeouts.http_s) is not False:
                    await engines.wake(victim.endpoint, bound.seconds)
            except engines.EngineError as err:
                why = f"{victim.signature}: wake_up: {err}"
                run.record(ROLLBACK_WAKE, False, why)
                restore.fail(unit, why)
                continue
            model = registry.models.get(victim.model)
            if model is None:
                ok, detail = False, f"{victim.model} is no longer in the registry"
            else:
                ok, detail = await self._verify_awake(victim, model, config, None, bound)
            run.record(ROLLBACK_WAKE, ok, detail)
            if ok:
                restore.restored.add(unit)
            else:
                restore.fail(unit, detail)

    async def _pids_of(self, units: Iterable[str]) -> set[int]:
        pids: set[int] = set()
        for unit in units:
            try:
                pids.update(await self.units.pids(unit))
            except UnitError as err:
                log.warning("cannot list the processes of %s: %s", unit, err)
        return pids

    async def _verify_free(self, run: _Run, target: _Target) -> None:
        need = _free_need(target)
        bound = self.timeouts.verify_free_bound([self._victim_config(v) for v in target.victims])
        deadline = time.monotonic() + bound.seconds
        while True:
            readings = await self.host.read_devices()
            reading = readings.get(target.device)
            problem = self._free_problem(reading, target.device, need, run.victim_pids)
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
                orphans = await self._unexpected_processes(reading, target)
                raise run.fail(
                    VERIFY_FREE,
                    f"after {bound.seconds:g}s: {problem}; {orphans} ({bound.text()})",
                )
            await asyncio.sleep(self.timeouts.verify_free_poll_s)

    @staticmethod
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

    async def _unexpected_processes(self, reading: DeviceReading | None, target: _Target) -> str:
        """Every compute process on the device that is not a staying resident's."""
        if reading is None or not reading.processes:
            return "no compute process is listed on the device (the memory is unattributed)"
        victims = {resident_key(v) for v in target.victims}
        staying = [
            r.unit
            for r in self.host.residents()
            if r.device == target.device and resident_key(r) not in victims and r.unit
        ]
        expected = await self._pids_of(unit_file_name(u) for u in staying)
        unexpected = [p for p in reading.processes if p.pid not in expected]
        if not unexpected:
            return "every process on the device belongs to a staying resident"
        rows = processes_text(unexpected)
        return f"processes on {target.device} that are not an expected resident: {rows}"

    # ------------------------------------------------------------------ start / verify-up

    async def _start(self, run: _Run, target: _Target) -> None:
        unit = target.new_unit
        key = target.new_key
        assert unit is not None and key is not None
        self.marks.expect_unit(unit, key, run.run_id)
        run.started_unit = unit
        await self._journal_step(run, target, START)
        self._watch(unit)
        outcome = await self.units.start_unit(unit, self.timeouts.start_s)
        if not outcome.ok:
            state = await self._state_text(unit)
            raise run.fail(START, f"{unit}: start job {outcome_text(outcome)}; unit {state}")
        run.record(START, True, f"started {unit}")
        await self._journal_step(run, target, VERIFY_UP)

    async def _verify_up(self, run: _Run, target: _Target) -> None:
        unit = target.new_unit
        assert unit is not None and target.config is not None
        # Behind a single-upstream proxy, the address the proxy will use (issue 13).
        endpoint = verify_endpoint(
            target.model.endpoint_for(target.config), self.host.registry().single_upstream
        )
        label = f"{target.model.key}/{target.config.key}"
        bound = self.timeouts.verify_up_bound(label, target.config, self.timeouts.verify_up_s)
        run.verify_up_bound = bound
        healthy = await self._wait_up(unit, endpoint, bound.seconds)
        if healthy is not None:
            # The bound passed (or the unit went down): roll back at once, never wait more.
            raise run.fail(VERIFY_UP, f"{healthy}; {bound.text()}")
        if endpoint is None:
            run.record(
                VERIFY_UP,
                True,
                f"{unit} active; no endpoint in the registry to probe; {bound.text()}",
            )
            return
        problem = await self._served_problem(target, endpoint)
        if problem is not None:
            raise run.fail(VERIFY_UP, problem)
        policy = self.host.service_policy(target.model)
        checked = ""
        if policy is not None and policy.metrics_must_match:
            problem = await self._metrics_problem(policy, endpoint)
            if problem is not None:
                raise run.fail(VERIFY_UP, problem)
            checked = f"; metricsMustMatch {', '.join(policy.metrics_must_match)} as policy"
        run.record(
            VERIFY_UP,
            True,
            f"{unit} active, {endpoint} healthy, serves {target.requested}{checked}; "
            f"{bound.text()}",
        )

    async def _wait_up(self, unit: str, endpoint: str | None, limit: float) -> str | None:
        """Wait until ``unit`` is active and its ``/health`` is 200; ``None`` when it is,
        else why not. A unit that goes down ends the wait at once (:func:`verify.wait_up`)."""
        return await verify.wait_up(
            unit,
            endpoint,
            limit,
            changed=self._watch(unit),
            fresh_state=lambda: self._fresh_state(unit),
            cached_state=lambda: self._unit_states.get(unit),
            first_poll_s=self.timeouts.health_first_poll_s,
            max_poll_s=self.timeouts.health_max_poll_s,
            http_s=self.timeouts.http_s,
        )

    async def _served_problem(self, target: _Target, endpoint: str) -> str | None:
        """``/v1/models`` must list the requested id, the model, its config or an advertised id."""
        expect = verify.expectation(target.model, target.config, target.requested)
        return await verify.served_problem(endpoint, expect, self.timeouts.http_s)

    async def _metrics_problem(self, policy: ServicePolicy, endpoint: str) -> str | None:
        """The capacity policy's ``metricsMustMatch`` against the engine's ``/metrics``."""
        return await verify.metrics_problem(policy, endpoint, self.timeouts.http_s)

    # ------------------------------------------------------------------ refresh / resolve

    async def _refresh_proxy(self, run: _Run) -> None:
        if self.refresher is None:
            run.record(REFRESH_PROXY, True, "skipped: no proxy configured")
            return
        try:
            ok, detail = await self.refresher.refresh()
        except Exception as err:  # not fatal: the swap itself succeeded
            ok, detail = False, f"{type(err).__name__}: {err}"
        run.record(REFRESH_PROXY, ok, detail if ok else f"{detail} (not fatal)")

    def _resolve(self, run: _Run, target: _Target) -> None:
        self.marks.clear_run(run.run_id)
        registry = self.host.registry()
        for victim in target.stopping:
            self.host.drop_resident(victim)
        for victim in target.pausing:
            self.host.put_resident(paused_resident(registry, victim))
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
                since=iso(self._clock()),
                holders=(),
            )
        elif served is None and target.config is not None:
            served = self._new_resident(target, target.config)
        # Resolve before publishing the resident: publishing would resolve them as
        # "forwarded", and these entries were resolved by this enforcement.
        resolved: list[str] = []
        if target.entry is not None and self.host.resolve_entry(target.entry.id, APPLIED):
            resolved.append(target.entry.id)
        if served is not None:
            resolved += self.host.resolve_served(served, APPLIED)
            self.host.put_resident(served)
            parts.append(f"{served.signature} {served.state.value} on {served.device}")
        parts.append(
            f"resolved {', '.join(resolved)}" if resolved else "no pending entry to resolve"
        )
        run.record(RESOLVE, True, "; ".join(parts))

    def _new_resident(self, target: _Target, config: Config) -> Resident:
        unit_state = self._unit_states.get(target.new_unit or "")
        return Resident(
            model=target.model.key,
            config=config.key,
            device=target.device,
            engine=target.model.engine,
            endpoint=target.model.endpoint_for(config),
            unit=target.new_unit,
            state=ResidentState.HOT,
            gpu_mib=config.resident_gpu_mib,
            host_rss_mib=config.host_rss_mib,
            since=iso(self._clock()),
            main_pid=(unit_state.main_pid or None) if unit_state is not None else None,
        )

    # ------------------------------------------------------------------ journal

    async def _journal_step(
        self, run: _Run, target: _Target, step: str, stopping: Sequence[str] = ()
    ) -> None:
        """Make the run's intent and progress durable before ``step`` changes units.

        A forward step that cannot be journaled fails (the run rolls back rather
        than change units a crash could not repair); a rollback step goes on
        regardless (undoing is never held back by the journal).
        """
        if self.journal is None:
            return
        try:
            await self.journal.record(self._run_record(run, target, step, stopping))
        except (OSError, ValueError, JournalError) as err:
            why = f"cannot write the enforcement journal {self.journal.path}: {err}"
            if step in (ROLLBACK_STOP, ROLLBACK_START, ROLLBACK_SLEEP, ROLLBACK_WAKE):
                log.error("%s %s: %s", run.run_id, step, why)
                return
            raise run.fail(step, why) from None

    def _run_record(
        self, run: _Run, target: _Target, step: str, stopping: Sequence[str]
    ) -> RunRecord:
        new = self._new_resident(target, target.config) if target.config is not None else None
        accepted = [target.requested, target.model.key, *target.model.advertises]
        if target.config is not None:
            accepted.append(target.config.key)
        failed = next((s for s in reversed(run.steps) if not s.ok), None)
        return RunRecord(
            run_id=run.run_id,
            kind=target.kind,
            requested=target.requested,
            device=target.device,
            placement_id=target.entry.id if target.entry is not None else None,
            victims=target.victims,
            new=new,
            accepted_ids=tuple(dict.fromkeys(accepted)),
            step=step,
            started_at=run.started_at,
            updated_at=self._clock(),
            stopped_units=tuple(dict.fromkeys([*run.stopped_units, *stopping])),
            started_unit=run.started_unit,
            detail=f"{failed.name}: {failed.detail}" if failed is not None else "",
            history=tuple(s.name for s in run.steps),
            victim_actions={
                v.signature: "pause" if v in target.pausing else "stop" for v in target.victims
            },
            paused=tuple(
                dict.fromkeys(
                    v.signature for v in (*run.paused, *(target.pausing if step == PAUSE else ()))
                )
            ),
            wake=target.wake,
        )

    async def _journal_clear(self, run: _Run) -> None:
        if self.journal is None:
            return
        try:
            await self.journal.clear()
        except OSError as err:  # recovery at the next start finds an ended run: no harm
            log.error("%s: cannot clear the enforcement journal: %s", run.run_id, err)

    # ------------------------------------------------------------------ rollback

    async def _rollback(
        self, run: _Run, target: _Target
    ) -> tuple[_Restore, tuple[RunningAfter, ...]]:
        """Undo what ``run`` did: what could not be restored, and what runs at the end."""
        restore = _Restore()
        safe = True
        if run.started_unit is not None:
            await self._journal_step(run, target, ROLLBACK_STOP)
            safe = await self._stop_started(run, target, restore)
        if run.woke and target.wake is not None:
            await self._journal_step(run, target, ROLLBACK_SLEEP)
            safe = await self._resleep(run, target.wake, restore) and safe
        if run.stopped_units:
            if safe:
                await self._journal_step(run, target, ROLLBACK_START)
                await self._restart_victims(run, target, restore)
            else:
                self._leave_victims_down(run, restore)
        if run.paused:
            if safe:
                await self._journal_step(run, target, ROLLBACK_WAKE)
            await self._rewake_victims(run, restore, safe)
        running = await self._running_after(run, target)
        self._clear(run, restore.restored, running)
        return restore, running

    async def _stop_started(self, run: _Run, target: _Target, restore: _Restore) -> bool:
        """Stop the unit this run started; ``True`` once it is *seen* not running.

        The stop job's result alone does not decide: a unit that does not exist
        (the stop job errors) or is ``inactive``/``failed`` anyway is safe, and the
        victims are restarted. Only a unit observed still up, or whose state cannot
        be read, keeps them down (two residents must never share the device).
        """
        unit = run.started_unit
        assert unit is not None
        outcome = await self.units.stop_unit(unit, self.timeouts.stop_s)
        state = await self._fresh_state(unit)
        job = outcome_text(outcome)
        if state is not None and state.active_state in _DOWN_STATES:
            seen = (
                "does not exist" if state.load_state == "not-found" else f"is {state_text(state)}"
            )
            run.record(
                ROLLBACK_STOP,
                True,
                f"{unit}, which this run started, {seen} (stop job {job}): nothing of it runs",
            )
            if target.new_key is not None:
                stale = next(
                    (r for r in self.host.residents() if resident_key(r) == target.new_key), None
                )
                if stale is not None:
                    self.host.drop_resident(stale)
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

    def _leave_victims_down(self, run: _Run, restore: _Restore) -> None:
        units = list(dict.fromkeys(run.stopped_units))
        why = f"not restarted: {restore.blocker}"
        for unit in units:
            restore.unrestored[unit] = why
        run.record(ROLLBACK_START, False, f"{', '.join(units)} {why}")

    async def _restart_victims(self, run: _Run, target: _Target, restore: _Restore) -> None:
        """Start every victim unit this run stopped, each with its own verify-up."""
        for unit in dict.fromkeys(run.stopped_units):
            victim = next((v for v in target.victims if unit_of(v) == unit), None)
            label = victim.signature if victim is not None else unit
            outcome = await self.units.start_unit(unit, self.timeouts.start_s)
            if not outcome.ok:
                state = await self._state_text(unit)
                why = f"{unit}: start job {outcome_text(outcome)}; unit {state}"
                run.record(ROLLBACK_START, False, why)
                restore.fail(unit, why)
                continue
            run.record(ROLLBACK_START, True, f"restarted {unit} ({label})")
            ok, detail = await self._verify_victim(unit, victim)
            run.record(ROLLBACK_VERIFY, ok, detail)
            if ok:
                restore.restored.add(unit)
            else:
                restore.fail(unit, detail)

    async def _verify_victim(self, unit: str, victim: Resident | None) -> tuple[bool, str]:
        """The victim's own verify-up: health, served id, metrics policy; bounded by its
        config's start facts (:meth:`Timeouts.verify_up_bound`, ``rollback_up_s`` else)."""
        if victim is None:
            bound = UpBound(self.timeouts.rollback_up_s, "default rollback_up_s")
            why = await self._wait_up(unit, None, bound.seconds)
            return why is None, why or f"{unit} active again; {bound.text()}"
        model = self.host.registry().models.get(victim.model)
        config = model.configs.get(victim.config) if model is not None else None
        bound = self.timeouts.verify_up_bound(victim.signature, config, self.timeouts.rollback_up_s)
        if model is not None:
            expect = verify.expectation(model, config, None, self.host.service_policy(model))
        else:
            accepted = frozenset({victim.model, victim.config})
            expect = verify.Expectation(victim.model, victim.model, accepted)
        verdict = await verify.verify_up(
            unit,
            victim.endpoint,
            expect,
            bound.seconds,
            changed=self._watch(unit),
            fresh_state=lambda: self._fresh_state(unit),
            cached_state=lambda: self._unit_states.get(unit),
            first_poll_s=self.timeouts.health_first_poll_s,
            max_poll_s=self.timeouts.health_max_poll_s,
            http_s=self.timeouts.http_s,
        )
        if verdict.ok:
            return True, f"{victim.signature} healthy again: {verdict.detail}; {bound.text()}"
        return False, f"{verdict.detail}; {bound.text()}"

    def _clear(self, run: _Run, restored: set[str], running: Sequence[RunningAfter]) -> None:
        """Clear this run's marks; put back the victims that run, drop the ones that do not."""
        cleared = self.marks.clear_run(run.run_id)
        stopped = set(run.stopped_units)
        paused = {resident_key(v) for v in run.paused}
        registry = self.host.registry()
        for victim in run.victims:
            unit = unit_of(victim)
            if unit in stopped and unit not in restored:
                self.host.drop_resident(victim)
            elif resident_key(victim) in paused and unit not in restored:
                # Still resident, asleep: never published as serving (issue 12).
                self.host.put_resident(paused_resident(registry, victim))
            else:
                self.host.put_resident(victim)
        names = ", ".join(f"{m}/{c}" for m, c, _ in cleared) or "none"
        now = ", ".join(r.text() for r in running) or "nothing"
        run.record(ROLLBACK_CLEAR, True, f"draining marks cleared ({names}); running now: {now}")

    # ------------------------------------------------------------------ the end of a run

    def _devices(self, target: _Target) -> list[str]:
        return sorted({target.device, *(v.device for v in target.victims)})

    def _published(self, target: _Target) -> tuple[RunningAfter, ...]:
        """After a successful run: the residents on its device(s), as published."""
        devices = self._devices(target)
        return tuple(
            RunningAfter(r.model, r.config, r.device, unit_of(r), r.state.value)
            for r in self.host.residents()
            if r.device in devices
        )

    async def _running_after(self, run: _Run, target: _Target) -> tuple[RunningAfter, ...]:
        """After a failed run: what runs on its device(s), read from systemd now.

        Residents there, the victims and the new unit; a unit ``inactive`` or
        ``failed`` is not running; one whose state cannot be read is listed as
        ``state unknown`` (never assumed gone).
        """
        devices = self._devices(target)
        seen: dict[tuple[str, str, str], str | None] = {}
        for resident in [*self.host.residents(), *target.victims]:
            if resident.device in devices:
                seen.setdefault(
                    (resident.model, resident.config, resident.device), unit_of(resident)
                )
        if target.config is not None and target.new_unit is not None:
            seen.setdefault((target.model.key, target.config.key, target.device), target.new_unit)
        out: list[RunningAfter] = []
        for (model, config, device), unit in seen.items():
            if unit is None:
                out.append(RunningAfter(model, config, device, None, "published, no unit"))
                continue
            state = await self._fresh_state(unit)
            if state is not None and state.active_state in _DOWN_STATES:
                continue
            text = state_text(state) if state is not None else "state unknown"
            out.append(RunningAfter(model, config, device, unit, text))
        return tuple(out)

    def _alert_incomplete(
        self,
        run: _Run,
        target: _Target,
        failure: _StepFailed,
        restore: _Restore,
        running: Sequence[RunningAfter],
    ) -> None:
        """One critical ``rollback_incomplete`` alert per device left emptier than before."""
        lost_by_device: dict[str, list[Resident]] = {}
        for victim in run.victims:
            if unit_of(victim) in restore.unrestored:
                lost_by_device.setdefault(victim.device, []).append(victim)
        if not lost_by_device:  # nothing lost, but the new unit could not be stopped
            lost_by_device[target.device] = []
        for device, lost in sorted(lost_by_device.items()):
            self._raise_safely(
                AlertKind.ROLLBACK_INCOMPLETE,
                Severity.CRITICAL,
                device,
                _incomplete_message(run, device, failure, restore, lost, running),
                {
                    "runId": run.run_id,
                    "run": run.what,
                    "placementId": target.entry.id if target.entry is not None else None,
                    "failedStep": failure.step,
                    "failure": failure.detail,
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

    def _alert_unattended(
        self, run: _Run, target: _Target, result: EnforcementResult, origin: str | None
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
        self._raise_safely(
            AlertKind.ENFORCEMENT_FAILED,
            Severity.WARNING,
            target.requested,
            f"{origin}: {run.what} {how}: {result.error}. Running now: {running}.",
            {
                "runId": run.run_id,
                "run": run.what,
                "origin": origin,
                "error": result.error,
                "runningAfter": [r.to_json() for r in result.running_after or ()],
            },
        )

    def _raise_safely(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any],
    ) -> None:
        try:
            self.host.raise_alert(kind, severity, subject, message, detail)
        except Exception:  # the run's result still reports it; never lose the run for this
            log.exception("could not raise the %s alert for %s: %s", kind.value, subject, message)

    def _release_marks(self, run: _Run) -> None:
        """Whatever happened (cancellation included), no mark outlives its run."""
        leaked = self.marks.clear_run(run.run_id)
        for key in leaked:
            current = next((r for r in self.host.residents() if resident_key(r) == key), None)
            original = next((v for v in run.victims if resident_key(v) == key), None)
            if current is not None and original is not None:
                self.host.put_resident(replace(current, state=original.state))

    # ------------------------------------------------------------------ unit states

    def _on_unit_change(self, unit: str, state: UnitState) -> None:
        self._unit_states[unit] = state
        event = self._unit_events.get(unit)
        if event is not None:
            event.set()

    def _watch(self, unit: str) -> asyncio.Event:
        return self._unit_events.setdefault(unit, asyncio.Event())

    async def _fresh_state(self, unit: str) -> UnitState | None:
        try:
            state = await self.units.state(unit)
        except UnitError as err:
            log.warning("cannot read the state of %s: %s", unit, err)
            return None
        self._unit_states[unit] = state
        return state

    async def _state_text(self, unit: str) -> str:
        state = await self._fresh_state(unit)
        return state_text(state) if state is not None else "state unknown"


# --------------------------------------------------------------------------- rollback


@dataclass
class _Restore:
    """What a rollback could not put back."""

    restored: set[str] = field(default_factory=set)
    """Victim units running and verified again."""
    unrestored: dict[str, str] = field(default_factory=dict)
    """Victim unit → why it is not running verified."""
    problems: list[str] = field(default_factory=list)
    """Every observed problem, in order (the ``ROLLBACK INCOMPLETE: …`` text)."""
    blocker: str = ""
    """Why the victims were not restarted at all (the new unit seen still up)."""

    @property
    def complete(self) -> bool:
        return not self.problems

    def fail(self, unit: str, why: str) -> None:
        self.unrestored[unit] = why
        self.problems.append(why)


def _unattended(target: _Target, wait: bool, origin: str | None) -> str | None:
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


def _incomplete_message(
    run: _Run,
    device: str,
    failure: _StepFailed,
    restore: _Restore,
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
    return (
        f"{ROLLBACK_INCOMPLETE} on {device}: {run.what} failed at {failure.step} "
        f"({failure.detail}) and could not restore {what}. {now}. Rollback is tried once, "
        "never looped: start the units by hand once the cause is fixed."
    )


# --------------------------------------------------------------------------- helpers


def _free_need(target: _Target) -> float:
    """MiB the device must show free before the start (or wake): the new config's cost;
    for a wake, less what the paused engine still holds (its residual)."""
    if target.config is None:
        return 0.0
    if target.wake is not None:
        return max(0.0, target.cost_mib - (target.wake.gpu_mib or 0.0))
    return target.cost_mib


def paused_resident(registry: Registry, victim: Resident) -> Resident:
    """``victim`` as the ledger holds it once paused: state ``paused``, the GPU MiB the
    sleeping engine keeps, host RSS grown by what a level-1 sleep offloads
    (:func:`uapplace.planner.pause_figures`)."""
    config = config_of(registry, victim)
    level = config.sleep_level if config is not None else None
    freed, grows = pause_figures(config, victim, level or 2)
    host = victim.host_rss_mib + grows if victim.host_rss_mib is not None else None
    return replace(
        victim,
        state=ResidentState.PAUSED,
        gpu_mib=max(0.0, (victim.gpu_mib or 0.0) - freed),
        host_rss_mib=host,
        holders=(),
    )


def _same_placement(a: Option, b: Option) -> bool:
    return (a.kind, a.model, a.config, a.device) == (b.kind, b.model, b.config, b.device)


def _option_text(option: Option) -> str:
    text = f"{option.kind.value} {option.model}/{option.config} on {option.device}"
    stopped = [f"{v.model}/{v.config}" for v in option.victims if v.action == "stop"]
    paused = [f"{v.model}/{v.config}" for v in option.victims if v.action == "pause"]
    if stopped:
        text += f", stopping {', '.join(stopped)}"
    if paused:
        text += f", pausing {', '.join(paused)}"
    return text
