"""``uapplace demo``: the whole product on a machine with no GPU, in about a minute.

It builds a sandbox (:mod:`uapplace.demo.sandbox`: a systemd user manager, a simulated
GPU, two fake engines as real units, a fake of the proxy's internal routes,
``uapplaced`` and ``uapplace-shim``) and walks through what an operator sees:
admit → park → pending with impact → apply (each enforcement step as it
happens) → admit forwards, and a chat completion from the new model. Everything
is removed on exit, Ctrl-C included. ``--keep`` leaves it running and prints
the ``export`` lines to poke it with ``uapplace`` and ``busctl``.
"""

from __future__ import annotations

import asyncio
import shlex
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
from dbus_fast import Message, MessageType
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.util import bus_daemon_message
from uapplace.demo.sandbox import (
    CODER,
    DEVICE_MIB,
    STEP_GUARD_S,
    WRITER,
    DemoError,
    Sandbox,
    SandboxSpec,
    log_tail,
)
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.io.units import UnitError
from uapplace.sim.gpu import SimGpu
from uapplace.sim.usermanager import ContainmentError

CLIENT = "x-uap-client-id:claude-code"
"""The client identity the demo's requests carry (as the proxy would send it)."""
EXIT_INTERRUPTED = 130
NO_OPTIONS_S = 2.0
"""A parked request still without options after this long: ask ``Preview`` why."""


# --------------------------------------------------------------------------- the walkthrough


class Narrator:
    def __init__(self, console: Console) -> None:
        self.console = console
        self.number = 0

    def step(self, title: str, explain: str) -> None:
        self.number += 1
        self.console.print()
        self.console.rule(f"[bold cyan]{self.number}. {title}")
        self.console.print(f"[dim]{explain}")

    def ok(self, text: str) -> None:
        self.console.print(f"  [green]✓[/] {text}")

    def note(self, text: str) -> None:
        self.console.print(f"  [yellow]•[/] {text}")


async def shim_admit(box: Sandbox, model: str, client: str) -> dict[str, Any]:
    """``POST /api/placement/admit`` exactly as the proxy sends it (docs/http-contract.md §1)."""
    body = {"model_id": model, "client": client, "session": None}
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{box.shim_url}/api/placement/admit", json=body) as reply,
    ):
        answer: dict[str, Any] = await reply.json()
        return answer


def decision_text(answer: Mapping[str, Any]) -> str:
    """An admit answer in words: ``forward → gpu0:http://…`` or ``park plc-… (not_resident)``."""
    if answer.get("decision") == "forward":
        return f"forward → {answer.get('target_id')}"
    if answer.get("decision") == "park":
        return f"park {answer.get('placement_id')} (reason: {answer.get('reason')})"
    return f"unexpected answer {dict(answer)}"


async def admit(box: Sandbox, bus: PlacementClient, model: str, client: str) -> dict[str, Any]:
    if box.spec.shim:
        return await shim_admit(box, model, client)
    return await bus.admit(model, client, "", 0)


def state_tables(state: Mapping[str, Any], sim: SimGpu | None) -> list[Table]:
    """The residents, and what the simulated GPU's probe reads (when there is one)."""
    residents = Table(title="residents", title_justify="left")
    for column in ("model", "config", "device", "state", "GPU MiB", "target"):
        residents.add_column(column)
    for r in state.get("residents", []):
        target = f"{r['device']}:{r.get('endpoint') or 'default'}"
        residents.add_row(
            r["model"],
            r["config"],
            r["device"],
            r["state"],
            f"{r.get('gpu_mib') or 0:,.0f}",
            target,
        )
    if sim is None:
        return [residents]
    gpu = Table(title="simulated GPU (what the probe reads)", title_justify="left")
    for column in ("device", "total MiB", "free MiB", "held by"):
        gpu.add_column(column)
    live = sim.read()
    for device in live.devices:
        holders = ", ".join(
            f"pid {a.pid} {a.command.split()[-1] if a.command else ''} {a.used_mib:,.0f} MiB"
            for a in live.allocations_on(device.uuid)
        )
        gpu.add_row(
            device.uuid,
            f"{device.total_mib:,}",
            f"{live.free_mib(device.uuid):,.0f}",
            holders or "-",
        )
    return [residents, gpu]


def options_table(entry: Mapping[str, Any]) -> Table:
    table = Table(
        title=f"options for {entry['requested_model']} ({entry['id']})", title_justify="left"
    )
    for column in ("#", "kind", "config", "device", "cost MiB", "impact"):
        table.add_column(column)
    for index, option in enumerate(entry.get("options", []), start=1):
        victims = option.get("victims") or []
        impact = (
            "; ".join(
                f"{'pauses' if v.get('action') == 'pause' else 'stops'} "
                f"{v['model']}/{v['config']}: {v['consequence']}"
                for v in victims
            )
            or "nothing is stopped"
        )
        # The CPU tier's cost is host RAM (docs/placement-rules.md §4.5).
        on_host = option.get("device_kind") == "cpu"
        cost = option.get("host_mib", 0) if on_host else option["cost_mib"]
        table.add_row(
            str(index),
            option["kind"],
            f"{option['model']}/{option['config']}",
            option["device"],
            f"{cost:,.0f}" + (" host" if on_host else ""),
            impact,
        )
    return table


class StepPrinter:
    """Prints ``EnforcementStep`` signals as they arrive on the bus."""

    def __init__(self, narrator: Narrator) -> None:
        self.narrator = narrator
        self.seen = 0

    def __call__(self, message: Message) -> None:
        if (
            message.message_type is MessageType.SIGNAL
            and message.interface == INTERFACE
            and message.member == "EnforcementStep"
        ):
            _run, step, ok, detail = message.body
            self.seen += 1
            mark = "[green]✓[/]" if ok else "[red]✗[/]"
            self.narrator.console.print(f"    {mark} [bold]{step}[/]  {detail}")


async def wait_hot(box: Sandbox, bus: PlacementClient, model: str) -> dict[str, Any]:
    """GetState until ``model`` is a hot resident (the daemon follows the unit)."""
    deadline = time.monotonic() + STEP_GUARD_S
    while time.monotonic() < deadline:
        state: dict[str, Any] = await bus.get_state()
        if any(r["model"] == model and r["state"] == "hot" for r in state["residents"]):
            return state
        await asyncio.sleep(0.1)
    raise DemoError(
        f"{model} runs but uapplaced never listed it as a hot resident in {STEP_GUARD_S:g}s "
        f"(does this uapplaced follow the units?); its log:\n{log_tail(box.daemon_log)}"
    )


async def park_for_the_operator(
    say: Narrator,
    box: Sandbox,
    bus: PlacementClient,
    resident: str,
    wanted: str,
    *,
    retry_note: bool = False,
) -> tuple[str, int, dict[str, Any]]:
    """The three steps every walkthrough shows: a request for ``resident`` forwards, one
    for ``wanted`` parks, the operator sees its options. The placement id and its option
    that stops ``resident`` (index, option). ``retry_note``: say what the proxy answers."""
    say.step(
        "A client asks for the resident model",
        "Before it forwards a request, the proxy asks uapplace where to send it "
        "(POST /api/placement/admit on the shim).",
    )
    answer = await admit(box, bus, resident, CLIENT)
    say.ok(f"{resident}: {decision_text(answer)}")

    say.step(
        "A client asks for a model that is not loaded",
        "uapplace never evicts on its own: the request is parked for the operator.",
    )
    parked = await admit(box, bus, wanted, CLIENT)
    if parked.get("decision") != "park":
        raise DemoError(f"expected a park for {wanted}, got {parked}")
    placement_id = str(parked["placement_id"])
    say.ok(f"{wanted}: {decision_text(parked)}")
    if retry_note:
        say.note("the proxy answers the client 409 with this id; the client retries later")

    say.step(
        "What the operator sees (`uapplace pending`)",
        "Every option with its impact, computed before anyone says yes.",
    )
    entry = await pending_with_options(bus, placement_id)
    say.console.print(options_table(entry))
    index, option = form_option(entry, "stop")
    return placement_id, index, option


async def walkthrough(box: Sandbox, console: Console) -> None:
    say = Narrator(console)
    bus = await PlacementClient.connect(box.bus_address, call_timeout=STEP_GUARD_S * 5)
    try:
        say.step(
            "The machine",
            f"{CODER.key} runs under {CODER.unit} and holds {CODER.mib:,} MiB of the "
            f"{DEVICE_MIB:,} MiB card; {WRITER.key} needs {WRITER.mib:,} MiB, so the two "
            "cannot be loaded at once.",
        )
        state = await wait_hot(box, bus, CODER.key)
        for table in state_tables(state, box.sim):
            console.print(table)

        placement_id, index, option = await park_for_the_operator(
            say, box, bus, CODER.key, WRITER.key, retry_note=True
        )
        signature = list(option.get("signature", []))

        say.step(
            f"The operator says yes: `uapplace apply {placement_id} {index}`",
            "The approved victim set travels with the call; if it changed, nothing happens.",
        )
        printer = StepPrinter(say)
        bus.bus.add_message_handler(printer)
        await add_match(bus, f"type='signal',interface='{INTERFACE}',member='EnforcementStep'")
        started = time.perf_counter()
        result = await bus.apply(placement_id, index, signature)
        stop_start_s = time.perf_counter() - started
        await asyncio.sleep(0.1)  # the last signals may trail the reply
        bus.bus.remove_message_handler(printer)
        if not result.get("ok"):
            raise DemoError(f"the enforcement failed: {result.get('error')}")
        say.ok(f"applied in {len(result['steps'])} steps, run {result.get('runId')}")

        say.step("The client retries", "Now the same request forwards to the new resident.")
        answer = await admit(box, bus, WRITER.key, CLIENT)
        say.ok(f"{WRITER.key}: {decision_text(answer)}")
        reply = await _chat(box.endpoint(WRITER), WRITER.key)
        say.ok(f"{box.endpoint(WRITER)}/v1/chat/completions → {reply!r}")

        say.step("The machine now", "The probe agrees with the ledger.")
        for table in state_tables(await bus.get_state(), box.sim):
            console.print(table)
        if box.spec.pause_lever is not None and box.single_upstream is None:
            await pause_walkthrough(box, bus, say, stop_start_s)
    finally:
        bus.disconnect()


def form_option(entry: Mapping[str, Any], form: str) -> tuple[int, dict[str, Any]]:
    """The 1-based index and the option whose victims are all stopped (``form="stop"``)
    or all paused (``"pause"``); the first option when none has that form."""
    options: list[dict[str, Any]] = list(entry.get("options", []))
    for index, option in enumerate(options, start=1):
        victims = option.get("victims") or []
        if victims and all(v.get("action", "stop") == form for v in victims):
            return index, option
    if not options:
        raise DemoError(f"no option for {entry.get('requested_model')}")
    return 1, options[0]


async def timed_switch(
    bus: PlacementClient, model: str, form: str
) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """Park a request for ``model``, apply the option of ``form``: (seconds, option, result)."""
    parked = await bus.admit(model, CLIENT, "", 0)
    if parked.get("decision") != "park":
        raise DemoError(f"expected a park for {model}, got {parked}")
    entry = await pending_with_options(bus, str(parked["placement_id"]))
    index, option = form_option(entry, form)
    started = time.perf_counter()
    result = await bus.apply(str(parked["placement_id"]), index, list(option["signature"]))
    took = time.perf_counter() - started
    if not result.get("ok"):
        raise DemoError(f"the {form} switch to {model} failed: {result.get('error')}")
    return took, option, result


async def pause_walkthrough(
    box: Sandbox, bus: PlacementClient, say: Narrator, stop_start_s: float
) -> None:
    """Issue 12: one switch by pause and wake next to the one by stop and start."""
    say.step(
        "Pause instead of stop",
        f"Both engines declare vLLM's sleep lever (pause_lever {box.spec.pause_lever}): a "
        "switch may put the resident to sleep (weights to host RAM, the VRAM verified free "
        "by the probe) and wake it later instead of reloading it. The preview offers both "
        "forms; the approval signature names which (`model/config@pause`).",
    )
    took_cold, option, _ = await timed_switch(bus, CODER.key, "pause")
    victims = ", ".join(f"{v['model']} ({v['consequence']})" for v in option["victims"])
    say.ok(f"{CODER.key} started, pausing {victims}: {took_cold:.2f} s")
    took_wake, option, result = await timed_switch(bus, WRITER.key, "pause")
    steps = " → ".join(step["name"] for step in result["steps"])
    say.ok(f"{WRITER.key} woken, pausing {CODER.key}: {took_wake:.2f} s ({steps})")
    table = Table(title="the same switch, two ways", title_justify="left")
    for column in ("switch", "how", "seconds"):
        table.add_column(column)
    table.add_row(f"→ {WRITER.key}", "stop coder-7b, start writer-13b", f"{stop_start_s:.2f}")
    table.add_row(f"→ {WRITER.key}", "pause coder-7b, wake writer-13b", f"{took_wake:.2f}")
    say.console.print(table)
    say.note(
        f"the fake engines take {box.spec.load_secs:g} s to load and "
        f"{box.spec.wake_secs:g} s to wake; real ones: `bench/bench_swap.py --pause`"
    )
    for table in state_tables(await bus.get_state(), box.sim):
        say.console.print(table)


async def pending_with_options(bus: PlacementClient, placement_id: str) -> dict[str, Any]:
    """The pending entry once the daemon has attached its options (planned after the park).

    Still none after :data:`NO_OPTIONS_S`: ``Preview`` of the same request says whether
    there are any at all; none there is a :class:`DemoError` with its reasons."""
    started = time.monotonic()
    asked = False
    async with asyncio.timeout(STEP_GUARD_S):
        while True:
            listed = await bus.list_pending()
            entry = next((e for e in listed["pending"] if e["id"] == placement_id), None)
            if entry is None:
                raise DemoError(f"{placement_id} vanished from the pending list")
            if entry.get("options"):
                return dict(entry)
            if not asked and time.monotonic() - started > NO_OPTIONS_S:
                asked = True
                await _some_option(bus, entry)
            await asyncio.sleep(0.05)


async def _some_option(bus: PlacementClient, entry: Mapping[str, Any]) -> None:
    model = str(entry.get("requested_model"))
    plan: dict[str, Any] = await bus.preview(model, int(entry.get("cells") or 0))
    if not plan.get("options"):
        reasons = "; ".join(plan.get("infeasible") or []) or str(plan.get("reason"))
        raise DemoError(f"no option to place {model} ({entry.get('id')}): {reasons}")


async def add_match(bus: PlacementClient, rule: str) -> None:
    await bus.bus.call(bus_daemon_message("AddMatch", "s", [rule]))


async def _chat(endpoint: str, model: str) -> str:
    body = {"model": model, "messages": [{"role": "user", "content": "Hello?"}]}
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(f"{endpoint}/v1/chat/completions", json=body) as reply,
    ):
        data = await reply.json()
    return str(data["choices"][0]["message"]["content"])


def export_lines(box: Sandbox) -> list[str]:
    keys = (
        "DBUS_SESSION_BUS_ADDRESS",
        "XDG_RUNTIME_DIR",
        "UAP_HOME",
        "UAPPLACE_CONFIG_DIR",
        "UAPPLACE_SIM_GPU",
        "UAP_PROXY_URL",
        "PROXY_AUTH_TOKEN",
        "UAPPLACE_SHIM_PORT",
    )
    return [f"export {k}={shlex.quote(box.env[k])}" for k in keys if k in box.env]


def keep_lines(box: Sandbox) -> list[str]:
    """Copy-paste lines for another shell (plain text: a panel would wrap them)."""
    first = box.spec.models[0]
    lines = [
        *export_lines(box),
        "uapplace status",
        "uapplace pending",
        f"uapplace preview {first.key}",
        f"busctl --user call {BUS_NAME} {OBJECT_PATH} {INTERFACE} Admit sssu {first.key} me '' 0",
        f"systemctl --user status {' '.join(m.unit for m in box.spec.models)}",
    ]
    if box.spec.shim:
        lines.append(f"curl -s {box.shim_url}/api/placement/state")
        lines.append(f"curl -sN {box.shim_url}/api/placement/events")
        lines.append(
            f"# a proxy in front: controller {box.shim_url}, "
            f"PROXY_AUTH_TOKEN={shlex.quote(box.spec.token)}"
            + (f", one upstream {box.single_upstream}" if box.single_upstream else "")
        )
    return lines


# --------------------------------------------------------------------------- entry point


def run(
    keep: bool,
    *,
    single_upstream: bool = False,
    proxy_url: str | None = None,
    proxy_token: str | None = None,
) -> int:
    """``uapplace demo [--keep] [--single-upstream] [--proxy-url U --proxy-token T]``:
    0 when the walkthrough succeeded."""
    console = Console()
    spec = SandboxSpec(
        single_upstream=single_upstream, proxy_url=proxy_url, proxy_token=proxy_token
    )
    try:
        return asyncio.run(run_in_sandbox(console, keep, spec, walk=walkthrough, intro=fake_intro))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; cleaned up")
        return EXIT_INTERRUPTED


def fake_intro(box: Sandbox) -> str:
    """The opening panel of the default demo."""
    where = "a contained systemd --user" if box.contained else "your user manager"
    return (
        f"uapplace demo: {where}, a simulated GPU, two fake engines, uapplaced"
        + (" and uapplace-shim" if box.spec.shim else "")
        + ".\nYou will see a request for a model that is not loaded get parked, "
        "the operator approve one option, and uapplace swap the engines, checking "
        "each step."
    )


Walk = Callable[[Sandbox, Console], Awaitable[None]]
"""A walkthrough: what the operator sees, on a built sandbox."""


async def run_in_sandbox(
    console: Console,
    keep: bool,
    spec: SandboxSpec,
    *,
    walk: Walk,
    intro: Callable[[Sandbox], str],
    **sandbox_options: Any,
) -> int:
    """Build the sandbox for ``spec``, show ``intro`` and run ``walk`` in it, then remove
    everything (Ctrl-C included); with ``keep``, wait for Ctrl-C first. 0: it succeeded."""
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    assert main_task is not None
    stop = asyncio.Event()
    interrupted = False
    keep_waiting = False

    def on_signal() -> None:
        nonlocal interrupted
        if interrupted:
            return  # the clean-up is under way: another Ctrl-C must not cut it short
        interrupted = True
        stop.set()
        if not keep_waiting:
            main_task.cancel()

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, on_signal)
    try:
        async with AsyncExitStack() as stack:
            with console.status("building the sandbox") as status:
                box = await Sandbox.create(
                    stack, spec, progress=lambda text: status.update(text), **sandbox_options
                )
            console.print(
                Panel(
                    intro(box)
                    + f"\nsandbox: {box.base}"
                    + f"\nproxy: {box.proxy_url} (token {box.spec.token})"
                    + (
                        f"\none upstream for every engine: {box.single_upstream}"
                        if box.single_upstream
                        else ""
                    ),
                    expand=False,
                )
            )
            await walk(box, console)
            if keep:
                console.print()
                console.rule("[bold]the demo keeps running; in another shell:")
                for line in keep_lines(box):
                    console.print(line, highlight=False, soft_wrap=True)
                console.rule("[bold]Ctrl-C ends it and removes everything")
                keep_waiting = True
                await stop.wait()
            console.print("\n[dim]cleaning up: units, daemon, shim, manager, files")
    except asyncio.CancelledError:
        console.print("[yellow]interrupted; cleaned up")
        return EXIT_INTERRUPTED
    except (
        DemoError,
        ContainmentError,
        PlacementError,
        UnitError,
        aiohttp.ClientError,
        TimeoutError,
    ) as err:
        console.print(f"[red]demo failed:[/] {str(err) or type(err).__name__}")
        return 1
    finally:
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
    if interrupted and not keep:
        return EXIT_INTERRUPTED
    console.print("[bold green]demo finished; nothing left behind")
    if not keep:
        console.print("[dim]`uapplace demo --keep` leaves the sandbox running to explore it")
    return 0
