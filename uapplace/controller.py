"""The one object that owns placement state while ``uapplaced`` runs.

It holds the last good registry, the capacity policy, the device probe, the
ledger, the admission table, the residents, the bus holds, and the optional
collaborators the daemon wires in at start (enforcer, measurer, unit writer, auto
policy, notifier, authorizer, proxy client). The D-Bus layer (``service.py``)
is a thin shell around it; the controller knows nothing of D-Bus and reports
what happens through :class:`ControllerEvents`.

Three rules shape the code:

- **``admit`` never blocks.** It is dictionary look-ups (``Admission.decide``)
  plus bookkeeping. Everything slow a new park needs (the proxy's in-flight
  list, a probe, the planner, the ledger, the notification) runs after the
  answer has been sent, scheduled with ``loop.call_soon``.
- **The ledger is written behind.** Changes mark the controller dirty; one
  writer task coalesces bursts (``debounce_s``, or ``usage_flush_s`` when only
  usage clocks moved) and writes in a thread (``Ledger.update``). Shutdown
  flushes synchronously. While the daemon runs it is the ledger's only writer.
- **A bad reload keeps the last good registry.** The error is kept and shown
  by ``Validate`` and ``GetState``; placement goes on with what was loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from uapplace import __version__
from uapplace.admission import (
    DEFAULT_TTL_SECONDS,
    TRIM_AFTER_EXPIRED,
    Admission,
    return_freed_memory_soon,
)
from uapplace.alerts import Alert, AlertBoard, AlertKind, Severity
from uapplace.capacity import CapacityPolicy, Finding, has_errors, load_policy, topology_findings
from uapplace.capacity import validate as validate_capacity
from uapplace.conflicts import conflict_edges, dropin_groups
from uapplace.counters import DaemonCounters
from uapplace.devices import Probe, make_probe
from uapplace.engines import ProxyClient, ProxyTokenRejected
from uapplace.errors import (
    Busy,
    Failed,
    InvalidArgument,
    NotAuthorized,
    NotFound,
    Unavailable,
    UnknownModel,
    unavailable,
)
from uapplace.ledger import Ledger, LedgerDoc, doc_to_json, pending_to_json
from uapplace.model import (
    DEFAULT_CELLS,
    Decision,
    DeviceReading,
    Holder,
    Model,
    Option,
    ParkReason,
    PendingEntry,
    Plan,
    Registry,
    Resident,
    ResidentState,
    iso,
)
from uapplace.paths import Paths
from uapplace.planner import PlanInput, pause_level, plan, plan_unload, victim_of
from uapplace.rails import RailsCache
from uapplace.registry import (
    ConfigFileError,
    RegistryLoad,
    gate_on_devices,
    load_registry,
    provenance_rows,
)
from uapplace.units import UnitError, has_conflict_dropins, write_conflict_dropins

log = logging.getLogger(__name__)

ResidentRow = tuple[str, str, str, str]
"""``(model, config, device, state)``: one element of the ``Residents`` property."""

DEFAULT_DEBOUNCE_S = 0.075
DEFAULT_USAGE_FLUSH_S = 5.0
DEFAULT_TICK_S = 5.0
DEFAULT_SHUTDOWN_WAIT_S = 30.0
PARK_PLANNERS = 4
"""New parks planned at once (options attached after the admit answered)."""
WRITE_RETRY_S = 2.0
DEADLINE_PASSED = "deadline_passed"
"""The reason of an ``AdmitBy`` answered after its caller's deadline (no entry, no id)."""
REPLAN_DEBOUNCE_S = 0.1
"""How long resident changes are gathered before the pending entries are re-planned."""
GONE = "gone"
"""The ``ResidentChanged`` state of a resident that is no longer loaded."""


@dataclass(frozen=True)
class VictimRef:
    """One element of an approval signature: a resident the operator agreed to stop."""

    model: str
    config: str

    @property
    def signature(self) -> str:
        return f"{self.model}/{self.config}"


Signature = Sequence[str] | Sequence[VictimRef]
"""An approval signature: ``model/config`` strings (the bus form) or VictimRef objects."""


@dataclass(frozen=True)
class BusHold:
    """A ``Hold`` on the bus: lives until ``Release`` or until ``sender`` disconnects."""

    cookie: int
    model: str
    reason: str
    app_id: str
    sender: str
    since: float

    def holder(self) -> Holder:
        return Holder(
            client=self.app_id or self.sender,
            kind="hold",
            detail=self.reason,
            started_at=iso(self.since),
            cookie=self.cookie,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "cookie": self.cookie,
            "model": self.model,
            "reason": self.reason,
            "app_id": self.app_id,
            "sender": self.sender,
            "since": iso(self.since),
        }


# --------------------------------------------------------------------------- collaborators


class ControllerEvents(Protocol):
    """What the controller reports; the bus service turns each into a signal."""

    def on_parked(self, entry: PendingEntry) -> None: ...

    def on_resolved(self, placement_id: str, outcome: str) -> None: ...

    def on_resident_changed(self, row: ResidentRow) -> None: ...

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None: ...

    def on_pending_count(self, count: int) -> None: ...

    def on_residents(self, rows: list[ResidentRow]) -> None: ...

    def on_alert(self, alert: Alert) -> None: ...


class _NoEvents:
    def on_parked(self, entry: PendingEntry) -> None:
        pass

    def on_resolved(self, placement_id: str, outcome: str) -> None:
        pass

    def on_resident_changed(self, row: ResidentRow) -> None:
        pass

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        pass

    def on_pending_count(self, count: int) -> None:
        pass

    def on_residents(self, rows: list[ResidentRow]) -> None:
        pass

    def on_alert(self, alert: Alert) -> None:
        pass


class Enforcement(Protocol):
    """Apply / Load / Unload (spec §4.6); wired by the enforcement issue."""

    async def apply(
        self,
        entry: PendingEntry,
        option: int,
        expected: Signature | None,
        *,
        origin: str | None = None,
    ) -> dict[str, Any]: ...

    async def load(self, model: str, expected: Signature) -> dict[str, Any]: ...

    async def unload(self, model: str, expected: Signature) -> dict[str, Any]: ...

    async def wait_idle(self) -> None:
        """Return once no enforcement runs (a running one finished or rolled back).

        The controller bounds the wait itself at shutdown."""
        ...


class Measurer(Protocol):
    async def measure(self, model: str, config: str) -> dict[str, Any]: ...

    async def measure_envelope(self, model: str, config: str) -> dict[str, Any]: ...


class UnitWriter(Protocol):
    async def write_units(self) -> list[str]: ...

    async def check_units(self) -> list[str]: ...

    async def refresh(self) -> list[str]: ...


class AutoPolicyStore(Protocol):
    async def get(self) -> dict[str, Any]: ...

    async def set(self, changes: Mapping[str, Any], consent: bool) -> dict[str, Any]: ...


class NotifierLike(Protocol):
    async def parked(self, entry: PendingEntry, plan: Plan, clients: Sequence[str]) -> None: ...

    async def resolved(self, placement_id: str, outcome: str) -> None: ...

    async def alert(self, alert: Alert) -> None:
        """A critical (or warning) desktop notification for an alert."""
        ...


class AuthorizerLike(Protocol):
    async def check(self, sender: str, action: Any) -> None: ...

    async def check_polkit(self, sender: str, action: Any) -> None:
        """polkit's yes only (no same-uid fallback); for acting on others' state."""
        ...


class AutoScheduler(Protocol):
    """``uapplace.auto.AutoRunner``: unattended loads under the operator's standing consent."""

    async def schedule(self, entry: PendingEntry, plan: Plan) -> ParkReason | None: ...

    async def close(self) -> None: ...


class Closable(Protocol):
    def close(self) -> None: ...


class InflightSource(Protocol):
    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """Target id → in-flight requests, or ``None`` when the proxy did not answer."""
        ...


class ProxyHolders:
    """The proxy's ``/internal/placement/inflight`` as :class:`Holder` lists (kind ``inflight``).

    A 401 (:class:`ProxyTokenRejected`) is handed to ``on_token_rejected`` (the
    daemon raises the ``token_mismatch`` alert there) and re-raised: callers that
    treat the list as unknown still do, and a drain stops on it at once.
    """

    def __init__(
        self, proxy: ProxyClient, on_token_rejected: Callable[[str], None] | None = None
    ) -> None:
        self.proxy = proxy
        self.on_token_rejected = on_token_rejected

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        try:
            targets = await self.proxy.inflight()
        except ProxyTokenRejected as err:
            if self.on_token_rejected is not None:
                self.on_token_rejected(str(err))
            raise
        if targets is None:
            return None
        return {
            target: [_inflight_holder(r) for r in requests] for target, requests in targets.items()
        }


def _inflight_holder(request: Mapping[str, Any]) -> Holder:
    started = request.get("started_at")
    return Holder(
        client=str(request.get("client") or "unknown client"),
        kind="inflight",
        detail=str(request.get("id") or ""),
        started_at=str(started) if started else None,
    )


class UnitDropins:
    """``WriteUnits``: ``Conflicts=`` drop-ins for the units that can never be resident together.

    The edges are :func:`uapplace.conflicts.conflict_edges`: computed in MiB with the
    planner's own fit test, so systemd never stops a model the planner would have kept
    alongside (DESIGN §5a invariant 1: nothing is stopped without a yes). ``reload`` is
    the user manager's ``Reload``; without one the files are still written and the log
    says to run ``systemctl --user daemon-reload``.

    Once written, the graph follows the registry: every controller reload (SIGHUP,
    ``validate``, a finished ``measure``) calls :meth:`refresh`, which rewrites the
    drop-ins only where ``uapplace units`` wrote some before (a machine whose operator
    never asked for drop-ins gets none). :meth:`check_units` reports, without writing,
    which files differ from the graph the registry gives now (``uapplace units --check``).
    """

    def __init__(
        self, controller: Controller, reload: Callable[[], Awaitable[None]] | None
    ) -> None:
        self.controller = controller
        self._reload = reload

    async def write_units(self) -> list[str]:
        changed = await self._write(dry_run=False)
        if changed:
            if self._reload is not None:
                await self._reload()
            else:
                log.warning("drop-ins written; run `systemctl --user daemon-reload` to apply them")
        return [str(path) for path in changed]

    async def check_units(self) -> list[str]:
        """The drop-in files that are stale (would be written or removed); nothing is touched."""
        return [str(path) for path in await self._write(dry_run=True)]

    async def refresh(self) -> list[str]:
        """Rewrite the drop-ins after a registry or measurement change, where they exist."""
        unit_dir = self.controller.paths.user_unit_dir
        if not await asyncio.to_thread(has_conflict_dropins, unit_dir):
            return []
        try:
            written = await self.write_units()
        except (Failed, UnitError) as err:
            log.error("the Conflicts= drop-ins are stale (`uapplace units` rewrites them): %s", err)
            return []
        if written:
            log.info("Conflicts= drop-ins regenerated: %s", ", ".join(written))
        return written

    async def _write(self, *, dry_run: bool) -> list[Path]:
        groups = conflict_unit_groups(self.controller.load.registry)
        try:
            return await asyncio.to_thread(
                write_conflict_dropins,
                self.controller.paths.user_unit_dir,
                groups,
                dry_run=dry_run,
            )
        except (ValueError, OSError) as err:
            raise Failed(f"cannot write the Conflicts= drop-ins: {err}") from None


def conflict_unit_groups(registry: Registry) -> dict[str, list[str]]:
    """Every ``Conflicts=`` edge of the registry as a two-unit group (``"a + b" → [a, b]``)."""
    return dropin_groups(conflict_edges(registry))


# --------------------------------------------------------------------------- the controller


class Controller:
    def __init__(
        self,
        paths: Paths,
        load: RegistryLoad,
        policy: CapacityPolicy | None,
        probe: Probe,
        ledger: Ledger,
        *,
        policy_error: ConfigFileError | None = None,
        clock: Callable[[], float] = time.time,
        debounce_s: float = DEFAULT_DEBOUNCE_S,
        usage_flush_s: float = DEFAULT_USAGE_FLUSH_S,
        tick_s: float = DEFAULT_TICK_S,
    ) -> None:
        self.paths = paths
        self.load = load
        self.policy = policy
        self.policy_error = policy_error
        self.policy_loaded_at: float | None = clock() if policy is not None else None
        """When the policy in force was read (it outlives a broken file: ``policy_state``)."""
        self.reload_error: ConfigFileError | None = None
        self.probe = probe
        self.ledger = ledger
        ttl = paths.test_pending_ttl_s or DEFAULT_TTL_SECONDS
        self.admission = Admission(load.registry, ttl=ttl)
        self.residents: list[Resident] = []
        self.usage: dict[str, float] = {}
        self.cooldowns: dict[str, float] = {}
        self.holds: dict[int, BusHold] = {}
        self.alerts = AlertBoard(clock)
        self.counters = DaemonCounters()
        """Admits, runs, steps, alerts however they arrived (``GetState.counters``)."""
        self.rails = RailsCache()
        """Per-target rails of the residents (``GetState.targets``, issue 13)."""
        self.version = __version__
        self.events: ControllerEvents = _NoEvents()
        # Collaborators wired by the daemon; None until then (methods say "not available").
        self.enforcer: Enforcement | None = None
        self.measurer: Measurer | None = None
        self.unit_writer: UnitWriter | None = None
        self.auto_policy: AutoPolicyStore | None = None
        self.notifier: NotifierLike | None = None
        self.authorizer: AuthorizerLike | None = None
        self.proxy: InflightSource | None = None
        self.auto_runner: AutoScheduler | None = None
        self.idle_sweep: Closable | None = None
        self.enforcement_unavailable: str | None = None
        """Why the enforcer could not be wired (no systemd user manager); ``None`` otherwise."""
        self.peer_alive: Callable[[str], Awaitable[bool]] | None = None
        """Is this bus name still connected? Set by the daemon; closes the Hold race."""
        self._clock = clock
        self._debounce_s = debounce_s
        self._usage_flush_s = usage_flush_s
        self._tick_s = tick_s
        self._next_cookie = 1
        self._usage_keys: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._to_plan: dict[str, PendingEntry] = {}
        """New parks waiting for their options, planned by at most ``PARK_PLANNERS`` tasks
        (a flood of 10,000 admits must not become 10,000 concurrent probe + plan tasks)."""
        self._planners = 0
        self._accepting = True
        self._replan_wanted = asyncio.Event()
        self._residents_generation = 0
        """Bumped by every change a plan depends on besides readings (residents,
        holds): a plan that started under an older value is stale."""
        self._replanned_generation = -1
        """``_residents_generation`` as the last finished re-plan found it."""
        self._replan_lock = asyncio.Lock()

    # ------------------------------------------------------------------ construction

    @classmethod
    def open(cls, paths: Paths, **kwargs: Any) -> Controller:
        """Read the registry and policy (blocking: call before serving).

        Raises :class:`ConfigFileError` when the repo registry is invalid. A local
        registry that is invalid is ignored (its errors are in ``load.errors``);
        a capacity policy that is missing or invalid only disables ``validate``'s
        cross-checks and is reported there.
        """
        load = load_registry(paths.repo_registry, paths.local_registry)
        for err in load.errors:
            log.error("ignoring the machine-local registry: %s", err)
        policy, policy_error = _read_policy(paths)
        probe = make_probe(paths, load.registry)
        load = _gated(load, probe)
        return cls(
            paths, load, policy, probe, Ledger(paths.ledger), policy_error=policy_error, **kwargs
        )

    async def start(self) -> None:
        """Restore from the ledger, then start the writer and the expiry tick."""
        await self.restore_from_ledger()
        self.report_topology()
        self.start_background()

    def report_topology(self) -> None:
        """With ``proxy.single_upstream``, log every model the proxy cannot reach after a
        switch as an error and raise one ``config_error`` alert naming them (at start and
        after each reload; ``validate`` lists them as errors too)."""
        findings = topology_findings(self.load)
        for finding in findings:
            log.error("%s", finding)
        if findings:
            names = "; ".join(f.message for f in findings[:3])
            more = f" (and {len(findings) - 3} more)" if len(findings) > 3 else ""
            self.raise_alert(
                AlertKind.CONFIG_ERROR,
                Severity.WARNING,
                f"{self.load.repo_path}: proxy.single_upstream",
                f"{len(findings)} model(s) unreachable through the single-upstream proxy: "
                f"{names}{more}",
                {"findings": [f.to_json() for f in findings[:20]]},
            )

    async def restore_from_ledger(self) -> None:
        """Read the ledger (a corrupt one is moved aside by :class:`Ledger`) and restore."""
        doc = await asyncio.to_thread(self.ledger.read)
        moved = self.ledger.last_error
        if moved:
            log.warning("%s", moved)
            self.ledger.last_error = None
        self.restore(doc)
        problems = ([moved] if moved else []) + doc.dropped
        if problems:  # a file moved aside or items dropped alone: a human should know
            more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
            shown = "; ".join(problems[:3]) + more
            self.raise_alert(
                AlertKind.CONFIG_ERROR,
                Severity.WARNING,
                str(self.ledger.path),
                f"the ledger was repaired at start: {shown}",
                {"problems": problems[:20]},
            )

    def start_background(self) -> None:
        """The write-behind task and the expiry tick; the first write lands right away."""
        self._tasks = [
            asyncio.create_task(self._write_behind(), name="ledger-writer"),
            asyncio.create_task(self._tick(), name="expiry-tick"),
            asyncio.create_task(self._replan_behind(), name="pending-replanner"),
        ]
        self.mark_dirty()
        self.request_replan()

    def restore(self, doc: LedgerDoc) -> None:
        """Residents, usage, cooldowns and live pending entries from the ledger."""
        now = self._clock()
        # Holders are live facts (connections, requests); none survives a restart.
        # Publication (DESIGN §5a invariant 2): a resident is forwarded to only after a
        # verify-up passed in this daemon's life, so every restored resident that was
        # serving is ``warming`` until the unit sync (or LedgerPublication) verifies it.
        self.residents = [
            replace(r, holders=(), state=ResidentState.WARMING)
            if r.state is ResidentState.HOT
            else replace(r, holders=())
            for r in doc.residents
        ]
        self.admission.set_residents(self.residents)
        self.usage = dict(doc.usage)
        self.cooldowns = {m: until for m, until in doc.cooldowns.items() if until > now}
        self.alerts.restore(doc.alerts)
        dropped = self.admission.restore(doc.pending, now)
        kept = len(self.admission.pending)
        log.info(
            "restored %d resident(s), %d pending (%d dropped as expired or superseded)",
            len(self.residents),
            kept,
            len(dropped),
        )

    async def shutdown(self, wait_s: float = DEFAULT_SHUTDOWN_WAIT_S) -> None:
        """Refuse new enforcement, let a running one end (bounded), flush the ledger."""
        self._accepting = False
        if self.idle_sweep is not None:
            self.idle_sweep.close()
        if self.auto_runner is not None:
            try:
                await asyncio.wait_for(self.auto_runner.close(), wait_s)
            except TimeoutError:
                log.error("an auto load was still running after %gs", wait_s)
        if self.enforcer is not None:
            try:
                await asyncio.wait_for(self.enforcer.wait_idle(), wait_s)
            except TimeoutError:
                log.error("an enforcement was still running after %gs; flushing anyway", wait_s)
        for task in [*self._tasks, *self._background]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._background, return_exceptions=True)
        self._tasks = []
        try:
            self._write(self._snapshot())
        except Exception as err:  # a flush failure must not turn a clean stop into a crash
            log.error("could not flush the ledger at shutdown: %s", err)

    # ------------------------------------------------------------------ the hot path

    def admit(self, model: str, client: str, session: str, cells: int, deadline_us: int = 0) -> Any:
        """Forward or park; O(1), never blocks, never awaits the ledger.

        ``deadline_us`` (``AdmitBy``; CLOCK_MONOTONIC µs, 0 = none): an admit handled
        after its caller's deadline changes nothing and answers a park without an id
        (reason ``deadline_passed``): the caller has gone, and a pending entry whose id
        no client received would be a ghost (issue 13).
        """
        if deadline_us and time.monotonic_ns() // 1000 > deadline_us:
            self.counters.admit("dropped", DEADLINE_PASSED)
            log.info(
                "admit of %r for %r arrived after its caller's deadline: no pending entry",
                model,
                client,
            )
            return Decision("park", reason=DEADLINE_PASSED)
        now = self._clock()
        decision, entry = self.admission.decide(
            model, client, session or None, cells or DEFAULT_CELLS, now
        )
        self.counters.admit(decision.decision, decision.reason)
        if decision.decision == "forward":
            self.usage[self._usage_key(model)] = now
            self.mark_dirty(urgent=False)
        elif entry is not None:
            asyncio.get_running_loop().call_soon(self._after_park, entry)
        return decision

    def _usage_key(self, requested: str) -> str:
        key = self._usage_keys.get(requested)
        if key is None:
            resolved = self.load.registry.resolve(requested)
            key = resolved[0].key if resolved is not None else requested
            self._usage_keys[requested] = key
        return key

    def _after_park(self, entry: PendingEntry) -> None:
        for pushed_out in self.admission.take_evicted():  # the pending caps (admission.py)
            self._to_plan.pop(pushed_out.id, None)
            self.resolve(pushed_out, "expired", already_removed=True)
        self.events.on_parked(entry)
        self.events.on_pending_count(self.pending_count)
        self.mark_dirty()
        self._to_plan[entry.id] = entry
        if self._planners < PARK_PLANNERS:
            self._planners += 1
            self._spawn(self._plan_queued(), "plan-parked")

    async def _plan_queued(self) -> None:
        """Plan queued parks oldest first. The queue is bounded by the pending caps (an
        entry pushed out leaves it too); a few planners run at once, so one slow proxy
        answer (``plan_input`` asks it for in-flight work) does not hold up the rest."""
        try:
            while self._to_plan:
                entry = self._to_plan.pop(next(iter(self._to_plan)))
                await _logged(self._plan_parked(entry), f"plan-{entry.id}")
        finally:
            self._planners -= 1

    async def _plan_parked(self, entry: PendingEntry) -> None:
        """Attach options to a new park, persist it, tell the notifier."""
        if self.admission.get(entry.id) is None:
            return  # already resolved, or pushed out by the pending caps in a flood
        planned_against = self._residents_generation
        inp, _inflight_clients = await self.plan_input()
        found = await asyncio.to_thread(plan, inp, entry.requested_model, entry.cells)
        current = self.admission.get(entry.id)
        if current is None:
            return  # resolved or dismissed while we planned
        updated = replace(current, options=found.options)
        self.admission.replace(updated)
        self.mark_dirty()
        if self._residents_generation != planned_against:
            # Residents or holds changed while we planned (a swap under way): the
            # re-plan they asked for may have finished before this write, which
            # would leave these stale options standing. Ask for another.
            self.request_replan()
        if self.auto_runner is not None:
            reason = await self.auto_runner.schedule(updated, found)
            if reason is ParkReason.AUTO_LOADING:
                return  # no operator decision to ask for: the load is under way
            updated = self.admission.get(entry.id) or updated
        if self.notifier is not None:
            # The bubble names who asked; the victims' own clients are in its body.
            await self.notifier.parked(updated, found, [updated.client])

    async def replan_pending(self) -> None:
        """Re-plan every pending entry against the residents and readings now.

        Options are computed once at park time; after a restart, a crash repair or
        a unit stopped by hand they name victims and free memory that no longer
        exist, and ``Apply`` would answer ``Drifted`` until the entry expired.
        One probe for all entries; entries resolved meanwhile are skipped. One
        re-plan at a time (the re-planner and ``ListPending`` both ask), so a
        later one's options are never overwritten by an earlier one's.
        """
        async with self._replan_lock:
            generation = self._residents_generation
            entries = self.pending_entries()
            if entries:
                inp, _clients = await self.plan_input()
                for entry in entries:
                    found = await asyncio.to_thread(plan, inp, entry.requested_model, entry.cells)
                    current = self.admission.get(entry.id)
                    if current is not None and current.options != found.options:
                        self.admission.replace(replace(current, options=found.options))
                self.mark_dirty()
            self._replanned_generation = generation

    async def _replan_if_stale(self) -> None:
        """Re-plan now if residents or holds changed since the last re-plan started.

        The re-planner runs ``REPLAN_DEBOUNCE_S`` after a change; a ``ListPending``
        in that window (``uapplace pending`` right after a swap) would otherwise show
        options planned against the residents before it. Nothing changed (the usual
        case) costs one comparison.
        """
        if self._replanned_generation != self._residents_generation:
            await self.replan_pending()

    # ------------------------------------------------------------------ reads

    @property
    def registry_models(self) -> Mapping[str, Model]:
        return self.load.registry.models

    @property
    def pending_count(self) -> int:
        return len(self.admission.pending)

    def resident_rows(self) -> list[ResidentRow]:
        return [(r.model, r.config, r.device, r.state.value) for r in self.residents]

    def pending_entries(self) -> list[PendingEntry]:
        return sorted(self.admission.pending.values(), key=lambda e: e.created_at)

    async def state_json(self) -> dict[str, Any]:
        """The ledger document as it is now (fresh probe, live holders) plus daemon facts."""
        readings = await asyncio.to_thread(self.probe.read)
        doc = self._document(readings, self.residents_with_holders(None))
        out = doc_to_json(doc)
        for key, device in out["devices"].items():
            configured = self.load.registry.devices.get(key)
            if configured is not None:
                device["reserved_mib"] = configured.reserved_mib
        out["daemon"] = True
        out["daemon_version"] = self.version
        out["holds"] = [h.to_json() for h in self.holds.values()]
        out["alerts"] = [a.to_json() for a in self.alerts.active()]
        out["counters"] = self.counters.to_json()
        targets = await self.rails.current(self.residents, self.load.registry.models)
        out["targets"] = [t.to_json() for t in targets]
        out["registry"] = {
            "repo": str(self.load.repo_path),
            "local": str(self.load.local_path) if self.load.local_path else None,
            "local_errors": [str(e) for e in self.load.errors],
            "reload_error": str(self.reload_error) if self.reload_error else None,
            "device_mismatches": [str(e) for e in self.load.device_mismatches],
            "capacity_policy": self.policy_state,
        }
        out["ledger"] = {"path": str(self.ledger.path), "error": self.ledger.last_error}
        return out

    async def preview(self, model: str, cells: int) -> dict[str, Any]:
        inp, _ = await self.plan_input()
        found = await asyncio.to_thread(plan, inp, model, cells or DEFAULT_CELLS)
        return found.to_json()

    async def plan_input(self) -> tuple[PlanInput, list[str]]:
        """Residents with their holders (bus holds + the proxy's in-flight), and fresh readings.

        Also returns the clients with work in flight on a resident.
        """
        inflight = await self.live_inflight()
        readings = await asyncio.to_thread(self.probe.read)
        residents = self.residents_with_holders(inflight)
        clients = sorted({h.client for r in residents for h in r.holders if h.kind == "inflight"})
        inp = PlanInput(
            self.load.registry, residents, readings, inflight_known=inflight is not None
        )
        return inp, clients

    async def live_inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """The proxy's in-flight list now (its client's timeout bounds the wait);
        ``None`` when there is no proxy answer: unknown, which counts as busy."""
        if self.proxy is None:
            return None
        try:
            return await self.proxy.inflight()
        except Exception as err:  # unknown counts as busy; never guess idle
            log.warning("proxy in-flight list unavailable: %s", err)
            return None

    async def pending_live_json(self) -> dict[str, Any]:
        """``ListPending``: the stored options with their victims' holders, in-flight
        work and consequence as they are at the time of the call (issue 13).

        Options are planned at park time and re-planned when the residents or the
        holds change; who is using a victim changes far more often (every request),
        so it is read live here (the proxy's list and the bus holds) and overlaid
        onto each victim instead of re-running the planner for every entry on each
        call. The option set and its signatures stay what was planned, so an
        ``Apply`` still approves exactly what was shown; only when the residents
        or holds changed since the last re-plan is the re-plan done first.
        """
        await self._replan_if_stale()
        inflight = await self.live_inflight()
        live = {(r.model, r.config, r.device): r for r in self.residents_with_holders(inflight)}
        registry = self.load.registry
        known = inflight is not None
        rows = []
        for entry in self.pending_entries():
            options = tuple(_with_live_victims(o, live, registry, known) for o in entry.options)
            row = pending_to_json(replace(entry, options=options))
            row["recommended"] = 1 if options else None
            rows.append(row)
        return {"pending": rows}

    def residents_with_holders(
        self, inflight: Mapping[str, Sequence[Holder]] | None
    ) -> list[Resident]:
        out = []
        for resident in self.residents:
            holders = [h.holder() for h in self.holds.values() if self._held(h, resident)]
            if inflight is not None:
                holders.extend(inflight.get(resident.target_id, ()))
            out.append(replace(resident, holders=tuple(holders)))
        return out

    def _held(self, hold: BusHold, resident: Resident) -> bool:
        return hold.model in (resident.model, resident.config)

    async def validate(self) -> dict[str, Any]:
        """Re-read the config files (a bad one keeps the last good), then cross-check."""
        await self.reload()
        findings: list[Finding] = []
        if self.reload_error is not None:
            findings.extend(_failed_file(e) for e in self.reload_error.every())
        if self.policy_error is not None:
            findings.extend(self._failed_policy(e) for e in self.policy_error.every())
        findings.extend(validate_capacity(self.load, self.policy))
        findings.extend(await self.live_findings())
        return {
            "ok": not has_errors(findings),
            "errors": sum(1 for f in findings if f.severity == "error"),
            "warnings": sum(1 for f in findings if f.severity == "warning"),
            "findings": [f.to_json() for f in findings],
            "provenance": provenance_rows(self.load),
            "capacity_policy": self.policy_json(),
        }

    async def live_findings(self) -> list[Finding]:
        """What only the running system can tell ``validate`` (issue 13): the proxy
        refusing our token (error; unreachable is a warning: it may just be down),
        and rails the registry declares that a live engine contradicts (warning)."""
        findings: list[Finding] = []
        proxy = getattr(self.proxy, "proxy", None)
        if isinstance(proxy, ProxyClient):
            problem = await proxy.check()
            if problem is not None:
                token = "HTTP 401" in problem
                findings.append(
                    Finding("error" if token else "warning", proxy.base_url, "$", problem)
                )
                if token:
                    self.proxy_token_rejected(problem)
        targets = await self.rails.current(self.residents, self.load.registry.models)
        for target in targets:
            warning = target.disagreement()
            if warning is not None:
                path = f"$.models.{target.model}.rails"
                findings.append(Finding("warning", str(self.load.repo_path), path, warning))
        return findings

    def policy_json(self) -> dict[str, Any]:
        """Which capacity policy is in force, for ``validate`` (never silently off)."""
        loaded = self.policy_loaded_at
        return {
            "state": self.policy_state,
            "file": str(self.paths.capacity_policy),
            "loaded_at": iso(loaded) if loaded is not None else None,
            "refusal": self.policy_refusal(),
        }

    def _failed_policy(self, err: ConfigFileError) -> Finding:
        if self.policy is not None and self.policy_loaded_at is not None:
            kept = (
                "the last good capacity policy, read at "
                f"{iso(self.policy_loaded_at)}, stays in force"
            )
        else:
            kept = "no good capacity policy was ever loaded: every verify-up refuses"
        return Finding("error", str(err.file), err.json_path, f"{err.message} ({kept})")

    async def reload(self) -> bool:
        """Re-read registry and policy; a bad repo registry keeps the last good one running."""
        try:
            load = await asyncio.to_thread(
                load_registry, self.paths.repo_registry, self.paths.local_registry
            )
        except ConfigFileError as err:
            self.reload_error = err
            log.error("registry reload failed, keeping the last good one: %s", err)
            # The operator's edit is being ignored: say so where they look (status
            # banner, a notification), not only in the log and `validate`.
            self.raise_alert(
                AlertKind.CONFIG_ERROR,
                Severity.WARNING,
                str(err.file),
                f"the registry does not load ({err}); uapplaced keeps placing with the last "
                "good one until it is fixed",
            )
            return False
        policy, policy_error = await asyncio.to_thread(_read_policy, self.paths)
        probe = make_probe(self.paths, load.registry)
        load = await asyncio.to_thread(_gated, load, probe)
        self.reload_error = None
        self.load = load
        self._take_policy(policy, policy_error)
        self.probe = probe
        self.admission.set_registry(load.registry)
        self._usage_keys.clear()
        self.report_topology()
        if self.unit_writer is not None:
            await self.unit_writer.refresh()
        return True

    def _take_policy(self, policy: CapacityPolicy | None, error: ConfigFileError | None) -> None:
        """A broken policy file keeps the last good policy in force (like the registry)."""
        self.policy_error = error
        if policy is not None:
            self.policy = policy
            self.policy_loaded_at = self._clock()
        elif self.policy is not None:
            log.error("capacity policy reload failed, keeping the last good one: %s", error)

    @property
    def policy_state(self) -> str:
        """``loaded`` (the file as it is now), ``last-good`` (the file is broken; the policy
        read before stays in force) or ``none`` (no good policy was ever read: every
        verify-up refuses, see :func:`uapplace.capacity.refusing_policy`)."""
        if self.policy is None:
            return "none"
        return "last-good" if self.policy_error is not None else "loaded"

    def policy_refusal(self) -> str | None:
        """Why verify-up must refuse every engine now, or ``None`` when a policy is in force."""
        if self.policy is not None:
            return None
        why = str(self.policy_error) if self.policy_error else str(self.paths.capacity_policy)
        return f"no good capacity policy was ever loaded ({why}); verify-up fails closed"

    # ------------------------------------------------------------------ operator writes

    def dismiss(self, placement_id: str) -> bool:
        entry = self.admission.remove(placement_id)
        if entry is None:
            raise NotFound(_no_pending(placement_id))
        self.resolve(entry, "dismissed", already_removed=True)
        return True

    def resolve(self, entry: PendingEntry, outcome: str, already_removed: bool = False) -> None:
        """Drop a pending entry and say so (``Resolved``, notifier, ledger)."""
        if not already_removed:
            self.admission.remove(entry.id)
        self.events.on_resolved(entry.id, outcome)
        self.events.on_pending_count(self.pending_count)
        if self.notifier is not None:
            self._spawn(self.notifier.resolved(entry.id, outcome), f"resolved-{entry.id}")
        self.mark_dirty()

    async def apply(
        self, placement_id: str, option: int, expected: Signature, *, origin: str | None = None
    ) -> dict[str, Any]:
        """Enforce an option of a pending entry; ``expected`` is the approval signature
        (``model/config`` strings, as ``ListPending`` shows them) and is always checked.
        ``origin`` names an unattended caller (a notification click): a failed run then
        also raises an ``enforcement_failed`` alert."""
        entry = self.admission.get(placement_id, self._clock())
        if entry is None:
            raise NotFound(_no_pending(placement_id))
        if not entry.options:
            raise InvalidArgument(
                f"placement {placement_id} has no options (see `uapplace pending`); "
                "nothing can be applied"
            )
        if not 1 <= option <= len(entry.options):
            raise InvalidArgument(
                f"option {option} is out of range: placement {placement_id} has options "
                f"1..{len(entry.options)}"
            )
        enforcer = self._enforcer("Apply")
        await self._durable_before_run()
        return await enforcer.apply(entry, option, expected, origin=origin)

    async def load_model(self, model: str, expected: Signature) -> dict[str, Any]:
        """Load with the recommended option; ``expected`` is its signature from ``Preview``."""
        self.model_named(model)
        enforcer = self._enforcer("Load")
        await self._durable_before_run()
        return await enforcer.load(model, expected)

    async def unload(self, model: str, expected: Signature) -> dict[str, Any]:
        """Stop ``model``; ``expected`` is the signature ``PreviewUnload`` showed."""
        self.model_named(model)
        enforcer = self._enforcer("Unload")
        await self._durable_before_run()
        return await enforcer.unload(model, expected)

    async def _durable_before_run(self) -> None:
        """Write the ledger before a run changes anything (DESIGN §5a invariant 6).

        The write-behind coalesces for ``debounce_s``; a park answered just before an
        ``Apply`` could otherwise be lost with a crash mid-run (found by the chaos
        harness: a SIGKILL at ``drain`` 0.2 s after the park). One write per run.
        """
        try:
            await self.flush()
        except Exception as err:  # the run itself does not depend on the ledger write
            log.warning("could not write the ledger before the run: %s", err)

    async def preview_unload(self, model: str) -> dict[str, Any]:
        """What ``Unload(model)`` would stop now: ``{model, victims, signature, frees_mib}``.

        The same residents the enforcer stops (every resident of the model's key),
        with holders, in-flight and consequence as a displace option shows them.
        """
        key = self.model_named(model).key
        inp, _ = await self.plan_input()
        try:
            victims = plan_unload(inp, key)
        except KeyError:
            raise NotFound(f"{key} is not resident: nothing to unload") from None
        return {
            "model": key,
            "victims": [v.to_json() for v in victims],
            "signature": sorted(v.signature for v in victims),
            "frees_mib": round(sum(v.frees_mib for v in victims), 3),
        }

    async def measure(self, model: str, config: str) -> dict[str, Any]:
        found = self.model_named(model)
        if config and config not in found.configs:
            known = ", ".join(found.configs) or "none"
            raise NotFound(f"model {found.key} has no config {config!r} (configs: {known})")
        if self.measurer is None:
            raise self._missing("Measure")
        return await self.measurer.measure(found.key, config)

    async def measure_envelope(self, model: str, config: str) -> dict[str, Any]:
        """``uapplace measure --envelope``: takes the backend down and up (issue 12)."""
        found = self.model_named(model)
        if config and config not in found.configs:
            known = ", ".join(found.configs) or "none"
            raise NotFound(f"model {found.key} has no config {config!r} (configs: {known})")
        if self.measurer is None:
            raise self._missing("MeasureEnvelope")
        return await self.measurer.measure_envelope(found.key, config)

    async def write_units(self) -> list[str]:
        if self.unit_writer is None:
            raise self._missing("WriteUnits")
        return await self.unit_writer.write_units()

    async def check_units(self) -> list[str]:
        if self.unit_writer is None:
            raise self._missing("CheckUnits")
        return await self.unit_writer.check_units()

    async def get_auto_policy(self) -> dict[str, Any]:
        if self.auto_policy is None:
            raise self._missing("GetAutoPolicy")
        return await self.auto_policy.get()

    async def set_auto_policy(self, changes: Mapping[str, Any], consent: bool) -> dict[str, Any]:
        granting = [k for k in ("allow_displace", "allow_unload") if changes.get(k)]
        if granting and not consent:
            raise InvalidArgument(
                f"{' and '.join(granting)} records standing consent to stop models unattended; "
                "it needs consent=true (`uapplace auto ... --yes`)"
            )
        if self.auto_policy is None:
            raise self._missing("SetAutoPolicy")
        return await self.auto_policy.set(changes, consent)

    def model_named(self, model: str) -> Model:
        resolved = self.load.registry.resolve(model)
        if resolved is None:
            raise UnknownModel(
                f"model {model!r} is in no registry file ({self.load.repo_path}"
                + (f", {self.load.local_path}" if self.load.local_path else "")
                + ")"
            )
        return resolved[0]

    def _enforcer(self, method: str) -> Enforcement:
        if not self._accepting:
            raise Busy(f"{method}: uapplaced is shutting down; try again once it is back")
        if self.enforcer is None:
            raise self._missing(method)
        return self.enforcer

    def _missing(self, method: str) -> Unavailable:
        """A collaborator the daemon wires at start is absent: say why, never "later"."""
        why = self.enforcement_unavailable or "uapplaced has not wired it (it is still starting)"
        return unavailable(method, why)

    # ------------------------------------------------------------------ holds

    async def hold(self, model: str, reason: str, app_id: str, sender: str) -> int:
        """Pin ``model``: while held, a resident serving it is never a victim."""
        key = self.model_named(model).key
        if not reason.strip():
            raise InvalidArgument("a hold needs a reason (shown to the operator next to the pin)")
        cookie = self._next_cookie
        self._next_cookie = cookie % 0xFFFFFFFF + 1
        self.holds[cookie] = BusHold(cookie, key, reason, app_id, sender, self._clock())
        log.info("hold %d on %s by %s (%s): %s", cookie, key, app_id or "-", sender, reason)
        self.mark_dirty()
        self.request_replan()  # a held resident is never a victim: options change
        if sender and self.peer_alive is not None and not await self.peer_alive(sender):
            self.drop_holds_of(sender)  # it disconnected before we could watch it
        return cookie

    def hold_owner(self, cookie: int) -> str:
        """The bus connection that took hold ``cookie`` (``NotFound`` when there is none)."""
        return self._hold(cookie).sender

    def release(self, cookie: int, sender: str, *, may_release_others: bool = False) -> None:
        """End a hold. Only the connection that took it may, unless the caller was
        authorized for ``org.uap.placement.release-others`` (``may_release_others``)."""
        held = self._hold(cookie)
        if held.sender != sender and not may_release_others:
            raise NotAuthorized(
                f"hold {cookie} on {held.model} belongs to bus connection {held.sender}"
                + (f" ({held.app_id})" if held.app_id else "")
                + "; only that connection may release it (or a caller polkit authorizes for "
                "org.uap.placement.release-others); it also ends when that connection closes"
            )
        del self.holds[cookie]
        log.info("hold %d on %s released by %s", cookie, held.model, sender or "-")
        self.mark_dirty()
        self.request_replan()

    def _hold(self, cookie: int) -> BusHold:
        held = self.holds.get(cookie)
        if held is None:
            raise NotFound(
                f"no hold with cookie {cookie} (it was released, or its holder's bus "
                "connection closed)"
            )
        return held

    def drop_holds_of(self, sender: str) -> None:
        """``sender`` left the bus: its holds end with it."""
        gone = [c for c, h in self.holds.items() if h.sender == sender]
        for cookie in gone:
            held = self.holds.pop(cookie)
            log.info("hold %d on %s ended: %s left the bus", cookie, held.model, sender)
        if gone:
            self.mark_dirty()
            self.request_replan()

    # ------------------------------------------------------------------ residents

    def upsert_resident(self, resident: Resident) -> None:
        """Add a resident or replace the one with the same model/config/device."""
        key = (resident.model, resident.config, resident.device)
        others = [r for r in self.residents if (r.model, r.config, r.device) != key]
        self._set_residents([*others, resident])
        self.events.on_resident_changed(
            (resident.model, resident.config, resident.device, resident.state.value)
        )
        self._resolve_served(resident)

    def set_resident_state(
        self, model: str, config: str, device: str, state: ResidentState
    ) -> Resident:
        current = self.resident(model, config, device)
        if current is None:
            raise NotFound(f"no resident {model}/{config} on {device}")
        updated = replace(current, state=state)
        self.upsert_resident(updated)
        return updated

    def drop_resident(self, model: str, config: str, device: str) -> Resident | None:
        current = self.resident(model, config, device)
        if current is None:
            return None
        self._set_residents([r for r in self.residents if r is not current])
        self.events.on_resident_changed((model, config, device, GONE))
        return current

    def resident(self, model: str, config: str, device: str) -> Resident | None:
        return next(
            (r for r in self.residents if (r.model, r.config, r.device) == (model, config, device)),
            None,
        )

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        """For the enforcer: one ``EnforcementStep`` signal."""
        self.counters.step(run_id, step, ok)
        self.events.on_enforcement_step(run_id, step, ok, detail)

    def _set_residents(self, residents: list[Resident]) -> None:
        self.residents = residents
        self.admission.set_residents(residents)
        self.rails.invalidate()  # a resident turned hot answers /slots now: probe again
        self.events.on_residents(self.resident_rows())
        self.mark_dirty()
        self.request_replan()

    def request_replan(self) -> None:
        """Ask for :meth:`replan_pending` soon; a burst of resident changes (a swap,
        a start-up reconcile) coalesces into one re-plan ``REPLAN_DEBOUNCE_S`` after
        the first request (the replanner task runs from ``start_background``).
        A change during a re-plan asks again, so the last re-plan always starts
        after the last change."""
        self._residents_generation += 1
        self._replan_wanted.set()

    async def _replan_behind(self) -> None:
        while True:
            await self._replan_wanted.wait()
            await asyncio.sleep(REPLAN_DEBOUNCE_S)
            self._replan_wanted.clear()
            try:
                await self.replan_pending()
            except Exception:  # a failed re-plan must not end the replanner
                log.exception("re-planning the pending entries failed")

    def _resolve_served(self, resident: Resident) -> None:
        for entry in self.admission.resolved_by(resident):
            self.resolve(entry, "forwarded")

    # ------------------------------------------------------------------ alerts

    def proxy_token_rejected(self, message: str) -> None:
        """The proxy answered 401 on an internal route: a critical ``token_mismatch``
        alert, raised once while it is open (every preview and drain asks the proxy;
        one notification is enough, the log has each)."""
        url = self.paths.proxy_url
        if any(a.key == (AlertKind.TOKEN_MISMATCH.value, url) for a in self.alerts.active()):
            log.warning("%s", message)
            return
        self.raise_alert(
            AlertKind.TOKEN_MISMATCH,
            Severity.CRITICAL,
            self.paths.proxy_url,
            message,
            {"proxy_url": self.paths.proxy_url},
        )

    def raise_alert(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any] | None = None,
    ) -> Alert:
        """Record an alert (deduped on ``(kind, subject)``), signal it, notify, persist."""
        alert = self.alerts.raise_(kind, severity, subject, message, detail)
        self.counters.alert(kind.value, severity.value)
        log.log(
            logging.ERROR if severity is Severity.CRITICAL else logging.WARNING,
            "alert %s [%s] %s: %s",
            alert.id,
            kind.value,
            subject,
            message,
        )
        self.events.on_alert(alert)
        if self.notifier is not None and severity is not Severity.INFO:
            self._spawn(self.notifier.alert(alert), f"alert-{alert.id}")
        self.mark_dirty()
        return alert

    def acknowledge_alerts(self, ids: Sequence[str]) -> list[str]:
        """Drop the named alerts (all when ``ids`` is empty); unknown ids are ``NotFound``."""
        unknown = [i for i in ids if i not in {a.id for a in self.alerts.active()}]
        if unknown:
            raise NotFound(f"no open alert {', '.join(unknown)} (see `uapplace status`)")
        gone = self.alerts.acknowledge(ids)
        if gone:
            self.mark_dirty()
        return gone

    # ------------------------------------------------------------------ persistence

    def mark_dirty(self, urgent: bool = True) -> None:
        """Schedule a ledger write: soon when ``urgent``, within ``usage_flush_s`` otherwise."""
        self._wake.set()
        if urgent:
            self._urgent.set()

    async def flush(self) -> None:
        """Write the ledger now (in a thread)."""
        await asyncio.to_thread(self._write, self._snapshot())

    async def _write_behind(self) -> None:
        while True:
            await self._wake.wait()
            if not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._urgent.wait(), self._usage_flush_s)
            await asyncio.sleep(self._debounce_s)
            self._wake.clear()
            self._urgent.clear()
            try:
                await self.flush()
            except Exception as err:  # the file may be locked or the disk full: retry later
                log.warning("ledger write failed (%s); retrying in %gs", err, WRITE_RETRY_S)
                await asyncio.sleep(WRITE_RETRY_S)
                self.mark_dirty()

    def _snapshot(self) -> LedgerDoc:
        """What goes into the ledger, captured on the loop (the write runs in a thread)."""
        return self._document({}, self.residents_with_holders(None))

    def _document(
        self, readings: Mapping[str, DeviceReading], residents: list[Resident]
    ) -> LedgerDoc:
        return LedgerDoc(
            updated_at=self._clock(),
            devices=dict(readings),
            residents=residents,
            pending=self.pending_entries(),
            usage=dict(self.usage),
            cooldowns=dict(self.cooldowns),
            alerts=self.alerts.active(),
        )

    def _write(self, snapshot: LedgerDoc) -> None:
        """Blocking: probe the devices and replace the ledger's content with ``snapshot``."""
        readings = self.probe.read()

        def commit(doc: LedgerDoc) -> None:
            doc.devices = dict(readings)
            doc.residents = snapshot.residents
            doc.pending = snapshot.pending
            doc.usage = snapshot.usage
            doc.cooldowns = snapshot.cooldowns
            doc.alerts = snapshot.alerts

        self.ledger.update(commit)
        if self.ledger.last_error:
            log.warning("%s", self.ledger.last_error)
            self.ledger.last_error = None

    # ------------------------------------------------------------------ background

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            self.expire()

    def expire(self) -> list[PendingEntry]:
        """Drop expired entries (``Resolved(id, "expired")``) and lapsed cooldowns."""
        now = self._clock()
        gone = self.admission.expire(now)
        for entry in gone:
            self.resolve(entry, "expired", already_removed=True)
        if len(gone) >= TRIM_AFTER_EXPIRED:  # after a flood: let RSS come back down
            self._spawn(return_freed_memory_soon(), "return-freed-memory")
        lapsed = [m for m, until in self.cooldowns.items() if until <= now]
        for model in lapsed:
            del self.cooldowns[model]
        if lapsed:
            self.mark_dirty()
        return gone

    def _spawn(self, work: Awaitable[None], name: str) -> None:
        task = asyncio.ensure_future(_logged(work, name))
        self._background.add(task)
        task.add_done_callback(self._background.discard)


async def _logged(work: Awaitable[None], name: str) -> None:
    try:
        await work
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background work %s failed", name)


def _gated(load: RegistryLoad, probe: Probe) -> RegistryLoad:
    """Blocking: measurements whose recorded device is not the one the probe sees are unknown."""
    gated = gate_on_devices(load, probe.read())
    for err in gated.device_mismatches:
        log.error("measurement not used on this machine: %s", err)
    return gated


def _read_policy(paths: Paths) -> tuple[CapacityPolicy | None, ConfigFileError | None]:
    try:
        return load_policy(paths.capacity_policy), None
    except ConfigFileError as err:
        log.warning("capacity policy not used: %s", err)
        return None, err


def _with_live_victims(
    option: Option,
    live: Mapping[tuple[str, str, str], Resident],
    registry: Registry,
    inflight_known: bool,
) -> Option:
    """``option`` with each victim's holders, in-flight flag, state and consequence
    taken from ``live`` (residents carrying the holders read now).

    A victim that is no longer resident keeps what was planned: the resident
    change that removed it has already asked for a re-plan, which replaces the
    option within ``REPLAN_DEBOUNCE_S``.
    """
    if not option.victims:
        return option
    victims = []
    for victim in option.victims:
        resident = live.get((victim.model, victim.config, victim.device))
        if resident is None or (
            victim.action == "pause" and pause_level(registry, resident) is None
        ):
            victims.append(victim)  # a re-plan replaces it (issue 12: no longer pausable)
            continue
        now = victim_of(registry, resident, inflight_known, victim.action)
        victims.append(
            replace(
                victim,
                holders=now.holders,
                in_flight=now.in_flight,
                state=now.state,
                consequence=now.consequence,
            )
        )
    return replace(option, victims=tuple(victims))


def _no_pending(placement_id: str) -> str:
    return f"no pending placement {placement_id} (it may have expired or been resolved)"


def _failed_file(err: ConfigFileError) -> Finding:
    return Finding(
        "error",
        str(err.file),
        err.json_path,
        f"{err.message} (uapplaced keeps running on the registry it loaded before)",
    )
