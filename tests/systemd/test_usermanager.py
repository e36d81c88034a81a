"""The contained systemd --user: where it runs, and that it leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from uapplace.sim.usermanager import ContainedUserManager, can_contain, reap_stale_cgroups

pytestmark = pytest.mark.systemd


def cgroup_of(pid: int) -> dict[str, str]:
    lines = Path(f"/proc/{pid}/cgroup").read_text().splitlines()
    return {controllers: path for _, controllers, path in (x.split(":", 2) for x in lines)}


def systemctl(manager: ContainedUserManager, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["systemctl", "--user", *args],
        env=manager.client_env(),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def assert_nothing_left(
    cgroups: list[Path], pids: list[int], base: Path, pid1_cgroups: dict[str, str]
) -> None:
    assert cgroups, "the manager created no cgroup at all"
    assert [c for c in cgroups if c.exists()] == []
    assert [p for p in pids if not gone(p)] == []
    assert not base.exists()
    assert not Path("/run/systemd/system").exists()
    assert cgroup_of(1) == pid1_cgroups


@pytest.fixture
def manager() -> ContainedUserManager:
    ok, why = can_contain()
    if not ok:
        if os.environ.get("UAPPLACE_REQUIRE_SYSTEMD") == "1":
            pytest.fail(f"UAPPLACE_REQUIRE_SYSTEMD=1 but: {why}")
        pytest.skip(why)
    return ContainedUserManager(name_prefix="uapplace-test-um")


def test_manager_is_contained(manager: ContainedUserManager) -> None:
    pid1_before = cgroup_of(1)
    with manager:
        mine = cgroup_of(manager.pid)
        systemd_key = "name=systemd" if "name=systemd" in mine else ""
        assert mine[systemd_key].startswith(f"/{manager.name}/")
        # A private mount namespace, with /run/systemd/system only inside it.
        assert os.readlink(f"/proc/{manager.pid}/ns/mnt") != os.readlink("/proc/self/ns/mnt")
        assert Path(f"/proc/{manager.pid}/root/run/systemd/system").is_dir()
        assert not Path("/run/systemd/system").exists()
        assert cgroup_of(1) == pid1_before
        assert (manager.runtime_dir.stat().st_mode & 0o777) == 0o700
        assert manager.env["DBUS_SESSION_BUS_ADDRESS"] == f"unix:path={manager.runtime_dir}/bus"
        # (not is-system-running: outside the namespace it sees no
        # /run/systemd/system and answers "offline" without asking)
        state = systemctl(manager, "show", "-P", "SystemState").stdout.strip()
        assert state in ("running", "degraded")


def test_stop_leaves_no_process_no_cgroup_no_directory(manager: ContainedUserManager) -> None:
    pid1_before = cgroup_of(1)
    manager.start()
    base = manager.base_dir
    (manager.unit_dir / "busy.service").write_text("[Service]\nExecStart=/bin/sleep 300\n")
    assert systemctl(manager, "daemon-reload").returncode == 0
    assert systemctl(manager, "start", "busy.service").returncode == 0
    busy = int(systemctl(manager, "show", "-P", "MainPID", "busy.service").stdout)
    bus = int(systemctl(manager, "show", "-P", "MainPID", "dbus.service").stdout)
    pids = [manager.pid, busy, bus]
    cgroups = manager.cgroups
    assert all(not gone(p) for p in pids)

    manager.stop()

    assert_nothing_left(cgroups, pids, base, pid1_before)


def test_stop_cleans_up_after_a_killed_manager(manager: ContainedUserManager) -> None:
    # SIGKILL leaves the manager no chance to stop its units: teardown must
    # still find them in our cgroups and end them.
    pid1_before = cgroup_of(1)
    manager.start()
    base = manager.base_dir
    (manager.unit_dir / "stray.service").write_text("[Service]\nExecStart=/bin/sleep 300\n")
    assert systemctl(manager, "daemon-reload").returncode == 0
    assert systemctl(manager, "start", "stray.service").returncode == 0
    stray = int(systemctl(manager, "show", "-P", "MainPID", "stray.service").stdout)
    pids = [manager.pid, stray]
    cgroups = manager.cgroups

    os.kill(manager.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(manager.pid) and not gone(manager.pid):
        assert time.monotonic() < deadline, "SIGKILL did not end the manager"
        time.sleep(0.02)
    assert not gone(stray)

    manager.stop()

    assert_nothing_left(cgroups, pids, base, pid1_before)


def test_a_dead_runs_cgroups_are_reaped_and_a_live_runs_kept(
    manager: ContainedUserManager,
) -> None:
    hierarchy = next(
        h
        for h in (
            Path("/sys/fs/cgroup/systemd"),
            Path("/sys/fs/cgroup/unified"),
            Path("/sys/fs/cgroup"),
        )
        if (h / "cgroup.procs").exists()
    )
    finished = subprocess.Popen(["true"])
    finished.wait()
    stale = hierarchy / f"uapplace-test-reap-{finished.pid}-abcdef"
    live = hierarchy / f"uapplace-test-reap-{os.getpid()}-abcdef"
    stale.mkdir()
    live.mkdir()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        (stale / "cgroup.procs").write_text(f"{sleeper.pid}\n")

        assert reap_stale_cgroups("uapplace-test-reap") == [stale]

        assert sleeper.wait(10) == -signal.SIGKILL
        assert not stale.exists()
        assert live.is_dir()
    finally:
        sleeper.kill()
        sleeper.wait(10)
        live.rmdir()
        if stale.exists():
            stale.rmdir()
