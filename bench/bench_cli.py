"""The light CLI end to end against its floor: ``uapplace apply ID 1 --yes`` and friends.

Issue 23: "Apply end-to-end through the CLI costs no more than the run itself plus one
round trip". This bench takes the run out: a private ``dbus-daemon`` and a stand-in
``org.uap.Placement1`` (this file with ``--serve``) whose ``Apply`` emits four
``EnforcementStep`` signals and answers at once, so what is timed is the command itself:
Python's start, its imports, the impact preview, the call, the output, the exit.

The floor is a process that imports ``dbus_fast.aio``, connects (``Hello``) and makes
one call (``ListPending``), then exits: what no D-Bus client in Python can go under.
Each round runs every command once, alternating, so load on this shared machine hits
all of them alike; with ``--baseline-tree DIR`` (a ``git archive HEAD`` copy) the same
commands run from that tree too (``PYTHONPATH``). Run by hand:

    .venv/bin/python bench/bench_cli.py [--rounds 10] [--baseline-tree DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Annotated, Any, NamedTuple

from dbus_fast.aio import MessageBus
from dbus_fast.annotations import DBusSignature, DBusStr, DBusUInt32
from dbus_fast.service import ServiceInterface, dbus_method, dbus_signal

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bus.dbusmock_fixtures import private_bus  # noqa: E402
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH  # noqa: E402

PLACEMENT_ID = "plc-000001"
STEPS = ("revalidate", "stop", "start", "verify-up")
Signature = Annotated[list[str], DBusSignature("as")]
Step = Annotated[list[Any], DBusSignature("ssbs")]

PENDING = {
    "pending": [
        {
            "id": PLACEMENT_ID,
            "requested_model": "alpha",
            "client": "bench",
            "expires_at": "2099-01-01T00:00:00Z",
            "reason": "no_capacity",
            "options": [
                {
                    "kind": "displace",
                    "model": "alpha",
                    "config": "q4",
                    "device": "gpu0",
                    "cost_mib": 9000,
                    "victims": [
                        {
                            "model": "beta",
                            "config": "f16",
                            "device": "gpu0",
                            "state": "serving",
                            "in_flight": False,
                            "holders": [],
                            "frees_mib": 8000,
                            "consequence": "stops",
                        }
                    ],
                    "frees_mib": 8000,
                    "signature": ["beta/f16"],
                }
            ],
        }
    ]
}
STATE = {"daemon": True, "devices": {}, "residents": [], "pending": [], "holds": []}

FLOOR = f"""
import asyncio, os
from dbus_fast import Message
from dbus_fast.aio import MessageBus

async def main():
    bus = await MessageBus(bus_address=os.environ["DBUS_SESSION_BUS_ADDRESS"]).connect()
    await bus.call(Message(destination={BUS_NAME!r}, path={OBJECT_PATH!r},
                           interface={INTERFACE!r}, member="ListPending"))
    bus.disconnect()

asyncio.run(main())
"""


class StandIn(ServiceInterface):
    """The calls the timed commands make, answered at once (``Apply``: four steps)."""

    def __init__(self) -> None:
        super().__init__(INTERFACE)
        self.runs = 0

    @dbus_method()
    def ListPending(self) -> DBusStr:
        return json.dumps(PENDING)

    @dbus_method()
    def GetState(self) -> DBusStr:
        return json.dumps(STATE)

    @dbus_method()
    def Apply(self, placement_id: DBusStr, option: DBusUInt32, expected: Signature) -> DBusStr:
        self.runs += 1
        run_id = f"run-{self.runs}"
        for step in STEPS:
            self.EnforcementStep([run_id, step, True, ""])
        steps = [{"name": step, "ok": True} for step in STEPS]
        return json.dumps({"ok": True, "runId": run_id, "steps": steps})

    @dbus_signal()
    def EnforcementStep(self, body: list[Any]) -> Step:
        return body


async def serve(address: str) -> None:
    bus = await MessageBus(bus_address=address).connect()
    bus.export(OBJECT_PATH, StandIn())
    await bus.request_name(BUS_NAME)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    await bus.wait_for_disconnect()  # type: ignore[no-untyped-call]


COMMANDS: dict[str, list[str]] = {
    "apply --yes": ["-m", "uapplace.cli", "apply", PLACEMENT_ID, "1", "--yes"],
    "pending": ["-m", "uapplace.cli", "pending"],
    "status --json": ["-m", "uapplace.cli", "status", "--json"],
    "--help": ["-m", "uapplace.cli", "--help"],
}


class Sample(NamedTuple):
    wall_ms: float
    cpu_ms: float
    """user + system time of the process: what load from others inflates least."""


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(argv: list[str], env: dict[str, str]) -> Sample:
    """Run ``argv`` from the tree on ``PYTHONPATH`` (``python -m`` puts the working
    directory first on ``sys.path``: from this tree, a baseline would import this tree)."""
    cpu = _children_cpu_s()
    started = time.perf_counter()
    done = subprocess.run(
        argv, env=env, cwd=env.get("PYTHONPATH"), capture_output=True, text=True, check=False
    )
    elapsed = (time.perf_counter() - started) * 1000
    if done.returncode != 0:
        raise RuntimeError(f"{argv} exited {done.returncode}: {done.stderr}")
    return Sample(elapsed, (_children_cpu_s() - cpu) * 1000)


def bench_env(address: str, pycache: Path | None) -> dict[str, str]:
    """The commands' environment: the private bus, and bytecode cached in ``pycache`` (as
    an installed package has it) unless ``None`` (the caller's setting, e.g. this dev
    environment's ``PYTHONDONTWRITEBYTECODE=1``, where every run compiles the tree)."""
    env = {**os.environ, "DBUS_SESSION_BUS_ADDRESS": address, "COLUMNS": "100"}
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    return env


def measure(env: dict[str, str], rounds: int, baseline: Path | None) -> dict[str, list[Sample]]:
    """Warm up once (untimed: it writes the bytecode), then ``rounds`` alternating rounds."""
    trees = {"now": ROOT, **({"baseline": baseline} if baseline else {})}
    samples: dict[str, list[Sample]] = {}
    for tree in trees.values():
        for args in COMMANDS.values():
            timed([sys.executable, *args], {**env, "PYTHONPATH": str(tree)})
    timed([sys.executable, "-c", FLOOR], env)
    for _ in range(rounds):
        samples.setdefault("floor", []).append(timed([sys.executable, "-c", FLOOR], env))
        samples.setdefault("python -c pass", []).append(timed([sys.executable, "-c", "pass"], env))
        for label, args in COMMANDS.items():
            for tree_name, tree in trees.items():
                tree_env = {**env, "PYTHONPATH": str(tree)}
                key = f"{label} ({tree_name})"
                samples.setdefault(key, []).append(timed([sys.executable, *args], tree_env))
    return samples


def report(samples: dict[str, list[Sample]]) -> None:
    def wall(key: str) -> float:
        return statistics.median(s.wall_ms for s in samples[key])

    def cpu(key: str) -> float:
        return statistics.median(s.cpu_ms for s in samples[key])

    print(
        f"{'command (medians)':<28} {'wall ms':>8} {'min':>7} {'÷ floor':>8} {'− floor':>8} "
        f"{'CPU ms':>7} {'− floor':>8}"
    )
    for key, values in samples.items():
        print(
            f"{key:<28} {wall(key):8.1f} {min(s.wall_ms for s in values):7.1f} "
            f"{wall(key) / wall('floor'):8.2f} {wall(key) - wall('floor'):+8.1f} "
            f"{cpu(key):7.1f} {cpu(key) - cpu('floor'):+8.1f}"
        )
    now = wall("apply --yes (now)")
    print(
        f"goal: apply --yes (its run takes ~0 here) ≤ floor + one round trip; "
        f"now floor + {now - wall('floor'):.1f} ms"
    )
    if "apply --yes (baseline)" in samples:
        before = wall("apply --yes (baseline)")
        print(
            f"apply --yes: baseline {before:.1f} ms → now {now:.1f} ms ({now / before:.2f}×); "
            f"CPU {cpu('apply --yes (baseline)'):.1f} → {cpu('apply --yes (now)'):.1f} ms"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--baseline-tree", type=Path, default=None)
    parser.add_argument(
        "--as-is",
        action="store_true",
        help="keep the caller's bytecode settings (default: cached, as installed)",
    )
    parser.add_argument("--serve", metavar="ADDRESS", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return 0
    with (
        tempfile.TemporaryDirectory(prefix="bench-cli-") as directory,
        private_bus("session", Path(directory)) as address,
    ):
        service = subprocess.Popen(
            [sys.executable, __file__, "--serve", address], stdout=subprocess.PIPE, text=True
        )
        try:
            assert service.stdout is not None
            if service.stdout.readline().strip() != "ready":
                raise RuntimeError("the stand-in service did not start")
            pycache = None if args.as_is else Path(directory) / "pycache"
            report(measure(bench_env(address, pycache), args.rounds, args.baseline_tree))
        finally:
            service.terminate()
            service.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
