"""A small placement machine for the enforcement tier: real units, real daemon parts.

Two models on one simulated 24 GiB GPU, each a real unit running the fake
engine: ``alpha`` (14000 MiB) and ``beta`` (16000 MiB) cannot both be loaded,
so loading ``beta`` while ``alpha`` is resident means displacing it. The
:class:`~uapplace.controller.controller.Controller` is the real one (in-process, no bus),
wired to an :class:`~uapplace.enforce.enforcer.Enforcer` and a
:class:`~uapplace.publish.unitsync.UnitSync` through :class:`~uapplace.enforce.host.ControllerHost`,
exactly as the daemon wires them. The proxy's internal routes are the fake of
:mod:`uapplace.sim.proxy`, served over real HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tests.worlds.registries import measured, sim_devices, unit_model
from uapplace.controller.controller import Controller
from uapplace.controller.dropins import no_manager_to_reload
from uapplace.controller.holds import ProxyHolders
from uapplace.controller.ports import ResidentRow
from uapplace.core.alerts import Alert
from uapplace.core.model import PendingEntry, Resident
from uapplace.daemon.wiring import EnforcementStack, attach_enforcement
from uapplace.enforce.enforcer import Enforcer
from uapplace.enforce.host import ControllerHost
from uapplace.files.paths import Paths
from uapplace.files.registry import local_measurements
from uapplace.files.timeouts import Timeouts
from uapplace.io.engines import ProxyClient
from uapplace.io.units import UnitManager, UnitState
from uapplace.publish.unitsync import UnitSync
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.gpu import SimGpu, pid_alive

if TYPE_CHECKING:  # conftest imports this module (its fixtures build the world): types only here
    from tests.systemd.conftest import EngineUnit, UnitFiles

GUARD_S = 30.0
"""Upper bound on any wait: a hang guard, never an assertion about speed."""

ALPHA_MIB = 14000
BETA_MIB = 16000

FAST = Timeouts(
    drain_s=0.6,
    stop_s=10.0,
    verify_free_s=1.0,
    start_s=10.0,
    verify_up_s=5.0,
    rollback_up_s=10.0,
)


class Recorder:
    """ControllerEvents that keeps everything, and lets a test await a condition."""

    def __init__(self) -> None:
        self.resident_changes: list[ResidentRow] = []
        self.steps: list[tuple[str, str, bool, str]] = []
        self.resolved: list[tuple[str, str]] = []
        self.parked: list[str] = []
        self.alerts: list[Alert] = []
        self.step_hook: Callable[[str, bool], None] | None = None
        """Called as each step is reported, inside the run (to change the world mid-run)."""
        self._changed = asyncio.Event()

    def on_parked(self, entry: PendingEntry) -> None:
        self.parked.append(entry.id)
        self._changed.set()

    def on_resolved(self, placement_id: str, outcome: str) -> None:
        self.resolved.append((placement_id, outcome))
        self._changed.set()

    def on_resident_changed(self, row: ResidentRow) -> None:
        self.resident_changes.append(row)
        self._changed.set()

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.steps.append((run_id, step, ok, detail))
        if self.step_hook is not None:
            self.step_hook(step, ok)
        self._changed.set()

    def on_pending_count(self, count: int) -> None:
        self._changed.set()

    def on_residents(self, rows: list[ResidentRow]) -> None:
        self._changed.set()

    def on_alert(self, alert: Alert) -> None:
        self.alerts.append(alert)
        self._changed.set()

    def poke(self) -> None:
        self._changed.set()

    async def until(self, condition: Callable[[], bool], poll_s: float = 0.05) -> None:
        """Wait for ``condition`` (re-checked on every event, and every ``poll_s``)."""
        async with asyncio.timeout(GUARD_S):
            while not condition():
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), poll_s)

    def states_of(self, model: str) -> list[str]:
        return [row[3] for row in self.resident_changes if row[0] == model]


class UnitTimeline:
    """Every state change of the given units, to check two never ran together."""

    def __init__(self, units: UnitManager, names: Sequence[str]) -> None:
        self.names = set(names)
        self.changes: list[tuple[str, str]] = []
        units.on_change(self._record)

    def _record(self, unit: str, state: UnitState) -> None:
        if unit in self.names:
            self.changes.append((unit, state.active_state))

    def overlaps(self) -> list[dict[str, str]]:
        """Each moment at which more than one of the units was not inactive/failed."""
        current: dict[str, str] = {}
        found: list[dict[str, str]] = []
        for unit, state in self.changes:
            current[unit] = state
            up = {u: s for u, s in current.items() if s not in ("inactive", "failed", "")}
            if len(up) > 1:
                found.append(up)
        return found


@dataclass
class World:
    units: UnitManager
    unit_files: UnitFiles
    sim: SimGpu
    paths: Paths
    controller: Controller
    host: ControllerHost
    enforcer: Enforcer
    sync: UnitSync
    proxy: sim_proxy.FakeProxy
    events: Recorder
    timeline: UnitTimeline
    alpha: EngineUnit
    beta: EngineUnit
    runner: web.AppRunner
    orphan_pidfile: Path
    extra_pids: list[int] = field(default_factory=list)

    def resident(self, model: str) -> Resident | None:
        return next((r for r in self.controller.residents if r.model == model), None)

    def state_of(self, model: str) -> str | None:
        resident = self.resident(model)
        return resident.state.value if resident is not None else None

    async def start_alpha(self) -> None:
        outcome = await self.units.start_unit(self.alpha.name, GUARD_S)
        assert outcome.ok, outcome
        await self.events.until(lambda: self.state_of("alpha") == "hot")

    async def park(self, model: str, client: str = "client-1") -> PendingEntry:
        """Admit ``model`` (not resident), then wait for the park's options."""
        return await park(self.controller, self.events, model, client)

    def target_of(self, unit: EngineUnit) -> str:
        return f"gpu0:{unit.endpoint}"

    def local_doc(self) -> dict[str, Any]:
        """The machine-local registry file (measurements), as JSON."""
        doc: dict[str, Any] = json.loads(self.paths.local_registry.read_text(encoding="utf-8"))
        return doc

    async def add_cpu_gamma(self, engine_args: Sequence[str]) -> EngineUnit:
        """A CPU-only engine unit ``gamma`` (it claims no simulated GPU memory), added to
        the repo registry with one unmeasured config ``c1``; the controller reloaded."""
        gamma = self.unit_files.engine("gamma", "gamma", None, engine_args=engine_args)
        await self.units.reload()
        repo = json.loads(self.paths.repo_registry.read_text(encoding="utf-8"))
        repo["models"]["gamma"] = {
            "display": "Gamma (CPU)",
            "engine": "llama.cpp",
            "unit": gamma.name,
            "endpoint": gamma.endpoint,
            "configs": {"c1": {"status": "unmeasured"}},
        }
        self.paths.repo_registry.write_text(json.dumps(repo), encoding="utf-8")
        assert await self.controller.reload()
        return gamma

    def orphan_pid(self) -> int:
        """The PID the ``--orphan`` engine wrote (once ``orphan_pidfile`` exists)."""
        return int(self.orphan_pidfile.read_text(encoding="ascii").strip())

    def kill_orphan(self) -> None:
        """End the orphan a ``--orphan`` engine left (by the PID it wrote), if any."""
        try:
            pid = self.orphan_pid()
        except (OSError, ValueError):
            return
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)


async def park(
    controller: Controller, events: Recorder, model: str, client: str = "client-1"
) -> PendingEntry:
    """Admit ``model`` (not resident) to ``controller``, then wait for the park's options."""
    decision = controller.admit(model, client, "", 0)
    assert decision.decision == "park", decision
    placement_id = decision.placement_id

    def planned() -> bool:
        entry = controller.admission.get(placement_id)
        return entry is not None and bool(entry.options)

    await events.until(planned)
    entry = controller.admission.get(placement_id)
    assert entry is not None
    return entry


def step(result: dict[str, Any], name: str) -> dict[str, Any]:
    """The step ``name`` of an enforcement result (the first, if it ran twice)."""
    return next(s for s in result["steps"] if s["name"] == name)


def step_names(result: dict[str, Any]) -> list[str]:
    """An enforcement result's steps, by name, in the order they ran."""
    return [s["name"] for s in result["steps"]]


def registry_json(
    alpha: EngineUnit, beta: EngineUnit, alpha_mib: int = ALPHA_MIB, beta_mib: int = BETA_MIB
) -> dict[str, Any]:
    """``alpha`` and ``beta`` on the simulated card, their configs measured with the
    ``kv`` that :data:`POLICY` asks of ``beta-server``."""
    return {
        "version": 1,
        "devices": sim_devices(),
        "models": {
            "alpha": unit_model(
                "alpha", alpha, measured(alpha_mib, kv="int8"), advertises=["alpha-latest"]
            ),
            "beta": unit_model(
                "beta",
                beta,
                measured(beta_mib, kv="int8"),
                service="beta-server",
                advertises=["beta-latest"],
            ),
        },
    }


POLICY = {"services": [{"name": "beta-server", "metricsMustMatch": {"kv": "int8"}}]}


def declare_pause_lever(registry: dict[str, Any], lever: str) -> None:
    """Every config of the registry document ``registry`` declares ``lever`` (in place)."""
    for model in registry["models"].values():
        for config in model.get("configs", {}).values():
            config["pause_lever"] = lever


@dataclass(frozen=True)
class Wired:
    """A controller wired to enforcement exactly as the daemon wires it."""

    paths: Paths
    controller: Controller
    stack: EnforcementStack
    events: Recorder


async def wire_controller(
    tmp_path: Path,
    units: UnitManager,
    registry: dict[str, Any],
    *,
    proxy_url: str,
    timeouts: Timeouts,
    policy: dict[str, Any],
    sim: SimGpu | None = None,
    unit_dir: Path | None = None,
) -> Wired:
    """``registry`` and ``policy`` written under ``tmp_path`` (``config/``, the measured
    figures in ``uap/``), a started :class:`Controller` on them and its enforcement stack;
    the test owns ``units``. ``sim``: the simulated card the controller reads (none: the
    host's). ``unit_dir``: the user manager's unit directory; the controller's
    ``Conflicts=`` drop-ins go there and are followed by a user-manager reload (as in the
    daemon)."""
    config_dir = tmp_path / "config"
    uap_home = tmp_path / "uap"
    config_dir.mkdir()
    uap_home.mkdir()
    (config_dir / "model-registry.json").write_text(json.dumps(registry), encoding="utf-8")
    # The figures are this sandbox machine's own: they count only from the local file.
    local = json.dumps(local_measurements(registry))
    (uap_home / "model-registry.json").write_text(local, encoding="utf-8")
    (config_dir / "capacity-policy.json").write_text(json.dumps(policy), encoding="utf-8")
    env = {
        "HOME": str(tmp_path),
        "UAP_HOME": str(uap_home),
        "UAPPLACE_CONFIG_DIR": str(config_dir),
        "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        "XDG_CONFIG_HOME": str(
            unit_dir.parent.parent if unit_dir is not None else tmp_path / "xdg-config"
        ),
        "UAP_PROXY_URL": proxy_url,
    }
    if sim is not None:
        env["UAPPLACE_SIM_GPU"] = str(sim.path)
    paths = Paths.from_env(env)
    events = Recorder()
    client = ProxyClient(paths.proxy_url, None)

    async def reload_units() -> bool:
        await units.reload()
        return True

    controller = Controller.open(
        paths,
        events=events,
        proxy=ProxyHolders(client),
        reload_units=reload_units if unit_dir is not None else no_manager_to_reload,
    )
    try:
        await controller.start()
        stack = await attach_enforcement(controller, paths, client, units=units, timeouts=timeouts)
    except BaseException:
        await controller.shutdown(wait_s=GUARD_S)
        raise
    return Wired(paths, controller, stack, events)


async def build_world(
    tmp_path: Path,
    units: UnitManager,
    unit_files: UnitFiles,
    sim: SimGpu,
    *,
    alpha_args: Sequence[str] = (),
    alpha_service: str = "",
    beta_args: Sequence[str] = (),
    timeouts: Timeouts = FAST,
    alpha_mib: int = ALPHA_MIB,
    beta_mib: int = BETA_MIB,
    unit_dir: Path | None = None,
    orphan: bool = False,
) -> World:
    """``unit_dir``: as :func:`wire_controller` takes it.
    ``orphan``: alpha's engine leaves a child holding its memory that outlives it
    (``KillMode=process``), its PID in ``orphan_pidfile`` (:meth:`World.orphan_pid`)."""
    orphan_pidfile = tmp_path / "orphan.pid"
    if orphan:
        pidfile = ["--orphan-pidfile", str(orphan_pidfile), "--orphan-lifetime", "60"]
        alpha_args = [*alpha_args, "--orphan", *pidfile]
        alpha_service = "\n".join(filter(None, [alpha_service, "KillMode=process"]))
    # The proxy binds first, so the free ports picked for the engines cannot be its.
    proxy = sim_proxy.FakeProxy()
    runner, proxy_url = await sim_proxy.start(proxy)
    try:
        load = ["--load-secs", "0.3", "--kv", "int8"]
        alpha = unit_files.engine(
            "alpha",
            "alpha",
            sim,
            mib=alpha_mib,
            engine_args=[*load, *alpha_args],
            service=alpha_service,
        )
        beta = unit_files.engine(
            "beta",
            "beta",
            sim,
            mib=beta_mib,
            engine_args=[*load, "--advertise", "beta-latest", *beta_args],
        )
        await units.reload()

        wired = await wire_controller(
            tmp_path,
            units,
            registry_json(alpha, beta, alpha_mib, beta_mib),
            proxy_url=proxy_url,
            timeouts=timeouts,
            policy=POLICY,
            sim=sim,
            unit_dir=unit_dir,
        )
        timeline = UnitTimeline(units, [alpha.name, beta.name])
        return World(
            units=units,
            unit_files=unit_files,
            sim=sim,
            paths=wired.paths,
            controller=wired.controller,
            host=ControllerHost(wired.controller),
            enforcer=wired.stack.enforcer,
            sync=wired.stack.sync,
            proxy=proxy,
            events=wired.events,
            timeline=timeline,
            alpha=alpha,
            beta=beta,
            runner=runner,
            orphan_pidfile=orphan_pidfile,
        )
    except BaseException:
        await runner.cleanup()
        raise


async def close_world(world: World) -> None:
    async with asyncio.timeout(GUARD_S):  # a watcher that ignores its cancel fails, not hangs
        await world.sync.close()
    await world.controller.shutdown(wait_s=GUARD_S)
    await world.runner.cleanup()
    world.kill_orphan()
