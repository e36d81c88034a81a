"""Admit through the shim (HTTP → bus → uapplaced) against a bare aiohttp JSON endpoint.

Run by hand: ``.venv/bin/python bench/bench_shim.py`` (``make bench`` runs it too).

It starts, all private and all torn down at the end: a ``dbus-daemon``, the real
``uapplaced`` on it (the bus tier's test registry, ``alpha`` resident so admit
forwards), two real ``uapplace-shim`` processes (one admitting over uapplaced's
peer-to-peer socket, the default; one started with ``--no-peer``, admitting over
the bus), and a *floor* process: a bare aiohttp app answering the same POST with
a constant forward decision after reading and parsing the body like the shim
does, served the way the shim serves (an ``AppRunner`` without access log on a
pre-bound loopback socket). The same load generator (raw HTTP/1.1 over
keep-alive asyncio streams, much cheaper than an HTTP library) drives all three,
in alternating rounds:

- sequential: one connection per target, one request at a time, the targets
  taking turns in blocks of 100 (so a slow spell of the machine hits all alike)
  → p50 / p99;
- closed loop: N connections (default 32) each sending requests back to back →
  p50 / p99 and throughput;
- open loop: the same N connections sharing a fixed arrival rate (default
  400/s), each request timed from when it was due → p50 / p99.

Also reported: admit straight over the bus and straight over the peer socket
(dbus-fast client → daemon), to show where the time goes. Targets (issue 5):
shim p50 within 2× of the floor's, and shim p99 under 5 ms at 32 clients, on
this machine. Ratios are against the floor measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from dbus_fast import Message

if TYPE_CHECKING:
    from uapplace.bus.client import PlacementClient

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ADMIT_PATH = "/api/placement/admit"
BODY = json.dumps(
    {
        "model_id": "alpha",
        "client": "x-uap-client-id:bench",
        "session": "bench-session",
        "cells": 4096,
    }
).encode()
FLOOR_ANSWER = {"decision": "forward", "target_id": "gpu0:http://127.0.0.1:18080"}


# --------------------------------------------------------------------------- the floor


def serve_floor() -> None:
    """A bare aiohttp endpoint: read + parse the JSON body, answer a constant decision."""

    async def admit(request: web.Request) -> web.Response:
        await request.json()
        return web.json_response(FLOOR_ANSWER)

    async def run() -> None:
        from uapplace.shim.server import bind_sockets

        app = web.Application()
        app.router.add_post(ADMIT_PATH, admit)
        runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await runner.setup()
        (sock,) = bind_sockets(["127.0.0.1"], 0)
        await web.SockSite(runner, sock).start()
        print(sock.getsockname()[1], flush=True)
        await asyncio.Event().wait()

    asyncio.run(run())


# --------------------------------------------------------------------------- load generator


class Connection:
    """One keep-alive HTTP/1.1 connection sending the admit POST again and again."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.request = (
            f"POST {ADMIT_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()

    async def admit(self) -> float:
        """One round trip; its latency in seconds (fails on anything but a 200)."""
        assert self.reader is not None and self.writer is not None
        started = time.perf_counter()
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        body = await self.reader.readexactly(length)
        elapsed = time.perf_counter() - started
        if head[9:12] != b"200":
            raise RuntimeError(f"non-200 answer: {head[:40]!r} {body[:200]!r}")
        return elapsed


async def sequential(port: int, count: int) -> list[float]:
    connection = Connection(port)
    await connection.open()
    try:
        return [await connection.admit() for _ in range(count)]
    finally:
        await connection.close()


async def interleaved(
    ports: Sequence[int], count: int, block: int, warmup: int
) -> list[list[float]]:
    """``count`` sequential admits per target, sent in alternating blocks of ``block``.

    One connection per target, used in turn: a slow spell of the machine (a
    small VM has many) then hits every target alike instead of one round of one.
    """
    connections = [Connection(port) for port in ports]
    for connection in connections:
        await connection.open()
    try:
        for connection in connections:
            for _ in range(warmup):
                await connection.admit()
        results: list[list[float]] = [[] for _ in ports]
        while len(results[0]) < count:
            for connection, latencies in zip(connections, results, strict=True):
                latencies.extend([await connection.admit() for _ in range(block)])
        return results
    finally:
        for connection in connections:
            await connection.close()


async def concurrent(port: int, clients: int, per_client: int) -> tuple[list[float], float]:
    connections = [Connection(port) for _ in range(clients)]
    await asyncio.gather(*(c.open() for c in connections))

    async def drive(connection: Connection) -> list[float]:
        return [await connection.admit() for _ in range(per_client)]

    try:
        started = time.perf_counter()
        results = await asyncio.gather(*(drive(c) for c in connections))
        wall = time.perf_counter() - started
    finally:
        await asyncio.gather(*(c.close() for c in connections))
    return [latency for result in results for latency in result], wall


async def open_loop(port: int, clients: int, rate: float, seconds: float) -> list[float]:
    """``clients`` connections sharing ``rate`` requests/s, each on its own fixed schedule.

    Unlike the closed loop, a slow answer does not slow the senders down, so the
    latency measured is what a request sees at that arrival rate (no coordinated
    omission: a late send is timed from when it was due).
    """
    connections = [Connection(port) for _ in range(clients)]
    await asyncio.gather(*(c.open() for c in connections))
    interval = clients / rate
    start = time.perf_counter() + 0.05

    async def drive(index: int, connection: Connection) -> list[float]:
        latencies = []
        due = start + interval * index / clients
        while due < start + seconds:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            late = max(0.0, time.perf_counter() - due)
            latencies.append(late + await connection.admit())
            due += interval
        return latencies

    try:
        results = await asyncio.gather(*(drive(i, c) for i, c in enumerate(connections)))
    finally:
        await asyncio.gather(*(c.close() for c in connections))
    return [latency for result in results for latency in result]


async def bus_only(address: str, count: int) -> list[float]:
    from uapplace.bus.client import PlacementClient

    client = await PlacementClient.connect(address)
    return await admits(client, count)


async def peer_only(bus_address: str, socket_path: Path, count: int) -> list[float]:
    from uapplace.bus.client import PlacementClient
    from uapplace.bus.peer import connect_peer

    on_bus = await PlacementClient.connect(bus_address)
    try:
        reply = await on_bus.bus.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="GetConnectionUnixProcessID",
                signature="s",
                body=["org.uap.Placement1"],
            )
        )
    finally:
        on_bus.disconnect()
    assert reply is not None
    return await admits(PlacementClient(await connect_peer(socket_path, reply.body[0])), count)


async def admits(client: PlacementClient, count: int) -> list[float]:
    try:
        latencies = []
        for _ in range(count):
            started = time.perf_counter()
            await client.admit("alpha", "x-uap-client-id:bench", "bench-session", 4096)
            latencies.append(time.perf_counter() - started)
        return latencies
    finally:
        client.disconnect()


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:7.3f} ms"


def summary(name: str, latencies: Sequence[float], wall: float | None = None) -> dict[str, float]:
    figures = {
        "p50": statistics.median(latencies),
        "p90": percentile(latencies, 0.90),
        "p99": percentile(latencies, 0.99),
        "max": max(latencies),
    }
    rate = f"  {len(latencies) / wall:8.0f} req/s" if wall else ""
    print(
        f"  {name:<34} p50 {ms(figures['p50'])}  p90 {ms(figures['p90'])}  "
        f"p99 {ms(figures['p99'])}  max {ms(figures['max'])}{rate}"
    )
    if wall:
        figures["rps"] = len(latencies) / wall
    return figures


# --------------------------------------------------------------------------- main


Round = dict[str, dict[str, float]]


async def run_round(label: str, port: int, args: argparse.Namespace) -> Round:
    """One round of the concurrent loads against one target (sequential: :func:`interleaved`)."""
    await sequential(port, args.warmup)
    figures: Round = {}
    if "closed" in args.loads:
        latencies, wall = await concurrent(port, args.clients, args.per_client)
        figures["closed"] = summary(f"{label}, {args.clients} clients closed", latencies, wall)
    if "open" in args.loads:
        figures["open"] = summary(
            f"{label}, {args.clients} clients @{args.rate:.0f}/s",
            await open_loop(port, args.clients, args.rate, args.seconds),
        )
    return figures


def median_of(rounds: Sequence[Round], load: str, figure: str) -> float:
    return statistics.median(r[load][figure] for r in rounds)


LOADS = ("sequential", "closed", "open")
FIGURES = (
    ("sequential", "p50"),
    ("sequential", "p99"),
    ("closed", "p50"),
    ("closed", "p99"),
    ("closed", "rps"),
    ("open", "p50"),
    ("open", "p99"),
)


def start_floor() -> tuple[subprocess.Popen[bytes], int]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-floor"], stdout=subprocess.PIPE, cwd=ROOT
    )
    assert process.stdout is not None
    return process, int(process.stdout.readline())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-floor", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--requests", type=int, default=3000, help="sequential requests")
    parser.add_argument("--clients", type=int, default=32, help="concurrent connections")
    parser.add_argument("--per-client", type=int, default=300, help="requests per connection")
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument(
        "--block", type=int, default=100, help="sequential requests per turn of each target"
    )
    parser.add_argument("--rate", type=float, default=400.0, help="open-loop requests/s in all")
    parser.add_argument("--seconds", type=float, default=5.0, help="open-loop duration")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per target")
    parser.add_argument(
        "--loads",
        nargs="+",
        choices=LOADS,
        default=list(LOADS),
        help="which loads to run (default: all three)",
    )
    args = parser.parse_args(argv)
    if args.serve_floor:
        serve_floor()
        return 0

    from tests.bus.conftest import make_env, start_daemon, wait_until
    from tests.bus.dbusmock_fixtures import private_bus
    from tests.bus.shim_fixtures import SEEDED_LEDGER, start_shim

    print(f"bench_shim: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    targets = ("floor (bare aiohttp)", "shim → peer → uapplaced", "shim → bus → uapplaced")
    rounds: dict[str, list[Round]] = {name: [] for name in targets}
    with tempfile.TemporaryDirectory(prefix="bench-shim-") as scratch:
        root = Path(scratch)
        (root / "bus").mkdir()
        with private_bus("session", root / "bus") as address:
            uap = make_env(root / "world", address)
            uap.seed_ledger(SEEDED_LEDGER)
            daemon = start_daemon(uap)
            wait_until(lambda: "owns org.uap.Placement1" in daemon.log(), "uapplaced wired")
            peer_shim = start_shim(uap.env, address, root)
            bus_shim = start_shim(uap.env, address, root, "--no-peer")
            floor, floor_port = start_floor()
            ports = dict(zip(targets, (floor_port, peer_shim.port, bus_shim.port), strict=True))
            try:
                print("admit latency (client-side, loopback), rounds alternate between targets:")
                for _ in range(args.rounds):
                    seq: list[list[float]] = []
                    if "sequential" in args.loads:
                        seq = asyncio.run(
                            interleaved(
                                list(ports.values()), args.requests, args.block, args.warmup
                            )
                        )
                    for index, name in enumerate(targets):
                        figures = asyncio.run(run_round(name, ports[name], args))
                        if seq:
                            figures["sequential"] = summary(f"{name}, sequential", seq[index])
                        rounds[name].append(figures)
                socket_path = Path(uap.env["XDG_RUNTIME_DIR"]) / "uapplace" / "bus"
                for label, measure in (
                    ("bus only (dbus-fast → bus → uapplaced)", partial(bus_only, address)),
                    (
                        "peer only (dbus-fast → uapplaced)",
                        partial(peer_only, address, socket_path),
                    ),
                ):
                    asyncio.run(measure(args.warmup))
                    summary(label, asyncio.run(measure(args.requests)))
                assert "admits go over the peer socket" in peer_shim.log(), peer_shim.log()
            finally:
                floor.terminate()
                floor.wait()
                peer_shim.stop()
                bus_shim.stop()
                daemon.stop()
    print(f"medians over {args.rounds} rounds (ratio: against the floor of this run):")
    floor_rounds = rounds[targets[0]]
    for load, figure in FIGURES:
        if load not in args.loads:
            continue
        unit = "req/s" if figure == "rps" else "ms"
        scale = 1 if figure == "rps" else 1000
        floor_value = median_of(floor_rounds, load, figure)
        cells = [f"  {load:<10} {figure:<4} floor {floor_value * scale:9.3f} {unit}"]
        for name, short in zip(targets[1:], ("peer", "bus"), strict=True):
            value = median_of(rounds[name], load, figure)
            cells.append(f"{short} {value * scale:9.3f} ({value / floor_value:4.2f}x)")
        print("  ".join(cells))
    print("targets: shim p50 within 2x of the floor; shim p99 under 5 ms at 32 clients")
    return 0


if __name__ == "__main__":
    sys.exit(main())
