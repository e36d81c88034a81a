"""In-memory fakes for the enforcement seams: the controller, the units, the engines.

- :class:`ListHost`: an :class:`~uapplace.enforce.host.EnforcementHost` over plain
  lists (residents, pending entries, bus holds), keeping every step signal, alert
  and resolution it is given. Its device readings come from a callable, so a
  :class:`World` can derive them from what runs.
- :class:`FakeUnits`: a :class:`~uapplace.io.seams.UnitControl` with in-memory unit
  states and scripted job outcomes (a start job that fails, a unit that turns
  ``failed`` after starting, one that survives its stop job, one whose stop systemd
  forces with ``SIGKILL`` after the stop timeout, one that leaves processes in its
  cgroup, one whose state cannot be read). It signals every state change like the
  real manager, and logs each job with the journal step on disk at that moment, so a
  test can show that the journal was written before each unit change.
- :class:`FakeEngines`: an :class:`~uapplace.io.seams.EngineProbe`: an engine is
  healthy only while its unit is active; served ids, metrics and vLLM's sleep
  state are scripted per endpoint, and so is what the drain asks of it
  (``/props``, ``/slots``, ``/metrics`` bodies as llama.cpp serves them: busy slots,
  asleep, ``--no-slots``, no ``--metrics``, not answering).
- :class:`World` ties the three together; :class:`Scene` adds a journal and a real
  :class:`~uapplace.enforce.enforcer.Enforcer` with tiny bounds (:data:`FAST`).

Used by ``test_enforce_fakes.py`` (every success and rollback branch),
``test_enforce_engine_truth.py`` (the engine's own word in the drain, forced stops,
verify-free on the host), ``test_enforce_safety.py`` and ``test_enforce_unit.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import signal
import sys
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tests.worlds import builders
from tests.worlds.builders import MEASURED_AT, cpu, gpu
from uapplace.core.alerts import Alert, AlertBoard, AlertKind, Severity
from uapplace.core.model import (
    Config,
    DeviceKind,
    DeviceReading,
    Holder,
    Model,
    ParkReason,
    PendingEntry,
    Plan,
    ProbeSource,
    ProcessUsage,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.core.unitnames import unit_file_name
from uapplace.enforce.enforcer import Enforcer
from uapplace.enforce.host import ProxyRefresher
from uapplace.files.capacity import ServicePolicy
from uapplace.files.journal import Journal
from uapplace.files.timeouts import Timeouts
from uapplace.io.engines import EngineError
from uapplace.io.router import HTTP_ROUTER, RouterProbe
from uapplace.io.units import CLD_EXITED, CLD_KILLED, JobOutcome, UnitError, UnitState

GPU = gpu(reserved=0)
HOST = cpu(65536, 1024)


# --------------------------------------------------------------------------- registry


def measured(key: str, mib: float, **kw: Any) -> Config:
    """A config measured on gpu0 for this machine (what preflight accepts)."""
    return builders.measured(key, mib, 64.0, **kw)


def endpoint_of(model: str) -> str:
    return f"http://127.0.0.1:{8000 + sum(map(ord, model))}"


def llama(key: str, config: Config) -> Model:
    """A llama.cpp model under unit ``<key>.service`` at :func:`endpoint_of`."""
    return Model(
        key, key.title(), "llama.cpp", {config.key: config}, unit=key, endpoint=endpoint_of(key)
    )


def vllm(key: str, config: Config) -> Model:
    """A vLLM model (``pause_lever`` on its config makes it pausable)."""
    return Model(
        key, key.title(), "vllm", {config.key: config}, unit=key, endpoint=endpoint_of(key)
    )


def swap_registry() -> Registry:
    """alpha (14,000 MiB) and beta (16,000 MiB) never fit gpu0 (24,576 MiB) together."""
    models = {
        "alpha": llama("alpha", measured("a1", 14000)),
        "beta": llama("beta", measured("b1", 16000)),
    }
    return Registry({GPU.key: GPU, HOST.key: HOST}, models)


def resident(
    model: str, config: str, state: ResidentState = ResidentState.HOT, **kw: Any
) -> Resident:
    values: dict[str, Any] = {
        "model": model,
        "config": config,
        "device": "gpu0",
        "engine": "llama.cpp",
        "endpoint": endpoint_of(model),
        "unit": f"{model}.service",
        "state": state,
        "gpu_mib": 14000.0,
        "host_rss_mib": 64.0,
        "since": MEASURED_AT,
    }
    values.update(kw)
    return Resident(**values)


def host_reading(free_mib: float = 60000.0) -> DeviceReading:
    return DeviceReading("cpu0", DeviceKind.CPU, HOST.total_mib, free_mib, ProbeSource.MEMAVAILABLE)


def static_readings() -> dict[str, DeviceReading]:
    """gpu0 with alpha's 14,000 MiB in use; plenty of host RAM."""
    return {
        "gpu0": DeviceReading("gpu0", DeviceKind.GPU, 24576, 10576, ProbeSource.SIM),
        "cpu0": host_reading(),
    }


# --------------------------------------------------------------------------- the host


@dataclass
class ListHost:
    """An :class:`~uapplace.enforce.host.EnforcementHost` over plain lists."""

    reg: Registry = field(default_factory=swap_registry)
    live: list[Resident] = field(default_factory=list)
    entries: dict[str, PendingEntry] = field(default_factory=dict)
    bus_holds: list[tuple[str, Holder]] = field(default_factory=list)
    """``(model, holder)``: a bus hold on every resident of that model."""
    in_flight: Mapping[str, Sequence[Holder]] | None = field(default_factory=dict)
    """The proxy's in-flight list per target id; ``None``: the proxy does not answer."""
    readings: Callable[[], Mapping[str, DeviceReading]] = static_readings
    policy: ServicePolicy | None = None
    steps: list[tuple[str, str, bool, str]] = field(default_factory=list)
    alerts: list[tuple[AlertKind, Severity, str, str]] = field(default_factory=list)
    alert_board: AlertBoard = field(init=False)
    resolved: list[tuple[str, str]] = field(default_factory=list)
    gate: asyncio.Event | None = None
    """When set, ``plan_input`` waits for it (a test holds a run in revalidation)."""
    on_inflight: Callable[[], None] | None = None
    """Called each time the drain asks for the in-flight list (a test looks mid-drain)."""
    forwarded: dict[str, float] = field(default_factory=dict)
    """Target id → seconds since admission last answered ``forward`` to it (the lease)."""

    def __post_init__(self) -> None:
        self.alert_board = AlertBoard(lambda: 0.0, self._note_alert)

    def registry(self) -> Registry:
        return self.reg

    def residents(self) -> Sequence[Resident]:
        return tuple(self.live)

    async def plan_input(self) -> PlanInput:
        if self.gate is not None:
            await self.gate.wait()
        with_holders = [replace(r, holders=tuple(self.holds(r))) for r in self.live]
        return PlanInput(self.reg, with_holders, self.readings())

    async def plan_for(self, model: str, cells: int) -> Plan:
        return plan(await self.plan_input(), model, cells)

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        if self.on_inflight is not None:
            self.on_inflight()
        return self.in_flight

    def holds(self, resident: Resident) -> Sequence[Holder]:
        return [h for model, h in self.bus_holds if model == resident.model]

    def forward_age(self, target_id: str) -> float | None:
        return self.forwarded.get(target_id)

    def pending_entry(self, placement_id: str) -> PendingEntry | None:
        return self.entries.get(placement_id)

    @contextlib.asynccontextmanager
    async def durable_resolutions(self) -> AsyncIterator[None]:
        yield

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return self.readings()

    def service_policy(self, model: Model) -> ServicePolicy | None:
        return self.policy

    def put_resident(self, resident: Resident) -> None:
        key = (resident.model, resident.config, resident.device)
        self.live = [r for r in self.live if (r.model, r.config, r.device) != key] + [resident]

    def drop_resident(self, resident: Resident) -> None:
        key = (resident.model, resident.config, resident.device)
        self.live = [r for r in self.live if (r.model, r.config, r.device) != key]

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        return []

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        self.resolved.append((placement_id, outcome))
        return self.entries.pop(placement_id, None) is not None

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.steps.append((run_id, step, ok, detail))

    def run_finished(self, run_id: str, verb: str, outcome: str) -> None:
        """No counters here."""

    def _note_alert(self, alert: Alert) -> None:
        self.alerts.append((alert.kind, alert.severity, alert.subject, alert.message))

    def states(self) -> dict[str, str]:
        """``model/config`` → the resident's state, for assertions."""
        return {r.signature: r.state.value for r in self.live}


# --------------------------------------------------------------------------- units


_SUB = {"active": "running", "inactive": "dead", "failed": "failed", "activating": "start"}


@dataclass
class FakeUnits:
    """A :class:`~uapplace.io.seams.UnitControl` over a dict of unit → ``ActiveState``."""

    active: dict[str, str] = field(default_factory=dict)
    """Unit → ActiveState; a unit not named is ``inactive``."""
    start_result: dict[str, str] = field(default_factory=dict)
    """Unit → the start job's result when not ``done`` (the unit then turns ``failed``)."""
    after_start: dict[str, str] = field(default_factory=dict)
    """Unit → its state once a ``done`` start job ends (default ``active``)."""
    stop_result: dict[str, str] = field(default_factory=dict)
    """Unit → the stop job's result when not ``done``."""
    survives_stop: set[str] = field(default_factory=set)
    """Units still ``active`` after their stop job, whatever it said."""
    unreadable: set[str] = field(default_factory=set)
    """Units whose state cannot be read (the manager refuses)."""
    forced_kill: set[str] = field(default_factory=set)
    """Units whose stop job is ``done`` only after systemd SIGKILLed them at the stop
    timeout: ``failed``, ``Result=timeout``, ``ExecMainCode=2`` (killed), status 9."""
    leftover_pids: dict[str, list[int]] = field(default_factory=dict)
    """Unit → processes its cgroup still holds once it is down (``KillMode=process``)."""
    journal: Journal | None = None
    """When set, each job is logged with the journal's step at that moment."""
    jobs: list[str] = field(default_factory=list)
    """``start x.service`` / ``stop x.service``, in order."""
    journaled: list[tuple[str, str | None]] = field(default_factory=list)
    """``(job, journal step on disk when it was queued)``."""
    _listeners: list[Callable[[str, UnitState], None]] = field(default_factory=list)
    _pids: itertools.count[int] = field(default_factory=lambda: itertools.count(4000))
    _main_pid: dict[str, int] = field(default_factory=dict)
    _ended: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    """Unit → ``(Result, ExecMainCode, ExecMainStatus)`` of its last main process."""

    def state_now(self, name: str) -> UnitState:
        active = self.active.get(name, "inactive")
        pid = self._main_pid.get(name, 0) if active == "active" else 0
        result, code, status = self._ended.get(name, ("success", 0, 0))
        return UnitState(
            active,
            _SUB.get(active, active),
            "loaded",
            pid,
            f"{sys.executable} -m engine",
            result=result,
            exec_paths=(sys.executable,),
            exec_main_code=code,
            exec_main_status=status,
        )

    async def state(self, name: str) -> UnitState:
        if name in self.unreadable:
            raise UnitError(f"cannot read {name}: the user manager refused")
        return self.state_now(name)

    async def start_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        self._log(f"start {name}")
        result = self.start_result.get(name, "done")
        if result != "done":
            self._set(name, "failed")
            return JobOutcome(name, result)
        self._main_pid[name] = next(self._pids)
        self._ended.pop(name, None)
        self._set(name, self.after_start.get(name, "active"))
        return JobOutcome(name, "done", f"/job/{len(self.jobs)}")

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        self._log(f"stop {name}")
        if name in self.forced_kill:
            self._ended[name] = ("timeout", CLD_KILLED, signal.SIGKILL)
            self._set(name, "failed")
        elif name not in self.survives_stop:
            self._ended[name] = ("success", CLD_EXITED, 0)
            self._set(name, "inactive")
        return JobOutcome(name, self.stop_result.get(name, "done"), f"/job/{len(self.jobs)}")

    async def pids(self, name: str) -> list[int]:
        pid = self.state_now(name).main_pid
        return [pid] if pid else list(self.leftover_pids.get(name, ()))

    def on_change(self, callback: Callable[[str, UnitState], None]) -> None:
        self._listeners.append(callback)

    def already_running(self, name: str) -> None:
        """``name`` was active before the test (no job, no signal)."""
        self.active[name] = "active"
        self._main_pid[name] = next(self._pids)

    def running(self) -> dict[str, str]:
        """Every unit named so far → its ActiveState (for assertions)."""
        return dict(sorted(self.active.items()))

    def _log(self, job: str) -> None:
        self.jobs.append(job)
        if self.journal is not None:
            record = self.journal.read()
            self.journaled.append((job, record.step if record is not None else None))

    def _set(self, name: str, active: str) -> None:
        self.active[name] = active
        state = self.state_now(name)
        for listener in self._listeners:
            listener(name, state)


# --------------------------------------------------------------------------- engines


@dataclass
class FakeEngines:
    """An :class:`~uapplace.io.seams.EngineProbe`: each endpoint is its model's engine,
    answering only while that model's unit is active (like a real engine)."""

    units: FakeUnits
    unit_of: dict[str, str]
    """Endpoint → the unit its engine runs under."""
    served: dict[str, list[str]] = field(default_factory=dict)
    """Endpoint → ``/v1/models`` ids (default: the unit's name without ``.service``)."""
    metrics_of: dict[str, dict[str, float | str]] = field(default_factory=dict)
    never_healthy: set[str] = field(default_factory=set)
    asleep: set[str] = field(default_factory=set)
    refuse_sleep: set[str] = field(default_factory=set)
    """Endpoints whose ``POST /sleep`` answers 500."""
    sleep_unseen: set[str] = field(default_factory=set)
    """Endpoints that answer the sleep but never say ``/is_sleeping`` true."""
    refuse_wake: set[str] = field(default_factory=set)
    broken: set[str] = field(default_factory=set)
    """Endpoints whose probe raises something no step expects (a bug, a dead probe)."""
    levers: list[str] = field(default_factory=list)
    """``sleep <endpoint>`` / ``wake <endpoint>``, in order."""
    journal: Journal | None = None
    """When set, each lever pulled is logged with the journal's step at that moment."""
    journaled: list[tuple[str, str | None]] = field(default_factory=list)
    slots: int = 2
    """Each engine's ``/slots`` entries (llama.cpp ``--parallel``)."""
    processing: dict[str, int] = field(default_factory=dict)
    """Endpoint → slots ``is_processing`` (and ``llamacpp:requests_processing``)."""
    idle_asleep: set[str] = field(default_factory=set)
    """Endpoints whose llama-server sleeps (``--sleep-idle-seconds``): ``/props`` says
    ``is_sleeping: true``; a ``GET /slots`` wakes it (noted in ``woken``), as the real one."""
    woken: list[str] = field(default_factory=list)
    no_props: set[str] = field(default_factory=set)
    """Endpoints with no ``/props`` (404: vLLM and others)."""
    no_slots: set[str] = field(default_factory=set)
    """Endpoints whose ``/slots`` answers 501 (llama-server ``--no-slots``)."""
    no_metrics: set[str] = field(default_factory=set)
    """Endpoints whose ``/metrics`` answers 501 (llama-server without ``--metrics``)."""
    metrics_text: dict[str, str] = field(default_factory=dict)
    """Endpoint → its ``/metrics`` body as served (default: llama.cpp's request gauges)."""
    unanswered: set[str] = field(default_factory=set)
    """Endpoints whose routes time out (a wedged engine) while its unit runs."""
    asked: list[str] = field(default_factory=list)
    """``<endpoint><route>`` of each ``get_reply``, in order."""

    def _up(self, endpoint: str) -> bool:
        return self.units.active.get(self.unit_of.get(endpoint, ""), "inactive") == "active"

    def _pull(self, lever: str) -> None:
        self.levers.append(lever)
        if self.journal is not None:
            record = self.journal.read()
            self.journaled.append((lever, record.step if record is not None else None))

    async def health(self, endpoint: str, timeout_s: float) -> bool:
        if endpoint in self.broken:
            raise RuntimeError(f"the probe of {endpoint} died")
        return self._up(endpoint) and endpoint not in self.never_healthy

    async def served_ids(self, endpoint: str, timeout_s: float) -> list[str]:
        if not self._up(endpoint):
            raise EngineError(f"{endpoint}/v1/models: connection refused")
        default = self.unit_of[endpoint].removesuffix(".service")
        return self.served.get(endpoint, [default])

    async def metrics(self, endpoint: str, timeout_s: float) -> dict[str, float | str]:
        if not self._up(endpoint):
            raise EngineError(f"{endpoint}/metrics: connection refused")
        return self.metrics_of.get(endpoint, {})

    async def is_sleeping(self, endpoint: str, timeout_s: float) -> bool | None:
        if not self._up(endpoint):
            return None
        return endpoint in self.asleep

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None:
        self._pull(f"sleep {endpoint}")
        if endpoint in self.refuse_sleep:
            raise EngineError(f"{endpoint}/sleep: HTTP 500")
        if endpoint not in self.sleep_unseen:
            self.asleep.add(endpoint)

    async def wake(self, endpoint: str, timeout_s: float) -> None:
        self._pull(f"wake {endpoint}")
        if endpoint in self.refuse_wake:
            raise EngineError(f"{endpoint}/wake_up: HTTP 500")
        self.asleep.discard(endpoint)

    async def get_reply(
        self, endpoint: str, route: str, timeout_s: float
    ) -> tuple[int | None, str]:
        self.asked.append(f"{endpoint}{route}")
        if endpoint in self.broken:
            raise RuntimeError(f"the probe of {endpoint} died")
        if not self._up(endpoint):
            return None, "Cannot connect to host: Connection refused"
        if endpoint in self.unanswered:
            return None, "timed out"
        path = route.split("?", 1)[0]  # a router model is asked with ?model=ID
        if path == "/props":
            return self._props(endpoint)
        if path == "/slots":
            return self._slots(endpoint)
        if path == "/metrics":
            return self._metrics(endpoint)
        return 404, NOT_FOUND

    def _props(self, endpoint: str) -> tuple[int, str]:
        if endpoint in self.no_props:
            return 404, NOT_FOUND
        sleeping = endpoint in self.idle_asleep
        return 200, json.dumps({"total_slots": self.slots, "is_sleeping": sleeping})

    def _slots(self, endpoint: str) -> tuple[int, str]:
        if endpoint in self.no_slots:
            return 501, NOT_SUPPORTED
        if endpoint in self.idle_asleep:  # a task: llama-server wakes to answer it
            self.idle_asleep.discard(endpoint)
            self.woken.append(endpoint)
        busy = self.processing.get(endpoint, 0)
        slots = [{"id": i, "n_ctx": 256, "is_processing": i < busy} for i in range(self.slots)]
        return 200, json.dumps(slots)

    def _metrics(self, endpoint: str) -> tuple[int, str]:
        if endpoint in self.no_metrics:
            return 501, NOT_SUPPORTED
        if endpoint in self.metrics_text:
            return 200, self.metrics_text[endpoint]
        busy = self.processing.get(endpoint, 0)
        return 200, (
            "# TYPE llamacpp:requests_processing gauge\n"
            f"llamacpp:requests_processing {busy}\n"
            "llamacpp:requests_deferred 0\n"
        )


NOT_FOUND = '{"error":{"code":404,"message":"File Not Found","type":"not_found_error"}}'
NOT_SUPPORTED = (
    '{"error":{"code":501,"message":"This server does not support this endpoint",'
    '"type":"not_supported_error"}}'
)


# --------------------------------------------------------------------------- a world


@dataclass
class World:
    """A host, units and engines that agree: gpu0's free memory is what the running,
    awake engines of the registry leave (plus any ``orphans``)."""

    host: ListHost
    units: FakeUnits
    engines: FakeEngines
    leaves_orphan: dict[str, ProcessUsage] = field(default_factory=dict)
    """Unit → a process that keeps holding gpu0 memory once the unit is down (the
    orphan of docs/placement-rules.md §4.6 step 4: no unit owns it, verify-free names it)."""

    def readings(self) -> dict[str, DeviceReading]:
        used = 0.0
        processes = [
            orphan
            for unit, orphan in self.leaves_orphan.items()
            if self.units.state_now(unit).active_state != "active"
        ]
        used += sum(p.used_mib for p in processes)
        for model in self.host.reg.models.values():
            for config in model.configs.values():
                unit = unit_file_name(model.unit_for(config) or "")
                endpoint = model.endpoint_for(config)
                state = self.units.state_now(unit)
                if state.active_state != "active" or endpoint in self.engines.asleep:
                    continue
                used += config.resident_gpu_mib or 0.0
                processes.append(ProcessUsage(state.main_pid, config.resident_gpu_mib or 0.0))
        gpu = DeviceReading(
            "gpu0", DeviceKind.GPU, GPU.total_mib, GPU.total_mib - used, ProbeSource.SIM
        )
        return {"gpu0": replace(gpu, processes=tuple(processes)), "cpu0": host_reading()}


def world(registry: Registry, running: Sequence[Resident], journal: Journal | None) -> World:
    """A world where ``running`` are the residents, their units active."""
    units = FakeUnits(journal=journal)
    for r in running:
        assert r.unit is not None
        units.already_running(unit_file_name(r.unit))
    endpoints = {
        model.endpoint_for(config) or "": unit_file_name(model.unit_for(config) or "")
        for model in registry.models.values()
        for config in model.configs.values()
    }
    engines = FakeEngines(units, endpoints, journal=journal)
    host = ListHost(reg=registry, live=list(running))
    scene = World(host, units, engines)
    host.readings = scene.readings
    return scene


# --------------------------------------------------------------------------- a scene

FAST = Timeouts(
    drain_s=0.05,
    drain_poll_s=0.005,
    stop_s=0.5,
    verify_free_s=0.05,
    verify_free_poll_s=0.005,
    start_s=0.5,
    verify_up_s=0.1,
    rollback_up_s=0.1,
    health_first_poll_s=0.005,
    health_max_poll_s=0.01,
    http_s=0.05,
)
"""Tiny bounds: a wait that must fail fails in about 0.1 s."""


def fast_enforcer(
    host: ListHost,
    units: FakeUnits,
    journal: Journal,
    engines: FakeEngines,
    *,
    refresher: ProxyRefresher | None = None,
    routers: RouterProbe = HTTP_ROUTER,
) -> Enforcer:
    """An enforcer over the fakes under :data:`FAST` bounds, journaling to ``journal``."""
    return Enforcer(
        host,
        units,
        timeouts=FAST,
        journal=journal,
        engines=engines,
        refresher=refresher,
        routers=routers,
    )


class Scene:
    """One world, its journal and an enforcer over them."""

    def __init__(
        self,
        tmp_path: Path,
        registry: Registry,
        running: Sequence[Resident],
        refresher: ProxyRefresher | None = None,
    ) -> None:
        self.journal = Journal(tmp_path / "enforcement-journal.json")
        self.world: World = world(registry, running, self.journal)
        self.host = self.world.host
        self.units = self.world.units
        self.engines = self.world.engines
        self.enforcer = fast_enforcer(
            self.host, self.units, self.journal, self.engines, refresher=refresher
        )

    def park(self, model: str) -> PendingEntry:
        return park_on(self.host, self.host.readings(), model, "plc-000001")

    def assert_ended_cleanly(self) -> None:
        """Whatever the outcome: the journal is gone and no draining mark is left."""
        assert_ended_cleanly(self.journal, self.enforcer)


def park_on(
    host: ListHost, readings: Mapping[str, DeviceReading], model: str, placement_id: str
) -> PendingEntry:
    """``model`` parked on ``host`` as ``placement_id``, with the options the planner gives
    over ``readings``."""
    inp = PlanInput(host.reg, host.live, readings)
    entry = PendingEntry(
        placement_id,
        model,
        "client",
        None,
        0.0,
        1e12,
        ParkReason.NOT_RESIDENT,
        options=plan(inp, model).options,
    )
    host.entries[entry.id] = entry
    return entry


def assert_ended_cleanly(journal: Journal, enforcer: Enforcer) -> None:
    """Whatever the outcome: the journal is gone and no draining mark is left."""
    assert journal.read() is None
    assert enforcer.marks.draining == frozenset()


def steps(result: dict[str, Any]) -> list[tuple[str, bool]]:
    return [(s["name"], s["ok"]) for s in result["steps"]]


def ok(*names: str) -> list[tuple[str, bool]]:
    return [(name, True) for name in names]


def detail(result: dict[str, Any], name: str) -> str:
    return next(str(s["detail"]) for s in result["steps"] if s["name"] == name)
