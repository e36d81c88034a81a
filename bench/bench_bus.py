"""Admit over the bus vs a bare dbus-fast echo method, on one private bus.

Starts a private ``dbus-daemon``, the real ``uapplaced`` (simulated GPU, a test
registry, one resident seeded in the ledger so ``Admit`` forwards), and a tiny
echo service (a separate process exporting ``Echo(sssu) → ssss``). Then, for
each of the two, measures

- sequential round trips on one connection: p50 / p99 latency;
- throughput with 32 concurrent callers (32 connections, one caller each).

It prints both and the ratio (target: Admit within 1.5× of the echo baseline).
Everything runs on this machine and stops by itself; run by hand:

    .venv/bin/python bench/bench_bus.py [--rounds 3] [--calls 2000] [--callers 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.annotations import DBusSignature, DBusStr, DBusUInt32
from dbus_fast.service import ServiceInterface, dbus_method

from uapplace.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.registry import local_measurements
from uapplace.sim.gpu import SimGpu, sim_uuid

ECHO_NAME = "org.uap.BenchEcho"
ECHO_PATH = "/org/uap/BenchEcho"
ECHO_INTERFACE = "org.uap.BenchEcho"
STARTUP_TIMEOUT_S = 20.0
Four = Annotated[tuple[str, str, str, str], DBusSignature("ssss")]

REGISTRY = {
    "version": 1,
    "devices": {
        "gpu0": {"kind": "gpu", "total_mib": 24576, "reserved_mib": 1024, "uuid": sim_uuid(0)},
        "cpu0": {"kind": "cpu", "total_mib": 65536, "reserved_mib": 1024},
    },
    "models": {
        "alpha": {
            "display": "Alpha",
            "engine": "llama.cpp",
            "unit": "uap-alpha",
            "endpoint": "http://127.0.0.1:18080",
            "rails": 1,
            "configs": {
                "alpha-q4": {
                    "resident_gpu_mib": 8000,
                    "host_rss_mib": 2000,
                    "kv_resident_cells": 32768,
                    "kv_mib_per_1k_cells": 10,
                    "measured_at": "2026-01-01T00:00:00Z",
                    "measured_on": "gpu0",
                }
            },
        }
    },
}
LEDGER = {
    "version": 1,
    "updated_at": "2026-01-01T00:00:00Z",
    "residents": [
        {
            "model": "alpha",
            "config": "alpha-q4",
            "device": "gpu0",
            "engine": "llama.cpp",
            "endpoint": "http://127.0.0.1:18080",
            "unit": "uap-alpha",
            "state": "hot",
            "gpu_mib": 8000,
            "host_rss_mib": 2000,
            "holders": [],
            "since": "2026-01-01T00:00:00Z",
        }
    ],
}
BUS_CONFIG = """<!DOCTYPE busconfig PUBLIC "-//freedesktop//DTD D-Bus Bus Configuration 1.0//EN"
 "http://www.freedesktop.org/standards/dbus/1.0/busconfig.dtd">
<busconfig>
  <type>session</type>
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


# --------------------------------------------------------------------------- the echo service


class Echo(ServiceInterface):
    def __init__(self) -> None:
        super().__init__(ECHO_INTERFACE)

    @dbus_method()
    def Echo(self, model: DBusStr, client: DBusStr, session: DBusStr, cells: DBusUInt32) -> Four:
        return ("forward", model, client, session)


async def serve_echo(address: str) -> None:
    bus = await MessageBus(bus_address=address).connect()
    bus.export(ECHO_PATH, Echo())
    await bus.request_name(ECHO_NAME)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    bus.disconnect()


# --------------------------------------------------------------------------- measuring


def admit_message() -> Message:
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member="Admit",
        signature="sssu",
        body=["alpha", "bench-client", "bench-session", 32768],
    )


def echo_message() -> Message:
    return Message(
        destination=ECHO_NAME,
        path=ECHO_PATH,
        interface=ECHO_INTERFACE,
        member="Echo",
        signature="sssu",
        body=["alpha", "bench-client", "bench-session", 32768],
    )


async def one_call(bus: MessageBus, make: Callable[[], Message]) -> None:
    reply = await bus.call(make())
    if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
        raise RuntimeError(f"call failed: {reply and reply.body}")


async def sequential(address: str, make: Callable[[], Message], calls: int) -> list[float]:
    bus = await MessageBus(bus_address=address).connect()
    try:
        for _ in range(min(200, calls)):  # warm up
            await one_call(bus, make)
        samples = []
        for _ in range(calls):
            started = time.perf_counter_ns()
            await one_call(bus, make)
            samples.append((time.perf_counter_ns() - started) / 1000)
        return samples
    finally:
        bus.disconnect()


async def concurrent(
    address: str, make: Callable[[], Message], callers: int, per_caller: int
) -> float:
    buses = [await MessageBus(bus_address=address).connect() for _ in range(callers)]
    try:

        async def caller(bus: MessageBus) -> None:
            for _ in range(per_caller):
                await one_call(bus, make)

        await asyncio.gather(*(one_call(bus, make) for bus in buses))  # warm up
        started = time.perf_counter()
        await asyncio.gather(*(caller(bus) for bus in buses))
        return callers * per_caller / (time.perf_counter() - started)
    finally:
        for bus in buses:
            bus.disconnect()


def percentile(samples: list[float], fraction: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


# --------------------------------------------------------------------------- processes


def start_bus(directory: Path) -> tuple[subprocess.Popen[bytes], str]:
    config = directory / "bus.conf"
    config.write_text(BUS_CONFIG.format(socket=directory / "bus"))
    process = subprocess.Popen(
        ["dbus-daemon", f"--config-file={config}", "--nofork", "--print-address=1"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    address = process.stdout.readline().decode().strip()
    if not address:
        raise RuntimeError("dbus-daemon printed no address")
    return process, address


def daemon_env(directory: Path, address: str) -> dict[str, str]:
    config, home = directory / "config", directory / "home"
    config.mkdir()
    home.mkdir()
    (config / "model-registry.json").write_text(json.dumps(REGISTRY))
    # Measured figures count only from the machine-local file (spec §4.1).
    (home / "model-registry.json").write_text(json.dumps(local_measurements(REGISTRY)))
    (config / "capacity-policy.json").write_text(json.dumps({"services": []}))
    (home / "placement.json").write_text(json.dumps(LEDGER))
    SimGpu(directory / "sim.json").create([("bench GPU", 24576)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBUS_", "UAP", "XDG_"))}
    env.update(
        {
            "DBUS_SESSION_BUS_ADDRESS": address,
            "UAP_HOME": str(home),
            "UAPPLACE_CONFIG_DIR": str(config),
            "UAPPLACE_SIM_GPU": str(directory / "sim.json"),
            "UAPPLACE_SYSTEM_BUS_ADDRESS": "",
            "UAP_PROXY_URL": "http://127.0.0.1:9",
            "XDG_RUNTIME_DIR": str(directory),
        }
    )
    return env


async def wait_for_name(address: str, name: str, process: subprocess.Popen[bytes]) -> None:
    bus = await MessageBus(bus_address=address).connect()
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            reply = await bus.call(
                Message(
                    destination="org.freedesktop.DBus",
                    path="/org/freedesktop/DBus",
                    interface="org.freedesktop.DBus",
                    member="NameHasOwner",
                    signature="s",
                    body=[name],
                )
            )
            if reply is not None and reply.body == [True]:
                return
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not appear on the bus")
            await asyncio.sleep(0.05)
    finally:
        bus.disconnect()


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


# --------------------------------------------------------------------------- main


async def measure(
    address: str, make: Callable[[], Message], args: argparse.Namespace
) -> dict[str, float]:
    samples = await sequential(address, make, args.calls)
    return {
        "p50_us": statistics.median(samples),
        "p99_us": percentile(samples, 0.99),
        "calls_per_s": await concurrent(address, make, args.callers, args.per_caller),
    }


def report(label: str, rounds: list[dict[str, float]], callers: int) -> dict[str, float]:
    """The median of each figure over the rounds (the machine is shared: rounds interleave)."""
    row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(
        f"{label:<20} p50 {row['p50_us']:7.1f} µs   p99 {row['p99_us']:7.1f} µs   "
        f"{callers} callers: {row['calls_per_s']:8.0f} calls/s"
    )
    return row


async def compare(
    address: str, args: argparse.Namespace, started: list[subprocess.Popen[bytes]]
) -> None:
    daemon, echo = started
    await wait_for_name(address, BUS_NAME, daemon)
    await wait_for_name(address, ECHO_NAME, echo)
    print(
        f"{args.rounds} interleaved rounds of {args.calls} sequential calls, then "
        f"{args.callers} callers × {args.per_caller} calls; medians over the rounds"
    )
    echo_rounds, admit_rounds = [], []
    for _ in range(args.rounds):
        echo_rounds.append(await measure(address, echo_message, args))
        admit_rounds.append(await measure(address, admit_message, args))
    baseline = report("echo (dbus-fast)", echo_rounds, args.callers)
    admit = report("Admit (uapplaced)", admit_rounds, args.callers)
    print(
        f"ratio Admit/echo: p50 {admit['p50_us'] / baseline['p50_us']:.2f}×, "
        f"p99 {admit['p99_us'] / baseline['p99_us']:.2f}×, "
        f"throughput {baseline['calls_per_s'] / admit['calls_per_s']:.2f}× (echo/Admit calls/s)"
    )


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-bus-") as raw:
        directory = Path(raw)
        bus, address = start_bus(directory)
        processes: list[subprocess.Popen[bytes]] = []
        try:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "uapplace.daemon", "--log-level", "WARNING"],
                    env=daemon_env(directory, address),
                )
            )
            processes.append(subprocess.Popen([sys.executable, __file__, "--serve-echo", address]))
            asyncio.run(compare(address, args, processes))
        finally:
            for process in processes:
                stop(process)
            stop(bus)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per target")
    parser.add_argument("--calls", type=int, default=2000, help="sequential calls per round")
    parser.add_argument("--callers", type=int, default=32, help="concurrent callers")
    parser.add_argument("--per-caller", type=int, default=200, help="calls per concurrent caller")
    parser.add_argument("--serve-echo", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_echo:
        asyncio.run(serve_echo(args.serve_echo))
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
