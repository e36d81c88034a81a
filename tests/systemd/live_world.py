"""The whole path, live: engines as units, ``uapplaced`` and ``uapplace-shim`` as processes,
and the gate proxy of :mod:`uapplace.sim.gateproxy` in front of them.

The machine is the one of :mod:`tests.systemd.placement_world` (its registry and
capacity policy): ``alpha`` (14000 MiB) and ``beta`` (16000 MiB) on one simulated
24 GiB GPU, so loading ``beta`` while ``alpha`` is resident means displacing it.
Here every part is the real program:

- the engines are units of the contained ``systemd --user`` running the fake engine;
- ``uapplaced`` runs on that manager's own bus (so it wires enforcement), started
  with the bus tier's launcher (:func:`tests.bus.conftest.start_daemon`) in a
  private world (:func:`tests.bus.conftest.make_env`), its enforcement timeouts
  :data:`~tests.systemd.placement_world.FAST`;
- ``uapplace-shim`` runs in front of it (:func:`tests.bus.shim_fixtures.start_shim`);
- the gate proxy runs in the test's own loop, its ``GateClient`` pointed at the
  shim; ``UAP_PROXY_URL`` and ``PROXY_AUTH_TOKEN`` point the daemon at it, so the
  enforcement's ``drain`` and ``refresh-proxy`` steps talk to it, with the token.

Only ``alpha`` is started, before the daemon; the daemon adopts it as a resident.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp

from tests.bus.conftest import DaemonProcess, UapEnv, make_env, run_cli, start_daemon
from tests.bus.shim_fixtures import ShimProcess, start_shim
from tests.systemd.placement_world import ALPHA_MIB, BETA_MIB, FAST, POLICY, registry_json
from tests.worlds import polling
from tests.worlds.shim_view import ShimView
from uapplace.files.paths import BUS_NAME
from uapplace.files.timeouts import Timeouts
from uapplace.io.units import UnitManager
from uapplace.sim import gateproxy, serving
from uapplace.sim.gateproxy import GateProxy
from uapplace.sim.gpu import SimGpu

if TYPE_CHECKING:  # conftest imports this module (its fixtures build the world): types only here
    from tests.systemd.conftest import EngineUnit, UnitFiles

GUARD_S = 30.0
"""Upper bound on any wait: a hang guard, never an assertion about speed."""
CLI_TIMEOUT_S = 120.0
"""A hang guard for one CLI run, not a speed bound."""
PROXY_TOKEN = "live-world-proxy-token"
WIRED = "enforcement, unit sync, auto runner and idle sweep wired"


@dataclass
class LiveWorld(ShimView):
    uap: UapEnv
    daemon: DaemonProcess
    shim: ShimProcess
    proxy: GateProxy
    proxy_url: str
    alpha: EngineUnit
    beta: EngineUnit
    units: UnitManager
    http: aiohttp.ClientSession

    async def until(self, what: str, check: Callable[[], Any]) -> Any:
        """Await ``check()`` until it returns something truthy; fail with the daemon's log."""
        return await polling.until(what, check, self.daemon.log, guard_s=GUARD_S)

    # ------------------------------------------------------------- the shim

    async def resolve(
        self, placement_id: str, option: int, expected_victims: Sequence[dict[str, str]]
    ) -> tuple[int, dict[str, Any]]:
        body = {
            "placement_id": placement_id,
            "option": option,
            "expected_victims": list(expected_victims),
        }
        return await self.shim_post("/api/placement/resolve", body, self.shim.token)

    # ------------------------------------------------------------- the units

    async def active(self, unit: EngineUnit) -> str:
        return (await self.units.state(unit.name)).active_state

    def target_of(self, unit: EngineUnit) -> str:
        return f"gpu0:{unit.endpoint}"


async def cli(world: LiveWorld, *args: str) -> tuple[int, str, str]:
    """``uapplace ARGS`` against the world's daemon: exit code, stdout, stderr."""
    done = await asyncio.to_thread(run_cli, world.uap, *args, timeout=CLI_TIMEOUT_S)
    return done.returncode, done.stdout, done.stderr


def seed_daemon_files(uap: UapEnv, registry: dict[str, Any], timeouts: Timeouts) -> None:
    """What a daemon of this machine reads: ``registry``, :data:`POLICY` and ``timeouts``."""
    uap.write_registry(registry)
    (uap.config_dir / "capacity-policy.json").write_text(json.dumps(POLICY), encoding="utf-8")
    uap.home.mkdir(parents=True, exist_ok=True)
    path = uap.home / "enforcement-timeouts.json"
    path.write_text(json.dumps(timeouts.to_json()), encoding="utf-8")


def validate(world: LiveWorld) -> tuple[int, dict[str, Any]]:
    """``uapplace validate --json`` (blocking: run it in a thread): exit code, report."""
    done = run_cli(world.uap, "validate", "--json", timeout=GUARD_S)
    report: dict[str, Any] = json.loads(done.stdout)
    return done.returncode, report


@asynccontextmanager
async def live_world(
    tmp_path: Path,
    user_manager_bus: str,
    units: UnitManager,
    unit_files: UnitFiles,
    *,
    beta_args: Sequence[str] = (),
    single_upstream: bool = False,
    mibs: tuple[int, int] = (ALPHA_MIB, BETA_MIB),
) -> AsyncIterator[LiveWorld]:
    """The world above; everything it started is stopped (by PID) when the block ends.

    ``single_upstream``: the stock UAP proxy's topology (issue 13): both engines on one
    port, the registry's ``proxy.single_upstream`` naming it, and the gate proxy in its
    single-upstream mode. ``mibs``: alpha's and beta's footprints (registry and claim).
    """
    # The proxy binds first, so the free ports picked for the engines cannot be its.
    proxy_sock = serving.bind_loopback()
    daemon: DaemonProcess | None = None
    shim: ShimProcess | None = None
    runner = None
    try:
        uap = make_env(tmp_path / "uap", user_manager_bus)
        sim = SimGpu(Path(uap.env["UAPPLACE_SIM_GPU"]))
        load = ["--load-secs", "0.3", "--kv", "int8"]
        alpha = unit_files.engine("alpha", "alpha", sim, mib=mibs[0], engine_args=load)
        beta_load = [*load, "--advertise", "beta-latest", *beta_args]
        shared_port = alpha.port if single_upstream else None
        beta = unit_files.engine(
            "beta", "beta", sim, mib=mibs[1], engine_args=beta_load, port=shared_port
        )
        await units.reload()
        registry = registry_json(alpha, beta, *mibs)
        if single_upstream:
            registry["proxy"] = {"single_upstream": alpha.endpoint}
        seed_daemon_files(uap, registry, FAST)
        uap.env["UAP_PROXY_URL"] = serving.url_of(proxy_sock)
        uap.env["PROXY_AUTH_TOKEN"] = PROXY_TOKEN
        started = await units.start_unit(alpha.name, GUARD_S)
        assert started.ok, started

        daemon = await asyncio.to_thread(start_daemon, uap)
        shim = await asyncio.to_thread(start_shim, uap.env, user_manager_bus, uap.root)
        upstream = alpha.endpoint if single_upstream else None
        proxy = GateProxy(shim.base_url, PROXY_TOKEN, single_upstream=upstream)
        runner, proxy_url = await gateproxy.start(proxy, sock=proxy_sock)
        async with aiohttp.ClientSession() as http:
            world = LiveWorld(uap, daemon, shim, proxy, proxy_url, alpha, beta, units, http)
            running = daemon

            async def wired() -> bool:
                return f"owns {BUS_NAME}" in running.log()

            await world.until("uapplaced to finish wiring", wired)
            assert WIRED in daemon.log(), daemon.log()

            async def alpha_hot() -> bool:
                return (await world.resident_states()).get("alpha") == "hot"

            await world.until("alpha to be a hot resident", alpha_hot)
            yield world
    finally:
        if runner is not None:
            await runner.cleanup()
        else:
            proxy_sock.close()
        shim_code = await asyncio.to_thread(shim.stop) if shim is not None else 0
        daemon_code = await asyncio.to_thread(daemon.stop) if daemon is not None else 0
    assert shim_code == 0, f"uapplace-shim exited {shim_code}"
    assert daemon_code == 0, f"uapplaced exited {daemon_code}"
