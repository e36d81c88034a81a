"""One enforcement run's bookkeeping, the shapes of its result, and what its steps share.

Owned here (the step names are :mod:`uapplace.core.steps`'s): :class:`StepRecord`,
:class:`EnforcementResult` and :class:`RunningAfter` (docs/http-contract.md §4); :class:`Run`
(what a run touched, so the rollback knows what to undo), :class:`Target` (what it
does, once revalidated), :class:`Restore` (what a rollback could not put back); the
approval signature (:func:`normalize_signature`); and :class:`RunContext`, the
collaborators every step receives.

Why a context object and plain step functions rather than one class with
mixins: a step needs the host, the units, the engines, the timeouts and the
marks, and it changes only the :class:`Run` it is given. Passing both
explicitly (``step(ctx, run, target)``) keeps each step module readable on its
own and testable with fakes, with no hidden shared ``self``.

Called by :mod:`uapplace.enforce.enforcer` (the sequence driver), the step modules
(:mod:`uapplace.enforce.steps`, :mod:`uapplace.enforce.pause`,
:mod:`uapplace.enforce.rollback`), :mod:`uapplace.enforce.revalidate`, and by
:mod:`uapplace.recovery.repair` for :func:`paused_resident`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from uapplace.controller.ports import Signature
from uapplace.core.alerts import AlertKind, Severity
from uapplace.core.errors import Drifted
from uapplace.core.model import (
    Config,
    DeviceReading,
    Model,
    Option,
    PendingEntry,
    Registry,
    Resident,
    ResidentKey,
    ResidentState,
    iso,
    resident_key,
)
from uapplace.core.victims import config_of, pause_figures
from uapplace.enforce.host import EnforcementHost, ProxyRefresher
from uapplace.files.journal import Journal
from uapplace.files.timeouts import Timeouts, UpBound
from uapplace.io.router import HTTP_ROUTER, RouterProbe, RouterSlot
from uapplace.io.seams import EngineProbe, UnitControl
from uapplace.io.units import UnitError, UnitState, signalled_with_read, state_text
from uapplace.publish import verify
from uapplace.publish.unitsync import EnforcementMarks

log = logging.getLogger(__name__)

ROLLED_BACK = "rolled back"
ROLLBACK_INCOMPLETE = "ROLLBACK INCOMPLETE"
APPLIED = "applied"
FAILED_OUTCOME = "failed"
"""``Resolved`` outcome of the pending entry of a run whose rollback was incomplete."""


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
    """docs/http-contract.md §4: ``{ok, placementId, runId, steps, rolledBack?, error?}``."""

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


# --------------------------------------------------------------------------- a run


class StepFailed(Exception):
    """A step said no (already recorded): the driver rolls back."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"{step}: {detail}")
        self.step = step
        self.detail = detail


@dataclass
class Run:
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
    loaded: RouterSlot | None = None
    """The router model this run asked its router to load (the rollback unloads it
    first; docs/placement-rules.md §4.2, "What paused is")."""
    started_at: float = field(default_factory=time.time)
    verify_up_bound: UpBound | None = None
    """The verify-up wait this run used for its new unit, and why that long."""
    prefetched: PreflightReads | None = None
    """Preflight's reads, started while revalidate runs (``steps.prefetch_preflight``)."""
    journal_pending: asyncio.Future[str | None] | None = None
    """A progress record being written while a read-only step goes on
    (:func:`uapplace.enforce.journaling.journal_progress`): why it failed, or ``None``."""

    def record(self, step: str, ok: bool, detail: str) -> None:
        self.steps.append(StepRecord(step, ok, detail))
        log.info("enforcement %s %s %s: %s", self.run_id, step, "ok" if ok else "FAILED", detail)
        try:
            self.host.emit_step(self.run_id, step, ok, detail)
        except Exception:  # a signal that cannot be sent must not derail the sequence
            log.exception("could not emit EnforcementStep %s/%s", self.run_id, step)

    def fail(self, step: str, detail: str) -> StepFailed:
        self.record(step, False, detail)
        return StepFailed(step, detail)


@dataclass(frozen=True)
class PreflightReads:
    """Preflight's two reads for ``unit``, started early (issue 23): the unit's state, its
    read error and its ``ExecStart=`` binaries' problems; the host reading or why none."""

    unit: str
    unit_facts: asyncio.Future[tuple[UnitState | None, str, dict[str, str]]]
    host_facts: asyncio.Future[tuple[DeviceReading | None, str]]


@dataclass(frozen=True)
class Target:
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
    router: RouterSlot | None = None
    """Set when what starts (or wakes) is one model of a llama.cpp router: it is loaded
    in the router (``POST /models/load``), the router's unit started first only when it
    is not running, never restarted."""
    routed: frozenset[ResidentKey] = frozenset()
    """The victims that are router models: paused or stopped alike, their router unloads
    them in the ``pause`` step; their unit (the router, hosting its other models) is
    never stopped. A stopped one then leaves the ledger like any stopped victim."""

    @property
    def stopping(self) -> tuple[Resident, ...]:
        """The victims that leave the ledger: unit stops and router unloads."""
        return tuple(v for v in self.victims if resident_key(v) not in self.pause)

    @property
    def unit_stopping(self) -> tuple[Resident, ...]:
        """The victims whose unit the ``stop`` step stops (never a router's)."""
        return tuple(v for v in self.stopping if resident_key(v) not in self.routed)

    @property
    def unloading(self) -> tuple[Resident, ...]:
        """The victims their router unloads (the ``pause`` step), whatever the action."""
        return tuple(v for v in self.victims if resident_key(v) in self.routed)

    @property
    def sleeping(self) -> tuple[Resident, ...]:
        """The paused victims put to sleep by their engine (vLLM's lever)."""
        return tuple(v for v in self.pausing if resident_key(v) not in self.routed)

    @property
    def pausing(self) -> tuple[Resident, ...]:
        return tuple(v for v in self.victims if resident_key(v) in self.pause)

    @property
    def new_key(self) -> ResidentKey | None:
        if self.config is None:
            return None
        return (self.model.key, self.config.key, self.device)

    @property
    def label(self) -> str:
        """``model/config`` of what starts (or wakes); the model alone for an unload."""
        if self.config is None:
            return self.model.key
        return f"{self.model.key}/{self.config.key}"

    @property
    def devices(self) -> list[str]:
        """Every device the run touches, sorted (``runningAfter`` lists these)."""
        return sorted({self.device, *(v.device for v in self.victims)})


@dataclass
class Restore:
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


# --------------------------------------------------------------------------- collaborators


class UnitFollower:
    """The units as a run sees them: the last state the manager signalled for each, an
    event per unit a wait follows, and fresh reads that refresh both."""

    def __init__(
        self,
        units: UnitControl,
        timeouts: Timeouts,
        engines: EngineProbe,
        routers: RouterProbe = HTTP_ROUTER,
    ) -> None:
        self.units = units
        self.timeouts = timeouts
        self.engines = engines
        self.routers = routers
        self._states: dict[str, UnitState] = {}
        self._events: dict[str, asyncio.Event] = {}
        self._signalled: dict[str, int] = {}
        """Unit → how many changes the manager has signalled (to spot one mid-read)."""
        units.on_change(self._on_change)

    def _on_change(self, unit: str, state: UnitState) -> None:
        self._states[unit] = state
        self._signalled[unit] = self._signalled.get(unit, 0) + 1
        event = self._events.get(unit)
        if event is not None:
            event.set()

    def cached(self, unit: str) -> UnitState | None:
        return self._states.get(unit)

    def remember(self, unit: str, state: UnitState) -> None:
        self._states[unit] = state

    def watch(self, unit: str) -> asyncio.Event:
        """The event set on each change of ``unit`` (created on first use)."""
        return self._events.setdefault(unit, asyncio.Event())

    async def fresh(self, unit: str) -> UnitState | None:
        """Read ``unit`` from the manager now; ``None`` (logged) when it cannot be read.

        A change signalled while the read was in flight is newer than the read may be
        (:func:`~uapplace.io.units.signalled_with_read`): its fields win. Else a wait
        would go on from a stale ``active`` and miss a unit that had already failed
        (a llama-server that exits 1 within milliseconds of its start)."""
        before = self._signalled.get(unit, 0)
        try:
            state = await self.units.state(unit)
        except UnitError as err:
            log.warning("cannot read the state of %s: %s", unit, err)
            return None
        if self._signalled.get(unit, 0) != before:
            state = signalled_with_read(self._states[unit], state)
        self._states[unit] = state
        return state

    async def state_text(self, unit: str) -> str:
        state = await self.fresh(unit)
        return state_text(state) if state is not None else "state unknown"

    async def pids_of(self, units: Iterable[str]) -> set[int]:
        pids: set[int] = set()
        for unit in units:
            try:
                pids.update(await self.units.pids(unit))
            except UnitError as err:
                log.warning("cannot list the processes of %s: %s", unit, err)
        return pids

    def up_watch(self, unit: str) -> verify.UnitWatch:
        """How :func:`uapplace.publish.verify.wait_up` follows ``unit`` for a run."""
        return verify.UnitWatch(
            changed=self.watch(unit),
            fresh_state=lambda: self.fresh(unit),
            cached_state=lambda: self.cached(unit),
            first_poll_s=self.timeouts.health_first_poll_s,
            max_poll_s=self.timeouts.health_max_poll_s,
            http_s=self.timeouts.http_s,
            probe=self.engines,
            routers=self.routers,
        )


@dataclass(frozen=True)
class RunContext:
    """The collaborators every step of every run uses (built once by the Enforcer)."""

    host: EnforcementHost
    units: UnitControl
    engines: EngineProbe
    timeouts: Timeouts
    marks: EnforcementMarks
    follower: UnitFollower
    journal: Journal | None
    """Where each unit-changing step is recorded first (crash recovery); ``None``: nowhere."""
    refresher: ProxyRefresher | None
    clock: Callable[[], float]
    routers: RouterProbe = HTTP_ROUTER
    """llama.cpp routers' routes (the real HTTP one; the unit tier passes a fake)."""

    def victim_config(self, victim: Resident) -> tuple[str, Config | None]:
        """``(model/config, its registry config)`` for the envelope-derived bounds."""
        model = self.host.registry().models.get(victim.model)
        return victim.signature, model.configs.get(victim.config) if model else None

    def new_resident(self, target: Target, config: Config) -> Resident:
        """The resident a run that starts ``config`` publishes once it is verified."""
        unit_state = self.follower.cached(target.new_unit or "")
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
            since=iso(self.clock()),
            main_pid=(unit_state.main_pid or None) if unit_state is not None else None,
        )

    def raise_safely(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any],
    ) -> None:
        """``host.alert_board.raise_alert``, never raising: the run's result still reports it."""
        try:
            self.host.alert_board.raise_alert(kind, severity, subject, message, detail)
        except Exception:  # never lose the run for an alert
            log.exception("could not raise the %s alert for %s: %s", kind.value, subject, message)


def paused_resident(registry: Registry, victim: Resident) -> Resident:
    """``victim`` as the ledger holds it once paused: state ``paused``, the GPU MiB the
    sleeping engine keeps, host RSS grown by what a level-1 sleep offloads
    (:func:`uapplace.core.victims.pause_figures`); a router model, unloaded, holds
    nothing (its child process is gone). The start-up repair uses it too."""
    config = config_of(registry, victim)
    if config is not None and config.is_router_model:
        return replace(
            victim, state=ResidentState.PAUSED, gpu_mib=0.0, host_rss_mib=0.0, holders=()
        )
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


# --------------------------------------------------------------------------- the approval


def normalize_signature(expected: Signature | None) -> tuple[str, ...] | None:
    """``["m/c", …]`` → a sorted tuple; ``None`` stays.

    The signature is one type everywhere (bus ``as expected``, shim
    ``expected_victims``, notification buttons, auto and idle runs): the sorted
    ``model/config`` strings ``ListPending``/``Preview``/``PreviewUnload`` show.
    An empty one means "I approve stopping nothing": it is checked like any other.
    """
    if expected is None:
        return None
    return tuple(sorted(expected))


def signature_drift(approved: tuple[str, ...], now: Iterable[str]) -> Drifted | None:
    """``Drifted`` naming both lists when what would stop now is not what was approved."""
    current = tuple(sorted(now))
    if current == approved:
        return None
    return Drifted(
        f"victim set changed: approved [{', '.join(approved) or 'none'}], "
        f"now [{', '.join(current) or 'none'}]; look at the preview again"
    )


def option_signature_drift(option: Option, signature: tuple[str, ...]) -> Drifted | None:
    """``Drifted`` when ``signature`` is not the chosen option's own (issue 20).

    The index picks the option and the signature is the consent: they must name the same
    victims with the same actions, or the call approves something it did not choose
    (``Apply(ID, 1, ['coder/q4'])`` where option 1 pauses coder: never a stop)."""
    if option.signature == signature:
        return None
    return Drifted(
        f"victim set changed: approved [{', '.join(signature) or 'none'}], now "
        f"[{', '.join(option.signature) or 'none'}] for the chosen option "
        f"({option_text(option)}); look at the preview again"
    )


def same_placement(a: Option, b: Option) -> bool:
    return (a.kind, a.model, a.config, a.device) == (b.kind, b.model, b.config, b.device)


def option_text(option: Option) -> str:
    text = f"{option.kind.value} {option.model}/{option.config} on {option.device}"
    stopped = [f"{v.model}/{v.config}" for v in option.victims if v.action == "stop"]
    paused = [f"{v.model}/{v.config}" for v in option.victims if v.action == "pause"]
    if stopped:
        text += f", stopping {', '.join(stopped)}"
    if paused:
        text += f", pausing {', '.join(paused)}"
    return text
