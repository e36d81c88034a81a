"""A machine with real llama.cpp engines: ``llama-server`` units on the CPU tier, end to end.

Tier 4 (docs/architecture.md, "Test tiers"); the fixtures are in ``tests/engines/conftest.py``.
Every part is the real program:

- **the engines**: each :class:`LlamaModel` becomes a tiny GGUF file
  (:mod:`uapplace.sim.gguf_models`, written once per session by :class:`TinyModels`) and a
  hardened user unit in the contained ``systemd --user``'s unit directory whose
  ``ExecStart`` is the real ``llama-server`` (:func:`uapplace.sim.llamacpp.server_argv`:
  ``-m <gguf> --alias <id> --host 127.0.0.1 --port <port> -c 512 --parallel 2 --metrics
  --sse-ping-interval 1 [extra flags]``), with ``LLAMA_CACHE`` at an empty folder and its
  output appended to ``<world>/engines/<key>.log`` (:meth:`LlamaWorld.engine_log`);
- **the registry** places them on the CPU tier: ``cpu0`` is this machine's memory (its
  budget configurable), each model is ``engine: llama.cpp`` with its unit and endpoint
  and one config ``<key>-f32`` measured on ``cpu0`` (no GPU memory, ``host_rss_mib`` from the
  model, the KV geometry its ``-c``/``--parallel`` give, ``kv_mib_per_1k_cells`` 0: a
  llama.cpp pool is fixed at start), the machine-local copy written as ``measure`` would
  (docs/placement-rules.md §4.1). The simulated ``gpu0`` the private
  environment carries stays empty;
- **uapplaced** runs on the manager's own bus (so it wires enforcement) in a private
  world (the bus tier's ``make_env``/``start_daemon``, as ``tests/systemd/live_world.py``
  does), its enforcement timeouts :data:`LLAMA_TIMEOUTS`; ``UAP_PROXY_URL`` and
  ``PROXY_AUTH_TOKEN`` point it at the fake proxy of :mod:`uapplace.sim.proxy`, served in
  the test's loop, so ``drain`` and ``refresh-proxy`` have a proxy to talk to
  (:attr:`LlamaWorld.proxy`: ``set_inflight`` puts a request in flight, ``refreshes``
  counts the refreshes);
- **uapplace-shim** runs in front of it (:attr:`LlamaWorld.shim`).

A model may be shaped to fail: ``preset=CORRUPT`` (a GGUF cut short: the server exits 1
while loading), ``alias="wrong"`` (it serves another id), ``port_taken=True`` (another
socket holds its port: it exits 1), ``extra_args`` (any llama-server flag),
``sleep_idle_s`` (``--sleep-idle-seconds``), ``metrics=False`` (no ``--metrics``),
``stop_timeout_s`` (the unit's ``TimeoutStopSec=``, 10 by default). Models with
``started=True`` are started (and turn healthy) before the daemon, which adopts them as
residents; the world is yielded once those are ``hot``. A test that needs other
enforcement timeouts or a smaller ``cpu0`` passes them to :func:`llama_world` (the
``world_options`` fixture).

Helpers: the CLI (:meth:`LlamaWorld.cli`, :meth:`LlamaWorld.cli_json`), the daemon's
state through the shim (:meth:`LlamaWorld.state`, :meth:`LlamaWorld.resident_states`,
:meth:`LlamaWorld.alerts`), admission as the proxy and the dashboard use it
(:meth:`LlamaWorld.park`, :meth:`LlamaWorld.options_of`, :meth:`LlamaWorld.resolve`), the
engines' own answers (:meth:`LlamaWorld.engine_get`, :meth:`LlamaWorld.props`,
:meth:`LlamaWorld.slots_processing`) and completions sent straight to them
(:meth:`LlamaWorld.complete`, :meth:`LlamaWorld.stream`), the
units (:meth:`LlamaWorld.start`, :meth:`LlamaWorld.stop`, :meth:`LlamaWorld.main_pid`),
waiting (:meth:`LlamaWorld.until`, :meth:`LlamaWorld.wait_asleep`). Never poll ``/slots``
to see whether an engine sleeps: ``GET /slots`` wakes it (``/props`` does not).

Everything the world started is stopped when the block ends: the shim and the daemon by
PID, the units through the manager, the unit files removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import shlex
import socket
import subprocess
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp

from tests.bus.conftest import DaemonProcess, UapEnv, make_env, run_cli, start_daemon
from tests.bus.shim_fixtures import ShimProcess, start_shim
from tests.worlds import polling
from tests.worlds.registries import MEASURED_AT, sim_devices
from tests.worlds.shim_view import ShimView
from uapplace.files.paths import BUS_NAME
from uapplace.files.timeouts import Timeouts
from uapplace.io.units import JobOutcome, UnitManager, UnitState
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.gguf_models import preset, write_corrupt_model, write_tiny_model
from uapplace.sim.llamacpp import LLAMA_CACHE_ENV, server_argv

GUARD_S = 30.0
"""Upper bound on any wait: a hang guard, never an assertion about speed."""
PROXY_TOKEN = "llama-world-proxy-token"
WIRED = "enforcement, unit sync, auto runner and idle sweep wired"
CORRUPT = "corrupt"
"""The preset name of a GGUF file whose tensor data is cut short."""

LLAMA_TIMEOUTS = Timeouts(
    drain_s=5.0,
    stop_s=15.0,
    verify_free_s=2.0,
    start_s=10.0,
    verify_up_s=10.0,
    rollback_up_s=15.0,
)
"""Enforcement's waits in this world: the tiny models load in well under a second, and a
stop is at most ``TimeoutStopSec`` (10 s) before systemd's SIGKILL."""

HARDENING = (
    "NoNewPrivileges=yes",
    "LockPersonality=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "RestrictNamespaces=yes",
    "MemoryDenyWriteExecute=yes",
    "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service",
    "CapabilityBoundingSet=",
    "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX",
    "PrivateDevices=yes",
    "ProtectSystem=strict",
    "ProtectHome=read-only",
    "ProtectControlGroups=yes",
    "ProtectKernelModules=yes",
    "ProtectHostname=yes",
    "KeyringMode=private",
    "UMask=0077",
)
"""What a hardened llama-server unit may not do. No ``PrivateTmp`` (the models live under
the test's temporary folder); ``ProtectKernelTunables``/``ProtectKernelLogs`` are refused
by the contained manager on this kind of host, so they are left out."""


class TinyModels:
    """The tiny GGUF files of :mod:`uapplace.sim.gguf_models` in one folder, each written on
    first use (a session writes each preset once)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path(self, name: str) -> Path:
        """The file of preset ``name`` (``tiny-a``, ``tiny-b``, ``tiny-c``) or :data:`CORRUPT`."""
        target = self.folder / f"{name}.gguf"
        if not target.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            if name == CORRUPT:
                write_corrupt_model(target)
            else:
                write_tiny_model(target, preset(name))
        return target


@dataclass(frozen=True)
class LlamaModel:
    """One model of the world: a ``llama-server`` unit and its registry entry."""

    key: str
    """The registry's model key; the unit's ``--alias`` unless ``alias`` says otherwise."""
    preset: str = "tiny-a"
    """A :data:`uapplace.sim.gguf_models.SIZES` name, or :data:`CORRUPT`."""
    alias: str | None = None
    """``--alias``: the id the server serves (``None``: the key; another: a wrong id)."""
    ctx_size: int = 512
    """``-c``: the whole KV pool, split across the slots."""
    parallel: int = 2
    sleep_idle_s: int | None = None
    """``--sleep-idle-seconds``."""
    extra_args: tuple[str, ...] = ()
    port_taken: bool = False
    """Another socket listens on the unit's port for the world's whole life."""
    metrics: bool = True
    """``--metrics`` (``False``: ``/metrics`` answers 501, as without the flag)."""
    stop_timeout_s: int = 10
    """The unit's ``TimeoutStopSec=``: systemd ``SIGKILL``s it that long after ``SIGTERM``
    (llama-server ignores ``SIGTERM`` during a non-streaming generation)."""
    started: bool = False
    """Started before the daemon, which adopts it as a resident."""
    host_rss_mib: float = 64.0
    """The registry's figure (the measured one is a test's to take)."""
    measured: bool = True
    """``False``: the config is ``{"status": "unmeasured"}`` (for ``measure`` to fill)."""
    metrics_must_match: Mapping[str, Any] | None = None
    """A capacity-policy service ``<key>-server`` with this ``metricsMustMatch``."""
    exec_start_must_contain: tuple[str, ...] = ()
    """That service's ``execStartMustContain`` (any entry makes the service)."""
    entry: Mapping[str, Any] = field(default_factory=dict)
    """More keys of the model's registry entry (``advertises``; ``rails``, else ``parallel``)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """More keys of its measured config (``pause_lever``, ``start_s``)."""

    @property
    def served_alias(self) -> str:
        return self.key if self.alias is None else self.alias

    @property
    def config_key(self) -> str:
        """The model's one config: ``<key>-f32`` (the tiny models are F32; ids stay unique)."""
        return f"{self.key}-f32"

    @property
    def service(self) -> str | None:
        wanted = self.metrics_must_match is not None or self.exec_start_must_contain
        return f"{self.key}-server" if wanted else None


@dataclass(frozen=True)
class LlamaUnit:
    """What the world wrote for one model."""

    model: LlamaModel
    name: str
    """``<prefix>-<key>.service``."""
    port: int
    model_path: Path
    argv: tuple[str, ...]
    log_path: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def target(self) -> str:
        """The proxy's ``target_id`` for it: the CPU tier's device and the endpoint."""
        return f"cpu0:{self.endpoint}"


def unit_text(
    unit_key: str, argv: Sequence[str], cache: Path, log_path: Path, stop_timeout_s: int = 10
) -> str:
    """A hardened ``Type=exec`` user unit running ``argv``; output appended to ``log_path``."""
    service = [
        "Type=exec",
        f"ExecStart={shlex.join(argv)}",
        f"Environment={LLAMA_CACHE_ENV}={cache}",
        f"ReadWritePaths={cache}",
        f"StandardOutput=append:{log_path}",
        f"StandardError=append:{log_path}",
        f"TimeoutStopSec={stop_timeout_s}",
        *HARDENING,
    ]
    head = f"[Unit]\nDescription=uapplace engines tier: llama-server {unit_key}\n"
    return head + "\n[Service]\n" + "\n".join(service) + "\n"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def taken_port() -> socket.socket:
    """A socket listening on a free loopback port, which a server then cannot bind."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(1)
    return sock


def exe_of(pid: int) -> Path:
    """The program ``pid`` runs (``/proc/<pid>/exe``)."""
    return Path(os.readlink(f"/proc/{pid}/exe"))


def argv_of(pid: int) -> list[str]:
    """``pid``'s command line (``/proc/<pid>/cmdline``)."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0")
    return [arg.decode() for arg in raw.split(b"\0")]


def cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text(encoding="utf-8")


def rss_mib(pid: int) -> float:
    """``pid``'s resident set (``VmRSS``), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text(encoding="utf-8").splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for PID {pid}")


def model_entry(unit: LlamaUnit) -> dict[str, Any]:
    """The registry entry of ``unit``'s model, its one config on ``cpu0``."""
    spec = unit.model
    config: dict[str, Any] = {"status": "unmeasured"}
    if spec.measured:
        config = {
            "resident_gpu_mib": 0,
            "host_rss_mib": spec.host_rss_mib,
            "context_pool_cells": spec.ctx_size,
            "per_session_cap_cells": spec.ctx_size // spec.parallel,
            "kv_resident_cells": spec.ctx_size,
            # As ``measure`` records a llama.cpp config: its pool is fixed at start, so a
            # request's context costs nothing more (docs/placement-rules.md §4.1.1).
            "kv_mib_per_1k_cells": 0,
            "kv": "f16",
            "measured_at": MEASURED_AT,
            "measured_on": "cpu0",
            **spec.config,
        }
    entry: dict[str, Any] = {
        "display": f"{spec.key} ({spec.preset}, llama.cpp on the CPU)",
        "engine": "llama.cpp",
        "unit": unit.name,
        "endpoint": unit.endpoint,
        "rails": spec.parallel,
        **({"service": spec.service} if spec.service else {}),
        **spec.entry,
        "configs": {spec.config_key: config},
    }
    return entry


def llama_registry(
    units: Mapping[str, LlamaUnit], cpu_total_mib: int | None, cpu_reserved_mib: int
) -> dict[str, Any]:
    """The world's registry: :func:`model_entry` for each unit, ``cpu0`` as asked."""
    devices = sim_devices()
    if cpu_total_mib is not None:
        devices["cpu0"]["total_mib"] = cpu_total_mib
    devices["cpu0"]["reserved_mib"] = cpu_reserved_mib
    models = {key: model_entry(unit) for key, unit in units.items()}
    # One port per model behind a proxy that routes by target_id: said, so validate is clean.
    proxy = {"single_upstream": None}
    return {"version": 1, "devices": devices, "models": models, "proxy": proxy}


def capacity_policy(models: Sequence[LlamaModel]) -> dict[str, Any]:
    services = [
        {
            "name": spec.service,
            "metricsMustMatch": dict(spec.metrics_must_match or {}),
            "execStartMustContain": list(spec.exec_start_must_contain),
        }
        for spec in models
        if spec.service is not None
    ]
    return {"services": services}


@dataclass
class LlamaWorld(ShimView):
    binary: Path
    uap: UapEnv
    daemon: DaemonProcess
    shim: ShimProcess
    proxy: sim_proxy.FakeProxy
    proxy_url: str
    units: UnitManager
    engines: dict[str, LlamaUnit]
    http: aiohttp.ClientSession

    def engine(self, key: str) -> LlamaUnit:
        return self.engines[key]

    def engine_log(self, key: str) -> str:
        """What ``key``'s llama-server wrote (stdout and stderr, every start appended)."""
        path = self.engines[key].log_path
        return path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""

    def logs(self) -> str:
        """The daemon's log, then each engine's: what a failure shows."""
        parts = [f"--- uapplaced\n{self.daemon.log()}"]
        parts += [f"--- {key}\n{self.engine_log(key)[-2000:]}" for key in self.engines]
        return "\n".join(parts)

    async def until(self, what: str, check: Callable[[], Any]) -> Any:
        """Await ``check()`` until it returns something truthy; fail with the logs."""
        return await polling.until(what, check, self.logs, guard_s=GUARD_S, tail=8000)

    # ------------------------------------------------------------- the CLI

    async def cli(self, *args: str, limit_s: float = 60) -> subprocess.CompletedProcess[str]:
        """``python -m uapplace.cli ARGS`` against this world's daemon (not in the loop)."""
        return await asyncio.to_thread(run_cli, self.uap, *args, timeout=limit_s)

    async def cli_json(self, *args: str, limit_s: float = 60) -> Any:
        """``uapplace ARGS --json``, exit 0 asserted; its output parsed."""
        done = await self.cli(*args, "--json", limit_s=limit_s)
        assert done.returncode == 0, f"uapplace {' '.join(args)}: {done.stderr}{done.stdout}"
        return json.loads(done.stdout)

    # ------------------------------------------------------------- the daemon (via the shim)

    async def alerts(self, kind: str) -> list[dict[str, Any]]:
        """The open alerts of ``kind`` (``GetState.alerts``)."""
        return [alert for alert in (await self.state())["alerts"] if alert["kind"] == kind]

    async def admit(self, model: str, client: str = "llama-client") -> dict[str, Any]:
        """``POST /api/placement/admit`` as the proxy sends it: the decision's body."""
        body = {"model_id": model, "client": client, "session": None}
        status, decision = await self.shim_post("/api/placement/admit", body)
        assert status == 200, decision
        return decision

    async def park(self, model: str, client: str = "llama-client") -> str:
        """Admit ``model``, which must park; its placement id."""
        decision = await self.admit(model, client)
        assert decision["decision"] == "park", decision
        placement_id: str = decision["placement_id"]
        return placement_id

    async def resolve(self, placement_id: str, option: int) -> dict[str, Any]:
        """Apply ``option`` of ``placement_id`` through the shim (its victims as shown); the
        run's result."""
        chosen = (await self.options_of(placement_id))[option - 1]
        victims = [
            {"model": v["model"], "config": v["config"], "action": v["action"]}
            for v in chosen["victims"]
        ]
        body = {"placement_id": placement_id, "option": option, "expected_victims": victims}
        status, result = await self.shim_post("/api/placement/resolve", body, self.shim.token)
        assert status == 200, result
        return result

    async def wait_resident(self, key: str, wanted: str | None = "hot") -> None:
        """Until ``key``'s resident state is ``wanted`` (``None``: not a resident)."""

        async def reached() -> bool:
            return (await self.resident_states()).get(key) == wanted

        await self.until(f"{key} to be {wanted or 'gone'}", reached)

    # ------------------------------------------------------------- the units

    async def start(self, key: str) -> JobOutcome:
        return await self.units.start_unit(self.engines[key].name, GUARD_S)

    async def stop(self, key: str) -> JobOutcome:
        return await self.units.stop_unit(self.engines[key].name, GUARD_S)

    async def unit_state(self, key: str) -> UnitState:
        return await self.units.state(self.engines[key].name)

    async def main_pid(self, key: str) -> int:
        pid = (await self.unit_state(key)).main_pid
        assert pid, f"{key}'s unit has no main process"
        return pid

    async def relaunch(
        self, key: str, unit_dir: Path, models: TinyModels, **changes: Any
    ) -> LlamaUnit:
        """Restart ``key``'s unit under another command line, as an operator edits a unit:
        ``changes`` to its :class:`LlamaModel` (``preset``, ``ctx_size``, ``parallel`` …),
        the ``ExecStart=`` of its file in ``unit_dir`` rewritten, the manager reloaded, the
        unit stopped and started; returned once ``/health`` answers 200."""
        old = self.engines[key]
        spec = replace(old.model, **changes)
        model_path = models.path(spec.preset)
        argv = spec_argv(self.binary, model_path, spec, old.port)
        path = unit_dir / old.name
        lines = [
            f"ExecStart={shlex.join(argv)}" if line.startswith("ExecStart=") else line
            for line in path.read_text(encoding="utf-8").splitlines()
        ]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        await self.units.reload()
        assert (await self.stop(key)).ok
        unit = LlamaUnit(spec, old.name, old.port, model_path, tuple(argv), old.log_path)
        self.engines[key] = unit
        outcome = await self.start(key)
        assert outcome.ok, f"{outcome}; {self.engine_log(key)[-2000:]}"
        await self.wait_healthy(key)
        return unit

    # ------------------------------------------------------------- the engines

    async def engine_get(self, key: str, path: str) -> tuple[int, Any]:
        """``GET path`` of ``key``'s server: the status and the body (JSON when it is)."""
        async with self.http.get(self.engines[key].endpoint + path) as reply:
            text = await reply.text()
            try:
                return reply.status, json.loads(text)
            except ValueError:
                return reply.status, text

    async def props(self, key: str) -> dict[str, Any]:
        """``GET /props``: never wakes a sleeping server."""
        status, body = await self.engine_get(key, "/props")
        assert status == 200 and isinstance(body, dict), (status, body)
        return body

    async def slots_processing(self, key: str) -> int:
        """How many of ``key``'s slots say ``is_processing`` (``GET /slots`` wakes a
        sleeper: only for an engine that is awake anyway)."""
        status, slots = await self.engine_get(key, "/slots")
        assert status == 200 and isinstance(slots, list), (status, slots)
        return sum(1 for slot in slots if slot.get("is_processing"))

    async def complete(self, key: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """``POST /v1/completions`` straight to ``key``'s server (not through any proxy)."""
        url = f"{self.engines[key].endpoint}/v1/completions"
        async with self.http.post(url, json=dict(body)) as reply:
            assert reply.status == 200, await reply.text()
            answer: dict[str, Any] = await reply.json()
        return answer

    async def stream(self, key: str, body: Mapping[str, Any]) -> list[str]:
        """``body`` streamed straight from ``key``'s server: every ``data:`` payload, in order
        (the last is ``[DONE]`` when the stream ended whole)."""
        url = f"{self.engines[key].endpoint}/v1/completions"
        events: list[str] = []
        async with self.http.post(url, json={**body, "stream": True}) as reply:
            assert reply.status == 200, await reply.text()
            async for raw in reply.content:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
        return events

    async def wait_healthy(self, key: str) -> None:
        async def healthy() -> bool:
            try:
                return (await self.engine_get(key, "/health"))[0] == 200
            except aiohttp.ClientError:
                return False

        await self.until(f"{key}'s llama-server to answer /health 200", healthy)

    async def wait_asleep(self, key: str, asleep: bool = True) -> None:
        """Until ``/props`` ``is_sleeping`` is ``asleep`` (``/props`` does not wake it)."""

        async def reached() -> bool:
            return (await self.props(key)).get("is_sleeping") is asleep

        await self.until(f"{key} to be {'asleep' if asleep else 'awake'}", reached)


@asynccontextmanager
async def llama_world(
    tmp_path: Path,
    bus_address: str,
    unit_dir: Path,
    units: UnitManager,
    binary: Path,
    models: TinyModels,
    specs: Sequence[LlamaModel],
    *,
    timeouts: Timeouts = LLAMA_TIMEOUTS,
    cpu_total_mib: int | None = None,
    cpu_reserved_mib: int = 256,
) -> AsyncIterator[LlamaWorld]:
    """The world above, for ``specs``; everything it started is stopped when the block ends.

    ``bus_address``/``unit_dir``: the contained manager's; ``units``: a connected
    :class:`UnitManager` on it. ``cpu_total_mib``: ``cpu0``'s budget (default this
    machine's memory); ``cpu_reserved_mib`` its reserve.
    """
    keys = [spec.key for spec in specs]
    assert len(set(keys)) == len(keys), f"model keys must differ: {keys}"
    # The proxy binds first, so the free ports picked for the engines cannot be its.
    proxy = sim_proxy.FakeProxy()
    runner, proxy_url = await sim_proxy.start(proxy)
    prefix = f"llama{secrets.token_hex(3)}"
    written: list[Path] = []
    blockers: list[socket.socket] = []
    daemon: DaemonProcess | None = None
    shim: ShimProcess | None = None
    try:
        engines: dict[str, LlamaUnit] = {}
        cache = tmp_path / "llama-cache"
        logs = tmp_path / "engines"
        for folder in (cache, logs):
            folder.mkdir(parents=True, exist_ok=True)
        for spec in specs:
            if spec.port_taken:
                blockers.append(taken_port())
                port = blockers[-1].getsockname()[1]
            else:
                port = free_port()
            unit = _write_unit(prefix, spec, port, binary, models, cache, logs, unit_dir)
            written.append(unit_dir / unit.name)
            engines[spec.key] = unit
        await units.reload()

        uap = make_env(tmp_path / "uap", bus_address)
        uap.write_registry(llama_registry(engines, cpu_total_mib, cpu_reserved_mib))
        policy = json.dumps(capacity_policy(specs))
        (uap.config_dir / "capacity-policy.json").write_text(policy, encoding="utf-8")
        timeouts_file = uap.home / "enforcement-timeouts.json"
        timeouts_file.write_text(json.dumps(timeouts.to_json()), encoding="utf-8")
        uap.env["UAP_PROXY_URL"] = proxy_url
        uap.env["PROXY_AUTH_TOKEN"] = PROXY_TOKEN

        for unit in engines.values():
            if unit.model.started:
                outcome = await units.start_unit(unit.name, GUARD_S)
                assert outcome.ok, f"{outcome}; {unit.log_path.read_text(errors='replace')}"

        daemon = await asyncio.to_thread(start_daemon, uap)
        shim = await asyncio.to_thread(start_shim, uap.env, bus_address, uap.root)
        async with aiohttp.ClientSession() as http:
            world = LlamaWorld(binary, uap, daemon, shim, proxy, proxy_url, units, engines, http)
            running = daemon

            async def wired() -> bool:
                return f"owns {BUS_NAME}" in running.log()

            await world.until("uapplaced to finish wiring", wired)
            assert WIRED in daemon.log(), daemon.log()
            for unit in engines.values():
                if unit.model.started:
                    await world.wait_resident(unit.model.key, "hot")
            yield world
    finally:
        await runner.cleanup()
        shim_code = await asyncio.to_thread(shim.stop) if shim is not None else 0
        daemon_code = await asyncio.to_thread(daemon.stop) if daemon is not None else 0
        for path in written:
            await units.stop_unit(path.name, GUARD_S)
            path.unlink(missing_ok=True)
            _remove_dropins(path)
        await units.reload()
        for sock in blockers:
            sock.close()
    assert shim_code == 0, f"uapplace-shim exited {shim_code}"
    assert daemon_code == 0, f"uapplaced exited {daemon_code}"


def _write_unit(
    prefix: str,
    spec: LlamaModel,
    port: int,
    binary: Path,
    models: TinyModels,
    cache: Path,
    logs: Path,
    unit_dir: Path,
) -> LlamaUnit:
    model_path = models.path(spec.preset)
    argv = spec_argv(binary, model_path, spec, port)
    name = f"{prefix}-{spec.key}.service"
    log_path = logs / f"{spec.key}.log"
    unit_dir.mkdir(parents=True, exist_ok=True)
    text = unit_text(spec.key, argv, cache, log_path, spec.stop_timeout_s)
    (unit_dir / name).write_text(text, encoding="utf-8")
    return LlamaUnit(spec, name, port, model_path, tuple(argv), log_path)


def spec_argv(binary: Path, model_path: Path, spec: LlamaModel, port: int) -> list[str]:
    """The ``llama-server`` command line of ``spec`` serving ``model_path`` on ``port``."""
    extra = list(spec.extra_args)
    if spec.sleep_idle_s is not None:
        extra += ["--sleep-idle-seconds", str(spec.sleep_idle_s)]
    return server_argv(
        binary,
        model_path,
        port=port,
        alias=spec.served_alias,
        ctx_size=spec.ctx_size,
        parallel=spec.parallel,
        metrics=spec.metrics,
        extra=extra,
    )


def _remove_dropins(unit_file: Path) -> None:
    """The ``<unit>.d`` folder uapplace may have written (``Conflicts=`` drop-ins)."""
    dropins = unit_file.with_name(f"{unit_file.name}.d")
    if dropins.is_dir():
        for file in dropins.iterdir():
            file.unlink()
        with contextlib.suppress(OSError):
            dropins.rmdir()
