"""Tier 3 fixtures: a contained ``systemd --user``, units running the fake engine.

docs/architecture.md ("Contained user manager").

- ``user_manager`` (session): one :class:`ContainedUserManager` for the whole
  tier. Skips with the reason from ``can_contain()`` where it cannot run; fails
  instead when ``UAPPLACE_REQUIRE_SYSTEMD=1`` (CI).
- ``units``: a connected :class:`UnitManager` on that manager's bus.
- ``machine``: those three and ``tmp_path`` in one :class:`Machine`, for a test module's
  own world fixture.
- ``sim_gpu``: a fresh simulated GPU (one 24576 MiB device, ``GPU-sim-0000``).
- ``unit_files``: writes unit files (fake engine or raw), and at the end of the
  test stops every unit it wrote, removes the files and reloads, so tests
  sharing the session manager do not see each other's units.
- ``world_options``: keyword options for the world a test builds (empty unless a
  test's module overrides it, or an indirect parametrize gives them).
- ``built_world``: :mod:`tests.systemd.placement_world`'s machine, nothing started;
  ``alpha_world``: the same with ``alpha`` started and a hot resident.
- ``live``: :mod:`tests.systemd.live_world`'s machine (every part a real program).
- ``uap``: a private world for a ``uapplaced`` process (the bus tier's ``make_env``)
  on the contained manager's bus, under ``tmp_path / "uap"``.

:data:`APPLY_STEPS` is what every successful apply reports, in order.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import socket
import sys
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.bus.conftest import UapEnv, make_env
from tests.bus.dbusmock_fixtures import MockService, template_running
from tests.systemd import placement_world as placement
from tests.systemd.live_world import LiveWorld, live_world
from tests.worlds.contained import log_tail
from tests.worlds.contained import units as units  # the tier's fixture
from tests.worlds.steps import APPLY_STEPS as APPLY_STEPS  # the tier's tests import it from here
from uapplace.controller.dropins import FOLLOW_MARKER
from uapplace.io.units import UnitManager
from uapplace.sim.gpu import SimGpu, sim_uuid
from uapplace.sim.usermanager import ContainedUserManager, can_contain

SIM_DEVICE_MIB = 24576
GUARD_S = 20
"""Upper bound on any wait in this tier: a hang guard, never an assertion about speed."""


async def eventually(condition: Callable[[], bool], guard_s: float = GUARD_S) -> None:
    """Poll a condition nothing signals (a file appearing, a PID ending)."""
    async with asyncio.timeout(guard_s):
        while True:
            if condition():
                return
            await asyncio.sleep(0.02)


def require_containment() -> None:
    """Skip without a contained ``systemd --user`` here (fail under
    ``UAPPLACE_REQUIRE_SYSTEMD=1``)."""
    ok, why = can_contain()
    if not ok:
        if os.environ.get("UAPPLACE_REQUIRE_SYSTEMD") == "1":
            pytest.fail(f"UAPPLACE_REQUIRE_SYSTEMD=1 but no contained systemd --user here: {why}")
        pytest.skip(f"no contained systemd --user here: {why}")


@pytest.fixture(scope="session")
def user_manager() -> Iterator[ContainedUserManager]:
    require_containment()
    manager = ContainedUserManager()
    manager.start()
    yield manager
    manager.stop()


@pytest.fixture(autouse=True)
def no_follow_marker_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """``uapplace units`` marks the unit directory it wrote drop-ins in, and every later
    reload then rewrites them (docs/placement-rules.md); the contained manager's unit
    directory outlives each test, so a test's mark must not follow the next test."""
    yield
    if "user_manager" in request.fixturenames:
        manager: ContainedUserManager = request.getfixturevalue("user_manager")
        (manager.unit_dir / FOLLOW_MARKER).unlink(missing_ok=True)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """On a failure, attach the tail of the manager's log (its units' output included)."""
    report: pytest.TestReport = yield
    manager = getattr(item, "funcargs", {}).get("user_manager")
    if report.failed and isinstance(manager, ContainedUserManager):
        report.sections.append(("contained systemd --user log (tail)", log_tail(manager)))
    return report


@pytest.fixture
def sim_gpu(tmp_path: Path) -> SimGpu:
    gpu = SimGpu(tmp_path / "sim-gpu.json")
    gpu.create([("", SIM_DEVICE_MIB)])
    return gpu


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@dataclass(frozen=True)
class EngineUnit:
    name: str
    """``<stem>.service``."""
    port: int
    model_id: str
    path: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class UnitFiles:
    """Writes test units into the contained manager's unit directory."""

    def __init__(self, user_manager: ContainedUserManager) -> None:
        self.unit_dir = user_manager.unit_dir
        self.prefix = f"t{secrets.token_hex(3)}"
        self.written: list[str] = []

    def raw(self, stem: str, service: str, unit: str = "") -> str:
        """A unit ``<prefix>-<stem>.service`` with the given ``[Service]`` body; its name."""
        name = f"{self.prefix}-{stem}.service"
        text = f"[Unit]\nDescription=uapplace test {stem}\n{unit}\n[Service]\n{service}\n"
        (self.unit_dir / name).write_text(text, encoding="utf-8")
        self.written.append(name)
        return name

    def engine(
        self,
        stem: str,
        model_id: str,
        sim_gpu: SimGpu | None = None,
        mib: float = 0,
        engine_args: Sequence[str] = (),
        service: str = "",
        port: int | None = None,
    ) -> EngineUnit:
        """A ``Type=exec`` unit whose ExecStart is the fake engine on a free port (or on
        ``port``: two units sharing one, as behind a single-upstream proxy)."""
        port = port if port is not None else free_port()
        argv = [sys.executable, "-m", "uapplace.sim.engine", "--port", str(port)]
        argv += ["--model-id", model_id, *engine_args]
        lines = ["Type=exec", f"ExecStart={shlex.join(argv)}", "TimeoutStopSec=10"]
        if sim_gpu is not None:
            argv_gpu = ["--gpu-uuid", sim_uuid(0), "--mib", f"{mib:g}"]
            lines[1] = f"ExecStart={shlex.join([*argv, *argv_gpu])}"
            lines.append(f"Environment=UAPPLACE_SIM_GPU={sim_gpu.path}")
        if service:
            lines.append(service)
        name = self.raw(stem, "\n".join(lines))
        return EngineUnit(name, port, model_id, self.unit_dir / name)

    def remove_all(self) -> None:
        for name in self.written:
            (self.unit_dir / name).unlink(missing_ok=True)
            dropins = self.unit_dir / f"{name}.d"
            if dropins.is_dir():
                for file in dropins.iterdir():
                    file.unlink()
                dropins.rmdir()


@pytest.fixture
async def unit_files(
    user_manager: ContainedUserManager, units: UnitManager
) -> AsyncIterator[UnitFiles]:
    files = UnitFiles(user_manager)
    yield files
    for name in files.written:
        await units.stop_unit(name, timeout=15)
    files.remove_all()
    await units.reload()


@dataclass(frozen=True)
class Machine:
    """What a test builds its world on: the contained manager, a unit manager on its bus,
    the test's unit files and its own folder."""

    user_manager: ContainedUserManager
    units: UnitManager
    unit_files: UnitFiles
    tmp_path: Path

    def uap(self) -> UapEnv:
        """A private world for a ``uapplaced`` process (as the ``uap`` fixture makes)."""
        return make_env(self.tmp_path / "uap", self.user_manager.bus_address)


@pytest.fixture
def machine(
    user_manager: ContainedUserManager, units: UnitManager, unit_files: UnitFiles, tmp_path: Path
) -> Machine:
    return Machine(user_manager, units, unit_files, tmp_path)


@pytest.fixture
def uap(user_manager: ContainedUserManager, tmp_path: Path) -> UapEnv:
    """A private world for a ``uapplaced`` process on the contained manager's bus."""
    return make_env(tmp_path / "uap", user_manager.bus_address)


@pytest.fixture
def world_options(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Options for the world a test builds; tests override it with indirect parametrize."""
    return dict(getattr(request, "param", {}))


@pytest.fixture
async def built_world(
    tmp_path: Path,
    units: UnitManager,
    unit_files: UnitFiles,
    sim_gpu: SimGpu,
    world_options: dict[str, Any],
) -> AsyncIterator[placement.World]:
    """The placement machine (``build_world`` with ``world_options``), closed at the end."""
    built = await placement.build_world(tmp_path, units, unit_files, sim_gpu, **world_options)
    try:
        yield built
    finally:
        await placement.close_world(built)


@pytest.fixture
async def alpha_world(built_world: placement.World) -> placement.World:
    """The placement machine with ``alpha`` started and hot: the resident an apply displaces."""
    async with asyncio.timeout(placement.GUARD_S):
        await built_world.start_alpha()
    return built_world


@pytest.fixture
async def notifications(
    user_manager: ContainedUserManager, tmp_path: Path
) -> AsyncIterator[MockService]:
    """python-dbusmock's ``notification_daemon`` on the contained manager's bus."""
    with template_running("notification_daemon", user_manager.bus_address, tmp_path) as mock:
        yield mock


@pytest.fixture
async def live(
    user_manager: ContainedUserManager,
    units: UnitManager,
    unit_files: UnitFiles,
    tmp_path: Path,
    world_options: dict[str, Any],
) -> AsyncIterator[LiveWorld]:
    """The live machine (:func:`live_world` with ``world_options``), stopped at the end."""
    async with live_world(
        tmp_path, user_manager.bus_address, units, unit_files, **world_options
    ) as world:
        yield world
