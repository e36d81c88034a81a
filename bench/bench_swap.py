"""Swap time: uapplace's enforcement against a bare shell swap, on the same units.

Builds the demo's sandbox (:class:`uapplace.demo.sandbox.Sandbox`): a contained
``systemd --user``, a simulated 24 GiB GPU, two fake engines as real units
(``coder-7b`` 14 GiB, ``writer-13b`` 16 GiB, each 1 s to turn healthy, so one
must stop for the other to start), a fake of the proxy's internal routes and
``uapplaced``. Then alternates, for several rounds:

- **baseline**: ``systemctl --user stop A; systemctl --user start B; poll B's
  /health every 50 ms`` (bash + curl), timed around the whole script;
- **enforcement**: ``Apply`` over the bus on a parked request for B (revalidate,
  mark-draining, drain against the proxy, stop, verify-free, start, verify-up
  with /v1/models, refresh-proxy, resolve), timed around the ``Apply`` call.
  ``--via inprocess`` runs ``Enforcer.apply`` in this process instead (the
  daemon's controller and enforcement, without the bus).

Each round swaps both ways with both methods (baseline A→B, enforcement B→A,
enforcement A→B, baseline B→A). Prints every sample; each figure as median
[interquartile] (min – max); the paired ratios (each enforcement against the shell swap
of the same direction in the same round); the time outside the engine's load (the swap
less verify-up against the shell's less its poll); the per-step times of the enforcement
(from the ``EnforcementStep`` signals) and, by part, against the shell's own ``stop``,
``start`` and ``poll`` (stamped inside its script, :mod:`bench.shell_swap`). Target:
ratio ≤ 1.02 (issue 23; was 1.10). Needs root (contained manager).

``--ab-daemon-cmd CMD`` builds a second sandbox whose ``uapplaced`` is ``CMD`` and runs
the two sandboxes' rounds in turns: a before/after under one load (docs/performance.md,
"Swap at the shell's pace"), e.g. ``--daemon-cmd "env -C BASE PYTHONPATH=BASE
.venv/bin/python -m uapplace.daemon" --ab-daemon-cmd "env -C . .venv/bin/python -m
uapplace.daemon"`` (``env -C``: ``python -m`` puts its working directory first).

``--pause`` (issue 12) measures the pause/wake column instead: both fake engines run
the vLLM sleep API (``--sleep-mode``, ``--cold-secs`` to load, default 20 s,
``--wake-secs`` to wake, default 1.5 s) and declare ``pause_lever: vllm-sleep-1``.
In one run: stop-swaps (Apply of the option that stops the resident and cold-starts
the other, both ways), then one untimed pause + cold start so both are loaded, then
pause-swaps (Apply of the wake option that pauses the resident and wakes the other,
both ways). Prints every sample, the medians and the ratio pause-swap ÷ stop-swap
(target well under 0.2).

``--engine llama.cpp`` runs both on real llama.cpp ``llama-server`` units on the CPU
tier instead (:mod:`bench.real_swap`: the swap through ``uapplace apply`` end to end
and its run time against the shell, goals 1.10× and 1.02×; with ``--pause``, a
llama-server router's unload + load against a cold stop; start; poll). Needs ``make
engine``; exits 2 naming it when the binary is missing.

    .venv/bin/python bench/bench_swap.py [--rounds 4] [--via bus|inprocess]
    .venv/bin/python bench/bench_swap.py --rounds 8 --daemon-cmd CMD --ab-daemon-cmd CMD
    .venv/bin/python bench/bench_swap.py --pause --rounds 1
    .venv/bin/python bench/bench_swap.py --engine llama.cpp [--rounds 4] [--pause]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dbus_fast import Message, MessageType

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.controller.controller import Controller
from uapplace.controller.holds import ProxyHolders
from uapplace.controller.ports import NoEvents
from uapplace.core.errors import no_pending
from uapplace.core.model import Decision
from uapplace.daemon.wiring import attach_enforcement
from uapplace.demo.sandbox import CODER, WRITER, DemoModel, Sandbox, SandboxSpec
from uapplace.files.paths import INTERFACE, Paths
from uapplace.io.engines import ProxyClient
from uapplace.io.units import UnitManager
from uapplace.sim.usermanager import can_contain

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import real_swap  # noqa: E402
from bench.shell_swap import ShellParts, shell_swap_parts, spread  # noqa: E402

TARGET_RATIO = 1.02
PAUSE_TARGET_RATIO = 0.2
GUARD_S = 60.0


@dataclass
class Samples:
    baseline: list[float] = field(default_factory=list)
    enforcement: list[float] = field(default_factory=list)
    steps: dict[str, list[float]] = field(default_factory=dict)
    shell_parts: list[ShellParts] = field(default_factory=list)
    paired: list[tuple[float, float]] = field(default_factory=list)
    """(enforcement, shell) of the same direction in the same round: the paired ratios."""
    outside_engine: list[tuple[float, float]] = field(default_factory=list)
    """(enforcement less verify-up, shell less its poll), paired as above: the time each
    spends on anything but waiting for the engine to load, the noisiest part."""


# --------------------------------------------------------------------------- the two ways


class Enforcement:
    """Parks a request for a model, then times its Apply; records step arrival times."""

    def __init__(
        self,
        admit: Callable[[str, str], Awaitable[dict[str, Any]]],
        pending_options: Callable[[str], Awaitable[list[dict[str, Any]]]],
        apply: Callable[[str, int, list[str]], Awaitable[dict[str, Any]]],
        residents: Callable[[], Awaitable[list[tuple[str, str]]]],
    ) -> None:
        self.admit = admit
        self.pending_options = pending_options
        self.apply = apply
        self.residents = residents
        self.step_times: list[tuple[str, float]] = []
        self.round = 0
        self.controller: Controller | None = None
        """The in-process controller (``None`` over the bus)."""
        self.units: UnitManager | None = None
        """The in-process enforcement's unit manager (``None`` over the bus)."""

    def on_step(self, step: str) -> None:
        self.step_times.append((step, time.perf_counter()))

    async def swap(
        self, start: DemoModel, form: str | None = None
    ) -> tuple[float, dict[str, float]]:
        """Apply the first option for ``start``, or the first whose victims are all
        ``form`` (``"stop"`` / ``"pause"``), with its signature."""
        self.round += 1
        answer = await self.admit(start.key, f"bench-{self.round}")
        if answer.get("decision") != "park":
            raise RuntimeError(f"expected a park for {start.key}: {answer}")
        placement_id = str(answer["placement_id"])
        options = await self.pending_options(placement_id)
        index = 1
        if form is not None:
            index = next(
                (
                    i
                    for i, option in enumerate(options, start=1)
                    if option["victims"]
                    and all(v.get("action", "stop") == form for v in option["victims"])
                ),
                0,
            )
            if index == 0:
                raise RuntimeError(f"no {form} option for {start.key}: {options}")
        expected = list(options[index - 1].get("signature", []))
        self.step_times.clear()
        started = time.perf_counter()
        result = await self.apply(placement_id, index, expected)
        elapsed = time.perf_counter() - started
        self.step_times.append(("(reply)", started + elapsed))
        if not result.get("ok"):
            raise RuntimeError(f"Apply failed: {result.get('error')}")
        await asyncio.sleep(0.05)  # the last step signals may trail the reply
        steps: dict[str, float] = {}
        previous = started
        for step, at in sorted(self.step_times, key=lambda arrival: arrival[1]):
            steps[step] = steps.get(step, 0.0) + (at - previous)
            previous = at
        return elapsed, steps

    async def wait_resident(self, model: DemoModel) -> None:
        deadline = time.monotonic() + GUARD_S
        while time.monotonic() < deadline:
            if (model.key, "hot") in await self.residents():
                return
            await asyncio.sleep(0.05)
        raise RuntimeError(
            f"{model.key} never became a hot resident in {GUARD_S:g}s: does this uapplaced "
            "follow the units (enforcement wired)? Otherwise try --via inprocess"
        )


async def over_the_bus(stack: AsyncExitStack, box: Sandbox) -> Enforcement:
    client = await PlacementClient.connect(box.bus_address, call_timeout=GUARD_S * 5)
    stack.callback(client.disconnect)

    async def admit(model: str, who: str) -> dict[str, Any]:
        answer: dict[str, Any] = await client.admit(model, who, "", 0)
        return answer

    async def pending_options(placement_id: str) -> list[dict[str, Any]]:
        async with asyncio.timeout(GUARD_S):
            while True:
                listed = await client.list_pending()
                entry = next(e for e in listed["pending"] if e["id"] == placement_id)
                if entry["options"]:
                    return list(entry["options"])
                await asyncio.sleep(0.02)

    async def apply(placement_id: str, index: int, expected: list[str]) -> dict[str, Any]:
        result: dict[str, Any] = await client.apply(placement_id, index, expected)
        return result

    async def residents() -> list[tuple[str, str]]:
        state = await client.get_state()
        return [(r["model"], r["state"]) for r in state["residents"]]

    enforcement = Enforcement(admit, pending_options, apply, residents)

    def on_message(message: Message) -> None:
        if message.message_type is MessageType.SIGNAL and message.member == "EnforcementStep":
            enforcement.on_step(str(message.body[1]))

    client.bus.add_message_handler(on_message)
    await client.bus.call(
        Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            member="AddMatch",
            signature="s",
            body=[f"type='signal',interface='{INTERFACE}',member='EnforcementStep'"],
        )
    )
    return enforcement


class _StepEvents(NoEvents):
    """ControllerEvents for the in-process controller: only the steps matter here."""

    def __init__(self) -> None:
        self.on_step: Callable[[str], None] = lambda _: None

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.on_step(step)


async def in_process(
    stack: AsyncExitStack, box: Sandbox, *, units_in_process: bool = False
) -> Enforcement:
    """The daemon's controller and enforcement in this process; ``units_in_process``
    keeps pystemd's calls on a thread instead of the unit worker process."""
    paths = Paths.from_env(box.client_env())
    events = _StepEvents()
    client = ProxyClient(paths.proxy_url, paths.proxy_token())
    controller = Controller.open(paths, events=events, proxy=ProxyHolders(client))
    await controller.start()
    stack.push_async_callback(controller.shutdown)
    enforcement_stack = await attach_enforcement(
        controller, paths, client, units=UnitManager(box.bus_address, in_process=units_in_process)
    )
    stack.push_async_callback(enforcement_stack.close)

    async def admit(model: str, who: str) -> dict[str, Any]:
        decision: Decision = controller.admit(model, who, "", 0)
        return dict(decision.to_json())

    async def pending_options(placement_id: str) -> list[dict[str, Any]]:
        async with asyncio.timeout(GUARD_S):
            while True:
                entry = controller.admission.get(placement_id)
                if entry is not None and entry.options:
                    return [o.to_json() for o in entry.options]
                await asyncio.sleep(0.02)

    async def apply(placement_id: str, index: int, expected: list[str]) -> dict[str, Any]:
        entry = controller.live_pending_entry(placement_id)
        if entry is None:
            raise no_pending(placement_id)
        return await enforcement_stack.enforcer.apply(entry, index, expected)

    async def residents() -> list[tuple[str, str]]:
        return [(r.model, r.state.value) for r in controller.residents]

    enforcement = Enforcement(admit, pending_options, apply, residents)
    events.on_step = enforcement.on_step
    enforcement.controller = controller
    enforcement.units = enforcement_stack.units
    return enforcement


# --------------------------------------------------------------------------- the run


async def run(rounds: int, via: str, daemon_cmd: str | None) -> Samples:
    (samples,) = await run_trees(rounds, via, [daemon_cmd])
    return samples


async def run_trees(rounds: int, via: str, daemon_cmds: list[str | None]) -> list[Samples]:
    """One sandbox per daemon command, their rounds in turns (``--ab-daemon-cmd``: a
    before/after under one load)."""
    spec = SandboxSpec(
        load_secs=1.0, resident=CODER, shim=False, daemon=via == "bus", pause_lever=None
    )
    async with AsyncExitStack() as stack:
        rounds_of = []
        for daemon_cmd in daemon_cmds:
            argv = shlex.split(daemon_cmd) if daemon_cmd else None
            box = await Sandbox.create(stack, spec, contain=True, daemon_argv=argv)
            way = await (over_the_bus(stack, box) if via == "bus" else in_process(stack, box))
            await way.wait_resident(CODER)
            rounds_of.append(_Rounds(box, way, Samples()))
        for record in [False] + [True] * rounds:
            for index, tree in enumerate(rounds_of):
                if len(rounds_of) > 1:
                    print(f" tree {'AB'[index]}:", flush=True)
                await tree.one_round(record)
    return [tree.samples for tree in rounds_of]


@dataclass
class _Rounds:
    """One sandbox's rounds: shell A→B, enforcement B→A and A→B, shell B→A."""

    box: Sandbox
    way: Enforcement
    samples: Samples

    async def one_round(self, record: bool) -> None:
        box, way, a, b = self.box, self.way, CODER, WRITER
        there = await shell_swap_parts(box, a, b)
        await way.wait_resident(b)
        timed = [("baseline", f"{a.key} → {b.key}", there.total)]
        swapped: dict[str, tuple[float, dict[str, float]]] = {}
        for start in (a, b):
            took, steps = await way.swap(start)
            swapped[start.key] = (took, steps)
            timed.append(("enforcement", f"→ {start.key}", took))
        back = await shell_swap_parts(box, b, a)
        await way.wait_resident(a)
        timed.append(("baseline", f"{b.key} → {a.key}", back.total))
        for kind, what, seconds in timed:
            label = "warm-up" if not record else kind
            print(f"  {label:12} {what:26} {seconds * 1000:8.1f} ms", flush=True)
        if record:
            _record_round(self.samples, [(swapped[b.key], there), (swapped[a.key], back)])


def _record_round(
    samples: Samples, pairs: list[tuple[tuple[float, dict[str, float]], ShellParts]]
) -> None:
    """One round's two pairs: each enforcement with the shell swap in its direction."""
    for (took, steps), shell in pairs:
        samples.baseline.append(shell.total)
        samples.enforcement.append(took)
        samples.shell_parts.append(shell)
        samples.paired.append((took, shell.total))
        samples.outside_engine.append(
            (took - steps.get("verify-up", 0.0), shell.total - shell.poll)
        )
        for step, seconds in steps.items():
            samples.steps.setdefault(step, []).append(seconds)


@dataclass
class PauseSamples:
    stop: list[float] = field(default_factory=list)
    pause: list[float] = field(default_factory=list)


async def run_pause(
    rounds: int, via: str, daemon_cmd: str | None, cold_s: float, wake_s: float
) -> PauseSamples:
    """The pause/wake column (module docstring): stop-swaps, then pause-swaps, one run."""
    samples = PauseSamples()
    spec = SandboxSpec(
        load_secs=cold_s,
        wake_secs=wake_s,
        pause_lever="vllm-sleep-1",
        resident=CODER,
        shim=False,
        daemon=via == "bus",
    )
    async with AsyncExitStack() as stack:
        argv = shlex.split(daemon_cmd) if daemon_cmd else None
        box = await Sandbox.create(stack, spec, contain=True, daemon_argv=argv)
        way = await (over_the_bus(stack, box) if via == "bus" else in_process(stack, box))
        await way.wait_resident(CODER)
        for _ in range(rounds):
            for start in (WRITER, CODER):
                took, _ = await way.swap(start, "stop")
                samples.stop.append(took)
                print(f"  stop-swap   → {start.key:14} {took * 1000:9.1f} ms", flush=True)
        took, _ = await way.swap(WRITER, "pause")
        print(f"  (setup: pause {CODER.key}, cold start {WRITER.key}: {took:.2f} s)", flush=True)
        for _ in range(rounds):
            for start in (CODER, WRITER):
                took, _ = await way.swap(start, "pause")
                samples.pause.append(took)
                print(f"  pause-swap  → {start.key:14} {took * 1000:9.1f} ms", flush=True)
    return samples


def report_pause(samples: PauseSamples, cold_s: float, wake_s: float) -> int:
    stop = statistics.median(samples.stop)
    pause = statistics.median(samples.pause)
    ratio = pause / stop
    print()
    print(f"fake engines: cold start {cold_s:g} s, wake {wake_s:g} s")
    print(f"stop-swap  (stop + start + verify-up): median {stop:7.2f} s  n={len(samples.stop)}")
    print(f"pause-swap (pause + wake + verify-up): median {pause:7.2f} s  n={len(samples.pause)}")
    verdict = "PASS" if ratio < PAUSE_TARGET_RATIO else "FAIL"
    print(f"ratio pause-swap ÷ stop-swap {ratio:.3f}  target < {PAUSE_TARGET_RATIO}: {verdict}")
    return 0


PARTS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("before the stop", ("revalidate", "preflight", "mark-draining", "drain"), ""),
    ("stop", ("stop",), "stop"),
    ("start", ("verify-free", "start"), "start"),
    ("until healthy", ("verify-up",), "poll"),
    ("after", ("refresh-proxy", "resolve", "(reply)"), "outside"),
)
"""uapplace's steps against the shell's parts: (part, its steps, the ShellParts field)."""


def report(samples: Samples, via: str) -> int:
    base = statistics.median(samples.baseline)
    enforced = statistics.median(samples.enforcement)
    ratio = enforced / base
    overhead_ms = (enforced - base) * 1000
    n = len(samples.baseline)
    print()
    print(f"baseline    (shell stop/start/poll 50 ms) s: {spread(samples.baseline)}  n={n}")
    print(f"enforcement (Apply, {via:9})          s: {spread(samples.enforcement)}  n={n}")
    print("  (median [interquartile] (min – max))")
    paired = [e / b for e, b in samples.paired]
    outside = [e / b for e, b in samples.outside_engine]
    outside_ms = [(e - b) * 1000 for e, b in samples.outside_engine]
    print(f"paired ratios (same round, same direction): {spread(paired)}")
    print(
        f"outside the engine's load (less verify-up / less the shell's poll): ratio "
        f"{spread(outside)}; difference ms {statistics.median(outside_ms):+.1f}"
    )
    verdict = "PASS" if ratio <= TARGET_RATIO else "FAIL"
    q1, _, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired[0],) * 3
    if q1 <= TARGET_RATIO <= q3 or q1 <= ratio <= TARGET_RATIO <= q3:
        verdict += " (the goal is inside the paired ratios' interquartile range: noise)"
    print(
        f"ratio of medians {ratio:.3f}  (overhead {overhead_ms:+.1f} ms)  target ≤ "
        f"{TARGET_RATIO:.2f}: {verdict}"
    )
    if samples.steps:
        print(
            "\nenforcement steps, median ms (time since the previous step's signal; "
            "(reply): the Apply reply):"
        )
        for step, values in samples.steps.items():
            print(f"  {step:14} {statistics.median(values) * 1000:8.1f}")
        print("\nby part, median ms: uapplace's steps | the shell's part | difference")
        for part, steps, field_name in PARTS:
            ours = statistics.median(
                sum(samples.steps.get(step, [0.0] * n)[i] for step in steps) for i in range(n)
            )
            shell = (
                statistics.median(getattr(p, field_name) for p in samples.shell_parts)
                if field_name
                else 0.0
            )
            print(
                f"  {part:16} {ours * 1000:8.1f} | {shell * 1000:8.1f} | "
                f"{(ours - shell) * 1000:+8.1f}   ({' + '.join(steps)})"
            )
    return 0


def report_ab(trees: list[Samples]) -> int:
    """Each tree's report, then B against A: the figures their rounds in turns share."""
    for name, samples in zip("AB", trees, strict=True):
        print(f"\n===== tree {name}")
        report(samples, "bus")
    a, b = trees
    print("\n===== B against A (rounds in turns, one load)")
    for label, pick in (
        ("paired ratio to the shell", lambda s: [e / x for e, x in s.paired]),
        ("outside the engine's load, ms over the shell", _outside_ms),
    ):
        print(f"  {label:46} A {spread(pick(a))}   B {spread(pick(b))}")
    print("  steps, median ms:   A | B")
    for step in a.steps:
        mid_a = statistics.median(a.steps[step]) * 1000
        mid_b = statistics.median(b.steps.get(step, [0.0])) * 1000
        print(f"    {step:14} {mid_a:8.1f} | {mid_b:8.1f}")
    return 0


def _outside_ms(samples: Samples) -> list[float]:
    return [(e - x) * 1000 for e, x in samples.outside_engine]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds (4 swaps each)")
    parser.add_argument("--via", choices=["bus", "inprocess"], default="bus")
    parser.add_argument(
        "--daemon-cmd",
        default=None,
        help="command that runs uapplaced (default: this Python's -m uapplace.daemon)",
    )
    parser.add_argument(
        "--ab-daemon-cmd",
        default=None,
        help="a second uapplaced command (e.g. `env PYTHONPATH=BASE python -m uapplace.daemon`):"
        " two sandboxes, rounds in turns, A (--daemon-cmd) against B (this)",
    )
    parser.add_argument("--pause", action="store_true", help="the pause/wake column (issue 12)")
    parser.add_argument("--cold-secs", type=float, default=20.0, help="--pause: load time")
    parser.add_argument("--wake-secs", type=float, default=1.5, help="--pause: wake time")
    parser.add_argument(
        "--engine",
        choices=["fake", "llama.cpp"],
        default="fake",
        help="llama.cpp: real llama-server units on the CPU (needs `make engine`)",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.cold_secs < 0 or args.wake_secs < 0:
        parser.error("--cold-secs and --wake-secs must be >= 0")
    ok, why = can_contain()
    if not ok:
        print(f"bench_swap needs a contained systemd --user: {why}", file=sys.stderr)
        return 2
    if args.engine == "llama.cpp":
        return real_swap.main(args.rounds, args.pause)
    if args.pause:
        print(f"pause/wake benchmark: {args.rounds} rounds, enforcement via {args.via}")
        paused = asyncio.run(
            run_pause(args.rounds, args.via, args.daemon_cmd, args.cold_secs, args.wake_secs)
        )
        return report_pause(paused, args.cold_secs, args.wake_secs)
    print(f"swap benchmark: {args.rounds} rounds + 1 warm-up, enforcement via {args.via}")
    if args.ab_daemon_cmd is not None:
        if args.via != "bus":
            parser.error("--ab-daemon-cmd compares two daemons: it needs --via bus")
        trees = asyncio.run(run_trees(args.rounds, args.via, [args.daemon_cmd, args.ab_daemon_cmd]))
        return report_ab(trees)
    try:
        samples = asyncio.run(run(args.rounds, args.via, args.daemon_cmd))
    except KeyboardInterrupt:
        return 130
    except PlacementError as err:
        print(f"bench_swap: the daemon refused: {err}", file=sys.stderr)
        if "is not available" in err.message:
            print(
                "  (this uapplaced has no enforcement wired: try --via inprocess)", file=sys.stderr
            )
        return 1
    return report(samples, args.via)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
