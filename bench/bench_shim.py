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
(dbus-fast client → daemon), to show where the time goes, and the CPU time each
server process spent per sequential request (from ``/proc``: it holds on a busy
machine where latency does not). Targets (issue 5): shim p50 within 2× of the
floor's, and shim p99 under 5 ms at 32 clients, on this machine; issue 23's
(docs/performance.md): shim p50 within 1.3× of bare aiohttp plus a bare peer
call. Ratios are against the floor measured in the same run. ``--baseline-tree
DIR`` adds a peer shim run from another source tree (before/after in one run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
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


@contextlib.contextmanager
def seeded_engine(log_dir: Path) -> Iterator[None]:
    """The fake engine serving ``alpha`` where the seeded ledger says it is, so the daemon
    verifies it and admit *forwards* (without it every admit parks)."""
    from tests.bus.conftest import SEEDED_PORT, wait_until

    argv = [sys.executable, "-m", "uapplace.sim.engine", "--port", str(SEEDED_PORT)]
    argv += ["--model-id", "alpha", "--advertise", "alpha-chat"]
    log_path = log_dir / "engine.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        wait_until(lambda: "listening on" in log_path.read_text(), "the fake engine", 20)
        yield
    finally:
        process.terminate()
        process.wait()


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
    """One keep-alive HTTP/1.1 connection sending one POST (the admit's by default) again
    and again."""

    def __init__(self, port: int, path: str = ADMIT_PATH, body: bytes = BODY) -> None:
        self.port = port
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.last_body = b""

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
        chunked = False
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
            elif line.lower() == b"transfer-encoding: chunked":
                chunked = True
        body = await (self._chunks() if chunked else self.reader.readexactly(length))
        elapsed = time.perf_counter() - started
        self.last_body = body
        if head[9:12] != b"200":
            raise RuntimeError(f"non-200 answer: {head[:40]!r} {body[:200]!r}")
        return elapsed

    async def _chunks(self) -> bytes:
        """A chunked body (a relayed upstream answer), up to its last, empty chunk."""
        assert self.reader is not None
        body = b""
        while True:
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            chunk = await self.reader.readexactly(size + 2)
            if size == 0:
                return body
            body += chunk[:-2]


async def sequential(port: int, count: int) -> list[float]:
    connection = Connection(port)
    await connection.open()
    try:
        return [await connection.admit() for _ in range(count)]
    finally:
        await connection.close()


class PeerCall:
    """The floor's other half: ``AdmitBy`` straight over the daemon's peer socket from a bare
    dbus-fast client; ``admit`` like :meth:`Connection.admit`, so it can take its turn in
    the same alternating blocks."""

    def __init__(self, bus_address: str, socket_path: Path) -> None:
        self.bus_address = bus_address
        self.socket_path = socket_path
        self.client: PlacementClient | None = None

    async def open(self) -> None:
        from uapplace.bus.client import PlacementClient
        from uapplace.bus.peer import connect_peer

        on_bus = await PlacementClient.connect(self.bus_address)
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
        self.client = PlacementClient(await connect_peer(self.socket_path, reply.body[0]))

    async def close(self) -> None:
        if self.client is not None:
            self.client.disconnect()

    async def admit(self) -> float:
        assert self.client is not None
        started = time.perf_counter()
        await self.client.admit("alpha", "x-uap-client-id:bench", "bench-session", 4096)
        return time.perf_counter() - started


async def interleaved(
    ports: Sequence[int],
    count: int,
    block: int,
    warmup: int,
    extra: Sequence[PeerCall] = (),
) -> list[list[float]]:
    """``count`` sequential admits per target (each port, then each of ``extra``), sent in
    alternating blocks of ``block``.

    One connection per target, used in turn: a slow spell of the machine (a
    small VM has many) then hits every target alike instead of one round of one.
    """
    connections: list[Connection | PeerCall] = [Connection(port) for port in ports]
    connections += extra
    for connection in connections:
        await connection.open()
    try:
        for connection in connections:
            for _ in range(warmup):
                await connection.admit()
        results: list[list[float]] = [[] for _ in connections]
        while len(results[0]) < count:
            for connection, latencies in zip(connections, results, strict=True):
                latencies.extend([await connection.admit() for _ in range(block)])
        return results
    finally:
        for connection in connections:
            await connection.close()


async def concurrent(
    port: int, clients: int, per_client: int, path: str = ADMIT_PATH, body: bytes = BODY
) -> tuple[list[float], float]:
    """``clients`` keep-alive connections, each sending ``per_client`` POSTs back to back;
    every latency, and the wall time of the whole."""
    connections = [Connection(port, path, body) for _ in range(clients)]
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
    call = PeerCall(bus_address, socket_path)
    await call.open()
    try:
        return [await call.admit() for _ in range(count)]
    finally:
        await call.close()


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
    ("sequential", "cpu"),
    ("sequential", "p50"),
    ("sequential", "p99"),
    ("closed", "p50"),
    ("closed", "p99"),
    ("closed", "rps"),
    ("open", "p50"),
    ("open", "p99"),
)


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) process ``pid`` has used so far: what each request costs
    it, whatever else the machine is busy with (latency on a shared machine is not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


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
        "--baseline-tree",
        type=Path,
        default=None,
        help="also run a peer shim from this source tree (e.g. `git archive HEAD uapplace | "
        "tar -x -C DIR`): before and after in one run",
    )
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

    from tests.bus.conftest import make_env, start_daemon, wait_published, wait_until
    from tests.bus.dbusmock_fixtures import private_bus
    from tests.bus.shim_fixtures import SEEDED_LEDGER, start_shim

    print(f"bench_shim: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    targets: tuple[str, ...] = (
        "floor (bare aiohttp)",
        "shim → peer → uapplaced",
        "shim → bus → uapplaced",
    )
    if args.baseline_tree:
        targets += ("baseline shim → peer → uapplaced",)
    rounds: dict[str, list[Round]] = {name: [] for name in targets}
    with tempfile.TemporaryDirectory(prefix="bench-shim-") as scratch:
        root = Path(scratch)
        (root / "bus").mkdir()
        with private_bus("session", root / "bus") as address, seeded_engine(root):
            uap = make_env(root / "world", address)
            uap.seed_ledger(SEEDED_LEDGER)
            daemon = start_daemon(uap)
            wait_until(lambda: "owns org.uap.Placement1" in daemon.log(), "uapplaced wired")
            wait_published(address)
            peer_shim = start_shim(uap.env, address, root)
            bus_shim = start_shim(uap.env, address, root, "--no-peer")
            shims = [peer_shim, bus_shim]
            if args.baseline_tree:
                with contextlib.chdir(args.baseline_tree):  # python -m imports from the cwd
                    shims.append(start_shim(uap.env, address, root))
            floor, floor_port = start_floor()
            ports = dict(zip(targets, (floor_port, *(s.port for s in shims)), strict=True))
            pids = [floor.pid, *(s.process.pid for s in shims)]
            socket_path = Path(uap.env["XDG_RUNTIME_DIR"]) / "uapplace" / "bus"
            peer_rounds: list[float] = []  # the bare peer call's p50 per round, same blocks
            try:
                print("admit latency (client-side, loopback), rounds alternate between targets:")
                for _ in range(args.rounds):
                    seq: list[list[float]] = []
                    if "sequential" in args.loads:
                        cpu_before = [cpu_seconds(pid) for pid in pids]
                        seq = asyncio.run(
                            interleaved(
                                list(ports.values()),
                                args.requests,
                                args.block,
                                args.warmup,
                                [PeerCall(address, socket_path)],
                            )
                        )
                        peer_rounds.append(statistics.median(seq.pop()))
                        served = args.warmup + len(seq[0])
                        cpu = [
                            (cpu_seconds(pid) - before) / served
                            for pid, before in zip(pids, cpu_before, strict=True)
                        ]
                    for index, name in enumerate(targets):
                        figures = asyncio.run(run_round(name, ports[name], args))
                        if seq:
                            figures["sequential"] = summary(f"{name}, sequential", seq[index])
                            figures["sequential"]["cpu"] = cpu[index]
                        rounds[name].append(figures)
                direct: dict[str, dict[str, float]] = {}
                for label, measure in (
                    ("bus only (dbus-fast → bus → uapplaced)", partial(bus_only, address)),
                    (
                        "peer only (dbus-fast → uapplaced)",
                        partial(peer_only, address, socket_path),
                    ),
                ):
                    asyncio.run(measure(args.warmup))
                    cpu_started = time.process_time()  # this process is the bare client
                    direct[label] = summary(label, asyncio.run(measure(args.requests)))
                    direct[label]["cpu"] = (time.process_time() - cpu_started) / args.requests
                assert "admits go over the peer socket" in peer_shim.log(), peer_shim.log()
            finally:
                floor.terminate()
                floor.wait()
                for shim in shims:
                    shim.stop()
                daemon.stop()
    print(f"medians over {args.rounds} rounds (ratio: against the floor of this run):")
    floor_rounds = rounds[targets[0]]
    for load, figure in FIGURES:
        if load not in args.loads:
            continue
        unit = {"rps": "req/s", "cpu": "µs/req"}.get(figure, "ms")
        scale = {"rps": 1, "cpu": 1_000_000}.get(figure, 1000)
        floor_value = median_of(floor_rounds, load, figure)
        cells = [f"  {load:<10} {figure:<4} floor {floor_value * scale:9.3f} {unit}"]
        for name, short in zip(targets[1:], ("peer", "bus", "baseline"), strict=False):
            value = median_of(rounds[name], load, figure)
            cells.append(f"{short} {value * scale:9.3f} ({value / floor_value:4.2f}x)")
        print("  ".join(cells))
    print("targets: shim p50 within 2x of the floor; shim p99 under 5 ms at 32 clients")
    if "sequential" in args.loads:
        print(
            "  sequential p50 of the bare peer call in the same blocks: "
            f"{statistics.median(peer_rounds) * 1000:.3f} ms (alone, after the rounds: "
            f"{next(v['p50'] for k, v in direct.items() if k.startswith('peer only')) * 1000:.3f})"
        )
        print_issue_goals(rounds, targets, direct, args.loads, statistics.median(peer_rounds))
    return 0


def print_issue_goals(
    rounds: dict[str, list[Round]],
    targets: Sequence[str],
    direct: dict[str, dict[str, float]],
    loads: Sequence[str],
    peer_call: float,
) -> None:
    """Issue 23's goals: the shim against its floor, bare aiohttp plus a bare peer call (its
    p50 taken in the same alternating blocks as the shim's, ``peer_call``)."""
    floor_http = median_of(rounds[targets[0]], "sequential", "p50")
    shim = median_of(rounds[targets[1]], "sequential", "p50")
    floor = floor_http + peer_call
    print(
        f"issue 23: shim admit sequential p50 {shim * 1000:.3f} ms vs floor "
        f"{floor_http * 1000:.3f} + {peer_call * 1000:.3f} = {floor * 1000:.3f} ms: "
        f"{shim / floor:.2f}x (goal <= 1.3x; the shim's own share {(shim - floor) * 1000:.3f} ms)"
    )
    floor_cpu = median_of(rounds[targets[0]], "sequential", "cpu")
    peer_cpu = next(v["cpu"] for k, v in direct.items() if k.startswith("peer only"))
    shim_cpu = median_of(rounds[targets[1]], "sequential", "cpu")
    print(
        f"issue 23: shim CPU per admit {shim_cpu * 1e6:.0f} µs vs floor {floor_cpu * 1e6:.0f} "
        f"+ {peer_cpu * 1e6:.0f} (the bare peer client) = {(floor_cpu + peer_cpu) * 1e6:.0f} µs: "
        f"{shim_cpu / (floor_cpu + peer_cpu):.2f}x"
    )
    if len(targets) > 3:
        before = median_of(rounds[targets[3]], "sequential", "p50")
        print(
            f"issue 23: the baseline tree's shim p50 {before * 1000:.3f} ms: "
            f"{before / floor:.2f}x the floor (this tree {shim / floor:.2f}x)"
        )
    if "closed" in loads:
        rps = median_of(rounds[targets[1]], "closed", "rps")
        floor_rps = median_of(rounds[targets[0]], "closed", "rps")
        p99 = median_of(rounds[targets[1]], "closed", "p99")
        floor_p99 = median_of(rounds[targets[0]], "closed", "p99")
        print(
            f"issue 23: closed loop {rps:.0f} req/s vs floor {floor_rps:.0f}: "
            f"{rps / floor_rps:.2f}x (goal >= 0.8x); p99 {p99 * 1000:.2f} ms vs "
            f"{floor_p99 * 1000:.2f} ms: {p99 / floor_p99:.2f}x (goal <= 1.5x)"
        )


if __name__ == "__main__":
    sys.exit(main())
