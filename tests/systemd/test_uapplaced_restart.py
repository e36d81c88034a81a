"""The installed ``uapplaced.service`` comes back by itself when the daemon loses its bus.

Issue 11: a daemon whose bus connection died used to end ``inactive`` with
``Result=success`` under the ``Type=dbus`` unit (systemd stops a ``Type=dbus``
service whose name vanished, and its SIGTERM made the daemon exit 0), so
``Restart=on-failure`` never fired. Now a lost bus is exit 1 whatever signal
follows, and the shipped unit restarts it.

Real parts only: the unit is installed with ``uapplace install`` on the
contained ``systemd --user`` and started by D-Bus activation (the ``installed``
fixture of ``test_uapplaced_unit.py``). The bus connection is cut from outside
the way a dying bus would: the test takes a copy of each of the daemon's
sockets connected to the user bus (``pidfd_getfd``, Linux ≥ 5.6) and shuts it
down, so ``dbus-daemon`` and the daemon both see the connection end. Then a
``SIGKILL`` of the new daemon. After each, the manager must have restarted the
unit (``NRestarts`` up by one, a new ``MainPID``) and ``Admit`` must answer.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.systemd.conftest import GUARD_S
from tests.systemd.test_uapplaced_unit import UNIT, installed, run, show
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

__all__ = ["installed"]  # the fixture, imported for pytest
SYS_PIDFD_GETFD = 438
"""The same number on every Linux architecture (syscalls added after 5.1 are unified)."""
POLL_S = 0.1


def admit(env: dict[str, str], client: str) -> str:
    done = run(
        env, "busctl", "--user", "call", BUS_NAME, OBJECT_PATH, INTERFACE,
        "Admit", "sssu", "beta", client, "s", "0",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def running(env: dict[str, str]) -> dict[str, str]:
    return show(env, "ActiveState", "MainPID", "NRestarts", "Result")


def wait_for_restart(env: dict[str, str], old_pid: str, restarts: int) -> dict[str, str]:
    """Until the unit runs again under a new PID, having been restarted once more."""
    deadline = time.monotonic() + 3 * GUARD_S
    while True:
        state = running(env)
        if (
            state["ActiveState"] == "active"
            and state["MainPID"] not in ("0", old_pid)
            and int(state["NRestarts"]) == restarts + 1
        ):
            return state
        if time.monotonic() > deadline:
            raise AssertionError(f"uapplaced.service was not restarted: {state}")
        time.sleep(POLL_S)


def bus_sockets_of(pid: int, bus_path: str) -> Iterator[socket.socket]:
    """Copies of ``pid``'s sockets whose peer is the bus socket at ``bus_path``."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for entry in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                if not os.readlink(entry).startswith("socket:"):
                    continue
            copy = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(entry.name), 0)
            if copy < 0:
                continue
            sock = socket.socket(fileno=copy)
            try:
                is_bus = sock.family == socket.AF_UNIX and sock.getpeername() == bus_path
            except OSError:
                is_bus = False
            if is_bus:
                yield sock
            else:
                sock.close()
    finally:
        os.close(pidfd)


def cut_bus_connection(pid: int, bus_address: str) -> int:
    """Shut down every bus connection of ``pid``; how many there were."""
    bus_path = bus_address.removeprefix("unix:path=").split(",")[0]
    cut = 0
    for sock in bus_sockets_of(pid, bus_path):
        with sock:
            sock.shutdown(socket.SHUT_RDWR)
        cut += 1
    return cut


def test_a_lost_bus_connection_and_a_sigkill_are_both_restarted(
    installed: dict[str, str], user_manager: ContainedUserManager
) -> None:
    env = installed
    admit(env, "restart-client")
    first = running(env)
    assert first["ActiveState"] == "active", first
    restarts = int(first["NRestarts"])
    pid = int(first["MainPID"])

    assert cut_bus_connection(pid, user_manager.bus_address) >= 1
    second = wait_for_restart(env, first["MainPID"], restarts)
    assert "park" in admit(env, "restart-client")  # the new daemon answers, same pending id
    log = user_manager.log_path.read_text(encoding="utf-8", errors="replace")
    assert "lost the bus connection" in log

    os.kill(int(second["MainPID"]), signal.SIGKILL)
    third = wait_for_restart(env, second["MainPID"], restarts + 1)
    assert third["ActiveState"] == "active"
    assert "park" in admit(env, "restart-client")


def test_a_clean_stop_is_not_restarted(installed: dict[str, str]) -> None:
    env = installed
    admit(env, "clean-stop-client")
    restarts = int(running(env)["NRestarts"])
    assert run(env, "systemctl", "--user", "stop", UNIT).returncode == 0
    stopped = show(env, "ActiveState", "Result", "NRestarts")
    assert stopped == {"ActiveState": "inactive", "Result": "success", "NRestarts": str(restarts)}
