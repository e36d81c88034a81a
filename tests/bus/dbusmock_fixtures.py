"""Private D-Bus buses and python-dbusmock services for the bus tier.

Fixtures (import them into a test module or a conftest):

- ``session_bus`` / ``system_bus`` (per test session): the address of a private
  ``dbus-daemon`` of that type. Nothing in the test process's environment is
  changed; pass the address on.
- ``notification_daemon`` / ``polkitd`` (per test): python-dbusmock's template of
  that name on the private bus, as a :class:`MockService`; stopped at teardown,
  and the teardown waits until its bus name is free again, so the next test on
  the same bus starts with no daemon.

Outside pytest, :func:`private_bus` and :func:`spawn_template` do the same.
``MockService`` talks to the mock through dbus-python (synchronous: fine inside
an async test, since the mock is another process).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import dbus
import dbus.bus
import pytest
from dbusmock.mockobject import MOCK_IFACE, load_module

BusKind = Literal["session", "system"]
STARTUP_TIMEOUT_S = 10.0
POLL_S = 0.02


def bus_config(kind: BusKind, socket: Path) -> str:
    """A bus of ``kind`` on ``socket`` where anyone may own and send to anything."""
    return f"""<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>{kind}</type>
  <listen>unix:path={socket}</listen>
  <auth>EXTERNAL</auth>
  <policy context="default">
    <allow user="*"/>
    <allow own="*"/>
    <allow send_destination="*" eavesdrop="true"/>
    <allow eavesdrop="true"/>
  </policy>
</busconfig>
"""


def stop_process(process: subprocess.Popen[Any], grace_s: float = 5.0) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for stream in (process.stdout, process.stderr):
        if stream is not None:
            stream.close()


@contextmanager
def private_bus(kind: BusKind, directory: Path) -> Iterator[str]:
    """Run a ``dbus-daemon`` of ``kind`` with its socket in ``directory``; yield its address."""
    config = directory / f"{kind}-bus.conf"
    config.write_text(bus_config(kind, directory / f"{kind}-bus"), encoding="utf-8")
    with (directory / f"{kind}-bus.log").open("wb") as bus_log:
        process = subprocess.Popen(
            ["dbus-daemon", f"--config-file={config}", "--nofork", "--print-address=1"],
            stdout=subprocess.PIPE,
            stderr=bus_log,
        )
    try:
        assert process.stdout is not None
        address = process.stdout.readline().decode().strip()
        if not address:
            raise RuntimeError(f"dbus-daemon ({kind}) printed no address; config {config}")
        yield address
    finally:
        stop_process(process)


def plain(value: Any) -> Any:
    """dbus-python values → plain Python (lists, dicts, tuples, str, int, bool, float)."""
    if isinstance(value, dbus.Boolean):
        return bool(value)
    if isinstance(value, dbus.Dictionary | dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, dbus.Struct | tuple):
        return tuple(plain(v) for v in value)
    if isinstance(value, dbus.Array | list):
        return [plain(v) for v in value]
    if isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return value


@dataclass
class MockService:
    """A running python-dbusmock template, and a handle on its mock interface."""

    template: str
    bus_name: str
    object_path: str
    address: str
    process: subprocess.Popen[bytes]
    log_path: Path
    connection: Any
    stopped: bool = False

    def call(self, member: str, *args: Any, interface: str = MOCK_IFACE) -> Any:
        """Call ``member`` on the mock's main object (the mock control interface by default)."""
        obj = self.connection.get_object(self.bus_name, self.object_path)
        return plain(obj.get_dbus_method(member, interface)(*args))

    def calls(self, method: str) -> list[list[Any]]:
        """Arguments of every logged call of ``method``, oldest first."""
        return [list(args) for _, args in self.call("GetMethodCalls", method)]

    def emit(self, name: str, signature: str, *args: Any) -> None:
        """Emit signal ``name`` from the main object on its main interface."""
        self.call("EmitSignal", "", name, signature, list(args))

    def has_owner(self) -> bool:
        return bool(self.connection.name_has_owner(self.bus_name))

    def stop(self) -> None:
        """Stop the mock and wait until its name is free; a second call does nothing."""
        if self.stopped:
            return
        self.stopped = True
        stop_process(self.process)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.has_owner():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.bus_name} still owned after its mock exited")
            time.sleep(POLL_S)
        self.connection.close()


def spawn_template(
    template: str,
    address: str,
    log_dir: Path,
    *,
    system: bool | None = None,
    parameters: str | None = None,
) -> MockService:
    """Start ``python -m dbusmock --template <template>`` on the bus at ``address``.

    ``system`` picks the bus type the mock believes it is on (default: the
    template's own choice); ``parameters`` is the template's JSON parameters.
    Returns once the mock owns its bus name.
    """
    module = load_module(template)
    on_system = bool(module.SYSTEM_BUS) if system is None else system
    env = dict(os.environ)
    env["DBUS_SYSTEM_BUS_ADDRESS" if on_system else "DBUS_SESSION_BUS_ADDRESS"] = address
    log_path = log_dir / f"{template}.log"
    argv = [sys.executable, "-m", "dbusmock", "--template", template, "-l", str(log_path)]
    argv.append("--system" if on_system else "--session")
    if parameters is not None:
        argv += ["--parameters", parameters]
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    connection = dbus.bus.BusConnection(address)
    mock = MockService(
        template, module.BUS_NAME, module.MAIN_OBJ, address, process, log_path, connection
    )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not mock.has_owner():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            _, errors = process.communicate()
            connection.close()
            raise RuntimeError(f"dbusmock {template} did not come up: {errors.decode().strip()}")
        time.sleep(POLL_S)
    return mock


@contextmanager
def template_running(template: str, address: str, log_dir: Path) -> Iterator[MockService]:
    """:func:`spawn_template` for the block; the mock is stopped when it ends."""
    mock = spawn_template(template, address, log_dir)
    try:
        yield mock
    finally:
        mock.stop()


@pytest.fixture(scope="session")
def session_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with private_bus("session", tmp_path_factory.mktemp("session-bus")) as address:
        yield address


@pytest.fixture(scope="session")
def system_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with private_bus("system", tmp_path_factory.mktemp("system-bus")) as address:
        yield address


@pytest.fixture
def notification_daemon(session_bus: str, tmp_path: Path) -> Iterator[MockService]:
    with template_running("notification_daemon", session_bus, tmp_path) as mock:
        yield mock


@pytest.fixture
def polkitd(system_bus: str, tmp_path: Path) -> Iterator[MockService]:
    with template_running("polkitd", system_bus, tmp_path) as mock:
        yield mock
