"""The demo's sandbox: the whole product on a machine with no GPU, built and torn down
in one :class:`contextlib.AsyncExitStack`.

:meth:`Sandbox.create` builds

- a systemd user manager: a contained ``systemd --user`` when this machine
  allows one (root and a writable cgroup tree; docs/architecture.md, "Contained user
  manager"); otherwise the
  session's own user manager, with the demo's units written as *runtime* unit
  files (``$XDG_RUNTIME_DIR/systemd/user/uapplace-demo-*.service``) and removed
  on exit. Runtime unit files rather than transient units, because a transient
  unit is gone once stopped, and a rollback must be able to start the victim
  again;
- a simulated 24 GiB GPU (``UAPPLACE_SIM_GPU``);
- two fake llama.cpp-like engines as real units, written from the tracked templates
  ``uapplace unit add`` fills (:mod:`uapplace.files.unit_template`): ``coder-7b`` (14 GiB,
  resident) and ``writer-13b`` (16 GiB, measured, needs the card to itself);
  or, with :func:`llamacpp_spec` (``uapplace demo --engine llama.cpp``), two real
  ``llama-server`` units on the CPU tier (``cpu0``, host RAM) serving tiny GGUF models
  of different sizes written at start (:mod:`uapplace.sim.gguf_models`), unmeasured
  until ``uapplace measure`` records them, both on one port (one at a time, as behind
  the stock UAP proxy), no GPU, nothing simulated;
- a fake of the proxy's internal routes (in-flight list, refresh);
- ``uapplaced`` and ``uapplace-shim`` as processes, with a registry and ledger
  in a temporary ``UAPPLACE_CONFIG_DIR`` / ``UAP_HOME``.

Used by ``uapplace demo`` (:mod:`uapplace.demo.walkthrough`, the walkthrough) and by
``bench/bench_swap.py`` and ``bench/bench_envelope.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from dbus_fast import MessageType

from uapplace.bus import connection as busio
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.util import bus_daemon_message, user_bus_address
from uapplace.files.paths import BUS_NAME
from uapplace.files.registry import local_measurements
from uapplace.files.unit_template import EngineUnit, TemplateError, render_unit
from uapplace.io import engines
from uapplace.io.units import UnitError, UnitManager
from uapplace.sim.gpu import SimGpu, sim_uuid
from uapplace.sim.llamacpp import LLAMA_CACHE_ENV, server_argv
from uapplace.sim.usermanager import ContainedUserManager, can_contain, terminate

UNIT_PREFIX = "uapplace-demo"
DEVICE_MIB = 24576
DEVICE_NAME = "Simulated 24 GiB GPU"
MEASURED_AT = "2026-10-08T14:02:00Z"
STEP_GUARD_S = 60.0
"""No single demo step may take longer than this (a hang guard)."""
PROXY_TOKEN = "uapplace-demo-token"
DEMO_UNIT_MARKER = "Written by `uapplace demo` (its sandbox); removed when the demo exits."


LLAMA_CTX = 512
"""``-c`` of every real llama-server unit: the whole KV pool, split across the slots."""
LLAMA_PARALLEL = 2
"""``--parallel`` of every real llama-server unit: its slots, the model's ``rails``."""
LLAMA_SSE_PING_S = 1
"""``--sse-ping-interval``: a stream ends within a second of SIGTERM (llama-server waits
for the next ping before it exits)."""


@dataclass(frozen=True)
class DemoModel:
    key: str
    config: str
    stem: str
    mib: int
    """The fake engine's simulated GPU memory; 0 for a real engine (it is measured)."""
    display: str
    tiny: str | None = None
    """The tiny GGUF preset (:data:`uapplace.sim.gguf_models.SIZES`) a real llama-server
    serves; ``None``: the fake engine."""

    @property
    def unit(self) -> str:
        return f"{UNIT_PREFIX}-{self.stem}.service"


CODER = DemoModel("coder-7b", "q4_k_m", "coder", 14000, "Coder 7B")
WRITER = DemoModel("writer-13b", "q5_k_m", "writer", 16000, "Writer 13B")
TINY_B = DemoModel("tiny-b", "f32", "tiny-b", 0, "Tiny B (llama.cpp, CPU)", tiny="tiny-b")
"""The real-engine demo's first resident (~30 MiB of server RSS)."""
TINY_C = DemoModel("tiny-c", "f32", "tiny-c", 0, "Tiny C (llama.cpp, CPU)", tiny="tiny-c")
"""The real-engine demo's model that is not loaded (~70 MiB of server RSS)."""


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
    naming it: the stock UAP proxy's topology (issue 13, :mod:`uapplace.core.topology`)."""
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
    llama_server: Path | None = None
    """A real llama.cpp ``llama-server`` binary: every model's unit runs it on its tiny
    GGUF (:attr:`DemoModel.tiny`) on the CPU tier, with no simulated GPU; ``None``: the
    fake engine on the simulated GPU."""

    @property
    def token(self) -> str:
        return self.proxy_token if self.proxy_token is not None else PROXY_TOKEN


def llamacpp_spec(
    binary: Path, proxy_url: str | None = None, proxy_token: str | None = None
) -> SandboxSpec:
    """Two real llama-servers (:data:`TINY_B`, :data:`TINY_C`) on one port, nothing started:
    both are unmeasured until ``uapplace measure`` records them (the walkthrough and
    ``bench/bench_swap.py --engine llama.cpp`` do). One port, one engine at a time, so a
    request for the other model is a swap: host RAM alone would let tiny models load
    side by side."""
    return SandboxSpec(
        models=(TINY_B, TINY_C),
        resident=None,
        single_upstream=True,
        pause_lever=None,
        proxy_url=proxy_url,
        proxy_token=proxy_token,
        llama_server=binary,
    )


# --------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


async def _wait_for(
    what: str, check: Callable[[], Awaitable[bool]], proc: subprocess.Popen[bytes] | None, log: Path
) -> None:
    """Poll ``check`` until true; fail early (with the log's tail) if ``proc`` exits."""
    deadline = time.monotonic() + STEP_GUARD_S
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise DemoError(f"{what} exited with {proc.returncode}:\n{log_tail(log)}")
        if await check():
            return
        await asyncio.sleep(0.05)
    raise DemoError(f"{what} not ready after {STEP_GUARD_S:g}s:\n{log_tail(log)}")


def log_tail(path: Path, chars: int = 1500) -> str:
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
    sim: SimGpu | None
    """The simulated GPU; ``None`` with real engines (the CPU tier only)."""
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

    @property
    def models_dir(self) -> Path:
        """Where the real engines' tiny GGUF files are written."""
        return self.base / "models"

    def model_file(self, model: DemoModel) -> Path:
        return self.models_dir / f"{model.tiny or model.key}.gguf"

    def unit_argv(self, model: DemoModel) -> list[str]:
        """The ``ExecStart`` of ``model``'s unit."""
        if self.spec.llama_server is not None:
            return server_argv(
                self.spec.llama_server,
                self.model_file(model),
                port=self.ports[model.key],
                alias=model.key,
                ctx_size=LLAMA_CTX,
                parallel=LLAMA_PARALLEL,
                sse_ping_s=LLAMA_SSE_PING_S,
            )
        argv = [sys.executable, "-m", "uapplace.sim.engine", "--port", str(self.ports[model.key])]
        argv += ["--model-id", model.key, "--gpu-uuid", sim_uuid(0), "--mib", str(model.mib)]
        argv += ["--load-secs", f"{self.spec.load_secs:g}", "--kv", "q8_0"]
        if self.spec.pause_lever is not None:
            argv += ["--sleep-mode", "--wake-delay", f"{self.spec.wake_secs:g}"]
        return argv

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
        sim: SimGpu | None = None
        if spec.llama_server is None:
            sim = SimGpu(base / "sim-gpu.json")
            sim.create([(DEVICE_NAME, DEVICE_MIB)])
        box = cls(spec, base, bus, unit_dir, manager is not None, sim, ports, manager=manager)
        box.env = box._client_env_vars()
        await box._check_bus_free()
        box._write_config()
        if spec.llama_server is not None:
            progress("writing the tiny GGUF models")
            await box._write_models()
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
            "UAP_PROXY_URL": self.proxy_url,
            "PROXY_AUTH_TOKEN": self.spec.token,
            "UAPPLACE_SHIM_PORT": str(self.ports["shim"]),
            # No polkit in a sandbox: the daemon's own uid may act
            # (docs/bus-api.md, "Authorization").
            "UAPPLACE_SYSTEM_BUS_ADDRESS": "",
        }
        if self.sim is not None:
            env["UAPPLACE_SIM_GPU"] = str(self.sim.path)
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
        # Measured figures count only from the machine-local file (docs/placement-rules.md §4.1):
        # the demo's box records its own, with the simulated card's identity, as `measure`
        # would.
        (self.uap_home / "model-registry.json").write_text(
            json.dumps(local_measurements(registry), indent=2), encoding="utf-8"
        )
        (self.config_dir / "capacity-policy.json").write_text(
            json.dumps(capacity_policy_json(self.spec.models), indent=2), encoding="utf-8"
        )

    async def _write_models(self) -> None:
        """Every tiny GGUF preset into :attr:`models_dir`, by ``python -m
        uapplace.sim.gguf_models`` in a child process: the ``gguf`` package it needs is an
        optional extra (``engines``), so ``uapplace`` itself never imports it."""
        argv = [sys.executable, "-m", "uapplace.sim.gguf_models", str(self.models_dir)]
        proc = await asyncio.create_subprocess_exec(
            *argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.client_env()
        )
        async with asyncio.timeout(STEP_GUARD_S):
            output, _ = await proc.communicate()
        if proc.returncode != 0:
            text = output.decode(errors="replace")[-1500:]
            hint = (
                "\nthe tiny models need the gguf package: `make setup` installs it "
                "(pip install -e '.[engines]')"
                if "No module named 'gguf'" in text
                else ""
            )
            raise DemoError(f"{shlex.join(argv)} exited with {proc.returncode}:\n{text}{hint}")
        (self.base / "llama-cache").mkdir(exist_ok=True)

    def _engine_environment(self) -> tuple[tuple[str, str], ...]:
        """The ``Environment=`` of every engine unit."""
        if self.sim is not None:
            return (("UAPPLACE_SIM_GPU", str(self.sim.path)),)
        # An empty download cache: llama-server (a router above all) lists what it finds there.
        return ((LLAMA_CACHE_ENV, str(self.base / "llama-cache")),)

    @property
    def engine_template(self) -> str:
        """The unit template of this sandbox's engines (:mod:`uapplace.files.unit_template`)."""
        return "fake" if self.spec.llama_server is None else "llama.cpp"

    def _unit_text(self, model: DemoModel) -> str:
        weights = model.display if self.spec.llama_server is None else str(self.model_file(model))
        return self._render(model.key, weights, self.unit_argv(model))

    def _render(self, name: str, weights: str, argv: Sequence[str]) -> str:
        """An engine unit from the template ``uapplace unit add`` fills: the demo's engines
        run hardened as an operator's do."""
        unit = EngineUnit(
            self.engine_template,
            name,
            weights,
            tuple(argv),
            DEMO_UNIT_MARKER,
            self._engine_environment(),
        )
        try:
            return render_unit(unit)
        except TemplateError as err:
            raise DemoError(str(err)) from err

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
            self._write_unit(stack, model.unit, self._unit_text(model))
        await units.reload()

    def _write_unit(self, stack: AsyncExitStack, name: str, text: str) -> None:
        path = self.unit_dir / name
        if path.exists() and self.manager is None:
            raise DemoError(f"{path} exists already: is another demo running?")
        path.write_text(text, encoding="utf-8")
        stack.push_async_callback(self._remove_unit, name)

    async def add_unit(
        self, stack: AsyncExitStack, stem: str, serves: str, argv: Sequence[str]
    ) -> str:
        """One more unit, ``uapplace-demo-<stem>.service`` running ``argv`` with the
        engines' environment and template (``serves``: what its ``Description=`` says it
        serves), stopped and removed when ``stack`` closes; its name.
        (``bench/bench_swap.py --engine llama.cpp --pause``: a llama-server router.)"""
        name = f"{UNIT_PREFIX}-{stem}.service"
        self._write_unit(stack, name, self._render(stem, serves, argv))
        await self.units.reload()
        return name

    async def _remove_unit(self, name: str) -> None:
        with contextlib.suppress(UnitError):
            await self.units.stop_unit(name, 15)
        (self.unit_dir / name).unlink(missing_ok=True)
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
        stack.callback(terminate, proc)
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


def host_device_json() -> dict[str, Any]:
    """``cpu0``: this host's RAM, with a 512 MiB reserve."""
    host_mib = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
    return {"kind": "cpu", "total_mib": host_mib, "reserved_mib": 512}


def registry_json(box: Sandbox, models: Sequence[DemoModel]) -> dict[str, Any]:
    """The demo's registry: one simulated GPU, the host, and each model measured on gpu0;
    with real engines, :func:`llamacpp_registry_json`."""
    if box.spec.llama_server is not None:
        return llamacpp_registry_json(box, models)
    # Stated either way: the demo's own proxy routes by target_id unless it is the one upstream.
    proxy = {"single_upstream": box.single_upstream}
    # Behind a single upstream one engine at a time owns the port: a paused one would
    # keep it, so the planner always stops there; no lever is declared.
    lever = box.spec.pause_lever if not box.single_upstream else None
    return {
        "version": 1,
        "proxy": proxy,
        "devices": {
            "gpu0": {
                "kind": "gpu",
                "name": DEVICE_NAME,
                "total_mib": DEVICE_MIB,
                "reserved_mib": 0,
                "uuid": sim_uuid(0),
            },
            "cpu0": host_device_json(),
        },
        "models": {
            m.key: model_json(
                box,
                m,
                rails=1,
                affinity="code" if m is CODER else "general",
                config={
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
                },
            )
            for m in models
        },
    }


def llamacpp_registry_json(box: Sandbox, models: Sequence[DemoModel]) -> dict[str, Any]:
    """Real llama-servers on the CPU tier: only ``cpu0`` (host RAM), every config
    unmeasured (``uapplace measure`` records ``measured_on: cpu0`` and the RSS of the
    unit's processes), ``rails`` the units' ``--parallel``, one upstream for all."""
    return {
        "version": 1,
        "proxy": {"single_upstream": box.single_upstream},
        "devices": {"cpu0": host_device_json()},
        "models": {
            m.key: model_json(
                box, m, rails=LLAMA_PARALLEL, affinity="general", config={"status": "unmeasured"}
            )
            for m in models
        },
    }


def model_json(
    box: Sandbox, model: DemoModel, *, rails: int, affinity: str, config: dict[str, Any]
) -> dict[str, Any]:
    """``model``'s registry entry (a llama.cpp unit of the sandbox, its service named after
    it) with its one config ``config``."""
    return {
        "display": model.display,
        "engine": "llama.cpp",
        "unit": model.unit,
        "endpoint": box.endpoint(model),
        "rails": rails,
        "service": model.key,
        "task_affinity": [affinity],
        "configs": {model.config: config},
    }


def capacity_policy_json(models: Sequence[DemoModel]) -> dict[str, Any]:
    """One service per model: verify-up checks the engine's KV type and pool in ``/metrics``
    (the fake engine's); a real llama-server exports neither there, so its services
    only name the unit."""
    if any(m.tiny is not None for m in models):
        return {"services": [{"name": m.key, "unit": m.unit} for m in models]}
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
