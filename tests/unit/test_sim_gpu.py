"""The simulated GPU state file: claims, releases, dead PIDs, concurrency, CLI."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from uapplace.sim.gpu import (
    SimDevice,
    SimGpu,
    SimGpuError,
    SimGpuOutOfMemory,
    main,
    pid_alive,
    sim_uuid,
)


@pytest.fixture
def sim(tmp_path: Path) -> SimGpu:
    gpu = SimGpu(tmp_path / "sim-gpu.json")
    gpu.create([("Sim A", 24576), ("Sim B", 16384)])
    return gpu


def test_create_names_devices_with_sim_uuids(sim: SimGpu) -> None:
    state = sim.read()
    assert [(d.uuid, d.name, d.total_mib) for d in state.devices] == [
        ("GPU-sim-0000", "Sim A", 24576),
        ("GPU-sim-0001", "Sim B", 16384),
    ]
    assert state.allocations == ()
    assert state.free_mib("GPU-sim-0000") == 24576
    on_disk = json.loads(sim.path.read_text())
    assert on_disk["devices"][1] == {"uuid": "GPU-sim-0001", "name": "Sim B", "total_mib": 16384}
    assert on_disk["allocations"] == []


def test_create_accepts_explicit_devices(tmp_path: Path) -> None:
    gpu = SimGpu(tmp_path / "nested" / "gpu.json")
    gpu.create([SimDevice("GPU-custom", "Custom", 8192)])
    assert gpu.read().device("GPU-custom") == SimDevice("GPU-custom", "Custom", 8192)


def test_claim_and_release_by_a_live_pid(sim: SimGpu) -> None:
    me = os.getpid()
    sim.claim(sim_uuid(0), me, 1000, "engine --model a")
    sim.claim(sim_uuid(0), me, 500.5)
    sim.claim(sim_uuid(1), me, 200)
    state = sim.read()
    held = state.allocations_on(sim_uuid(0))
    assert [(a.pid, a.used_mib, a.command) for a in held] == [(me, 1500.5, "engine --model a")]
    assert state.free_mib(sim_uuid(0)) == 24576 - 1500.5
    assert state.used_mib(sim_uuid(1)) == 200

    sim.release(me)
    state = sim.read()
    assert state.allocations == ()
    assert state.free_mib(sim_uuid(1)) == 16384


def test_claim_past_free_memory_fails_like_an_oom(sim: SimGpu) -> None:
    sim.claim(sim_uuid(1), os.getpid(), 16000)
    before = sim.path.read_bytes()
    with pytest.raises(SimGpuOutOfMemory, match=r"GPU-sim-0001.*384 MiB free"):
        sim.claim(sim_uuid(1), os.getpid(), 400)
    assert sim.path.read_bytes() == before


def test_claim_on_an_unknown_device_names_it(sim: SimGpu) -> None:
    with pytest.raises(SimGpuError, match=r"GPU-nope.*GPU-sim-0000, GPU-sim-0001"):
        sim.claim("GPU-nope", os.getpid(), 1)


def test_dead_and_zombie_pids_hold_nothing(sim: SimGpu) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sim.claim(sim_uuid(0), dead.pid, 5000, "gone")
        sim.claim(sim_uuid(0), zombie.pid, 3000, "orphan")
        sim.claim(sim_uuid(0), os.getpid(), 1000)
        assert sorted(a.command for a in sim.read().allocations) == ["", "orphan"]
        assert sim.read().used_mib(sim_uuid(0)) == 4000

        zombie.kill()
        # Not reaped yet: a zombie, which a real GPU has already freed.
        _wait_until_zombie(zombie.pid)
        assert not pid_alive(zombie.pid)
        state = sim.read()
        assert [a.pid for a in state.allocations] == [os.getpid()]
        assert state.free_mib(sim_uuid(0)) == 24576 - 1000
    finally:
        zombie.kill()
        zombie.wait()


def test_a_write_drops_allocations_of_dead_pids_from_the_file(sim: SimGpu) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sim.claim(sim_uuid(0), child.pid, 2000)
    finally:
        child.kill()
        child.wait()
    sim.claim(sim_uuid(0), os.getpid(), 10)
    pids = [a["pid"] for a in json.loads(sim.path.read_text())["allocations"]]
    assert pids == [os.getpid()]


def _wait_until_zombie(pid: int) -> None:
    status_file = Path(f"/proc/{pid}/stat")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if status_file.read_text().split(") ", 1)[1].startswith("Z"):
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} never became a zombie")


def _claim_many(path: str, uuid: str, pid: int, times: int) -> None:
    gpu = SimGpu(Path(path))
    for _ in range(times):
        gpu.claim(uuid, pid, 1.0)


def test_concurrent_claims_lose_nothing(sim: SimGpu) -> None:
    me = os.getpid()
    context = multiprocessing.get_context("fork")
    workers = [
        context.Process(target=_claim_many, args=(str(sim.path), sim_uuid(0), me, 50))
        for _ in range(4)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert [w.exitcode for w in workers] == [0, 0, 0, 0]
    assert sim.read().used_mib(sim_uuid(0)) == 200


def test_missing_file_says_how_to_create_one(tmp_path: Path) -> None:
    for path in (tmp_path / "absent.json", tmp_path / "no-dir" / "absent.json"):
        with pytest.raises(SimGpuError, match=r"absent\.json.*uapplace\.sim\.gpu create"):
            SimGpu(path).read()
        with pytest.raises(SimGpuError, match=r"absent\.json.*uapplace\.sim\.gpu create"):
            SimGpu(path).claim(sim_uuid(0), os.getpid(), 1)


@pytest.mark.parametrize(
    ("content", "where"),
    [
        ("{not json", "invalid JSON"),
        ('{"devices": [{"uuid": "GPU-x", "total_mib": "big"}]}', r"devices\[0\]\.total_mib"),
        (
            '{"devices": [{"uuid": "GPU-x", "total_mib": 1}],'
            ' "allocations": [{"pid": 1, "used_mib": 1, "uuid": "GPU-y"}]}',
            r"allocations\[0\]\.uuid: no device with uuid 'GPU-y'",
        ),
        (
            '{"devices": [{"uuid": "GPU-x", "total_mib": 1}, {"uuid": "GPU-x", "total_mib": 2}]}',
            r"devices\[1\]\.uuid: duplicate",
        ),
    ],
)
def test_invalid_file_is_named_with_the_json_path(tmp_path: Path, content: str, where: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(SimGpuError, match=rf"bad\.json: .*{where}"):
        SimGpu(path).read()


def test_command_line_create_show_claim_release(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "cli.json"
    assert main(["create", str(path), "--device", "24576", "--device", "16384"]) == 0
    assert "GPU-sim-0001" in capsys.readouterr().out

    assert main(["claim", str(path), sim_uuid(1), str(os.getpid()), "300", "--command", "x"]) == 0
    assert main(["show", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["allocations"] == [
        {"pid": os.getpid(), "used_mib": 300.0, "uuid": sim_uuid(1), "command": "x"}
    ]

    assert main(["claim", str(path), sim_uuid(1), str(os.getpid()), "99999"]) == 1
    assert "out of memory" in capsys.readouterr().err

    assert main(["release", str(path), str(os.getpid())]) == 0
    assert main(["show", str(path)]) == 0
    assert "free 16384 MiB" in capsys.readouterr().out


def test_module_entry_point_runs(tmp_path: Path) -> None:
    path = tmp_path / "entry.json"
    result = subprocess.run(
        [sys.executable, "-m", "uapplace.sim.gpu", "create", str(path), "--device", "8192"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert SimGpu(path).read().devices[0].total_mib == 8192
