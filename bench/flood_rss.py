"""uapplaced's memory under an admit flood, and after the flood expires.

Starts a private ``dbus-daemon`` and the real ``uapplaced`` on it (simulated GPU, a
one-model registry, pending entries living ``--ttl`` seconds through
``UAPPLACE_TEST_PENDING_TTL_S``), then measures the daemon's RSS (psutil):

1. at baseline, after start-up has settled;
2. after ``--admits`` distinct admits (default 10,000) with long ids: model ids of
   ``--model-chars`` (default 1,000: under the 1,024 limit, so every one parks and
   creates an entry), clients and sessions of 1,000 characters (cut to 128);
3. after ``--huge`` admits (default 300) with 100 KB model ids, which park
   ``invalid_request`` and hold nothing (the issue's 68 → 286 MB case);
4. after expiry (TTL + the 5 s expiry tick + the ledger write);

and repeats 2–4 ``--rounds`` times (default 2), to show RSS settles instead of growing.

It also prints the pending count (``PendingCount``) and the ledger's size at each
point. The pending caps (32 per client, 1,024 in all) bound what a flood can hold.
Run by hand (needs ``dbus-daemon``):

    .venv/bin/python bench/flood_rss.py [--admits 10000] [--ttl 20] [--callers 8]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.private_daemon import daemon_env, spawn_daemon, stop  # noqa: E402
from tests.bus.burst import admit_call  # noqa: E402
from tests.bus.dbusmock_fixtures import private_bus  # noqa: E402
from tests.worlds.seed_docs import alpha_model  # noqa: E402
from uapplace.bus.connection import connect  # noqa: E402
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH  # noqa: E402

STARTUP_TIMEOUT_S = 20.0
EXPIRY_TICK_S = 5.0
REGISTRY = {
    "version": 1,
    "devices": {"gpu0": {"kind": "gpu", "total_mib": 24576, "reserved_mib": 1024}},
    "models": {"alpha": alpha_model()},
}


# --------------------------------------------------------------------------- bus calls


async def pending_count(bus: MessageBus) -> int:
    reply = await bus.call(
        Message(
            destination=BUS_NAME,
            path=OBJECT_PATH,
            interface="org.freedesktop.DBus.Properties",
            member="Get",
            signature="ss",
            body=[INTERFACE, "PendingCount"],
        )
    )
    assert reply is not None and reply.message_type is MessageType.METHOD_RETURN, reply
    return int(reply.body[0].value)


async def wait_for_daemon(address: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"uapplaced did not take {BUS_NAME}")
        bus = await connect(address)
        try:
            await pending_count(bus)
            return
        except AssertionError:
            await asyncio.sleep(0.1)
        finally:
            bus.disconnect()


async def flood(
    address: str, messages: list[Message], callers: int, in_flight: int
) -> dict[str, int]:
    """Send every message, ``callers`` connections with ``in_flight`` calls each; count replies."""
    counts: dict[str, int] = {}
    queue = list(reversed(messages))

    async def one(bus: MessageBus) -> None:
        while queue:
            reply = await bus.call(queue.pop())
            if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
                key = f"error {reply.error_name if reply else None}"
            else:
                key = f"{reply.body[0]} {reply.body[3]}"
            counts[key] = counts.get(key, 0) + 1

    buses = [await connect(address) for _ in range(callers)]
    try:
        await asyncio.gather(*(one(bus) for bus in buses for _ in range(in_flight)))
    finally:
        for bus in buses:
            bus.disconnect()
    return counts


# --------------------------------------------------------------------------- main


def mib(value: int) -> str:
    return f"{value / 2**20:7.1f} MiB"


async def measure(
    args: argparse.Namespace, address: str, daemon: subprocess.Popen[bytes], ledger: Path
) -> int:
    await wait_for_daemon(address, daemon)
    proc = psutil.Process(daemon.pid)
    control = await connect(address)

    async def point(label: str) -> int:
        rss = proc.memory_info().rss
        size = await asyncio.to_thread(lambda: ledger.stat().st_size if ledger.exists() else 0)
        count = await pending_count(control)
        print(f"{label:<34} RSS {mib(rss)}  pending {count:5d}  ledger {size:>10,} B")
        return rss

    await asyncio.sleep(2.0)
    baseline = await point("baseline")
    flooded = expired = baseline
    for round_ in range(1, args.rounds + 1):
        messages = [
            admit_call(
                f"{round_}{n:06d}".ljust(args.model_chars, "m"),
                f"{round_}{n:06d}".ljust(1000, "c"),
                "s" * 1000,
                cells=0,
            )
            for n in range(args.admits)
        ]
        started = time.monotonic()
        counts = await flood(address, messages, args.callers, args.in_flight)
        took = time.monotonic() - started
        print(f"round {round_}: {args.admits} admits in {took:.1f} s: {counts}")
        await asyncio.sleep(2.0)  # the write-behind lands
        flooded = await point(f"after {args.admits} distinct admits")
        huge = [
            admit_call("h" * 100_000 + str(n), f"huge-{n}", "", cells=0) for n in range(args.huge)
        ]
        counts = await flood(address, huge, 2, 4)
        print(f"{args.huge} admits with 100 KB model ids: {counts}")
        await asyncio.sleep(2.0)
        await point(f"after {args.huge} x 100 KB ids")
        wait = args.ttl + EXPIRY_TICK_S + 3.0
        print(f"waiting {wait:.0f} s for expiry (TTL {args.ttl:g} s + tick + write)")
        await asyncio.sleep(wait)
        expired = await point("after expiry")
    control.disconnect()
    alive = daemon.poll() is None
    print(
        f"RSS: baseline {mib(baseline)}, last flood +{mib(flooded - baseline)}, "
        f"after the last expiry +{mib(expired - baseline)} over baseline; "
        f"daemon pid {daemon.pid} {'alive' if alive else 'EXITED'}"
    )
    return 0 if alive else 1


def run(args: argparse.Namespace, directory: Path) -> int:
    with private_bus("session", directory) as address:
        ttl = {"UAPPLACE_TEST_PENDING_TTL_S": str(args.ttl)}
        env = daemon_env(directory, address, REGISTRY, extra=ttl)
        with (directory / "uapplaced.log").open("wb") as log:
            daemon = spawn_daemon(env, log)
        try:
            return asyncio.run(
                measure(args, address, daemon, directory / "home" / "placement.json")
            )
        finally:
            stop(daemon)
            tail = (directory / "uapplaced.log").read_text(errors="replace")[-1500:]
            if tail.strip():
                print(f"--- uapplaced log (tail) ---\n{tail}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--admits", type=int, default=10_000)
    parser.add_argument("--model-chars", type=int, default=1_000)
    parser.add_argument("--huge", type=int, default=300)
    parser.add_argument("--ttl", type=float, default=20.0)
    parser.add_argument("--callers", type=int, default=8)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="flood + expiry, repeated")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="uap-flood-") as tmp:
        return run(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
