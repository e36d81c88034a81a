"""Device probes: NVML (through a fake pynvml module), the simulated GPU, host RAM."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil
import pytest

from uapplace.core.model import (
    Device,
    DeviceKind,
    DeviceReading,
    ProbeSource,
    ProcessUsage,
    Registry,
)
from uapplace.files.paths import Paths
from uapplace.io.devices import (
    MIB,
    HostProbe,
    NvmlProbe,
    SimProbe,
    gpu_index,
    gpu_usage_of,
    make_probe,
    process_rss_mib,
)
from uapplace.sim.gpu import SimDevice, SimGpu


def gpu(key: str, uuid: str | None = None) -> Device:
    return Device(key, DeviceKind.GPU, 24576, 1024, uuid=uuid)


CPU0 = Device("cpu0", DeviceKind.CPU, 131072, 8192)


# --------------------------------------------------------------------------- a fake pynvml


class FakeNvmlError(Exception):
    """Stands in for pynvml.NVMLError (its str is the NVML error string)."""


@dataclass
class FakeGpu:
    uuid: str
    total: int
    free: int
    processes: list[tuple[int, int | None]] = field(default_factory=list)
    name: str | None = None
    """``None``: this fake NVML has no ``nvmlDeviceGetName`` answer for the card."""


@dataclass
class FakeMemory:
    total: int
    free: int
    used: int


@dataclass
class FakeProcess:
    pid: int
    usedGpuMemory: int | None  # pynvml's field name


class FakeNvml:
    """The pynvml calls NvmlProbe makes, over a list of fake GPUs."""

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.init_calls = 0
        self.shutdown_calls = 0
        self.handle_lookups = 0
        self.fail_init: str | None = None
        self.fail_memory: str | None = None

    def nvmlInit(self) -> None:
        self.init_calls += 1
        if self.fail_init:
            raise FakeNvmlError(self.fail_init)

    def nvmlShutdown(self) -> None:
        self.shutdown_calls += 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        self.handle_lookups += 1
        for index, fake in enumerate(self.gpus):
            if fake.uuid == uuid:
                return index
        raise FakeNvmlError("Not Found")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.handle_lookups += 1
        if not 0 <= index < len(self.gpus):
            raise FakeNvmlError("Invalid Argument")
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.gpus[handle].uuid.encode()

    def nvmlDeviceGetName(self, handle: int) -> bytes:
        name = self.gpus[handle].name
        if name is None:
            raise FakeNvmlError("Not Supported")
        return name.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> FakeMemory:
        if self.fail_memory:
            raise FakeNvmlError(self.fail_memory)
        fake = self.gpus[handle]
        return FakeMemory(fake.total, fake.free, fake.total - fake.free)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[FakeProcess]:
        return [FakeProcess(pid, used) for pid, used in self.gpus[handle].processes]


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu("GPU-aaaa", 24576 * MIB, 20000 * MIB, [(os.getpid(), 4096 * MIB)]),
            FakeGpu("GPU-bbbb", 16384 * MIB, 16000 * MIB, [(999_999_999, None)]),
        ]
    )


# --------------------------------------------------------------------------- NVML probe


def test_index_binding_reads_each_gpu() -> None:
    nvml = two_gpus()
    readings = NvmlProbe([gpu("gpu0"), gpu("gpu1"), CPU0], nvml=nvml).read()

    assert list(readings) == ["gpu0", "gpu1"]
    first = readings["gpu0"]
    assert first.source is ProbeSource.NVML
    assert (first.total_mib, first.free_mib) == (24576.0, 20000.0)
    assert first.uuid == "GPU-aaaa"
    assert first.error is None
    [mine] = first.processes
    assert (mine.pid, mine.used_mib) == (os.getpid(), 4096.0)
    assert mine.command == " ".join(psutil.Process().cmdline())
    # A PID NVML lists but psutil cannot see, with no per-process figure.
    assert readings["gpu1"].processes == (ProcessUsage(999_999_999, 0.0, ""),)


def test_uuid_binding_wins_over_the_index_in_the_key() -> None:
    nvml = two_gpus()
    readings = NvmlProbe([gpu("gpu0", uuid="GPU-bbbb"), gpu("gpu1", uuid="GPU-aaaa")], nvml).read()
    assert (readings["gpu0"].uuid, readings["gpu0"].total_mib) == ("GPU-bbbb", 16384.0)
    assert (readings["gpu1"].uuid, readings["gpu1"].total_mib) == ("GPU-aaaa", 24576.0)


def test_initialises_once_and_keeps_the_handles() -> None:
    nvml = two_gpus()
    probe = NvmlProbe([gpu("gpu0"), gpu("gpu1", uuid="GPU-bbbb")], nvml=nvml)
    probe.read()
    nvml.gpus[0].free = 100 * MIB
    again = probe.read()
    assert again["gpu0"].free_mib == 100.0
    assert (nvml.init_calls, nvml.handle_lookups) == (1, 2)


def test_unknown_uuid_is_absent_and_the_others_still_read() -> None:
    nvml = two_gpus()
    readings = NvmlProbe([gpu("gpu0"), gpu("gpu1", uuid="GPU-gone"), gpu("gpu7")], nvml).read()
    assert readings["gpu0"].source is ProbeSource.NVML
    gone = readings["gpu1"]
    assert gone.source is ProbeSource.ABSENT
    assert (gone.total_mib, gone.free_mib, gone.processes) == (0.0, 0.0, ())
    assert gone.uuid == "GPU-gone"
    assert gone.error == "NVML: no GPU at uuid GPU-gone: FakeNvmlError: Not Found"
    assert readings["gpu7"].error == "NVML: no GPU at index 7: FakeNvmlError: Invalid Argument"
    assert nvml.init_calls == 1  # a wrong binding is not an NVML failure


def test_key_without_index_or_uuid_is_absent() -> None:
    readings = NvmlProbe([gpu("bigcard")], nvml=two_gpus()).read()
    assert readings["bigcard"].source is ProbeSource.ABSENT
    assert "no uuid and no index in the key" in (readings["bigcard"].error or "")


def test_nvml_error_reports_absent_then_reinitialises() -> None:
    nvml = two_gpus()
    probe = NvmlProbe([gpu("gpu0"), gpu("gpu1")], nvml=nvml)
    probe.read()

    nvml.fail_memory = "GPU is lost"
    failed = probe.read()
    assert {r.source for r in failed.values()} == {ProbeSource.ABSENT}
    assert failed["gpu0"].error == "NVML: reading index 0 failed: FakeNvmlError: GPU is lost"
    assert nvml.shutdown_calls == 1

    nvml.fail_memory = None
    recovered = probe.read()
    assert {r.source for r in recovered.values()} == {ProbeSource.NVML}
    assert nvml.init_calls == 2


def test_init_failure_reports_every_gpu_absent() -> None:
    nvml = two_gpus()
    nvml.fail_init = "Driver Not Loaded"
    probe = NvmlProbe([gpu("gpu0"), gpu("gpu1", uuid="GPU-bbbb")], nvml=nvml)
    readings = probe.read()
    assert readings == {
        "gpu0": DeviceReading(
            "gpu0",
            DeviceKind.GPU,
            0.0,
            0.0,
            ProbeSource.ABSENT,
            error="NVML unavailable: FakeNvmlError: Driver Not Loaded",
        ),
        "gpu1": DeviceReading(
            "gpu1",
            DeviceKind.GPU,
            0.0,
            0.0,
            ProbeSource.ABSENT,
            uuid="GPU-bbbb",
            error="NVML unavailable: FakeNvmlError: Driver Not Loaded",
        ),
    }
    nvml.fail_init = None
    assert probe.read()["gpu1"].source is ProbeSource.NVML


def test_no_library_reports_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    readings = NvmlProbe([gpu("gpu0")]).read()
    assert readings["gpu0"].source is ProbeSource.ABSENT
    assert readings["gpu0"].error == (
        "NVML unavailable: the pynvml module (nvidia-ml-py) is not installed"
    )


def test_real_pynvml_never_raises() -> None:
    reading = NvmlProbe([gpu("gpu0")]).read()["gpu0"]
    if reading.source is ProbeSource.ABSENT:
        assert reading.error
    else:
        assert reading.source is ProbeSource.NVML
        assert reading.total_mib > 0


def test_gpu_index() -> None:
    assert [gpu_index(k) for k in ("gpu0", "gpu1", "gpu12", "gpu")] == [0, 1, 12, None]


# --------------------------------------------------------------------------- simulated GPU


@pytest.fixture
def sim(tmp_path: Path) -> SimGpu:
    gpu_file = SimGpu(tmp_path / "sim-gpu.json")
    gpu_file.create(
        [SimDevice("GPU-aaaa", "A", 24576), SimDevice("GPU-bbbb", "B", 16384)],
    )
    return gpu_file


def test_sim_probe_reads_like_nvml(sim: SimGpu) -> None:
    sim.claim("GPU-aaaa", os.getpid(), 4576, "engine")
    devices = [gpu("gpu0"), gpu("gpu1", uuid="GPU-bbbb")]
    simulated = SimProbe(sim, devices).read()

    nvml = FakeNvml(
        [
            FakeGpu("GPU-aaaa", 24576 * MIB, 20000 * MIB, [(os.getpid(), 4576 * MIB)], "A"),
            FakeGpu("GPU-bbbb", 16384 * MIB, 16384 * MIB, name="B"),
        ]
    )
    real = NvmlProbe(devices, nvml=nvml, command_of=lambda pid: "engine").read()

    assert {r.source for r in simulated.values()} == {ProbeSource.SIM}
    assert [r.name for r in real.values()] == ["A", "B"]  # a measurement's device identity
    assert {key: replace(r, source=ProbeSource.NVML) for key, r in simulated.items()} == real


def test_sim_probe_unbound_or_missing_file_is_absent(sim: SimGpu, tmp_path: Path) -> None:
    readings = SimProbe(sim, [gpu("gpu2"), gpu("gpu0", uuid="GPU-zzzz")]).read()
    assert readings["gpu2"].error == f"simulated GPU {sim.path}: no device at index 2"
    assert readings["gpu0"].error == f"simulated GPU {sim.path}: no device at uuid GPU-zzzz"

    missing = SimProbe(SimGpu(tmp_path / "none.json"), [gpu("gpu0")]).read()["gpu0"]
    assert missing.source is ProbeSource.ABSENT
    assert "none.json" in (missing.error or "")


def test_sim_probe_frees_memory_of_exited_processes(sim: SimGpu) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        sim.claim("GPU-bbbb", child.pid, 16000)
        probe = SimProbe(sim, [gpu("gpu1")])
        assert probe.read()["gpu1"].free_mib == 384
    finally:
        child.kill()
        child.wait()
    assert probe.read()["gpu1"].free_mib == 16384


# --------------------------------------------------------------------------- host, composition


def test_host_probe_reads_memavailable() -> None:
    reading = HostProbe([gpu("gpu0"), CPU0]).read()
    assert list(reading) == ["cpu0"]
    host = reading["cpu0"]
    memory = psutil.virtual_memory()
    assert host.source is ProbeSource.MEMAVAILABLE
    assert host.total_mib == memory.total / MIB
    assert 0 < host.free_mib <= host.total_mib
    assert host.processes == ()


def test_make_probe_uses_the_simulated_gpu_when_set(sim: SimGpu, tmp_path: Path) -> None:
    registry = Registry(devices={"cpu0": CPU0, "gpu0": gpu("gpu0"), "gpu1": gpu("gpu1")}, models={})
    env = {"HOME": str(tmp_path), "UAPPLACE_SIM_GPU": str(sim.path)}
    readings = make_probe(Paths.from_env(env), registry).read()
    assert list(readings) == ["cpu0", "gpu0", "gpu1"]
    assert [r.source for r in readings.values()] == [
        ProbeSource.MEMAVAILABLE,
        ProbeSource.SIM,
        ProbeSource.SIM,
    ]
    assert readings["gpu1"].uuid == "GPU-bbbb"


def test_make_probe_uses_nvml_otherwise(tmp_path: Path) -> None:
    registry = Registry(devices={"gpu0": gpu("gpu0"), "cpu0": CPU0}, models={})
    readings = make_probe(Paths.from_env({"HOME": str(tmp_path)}), registry).read()
    assert readings["gpu0"].source in (ProbeSource.NVML, ProbeSource.ABSENT)
    assert readings["gpu0"].source is not ProbeSource.ABSENT or readings["gpu0"].error
    assert readings["cpu0"].source is ProbeSource.MEMAVAILABLE


# --------------------------------------------------------------------------- per-PID figures


def test_process_rss_skips_missing_and_repeated_pids() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    mine = psutil.Process().memory_info().rss / MIB
    measured = process_rss_mib([os.getpid(), os.getpid(), child.pid])
    assert measured > 0
    # Our own RSS can move a little between the two reads; the dead PID adds nothing.
    assert abs(measured - mine) < 64
    assert process_rss_mib([child.pid]) == 0.0


def test_gpu_usage_of_sums_per_device() -> None:
    readings: dict[str, Any] = {
        "gpu0": DeviceReading(
            "gpu0",
            DeviceKind.GPU,
            24576,
            1000,
            ProbeSource.SIM,
            (ProcessUsage(10, 1000.0), ProcessUsage(11, 500.0), ProcessUsage(12, 7.0)),
        ),
        "gpu1": DeviceReading(
            "gpu1", DeviceKind.GPU, 16384, 16384, ProbeSource.NVML, (ProcessUsage(11, 0.0),)
        ),
        "cpu0": DeviceReading("cpu0", DeviceKind.CPU, 1, 1, ProbeSource.MEMAVAILABLE),
    }
    assert gpu_usage_of(readings, [10, 11]) == {"gpu0": 1500.0, "gpu1": 0.0}
    assert gpu_usage_of(readings, [99]) == {}
