"""The simulated GPU: a JSON state file that stands in for NVML.

docs/architecture.md ("Simulated GPU and fake engine").

The file lists devices (``uuid``, ``name``, ``total_mib``) and allocations
(``pid``, ``used_mib``, ``uuid``, ``command``). Fake engines :meth:`SimGpu.claim`
memory at start and :meth:`SimGpu.release` it at exit; the device probe reads
the file through the same output type as NVML, so the daemon cannot tell the
difference.

Like a real GPU, the memory of a process that no longer exists is free:
:meth:`SimGpu.read` ignores allocations of dead (or zombie) PIDs, and every
write drops them from the file. A claim that does not fit fails the way
``cudaMalloc`` does (:class:`SimGpuOutOfMemory`).

Several fake engines claim concurrently, so every write holds ``fcntl.flock``
on the sidecar ``<path>.lock`` and replaces the file atomically.

Command line, for the demo and for humans::

    python -m uapplace.sim.gpu create PATH --device 24576 [--device 16384]
    python -m uapplace.sim.gpu show PATH [--json]
    python -m uapplace.sim.gpu claim PATH UUID PID MIB [--command TEXT]
    python -m uapplace.sim.gpu release PATH PID
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from uapplace.files import jsonfile
from uapplace.files.jsonfile import ConfigFileError, LockTimeout, atomic_write, exclusive_lock
from uapplace.files.ledger import describe_validation_error

SIM_UUID_PREFIX = "GPU-sim-"
LOCK_TIMEOUT_S = 10.0


class SimGpuError(Exception):
    """A missing or invalid state file, an unknown device, or a bad argument."""


class SimGpuFileError(ConfigFileError, SimGpuError):
    """The state file is unreadable, over 4 MiB, nested too deep, not JSON, or holds a
    number that is not finite (:mod:`uapplace.files.jsonfile`); names file and JSON path."""


class SimGpuOutOfMemory(SimGpuError):
    """A claim larger than the device's free memory (the simulated ``cudaMalloc`` failure)."""


@dataclass(frozen=True)
class SimDevice:
    uuid: str
    name: str
    total_mib: int


@dataclass(frozen=True)
class SimAllocation:
    pid: int
    used_mib: float
    uuid: str
    command: str = ""


@dataclass(frozen=True)
class SimState:
    """Devices in file order, and the allocations of live PIDs."""

    devices: tuple[SimDevice, ...]
    allocations: tuple[SimAllocation, ...]

    def device(self, uuid: str) -> SimDevice | None:
        return next((d for d in self.devices if d.uuid == uuid), None)

    def allocations_on(self, uuid: str) -> tuple[SimAllocation, ...]:
        return tuple(a for a in self.allocations if a.uuid == uuid)

    def used_mib(self, uuid: str) -> float:
        return sum(a.used_mib for a in self.allocations_on(uuid))

    def free_mib(self, uuid: str) -> float:
        device = self.device(uuid)
        if device is None:
            return 0.0
        return max(0.0, device.total_mib - self.used_mib(uuid))


def sim_uuid(index: int) -> str:
    """The UUID :meth:`SimGpu.create` gives the device at ``index``: ``GPU-sim-0000``."""
    return f"{SIM_UUID_PREFIX}{index:04d}"


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a zombie holds no GPU memory)."""
    if pid <= 0:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


# --------------------------------------------------------------------------- file schema


class _DeviceFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    uuid: str = Field(min_length=1)
    name: str = ""
    total_mib: int = Field(ge=0)


class _AllocationFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pid: int = Field(gt=0)
    used_mib: float = Field(ge=0)
    uuid: str = Field(min_length=1)
    command: str = ""


class _StateFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Literal[1] = 1
    devices: list[_DeviceFile]
    allocations: list[_AllocationFile] = []


def _state_from_json(data: Any, path: Path) -> SimState:
    try:
        parsed = _StateFile.model_validate(data)
    except ValidationError as err:
        raise SimGpuError(f"{path}: {describe_validation_error(err)}") from None
    devices = tuple(SimDevice(d.uuid, d.name, d.total_mib) for d in parsed.devices)
    seen: set[str] = set()
    for index, device in enumerate(devices):
        if device.uuid in seen:
            raise SimGpuError(f"{path}: devices[{index}].uuid: duplicate uuid {device.uuid!r}")
        seen.add(device.uuid)
    allocations = []
    for index, alloc in enumerate(parsed.allocations):
        if alloc.uuid not in seen:
            raise SimGpuError(
                f"{path}: allocations[{index}].uuid: no device with uuid {alloc.uuid!r}"
            )
        allocations.append(SimAllocation(alloc.pid, alloc.used_mib, alloc.uuid, alloc.command))
    return SimState(devices, tuple(allocations))


def _state_to_json(state: SimState) -> dict[str, Any]:
    return {
        "version": 1,
        "devices": [
            {"uuid": d.uuid, "name": d.name, "total_mib": d.total_mib} for d in state.devices
        ],
        "allocations": [
            {"pid": a.pid, "used_mib": a.used_mib, "uuid": a.uuid, "command": a.command}
            for a in state.allocations
        ],
    }


def _only_live(state: SimState) -> SimState:
    return SimState(state.devices, tuple(a for a in state.allocations if pid_alive(a.pid)))


# --------------------------------------------------------------------------- the state file


class SimGpu:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.lock_path = self.path.with_name(self.path.name + ".lock")

    def create(self, devices: Sequence[tuple[str, int] | SimDevice]) -> SimState:
        """Write a fresh state file: no allocations. ``(name, total_mib)`` pairs get
        the UUIDs ``GPU-sim-0000``, ``GPU-sim-0001``… in order."""
        built = tuple(_as_device(index, spec) for index, spec in enumerate(devices))
        if not built:
            raise SimGpuError(f"{self.path}: a simulated GPU needs at least one device")
        state = _state_from_json(_state_to_json(SimState(built, ())), self.path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self._write(state)
        return state

    def read(self) -> SimState:
        """Devices and the allocations of live PIDs. No lock: writes replace atomically."""
        return _only_live(self._read_file())

    def claim(self, uuid: str, pid: int, mib: float, command: str = "") -> None:
        """Allocate ``mib`` on ``uuid`` for ``pid`` (added to what ``pid`` holds there)."""
        if mib < 0:
            raise SimGpuError(f"claim: mib must be >= 0, got {mib}")
        if pid <= 0:
            raise SimGpuError(f"claim: pid must be positive, got {pid}")

        def add(state: SimState) -> SimState:
            device = state.device(uuid)
            if device is None:
                known = ", ".join(d.uuid for d in state.devices)
                raise SimGpuError(f"{self.path}: no device with uuid {uuid!r} (have {known})")
            free = state.free_mib(uuid)
            if mib > free:
                raise SimGpuOutOfMemory(
                    f"{self.path}: out of memory on {uuid}: pid {pid} asked for {mib:g} MiB, "
                    f"{free:g} MiB free of {device.total_mib} MiB"
                )
            held = next((a for a in state.allocations if a.pid == pid and a.uuid == uuid), None)
            others = tuple(a for a in state.allocations if a is not held)
            total = mib + (held.used_mib if held else 0.0)
            label = command or (held.command if held else "")
            return SimState(state.devices, (*others, SimAllocation(pid, total, uuid, label)))

        self._mutate(add)

    def release(self, pid: int) -> None:
        """Free everything ``pid`` holds, on every device. Unknown PIDs are a no-op."""

        def drop(state: SimState) -> SimState:
            return SimState(state.devices, tuple(a for a in state.allocations if a.pid != pid))

        self._mutate(drop)

    # ----------------------------------------------------------------- internals

    def _read_file(self) -> SimState:
        try:
            raw = jsonfile.read_capped_or_none(self.path)
            if raw is None:
                raise self._missing()
            data = jsonfile.parse_json(raw, self.path)
        except ConfigFileError as err:
            raise SimGpuFileError(err.file, err.json_path, err.message) from None
        return _state_from_json(data, self.path)

    def _mutate(self, change: Callable[[SimState], SimState]) -> None:
        with self._locked():
            # Dead PIDs' memory is free on a real GPU, so the file forgets them too.
            state = change(_only_live(self._read_file()))
            self._write(state)

    def _write(self, state: SimState) -> None:
        text = jsonfile.dumps(_state_to_json(state), indent=2) + "\n"
        atomic_write(self.path, text, mode=0o644, sync=False)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        if not self.path.parent.is_dir():
            raise self._missing()
        try:
            with exclusive_lock(self.lock_path, LOCK_TIMEOUT_S):
                yield
        except LockTimeout as err:
            raise SimGpuError(str(err)) from None

    def _missing(self) -> SimGpuError:
        return SimGpuError(
            f"{self.path}: no simulated GPU state file; create one with "
            f"`python -m uapplace.sim.gpu create {self.path} --device 24576`"
        )


def _as_device(index: int, spec: tuple[str, int] | SimDevice) -> SimDevice:
    if isinstance(spec, SimDevice):
        return spec
    name, total_mib = spec
    return SimDevice(sim_uuid(index), name or f"Simulated GPU {index}", int(total_mib))


# --------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m uapplace.sim.gpu", description="Simulated GPU state file."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="write a fresh state file")
    create.add_argument("path", type=Path)
    create.add_argument(
        "--device",
        action="append",
        required=True,
        metavar="MIB",
        type=_positive_int,
        help="total MiB of one device; repeat for more devices",
    )
    show = sub.add_parser("show", help="print devices and live allocations")
    show.add_argument("path", type=Path)
    show.add_argument("--json", action="store_true", help="print the live state as JSON")
    claim = sub.add_parser("claim", help="allocate MiB on a device for a PID")
    claim.add_argument("path", type=Path)
    claim.add_argument("uuid")
    claim.add_argument("pid", type=_positive_int)
    claim.add_argument("mib", type=float)
    claim.add_argument("--command", default="", dest="label")
    release = sub.add_parser("release", help="free everything a PID holds")
    release.add_argument("path", type=Path)
    release.add_argument("pid", type=_positive_int)
    return parser


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def _show(state: SimState) -> str:
    lines = []
    for device in state.devices:
        lines.append(
            f"{device.uuid}  {device.name}  total {device.total_mib} MiB  "
            f"used {state.used_mib(device.uuid):g} MiB  free {state.free_mib(device.uuid):g} MiB"
        )
        for alloc in state.allocations_on(device.uuid):
            lines.append(f"    pid {alloc.pid}  {alloc.used_mib:g} MiB  {alloc.command}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    sim = SimGpu(args.path)
    try:
        if args.command == "create":
            state = sim.create([("", mib) for mib in args.device])
            print(_show(state))
        elif args.command == "show":
            state = sim.read()
            print(json.dumps(_state_to_json(state), indent=2) if args.json else _show(state))
        elif args.command == "claim":
            sim.claim(args.uuid, args.pid, args.mib, args.label)
        elif args.command == "release":
            sim.release(args.pid)
    except SimGpuError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
