"""Admit over the bus vs a bare dbus-fast echo method, on one private bus.

Starts a private ``dbus-daemon``, the real ``uapplaced`` (simulated GPU, a test
registry, one resident seeded in the ledger so ``Admit`` forwards), and a tiny
echo service (a separate process exporting ``Echo(sssu) → ssss``). Then, for
each of the two, measures

- sequential round trips, one connection to each, the echo and ``Admit`` calls in
  turns (so both see the same moments of a shared machine): p50 / p99 latency and
  each server's CPU per call;
- throughput with 32 concurrent callers (32 connections, one caller each).

It prints both and the ratio (target: Admit within 1.5× of the echo baseline).
Everything runs on this machine and stops by itself; run by hand:

    .venv/bin/python bench/bench_bus.py [--rounds 3] [--calls 2000] [--callers 32]
"""

from __future__ import annotations

import argparse
import asyncio
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_shim import seeded_engine  # noqa: E402
from bench.private_daemon import daemon_env, spawn_daemon, stop  # noqa: E402
from tests.bus.burst import admit_call  # noqa: E402
from tests.bus.conftest import SEEDED_ENDPOINT, wait_published  # noqa: E402
from tests.bus.dbusmock_fixtures import private_bus  # noqa: E402
from tests.worlds.seed_docs import alpha_ledger, alpha_model  # noqa: E402
from uapplace.files.paths import BUS_NAME  # noqa: E402
from uapplace.sim.gpu import sim_uuid  # noqa: E402

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
    "models": {"alpha": alpha_model(rails=1)},
}
LEDGER = alpha_ledger(SEEDED_ENDPOINT)
"""``alpha`` where :func:`bench.bench_shim.seeded_engine` serves it: Admit *forwards*."""


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
    return admit_call("alpha", "bench-client", "bench-session")


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


async def paired(address: str, calls: int) -> tuple[list[float], list[float]]:
    """``calls`` sequential echo calls and ``calls`` sequential ``Admit`` calls, in turns.

    One connection per server, one call at a time, the two alternating (which goes first
    swaps every pair), so both see the same moments of this shared machine: a burst of
    other work lands on both sides of the ratio instead of on whichever ran then."""
    echo_bus = await MessageBus(bus_address=address).connect()
    admit_bus = await MessageBus(bus_address=address).connect()
    targets = ((echo_bus, echo_message), (admit_bus, admit_message))
    try:
        for _ in range(min(200, calls)):  # warm up
            for bus, make in targets:
                await one_call(bus, make)
        samples: tuple[list[float], list[float]] = ([], [])
        for turn in range(calls):
            order = (0, 1) if turn % 2 == 0 else (1, 0)
            for index in order:
                bus, make = targets[index]
                started = time.perf_counter_ns()
                await one_call(bus, make)
                samples[index].append((time.perf_counter_ns() - started) / 1000)
        return samples
    finally:
        echo_bus.disconnect()
        admit_bus.disconnect()


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


# --------------------------------------------------------------------------- main


def on_cpu_ns(pid: int) -> int:
    """Nanoseconds the main thread of ``pid`` (the one running its loop) has spent on a CPU.

    It holds on a busy machine where latency does not: the server's own work per call."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


async def measure(
    address: str, args: argparse.Namespace, servers: tuple[int, int]
) -> tuple[dict[str, float], dict[str, float]]:
    """One round: the paired sequential calls (latency, each server's CPU per call), then
    each server's throughput under ``--callers`` concurrent callers."""
    cpu_before = [on_cpu_ns(pid) for pid in servers]
    samples = await paired(address, args.calls)
    calls_made = args.calls + min(200, args.calls)
    rows = []
    for index, make in enumerate((echo_message, admit_message)):
        cpu_us = (on_cpu_ns(servers[index]) - cpu_before[index]) / 1000 / calls_made
        rows.append(
            {
                "p50_us": statistics.median(samples[index]),
                "p99_us": percentile(samples[index], 0.99),
                "cpu_us": cpu_us,
                "calls_per_s": await concurrent(address, make, args.callers, args.per_caller),
            }
        )
    return rows[0], rows[1]


def report(label: str, rounds: list[dict[str, float]], callers: int) -> dict[str, float]:
    """The median of each figure over the rounds (the machine is shared: rounds interleave)."""
    row = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(
        f"{label:<20} p50 {row['p50_us']:7.1f} µs   p99 {row['p99_us']:7.1f} µs   "
        f"server CPU {row['cpu_us']:5.1f} µs/call   "
        f"{callers} callers: {row['calls_per_s']:8.0f} calls/s"
    )
    return row


async def compare(
    address: str, args: argparse.Namespace, started: list[subprocess.Popen[bytes]]
) -> None:
    daemon, echo = started
    await wait_for_name(address, BUS_NAME, daemon)
    await wait_for_name(address, ECHO_NAME, echo)
    await asyncio.to_thread(wait_published, address)
    print(
        f"{args.rounds} rounds of {args.calls} sequential calls to each, the two in turns, then "
        f"{args.callers} callers × {args.per_caller} calls; medians over the rounds"
    )
    echo_rounds, admit_rounds = [], []
    for _ in range(args.rounds):
        echo_row, admit_row = await measure(address, args, (echo.pid, daemon.pid))
        echo_rounds.append(echo_row)
        admit_rounds.append(admit_row)
    baseline = report("echo (dbus-fast)", echo_rounds, args.callers)
    admit = report("Admit (uapplaced)", admit_rounds, args.callers)
    print(
        f"ratio Admit/echo: p50 {admit['p50_us'] / baseline['p50_us']:.2f}×, "
        f"p99 {admit['p99_us'] / baseline['p99_us']:.2f}×, "
        f"server CPU {admit['cpu_us'] / baseline['cpu_us']:.2f}×, "
        f"throughput {baseline['calls_per_s'] / admit['calls_per_s']:.2f}× (echo/Admit calls/s); "
        "issue 23 goal: p50 <= 1.05×"
    )


def run(args: argparse.Namespace) -> int:
    with (
        tempfile.TemporaryDirectory(prefix="bench-bus-") as raw,
        private_bus("session", Path(raw)) as address,
        seeded_engine(Path(raw)),
    ):
        processes: list[subprocess.Popen[bytes]] = []
        try:
            processes.append(spawn_daemon(daemon_env(Path(raw), address, REGISTRY, ledger=LEDGER)))
            processes.append(subprocess.Popen([sys.executable, __file__, "--serve-echo", address]))
            asyncio.run(compare(address, args, processes))
        finally:
            for process in processes:
                stop(process)
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
