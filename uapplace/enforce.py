"""Enforcement: the spec §4.6 sequence, one run at a time, with rollback.

Every ``Apply``, ``Load`` and ``Unload`` goes through one sequence of named
steps, each reported as it ends (``EnforcementStep(run_id, step, ok, detail)``)
and returned in the result (CONTRACT.md §4)::

    revalidate → mark-draining → drain → stop → verify-free → start → verify-up
               → refresh-proxy → resolve

- **revalidate** recomputes the options now (planner on fresh residents,
  readings and in-flight) and refuses with :class:`~uapplace.errors.Drifted`
  when the approved option is gone or its victim signature differs from what
  the operator approved ("victim set changed"). Nothing has been touched yet.
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

Rollback (any failure after revalidate): stop what this run started (two
same-device residents must never coexist, so the victims are restarted only
once it is confirmed stopped), restart the victims this run stopped and wait
until healthy, clear the marks. The result says ``rolled back`` or
``ROLLBACK INCOMPLETE: <observed state>``; rollback is tried once, never looped.

Concurrency: one run machine-wide. A second operator call while one runs gets
:class:`~uapplace.errors.Busy` at once (naming the running one), because a bus
call blocked for minutes would outlive every client timeout; background callers
(the auto runner) pass ``wait=True`` and queue behind it. Nothing here blocks
the loop: systemd work goes through :class:`~uapplace.units.UnitManager`, probes
run in a thread, HTTP is aiohttp.

Timeouts (:class:`Timeouts`) are **unvalidated defaults** (spec §4.3: "the
timeouts have an envelope nobody has measured"): conservative guesses until a
planned switch on the real machine measures the envelope. Override any of them
in ``$UAP_HOME/enforcement-timeouts.json`` (:meth:`Timeouts.load`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from uapplace import engines
from uapplace.capacity import ServicePolicy
from uapplace.errors import Busy, Drifted, Failed, InvalidArgument, NotFound, UnknownModel
from uapplace.measure import Measurer
from uapplace.model import (
    DEFAULT_CELLS,
    Config,
    DeviceReading,
    Holder,
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
)
from uapplace.planner import PlanInput, plan
from uapplace.registry import ConfigFileError, read_json, unit_file_name, valid_unit_name
from uapplace.units import JobOutcome, UnitError, UnitManager, UnitState
from uapplace.unitsync import EnforcementMarks, ResidentKey, UnitSync, resident_key

if TYPE_CHECKING:
    from uapplace.controller import Controller
    from uapplace.paths import Paths

log = logging.getLogger(__name__)

REVALIDATE = "revalidate"
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

ROLLED_BACK = "rolled back"
ROLLBACK_INCOMPLETE = "ROLLBACK INCOMPLETE"
APPLIED = "applied"

HEALTH_BACKOFF = 1.5
"""Growth of the pause between two ``/health`` polls (from ``health_first_poll_s``)."""
_DOWN_STATES = frozenset({"failed", "inactive"})


# --------------------------------------------------------------------------- timeouts


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the sequence, in seconds. **Unvalidated defaults**: nobody has
    measured this machine's teardown/start envelope yet (spec §4.3, §4.6)."""

    drain_s: float = 60.0
    """How long in-flight work and holds may take to finish before rolling back."""
    drain_poll_s: float = 0.25
    """Pause between two in-flight checks (≤ 250 ms)."""
    stop_s: float = 90.0
    """A stop job's deadline (systemd's own ``TimeoutStopSec`` default)."""
    verify_free_s: float = 15.0
    """How long freed memory may take to show in the probe after the stop."""
    verify_free_poll_s: float = 0.1
    start_s: float = 90.0
    """The start job's deadline (``Type=simple`` units finish it at fork)."""
    verify_up_s: float = 600.0
    """Load time: from the start job until ``/health`` is 200. Large models are slow."""
    health_first_poll_s: float = 0.05
    health_max_poll_s: float = 0.1
    """The pause between ``/health`` polls grows ×1.5 from 50 ms to this: a local GET
    is cheap, and every 100 ms of pause is up to 100 ms added to a swap."""
    http_s: float = 2.0
    """One engine probe (``/health``, ``/v1/models``, ``/metrics``)."""
    rollback_up_s: float = 600.0
    """How long a restarted victim may take to turn healthy again."""

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"Timeouts.{item.name}: must be a positive number, got {value!r}")

    @classmethod
    def load(cls, path: Path | None) -> Timeouts:
        """Defaults, overridden by the JSON object in ``path`` when that file exists.

        Raises :class:`~uapplace.registry.ConfigFileError` naming the file and key
        for a bad file (unknown key, not a positive number).
        """
        if path is None or not path.exists():
            return cls()
        raw = read_json(path)
        try:
            doc = _TimeoutsDoc.model_validate(raw)
        except ValidationError as err:
            first = err.errors(include_url=False)[0]
            where = "$" + "".join(f".{part}" for part in first["loc"])
            raise ConfigFileError(path, where, str(first["msg"])) from None
        return cls(**doc.model_dump(exclude_none=True))

    def to_json(self) -> dict[str, float]:
        return {item.name: getattr(self, item.name) for item in fields(self)}


class _TimeoutsDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    drain_s: float | None = Field(default=None, gt=0)
    drain_poll_s: float | None = Field(default=None, gt=0, le=0.25)
    stop_s: float | None = Field(default=None, gt=0)
    verify_free_s: float | None = Field(default=None, gt=0)
    verify_free_poll_s: float | None = Field(default=None, gt=0)
    start_s: float | None = Field(default=None, gt=0)
    verify_up_s: float | None = Field(default=None, gt=0)
    health_first_poll_s: float | None = Field(default=None, gt=0, le=0.05)
    health_max_poll_s: float | None = Field(default=None, gt=0)
    http_s: float | None = Field(default=None, gt=0)
    rollback_up_s: float | None = Field(default=None, gt=0)


# --------------------------------------------------------------------------- the host


class EnforcementHost(Protocol):
    """The narrow view of the controller that enforcement needs.

    :class:`ControllerHost` implements it over :class:`~uapplace.controller.Controller`;
    a test can implement it over plain lists.
    """

    def registry(self) -> Registry:
        """The registry in force now."""
        ...

    def residents(self) -> Sequence[Resident]:
        """The residents now, without holders."""
        ...

    def pending(self, placement_id: str) -> PendingEntry | None: ...

    async def plan_input(self) -> PlanInput:
        """Fresh readings and the residents with their holders (bus holds + in-flight)."""
        ...

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """The proxy's in-flight requests per target id; ``None`` = unknown = busy."""
        ...

    def holds(self, resident: Resident) -> Sequence[Holder]:
        """The bus holds on this resident."""
        ...

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        """A fresh probe of every device (runs the blocking probe in a thread)."""
        ...

    def service_policy(self, model: Model) -> ServicePolicy | None:
        """The capacity policy's service entry for ``model`` (its ``service`` name)."""
        ...

    def put_resident(self, resident: Resident) -> None:
        """Add or replace (same model/config/device); emits ``ResidentChanged``."""
        ...

    def drop_resident(self, resident: Resident) -> None:
        """Remove it if present; emits ``ResidentChanged(…, "gone")``."""
        ...

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        """Resolve every pending entry ``resident`` serves with ``outcome``; their ids."""
        ...

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        """Resolve one pending entry (if still there) with ``outcome``."""
        ...

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        """One ``EnforcementStep`` signal."""
        ...


class ProxyRefresher(Protocol):
    async def refresh(self) -> tuple[bool, str]: ...


class ControllerHost:
    """:class:`EnforcementHost` over the daemon's :class:`~uapplace.controller.Controller`."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def registry(self) -> Registry:
        return self.controller.load.registry

    def residents(self) -> Sequence[Resident]:
        return tuple(self.controller.residents)

    def pending(self, placement_id: str) -> PendingEntry | None:
        return self.controller.admission.get(placement_id, time.time())

    async def plan_input(self) -> PlanInput:
        inp, _clients = await self.controller.plan_input()
        return inp

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        proxy = self.controller.proxy
        if proxy is None:
            return None
        try:
            return await proxy.inflight()
        except Exception as err:  # unknown counts as busy; never guess idle
            log.warning("proxy in-flight list unavailable: %s", err)
            return None

    def holds(self, resident: Resident) -> Sequence[Holder]:
        return [
            hold.holder()
            for hold in self.controller.holds.values()
            if hold.model in (resident.model, resident.config)
        ]

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return await asyncio.to_thread(self.controller.probe.read)

    def service_policy(self, model: Model) -> ServicePolicy | None:
        policy = self.controller.policy
        if policy is None or model.service is None:
            return None
        return policy.services.get(model.service)

    def put_resident(self, resident: Resident) -> None:
        current = self.controller.resident(resident.model, resident.config, resident.device)
        if current is not None and _same_publication(current, resident):
            return
        self.controller.upsert_resident(resident)

    def drop_resident(self, resident: Resident) -> None:
        self.controller.drop_resident(resident.model, resident.config, resident.device)

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        entries = self.controller.admission.resolved_by(resident)
        for entry in entries:
            self.controller.resolve(entry, outcome)
        return [e.id for e in entries]

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        entry = self.controller.admission.get(placement_id)
        if entry is None:
            return False
        self.controller.resolve(entry, outcome)
        return True

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.controller.emit_step(run_id, step, ok, detail)


def _same_publication(a: Resident, b: Resident) -> bool:
    """Equal for everything a ``ResidentChanged`` or the ledger would show."""
    return replace(a, since=b.since, holders=b.holders) == b


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
        return out


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
    """``["m/c", …]`` or objects with ``.signature`` → a sorted tuple; ``None`` stays."""
    if expected is None:
        return None
    out = [item if isinstance(item, str) else item.signature for item in expected]
    return tuple(sorted(out))


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
    ) -> None:
        self.host = host
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

    async def apply(
        self,
        entry: PendingEntry | str,
        option: int,
        expected: ExpectedVictims | None = None,
        *,
        wait: bool = False,
    ) -> dict[str, Any]:
        """Enforce option ``option`` (1-based) of a pending entry.

        ``expected`` is the approval signature (``model/config`` of every victim,
        or objects with ``.signature``); ``None`` compares against the victims of
        the stored option the index names, i.e. what ``ListPending`` showed.
        Raises ``NotFound``/``InvalidArgument`` for a bad id or index, ``Drifted``
        when revalidation refuses, ``Busy`` when another run is in progress and
        ``wait`` is false. Returns the result JSON otherwise (``ok`` false after a
        rollback).
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

        result = await self._enforce(what, revalidate, found.id, wait)
        return result.to_json()

    async def load(
        self, model: str, *, cells: int = DEFAULT_CELLS, wait: bool = False
    ) -> dict[str, Any]:
        """Load ``model`` with the planner's recommended option (operator-initiated).

        The recommended option may displace residents: ``Load`` is the operator's
        explicit request, and the CLI shows the preview before it asks.
        """

        async def revalidate(run: _Run) -> _Target:
            return await self._revalidate_load(run, model, cells)

        result = await self._enforce(f"load {model}", revalidate, None, wait)
        return result.to_json()

    async def unload(self, model: str, *, wait: bool = False) -> dict[str, Any]:
        """Stop every resident serving ``model`` (drain first, rollback on failure)."""

        async def revalidate(run: _Run) -> _Target:
            return await self._revalidate_unload(run, model)

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
    ) -> EnforcementResult:
        if self._lock.locked() and not wait:
            raise Busy(
                f"another enforcement is running ({self._running}); one runs at a time "
                "machine-wide: retry when it has finished"
            )
        async with self._lock:
            run = _Run(run_id=f"run-{secrets.token_hex(4)}", what=what, host=self.host)
            self._running = f"{run.run_id} ({what})"
            try:
                target = await revalidate(run)
                return await self._sequence(run, target, placement_id)
            finally:
                self._release_marks(run)
                self._running = None

    async def _sequence(
        self, run: _Run, target: _Target, placement_id: str | None
    ) -> EnforcementResult:
        if target.reuse is not None:
            self._resolve(run, target)
            return EnforcementResult(True, run.run_id, placement_id, tuple(run.steps))
        try:
            self._mark_draining(run, target)
            await self._drain(run, target)
            await self._stop(run, target)
            await self._verify_free(run, target)
            if target.new_unit is not None:
                await self._start(run, target)
                await self._verify_up(run, target)
        except _StepFailed as failure:
            complete, observed = await self._rollback(run, target)
            error = f"{failure.step}: {failure.detail}"
            if complete:
                error += f"; {ROLLED_BACK}"
            else:
                error += f"; {ROLLBACK_INCOMPLETE}: {observed}"
            return EnforcementResult(
                False, run.run_id, placement_id, tuple(run.steps), rolled_back=complete, error=error
            )
        await self._refresh_proxy(run)
        self._resolve(run, target)
        return EnforcementResult(True, run.run_id, placement_id, tuple(run.steps))

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

    async def _revalidate_load(self, run: _Run, model: str, cells: int) -> _Target:
        registry = self.host.registry()
        if registry.resolve(model) is None:
            raise self._refuse(run, UnknownModel(f"model {model!r} is in no registry file"))
        fresh = await self._fresh_plan(model, cells)
        if not fresh.options:
            why = "; ".join(fresh.infeasible) or fresh.reason.value
            raise self._refuse(run, Failed(f"no way to load {model} now: {why}"))
        chosen = fresh.options[0]
        if chosen.kind is OptionKind.REUSE:
            return self._reuse_target(run, model, chosen, None)
        return self._option_target(run, "load", model, chosen, None)

    async def _revalidate_unload(self, run: _Run, model: str) -> _Target:
        registry = self.host.registry()
        resolved = registry.resolve(model)
        if resolved is None:
            raise self._refuse(run, UnknownModel(f"model {model!r} is in no registry file"))
        found = resolved[0]
        victims = tuple(r for r in self.host.residents() if r.model == found.key)
        if not victims:
            raise self._refuse(run, NotFound(f"{found.key} is not resident: nothing to unload"))
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
        wanted = {v.signature for v in option.victims}
        victims = tuple(
            r for r in self.host.residents() if r.signature in wanted and r.device == option.device
        )
        if len(victims) != len(wanted):
            raise self._refuse(run, Drifted("a victim is no longer resident; look at the preview"))
        self._check_victim_units(run, victims)
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
            new_unit=unit_file_name(unit),
            entry=entry,
        )

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
        deadline = started + self.timeouts.drain_s
        while True:
            busy = await self._busy(target.victims)
            if not busy:
                waited = time.monotonic() - started
                run.record(DRAIN, True, f"no in-flight work or holds (waited {waited:.2f}s)")
                return
            if time.monotonic() >= deadline:
                raise run.fail(
                    DRAIN,
                    f"still busy after {self.timeouts.drain_s:g}s: {'; '.join(busy)} "
                    "(nothing was cut off)",
                )
            await asyncio.sleep(
                min(self.timeouts.drain_poll_s, max(0.0, deadline - time.monotonic()))
            )

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
        units = _units_of(target.victims)
        if not units:
            run.record(STOP, True, "no victims")
            return
        run.victim_pids = frozenset(await self._pids_of(units))
        for unit in units:
            run.stopped_units.append(unit)
            outcome = await self.units.stop_unit(unit, self.timeouts.stop_s)
            if not outcome.ok:
                raise run.fail(STOP, f"{unit}: stop job {_outcome_text(outcome)}")
        run.record(STOP, True, f"stopped {', '.join(units)}")

    async def _pids_of(self, units: Iterable[str]) -> set[int]:
        pids: set[int] = set()
        for unit in units:
            try:
                pids.update(await self.units.pids(unit))
            except UnitError as err:
                log.warning("cannot list the processes of %s: %s", unit, err)
        return pids

    async def _verify_free(self, run: _Run, target: _Target) -> None:
        need = target.cost_mib if target.config is not None else 0.0
        deadline = time.monotonic() + self.timeouts.verify_free_s
        while True:
            readings = await self.host.read_devices()
            reading = readings.get(target.device)
            problem = self._free_problem(reading, target.device, need, run.victim_pids)
            if problem is None:
                assert reading is not None
                what = f"{need:,.0f} MiB needed" if need else "victims released their memory"
                run.record(
                    VERIFY_FREE, True, f"{target.device}: {reading.free_mib:,.0f} MiB free, {what}"
                )
                return
            if time.monotonic() >= deadline:
                orphans = await self._unexpected_processes(reading, target)
                raise run.fail(
                    VERIFY_FREE,
                    f"after {self.timeouts.verify_free_s:g}s: {problem}; {orphans}",
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
        rows = "; ".join(
            f"pid {p.pid} `{p.command or '?'}` {p.used_mib:,.0f} MiB" for p in unexpected
        )
        return f"processes on {target.device} that are not an expected resident: {rows}"

    # ------------------------------------------------------------------ start / verify-up

    async def _start(self, run: _Run, target: _Target) -> None:
        unit = target.new_unit
        key = target.new_key
        assert unit is not None and key is not None
        self.marks.expect_unit(unit, key, run.run_id)
        run.started_unit = unit
        self._watch(unit)
        outcome = await self.units.start_unit(unit, self.timeouts.start_s)
        if not outcome.ok:
            state = await self._state_text(unit)
            raise run.fail(START, f"{unit}: start job {_outcome_text(outcome)}; unit {state}")
        run.record(START, True, f"started {unit}")

    async def _verify_up(self, run: _Run, target: _Target) -> None:
        unit = target.new_unit
        assert unit is not None and target.config is not None
        endpoint = target.model.endpoint_for(target.config)
        healthy = await self._wait_up(unit, endpoint, self.timeouts.verify_up_s)
        if healthy is not None:
            raise run.fail(VERIFY_UP, healthy)
        if endpoint is None:
            run.record(VERIFY_UP, True, f"{unit} active; no endpoint in the registry to probe")
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
            f"{unit} active, {endpoint} healthy, serves {target.requested}{checked}",
        )

    async def _wait_up(self, unit: str, endpoint: str | None, limit: float) -> str | None:
        """Wait until ``unit`` is active and its ``/health`` is 200; ``None`` when it is,
        else why not. A unit that goes down ends the wait at once."""
        started = time.monotonic()
        deadline = started + limit
        interval = self.timeouts.health_first_poll_s
        event = self._watch(unit)
        state = await self._fresh_state(unit)
        while True:
            event.clear()
            if state is not None and state.active_state in _DOWN_STATES:
                return f"{unit} went {_state_text(state)} while loading"
            if state is not None and state.active_state == "active":
                if endpoint is None:
                    return None
                remaining = deadline - time.monotonic()
                probe_s = max(0.05, min(self.timeouts.http_s, remaining))
                if await engines.health(endpoint, timeout_s=probe_s):
                    return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state_text = _state_text(state) if state is not None else "unknown"
                return f"{unit} not healthy after {limit:g}s (unit {state_text})"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), min(interval, remaining))
            interval = min(interval * HEALTH_BACKOFF, self.timeouts.health_max_poll_s)
            state = self._unit_states.get(unit) or await self._fresh_state(unit)

    async def _served_problem(self, target: _Target, endpoint: str) -> str | None:
        """``/v1/models`` must list the requested id, the model, its config or an advertised id."""
        try:
            served = await engines.served_ids(endpoint, timeout_s=self.timeouts.http_s)
        except engines.EngineError as err:
            return str(err)
        accepted = {target.requested, target.model.key, *target.model.advertises}
        if target.config is not None:
            accepted.add(target.config.key)
        if accepted.intersection(served):
            return None
        return (
            f"{endpoint} serves [{', '.join(served) or 'nothing'}], not {target.requested} "
            f"(nor any id {target.model.key} advertises)"
        )

    async def _metrics_problem(self, policy: ServicePolicy, endpoint: str) -> str | None:
        """The capacity policy's ``metricsMustMatch`` against the engine's ``/metrics``."""
        try:
            seen = await engines.metrics(endpoint, timeout_s=self.timeouts.http_s)
        except engines.EngineError as err:
            return f"metricsMustMatch of service {policy.name}: {err}"
        wrong = [
            f"{key} is {seen.get(key, 'missing')!r}, policy wants {want!r}"
            for key, want in policy.metrics_must_match.items()
            if not _metric_matches(want, seen.get(key))
        ]
        if wrong:
            return f"metricsMustMatch of service {policy.name}: {'; '.join(wrong)}"
        return None

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
        for victim in target.victims:
            self.host.drop_resident(victim)
        parts = []
        if target.victims:
            parts.append(f"removed {', '.join(v.signature for v in target.victims)}")
        served = target.reuse
        if served is None and target.config is not None:
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

    # ------------------------------------------------------------------ rollback

    async def _rollback(self, run: _Run, target: _Target) -> tuple[bool, str]:
        """Undo what ``run`` did. Returns (complete, observed state when not)."""
        problems: list[str] = []
        if run.started_unit is not None and not await self._stop_started(run, target, problems):
            # Restarting the victims now could put two residents on one device.
            self._clear(run, restarted=set())
            return False, "; ".join(problems)
        restarted = await self._restart_victims(run, target, problems)
        self._clear(run, restarted)
        return not problems, "; ".join(problems)

    async def _stop_started(self, run: _Run, target: _Target, problems: list[str]) -> bool:
        unit = run.started_unit
        assert unit is not None
        outcome = await self.units.stop_unit(unit, self.timeouts.stop_s)
        state = await self._fresh_state(unit)
        if outcome.ok and state is not None and state.active_state in _DOWN_STATES:
            run.record(ROLLBACK_STOP, True, f"stopped {unit}, which this run started")
            if target.new_key is not None:
                stale = next(
                    (r for r in self.host.residents() if resident_key(r) == target.new_key), None
                )
                if stale is not None:
                    self.host.drop_resident(stale)
            return True
        state_text = _state_text(state) if state is not None else "state unknown"
        observed = f"{unit} {state_text} (stop job {_outcome_text(outcome)})"
        run.record(ROLLBACK_STOP, False, observed)
        problems.append(f"{observed}; the victims were not restarted")
        return False

    async def _restart_victims(self, run: _Run, target: _Target, problems: list[str]) -> set[str]:
        """Start every victim unit this run stopped; the units that are healthy again."""
        healthy: set[str] = set()
        for unit in dict.fromkeys(run.stopped_units):
            outcome = await self.units.start_unit(unit, self.timeouts.start_s)
            if not outcome.ok:
                state = await self._state_text(unit)
                run.record(ROLLBACK_START, False, f"{unit}: start job {_outcome_text(outcome)}")
                problems.append(f"{unit} {state}")
                continue
            run.record(ROLLBACK_START, True, f"restarted {unit}")
            endpoint = next((v.endpoint for v in target.victims if _unit_of(v) == unit), None)
            why = await self._wait_up(unit, endpoint, self.timeouts.rollback_up_s)
            if why is None:
                run.record(ROLLBACK_VERIFY, True, f"{unit} healthy again")
                healthy.add(unit)
            else:
                run.record(ROLLBACK_VERIFY, False, why)
                problems.append(why)
        return healthy

    def _clear(self, run: _Run, restarted: set[str]) -> None:
        """Clear this run's marks; put back the victims that run, drop the ones that do not."""
        cleared = self.marks.clear_run(run.run_id)
        stopped = set(run.stopped_units)
        for victim in run.victims:
            unit = _unit_of(victim)
            if unit in stopped and unit not in restarted:
                self.host.drop_resident(victim)
            else:
                self.host.put_resident(victim)
        names = ", ".join(f"{m}/{c}" for m, c, _ in cleared) or "none"
        run.record(ROLLBACK_CLEAR, True, f"draining marks cleared ({names})")

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
        return _state_text(state) if state is not None else "state unknown"


# --------------------------------------------------------------------------- helpers


def _unit_of(resident: Resident) -> str | None:
    return unit_file_name(resident.unit) if resident.unit else None


def _units_of(residents: Iterable[Resident]) -> list[str]:
    return list(dict.fromkeys(u for u in (_unit_of(r) for r in residents) if u))


def _state_text(state: UnitState) -> str:
    text = f"{state.active_state}/{state.sub_state}"
    if state.result and state.result != "success":
        text += f" (result {state.result})"
    return text


def _outcome_text(outcome: JobOutcome) -> str:
    return f"{outcome.result}: {outcome.detail}" if outcome.detail else outcome.result


def _same_placement(a: Option, b: Option) -> bool:
    return (a.kind, a.model, a.config, a.device) == (b.kind, b.model, b.config, b.device)


def _option_text(option: Option) -> str:
    text = f"{option.kind.value} {option.model}/{option.config} on {option.device}"
    if option.victims:
        text += f", stopping {', '.join(option.signature)}"
    return text


def _metric_matches(want: str | int | float, seen: str | float | None) -> bool:
    if seen is None:
        return False
    if isinstance(want, int | float) and isinstance(seen, int | float):
        return float(want) == float(seen)
    return str(want).strip().lower() == str(seen).strip().lower()


# --------------------------------------------------------------------------- wiring


@dataclass
class EnforcementStack:
    """What :func:`attach_enforcement` built: close it when the daemon stops."""

    units: UnitManager
    enforcer: Enforcer
    sync: UnitSync
    measurer: Measurer
    controller: Controller

    async def reload(self) -> bool:
        """Re-read the registry (a bad one keeps the last good), then re-sync the units."""
        changed = await self.controller.reload()
        await self.sync.sync_all()
        return changed

    async def close(self) -> None:
        await self.sync.close()
        self.units.close()


async def attach_enforcement(
    controller: Controller,
    paths: Paths,
    refresher: ProxyRefresher | None,
    *,
    units: UnitManager | None = None,
    timeouts: Timeouts | None = None,
) -> EnforcementStack:
    """Connect to the user manager and give ``controller`` its enforcer and measurer.

    Residents then follow the units (:class:`~uapplace.unitsync.UnitSync`, synced
    once now). The controller gets its enforcer and measurer only once all of
    that has started. Raises :class:`~uapplace.units.UnitError` when the user
    manager is unreachable, :class:`~uapplace.registry.ConfigFileError` for a bad
    ``enforcement-timeouts.json``, and whatever the first sync raised; then
    ``controller`` gets no enforcer or measurer, the unit sync is closed and the
    :class:`~uapplace.units.UnitManager` this call made (not one passed in as
    ``units``) is closed.
    """
    if timeouts is None:
        timeouts = await asyncio.to_thread(Timeouts.load, paths.enforcement_timeouts)
    manager = units or UnitManager()
    host = ControllerHost(controller)
    marks = EnforcementMarks()
    enforcer = Enforcer(host, manager, timeouts=timeouts, refresher=refresher, marks=marks)
    sync = UnitSync(host, manager, marks, http_s=timeouts.http_s)

    async def after_measure() -> None:
        await controller.reload()
        await sync.sync_all()

    measurer = Measurer(paths, host, manager, http_s=timeouts.http_s, after_write=after_measure)
    try:
        await manager.connect()
        await sync.start()
    except BaseException:
        await sync.close()
        if units is None:
            manager.close()
        raise
    # Only now: a half-wired controller would accept an Apply it cannot see through.
    controller.enforcer = enforcer
    controller.measurer = measurer
    return EnforcementStack(manager, enforcer, sync, measurer, controller)
