"""``bench_swap.py --engine llama.cpp``: the swap and the pause/wake column on real llama-servers.

The sandbox is the real-engine demo's (:func:`uapplace.demo.sandbox.llamacpp_spec`): a
contained ``systemd --user``, two real ``llama-server`` units (``tiny-b`` ~30 MiB and
``tiny-c`` ~70 MiB of RSS, tiny GGUF files written at start; ``-c 512 --parallel 2
--metrics --sse-ping-interval 1``, ``LLAMA_CACHE`` in the sandbox) on **one port** (one at
a time, as behind the stock UAP proxy, so every switch is a swap) on the CPU tier
(``cpu0``), a fake of the proxy's internal routes and ``uapplaced``.

**Swap** (:func:`run_swap`): both models are measured first (``Measure`` over the bus,
as ``uapplace measure``; nothing seeded), then each round alternates

- **shell**: ``systemctl --user stop A; systemctl --user start B; until curl -sf
  B/health; do sleep 0.05; done`` (bash, on the contained manager's bus), timed around
  the whole script;
- **uapplace**: a request for B parked (``Admit`` over the bus, not timed), then
  ``uapplace apply ID N --yes --json`` (the CLI as an operator runs it), timed around
  the process (**end to end**); its **run time** is the daemon's own clock for that
  run, the growth of ``uapplace_enforcement_run_duration_seconds`` (``GetState``
  ``counters``, read before and after; from the run's first step signal to its end).
  The steps come from the CLI's JSON reply (checked all ok) and their spacing from the
  ``EnforcementStep`` signals;

as shell A→B, uapplace B→A, uapplace A→B, shell B→A, after one warm-up round.
Goals (issue 23): run time ≤ 1.02× the shell, end to end ≤ 1.10×.

**Router pause/wake vs cold start** (:func:`run_router`): one more unit, a llama-server
router (``--models-dir`` holding the same two GGUF files, ``--models-max 1``, the same
``-c``/``--parallel`` for its children). A router switch is ``POST /models/unload A``,
``GET /models`` every 50 ms until A is ``unloaded``, ``POST /models/load B``, ``GET
/models`` every 50 ms until B is ``loaded``, driven **directly over HTTP** by this
script (uapplace's ``llamacpp-router`` lever is not in the loop); a cold switch is the
shell's ``stop; start; poll /health`` of the single-model units. Rounds alternate cold
A→B, router A→B, router B→A, cold B→A. No goal: issue 19 asks for the ratio.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Mapping
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from dbus_fast import Message, MessageType

from bench.shell_swap import POLL_S, ShellParts, shell_swap, shell_swap_parts, spread
from uapplace.bus.client import PlacementClient
from uapplace.demo.real_engine import engine_problem, measure_models, missing_engine_text
from uapplace.demo.sandbox import (
    LLAMA_CTX,
    LLAMA_PARALLEL,
    LLAMA_SSE_PING_S,
    DemoModel,
    Sandbox,
    free_port,
    llamacpp_spec,
)
from uapplace.files.paths import INTERFACE

GOAL_RUN = 1.02
GOAL_END_TO_END = 1.10
GUARD_S = 120.0
"""A hang guard for one switch (or one CLI process); never an assertion about speed."""
EXIT_NO_ENGINE = 2
NO_OPTIONS_S = 5.0
"""A parked request still without options after this long has none (Preview says why)."""


@dataclass
class SwapSamples:
    shell: list[float] = field(default_factory=list)
    end_to_end: list[float] = field(default_factory=list)
    run: list[float] = field(default_factory=list)
    steps: dict[str, list[float]] = field(default_factory=dict)
    shell_parts: list[ShellParts] = field(default_factory=list)
    paired: list[tuple[float, float]] = field(default_factory=list)
    """(run time, shell) of the same direction in the same round: the paired ratios."""


@dataclass
class RouterSamples:
    cold: list[float] = field(default_factory=list)
    router: list[float] = field(default_factory=list)


# --------------------------------------------------------------------------- uapplace


def uapplace_argv() -> list[str]:
    """The ``uapplace`` an operator runs: this venv's entry script."""
    script = Path(sys.executable).with_name("uapplace")
    return [str(script)] if script.exists() else [sys.executable, "-m", "uapplace.cli"]


def apply_run_seconds(state: Mapping[str, Any]) -> tuple[float, int]:
    """Sum and count of the daemon's ``apply``/``ok`` run durations (``GetState``)."""
    histogram = state.get("counters", {}).get("enforcement_run_seconds", {})
    for row in histogram.get("series", []):
        if row["labels"] == {"verb": "apply", "outcome": "ok"}:
            return float(row["sum"]), int(row["count"])
    return 0.0, 0


async def _read_timed(stream: asyncio.StreamReader) -> tuple[bytes, float | None]:
    """Everything ``stream`` gives, and when its first byte came (``None``: it gave none)."""
    first = await stream.read(1)
    at = time.perf_counter() if first else None
    return first + await stream.read(), at


class CliSwaps:
    """Parks a request over the bus, then applies it with the CLI, timing both ways."""

    def __init__(self, box: Sandbox, client: PlacementClient) -> None:
        self.box = box
        self.client = client
        self.step_times: list[tuple[str, float]] = []
        self.round = 0
        client.bus.add_message_handler(self._on_message)

    def _on_message(self, message: Message) -> None:
        if message.message_type is MessageType.SIGNAL and message.member == "EnforcementStep":
            self.step_times.append((str(message.body[1]), time.perf_counter()))

    async def subscribe(self) -> None:
        rule = f"type='signal',interface='{INTERFACE}',member='EnforcementStep'"
        await self.client.bus.call(
            Message(
                destination="org.freedesktop.DBus",
                path="/org/freedesktop/DBus",
                interface="org.freedesktop.DBus",
                member="AddMatch",
                signature="s",
                body=[rule],
            )
        )

    async def _parked(self, model: DemoModel) -> tuple[str, int]:
        self.round += 1
        answer = await self.client.admit(model.key, f"bench-{self.round}", "", 0)
        if answer.get("decision") != "park":
            raise RuntimeError(f"expected a park for {model.key}: {answer}")
        placement_id = str(answer["placement_id"])
        deadline = time.monotonic() + NO_OPTIONS_S
        while True:
            listed = await self.client.list_pending()
            entry = next(e for e in listed["pending"] if e["id"] == placement_id)
            if entry["options"]:
                break
            if time.monotonic() > deadline:
                plan = await self.client.preview(model.key, int(entry.get("cells") or 0))
                raise RuntimeError(f"no option for {model.key}: {plan.get('infeasible')}")
            await asyncio.sleep(0.02)
        for index, option in enumerate(entry["options"], start=1):
            if option["kind"] == "displace" and option["victims"]:
                return placement_id, index
        raise RuntimeError(f"no displace option for {model.key}: {entry['options']}")

    async def swap(self, start: DemoModel) -> tuple[float, float, dict[str, float]]:
        """``(end to end, run time, seconds per step)`` of one swap to ``start``."""
        placement_id, index = await self._parked(start)
        before = apply_run_seconds(await self.client.get_state())
        argv = [*uapplace_argv(), "apply", placement_id, str(index), "--yes", "--json"]
        self.step_times.clear()
        started = time.perf_counter()
        proc = await asyncio.create_subprocess_exec(
            *argv,
            env=self.box.client_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        async with asyncio.timeout(GUARD_S):
            (out, printed), err, _ = await asyncio.gather(
                _read_timed(proc.stdout), proc.stderr.read(), proc.wait()
            )
        ended = time.perf_counter()
        end_to_end = ended - started
        if proc.returncode != 0:
            raise RuntimeError(
                f"{shlex.join(argv)} exited {proc.returncode}:\n{err.decode()[-2000:]}"
            )
        result = json.loads(out)
        failed = [s for s in result["steps"] if not s["ok"]]
        if not result.get("ok") or failed:
            raise RuntimeError(f"the swap to {start.key} did not go cleanly: {result}")
        after = apply_run_seconds(await self.client.get_state())
        if after[1] != before[1] + 1:
            raise RuntimeError(f"expected one more apply run in the counters: {before} → {after}")
        await asyncio.sleep(0.05)  # the last step signals may trail the reply
        steps: dict[str, float] = {}
        previous = started
        for step, at in self.step_times:
            steps[step] = steps.get(step, 0.0) + (at - previous)
            previous = at
        if printed is not None:
            steps["(reply printed)"] = printed - previous
            steps["(CLI exited)"] = ended - printed
        return end_to_end, after[0] - before[0], steps

    async def wait_hot(self, model: DemoModel) -> None:
        async with asyncio.timeout(GUARD_S):
            while True:
                state = await self.client.get_state()
                if any(r["model"] == model.key and r["state"] == "hot" for r in state["residents"]):
                    return
                await asyncio.sleep(POLL_S)


async def run_swap(binary: Path, rounds: int) -> SwapSamples:
    samples = SwapSamples()
    spec = dataclasses.replace(llamacpp_spec(binary), shim=False)
    async with AsyncExitStack() as stack:
        box = await Sandbox.create(stack, spec, contain=True)
        client = await PlacementClient.connect(box.bus_address, call_timeout=GUARD_S)
        stack.callback(client.disconnect)
        a, b = box.spec.models[0], box.spec.models[1]
        measured = await measure_models(box, client, a)
        for key, result in measured.items():
            m = result["measurement"]
            print(f"  measured {key}: host RSS {m['host_rss_mib']:.1f} MiB on {m['measured_on']}")
        swaps = CliSwaps(box, client)
        await swaps.subscribe()
        await swaps.wait_hot(a)

        async def one_round(record: bool) -> None:
            timed: list[tuple[str, str, float, float | None]] = []
            there = await shell_swap_parts(box, a, b, GUARD_S)
            await swaps.wait_hot(b)
            timed.append(("shell", f"{a.key} → {b.key}", there.total, None))
            runs: dict[str, float] = {}
            for start in (a, b):
                end_to_end, run, steps = await swaps.swap(start)
                runs[start.key] = run
                timed.append(("uapplace", f"→ {start.key}", end_to_end, run))
                if record:
                    samples.end_to_end.append(end_to_end)
                    samples.run.append(run)
                    for step, seconds in steps.items():
                        samples.steps.setdefault(step, []).append(seconds)
            back = await shell_swap_parts(box, b, a, GUARD_S)
            await swaps.wait_hot(a)
            timed.append(("shell", f"{b.key} → {a.key}", back.total, None))
            if record:
                samples.shell_parts += [there, back]
                samples.paired += [(runs[b.key], there.total), (runs[a.key], back.total)]
            for kind, what, seconds, run_s in timed:
                label = kind if record else f"({kind})"
                extra = f"   run {run_s * 1000:7.1f} ms" if run_s is not None else ""
                print(f"  {label:9} {what:18} {seconds * 1000:8.1f} ms{extra}", flush=True)
                if record and kind == "shell":
                    samples.shell.append(seconds)

        await one_round(record=False)
        for _ in range(rounds):
            await one_round(record=True)
    return samples


def median_line(label: str, values: list[float]) -> float:
    """Print ``label``'s median (ms) and sample count; the median in seconds."""
    median = statistics.median(values)
    print(f"{label:44} median {median * 1000:8.1f} ms  n={len(values)}")
    return median


def report_swap(samples: SwapSamples, rounds: int) -> int:
    print()
    shell = median_line("shell: stop; start; poll /health 50 ms", samples.shell)
    run = median_line("uapplace: run time (the daemon's clock)", samples.run)
    end_to_end = median_line("uapplace: apply --yes, end to end (CLI)", samples.end_to_end)
    for what, value, goal in (
        ("run time", run / shell, GOAL_RUN),
        ("end to end", end_to_end / shell, GOAL_END_TO_END),
    ):
        verdict = "PASS" if value <= goal else "FAIL"
        print(f"ratio {what:10} {value:6.3f}  goal ≤ {goal:.2f} (issue 23): {verdict}")
    print(f"spread, s: median [interquartile] (min – max); n={len(samples.shell)}")
    print(f"  shell      {spread(samples.shell)}")
    print(f"  run time   {spread(samples.run)}")
    print(f"  end to end {spread(samples.end_to_end)}")
    print(f"  paired run-time ratios (same round, same direction) {spread(ratios(samples))}")
    _by_part(samples)
    if samples.steps:
        print("\nsteps, median ms, each since the one before: the first since the CLI started")
        print("(Python start-up and the impact preview included); (reply printed): the CLI")
        print("printed the Apply reply; (CLI exited): its process ended:")
        for step, values in samples.steps.items():
            print(f"  {step:14} {statistics.median(values) * 1000:8.1f}")
    print(f"\n{rounds} rounds + 1 warm-up; engines: llama-server -c {LLAMA_CTX} ", end="")
    print(f"--parallel {LLAMA_PARALLEL}")
    return 0


def ratios(samples: SwapSamples) -> list[float]:
    return [run / shell for run, shell in samples.paired]


def _by_part(samples: SwapSamples) -> None:
    """The shell's own parts against the steps that do the same (medians, ms)."""
    shell = samples.shell_parts
    if not shell or not samples.steps:
        return
    n = len(samples.run)

    def ours(*steps: str) -> float:
        rows = [samples.steps.get(step, [0.0] * n) for step in steps]
        return statistics.median(sum(row[i] for row in rows) for i in range(n)) * 1000

    print("by part, median ms: uapplace's steps | the shell's part")
    for part, mine, theirs in (
        ("stop", ours("stop"), statistics.median(p.stop for p in shell) * 1000),
        ("start", ours("verify-free", "start"), statistics.median(p.start for p in shell) * 1000),
        ("until healthy", ours("verify-up"), statistics.median(p.poll for p in shell) * 1000),
    ):
        print(f"  {part:14} {mine:8.1f} | {theirs:8.1f}")
    before = ours("preflight", "mark-draining", "drain")
    after = ours("refresh-proxy", "resolve")
    print(
        f"  uapplace only: preflight + mark-draining + drain {before:.1f}; "
        f"refresh + resolve {after:.1f}"
    )


# --------------------------------------------------------------------------- the router


def router_argv(binary: Path, models_dir: Path, port: int) -> list[str]:
    """A llama-server router over ``models_dir``, one model at a time, its children run
    with the single-model units' ``-c``/``--parallel``/``--metrics``/ping flags."""
    return [
        str(binary),
        "--models-dir",
        str(models_dir),
        "--models-max",
        "1",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-c",
        str(LLAMA_CTX),
        "--parallel",
        str(LLAMA_PARALLEL),
        "--metrics",
        "--sse-ping-interval",
        str(LLAMA_SSE_PING_S),
    ]


class Router:
    """The router's own HTTP routes (``GET /models``, ``POST /models/load|unload``)."""

    def __init__(self, session: aiohttp.ClientSession, url: str) -> None:
        self.session = session
        self.url = url

    async def status(self, model_id: str) -> dict[str, Any]:
        async with self.session.get(f"{self.url}/models") as reply:
            body = await reply.json()
        for entry in body.get("data", []):
            if entry.get("id") == model_id:
                status: dict[str, Any] = entry.get("status", {})
                return status
        raise RuntimeError(f"{self.url}/models does not list {model_id}: {body}")

    async def post(self, route: str, model_id: str) -> None:
        url = f"{self.url}/models/{route}"
        async with self.session.post(url, json={"model": model_id}) as reply:
            if reply.status != 200:
                raise RuntimeError(f"POST {url} {model_id}: {reply.status} {await reply.text()}")

    async def until(self, model_id: str, value: str) -> None:
        async with asyncio.timeout(GUARD_S):
            while True:
                status = await self.status(model_id)
                if status.get("failed"):
                    raise RuntimeError(f"the router failed to load {model_id}: {status}")
                if status.get("value") == value:
                    return
                await asyncio.sleep(POLL_S)

    async def switch(self, old: str, new: str) -> float:
        started = time.perf_counter()
        await self.post("unload", old)
        await self.until(old, "unloaded")
        await self.post("load", new)
        await self.until(new, "loaded")
        return time.perf_counter() - started


async def _router_unit(stack: AsyncExitStack, box: Sandbox, binary: Path) -> str:
    folder = box.base / "router-models"
    folder.mkdir()
    for model in box.spec.models:
        os.link(box.model_file(model), folder / box.model_file(model).name)
    port = free_port()
    argv = router_argv(binary, folder, port)
    unit = await box.add_unit(stack, "router", f"the models in {folder}", argv)
    outcome = await box.units.start_unit(unit, GUARD_S)
    if not outcome.ok:
        raise RuntimeError(f"{unit}: start job {outcome.result} {outcome.detail}")
    return f"http://127.0.0.1:{port}"


async def run_router(binary: Path, rounds: int) -> RouterSamples:
    samples = RouterSamples()
    spec = dataclasses.replace(llamacpp_spec(binary), shim=False, daemon=False)
    async with AsyncExitStack() as stack:
        box = await Sandbox.create(stack, spec, contain=True)
        a, b = box.spec.models[0], box.spec.models[1]
        ids = {m.key: box.model_file(m).stem for m in (a, b)}
        url = await _router_unit(stack, box, binary)
        session = await stack.enter_async_context(
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
        )
        router = Router(session, url)
        async with asyncio.timeout(GUARD_S):
            while True:
                try:
                    await router.status(ids[a.key])
                    break
                except (aiohttp.ClientError, RuntimeError):
                    await asyncio.sleep(POLL_S)
        await router.post("load", ids[a.key])
        await router.until(ids[a.key], "loaded")
        await box.start_unit(a)

        async def one_round(record: bool) -> None:
            timed = [("cold", f"{a.key} → {b.key}", await shell_swap(box, a, b, GUARD_S))]
            timed.append(
                ("router", f"{a.key} → {b.key}", await router.switch(ids[a.key], ids[b.key]))
            )
            timed.append(
                ("router", f"{b.key} → {a.key}", await router.switch(ids[b.key], ids[a.key]))
            )
            timed.append(("cold", f"{b.key} → {a.key}", await shell_swap(box, b, a, GUARD_S)))
            for kind, what, seconds in timed:
                print(
                    f"  {kind if record else f'({kind})':8} {what:18} {seconds * 1000:8.1f} ms",
                    flush=True,
                )
                if record:
                    (samples.cold if kind == "cold" else samples.router).append(seconds)

        await one_round(record=False)
        for _ in range(rounds):
            await one_round(record=True)
    return samples


def report_router(samples: RouterSamples, rounds: int) -> int:
    print()
    cold = median_line("cold: systemctl stop; start; poll /health", samples.cold)
    router = median_line("router: unload; poll; load; poll GET /models", samples.router)
    print(f"ratio router ÷ cold {router / cold:.3f}  (no goal set: issue 19 asks for the ratio)")
    print("the router was driven directly over HTTP by this script (polls every 50 ms);")
    print(f"uapplace's llamacpp-router lever was not in the loop. {rounds} rounds + 1 warm-up.")
    return 0


# --------------------------------------------------------------------------- entry


def main(rounds: int, pause: bool) -> int:
    binary, why = engine_problem(os.environ)
    if why is not None:
        print(missing_engine_text(why, "bench_swap.py --engine llama.cpp"), file=sys.stderr)
        return EXIT_NO_ENGINE
    if pause:
        print(f"llama.cpp router pause/wake vs cold start: {rounds} rounds + 1 warm-up ({binary})")
        return report_router(asyncio.run(run_router(binary, rounds)), rounds)
    print(f"llama.cpp swap: uapplace vs the shell, {rounds} rounds + 1 warm-up ({binary})")
    return report_swap(asyncio.run(run_swap(binary, rounds)), rounds)
