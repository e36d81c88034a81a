"""A burst of concurrent ``Admit`` calls on the bus: does uapplaced survive it? (issue 11)

Run by hand: ``.venv/bin/python bench/bench_burst.py [--runs 5] [--calls 1000]
[--connections 10] [--model-bytes N] [--no-fix | --only-fixed]``.

It starts a private ``dbus-daemon`` and the real ``uapplaced`` on it (the bus
tier's test registry, ``alpha`` resident so ``Admit`` forwards), then fires
``--calls`` ``Admit`` calls at once, spread over ``--connections`` client
connections, ``--runs`` times, and reports per run: calls answered, the error
replies, whether the daemon is still the same live process, and throughput
(answered calls per second of the burst).

Two daemons are measured, each on its own bus:

- *before* (``--no-fix`` runs only this one): uapplaced with dbus-fast's own
  write path (``uapplace.bus.connection.OrderedWriter.write_callback`` put back to
  upstream's), where ``EAGAIN`` on a full send buffer ends the connection;
- *after*: uapplaced as shipped (:mod:`uapplace.bus.connection`).

A daemon that died is started afresh for the next run, so each run gets a fair
try. The clients always use :func:`uapplace.bus.connection.connect`, so what gives way is
the daemon, not the load generator. Everything is private and removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.bus.burst import (  # noqa: E402
    BurstResult,
    bus_burst,
    owner_pid,
    spawn_daemon_unfixed,
)
from tests.bus.conftest import (  # noqa: E402
    DaemonProcess,
    UapEnv,
    make_env,
    name_has_owner,
    seeded_engine_running,
    spawn_daemon,
    wait_published,
    wait_until,
)
from tests.bus.dbusmock_fixtures import private_bus  # noqa: E402
from tests.bus.shim_fixtures import SEEDED_LEDGER  # noqa: E402
from uapplace.files.paths import BUS_NAME  # noqa: E402

STARTUP_TIMEOUT_S = 30.0


@dataclass
class Tally:
    label: str
    results: list[BurstResult] = field(default_factory=list)
    survived: list[bool] = field(default_factory=list)

    def summary(self) -> str:
        calls = sum(r.calls for r in self.results)
        answered = sum(r.answered for r in self.results)
        rates = [r.per_second for r in self.results if r.answered == r.calls]
        rate = f"{statistics.median(rates):.0f}/s" if rates else "n/a (no complete run)"
        return (
            f"{self.label}: answered {answered}/{calls}, daemon survived "
            f"{sum(self.survived)}/{len(self.survived)} runs, median throughput of the "
            f"complete runs {rate}"
        )


def start(uap: UapEnv, fixed: bool) -> DaemonProcess:
    daemon = spawn_daemon(uap) if fixed else spawn_daemon_unfixed(uap)
    wait_until(
        lambda: name_has_owner(uap.bus_address) or daemon.process.poll() is not None,
        "uapplaced to take its name",
        STARTUP_TIMEOUT_S,
    )
    wait_until(
        lambda: f"owns {BUS_NAME}" in daemon.log() or daemon.process.poll() is not None,
        "uapplaced to finish wiring",
        STARTUP_TIMEOUT_S,
    )
    if daemon.process.poll() is not None:
        raise RuntimeError(f"uapplaced exited at start:\n{daemon.log()}")
    wait_published(uap.bus_address)
    return daemon


def measure(label: str, fixed: bool, args: argparse.Namespace) -> Tally:
    tally = Tally(label)
    with (
        tempfile.TemporaryDirectory(prefix="bench-burst-") as raw,
        private_bus("session", Path(raw)) as address,
        seeded_engine_running(Path(raw)),
    ):
        uap = make_env(Path(raw) / "world", address)
        uap.seed_ledger(SEEDED_LEDGER)
        daemon = start(uap, fixed)
        try:
            for run in range(1, args.runs + 1):
                pid = daemon.pid
                result = asyncio.run(bus_burst(address, args.calls, args.connections, args.model))
                alive = daemon.process.poll() is None and owner_pid(address) == pid
                tally.results.append(result)
                tally.survived.append(alive)
                errors = Counter({k: v for k, v in result.outcomes.items() if k != "ok"})
                print(
                    f"  {label} run {run}: answered {result.answered}/{result.calls} "
                    f"in {result.seconds:.2f} s ({result.per_second:.0f}/s), "
                    f"daemon pid {pid} {'still owns the name' if alive else 'LOST the bus'}"
                    + (f", errors {dict(errors)}" if errors else "")
                )
                if not alive:
                    daemon.stop()  # it is exiting (bus lost) or exited already
                    wait_until(lambda: not name_has_owner(address), "the name to be free")
                    daemon = start(uap, fixed)
        finally:
            daemon.stop()
    return tally


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--connections", type=int, default=10)
    parser.add_argument(
        "--model-bytes",
        type=int,
        default=0,
        help="ask for a model id this long (unknown: a park) instead of the resident alpha",
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--no-fix", action="store_true", help="only the daemon without busio")
    which.add_argument("--only-fixed", action="store_true", help="only the shipped daemon")
    args = parser.parse_args()
    args.model = "m" * args.model_bytes if args.model_bytes > 0 else "alpha"
    print(
        f"{args.runs} runs of {args.calls} concurrent Admit calls over "
        f"{args.connections} connections, model id {args.model[:16]!r} ({len(args.model)} bytes)"
    )
    tallies = []
    if not args.only_fixed:
        tallies.append(measure("before (dbus-fast writer)", False, args))
    if not args.no_fix:
        tallies.append(measure("after (uapplace.bus.connection)", True, args))
    for tally in tallies:
        print(tally.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
