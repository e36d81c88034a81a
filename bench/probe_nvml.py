"""Print what the NVML probe reads on this machine; run by hand on a GPU machine.

    .venv/bin/python bench/probe_nvml.py [--allocate-mib 1024] [--reads 20]

1. Reads every GPU NVML counts, bound by index (``gpu0``, ``gpu1``…), and again
   bound by the UUID the first read reported, and prints both as ledger JSON.
2. Times ``probe.read()`` over ``--reads`` reads (mean and worst, in ms).
3. If ``torch`` or ``cupy`` is importable and sees a GPU, allocates
   ``--allocate-mib`` on it and checks that the probe sees this PID holding at
   least that much and the device's free memory drop; then frees it.

Exit status 0 when every check that could run passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from uapplace.core.model import Device, DeviceKind, DeviceReading, ProbeSource
from uapplace.files.ledger import reading_to_json
from uapplace.io.devices import MIB, NvmlProbe, gpu_usage_of


def gpu_count() -> int:
    try:
        pynvml = importlib.import_module("pynvml")
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception as err:
        print(f"NVML cannot count GPUs: {type(err).__name__}: {err}")
        return 0


def show(title: str, readings: dict[str, DeviceReading]) -> None:
    print(f"== {title}")
    print(json.dumps({k: reading_to_json(r) for k, r in readings.items()}, indent=2))


def time_reads(probe: NvmlProbe, reads: int) -> None:
    took = []
    for _ in range(reads):
        start = time.perf_counter()
        probe.read()
        took.append((time.perf_counter() - start) * 1000)
    print(
        f"== probe.read(): mean {sum(took) / len(took):.2f} ms, worst {max(took):.2f} ms "
        f"over {reads} reads"
    )


def allocator() -> tuple[str, Callable[[int], Any]] | None:
    """``(library, allocate(mib) -> buffer)`` on the first visible GPU, if any."""
    try:
        torch = importlib.import_module("torch")
        if torch.cuda.is_available():

            def with_torch(mib: int) -> Any:
                buffer = torch.empty(mib * MIB, dtype=torch.uint8, device="cuda:0")
                torch.cuda.synchronize()
                return buffer

            return "torch", with_torch
    except ImportError:
        pass
    try:
        cupy = importlib.import_module("cupy")

        def with_cupy(mib: int) -> Any:
            buffer = cupy.empty(mib * MIB, dtype=cupy.uint8)
            cupy.cuda.Device(0).synchronize()
            return buffer

        return "cupy", with_cupy
    except ImportError:
        return None


def self_allocation_check(probe: NvmlProbe, mib: int) -> bool:
    found = allocator()
    if found is None:
        print("== self-allocation: skipped (neither torch with CUDA nor cupy is importable)")
        return True
    library, allocate = found
    me = os.getpid()
    before = probe.read()
    buffer = allocate(mib)
    after = probe.read()
    held = gpu_usage_of(after, [me])
    print(f"== self-allocation with {library}: {mib} MiB; this PID ({me}) holds {held}")
    ok = True
    if not held:
        print("FAIL: NVML does not list this PID (a container's PID namespace hides it?)")
        ok = False
    elif max(held.values()) < mib:
        print(f"FAIL: NVML reports less than the {mib} MiB allocated")
        ok = False
    drops = {k: before[k].free_mib - after[k].free_mib for k in after if k in before}
    print(f"   free memory drop per device (MiB): { {k: round(v, 1) for k, v in drops.items()} }")
    if not any(drop >= mib * 0.99 for drop in drops.values()):
        print("FAIL: no device's free memory dropped by the allocation")
        ok = False
    del buffer
    print("PASS" if ok else "self-allocation check failed")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--allocate-mib", type=int, default=1024)
    parser.add_argument("--reads", type=int, default=20)
    args = parser.parse_args()

    count = gpu_count()
    by_index = [Device(f"gpu{i}", DeviceKind.GPU, 0, 0) for i in range(max(count, 1))]
    probe = NvmlProbe(by_index)
    first = probe.read()
    show(f"bound by index ({count} GPU(s) counted)", first)
    if all(r.source is ProbeSource.ABSENT for r in first.values()):
        print("no GPU readable through NVML: every device reported absent (see error)")
        return 1 if count else 0

    by_uuid = [
        Device(f"gpu{i}", DeviceKind.GPU, 0, 0, uuid=r.uuid)
        for i, r in enumerate(first.values())
        if r.uuid
    ]
    uuid_readings = NvmlProbe(by_uuid).read()
    show("bound by uuid", uuid_readings)
    ok = all(uuid_readings[k].uuid == first[k].uuid for k in uuid_readings)
    print("uuid binding matches index binding" if ok else "FAIL: uuid binding differs")

    time_reads(probe, args.reads)
    return 0 if self_allocation_check(probe, args.allocate_mib) and ok else 1


if __name__ == "__main__":
    sys.exit(main())
