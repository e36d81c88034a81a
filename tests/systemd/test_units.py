"""UnitManager against a real, contained systemd --user running the fake engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.systemd.conftest import GUARD_S, UnitFiles, eventually
from uapplace.io import engines
from uapplace.io.units import UnitManager, UnitState, write_conflict_dropins
from uapplace.sim.gpu import SimGpu, pid_alive
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd


def held(sim: SimGpu) -> list[tuple[int, float]]:
    return [(a.pid, a.used_mib) for a in sim.read().allocations]


class Changes:
    """Collects on_change deliveries and lets a test await a condition on them."""

    def __init__(self, units: UnitManager) -> None:
        self.seen: list[tuple[str, UnitState]] = []
        self._changed = asyncio.Event()
        units.on_change(self._record)

    def _record(self, unit: str, state: UnitState) -> None:
        self.seen.append((unit, state))
        self._changed.set()

    def states_of(self, unit: str) -> list[str]:
        return [s.active_state for name, s in self.seen if name == unit]

    async def until(self, condition: Callable[[], bool]) -> None:
        async with asyncio.timeout(GUARD_S):
            while not condition():
                self._changed.clear()
                await self._changed.wait()


async def test_start_and_stop_the_fake_engine(
    units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> None:
    engine = unit_files.engine("a", "qwen", sim_gpu, mib=4096)
    await units.reload()

    started = await units.start_unit(engine.name.removesuffix(".service"), timeout=GUARD_S)
    assert (started.unit, started.result, started.ok) == (engine.name, "done", True)
    assert started.job is not None and started.job.startswith("/org/freedesktop/systemd1/job/")

    state = await units.state(engine.name)
    assert (state.active_state, state.sub_state, state.load_state) == (
        "active",
        "running",
        "loaded",
    )
    assert "-m uapplace.sim.engine --port" in state.exec_start
    assert "--model-id qwen --gpu-uuid GPU-sim-0000 --mib 4096" in state.exec_start
    assert await units.pids(engine.name) == [state.main_pid]
    assert await engines.wait_healthy(engine.endpoint, time.monotonic() + GUARD_S)
    assert await engines.served_ids(engine.endpoint) == ["qwen"]
    assert held(sim_gpu) == [(state.main_pid, 4096.0)]

    stopped = await units.stop_unit(engine.name, timeout=GUARD_S)
    assert (stopped.result, stopped.ok) == ("done", True)
    after = await units.state(engine.name)
    assert (after.active_state, after.main_pid, after.result) == ("inactive", 0, "success")
    assert await units.pids(engine.name) == []
    assert held(sim_gpu) == []


async def test_a_start_that_cannot_exec_fails(units: UnitManager, unit_files: UnitFiles) -> None:
    name = unit_files.raw("noexec", "Type=exec\nExecStart=/nonexistent/engine --port 1")
    await units.reload()

    outcome = await units.start_unit(name, timeout=GUARD_S)

    assert (outcome.result, outcome.ok) == ("failed", False)
    state = await units.state(name)
    assert (state.active_state, state.result) == ("failed", "exit-code")


async def test_an_engine_that_exits_at_start_is_seen_failing(
    units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> None:
    # Type=exec: the job is done once exec() worked; the exit comes after.
    # Callers must watch the unit (on_change) while they wait for /health.
    engine = unit_files.engine("crash", "q", sim_gpu, mib=100, engine_args=["--fail-at-start"])
    await units.reload()
    changes = Changes(units)

    outcome = await units.start_unit(engine.name, timeout=GUARD_S)
    assert outcome.result == "done"
    await changes.until(lambda: "failed" in changes.states_of(engine.name))

    assert (await units.state(engine.name)).result == "exit-code"
    assert held(sim_gpu) == []


async def test_unknown_unit_is_an_error_outcome_and_not_found_state(units: UnitManager) -> None:
    outcome = await units.start_unit("no-such-unit", timeout=GUARD_S)

    assert (outcome.unit, outcome.result, outcome.job) == ("no-such-unit.service", "error", None)
    assert "no-such-unit.service not found" in outcome.detail
    assert (await units.state("no-such-unit")).load_state == "not-found"
    assert await units.pids("no-such-unit") == []


async def test_our_deadline_gives_timeout_and_a_stop_cancels_the_job(
    units: UnitManager, unit_files: UnitFiles
) -> None:
    name = unit_files.raw("slow", "Type=exec\nExecStartPre=/bin/sleep 30\nExecStart=/bin/sleep 60")
    await units.reload()

    outcome = await units.start_unit(name, timeout=0.3)
    assert (outcome.result, outcome.job) == ("timeout", None)
    assert (await units.state(name)).active_state == "activating"

    stopped = await units.stop_unit(name, timeout=GUARD_S)
    assert stopped.result == "done"
    assert (await units.state(name)).active_state in ("inactive", "failed")


async def test_on_change_sees_units_started_and_stopped_by_hand(
    units: UnitManager, unit_files: UnitFiles, user_manager: ContainedUserManager
) -> None:
    name = unit_files.raw("byhand", "Type=exec\nExecStart=/bin/sleep 60")
    await units.reload()
    changes = Changes(units)

    async def systemctl(*args: str) -> None:
        proc = await asyncio.create_subprocess_exec(
            "systemctl", "--user", *args, env=user_manager.client_env()
        )
        assert await proc.wait() == 0

    await systemctl("start", name)
    await changes.until(lambda: "active" in changes.states_of(name))
    running = [s for n, s in changes.seen if n == name and s.active_state == "active"][-1]
    assert running.sub_state == "running"
    assert running.main_pid > 0

    await systemctl("stop", name)
    await changes.until(lambda: changes.states_of(name)[-1] == "inactive")
    assert changes.states_of(name)[-1] == "inactive"
    assert not pid_alive(running.main_pid)


async def test_conflicts_make_systemd_swap_units_on_one_device(
    units: UnitManager, unit_files: UnitFiles, user_manager: ContainedUserManager, sim_gpu: SimGpu
) -> None:
    # 2 × 16 GiB never fit the 24 GiB device: B can only claim once A has
    # released, so B coming up healthy proves systemd stopped A first.
    a = unit_files.engine("a", "model-a", sim_gpu, mib=16384)
    b = unit_files.engine("b", "model-b", sim_gpu, mib=16384)
    written = write_conflict_dropins(user_manager.unit_dir, {"gpu0": [a.name, b.name]})
    assert len(written) == 2
    await units.reload()

    assert (await units.start_unit(a.name, timeout=GUARD_S)).ok
    assert await engines.wait_healthy(a.endpoint, time.monotonic() + GUARD_S)

    assert (await units.start_unit(b.name, timeout=GUARD_S)).ok
    assert await engines.wait_healthy(b.endpoint, time.monotonic() + GUARD_S)

    assert (await units.state(a.name)).active_state == "inactive"
    b_state = await units.state(b.name)
    assert b_state.active_state == "active"
    assert held(sim_gpu) == [(b_state.main_pid, 16384.0)]

    # And back: starting A stops B.
    assert (await units.start_unit(a.name, timeout=GUARD_S)).ok
    assert (await units.state(b.name)).active_state == "inactive"
    assert await engines.wait_healthy(a.endpoint, time.monotonic() + GUARD_S)


async def test_without_conflicts_both_run_and_the_second_cannot_claim(
    units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu
) -> None:
    a = unit_files.engine("a", "model-a", sim_gpu, mib=16384)
    b = unit_files.engine("b", "model-b", sim_gpu, mib=16384)
    await units.reload()
    changes = Changes(units)

    assert (await units.start_unit(a.name, timeout=GUARD_S)).ok
    assert await engines.wait_healthy(a.endpoint, time.monotonic() + GUARD_S)
    assert (await units.start_unit(b.name, timeout=GUARD_S)).ok
    await changes.until(lambda: "failed" in changes.states_of(b.name))

    assert (await units.state(a.name)).active_state == "active"


def test_dropin_writer_refuses_malicious_names_in_the_unit_dir(
    user_manager: ContainedUserManager,
) -> None:
    before = sorted(p.name for p in user_manager.unit_dir.iterdir())
    for bad in ("../escape", "a/b", "x\ny", "two words", ".."):
        with pytest.raises(ValueError, match="invalid unit name"):
            write_conflict_dropins(user_manager.unit_dir, {"gpu0": ["ok", bad]})
    assert sorted(p.name for p in user_manager.unit_dir.iterdir()) == before
    assert not (user_manager.config_home / "systemd" / "escape.service.d").exists()


async def test_an_orphan_outlives_its_unit_with_killmode_process(
    units: UnitManager, unit_files: UnitFiles, sim_gpu: SimGpu, tmp_path: Path
) -> None:
    pidfile = tmp_path / "orphan.pid"
    orphan_args = ["--orphan", "--orphan-pidfile", str(pidfile), "--orphan-lifetime", "60"]
    engine = unit_files.engine(
        "orphan", "q", sim_gpu, mib=8192, engine_args=orphan_args, service="KillMode=process"
    )
    await units.reload()
    assert (await units.start_unit(engine.name, timeout=GUARD_S)).ok
    assert await engines.wait_healthy(engine.endpoint, time.monotonic() + GUARD_S)
    await eventually(pidfile.exists)
    orphan = int(pidfile.read_text())
    try:
        main_pid = (await units.state(engine.name)).main_pid
        assert sorted(await units.pids(engine.name)) == sorted([main_pid, orphan])

        assert (await units.stop_unit(engine.name, timeout=GUARD_S)).ok

        # The unit is inactive, its main process gone, yet the VRAM is held:
        # the orphan stays in the unit's cgroup and on the GPU.
        assert (await units.state(engine.name)).active_state == "inactive"
        assert not pid_alive(main_pid)
        assert held(sim_gpu) == [(orphan, 8192.0)]
        assert await units.pids(engine.name) == [orphan]
    finally:
        os.kill(orphan, signal.SIGKILL)
    await eventually(lambda: not pid_alive(orphan))
    assert held(sim_gpu) == []
