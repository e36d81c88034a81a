"""Standing consent, part two: unattended loads for new parks (docs/placement-rules.md §4.4.1).

:class:`AutoRunner` turns a new park into at most one unattended enforcement per
requested model, single-flight machine-wide; see its docstring. The policy it obeys
is the file :mod:`uapplace.files.autopolicy` reads. The controller calls
:meth:`AutoRunner.schedule` for each new park once it is planned (``wiring`` hands
the runner over with the enforcer); the runner changes pending entries and
cooldowns only through the controller's API (:class:`AutoHost`), which persists them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from uapplace.controller.standing import Cooldowns
from uapplace.core.model import (
    Config,
    Option,
    OptionKind,
    ParkReason,
    PendingEntry,
    Plan,
    PreviewReason,
    Registry,
)
from uapplace.files.autopolicy import AutoPolicy, PolicySource
from uapplace.files.timeouts import Timeouts

log = logging.getLogger(__name__)

COOLDOWN_S = 600.0
"""After a failed unattended run (load or unload), automation leaves the model alone this long."""
MAX_SCHEDULED_RUNS = 2
"""Auto runs that may exist at once, the running one included (spec: AUTO_MAX_CONCURRENT_RUNS)."""
ENVELOPE_MARGIN_S = 30.0
"""Added to the enforcement envelope when extending a pending entry's expiry."""
DEFAULT_ENVELOPE_S = 60.0 + 90.0 + 15.0 + 90.0 + 600.0
"""drain + stop + verify-free + start + verify-up, the enforcer's default timeouts."""

NEVER_AUTO = frozenset(
    {
        ParkReason.UNKNOWN_MODEL,
        ParkReason.NO_MEASURED_CONFIG,
        ParkReason.INVALID_REQUEST,
        ParkReason.WARMING,
    }
)
"""Parks with nothing to enforce: their reason always stands (a ``warming`` resident
publishes itself once verify-up passes)."""
_NON_DISPLACING = frozenset({OptionKind.REUSE, OptionKind.LOAD_ALONGSIDE})


# --------------------------------------------------------------------------- the runner


class AutoHost(Protocol):
    """What the runner needs of the controller (``Controller`` has all of it); each
    change it makes persists itself."""

    @property
    def cooldowns(self) -> Cooldowns:
        """Model → POSIX seconds until which automation leaves it alone (in the ledger)."""
        ...

    def pending_entry(self, placement_id: str) -> PendingEntry | None: ...

    def replace_pending(self, entry: PendingEntry) -> None: ...

    def resolve_pending(
        self, entry: PendingEntry, outcome: str, already_removed: bool = False
    ) -> None: ...

    async def plan_for(self, model: str, cells: int) -> Plan:
        """Fresh options (the planner on the residents, readings, in-flight now)."""
        ...


class AutoEnforcer(Protocol):
    """``uapplace.enforce.enforcer.Enforcer`` (its ``apply`` takes the entry or its id)."""

    async def apply(
        self, entry: PendingEntry, option: int, expected: Sequence[str], *, wait: bool = False
    ) -> Mapping[str, Any]: ...


class EnvelopeTimeouts(Protocol):
    """The waits of one enforcement (``uapplace.files.timeouts.Timeouts`` has them)."""

    @property
    def drain_s(self) -> float: ...
    @property
    def stop_s(self) -> float: ...
    @property
    def verify_free_s(self) -> float: ...
    @property
    def start_s(self) -> float: ...
    @property
    def verify_up_s(self) -> float: ...


def enforcement_envelope_s(timeouts: EnvelopeTimeouts) -> float:
    """drain + stop + verify-free + start + verify-up: the longest a successful run takes."""
    return (
        timeouts.drain_s
        + timeouts.stop_s
        + timeouts.verify_free_s
        + timeouts.start_s
        + timeouts.verify_up_s
    )


def option_envelope_s(timeouts: Timeouts, registry: Registry, option: Option) -> float:
    """The longest a successful run of ``option`` takes, by the bounds enforcement itself
    uses for its configs (issue 21 item 8): the drain and verify-free bounds over the
    victims' envelopes, ``stop_s``, ``start_s``, and the verify-up bound of the config
    that starts (its envelope, measured start or ``start_timeout_s``), or its wake bound
    for a ``wake``; the defaults where a config records nothing
    (:class:`~uapplace.files.timeouts.Timeouts`)."""
    starting = (
        f"{option.model}/{option.config}",
        _config_of(registry, option.model, option.config),
    )
    victims = [(v.signature, _config_of(registry, v.model, v.config)) for v in option.victims]
    label, config = starting
    if option.kind is OptionKind.REUSE:
        up = 0.0
    elif option.kind is OptionKind.WAKE:
        up = timeouts.wake_bound(label, config, timeouts.verify_up_s).seconds
    else:
        up = timeouts.verify_up_bound(label, config, timeouts.verify_up_s).seconds
    return (
        timeouts.drain_bound(starting, victims).seconds
        + (timeouts.stop_s if victims else 0.0)
        + timeouts.verify_free_bound(victims).seconds
        + timeouts.start_s
        + up
    )


def _config_of(registry: Registry, model: str, config: str) -> Config | None:
    found = registry.models.get(model)
    return found.configs.get(config) if found is not None else None


def pick_option(options: Sequence[Option], policy: AutoPolicy, model: str) -> int | None:
    """The 1-based index of the first option, in the operator's ranking, auto may take.

    Non-displacing options whenever auto is enabled (a ``wake`` that stops or pauses
    nobody is one: issue 21 item 6); a displacement only when the *requested* model is
    in ``allow_displace``.
    """
    if not policy.enabled:
        return None
    for index, option in enumerate(options, start=1):
        if displaces_nobody(option) or policy.may_displace_for(model):
            return index
    return None


def displaces_nobody(option: Option) -> bool:
    """A reuse, a load alongside, or a wake with no victims."""
    return option.kind in _NON_DISPLACING or (option.kind is OptionKind.WAKE and not option.victims)


@dataclass
class _Run:
    model: str
    original: dict[str, ParkReason]
    """Placement id → the reason admission gave it; restored when the run does not happen."""
    started: bool = False
    applied: str | None = None
    """The entry whose option the run enforced."""


class AutoRunner:
    """Schedules unattended enforcement for new parks (docs/placement-rules.md §4.4.1).

    - :meth:`schedule` is called by the controller once a new park is stored and
      planned. It answers :attr:`ParkReason.AUTO_LOADING` (and sets it on the
      entry, with the expiry pushed past the enforcement envelope) only when a
      run will really execute for the entry's model; otherwise ``None`` and the
      entry keeps admission's reason.
    - One run per requested **model** (resolved to its model key): a second park
      for the model joins the run. At most :data:`MAX_SCHEDULED_RUNS` runs exist;
      they take turns on one lock, and each re-plans when its turn comes (a run
      queued behind another saw the machine before that one loaded).
    - A failed run (``ok`` false, or any exception) marks its entries
      ``auto_failed`` and puts the model in a :data:`COOLDOWN_S` cooldown in the
      ledger's ``cooldowns``; a success clears it and removes the entries.
    - Nothing here raises into the daemon: a run's every error is logged.
    """

    def __init__(
        self,
        host: AutoHost,
        enforcer: AutoEnforcer,
        policy: PolicySource,
        registry: Callable[[], Registry],
        *,
        envelope_s: float = DEFAULT_ENVELOPE_S,
        clock: Callable[[], float] = time.time,
        option_envelope: Callable[[Option], float] | None = None,
        on_runs: Callable[[frozenset[str]], None] | None = None,
    ) -> None:
        self.host = host
        self.enforcer = enforcer
        self.policy = policy
        self._registry = registry
        self.envelope_s = envelope_s
        """The envelope where no option is known (``option_envelope`` absent)."""
        self._option_envelope = option_envelope
        """The envelope of one option by its configs' own bounds (:func:`option_envelope_s`)."""
        self._on_runs = on_runs
        """Told the model keys with a scheduled run after each change (admission answers
        ``auto_loading`` at once for a new park of one of them)."""
        self._clock = clock
        self._runs: dict[str, _Run] = {}
        self._turn = asyncio.Lock()
        self._tasks: dict[asyncio.Task[None], _Run] = {}
        self._closing = False

    # ------------------------------------------------------------------ public

    async def schedule(self, entry: PendingEntry, plan: Plan) -> ParkReason | None:
        """Start (or join) the auto run for ``entry``'s model; the reason it now parks with."""
        if self._closing or entry.reason in NEVER_AUTO or entry.reason is ParkReason.AUTO_FAILED:
            return None
        if plan.reason is not PreviewReason.OK or not plan.options:
            return None
        resolved = self._registry().lookup(entry.requested_model)
        if resolved is None:
            return None
        model = resolved[0].key
        policy = await self.policy.refresh()
        current = self._live(entry.id)
        if current is None or current.reason in NEVER_AUTO:
            return None  # resolved, dismissed or expired while we looked
        if current.reason is ParkReason.AUTO_FAILED:
            return None  # one attempt per entry
        run = self._runs.get(model)
        if run is not None and current.id in run.original:
            return ParkReason.AUTO_LOADING
        stale = current.reason is ParkReason.AUTO_LOADING
        if stale:
            # Said by a run that no longer exists (a restart): back to the honest reason.
            current = replace(current, reason=ParkReason.NOT_RESIDENT)
        now = self._clock()
        if run is None:
            run = self._new_run(model, plan, policy, now)
            if run is None:
                if stale:
                    self.host.replace_pending(current)
                return None
        run.original[current.id] = current.reason
        ahead = 0 if run.started else list(self._runs).index(model)
        envelope = self._envelope_of(plan.options, policy, model)
        self._mark_loading(current, now + envelope * (ahead + 1) + ENVELOPE_MARGIN_S)
        return ParkReason.AUTO_LOADING

    def _envelope_of(self, options: Sequence[Option], policy: AutoPolicy, model: str) -> float:
        """The envelope of the option auto would take from ``options`` (the default one
        without a per-option bound, or when none may be taken)."""
        index = pick_option(options, policy, model)
        if self._option_envelope is None or index is None:
            return self.envelope_s
        return self._option_envelope(options[index - 1])

    def status(self) -> dict[str, Any]:
        """``{"running": model | None, "queued": [model…], "cooldowns": {model: until}}``."""
        running = next((m for m, r in self._runs.items() if r.started), None)
        return {
            "running": running,
            "queued": [m for m, r in self._runs.items() if not r.started],
            "cooldowns": dict(self.host.cooldowns),
        }

    async def wait_idle(self) -> None:
        """Return once every scheduled run has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Daemon shutdown: schedule nothing more, cancel the runs still waiting for
        their turn (their entries get their own reasons back), and let the running
        one finish: an enforcement is never cut off mid-sequence (bound the wait
        with ``asyncio.wait_for``)."""
        self._closing = True
        for task, run in list(self._tasks.items()):
            if not run.started:
                task.cancel()
        await self.wait_idle()

    # ------------------------------------------------------------------ scheduling

    def _new_run(self, model: str, plan: Plan, policy: AutoPolicy, now: float) -> _Run | None:
        until = self.host.cooldowns.get(model)
        if until is not None and until > now:
            log.info(
                "auto: %s is in cooldown after a failed run until %s; not loading", model, until
            )
            return None
        if pick_option(plan.options, policy, model) is None:
            return None
        if len(self._runs) >= MAX_SCHEDULED_RUNS:
            log.warning(
                "auto: %d runs already scheduled (%s); %s waits for the operator",
                len(self._runs),
                ", ".join(self._runs),
                model,
            )
            return None
        run = _Run(model, {})
        self._runs[model] = run
        self._runs_changed()
        task = asyncio.get_running_loop().create_task(self._execute(run), name=f"auto-{model}")
        self._tasks[task] = run
        task.add_done_callback(self._task_done)
        return run

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    def _mark_loading(self, entry: PendingEntry, expires_at: float) -> None:
        updated = replace(
            entry, reason=ParkReason.AUTO_LOADING, expires_at=max(entry.expires_at, expires_at)
        )
        self.host.replace_pending(updated)

    # ------------------------------------------------------------------ the run

    async def _execute(self, run: _Run) -> None:
        ok: bool | None = None
        try:
            async with self._turn:
                run.started = True
                ok = await self._attempt(run)
        except asyncio.CancelledError:
            self._forget(run)
            self._settle_logged(run, None)
            raise
        except Exception:
            log.exception("auto: the run for %s failed with an error", run.model)
            ok = False
        self._forget(run)
        self._settle_logged(run, ok)

    def _settle_logged(self, run: _Run, ok: bool | None) -> None:
        try:
            self._settle(run, ok)
        except Exception:
            log.exception("auto: recording the outcome of the run for %s failed", run.model)

    def _forget(self, run: _Run) -> None:
        if self._runs.get(run.model) is run:
            del self._runs[run.model]
            self._runs_changed()

    def _runs_changed(self) -> None:
        if self._on_runs is not None:
            self._on_runs(frozenset(self._runs))

    async def _attempt(self, run: _Run) -> bool | None:
        """``True``/``False`` for a run that enforced; ``None`` when it did not happen."""
        entry = self._first_live(run)
        if self._closing:
            return None
        if entry is None:
            log.info("auto: nobody waits for %s any more; nothing to load", run.model)
            return None
        policy = await self.policy.refresh()
        fresh = await self.host.plan_for(entry.requested_model, entry.cells)
        entry = self._live(entry.id)
        if entry is None:
            return None
        index = pick_option(fresh.options, policy, run.model)
        if index is None:
            log.info("auto: no option for %s that auto may take now; it waits", run.model)
            return None
        entry = replace(entry, options=fresh.options)
        self.host.replace_pending(entry)
        run.applied = entry.id
        option = fresh.options[index - 1]
        envelope = self._option_envelope(option) if self._option_envelope else self.envelope_s
        self._extend(run, self._clock() + envelope + ENVELOPE_MARGIN_S)
        log.warning(
            "auto: enforcing %s option %d for %s (%s %s/%s on %s%s)",
            entry.id,
            index,
            run.model,
            option.kind.value,
            option.model,
            option.config,
            option.device,
            f", displacing {', '.join(option.signature)} under allow_displace"
            if option.victims
            else "",
        )
        result = await self.enforcer.apply(entry, index, list(option.signature), wait=True)
        if result.get("ok") is True:
            return True
        log.warning("auto: loading %s failed: %s", run.model, result.get("error", "no detail"))
        return False

    def _first_live(self, run: _Run) -> PendingEntry | None:
        return next((e for e in map(self._live, run.original) if e is not None), None)

    def _live(self, placement_id: str) -> PendingEntry | None:
        """The entry unless it is gone or expired (the controller's tick drops and
        announces expired ones; this never drops anything)."""
        entry = self.host.pending_entry(placement_id)
        return entry if entry is not None and not entry.expired(self._clock()) else None

    def _extend(self, run: _Run, expires_at: float) -> None:
        for placement_id in run.original:
            entry = self.host.pending_entry(placement_id)
            if entry is not None and entry.expires_at < expires_at:
                self.host.replace_pending(replace(entry, expires_at=expires_at))

    def _settle(self, run: _Run, ok: bool | None) -> None:
        if ok:
            if self.host.cooldowns.end(run.model):
                log.info("auto: %s loaded; its cooldown is cleared", run.model)
        elif ok is False:
            until = self._clock() + COOLDOWN_S
            self.host.cooldowns.start(run.model, until)
            log.warning("auto: %s is in cooldown for %g s", run.model, COOLDOWN_S)
        for placement_id, original in run.original.items():
            entry = self.host.pending_entry(placement_id)
            if entry is None:
                continue
            if ok and placement_id == run.applied:
                # The enforcer's resolve step removes it; this only makes sure.
                self.host.resolve_pending(entry, "applied")
            elif ok is False:
                self.host.replace_pending(replace(entry, reason=ParkReason.AUTO_FAILED))
            elif entry.reason is ParkReason.AUTO_LOADING:
                # Joined a run that did not happen, or that loaded a config this
                # entry does not ask for (a config key pins one): back to the operator.
                self.host.replace_pending(replace(entry, reason=original))
