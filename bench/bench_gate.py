"""The gate inside a proxy: the same proxy with the gate on and off, upstream answering at once.

Run by hand (issue 23, goal: the gate adds at most 1 ms to the proxy's p50):

    .venv/bin/python bench/bench_gate.py [--requests 2000] [--clients 32] [--rounds 3]

It starts, all private and torn down at the end: a ``dbus-daemon``, ``uapplaced``
(``alpha`` resident and verified, so admit forwards), ``uapplace-shim`` (admitting
over the peer socket), an *instant upstream* (a bare aiohttp app answering every
``POST /v1/chat/completions`` with one constant completion, so no engine time is
timed), and two proxies from :mod:`uapplace.sim.gateproxy` in ``--single-upstream``
mode (the stock UAP proxy's topology) in front of it:

- *gated*: ``python -m uapplace.sim.gateproxy``, which asks the shim before each
  forward (:class:`uapplace.gate.GateClient`);
- *ungated*: the same :class:`~uapplace.sim.gateproxy.GateProxy` with its admit
  step replaced by an immediate forward: everything else (body read, model
  sniffing, in-flight table, slots, the relay) is the same code.

The same raw-HTTP load generator as ``bench/bench_shim.py`` drives both:
sequential requests in alternating blocks, then N clients in a closed loop; it
prints p50/p99 of each and the gate's share (gated − ungated).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from aiohttp import web

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_shim import (  # noqa: E402
    ADMIT_PATH,
    BODY,
    Connection,
    concurrent,
    percentile,
    seeded_engine,
)
from uapplace.sim import serving  # noqa: E402
from uapplace.sim.gateproxy import (  # noqa: E402
    OPENAI_ROUTE,
    READY_PREFIX,
    Admitted,
    GateProxy,
)

CHAT = json.dumps(
    {"model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
).encode()
COMPLETION = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "model": "alpha",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}}],
}
STARTUP_TIMEOUT_S = 20.0


# --------------------------------------------------------------------------- the processes


def serve_upstream() -> None:
    """Answer every chat completion at once with :data:`COMPLETION`."""

    async def complete(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response(COMPLETION)

    app = web.Application()
    app.router.add_post(OPENAI_ROUTE, complete)
    asyncio.run(serving.serve_until_signalled(app, 0, READY_PREFIX))


class UngatedProxy(GateProxy):
    """:class:`GateProxy` whose admit forwards at once, to its single upstream."""

    async def _admit(self, request: web.Request, model: str) -> Admitted | web.Response:
        assert self.single_upstream is not None
        return Admitted("default", self.single_upstream)


def serve_ungated(controller: str, upstream: str) -> None:
    proxy = UngatedProxy(controller, None, single_upstream=upstream)
    asyncio.run(serving.serve_until_signalled(proxy.app(), 0, READY_PREFIX))


def spawn(argv: list[str], env: dict[str, str] | None, log_path: Path) -> subprocess.Popen[bytes]:
    with log_path.open("wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)


def wait_url(process: subprocess.Popen[bytes], log_path: Path) -> str:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        for line in log_path.read_text(errors="replace").splitlines():
            if line.startswith(READY_PREFIX):
                return line.removeprefix(READY_PREFIX).strip()
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{log_path.name} did not start:\n{log_path.read_text()}")
        time.sleep(0.05)


@contextlib.contextmanager
def running(
    argv: list[str], env: dict[str, str] | None, log_path: Path
) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    process = spawn(argv, env, log_path)
    try:
        yield process, wait_url(process, log_path)
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].rstrip("/"))


# --------------------------------------------------------------------------- load


async def sequential(
    targets: Sequence[tuple[int, str, bytes]], count: int, block: int, warmup: int
) -> list[list[float]]:
    """``count`` requests per target (port, path, body), one connection each, in alternating
    blocks."""
    connections = [Connection(port, path, body) for port, path, body in targets]
    for connection in connections:
        await connection.open()
    try:
        for connection in connections:
            for _ in range(warmup):
                await connection.admit()
            assert connection.last_body.startswith(b'{"'), connection.last_body
        results: list[list[float]] = [[] for _ in targets]
        while len(results[0]) < count:
            for connection, latencies in zip(connections, results, strict=True):
                latencies.extend([await connection.admit() for _ in range(block)])
        return results
    finally:
        for connection in connections:
            await connection.close()


# --------------------------------------------------------------------------- main


def measure(
    ports: dict[str, int], shim_port: int, args: argparse.Namespace
) -> dict[str, dict[str, float]]:
    """One round: sequential p50/p99 and closed-loop p50/p99/rps for each proxy; the shim's
    admit alone (the same raw client, sequential, in the same alternating blocks)."""
    targets = [(port, OPENAI_ROUTE, CHAT) for port in ports.values()]
    targets.append((shim_port, ADMIT_PATH, BODY))
    seq = asyncio.run(sequential(targets, args.requests, args.block, args.warmup))
    figures: dict[str, dict[str, float]] = {"shim admit": {"seq p50": statistics.median(seq[-1])}}
    for (name, port), latencies in zip(ports.items(), seq, strict=False):
        loaded, wall = asyncio.run(
            concurrent(port, args.clients, args.per_client, OPENAI_ROUTE, CHAT)
        )
        figures[name] = {
            "seq p50": statistics.median(latencies),
            "seq p99": percentile(latencies, 0.99),
            "closed p50": statistics.median(loaded),
            "closed p99": percentile(loaded, 0.99),
            "closed rps": len(loaded) / wall,
        }
    return figures


def report(rounds: list[dict[str, dict[str, float]]]) -> None:
    print(f"medians over {len(rounds)} rounds:")
    for figure in ("seq p50", "seq p99", "closed p50", "closed p99", "closed rps"):
        gated = statistics.median(r["gated"][figure] for r in rounds)
        ungated = statistics.median(r["ungated"][figure] for r in rounds)
        if figure.endswith("rps"):
            print(f"  {figure:<10}  ungated {ungated:9.0f}/s  gated {gated:9.0f}/s")
            continue
        print(
            f"  {figure:<10}  ungated {ungated * 1000:7.3f} ms  gated {gated * 1000:7.3f} ms  "
            f"gate +{(gated - ungated) * 1000:.3f} ms"
        )
    shim = statistics.median(r["shim admit"]["seq p50"] for r in rounds)
    gate = statistics.median(r["gated"]["seq p50"] - r["ungated"]["seq p50"] for r in rounds)
    print(
        f"  the gate's +{gate * 1000:.3f} ms (seq p50): the shim's admit alone "
        f"{shim * 1000:.3f} ms (a raw client, same blocks) + {(gate - shim) * 1000:.3f} ms "
        "(the proxy's admit client, its hop, and scheduling five processes on this machine)"
    )
    print("goal (issue 23): the gate adds at most 1 ms to the proxy's p50")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve-upstream", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--serve-ungated", nargs=2, metavar=("CONTROLLER", "UPSTREAM"))
    parser.add_argument("--requests", type=int, default=2000, help="sequential per proxy")
    parser.add_argument("--block", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--per-client", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.serve_upstream:
        serve_upstream()
        return 0
    if args.serve_ungated:
        serve_ungated(*args.serve_ungated)
        return 0

    from tests.bus.conftest import make_env, start_daemon, wait_published, wait_until
    from tests.bus.dbusmock_fixtures import private_bus
    from tests.bus.shim_fixtures import SEEDED_LEDGER, ShimProcess, start_shim

    me = [sys.executable, __file__]
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as scratch:
        root = Path(scratch)
        (root / "bus").mkdir()
        with private_bus("session", root / "bus") as address, seeded_engine(root):
            uap = make_env(root / "world", address)
            uap.seed_ledger(SEEDED_LEDGER)
            daemon = start_daemon(uap)
            shim: ShimProcess | None = None
            try:
                wait_until(lambda: "owns org.uap.Placement1" in daemon.log(), "uapplaced wired")
                wait_published(address)
                shim = start_shim(uap.env, address, root)
                gated_argv = [sys.executable, "-m", "uapplace.sim.gateproxy"]
                gated_argv += ["--controller", shim.base_url, "--single-upstream"]
                with (
                    running([*me, "--serve-upstream"], None, root / "upstream.log") as (_, up),
                    running([*gated_argv, up], uap.env, root / "gated.log") as (_, gated),
                    running(
                        [*me, "--serve-ungated", shim.base_url, up], uap.env, root / "ungated.log"
                    ) as (_, ungated),
                ):
                    ports = {"gated": port_of(gated), "ungated": port_of(ungated)}
                    shim_port = port_of(shim.base_url)
                    rounds = [measure(ports, shim_port, args) for _ in range(args.rounds)]
            finally:
                if shim is not None:
                    shim.stop()
                daemon.stop()
    report(rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
