"""Admit latency through the shim at rest and with 200 SSE subscribers (issue 20).

Run by hand: ``.venv/bin/python bench/bench_sse_admit.py`` (``make bench`` runs it too).

It starts, all private and all torn down at the end: a ``dbus-daemon``, the real
``uapplaced`` on it (the bus tier's registry, ``alpha`` resident so its admits forward)
and the real ``uapplace-shim``. The same load runs twice, ``--seconds`` each:

- measured: admits of ``alpha`` (forward) on ``--clients`` keep-alive connections at
  ``--rate`` requests/s in all, open loop (each timed from when it was due, so a
  stalled shim shows as latency, not as fewer requests);
- background: admits of ``beta`` (not resident) from a new client each time at
  ``--park-rate``/s: each parks and the daemon signals ``Parked``, so the event feed
  carries that many events a second to every SSE subscriber.

The first run has no subscriber ("at rest"); for the second, a separate process opens
``--subscribers`` SSE streams (``GET /api/placement/events``), ``--stalled`` of them
with a 4 KiB receive buffer and never read (the shim must drop them), the rest read
everything. Printed: p50/p99/max of the measured admits in both runs, the p99 ratio,
the shim's admit deadline, the events the readers got, and how the stalled streams
ended (a ``StreamClosed`` event, and the connection closed by the shim). Target: the
p99 with subscribers stays under the admit deadline (1.5 s).

``--shim-tree DIR`` runs the shim from another checkout's ``uapplace`` (for a
before/after comparison: ``git archive <commit> | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ADMIT_PATH = "/api/placement/admit"
EVENTS_PATH = "/api/placement/events"
STALLED_RCVBUF = 4096
QUIET_S = 1.0
LAG_MAX_S = 20.0
"""After the run, readers read on until nothing came for ``QUIET_S`` (at most ``LAG_MAX_S``)."""
STALLED_READ_S = 8.0
"""After the run, how long the stalled streams are read to see whether the shim closed them."""


# --------------------------------------------------------------------------- HTTP


def admit_request(port: int, model: str, client: str) -> bytes:
    body = json.dumps({"model_id": model, "client": client, "cells": 4096}).encode()
    head = (
        f"POST {ADMIT_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class Connection:
    """One keep-alive HTTP/1.1 connection; each answer's status is recorded."""

    port: int
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            await self.writer.wait_closed()

    async def send(self, request: bytes) -> int:
        """One round trip; the status code."""
        assert self.reader is not None and self.writer is not None
        self.writer.write(request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                length = int(line[15:])
        await self.reader.readexactly(length)
        return int(head[9:12])


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    statuses: dict[int, int] = field(default_factory=dict)
    parks_sent: int = 0


async def open_loop(
    port: int, clients: int, rate: float, seconds: float, request: Any, result: LoadResult
) -> None:
    """``clients`` connections sharing ``rate`` requests/s on a fixed schedule; each
    latency is counted from when the request was due (no coordinated omission)."""
    connections = [Connection(port) for _ in range(clients)]
    await asyncio.gather(*(c.open() for c in connections))
    interval = clients / rate
    start = time.perf_counter() + 0.05

    async def drive(index: int, connection: Connection) -> None:
        due = start + interval * index / clients
        serial = 0
        while due < start + seconds:
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            serial += 1
            status = await connection.send(request(index, serial))
            result.latencies.append(time.perf_counter() - due)
            result.statuses[status] = result.statuses.get(status, 0) + 1
            due += interval

    try:
        await asyncio.gather(*(drive(i, c) for i, c in enumerate(connections)))
    finally:
        await asyncio.gather(*(c.close() for c in connections))


async def run_load(port: int, args: argparse.Namespace) -> tuple[LoadResult, LoadResult]:
    measured, parks = LoadResult(), LoadResult()
    forward = admit_request(port, "alpha", "x-uap-client-id:bench")
    run_id = time.monotonic_ns()
    await asyncio.gather(
        open_loop(port, args.clients, args.rate, args.seconds, lambda _i, _s: forward, measured),
        open_loop(
            port,
            4,
            args.park_rate,
            args.seconds,
            lambda i, s: admit_request(port, "beta", f"x-uap-client-id:park-{run_id}-{i}-{s}"),
            parks,
        ),
    )
    return measured, parks


# --------------------------------------------------------------------------- subscribers


async def subscribers(port: int, count: int, stalled: int) -> None:
    """The subscriber process: open the streams, say ``ready``, read until SIGTERM, then
    print one JSON line: what the readers got and how the stalled streams ended."""
    request = (
        f"GET {EVENTS_PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAccept: text/event-stream\r\n\r\n"
    ).encode()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    counts = {"events": 0, "closed_events": 0}
    readers: list[asyncio.Task[None]] = []
    writers: list[asyncio.StreamWriter] = []  # kept: a collected writer closes its stream
    stalled_socks: list[socket.socket] = []

    last_read = [time.monotonic()]

    async def read(reader: asyncio.StreamReader) -> None:
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                return
            last_read[0] = time.monotonic()
            counts["events"] += chunk.count(b"\nevent: ")
            counts["closed_events"] += chunk.count(b"event: StreamClosed")

    for _ in range(count - stalled):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request)
        writers.append(writer)
        await reader.readuntil(b"uapplace placement events\n\n")
        readers.append(asyncio.ensure_future(read(reader)))
    for _ in range(stalled):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, STALLED_RCVBUF)
        sock.connect(("127.0.0.1", port))
        sock.sendall(request)
        stalled_socks.append(sock)
    print("ready", flush=True)
    await stop.wait()
    stopped = time.monotonic()
    while time.monotonic() - stopped < LAG_MAX_S:  # the feed may lag behind the admits
        if time.monotonic() - last_read[0] >= QUIET_S:
            break
        await asyncio.sleep(0.1)
    ended = {"closed_by_shim": 0, "saw_stream_closed": 0}

    async def drain(sock: socket.socket) -> None:
        """Read what the shim left for a stalled stream: closed by the shim (EOF or reset
        within the time left), and whether its last event was ``StreamClosed``."""
        sock.setblocking(False)
        tail = b""
        try:
            while chunk := await asyncio.get_running_loop().sock_recv(sock, 1 << 20):
                tail = (tail + chunk)[-4096:]
            ended["closed_by_shim"] += 1
        except ConnectionError:
            ended["closed_by_shim"] += 1
        finally:
            ended["saw_stream_closed"] += b"event: StreamClosed" in tail

    drains = [asyncio.ensure_future(drain(sock)) for sock in stalled_socks]
    await asyncio.wait(drains, timeout=STALLED_READ_S) if drains else None
    for task in [*readers, *drains]:
        task.cancel()
    for sock in stalled_socks:
        sock.close()
    print(json.dumps({**counts, **ended}), flush=True)


def start_subscribers(port: int, count: int, stalled: int) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--subscribe", str(port), str(count), str(stalled)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()
    if line != "ready":
        process.kill()
        raise RuntimeError(f"the subscriber process did not start: {line!r}")
    return process


def stop_subscribers(process: subprocess.Popen[str]) -> dict[str, int]:
    os.kill(process.pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=90)
    parsed: dict[str, int] = json.loads(out.strip().splitlines()[-1])
    return parsed


# --------------------------------------------------------------------------- report


def shim_module(pid: int) -> str:
    """Which ``uapplace`` the shim process runs (``--shim-tree``, or this checkout)."""
    environ = psutil.Process(pid).environ()
    return f"uapplace from {environ.get('PYTHONPATH') or ROOT}"


def cpu_seconds(pids: dict[str, int], since: dict[str, float] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) each process has used (since ``since``)."""
    out = {}
    for name, pid in pids.items():
        times = psutil.Process(pid).cpu_times()
        out[name] = times.user + times.system - (since or {}).get(name, 0.0)
    return out


def percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def describe(label: str, result: LoadResult) -> dict[str, float]:
    figures = {
        "p50": statistics.median(result.latencies),
        "p99": percentile(result.latencies, 0.99),
        "max": max(result.latencies),
    }
    shown = "  ".join(f"{name} {value * 1000:9.1f} ms" for name, value in figures.items())
    print(f"  {label:<28} {shown}  n={len(result.latencies)}  statuses={result.statuses}")
    return figures


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subscribe", nargs=3, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=15.0, help="each run's duration")
    parser.add_argument("--rate", type=float, default=100.0, help="measured admits/s")
    parser.add_argument("--clients", type=int, default=8, help="measured connections")
    parser.add_argument("--park-rate", type=float, default=200.0, help="parking admits/s")
    parser.add_argument("--subscribers", type=int, default=200)
    parser.add_argument("--stalled", type=int, default=50, help="subscribers that never read")
    parser.add_argument("--shim-tree", type=Path, help="run the shim from this tree's uapplace")
    args = parser.parse_args(argv)
    if args.subscribe:
        asyncio.run(subscribers(*args.subscribe))
        return 0

    from tests.bus.conftest import make_env, start_daemon, wait_until
    from tests.bus.dbusmock_fixtures import private_bus
    from tests.bus.shim_fixtures import SEEDED_LEDGER, start_shim
    from uapplace.shim.settings import ADMIT_DEADLINE_S

    print(f"bench_sse_admit: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    with tempfile.TemporaryDirectory(prefix="bench-sse-") as scratch:
        root = Path(scratch)
        (root / "bus").mkdir()
        with private_bus("session", root / "bus") as address:
            uap = make_env(root / "world", address)
            uap.seed_ledger(SEEDED_LEDGER)
            daemon = start_daemon(uap)
            wait_until(lambda: "owns org.uap.Placement1" in daemon.log(), "uapplaced wired")
            shim_env = dict(uap.env)
            if args.shim_tree is not None:
                shim_env["PYTHONPATH"] = str(args.shim_tree.resolve())
                shim_env["PYTHONSAFEPATH"] = "1"  # -m must not put this tree's cwd first
            shim = start_shim(shim_env, address, root)
            print(f"shim: {shim_module(shim.process.pid)}")
            try:
                print(
                    f"measured: alpha admits @{args.rate:g}/s on {args.clients} connections; "
                    f"background: beta parks @{args.park_rate:g}/s; {args.seconds:g} s per run"
                )
                pids = {"shim": shim.process.pid, "uapplaced": daemon.pid}
                before = cpu_seconds(pids)
                rest, parks_rest = asyncio.run(run_load(shim.port, args))
                cpu_rest = cpu_seconds(pids, before)
                process = start_subscribers(shim.port, args.subscribers, args.stalled)
                pids["subscribers"] = process.pid
                before = cpu_seconds(pids)
                loaded, parks_loaded = asyncio.run(run_load(shim.port, args))
                cpu_loaded = cpu_seconds(pids, before)
                del pids["subscribers"]
                ended = stop_subscribers(process)
            finally:
                shim_log = shim.log()
                shim.stop()
                daemon.stop()
    print("admit latency (client-side, from when each request was due):")
    at_rest = describe("at rest", rest)
    describe("  (background parks)", parks_rest)
    label = f"{args.subscribers} SSE ({args.stalled} stalled)"
    with_sse = describe(label, loaded)
    describe("  (background parks)", parks_loaded)
    for label, cpu in (("at rest", cpu_rest), ("with SSE", cpu_loaded)):
        shown = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in cpu.items())
        print(f"  CPU during the run, {label}: {shown} (of {args.seconds:g} s)")
    ratio = with_sse["p99"] / at_rest["p99"]
    readers = args.subscribers - args.stalled
    print(
        f"p99 ratio (with SSE / at rest): {ratio:.2f}x; admit deadline {ADMIT_DEADLINE_S:g} s: "
        f"p99 with SSE is {'under' if with_sse['p99'] < ADMIT_DEADLINE_S else 'OVER'} it"
    )
    print(
        f"readers: {readers} got {ended['events']} events in all "
        f"({ended['events'] / max(1, readers):.0f} each); stalled: {args.stalled}, "
        f"closed by the shim {ended['closed_by_shim']}, "
        f"StreamClosed read by {ended['saw_stream_closed']} (read only after the run: the shim "
        "cuts a dropped stream 10 s after its final event); "
        f"shim log 'event stream dropped' lines: {shim_log.count('event stream dropped')}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
