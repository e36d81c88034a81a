"""``uapplace demo --engine llama.cpp``: the walkthrough on real ``llama-server`` units.

The same story as the default demo (:mod:`uapplace.demo.walkthrough`), told by llama.cpp's
own server on the CPU tier instead of the fake engine on a simulated GPU: the sandbox
(:func:`uapplace.demo.sandbox.llamacpp_spec`) writes two tiny GGUF models of different
sizes and a unit for each (``llama-server -c 512 --parallel 2 --metrics
--sse-ping-interval 1``, ``LLAMA_CACHE`` in the sandbox), both on one port, as behind
the stock UAP proxy, so a request for the model that is not loaded is a swap. Nothing is
seeded: each model is started by hand and measured (``uapplace measure``: the RSS of the
unit's real PIDs, ``measured_on: cpu0``), then park → impact → apply (each enforcement
step as it happens) → the retry forwards and the new server answers; then ``unload``
and ``load``, with the live host figures after each.

The binary is the one ``make engine`` (``scripts/build-llama-server.sh``) caches
(:func:`uapplace.sim.llamacpp.llama_server_path`); when it is missing the demo says
which command builds it and exits 2, having started nothing.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import psutil
from rich.console import Console
from rich.table import Table

from uapplace.bus.client import PlacementClient
from uapplace.core.model import DEFAULT_CELLS
from uapplace.demo.sandbox import (
    LLAMA_CTX,
    LLAMA_PARALLEL,
    STEP_GUARD_S,
    DemoError,
    DemoModel,
    Sandbox,
    llamacpp_spec,
    log_tail,
)
from uapplace.demo.walkthrough import (
    CLIENT,
    EXIT_INTERRUPTED,
    Narrator,
    StepPrinter,
    add_match,
    admit,
    decision_text,
    park_for_the_operator,
    run_in_sandbox,
    state_tables,
)
from uapplace.files.paths import INTERFACE
from uapplace.io.devices import process_rss_mib
from uapplace.sim.llamacpp import BUILD_COMMAND, llama_server_path, missing_binary

EXIT_NO_ENGINE = 2
"""The CLI's usage code: a prerequisite (the built engine) is missing."""
BUILD_SCRIPT = "scripts/build-llama-server.sh"


# --------------------------------------------------------------------------- the engine


def engine_problem(env: Mapping[str, str]) -> tuple[Path, str | None]:
    """The cached ``llama-server`` under ``env``, and why it cannot run (``None``: it can)."""
    binary = llama_server_path(env)
    return binary, missing_binary(binary)


def missing_engine_text(why: str, command: str = "uapplace demo --engine llama.cpp") -> str:
    return (
        f"{command}: {why} (or `{BUILD_SCRIPT}`, which "
        f"`{BUILD_COMMAND}` runs: it builds llama-server from the pinned llama-cpp-python "
        "sdist and caches it, minutes the first time). Nothing was started."
    )


async def engine_version(binary: Path) -> str:
    """The first line ``llama-server --version`` prints (on stderr), or why there is none."""
    try:
        proc = await asyncio.create_subprocess_exec(
            str(binary), "--version", stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        async with asyncio.timeout(10):
            output, _ = await proc.communicate()
    except (OSError, TimeoutError) as err:
        return f"(no version: {str(err) or type(err).__name__})"
    lines = output.decode(errors="replace").strip().splitlines()
    return lines[0] if lines else f"(no version; exit {proc.returncode})"


# --------------------------------------------------------------------------- live figures


async def unit_processes(box: Sandbox, model: DemoModel) -> tuple[str, tuple[int, ...], float]:
    """``(active/sub state, PIDs, their RSS in MiB)`` of ``model``'s unit, read now."""
    state = await box.units.state(model.unit)
    pids = tuple(sorted(await box.units.pids(model.unit)))
    rss = await asyncio.to_thread(process_rss_mib, pids)
    return f"{state.active_state}/{state.sub_state}", pids, rss


async def host_table(box: Sandbox) -> Table:
    """Each engine unit as systemd and ``/proc`` see it, and the host's MemAvailable."""
    table = Table(title="llama-server units (systemd, /proc)", title_justify="left")
    for column in ("model", "unit", "state", "PIDs", "RSS MiB", "model file"):
        table.add_column(column)
    for model in box.spec.models:
        state, pids, rss = await unit_processes(box, model)
        size = box.model_file(model).stat().st_size / 2**20
        table.add_row(
            model.key,
            model.unit,
            state,
            " ".join(map(str, pids)) or "-",
            f"{rss:,.1f}" if pids else "-",
            f"{model.tiny}.gguf, {size:,.1f} MiB",
        )
    available = (await asyncio.to_thread(psutil.virtual_memory)).available / 2**20
    table.caption = f"cpu0: MemAvailable {available:,.0f} MiB on this host right now"
    return table


async def show_machine(box: Sandbox, bus: PlacementClient, console: Console) -> None:
    for table in state_tables(await bus.get_state(), box.sim):
        console.print(table)
    console.print(await host_table(box))


def measured_table(results: Mapping[str, Mapping[str, Any]]) -> Table:
    """What ``uapplace measure`` recorded, per model."""
    table = Table(title="measured (machine-local registry)", title_justify="left")
    columns = ("model/config", "measured_on", "host RSS MiB", "GPU MiB", "KV pool", "per slot")
    for column in (*columns, "PIDs"):
        table.add_column(column)
    for model, result in results.items():
        m = result["measurement"]
        table.add_row(
            f"{model}/{result['config']}",
            str(m.get("measured_on")),
            f"{m.get('host_rss_mib', 0):,.1f}",
            f"{m.get('resident_gpu_mib', 0):,.1f}",
            str(m.get("context_pool_cells", "-")),
            str(m.get("per_session_cap_cells", "-")),
            " ".join(map(str, result.get("pids", []))),
        )
    return table


# --------------------------------------------------------------------------- steps


async def wait_listed(
    bus: PlacementClient, model: str, present: bool, log: Path
) -> dict[str, Any] | None:
    """GetState until ``model`` is (``present``) or is not a resident; its entry."""
    deadline = time.monotonic() + STEP_GUARD_S
    while time.monotonic() < deadline:
        state: dict[str, Any] = await bus.get_state()
        entry = next((r for r in state["residents"] if r["model"] == model), None)
        if (entry is not None) == present:
            return entry
        await asyncio.sleep(0.05)
    what = "listed" if present else "gone"
    raise DemoError(
        f"uapplaced never showed {model} as {what} in {STEP_GUARD_S:g}s (does this uapplaced "
        f"follow the units?); its log:\n{log_tail(log)}"
    )


async def wait_hot(bus: PlacementClient, model: str, log: Path) -> None:
    deadline = time.monotonic() + STEP_GUARD_S
    while time.monotonic() < deadline:
        entry = await wait_listed(bus, model, True, log)
        if entry is not None and entry["state"] == "hot":
            return
        await asyncio.sleep(0.05)
    raise DemoError(f"{model} never turned hot in {STEP_GUARD_S:g}s; log:\n{log_tail(log)}")


async def measure_models(
    box: Sandbox,
    bus: PlacementClient,
    keep_running: DemoModel,
    report: Callable[[str], None] = lambda _: None,
) -> dict[str, dict[str, Any]]:
    """Start each model's unit by hand, let it load, ``Measure`` it, stop it again;
    ``keep_running`` is measured last and left running (the first resident).

    One port serves every engine, so they are measured one at a time. Also used by
    ``bench/bench_swap.py --engine llama.cpp``. Returns each model's ``Measure`` reply."""
    results: dict[str, dict[str, Any]] = {}
    order = [m for m in box.spec.models if m is not keep_running] + [keep_running]
    for model in order:
        started = time.perf_counter()
        await box.start_unit(model)
        took = time.perf_counter() - started
        report(
            f"systemctl --user start {model.unit}: {box.endpoint(model)}/health 200 in {took:.2f} s"
        )
        await wait_listed(bus, model.key, True, box.daemon_log)
        result: dict[str, Any] = await bus.measure(model.key, model.config)
        results[model.key] = result
        m = result["measurement"]
        report(
            f"uapplace measure {model.key}: host RSS {m['host_rss_mib']:,.1f} MiB on "
            f"{m['measured_on']}, GPU {m['resident_gpu_mib']:,.1f} MiB "
            f"(PIDs {', '.join(map(str, result['pids']))})"
        )
        if model is not keep_running:
            outcome = await box.units.stop_unit(model.unit, STEP_GUARD_S)
            if not outcome.ok:
                raise DemoError(f"{model.unit}: stop job {outcome.result} {outcome.detail}")
            await wait_listed(bus, model.key, False, box.daemon_log)
            report(f"systemctl --user stop {model.unit}")
    await wait_hot(bus, keep_running.key, box.daemon_log)
    return results


async def followed(
    say: Narrator, bus: PlacementClient, what: str, call: Awaitable[dict[str, Any]]
) -> tuple[dict[str, Any], float]:
    """Await an enforcement call, printing its ``EnforcementStep`` signals as they come;
    the result and the seconds the call took. A failed run is a :class:`DemoError`."""
    printer = StepPrinter(say)
    bus.bus.add_message_handler(printer)
    try:
        started = time.perf_counter()
        result = await call
        took = time.perf_counter() - started
        await asyncio.sleep(0.1)  # the last signals may trail the reply
    finally:
        bus.bus.remove_message_handler(printer)
    if not result.get("ok"):
        raise DemoError(f"{what} failed: {result.get('error')}")
    return result, took


async def completion(endpoint: str, model: str) -> tuple[str, str]:
    """A short chat completion from a real server: ``(the served model id, the text)``."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Hello?"}],
        "max_tokens": 8,
    }
    timeout = aiohttp.ClientTimeout(total=30)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{endpoint}/v1/chat/completions", json=body) as reply,
    ):
        data = await reply.json()
    if reply.status != 200:
        raise DemoError(f"{endpoint}/v1/chat/completions answered {reply.status}: {data}")
    return str(data.get("model")), str(data["choices"][0]["message"]["content"])


# --------------------------------------------------------------------------- the walkthrough


async def real_walkthrough(box: Sandbox, console: Console) -> None:
    say = Narrator(console)
    first, second = box.spec.models[0], box.spec.models[1]
    binary = box.spec.llama_server
    if binary is None:
        raise DemoError("the real-engine walkthrough needs a sandbox with llama-server units")
    bus = await PlacementClient.connect(box.bus_address, call_timeout=STEP_GUARD_S * 5)
    try:
        await add_match(bus, f"type='signal',interface='{INTERFACE}',member='EnforcementStep'")
        say.step(
            "The engine and the models",
            "llama.cpp's own server, built by `make engine`, serving tiny GGUF models written "
            "just now (random weights: they answer nonsense, fast). Both units listen on one "
            "port, one at a time, as behind the stock UAP proxy, on the CPU tier (cpu0: host "
            "RAM, no GPU).",
        )
        say.ok(f"{binary}: {await engine_version(binary)}")
        for model in box.spec.models:
            say.ok(f"{model.unit}: ExecStart={' '.join(box.unit_argv(model))}")

        say.step(
            "Measure each model (`uapplace measure`)",
            "Nothing is seeded: every config starts unmeasured, so nothing could be placed. "
            "Each server is started by hand, let load, and measured from its real PIDs; "
            f"{second.key} is stopped again, {first.key} stays running.",
        )
        results = await measure_models(box, bus, first, say.ok)
        console.print(measured_table(results))
        small = results[first.key]["measurement"]["host_rss_mib"]
        large = results[second.key]["measurement"]["host_rss_mib"]
        say.note(f"{second.key} holds {large - small:+,.1f} MiB more host RAM than {first.key}")

        say.step("The machine", f"{first.key} runs; {second.key} is measured but not loaded.")
        await show_machine(box, bus, console)

        placement_id, index, option = await park_for_the_operator(
            say, box, bus, first.key, second.key
        )

        say.step(
            f"The operator says yes: `uapplace apply {placement_id} {index}`",
            "Drain, stop the real server, verify the port and memory are free, start the "
            "other, verify its /health and the id it serves (/v1/models).",
        )
        call = bus.apply(placement_id, index, list(option.get("signature", [])))
        result, swap_s = await followed(say, bus, "the swap", call)
        say.ok(
            f"applied in {len(result['steps'])} steps, run {result.get('runId')}: {swap_s:.2f} s"
        )

        say.step("The client retries", "Now the same request forwards to the new resident.")
        answer = await admit(box, bus, second.key, CLIENT)
        say.ok(f"{second.key}: {decision_text(answer)}")
        served, text = await completion(box.endpoint(second), second.key)
        say.ok(
            f"{box.endpoint(second)}/v1/chat/completions → model {served}, "
            f"text {text!a} (random weights)"
        )

        say.step("The machine now", "The units, their real PIDs and RSS agree with the ledger.")
        await show_machine(box, bus, console)

        unload_s, load_s = await unload_and_load(box, bus, say, second, first)
        say.step("What the real engines showed", "Measured and timed in this run.")
        table = Table(title_justify="left")
        for column in ("what", "figure"):
            table.add_column(column)
        for model in (first, second):
            rss = results[model.key]["measurement"]["host_rss_mib"]
            table.add_row(f"{model.key} measured (host RSS on cpu0)", f"{rss:,.1f} MiB")
        table.add_row(f"swap {first.key} → {second.key} (apply)", f"{swap_s:.2f} s")
        table.add_row(f"unload {second.key}", f"{unload_s:.2f} s")
        table.add_row(f"load {first.key}", f"{load_s:.2f} s")
        console.print(table)
        say.note(
            f"every unit: -c {LLAMA_CTX} --parallel {LLAMA_PARALLEL} (KV cells per slot: "
            f"{LLAMA_CTX // LLAMA_PARALLEL}); `bench/bench_swap.py --engine llama.cpp` times "
            "the swap against a bare systemctl stop; start; poll"
        )
    finally:
        bus.disconnect()


async def unload_and_load(
    box: Sandbox, bus: PlacementClient, say: Narrator, resident: DemoModel, other: DemoModel
) -> tuple[float, float]:
    """``uapplace unload`` the resident, then ``uapplace load`` the other model; the
    seconds each took."""
    say.step(
        f"`uapplace unload {resident.key} --yes`",
        "Stopping a model is enforced like a swap: drain, stop, verify the memory came back.",
    )
    impact: dict[str, Any] = await bus.preview_unload(resident.key)
    call = bus.unload(resident.key, list(impact.get("signature", [])))
    _, unload_s = await followed(say, bus, f"unload {resident.key}", call)
    await wait_listed(bus, resident.key, False, box.daemon_log)
    say.ok(f"{resident.key} unloaded in {unload_s:.2f} s")
    say.console.print(await host_table(box))

    say.step(
        f"`uapplace load {other.key} --yes`",
        "An operator-initiated load takes the recommended option of `uapplace preview`.",
    )
    plan: dict[str, Any] = await bus.preview(other.key, DEFAULT_CELLS)
    options = plan.get("options") or []
    if not options:
        raise DemoError(f"no option to load {other.key}: {plan.get('infeasible')}")
    call = bus.load(other.key, list(options[0].get("signature", [])))
    _, load_s = await followed(say, bus, f"load {other.key}", call)
    say.ok(f"{other.key} loaded in {load_s:.2f} s")
    await show_machine(box, bus, say.console)
    return unload_s, load_s


# --------------------------------------------------------------------------- entry point


def intro(box: Sandbox) -> str:
    where = "a contained systemd --user" if box.contained else "your user manager"
    names = " and ".join(f"{m.key} ({m.tiny}.gguf)" for m in box.spec.models)
    return (
        f"uapplace demo --engine llama.cpp: {where}, real llama-server units for {names} "
        "on the CPU tier, uapplaced and uapplace-shim.\nYou will see each model measured, "
        "a request for the model that is not loaded get parked, the operator approve, "
        "uapplace swap the real servers, then unload and load."
    )


def run(keep: bool, *, proxy_url: str | None = None, proxy_token: str | None = None) -> int:
    """``uapplace demo --engine llama.cpp [--keep] [--proxy-url U --proxy-token T]``:
    0 when the walkthrough succeeded, 2 when llama-server is not built (nothing started)."""
    console = Console()
    binary, why = engine_problem(os.environ)
    if why is not None:
        console.print(f"[red]{missing_engine_text(why)}", highlight=False)
        return EXIT_NO_ENGINE
    spec = llamacpp_spec(binary, proxy_url, proxy_token)
    try:
        return asyncio.run(run_in_sandbox(console, keep, spec, walk=real_walkthrough, intro=intro))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; cleaned up")
        return EXIT_INTERRUPTED
