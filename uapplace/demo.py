"""``uapplace demo``: the whole product on a machine with no GPU, in about a minute.

It builds a sandbox and walks through what an operator sees:

- a systemd user manager: a contained ``systemd --user`` when this machine
  allows one (root and a writable cgroup tree, DESIGN.md §6); otherwise the
  session's own user manager, with the demo's units written as *runtime* unit
  files (``$XDG_RUNTIME_DIR/systemd/user/uapplace-demo-*.service``) and removed
  on exit. Runtime unit files rather than transient units, because a transient
  unit is gone once stopped, and a rollback must be able to start the victim
  again;
- a simulated 24 GiB GPU (``UAPPLACE_SIM_GPU``);
- two fake llama.cpp-like engines as real units: ``coder-7b`` (14 GiB,
  resident) and ``writer-13b`` (16 GiB, measured, needs the card to itself);
- a fake of the proxy's internal routes (in-flight list, refresh);
- ``uapplaced`` and ``uapplace-shim`` as processes, with a registry and ledger
  in a temporary ``UAPPLACE_CONFIG_DIR`` / ``UAP_HOME``.

Then: admit → park → pending with impact → apply (each enforcement step as it
happens) → admit forwards, and a chat completion from the new model. Everything
is removed on exit, Ctrl-C included. ``--keep`` leaves it running and prints
the ``export`` lines to poke it with ``uapplace`` and ``busctl``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from dbus_fast import Message, MessageType
from rich.console import Console
from rich.panel import Panel
from rich.table import Table

from uapplace import busio, engines
from uapplace.client import PlacementClient, PlacementError, bus_daemon_message, user_bus_address
from uapplace.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.registry import local_measurements
from uapplace.sim.gpu import SimGpu, sim_uuid
from uapplace.sim.usermanager import ContainedUserManager, ContainmentError, can_contain
from uapplace.units import UnitError, UnitManager

UNIT_PREFIX = "uapplace-demo"
DEVICE_MIB = 24576
DEVICE_NAME = "Simulated 24 GiB GPU"
MEASURED_AT = "2026-10-08T14:02:00Z"
STEP_GUARD_S = 60.0
"""No single demo step may take longer than this (a hang guard)."""
PROXY_TOKEN = "uapplace-demo-token"
CLIENT = "x-uap-client-id:claude-code"
"""The client identity the demo's requests carry (as the proxy would send it)."""
EXIT_INTERRUPTED = 130


@dataclass(frozen=True)
class DemoModel:
    key: str
    config: str
    stem: str
    mib: int
    display: str

    @property
    def unit(self) -> str:
        return f"{UNIT_PREFIX}-{self.stem}.service"


CODER = DemoModel("coder-7b", "q4_k_m", "coder", 14000, "Coder 7B")
WRITER = DemoModel("writer-13b", "q5_k_m", "writer", 16000, "Writer 13B")


@dataclass(frozen=True)
class SandboxSpec:
    models: tuple[DemoModel, ...] = (CODER, WRITER)
    load_secs: float = 1.0
    """How long each fake engine takes to turn healthy."""
    resident: DemoModel | None = CODER
    """Started before the daemon, so it is resident from the start."""
    shim: bool = True
    daemon: bool = True
    single_upstream: bool = False
    """Both engines on one port, one at a time, and the registry's ``proxy.single_upstream``
    naming it: the stock UAP proxy's topology (issue 13, :mod:`uapplace.topology`)."""
    proxy_url: str | None = None
    """An outside proxy (its ``/internal/placement/*`` routes) instead of the built-in fake."""
    proxy_token: str | None = None
    """The token for ``proxy_url`` (``PROXY_AUTH_TOKEN``); the demo's own when ``None``."""
    pause_lever: str | None = "vllm-sleep-1"
    """Every engine runs the fake vLLM sleep API (``--sleep-mode``) and every config
    declares this lever (issue 12), so a switch can pause instead of stop; ``None``:
    plain engines that can only be stopped."""
    wake_secs: float = 0.3
    """How long each fake engine takes to wake (``--wake-delay``)."""

    @property
    def token(self) -> str:
        return self.proxy_token if self.proxy_token is not None else PROXY_TOKEN


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def _terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


async def _wait_for(
    what: str, check: Callable[[], Awaitable[bool]], proc: subprocess.Popen[bytes] | None, log: Path
) -> None:
    """Poll ``check`` until true; fail early (with the log's tail) if ``proc`` exits."""
    deadline = time.monotonic() + STEP_GUARD_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DemoError(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        if await check():
            return
        await asyncio.sleep(0.05)
    raise DemoError(f"{what} not ready after {STEP_GUARD_S:g}s:\n{_tail(log)}")


def _tail(path: Path, chars: int = 1500) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")[-chars:]
    except OSError:
        return "(no log)"


class DemoError(Exception):
    """The sandbox could not be built or a step failed; the message says which."""


# --------------------------------------------------------------------------- the sandbox


@dataclass
class Sandbox:
    """Everything the demo (and ``bench/bench_swap.py``) runs on. Build with :meth:`create`."""

    spec: SandboxSpec
    base: Path
    bus_address: str
    unit_dir: Path
    contained: bool
    sim: SimGpu
    ports: dict[str, int]
    env: dict[str, str] = field(default_factory=dict)
    """What a client of this sandbox needs: bus, UAP_HOME, config dir, sim GPU, proxy URL."""
    daemon_log: Path = Path()
    manager: ContainedUserManager | None = None
    unit_manager: UnitManager | None = None

    @property
    def uap_home(self) -> Path:
        return self.base / "uap"

    @property
    def config_dir(self) -> Path:
        return self.base / "config"

    @property
    def proxy_url(self) -> str:
        if self.spec.proxy_url is not None:
            return self.spec.proxy_url.rstrip("/")
        return f"http://127.0.0.1:{self.ports['proxy']}"

    @property
    def single_upstream(self) -> str | None:
        """The one address every engine listens on, with ``--single-upstream``."""
        return self.endpoint(self.spec.models[0]) if self.spec.single_upstream else None

    @property
    def shim_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['shim']}"

    def endpoint(self, model: DemoModel) -> str:
        return f"http://127.0.0.1:{self.ports[model.key]}"

    def client_env(self) -> dict[str, str]:
        """``os.environ`` plus :attr:`env`: for the CLI, ``busctl --user``, ``systemctl --user``."""
        return {**os.environ, **self.env}

    @classmethod
    async def create(
        cls,
        stack: AsyncExitStack,
        spec: SandboxSpec,
        *,
        contain: bool | None = None,
        daemon_argv: Sequence[str] | None = None,
        progress: Callable[[str], None] = lambda _: None,
    ) -> Sandbox:
        """Build the sandbox; every part registers its cleanup on ``stack`` first.

        ``contain`` None: a contained manager when possible, else the session's.
        """
        base = Path(tempfile.mkdtemp(prefix=f"{UNIT_PREFIX}-"))
        stack.callback(_remove_tree, base)
        ok, why = can_contain()
        use_contained = ok if contain is None else contain
        if use_contained:
            progress("starting a contained systemd --user")
            manager = ContainedUserManager(name_prefix=UNIT_PREFIX)
            stack.push_async_callback(asyncio.to_thread, manager.stop)
            await asyncio.to_thread(manager.start)
            bus, unit_dir = manager.bus_address, manager.unit_dir
        else:
            progress(f"no contained systemd here ({why}); using your own user manager")
            manager = None
            bus = user_bus_address()
            unit_dir = _runtime_unit_dir()
        shared = free_port()  # every engine's, with --single-upstream
        ports = {m.key: shared if spec.single_upstream else free_port() for m in spec.models}
        ports["proxy"] = free_port()
        ports["shim"] = free_port()
        sim = SimGpu(base / "sim-gpu.json")
        sim.create([(DEVICE_NAME, DEVICE_MIB)])
        box = cls(spec, base, bus, unit_dir, manager is not None, sim, ports, manager=manager)
        box.env = box._client_env_vars()
        await box._check_bus_free()
        box._write_config()
        await box._install_units(stack, progress)
        await box._start_proxy(stack, progress)
        if spec.resident is not None:
            progress(f"starting {spec.resident.key} ({spec.resident.unit})")
            await box.start_unit(spec.resident)
        if spec.daemon:
            await box._start_daemon(stack, progress, daemon_argv)
        if spec.shim:
            await box._start_shim(stack, progress)
        return box

    # ------------------------------------------------------------------ parts

    def _client_env_vars(self) -> dict[str, str]:
        env = {
            "DBUS_SESSION_BUS_ADDRESS": self.bus_address,
            "UAP_HOME": str(self.uap_home),
            "UAPPLACE_CONFIG_DIR": str(self.config_dir),
            "UAPPLACE_SIM_GPU": str(self.sim.path),
            "UAP_PROXY_URL": self.proxy_url,
            "PROXY_AUTH_TOKEN": self.spec.token,
            "UAPPLACE_SHIM_PORT": str(self.ports["shim"]),
            # No polkit in a sandbox: the daemon's own uid may act (DESIGN.md §5).
            "UAPPLACE_SYSTEM_BUS_ADDRESS": "",
        }
        if self.manager is not None:
            env.update(self.manager.env)
        else:
            # The shim's token and runtime files stay in the sandbox, not in the session's.
            env["XDG_RUNTIME_DIR"] = str(self.base / "run")
        return env

    async def _check_bus_free(self) -> None:
        try:
            bus = await busio.Bus(bus_address=self.bus_address).connect()
        except Exception as err:
            raise DemoError(f"cannot reach the user bus at {self.bus_address}: {err}") from err
        try:
            reply = await bus.call(bus_daemon_message("NameHasOwner", "s", [BUS_NAME]))
        finally:
            bus.disconnect()
        if reply is not None and reply.message_type is MessageType.METHOD_RETURN and reply.body[0]:
            raise DemoError(
                f"{BUS_NAME} already has an owner on {self.bus_address}: stop that uapplaced "
                "first (the demo runs its own)"
            )

    def _write_config(self) -> None:
        self.config_dir.mkdir(parents=True)
        self.uap_home.mkdir(parents=True)
        (self.base / "run").mkdir(mode=0o700, exist_ok=True)
        registry = registry_json(self, self.spec.models)
        (self.config_dir / "model-registry.json").write_text(
            json.dumps(registry, indent=2), encoding="utf-8"
        )
        # Measured figures count only from the machine-local file (spec §4.1): the demo's
        # box records its own, with the simulated card's identity, as `measure` would.
        (self.uap_home / "model-registry.json").write_text(
            json.dumps(local_measurements(registry), indent=2), encoding="utf-8"
        )
        (self.config_dir / "capacity-policy.json").write_text(
            json.dumps(capacity_policy_json(self.spec.models), indent=2), encoding="utf-8"
        )

    def _unit_text(self, model: DemoModel) -> str:
        argv = [
            sys.executable,
            "-m",
            "uapplace.sim.engine",
            "--port",
            str(self.ports[model.key]),
            "--model-id",
            model.key,
            "--gpu-uuid",
            sim_uuid(0),
            "--mib",
            str(model.mib),
            "--load-secs",
            f"{self.spec.load_secs:g}",
            "--kv",
            "q8_0",
        ]
        if self.spec.pause_lever is not None:
            argv += ["--sleep-mode", "--wake-delay", f"{self.spec.wake_secs:g}"]
        return (
            f"[Unit]\nDescription=uapplace demo engine {model.key} (fake llama.cpp)\n\n"
            f"[Service]\nType=exec\nExecStart={shlex.join(argv)}\n"
            f"Environment=UAPPLACE_SIM_GPU={self.sim.path}\nTimeoutStopSec=10\n"
        )

    async def _install_units(self, stack: AsyncExitStack, progress: Callable[[str], None]) -> None:
        progress("writing the engine units")
        self.unit_dir.mkdir(parents=True, exist_ok=True)
        units = UnitManager(self.bus_address)
        try:
            await units.connect()
        except UnitError as err:
            raise DemoError(f"no systemd user manager on {self.bus_address}: {err}") from err
        stack.callback(units.close)
        self.unit_manager = units
        for model in self.spec.models:
            path = self.unit_dir / model.unit
            if path.exists() and self.manager is None:
                raise DemoError(f"{path} exists already: is another demo running?")
            path.write_text(self._unit_text(model), encoding="utf-8")
            stack.push_async_callback(self._remove_unit, model)
        await units.reload()

    async def _remove_unit(self, model: DemoModel) -> None:
        with contextlib.suppress(UnitError):
            await self.units.stop_unit(model.unit, 15)
        (self.unit_dir / model.unit).unlink(missing_ok=True)
        with contextlib.suppress(UnitError):
            await self.units.reload()

    async def start_unit(self, model: DemoModel) -> None:
        outcome = await self.units.start_unit(model.unit, STEP_GUARD_S)
        if not outcome.ok:
            raise DemoError(f"{model.unit}: start job {outcome.result} {outcome.detail}")
        deadline = time.monotonic() + STEP_GUARD_S
        if not await engines.wait_healthy(self.endpoint(model), deadline):
            raise DemoError(f"{model.key} did not turn healthy at {self.endpoint(model)}")

    @property
    def units(self) -> UnitManager:
        if self.unit_manager is None:
            raise DemoError("the sandbox's units are not installed yet")
        return self.unit_manager

    def _spawn(
        self, stack: AsyncExitStack, name: str, argv: Sequence[str]
    ) -> tuple[subprocess.Popen[bytes], Path]:
        log = self.base / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self.client_env(),
                start_new_session=True,
            )
        stack.callback(_terminate, proc)
        return proc, log

    async def _start_proxy(self, stack: AsyncExitStack, progress: Callable[[str], None]) -> None:
        if self.spec.proxy_url is not None:
            progress(f"using the proxy at {self.proxy_url}")
            return
        progress("starting a fake of the proxy's internal routes")
        argv = [sys.executable, "-m", "uapplace.sim.proxy", "--port", str(self.ports["proxy"])]
        proc, log = self._spawn(stack, "proxy", argv)
        url = f"{self.proxy_url}/internal/placement/inflight"
        await _wait_for("the fake proxy", lambda: _http_ok(url), proc, log)

    async def _start_daemon(
        self,
        stack: AsyncExitStack,
        progress: Callable[[str], None],
        daemon_argv: Sequence[str] | None,
    ) -> None:
        progress("starting uapplaced")
        argv = list(daemon_argv or [sys.executable, "-m", "uapplace.daemon"])
        proc, self.daemon_log = self._spawn(stack, "uapplaced", argv)

        async def owned() -> bool:
            try:
                client = await PlacementClient.connect(self.bus_address, call_timeout=2)
            except Exception:
                return False
            try:
                await client.get_state()
                return True
            except PlacementError:
                return False
            finally:
                client.disconnect()

        await _wait_for("uapplaced", owned, proc, self.daemon_log)

    async def _start_shim(self, stack: AsyncExitStack, progress: Callable[[str], None]) -> None:
        progress("starting uapplace-shim")
        argv = [sys.executable, "-m", "uapplace.shim", "--port", str(self.ports["shim"])]
        argv += ["--bus-address", self.bus_address]
        proc, log = self._spawn(stack, "shim", argv)
        url = f"{self.shim_url}/api/placement/state"
        await _wait_for("uapplace-shim", lambda: _http_ok(url), proc, log)


def _runtime_unit_dir() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR") or f"/run/user/{os.getuid()}"
    return Path(runtime) / "systemd" / "user"


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


async def _http_ok(url: str) -> bool:
    try:
        timeout = aiohttp.ClientTimeout(total=2)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.get(url) as reply:
            return reply.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


def registry_json(box: Sandbox, models: Sequence[DemoModel]) -> dict[str, Any]:
    """The demo's registry: one simulated GPU, the host, and each model measured on gpu0."""
    host_mib = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
    proxy = {"single_upstream": box.single_upstream} if box.single_upstream else None
    # Behind a single upstream one engine at a time owns the port: a paused one would
    # keep it, so the planner always stops there; no lever is declared.
    lever = box.spec.pause_lever if not box.single_upstream else None
    return {
        "version": 1,
        **({"proxy": proxy} if proxy else {}),
        "devices": {
            "gpu0": {
                "kind": "gpu",
                "name": DEVICE_NAME,
                "total_mib": DEVICE_MIB,
                "reserved_mib": 0,
                "uuid": sim_uuid(0),
            },
            "cpu0": {"kind": "cpu", "total_mib": host_mib, "reserved_mib": 512},
        },
        "models": {
            m.key: {
                "display": m.display,
                "engine": "llama.cpp",
                "unit": m.unit,
                "endpoint": box.endpoint(m),
                "rails": 1,
                "service": m.key,
                "task_affinity": ["code"] if m is CODER else ["general"],
                "configs": {
                    m.config: {
                        "resident_gpu_mib": m.mib,
                        "host_rss_mib": 64,
                        "context_pool_cells": 32768,
                        "kv_resident_cells": 32768,
                        "kv": "q8_0",
                        "measured_at": MEASURED_AT,
                        "measured_on": "gpu0",
                        "measured_device": {
                            "name": DEVICE_NAME,
                            "uuid": sim_uuid(0),
                            "total_mib": DEVICE_MIB,
                        },
                        **({"pause_lever": lever} if lever else {}),
                    }
                },
            }
            for m in models
        },
    }


def capacity_policy_json(models: Sequence[DemoModel]) -> dict[str, Any]:
    """One service per model: verify-up checks the engine's KV type and pool in ``/metrics``."""
    return {
        "services": [
            {
                "name": m.key,
                "unit": m.unit,
                "metricsMustMatch": {"kv": "q8_0", "max_context": 32768},
            }
            for m in models
        ]
    }


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
    """``POST /api/placement/admit`` exactly as the proxy sends it (CONTRACT.md §1)."""
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


def state_tables(state: Mapping[str, Any], sim: SimGpu) -> list[Table]:
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
        table.add_row(
            str(index),
            option["kind"],
            f"{option['model']}/{option['config']}",
            option["device"],
            f"{option['cost_mib']:,.0f}",
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
        f"(does this uapplaced follow the units?); its log:\n{_tail(box.daemon_log)}"
    )


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

        say.step(
            "A client asks for the resident model",
            "Before it forwards a request, the proxy asks uapplace where to send it "
            "(POST /api/placement/admit on the shim).",
        )
        answer = await admit(box, bus, CODER.key, CLIENT)
        say.ok(f"{CODER.key}: {decision_text(answer)}")

        say.step(
            "A client asks for a model that is not loaded",
            "uapplace never evicts on its own: the request is parked for the operator.",
        )
        parked = await admit(box, bus, WRITER.key, CLIENT)
        if parked.get("decision") != "park":
            raise DemoError(f"expected a park for {WRITER.key}, got {parked}")
        placement_id = str(parked["placement_id"])
        say.ok(f"{WRITER.key}: {decision_text(parked)}")
        say.note("the proxy answers the client 409 with this id; the client retries later")

        say.step(
            "What the operator sees (`uapplace pending`)",
            "Every option with its impact, computed before anyone says yes.",
        )
        entry = await _pending_with_options(bus, placement_id)
        console.print(options_table(entry))
        index, option = form_option(entry, "stop")
        signature = list(option.get("signature", []))

        say.step(
            f"The operator says yes: `uapplace apply {placement_id} {index}`",
            "The approved victim set travels with the call; if it changed, nothing happens.",
        )
        printer = StepPrinter(say)
        bus.bus.add_message_handler(printer)
        await _add_match(bus, f"type='signal',interface='{INTERFACE}',member='EnforcementStep'")
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
    entry = await _pending_with_options(bus, str(parked["placement_id"]))
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


async def _pending_with_options(bus: PlacementClient, placement_id: str) -> dict[str, Any]:
    """The pending entry once the daemon has attached its options (planned after the park)."""
    async with asyncio.timeout(STEP_GUARD_S):
        while True:
            listed = await bus.list_pending()
            entry = next((e for e in listed["pending"] if e["id"] == placement_id), None)
            if entry is None:
                raise DemoError(f"{placement_id} vanished from the pending list")
            if entry.get("options"):
                return dict(entry)
            await asyncio.sleep(0.05)


async def _add_match(bus: PlacementClient, rule: str) -> None:
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
    lines = [
        *export_lines(box),
        "uapplace status",
        "uapplace pending",
        f"uapplace preview {CODER.key}",
        f"busctl --user call {BUS_NAME} {OBJECT_PATH} {INTERFACE} Admit sssu {CODER.key} me '' 0",
        f"systemctl --user status {CODER.unit} {WRITER.unit}",
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
        return asyncio.run(_main(console, keep, spec=spec))
    except KeyboardInterrupt:
        console.print("[yellow]interrupted; cleaned up")
        return EXIT_INTERRUPTED


async def _main(
    console: Console, keep: bool, spec: SandboxSpec | None = None, **sandbox_options: Any
) -> int:
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
                    stack,
                    spec or SandboxSpec(),
                    progress=lambda text: status.update(text),
                    **sandbox_options,
                )
            where = "a contained systemd --user" if box.contained else "your user manager"
            console.print(
                Panel(
                    f"uapplace demo: {where}, a simulated GPU, two fake engines, uapplaced"
                    + (" and uapplace-shim" if box.spec.shim else "")
                    + ".\nYou will see a request for a model that is not loaded get parked, "
                    "the operator approve one option, and uapplace swap the engines, checking "
                    "each step."
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
            await walkthrough(box, console)
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
        console.print(f"[red]demo failed:[/] {err or type(err).__name__}")
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
