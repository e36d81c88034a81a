"""Tier 2: a private ``dbus-daemon`` and the real ``uapplaced`` process on it.

Fixtures and helpers:

- ``bus_address`` (per module): a private session bus (``dbusmock_fixtures.private_bus``).
- ``uap_env`` (per module): private directories for everything the daemon and the CLI
  read (``UAP_HOME``, ``UAPPLACE_CONFIG_DIR`` with the test registry below,
  ``UAPPLACE_SIM_GPU`` with one simulated 24 GiB GPU, ``XDG_*``), no system bus
  (same-uid authorization), and a proxy URL where nothing listens.
- ``daemon`` (per module): ``python -m uapplace.daemon`` on that bus, up once it owns
  ``org.uap.Placement1``; stopped with SIGTERM (by PID) at the end.
- :func:`make_env` / :func:`start_daemon` for tests that need their own daemon
  (seeded ledger, corrupt files, restarts), :func:`alpha_resident_daemon` for one that
  starts with the seeded ``alpha`` resident; :func:`run_cli` runs ``python -m uapplace.cli``;
  :func:`busctl` runs the real ``busctl`` against the private bus.

Tests on a shared daemon use their own client names and models so they never depend
on each other's pending entries.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.bus.dbusmock_fixtures import private_bus
from tests.worlds.seed_docs import alpha_ledger, alpha_model, beta_model
from uapplace.bus.client import PlacementClient
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.files.registry import local_measurements
from uapplace.sim.gpu import SimGpu, sim_uuid

STARTUP_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
POLL_S = 0.05
SIM_GPU_MIB = 24576


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


SEEDED_PORT = free_port()
SEEDED_ENDPOINT = f"http://127.0.0.1:{SEEDED_PORT}"
"""Where the seeded ledgers' ``alpha`` resident serves: :func:`seeded_engine` runs the fake
engine there, because the daemon forwards only to a resident it verified (publication)."""

TEST_REGISTRY: dict[str, Any] = {
    "version": 1,
    "devices": {
        "gpu0": {
            "kind": "gpu",
            "name": "Simulated GPU 0",
            "total_mib": SIM_GPU_MIB,
            "reserved_mib": 1024,
            "uuid": sim_uuid(0),
        },
        "cpu0": {"kind": "cpu", "total_mib": 65536, "reserved_mib": 1024},
    },
    "models": {
        "alpha": alpha_model(SEEDED_ENDPOINT, rails=1, advertises=["alpha-chat"]),
        "beta": beta_model(),
        "gamma": {
            "display": "Gamma",
            "engine": "llama.cpp",
            "unit": "uap-gamma",
            "rails": 1,
            "configs": {"gamma-x": {"status": "unmeasured"}},
        },
    },
}


def _need(binary: str) -> None:
    if shutil.which(binary) is None:
        pytest.skip(f"{binary} is not installed (scripts/setup-system.sh installs it)")


@dataclass
class UapEnv:
    """One private world: directories, environment, bus address."""

    root: Path
    env: dict[str, str]
    bus_address: str

    @property
    def home(self) -> Path:
        return Path(self.env["UAP_HOME"])

    @property
    def ledger(self) -> Path:
        return self.home / "placement.json"

    @property
    def config_dir(self) -> Path:
        return Path(self.env["UAPPLACE_CONFIG_DIR"])

    @property
    def registry(self) -> Path:
        return self.config_dir / "model-registry.json"

    @property
    def local_registry(self) -> Path:
        return self.home / "model-registry.json"

    def write_registry(self, document: dict[str, Any]) -> None:
        """The repo file, and this sandbox machine's measurements in the local file.

        Measured figures count only from the machine-local file (docs/placement-rules.md §4.1), so a
        sandbox that wants placeable models records them there, as ``measure`` would.
        """
        self.home.mkdir(parents=True, exist_ok=True)
        self.registry.write_text(json.dumps(document, indent=2), encoding="utf-8")
        local = json.dumps(local_measurements(document), indent=2)
        self.local_registry.write_text(local, encoding="utf-8")

    def seed_ledger(self, document: dict[str, Any]) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        self.ledger.write_text(json.dumps(document, indent=2), encoding="utf-8")

    def read_ledger(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.ledger.read_text(encoding="utf-8"))
        return data


def make_env(root: Path, bus_address: str) -> UapEnv:
    """Private directories, the test registry, a simulated GPU; nothing shared with the host."""
    dirs = {name: root / name for name in ("home", "config", "runtime", "xdg-config", "xdg-data")}
    for path in dirs.values():
        path.mkdir(parents=True, exist_ok=True)
    dirs["runtime"].chmod(0o700)
    (dirs["config"] / "capacity-policy.json").write_text(json.dumps({"services": []}))
    sim = root / "sim-gpu.json"
    SimGpu(sim).create([("Simulated GPU 0", SIM_GPU_MIB)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBUS_", "UAP", "XDG_"))}
    env.update(
        {
            "DBUS_SESSION_BUS_ADDRESS": bus_address,
            "UAP_HOME": str(dirs["home"]),
            "UAPPLACE_CONFIG_DIR": str(dirs["config"]),
            "UAPPLACE_SIM_GPU": str(sim),
            "UAPPLACE_SYSTEM_BUS_ADDRESS": "",
            "UAP_PROXY_URL": "http://127.0.0.1:9",
            "XDG_RUNTIME_DIR": str(dirs["runtime"]),
            "XDG_CONFIG_HOME": str(dirs["xdg-config"]),
            "XDG_DATA_HOME": str(dirs["xdg-data"]),
            "HOME": str(root),
            "PYTHONUNBUFFERED": "1",
            "COLUMNS": "200",
        }
    )
    uap = UapEnv(root, env, bus_address)
    uap.write_registry(TEST_REGISTRY)
    return uap


def busctl(address: str, *args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["busctl", f"--address={address}", *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=check,
    )


def call(
    address: str, method: str, signature: str = "", *args: str
) -> subprocess.CompletedProcess[str]:
    """``busctl call org.uap.Placement1 /org/uap/Placement1 org.uap.Placement1 METHOD …``."""
    argv = ["call", BUS_NAME, OBJECT_PATH, INTERFACE, method]
    if signature:
        argv += [signature, *args]
    return busctl(address, *argv)


def call_json(address: str, method: str, signature: str = "", *args: str) -> list[Any]:
    """The reply body of a busctl call with ``--json=short`` (fails the test on an error)."""
    argv = ["--json=short", "call", BUS_NAME, OBJECT_PATH, INTERFACE, method]
    if signature:
        argv += [signature, *args]
    done = busctl(address, *argv)
    assert done.returncode == 0, done.stderr
    data: list[Any] = json.loads(done.stdout)["data"]
    return data


def ask_bus(
    address: str, member: str, name: str, *options: str
) -> subprocess.CompletedProcess[str]:
    """``busctl [options] call`` to the bus itself (``org.freedesktop.DBus``): ``member(name)``."""
    bus = ("org.freedesktop.DBus", "/org/freedesktop/DBus", "org.freedesktop.DBus")
    return busctl(address, *options, "call", *bus, member, "s", name)


def name_has_owner(address: str, name: str = BUS_NAME) -> bool:
    return ask_bus(address, "NameHasOwner", name).stdout.strip() == "b true"


@dataclass
class DaemonProcess:
    process: subprocess.Popen[bytes]
    log_path: Path
    uap: UapEnv

    @property
    def pid(self) -> int:
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def signal(self, number: int) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, number)

    def stop(self) -> int:
        """SIGTERM by PID, wait; SIGKILL if it hangs (and fail loudly then)."""
        self.signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"uapplaced ignored SIGTERM; log:\n{self.log()}") from None


def spawn_daemon(uap: UapEnv, name: str = "uapplaced") -> DaemonProcess:
    log_path = uap.root / f"{name}-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "uapplace.daemon", "--log-level", "DEBUG"],
            env=uap.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return DaemonProcess(process, log_path, uap)


def start_daemon(uap: UapEnv) -> DaemonProcess:
    """Start uapplaced and return once it owns the bus name (or fail with its log)."""
    daemon = spawn_daemon(uap)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not name_has_owner(uap.bus_address):
        if daemon.process.poll() is not None:
            raise AssertionError(f"uapplaced exited {daemon.process.returncode}:\n{daemon.log()}")
        if time.monotonic() > deadline:
            daemon.process.kill()
            daemon.process.wait()
            raise AssertionError(f"uapplaced did not take {BUS_NAME}:\n{daemon.log()}")
        time.sleep(POLL_S)
    return daemon


def run_cli(
    uap: UapEnv, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "uapplace.cli", *args],
        env=env or uap.env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def wait_until(predicate: Any, what: str, timeout: float = 10.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what}")
        time.sleep(POLL_S)


@contextlib.contextmanager
def seeded_engine_running(directory: Path) -> Iterator[None]:
    """The fake engine behind :data:`SEEDED_ENDPOINT`, serving ``alpha``, its output in
    ``directory/engine.log``; stopped (by PID) when the block ends."""
    log_path = directory / "engine.log"
    env = {k: v for k, v in os.environ.items() if k != "UAPPLACE_SIM_GPU"}
    argv = [sys.executable, "-m", "uapplace.sim.engine", "--port", str(SEEDED_PORT)]
    argv += ["--model-id", "alpha", "--advertise", "alpha-chat"]
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(
            lambda: (
                "listening on" in log_path.read_text(errors="replace") or process.poll() is not None
            ),
            "the seeded fake engine to listen",
            timeout=STARTUP_TIMEOUT_S,
        )
        assert process.poll() is None, log_path.read_text(errors="replace")
        yield
    finally:
        process.terminate()
        process.wait(timeout=STOP_TIMEOUT_S)


@pytest.fixture(scope="session", autouse=True)
def seeded_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The fake engine behind :data:`SEEDED_ENDPOINT`, serving ``alpha``, for the whole tier.

    A daemon restored from a ledger that names ``alpha`` there verifies it (``/health``,
    ``/v1/models``) before it forwards; tests wait with :func:`wait_published`.
    """
    with seeded_engine_running(tmp_path_factory.mktemp("seeded-engine")):
        yield


def wait_published(address: str, model: str = "alpha") -> None:
    """Until the daemon has verified ``model`` and publishes it ``hot`` (``Residents``)."""

    def hot() -> bool:
        rows = busctl(address, "get-property", BUS_NAME, OBJECT_PATH, INTERFACE, "Residents")
        return f'"{model}"' in rows.stdout and '"hot"' in rows.stdout

    wait_until(hot, f"{model} to pass verify-up and be published hot", timeout=STARTUP_TIMEOUT_S)


@contextlib.contextmanager
def alpha_resident_daemon(root: Path, bus_address: str, **env: str) -> Iterator[DaemonProcess]:
    """uapplaced in :func:`make_env`'s world under ``root`` (``env``: more variables), restored
    from a ledger with ``alpha`` resident at :data:`SEEDED_ENDPOINT`, once it publishes alpha
    hot; stopped when the block ends, exiting 0."""
    uap = make_env(root, bus_address)
    uap.env.update(env)
    uap.seed_ledger(alpha_ledger(SEEDED_ENDPOINT))
    started = start_daemon(uap)
    try:
        wait_published(bus_address)
        yield started
    finally:
        assert started.stop() == 0, started.log()


@pytest.fixture(scope="module")
def bus_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    _need("dbus-daemon")
    _need("busctl")
    with private_bus("session", tmp_path_factory.mktemp("bus")) as address:
        yield address


@pytest.fixture(scope="module")
def uap_env(tmp_path_factory: pytest.TempPathFactory, bus_address: str) -> UapEnv:
    return make_env(tmp_path_factory.mktemp("uap"), bus_address)


@pytest.fixture(scope="module")
def daemon(uap_env: UapEnv) -> Iterator[DaemonProcess]:
    started = start_daemon(uap_env)
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture
async def client(daemon: DaemonProcess) -> AsyncIterator[PlacementClient]:
    """A :class:`PlacementClient` on the module's daemon, disconnected after the test."""
    connected = await PlacementClient.connect(daemon.uap.bus_address)
    try:
        yield connected
    finally:
        connected.disconnect()
