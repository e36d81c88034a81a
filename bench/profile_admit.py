"""Where an admit's CPU goes: ``uapplace-shim`` and ``uapplaced`` under cProfile over N admits.

Run by hand (issue 23, "Admit at its floor"):

    .venv/bin/python bench/profile_admit.py [--admits 10000] [--top 5]

It starts a private ``dbus-daemon``, ``uapplaced`` (``alpha`` resident and verified by
the fake engine, so admit forwards) and ``uapplace-shim`` (admitting over the peer
socket), both as ``python -m cProfile -o FILE -m …``; warms up, sends ``--admits``
sequential admits over one keep-alive connection, stops both with SIGTERM (each
writes its profile as it exits) and prints, per process, the functions called at
least once per admit (so start-up and idle time drop out), by their own time and
by cumulative time. ``--out DIR`` keeps the ``.prof`` files. ``--baseline-tree DIR``
profiles a second shim from another source tree, the two taking turns, so a
before/after comparison runs under one load (this machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_shim import Connection, seeded_engine  # noqa: E402
from tests.bus.conftest import (  # noqa: E402
    DaemonProcess,
    make_env,
    name_has_owner,
    wait_published,
    wait_until,
)
from tests.bus.dbusmock_fixtures import private_bus  # noqa: E402
from tests.bus.shim_fixtures import LISTENING, SEEDED_LEDGER, without_guid  # noqa: E402
from uapplace.files.paths import BUS_NAME  # noqa: E402

STARTUP_TIMEOUT_S = 30.0


def profiled(module: str, profile: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "cProfile", "-o", str(profile), "-m", module, *args]


def spawn(
    argv: list[str], env: dict[str, str], log_path: Path, cwd: Path = ROOT
) -> subprocess.Popen[bytes]:
    """``argv`` in ``cwd`` (``python -m`` imports the package from there)."""
    with log_path.open("wb") as log:
        return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=cwd)


def wait_listening(process: subprocess.Popen[bytes], log_path: Path) -> int:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        found = LISTENING.search(log_path.read_text(encoding="utf-8", errors="replace"))
        if found:
            return int(found.group(1).rsplit(":", 1)[1])
        if process.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"uapplace-shim did not listen:\n{log_path.read_text()}")
        time.sleep(0.05)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.kill(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def drive(ports: Sequence[int], count: int, warmup: int, block: int = 100) -> list[float]:
    """``count`` sequential admits per shim after ``warmup``, the shims taking turns in blocks
    of ``block`` (a slow spell of the machine hits all alike); each one's median in seconds."""
    connections = [Connection(port) for port in ports]
    try:
        for connection in connections:
            await connection.open()
            for _ in range(warmup):
                await connection.admit()
            assert b'"forward"' in connection.last_body, connection.last_body
        latencies: list[list[float]] = [[] for _ in ports]
        while len(latencies[0]) < count:
            for connection, mine in zip(connections, latencies, strict=True):
                mine.extend([await connection.admit() for _ in range(min(block, count))])
        return [sorted(mine)[len(mine) // 2] for mine in latencies]
    finally:
        for connection in connections:
            await connection.close()


IDLE = "<method 'poll' of 'select.epoll' objects>"
"""The event loop waiting for the next byte: idle time, not a cost."""

Row = tuple[str, float, float, float]


def hot_rows(profile: Path, admits: int) -> list[Row]:
    """(function, calls per admit, own µs per admit, cumulative µs per admit) of every
    function called at least once per admit, the idle wait left out.

    ``admits`` counts the warm-up too: the profile covers the whole run. A coroutine's
    every resumption counts as a call, and its time is the time it ran, not awaited."""
    raw = pstats.Stats(str(profile)).stats  # type: ignore[attr-defined]
    rows: list[Row] = []
    for (path, line, name), (_, calls, own, cumulative, _callers) in raw.items():
        where = name if path == "~" else f"{shorten(path)}:{line}({name})"
        if calls >= admits and where != IDLE:
            per = 1e6 / admits
            rows.append((where, calls / admits, own * per, cumulative * per))
    return rows


def shorten(path: str) -> str:
    if "/uapplace/" in path:  # this tree's or the baseline tree's
        return "uapplace/" + path.rsplit("/uapplace/", 1)[1]
    for marker in ("site-packages/", "/lib/python3"):
        if marker in path:
            return path.split(marker, 1)[1].removeprefix(".11/").removeprefix(".12/")
    return path


def table(rows: Sequence[Row], top: int, by_own: bool) -> str:
    """The ``top`` rows by own time (``by_own``) or by cumulative time."""
    lines = [f"{'own µs':>8} {'cum µs':>8} {'calls':>6}  function (per admit)"]
    ranked = sorted(rows, key=lambda row: -(row[2] if by_own else row[3]))
    for where, calls, own, cumulative in ranked[:top]:
        lines.append(f"{own:8.1f} {cumulative:8.1f} {calls:6.2f}  {where}")
    return "\n".join(lines)


def report(name: str, profile: Path, admits: int, top: int) -> None:
    rows = hot_rows(profile, admits)
    print(f"== {name}: functions called >= once per admit ({admits} admits; idle wait left out)")
    print(f"-- top {top} by own time")
    print(table(rows, top, by_own=True))
    ours = [row for row in rows if row[0].startswith("uapplace/")]
    print(f"-- top {top} of uapplace's own functions by cumulative time")
    print(table(ours, top, by_own=False))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--admits", type=int, default=10_000)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="keep the .prof files here")
    parser.add_argument(
        "--baseline-tree",
        type=Path,
        default=None,
        help="also profile a shim from this source tree (`git archive HEAD uapplace | tar -x "
        "-C DIR`), driven in turns with this tree's: before and after under one load",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="profile-admit-") as scratch:
        root = Path(scratch)
        out = args.out or root
        out.mkdir(parents=True, exist_ok=True)
        (root / "bus").mkdir()
        with private_bus("session", root / "bus") as address, seeded_engine(root):
            uap = make_env(root / "world", address)
            uap.seed_ledger(SEEDED_LEDGER)
            daemon_log = root / "uapplaced.log"
            daemon = spawn(
                profiled("uapplace.daemon", out / "uapplaced.prof", "--log-level", "INFO"),
                uap.env,
                daemon_log,
            )
            shims: list[subprocess.Popen[bytes]] = []
            trees = {"uapplace-shim": ROOT}
            if args.baseline_tree is not None:
                trees["uapplace-shim (baseline tree)"] = args.baseline_tree.resolve()
            try:
                wait_until(lambda: name_has_owner(address), "uapplaced on the bus", 30)
                wiring = DaemonProcess(daemon, daemon_log, uap)
                wait_until(lambda: f"owns {BUS_NAME}" in wiring.log(), "uapplaced wired", 30)
                wait_published(address)
                ports = []
                for index, tree in enumerate(trees.values()):
                    shim_log = root / f"shim-{index}.log"
                    argv = ["--port", "0", "--bus-address", without_guid(address)]
                    shim = spawn(
                        profiled("uapplace.shim", out / f"shim-{index}.prof", *argv),
                        uap.env,
                        shim_log,
                        tree,
                    )
                    shims.append(shim)
                    ports.append(wait_listening(shim, shim_log))
                medians = asyncio.run(drive(ports, args.admits, args.warmup))
                for index in range(len(trees)):
                    text = (root / f"shim-{index}.log").read_text()
                    assert "admits go over the peer socket" in text, text
            finally:
                for shim in shims:
                    stop(shim)
                stop(daemon)
        for name, p50 in zip(trees, medians, strict=True):
            print(
                f"profile_admit: {name}: {args.admits} sequential admits, p50 {p50 * 1000:.3f} ms"
            )
        total = args.admits + args.warmup
        for index, name in enumerate(trees):
            report(name, out / f"shim-{index}.prof", total, args.top)
        report("uapplaced", out / "uapplaced.prof", total * len(trees), args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
