"""Admit latency while a swap runs, against admit latency at rest (issue 23).

pystemd holds the GIL for the whole of a call to systemd (docs/architecture.md,
"Decision: pystemd's calls in a worker process"), so while enforcement read unit states
the loop that answers ``Admit`` froze. This bench runs the daemon's controller and
enforcement in this process, on the demo's sandbox (a contained ``systemd --user``, two
fake engines as real units, one must stop for the other to start: as ``bench_swap.py``),
and probes the loop the way an arriving ``Admit`` meets it: every ``--every-ms`` a probe
wakes and calls ``Controller.admit``; its latency is how late it woke plus the admit
(what a request arriving at that instant waits for). Two phases per mode:

- **rest**: the probe alone for ``--rest-s`` seconds;
- **swap**: the probe while ``--swaps`` Applies swap the two models back and forth;
- **reads**: the probe while unit states are read back to back for ``--rest-s`` seconds
  (what preflight, the unit sync and a failed run's report do): the GIL stall alone,
  without the rest of a swap's work.

Modes, in one run: ``thread`` (pystemd's calls on a thread of this process, as before
issue 23) and ``worker`` (in the unit worker process, the default). Prints p50, p99 and
the max of each phase, the ratio swap p99 ÷ rest p99 per mode (goal ≤ 1.5: a swap is
not felt by admits) and the worker's swap p99 against the thread's. Needs root (the
contained manager). Not a test: nothing here asserts a speed.

    .venv/bin/python bench/bench_admit_during_swap.py [--swaps 4] [--rest-s 3]
        [--modes thread,worker] [--every-ms 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path

from uapplace.controller.controller import Controller
from uapplace.demo.sandbox import CODER, WRITER, Sandbox, SandboxSpec
from uapplace.io.units import UnitManager
from uapplace.sim.usermanager import can_contain

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_swap import in_process  # noqa: E402

GOAL_RATIO = 1.5
PROBE_MODEL = "bench-probe-unknown-model"
"""The probe admits an id no registry has: one deduped pending entry, no forward, so the
swaps it watches are not changed by it."""
MODES = ("thread", "worker")


@dataclass
class Phase:
    latencies: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class ModeResult:
    mode: str
    rest: Phase = field(default_factory=Phase)
    swap: Phase = field(default_factory=Phase)
    reads: Phase = field(default_factory=Phase)
    swap_s: list[float] = field(default_factory=list)
    read_count: int = 0


async def probe(controller: Controller, every_s: float, into: Phase, stop: asyncio.Event) -> None:
    """Admit every ``every_s``; record how long after its due time each admit returned."""
    while not stop.is_set():
        due = time.perf_counter() + every_s
        await asyncio.sleep(every_s)
        controller.admit(PROBE_MODEL, "bench-probe", "", 0)
        into.latencies.append(time.perf_counter() - due)


class Probing:
    """A running :func:`probe` into one phase; :meth:`end` stops it and waits for it."""

    def __init__(self, controller: Controller, every_s: float, into: Phase) -> None:
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(probe(controller, every_s, into, self._stop))

    async def end(self) -> None:
        self._stop.set()
        await self._task


async def run_mode(
    box: Sandbox, mode: str, swaps: int, rest_s: float, every_s: float
) -> ModeResult:
    result = ModeResult(mode)
    async with AsyncExitStack() as stack:
        way = await in_process(stack, box, units_in_process=mode == "thread")
        controller = way.controller
        assert controller is not None
        await way.wait_resident(CODER)
        await asyncio.sleep(0.5)  # start-up reads settle
        probing = Probing(controller, every_s, result.rest)
        await asyncio.sleep(rest_s)
        await probing.end()
        probing = Probing(controller, every_s, result.swap)
        try:
            for index in range(swaps):
                start = WRITER if index % 2 == 0 else CODER
                took, _steps = await way.swap(start)
                result.swap_s.append(took)
                print(f"  {mode:6} swap → {start.key:12} {took * 1000:8.1f} ms", flush=True)
        finally:
            await probing.end()
        if swaps % 2:  # leave CODER resident for the next mode
            await way.swap(CODER)
        assert way.units is not None
        probing = Probing(controller, every_s, result.reads)
        try:
            result.read_count = await read_states(way.units, rest_s)
        finally:
            await probing.end()
    return result


async def read_states(units: UnitManager, seconds: float) -> int:
    """Read both units' states back to back for ``seconds``: how many reads."""
    deadline = time.monotonic() + seconds
    count = 0
    while time.monotonic() < deadline:
        await units.state(CODER.unit)
        await units.state(WRITER.unit)
        count += 2
    return count


async def run(modes: list[str], swaps: int, rest_s: float, every_s: float) -> list[ModeResult]:
    spec = SandboxSpec(load_secs=1.0, resident=CODER, shim=False, daemon=False, pause_lever=None)
    results = []
    async with AsyncExitStack() as stack:
        box = await Sandbox.create(stack, spec, contain=True)
        for mode in modes:
            results.append(await run_mode(box, mode, swaps, rest_s, every_s))
    return results


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:7.2f}"


def report(results: list[ModeResult]) -> int:
    print()
    print("admit latency (late wake + admit), ms       p50      p99      max      n")
    for result in results:
        phases = (("rest", result.rest), ("swap", result.swap), ("reads", result.reads))
        for name, phase in phases:
            if not phase.latencies:
                continue
            print(
                f"  {result.mode:6} {name:5}                         "
                f"{_ms(statistics.median(phase.latencies))}  {_ms(phase.quantile(0.99))}  "
                f"{_ms(max(phase.latencies))}  {len(phase.latencies):5}"
            )
    print()
    by_mode = {r.mode: r for r in results}
    for result in results:
        ratio = result.swap.quantile(0.99) / result.rest.quantile(0.99)
        verdict = "PASS" if ratio <= GOAL_RATIO else "FAIL"
        print(
            f"{result.mode:6}: swap p99 ÷ rest p99 = {ratio:5.2f}  goal ≤ {GOAL_RATIO}: {verdict}"
            f"   (swap median {statistics.median(result.swap_s) * 1000:.0f} ms)"
        )
    for result in results:
        print(f"{result.mode:6}: {result.read_count} unit-state reads in the reads phase")
    if "thread" in by_mode and "worker" in by_mode:
        for name in ("swap", "reads"):
            before = getattr(by_mode["thread"], name)
            after = getattr(by_mode["worker"], name)
            print(
                f"during {name:5}, worker ÷ thread: "
                f"p99 {after.quantile(0.99) / before.quantile(0.99):.2f}, "
                f"max {max(after.latencies) / max(before.latencies):.2f}"
            )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--swaps", type=int, default=4, help="Applies per mode (default 4)")
    parser.add_argument("--rest-s", type=float, default=3.0, help="probe at rest (default 3 s)")
    parser.add_argument("--every-ms", type=float, default=2.0, help="probe period (default 2)")
    parser.add_argument(
        "--modes", default=",".join(MODES), help="comma-separated: thread, worker (default both)"
    )
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes: unknown {bad or 'empty'}; choose from {', '.join(MODES)}")
    if args.swaps < 1:
        parser.error("--swaps must be at least 1")
    if args.rest_s <= 0 or args.every_ms <= 0:
        parser.error("--rest-s and --every-ms must be > 0")
    ok, why = can_contain()
    if not ok:
        print(f"bench_admit_during_swap needs a contained systemd --user: {why}", file=sys.stderr)
        return 2
    print(f"admit during swap: modes {', '.join(modes)}, {args.swaps} swaps each")
    try:
        results = asyncio.run(run(modes, args.swaps, args.rest_s, args.every_ms / 1000))
    except KeyboardInterrupt:
        return 130
    return report(results)


if __name__ == "__main__":
    sys.exit(main())
