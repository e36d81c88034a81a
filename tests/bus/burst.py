"""Bursts of concurrent ``Admit`` calls, over the bus and through the shim (tier 2 and bench/).

- :func:`bus_burst`: ``calls`` concurrent ``Admit`` calls spread over ``connections``
  bus connections (each a :func:`uapplace.bus.connection.connect` connection, so the client
  side is not the part that gives way), all sent at once; every outcome counted.
- :func:`http_burst`: the same through the shim: ``connections`` keep-alive HTTP/1.1
  connections, each writing its share of ``POST /api/placement/admit`` requests
  pipelined in one go, then reading every response; statuses counted.
- :func:`spawn_daemon_unfixed`: uapplaced with dbus-fast's original write path
  (``busio.OrderedWriter.write_callback`` put back to upstream's), the "before"
  of ``bench/bench_burst.py``.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from dbus_fast import Message, MessageType

from tests.bus.conftest import DaemonProcess, UapEnv, ask_bus
from uapplace.bus import connection as busio
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

UNFIXED_DAEMON = (
    "import sys\n"
    "from dbus_fast.aio.message_bus import _MessageWriter\n"
    "from uapplace import busio\n"
    "busio.OrderedWriter.write_callback = _MessageWriter.write_callback\n"
    "from uapplace.daemon.main import main\n"
    "sys.exit(main(['--log-level', 'INFO']))\n"
)


@dataclass
class BurstResult:
    calls: int
    outcomes: Counter[str] = field(default_factory=Counter)
    """``ok`` for an answer; else the error name or exception type."""
    seconds: float = 0.0
    samples: list[str] = field(default_factory=list)
    """The first few failures in full (an HTTP error body), for the test's message."""

    @property
    def answered(self) -> int:
        return self.outcomes["ok"]

    @property
    def per_second(self) -> float:
        return self.answered / self.seconds if self.seconds else 0.0


def admit_call(model: str, client: str, session: str = "burst", cells: int = 32768) -> Message:
    """``Admit(model, client, session, cells)`` to uapplaced (the bursts and the bus benches)."""
    return Message(
        destination=BUS_NAME,
        path=OBJECT_PATH,
        interface=INTERFACE,
        member="Admit",
        signature="sssu",
        body=[model, client, session, cells],
    )


async def _one(bus: busio.Bus, message: Message) -> str:
    try:
        reply = await bus.call(message)
    except Exception as err:  # a connection that died mid-burst
        return type(err).__name__
    if reply is None:
        return "no reply"
    if reply.message_type is MessageType.ERROR:
        return reply.error_name or "error"
    return "ok"


async def bus_burst(
    address: str, calls: int, connections: int, model: str = "alpha", limit_s: float = 120.0
) -> BurstResult:
    """``calls`` Admits at once over ``connections`` connections; counts every outcome."""
    buses = [await busio.connect(address) for _ in range(connections)]
    result = BurstResult(calls)
    try:
        messages = [
            (buses[i % connections], admit_call(model, f"burst-{i % connections}"))
            for i in range(calls)
        ]
        started = time.perf_counter()
        async with asyncio.timeout(limit_s):
            outcomes = await asyncio.gather(*(_one(bus, m) for bus, m in messages))
        result.seconds = time.perf_counter() - started
        result.outcomes.update(outcomes)
    finally:
        for bus in buses:
            bus.disconnect()
    return result


def admit_request(host: str, model: str, client: str) -> bytes:
    body = json.dumps({"model_id": model, "client": client, "session": "burst"}).encode()
    head = (
        f"POST /api/placement/admit HTTP/1.1\r\nHost: {host}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the shim closed the connection")
    status = int(status_line.split()[1])
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    return status, await reader.readexactly(length)


async def _pipelined(
    base_url: str, count: int, model: str, client: str, samples: list[str]
) -> list[str]:
    parts = urlsplit(base_url)
    host = parts.hostname or "127.0.0.1"
    reader, writer = await asyncio.open_connection(host, parts.port)
    statuses: list[str] = []
    try:
        writer.write(
            b"".join(admit_request(f"{host}:{parts.port}", model, client) for _ in range(count))
        )
        await writer.drain()
        for _ in range(count):
            try:
                status, body = await _read_response(reader)
                statuses.append(str(status))
                if status != 200 and len(samples) < 3:
                    samples.append(f"{status} {body[:300]!r}")
            except (ConnectionError, asyncio.IncompleteReadError, ValueError) as err:
                statuses.append(type(err).__name__)
                break
    finally:
        writer.close()
        await writer.wait_closed()
    statuses += ["unanswered"] * (count - len(statuses))
    return statuses


async def http_burst(
    base_url: str, calls: int, connections: int, model: str = "alpha", limit_s: float = 120.0
) -> BurstResult:
    """``calls`` admits through the shim, pipelined over ``connections`` connections."""
    share = [
        calls // connections + (1 if i < calls % connections else 0) for i in range(connections)
    ]
    result = BurstResult(calls)
    started = time.perf_counter()
    async with asyncio.timeout(limit_s):
        groups = await asyncio.gather(
            *(
                _pipelined(base_url, n, model, f"burst-{i}", result.samples)
                for i, n in enumerate(share)
            )
        )
    result.seconds = time.perf_counter() - started
    for statuses in groups:
        result.outcomes.update("ok" if s == "200" else s for s in statuses)
    return result


def owner_pid(address: str) -> int | None:
    """The pid of the process owning ``org.uap.Placement1`` on the bus (``None``: no owner)."""
    done = ask_bus(address, "GetConnectionUnixProcessID", BUS_NAME)
    words = done.stdout.split()
    return int(words[1]) if done.returncode == 0 and len(words) == 2 else None


def spawn_daemon_unfixed(uap: UapEnv) -> DaemonProcess:
    """uapplaced with dbus-fast's own (EAGAIN-is-fatal) writer: the bench's "before"."""
    log_path = uap.root / f"uapplaced-unfixed-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", UNFIXED_DAEMON],
            env=uap.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    return DaemonProcess(process, log_path, uap)
