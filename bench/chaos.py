"""Chaos harness: random operations and faults against the real daemon, invariants after each.

::

    .venv/bin/python bench/chaos.py --steps 2000 --seed 7      # a long run (root: it
                                                               # starts a contained
                                                               # systemd --user)

``tests/systemd/test_chaos.py`` runs the same :class:`Chaos` for CI (bounded), on the
tier's contained user manager.

The world: one simulated 24 GiB GPU, three models as real units of a contained
``systemd --user`` running the fake engine (``alpha`` 14000 MiB, ``beta`` 12000,
``gamma`` 8000: alpha+beta do not fit, the others pair up, all three never), the
real ``uapplaced`` process (started and restarted by the harness), and the fake
proxy's internal routes (:mod:`uapplace.sim.proxy`) so drains see "nothing in flight".
``alpha`` and ``beta`` have a sleep lever (:data:`SLEEPERS`: the engine in vLLM's sleep
mode, taking :data:`LEVER_S` to sleep and to wake, the config ``pause_lever:
vllm-sleep-1``), so runs pause and wake them and kills land with a ``/sleep`` or a
``/wake_up`` in flight (issue 20).

Each step is one random operation:

- ``admit`` (a random id: model key or advertised id, a random client);
- ``apply`` (option and signature as ``ListPending`` shows them), ``load``
  (``Preview``'s first option signature), ``unload`` (``PreviewUnload``'s), each
  possibly with **a SIGKILL of uapplaced** when the run reports a chosen step
  (any step of docs/placement-rules.md §4.6 or a rollback step, from the
  ``EnforcementStep`` signal); the harness then restarts the daemon, which repairs the run
  (:mod:`uapplace.recovery.recover`);
- a unit started or stopped by hand (``StartUnit``/``StopUnit``);
- an engine fault for the unit's next start: ``exit`` at start, ``never-healthy``,
  ``wrong-id``, ``orphan`` (a child keeps the VRAM after the stop), ``slow-stop``;
  or healing it; or a running engine SIGKILLed;
- ``dismiss`` a pending entry; an idle SIGKILL of the daemon;
- a sleeper's engine put to sleep by hand (``POST /sleep``, not through uapplace), or
  one put to sleep that way woken by hand (``POST /wake_up``).

After each step it waits until the daemon has settled, then checks docs/invariants.md:

1. **forward**: every forward's target serves the requested id (its ``/v1/models``
   is read right after the answer) and is awake (a sleeper's ``/is_sleeping`` is
   false: a sleeping vLLM still lists its id, and answers 503);
2. **truth**: the residents are exactly the registry units that are up (after a
   restart: within the guard), no ``hot`` resident's engine is asleep (within the
   guard: the serving re-check unpublishes it), and every simulated-GPU allocation belongs to an
   up unit's process or to an orphan the daemon reported (``probe_mismatch``,
   ``rollback_incomplete``, ``recovery_needed``);
3. **never emptier**: a device with residents before an enforcement (or a crash)
   that has none after it, by no unload or hand stop, has a
   ``rollback_incomplete``/``recovery_needed``/``enforcement_failed`` alert, or a
   ``resident_dropped`` one (its unit failed on its own, e.g. an engine that could
   not claim the memory an orphan holds);
4. **budget**: the residents' ``gpu_mib`` on a device never exceed its budget;
5. **nothing lost**: every pending entry that reached the ledger file ends with a
   ``Resolved`` signal or by expiry. ``Admit`` answers a park before the ledger
   write (the write-behind coalesces for ~75 ms plus one fsynced write: the hot
   path never waits on the disk), so a SIGKILL inside that window can lose a park
   that was never durable; those are counted (``lost_in_write_window``), not
   violations, and the client's retry parks again.

It prints its seed first; the same ``--seed`` replays the same operations (the
timing of the world can still differ: a failing seed is re-run to reproduce).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from dbus_fast import Message, MessageType

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.util import bus_daemon_message
from uapplace.core.steps import (
    DRAIN,
    MARK_DRAINING,
    PAUSE,
    REFRESH_PROXY,
    ROLLBACK_START,
    ROLLBACK_STOP,
    ROLLBACK_VERIFY,
    ROLLBACK_WAKE,
    START,
    STOP,
    VERIFY_FREE,
    VERIFY_UP,
    WAKE,
)
from uapplace.files.paths import INTERFACE
from uapplace.files.registry import local_measurements
from uapplace.io import engines
from uapplace.io.units import RUNNING_OR_STARTING_STATES, UnitManager
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.gpu import SimGpu, pid_alive, sim_uuid
from uapplace.sim.usermanager import ContainedUserManager

DEVICE_MIB = 24576
MODELS: dict[str, int] = {"alpha": 14000, "beta": 12000, "gamma": 8000}
CONFIG = {m: f"{m[0]}1" for m in MODELS}
SLEEPERS = frozenset({"alpha", "beta"})
"""Models whose engine has a sleep lever (vLLM sleep mode; config ``pause_lever``)."""
LEVER_S = 0.4
"""How long a sleeper takes to sleep and to wake: a kill right after the step before
(``drain`` of a pause run, ``verify-free`` of a wake run) lands with it in flight."""
FAULTS = ("exit", "never-healthy", "wrong-id", "orphan", "slow-stop")
ROLLBACK_KILL_STEPS = (ROLLBACK_STOP, ROLLBACK_START, ROLLBACK_VERIFY, ROLLBACK_WAKE)
"""Where a run that is likely to roll back is killed."""
KILL_STEPS = (
    MARK_DRAINING,
    DRAIN,
    PAUSE,
    STOP,
    VERIFY_FREE,
    START,
    WAKE,
    VERIFY_UP,
    REFRESH_PROXY,
    *ROLLBACK_KILL_STEPS,
)
EMPTYING_ALERTS = frozenset(
    {"rollback_incomplete", "recovery_needed", "enforcement_failed", "resident_dropped"}
)
"""Alerts that name why a device is emptier (``resident_dropped``: its unit failed)."""
ORPHAN_ALERTS = frozenset({"probe_mismatch", "rollback_incomplete", "recovery_needed"})


def reported_pids(alerts: list[dict[str, Any]]) -> set[int]:
    """The processes open alerts name in their ``detail.pids`` (a ``probe_mismatch`` lists
    every process holding device memory outside a resident's unit)."""
    named: set[int] = set()
    for alert in alerts:
        detail = alert.get("detail")
        pids = detail.get("pids") if isinstance(detail, dict) else None
        if isinstance(pids, list):
            named.update(p for p in pids if isinstance(p, int))
    return named


TIMEOUTS = {
    "drain_s": 0.5,
    "stop_s": 8.0,
    "verify_free_s": 1.5,
    "start_s": 8.0,
    "http_s": 1.0,
    "verify_up_s": 4.0,
    "rollback_up_s": 4.0,
    "serving_check_s": 0.5,
}
START_TIMEOUT_S = 2
"""Each config's ``start_timeout_s``: a never-healthy engine is rolled back after this."""
ORPHAN_LIFETIME_S = 6.0
SETTLE_GUARD_S = 20.0
"""How long the world may take to settle after a step: a hang guard, never a speed claim."""
WIRED = "enforcement, unit sync, auto runner and idle sweep wired"
PENDING_TTL_S = 120.0


@dataclass(frozen=True)
class Violation:
    step: int
    invariant: str
    what: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.invariant}: {self.what}"


@dataclass
class ChaosReport:
    seed: int
    steps: int = 0
    kills: int = 0
    restarts: int = 0
    forwards_checked: int = 0
    lost_in_write_window: int = 0
    """Parks lost to a kill before the write-behind made them durable (see the module doc)."""
    ops: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> str:
        ops = ", ".join(f"{name} {count}" for name, count in sorted(self.ops.items()))
        return (
            f"seed {self.seed}: {self.steps} steps, {self.kills} kills of uapplaced, "
            f"{self.restarts} restarts, {self.forwards_checked} forwards checked, "
            f"{self.lost_in_write_window} parks lost before their ledger write, "
            f"{len(self.violations)} violations, {self.wall_s:.0f} s wall; ops: {ops}"
        )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def spawn_daemon(env: dict[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """``python -m uapplace.daemon`` with its output in ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "uapplace.daemon", "--log-level", "DEBUG"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )


@dataclass
class Engine:
    model: str
    unit: str
    port: int
    fault: str | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def sleeps(self) -> bool:
        """Its engine has the sleep routes (an orphan-faulted one cannot: the fake engine
        refuses ``--sleep-mode`` with ``--orphan``)."""
        return self.model in SLEEPERS and self.fault != "orphan"

    def accepted(self) -> set[str]:
        return {self.model, f"{self.model}-latest", CONFIG[self.model]}


class Chaos:
    """One chaos world; ``await setup()``, ``await run(...)``, ``await close()``."""

    def __init__(
        self,
        manager: ContainedUserManager,
        root: Path,
        seed: int,
        say: Callable[[str], None] = print,
        *,
        verbose: bool = False,
    ) -> None:
        self.manager = manager
        self.root = root
        self.seed = seed
        self.rng = random.Random(seed)
        self.say = say
        self.report = ChaosReport(seed)
        self.prefix = f"chaos{random.Random(seed).randrange(16**4):04x}{os.getpid() % 1000}"
        self.engines: dict[str, Engine] = {}
        self.sim = SimGpu(root / "sim-gpu.json")
        self.env: dict[str, str] = {}
        self.daemon: subprocess.Popen[bytes] | None = None
        self.daemon_logs: list[Path] = []
        self.units: UnitManager | None = None
        self.client: PlacementClient | None = None
        self.proxy_runner: Any = None
        self.http: aiohttp.ClientSession | None = None
        self.kill_at: str | None = None
        self.killed = False
        self.expected_exit = False
        self.resolved: dict[str, str] = {}
        self.tracked: dict[str, float] = {}
        self.durable: set[str] = set()
        """Tracked entries seen in the ledger file (an outside observer's view)."""
        self.alerts_this_step: list[tuple[str, str]] = []
        self.step_no = 0
        self.orphan_files: list[Path] = []
        self.detail = ""
        """What the current step did (logged with ``verbose``)."""
        self.verbose = verbose

    # ------------------------------------------------------------------ world

    async def setup(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        self.sim.create([("Simulated GPU 0", DEVICE_MIB)])
        self.proxy_runner, proxy_url = await sim_proxy.start(sim_proxy.FakeProxy())
        for model in MODELS:
            self.engines[model] = Engine(model, f"{self.prefix}-{model}.service", free_port())
            self._write_unit(self.engines[model])
        self.units = UnitManager(self.manager.bus_address)
        await self.units.connect()
        await self.units.reload()
        self._write_config(proxy_url)
        self.http = aiohttp.ClientSession()
        self.client = await PlacementClient.connect(self.manager.bus_address, call_timeout=120)
        # Signals on the client's own connection: the bus keeps one sender's messages in
        # order, so a run's EnforcementStep is handled before the reply that ends it.
        self.client.bus.add_message_handler(self._on_signal)
        reply = await self.client.bus.call(
            bus_daemon_message("AddMatch", "s", [f"type='signal',interface='{INTERFACE}'"])
        )
        assert reply is not None and reply.message_type is MessageType.METHOD_RETURN
        await self._start_daemon()
        # As an operator would (`uapplace units`): systemd itself never runs two units
        # that cannot be resident together, whoever starts them.
        written = await self.client.write_units()
        self.say(f"Conflicts= drop-ins: {', '.join(written) or 'none needed'}")

    def _write_config(self, proxy_url: str) -> None:
        config = self.root / "config"
        home = self.root / "home"
        runtime = self.root / "runtime"
        for path in (config, home, runtime):
            path.mkdir(parents=True, exist_ok=True)
        runtime.chmod(0o700)
        doc = self._registry()
        (config / "model-registry.json").write_text(json.dumps(doc), encoding="utf-8")
        (home / "model-registry.json").write_text(
            json.dumps(local_measurements(doc)), encoding="utf-8"
        )
        (config / "capacity-policy.json").write_text('{"services": []}', encoding="utf-8")
        (home / "enforcement-timeouts.json").write_text(json.dumps(TIMEOUTS), encoding="utf-8")
        keep = {k: v for k, v in os.environ.items() if not k.startswith(("DBUS_", "UAP", "XDG_"))}
        self.env = {
            **keep,
            "DBUS_SESSION_BUS_ADDRESS": self.manager.bus_address,
            "UAP_HOME": str(home),
            "UAPPLACE_CONFIG_DIR": str(config),
            "UAPPLACE_SIM_GPU": str(self.sim.path),
            "UAPPLACE_SYSTEM_BUS_ADDRESS": "",
            "UAP_PROXY_URL": proxy_url,
            "XDG_RUNTIME_DIR": str(runtime),
            # The manager's own: the Conflicts= drop-ins WriteUnits writes take effect.
            "XDG_CONFIG_HOME": str(self.manager.config_home),
            "HOME": str(self.root),
            "PYTHONUNBUFFERED": "1",
        }

    def _registry(self) -> dict[str, Any]:
        host_mib = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20)
        return {
            "version": 1,
            "devices": {
                "gpu0": {
                    "kind": "gpu",
                    "name": "Simulated GPU 0",
                    "total_mib": DEVICE_MIB,
                    "reserved_mib": 0,
                    "uuid": sim_uuid(0),
                },
                "cpu0": {"kind": "cpu", "total_mib": host_mib, "reserved_mib": 256},
            },
            "models": {
                model: {
                    "display": model.title(),
                    "engine": "llama.cpp",
                    "unit": engine.unit,
                    "endpoint": engine.endpoint,
                    "advertises": [f"{model}-latest"],
                    "configs": {
                        CONFIG[model]: {
                            **({"pause_lever": "vllm-sleep-1"} if model in SLEEPERS else {}),
                            "resident_gpu_mib": MODELS[model],
                            "host_rss_mib": 64,
                            "kv_resident_cells": 32768,
                            "context_pool_cells": 32768,
                            "measured_at": "2026-10-08T14:02:00Z",
                            "measured_on": "gpu0",
                            "start_timeout_s": START_TIMEOUT_S,
                        }
                    },
                }
                for model, engine in self.engines.items()
            },
        }

    def _write_unit(self, engine: Engine) -> None:
        argv = [sys.executable, "-m", "uapplace.sim.engine", "--port", str(engine.port)]
        argv += ["--model-id", engine.model, "--advertise", f"{engine.model}-latest"]
        argv += ["--load-secs", "0.1", "--gpu-uuid", sim_uuid(0)]
        argv += ["--mib", str(MODELS[engine.model])]
        if engine.sleeps:
            argv += [
                "--sleep-mode",
                "--sleep-delay",
                f"{LEVER_S:g}",
                "--wake-delay",
                f"{LEVER_S:g}",
            ]
        extra: list[str] = []
        if engine.fault == "exit":
            argv.append("--fail-at-start")
        elif engine.fault == "never-healthy":
            argv.append("--never-healthy")
        elif engine.fault == "wrong-id":
            argv.append("--wrong-id")
        elif engine.fault == "orphan":
            pidfile = self.root / f"orphan-{engine.model}-{len(self.orphan_files)}.pid"
            self.orphan_files.append(pidfile)
            argv += ["--orphan", "--orphan-pidfile", str(pidfile)]
            argv += ["--orphan-lifetime", str(ORPHAN_LIFETIME_S)]
            extra.append("KillMode=process")
        elif engine.fault == "slow-stop":
            extra.append("ExecStop=/bin/sleep 1")
        lines = [
            "[Unit]",
            f"Description=chaos {engine.model}",
            "[Service]",
            "Type=exec",
            f"ExecStart={shlex.join(argv)}",
            f"Environment=UAPPLACE_SIM_GPU={self.sim.path}",
            "TimeoutStopSec=10",
            *extra,
        ]
        path = self.manager.unit_dir / engine.unit
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")

    async def close(self) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.expected_exit = True
            self.daemon.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.daemon.wait, 30)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                await asyncio.to_thread(self.daemon.wait)
        if self.client is not None:
            self.client.disconnect()
        if self.units is not None:
            for engine in self.engines.values():
                with contextlib.suppress(Exception):
                    await self.units.stop_unit(engine.unit, 15)
                (self.manager.unit_dir / engine.unit).unlink(missing_ok=True)
                dropins = self.manager.unit_dir / f"{engine.unit}.d"
                if dropins.is_dir():
                    for file in dropins.iterdir():
                        file.unlink()
                    dropins.rmdir()
            with contextlib.suppress(Exception):
                await self.units.reload()
            self.units.close()
        for pidfile in self.orphan_files:
            with contextlib.suppress(OSError, ValueError):
                pid = int(pidfile.read_text(encoding="ascii").strip())
                if pid_alive(pid):
                    os.kill(pid, signal.SIGKILL)
        if self.http is not None:
            await self.http.close()
        if self.proxy_runner is not None:
            await self.proxy_runner.cleanup()

    # ------------------------------------------------------------------ the daemon

    async def _start_daemon(self) -> None:
        log_path = self.root / f"uapplaced-{len(self.daemon_logs)}.log"
        self.daemon_logs.append(log_path)
        self.daemon = spawn_daemon(self.env, log_path)
        self.killed = False
        deadline = time.monotonic() + 60
        while WIRED not in log_path.read_text(errors="replace"):
            if self.daemon.poll() is not None:
                raise RuntimeError(f"uapplaced exited {self.daemon.returncode}: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"uapplaced did not finish wiring: {self.log_tail()}")
            await asyncio.sleep(0.05)

    def log_tail(self, chars: int = 3000) -> str:
        if not self.daemon_logs:
            return ""
        return self.daemon_logs[-1].read_text(errors="replace")[-chars:]

    def _kill_daemon(self, why: str) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            os.kill(self.daemon.pid, signal.SIGKILL)
            self.killed = True
            self.report.kills += 1
            self.say(f"  step {self.step_no}: SIGKILL uapplaced ({why})")

    async def _restart_if_down(self) -> bool:
        """Restart a daemon that is gone; a death nobody caused is a violation."""
        assert self.daemon is not None
        if self.daemon.poll() is None and not self.killed:
            return False
        await asyncio.to_thread(self.daemon.wait)
        if not self.killed:
            self.violate("daemon", f"uapplaced exited {self.daemon.returncode} by itself")
        await self._start_daemon()
        self.report.restarts += 1
        return True

    def _on_signal(self, message: Message) -> None:
        if message.message_type is not MessageType.SIGNAL or message.interface != INTERFACE:
            return
        if message.member == "EnforcementStep":
            _run, step, _ok, _detail = message.body
            if self.kill_at is not None and step == self.kill_at:
                self.kill_at = None
                self._kill_daemon(f"after enforcement step {step}")
        elif message.member == "Resolved":
            placement_id, outcome = message.body
            self.resolved[placement_id] = outcome
        elif message.member == "AlertRaised":
            _id, kind, _severity, subject, _message = message.body
            self.alerts_this_step.append((kind, subject))

    # ------------------------------------------------------------------ running

    def violate(self, invariant: str, what: str) -> None:
        found = Violation(self.step_no, invariant, what)
        self.report.violations.append(found)
        self.say(f"  VIOLATION {found}")

    async def run(
        self, steps: int, min_kills: int = 0, max_steps: int | None = None
    ) -> ChaosReport:
        """``steps`` operations (more, up to ``max_steps``, until ``min_kills`` kills)."""
        started = time.monotonic()
        limit = max_steps or steps
        self.say(f"chaos seed {self.seed}")
        while self.step_no < steps or (self.report.kills < min_kills and self.step_no < limit):
            self.step_no += 1
            await self.step()
            self.report.steps = self.step_no
        self.report.wall_s = time.monotonic() - started
        return self.report

    async def step(self) -> None:
        self.alerts_this_step = []
        self._note_durable()
        before = await self._residents()
        op = self.rng.choices(
            [
                "admit",
                "apply",
                "load",
                "unload",
                "hand-start",
                "hand-stop",
                "fault",
                "heal",
                "engine-exit",
                "dismiss",
                "idle-kill",
                "hand-sleep",
                "hand-wake",
            ],
            weights=[22, 18, 10, 8, 8, 6, 10, 6, 4, 4, 6, 4, 3],
        )[0]
        self.report.ops[op] += 1
        self.detail = ""
        emptying = await getattr(self, "_op_" + op.replace("-", "_"))()
        if self.verbose:
            self.say(f"step {self.step_no}: {op} {self.detail}".rstrip())
        restarted = await self._restart_if_down()
        await self._settle(restarted)
        await self._check(before, emptying, restarted)

    # ------------------------------------------------------------------ operations

    def _model(self) -> str:
        return self.rng.choice(sorted(MODELS))

    async def _call(self, what: str, call: Any) -> Any:
        """One bus call; errors the contract allows are outcomes, not failures."""
        assert self.client is not None
        try:
            return await call
        except PlacementError as err:
            if not self.killed and err.short not in {
                "Busy",
                "Drifted",
                "NotFound",
                "InvalidArgument",
                "Failed",
                "UnknownModel",
                "NotAuthorized",
            }:
                self.say(f"  {what}: {err}")
            return None

    async def _op_admit(self) -> bool:
        assert self.client is not None
        model = self._model()
        requested = self.rng.choice([model, f"{model}-latest"])
        client = f"client-{self.rng.randrange(4)}"
        answer = await self._call("admit", self.client.admit(requested, client, "", 0))
        self.detail = f"{requested} by {client} → {answer}"
        if answer is None:
            return False
        if answer["decision"] == "forward":
            await self._check_forward(requested, answer["target_id"])
        elif answer.get("placement_id"):
            self.tracked.setdefault(answer["placement_id"], time.time())
        return False

    async def _op_apply(self) -> bool:
        assert self.client is not None
        listed = await self._call("pending", self.client.list_pending())
        entries = [e for e in (listed or {}).get("pending", []) if e.get("options")]
        if not entries:
            return await self._op_admit()
        entry = self.rng.choice(entries)
        index = self.rng.randrange(len(entry["options"]))
        signature = entry["options"][index].get("signature", [])
        option = entry["options"][index]
        self._arm_kill(option.get("model"), bool(option.get("victims")))
        result = await self._call("apply", self.client.apply(entry["id"], index + 1, signature))
        armed, self.kill_at = self.kill_at, None
        self.detail = f"{entry['id']} option {index + 1} {signature}{self._outcome(result, armed)}"
        return False

    async def _op_load(self) -> bool:
        assert self.client is not None
        model = self._model()
        preview = await self._call("preview", self.client.preview(model, 0))
        options = (preview or {}).get("options") or []
        signature = options[0].get("signature", []) if options else []
        self._arm_kill(model, bool(options and options[0].get("victims")))
        result = await self._call("load", self.client.load(model, signature))
        armed, self.kill_at = self.kill_at, None
        self.detail = f"{model} {signature}{self._outcome(result, armed)}"
        return False

    async def _op_unload(self) -> bool:
        assert self.client is not None
        model = self._model()
        preview = await self._call("preview-unload", self.client.preview_unload(model))
        if preview is None:
            return False
        self._arm_kill(None)
        result = await self._call("unload", self.client.unload(model, preview.get("signature", [])))
        armed, self.kill_at = self.kill_at, None
        self.detail = f"{model}{self._outcome(result, armed)}"
        return True

    def _outcome(self, result: Any, armed: str | None) -> str:
        killed = f" [kill armed at {armed}, not reached]" if armed else ""
        if self.killed:
            killed = " [uapplaced killed]"
        if isinstance(result, dict):
            return f" → ok={result.get('ok')} {result.get('error') or ''}{killed}"
        return f" → no result{killed}"

    def _arm_kill(self, target: str | None, has_victims: bool = False) -> None:
        """With probability 0.8 the run is killed at a step: a rollback step when the
        model it starts has a fault that makes verify-up fail (rollback likely)."""
        self.kill_at = None
        if self.rng.random() < 0.8:
            engine = self.engines.get(target or "")
            failing = engine is not None and engine.fault in ("exit", "never-healthy", "wrong-id")
            if not failing:
                self.kill_at = self.rng.choice(KILL_STEPS)
            else:  # rollback-start/-verify happen only when victims were stopped
                self.kill_at = self.rng.choice(
                    ROLLBACK_KILL_STEPS if has_victims else ROLLBACK_KILL_STEPS[:1]
                )

    async def _op_hand_start(self) -> bool:
        assert self.units is not None
        engine = self.engines[self._model()]
        residents = await self._residents()
        counted = sum(
            float(r.get("gpu_mib") or 0)
            for r in residents
            if r.get("device") == "gpu0" and r.get("model") != engine.model
        )
        if counted + MODELS[engine.model] > DEVICE_MIB:
            # Sleepers get no Conflicts= (one of them may be paused beside the other), so
            # systemd would start a unit beside an awake one: the operator looks first.
            self.detail = f"{engine.model}: not started, {counted:,.0f} MiB counted on gpu0"
            return False
        outcome = await self.units.start_unit(engine.unit, 15)
        self.detail = f"{engine.model} ({engine.fault or 'no fault'}) → {outcome.result}"
        return False

    async def _op_hand_stop(self) -> bool:
        assert self.units is not None
        engine = self.engines[self._model()]
        outcome = await self.units.stop_unit(engine.unit, 15)
        self.detail = f"{engine.model} → {outcome.result}"
        return True

    async def _op_fault(self) -> bool:
        assert self.units is not None
        engine = self.engines[self._model()]
        engine.fault = self.rng.choice(FAULTS)
        self.detail = f"{engine.model}: {engine.fault} at its next start"
        self._write_unit(engine)
        await self.units.reload()
        return False

    async def _op_heal(self) -> bool:
        assert self.units is not None
        faulty = [e for e in self.engines.values() if e.fault is not None]
        if not faulty:
            return await self._op_admit()
        engine = self.rng.choice(faulty)
        self.detail = f"{engine.model}: no more {engine.fault}"
        engine.fault = None
        self._write_unit(engine)
        await self.units.reload()
        return False

    async def _op_engine_exit(self) -> bool:
        assert self.units is not None
        engine = self.engines[self._model()]
        pid = (await self.units.state(engine.unit)).main_pid
        self.detail = f"{engine.model} pid {pid or 'none'}"
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return True

    async def _op_dismiss(self) -> bool:
        assert self.client is not None
        listed = await self._call("pending", self.client.list_pending())
        entries = (listed or {}).get("pending", [])
        if entries:
            await self._call("dismiss", self.client.dismiss(self.rng.choice(entries)["id"]))
        return False

    async def _op_idle_kill(self) -> bool:
        self._kill_daemon("idle")
        return False

    async def _up_sleepers(self) -> list[Engine]:
        up = await self._up_units()
        return [e for e in self.engines.values() if e.sleeps and e.unit in up]

    async def _op_hand_sleep(self) -> bool:
        """Anyone on the machine calls a sleeper's ``/sleep``: the serving re-check must
        unpublish it (the truth check waits for that, the forward check holds it)."""
        sleepers = await self._up_sleepers()
        if not sleepers:
            return await self._op_admit()
        engine = self.rng.choice(sleepers)
        try:
            await engines.sleep(engine.endpoint, 1, timeout=10)
            self.detail = f"{engine.model}: POST /sleep by hand"
        except engines.EngineError as err:
            self.detail = f"{engine.model}: POST /sleep by hand failed: {err}"
        return False

    async def _op_hand_wake(self) -> bool:
        """Wake by hand a sleeper put to sleep by hand (never a ``paused`` resident: its
        memory is lent to whatever the planner placed since)."""
        residents = {r.get("model"): r.get("state") for r in await self._residents()}
        asleep = [
            e
            for e in await self._up_sleepers()
            if residents.get(e.model) != "paused"
            and await engines.is_sleeping(e.endpoint, 2.0) is True
        ]
        if not asleep:
            return await self._op_admit()
        engine = self.rng.choice(asleep)
        try:
            await engines.wake(engine.endpoint, 10)
            self.detail = f"{engine.model}: POST /wake_up by hand"
        except engines.EngineError as err:
            self.detail = f"{engine.model}: POST /wake_up by hand failed: {err}"
        return False

    # ------------------------------------------------------------------ invariants

    async def _check_forward(self, requested: str, target_id: str) -> None:
        assert self.http is not None
        self.report.forwards_checked += 1
        endpoint = target_id.split(":", 1)[1]
        model = next((m for m, e in self.engines.items() if e.endpoint == endpoint), None)
        accepted = self.engines[model].accepted() if model is not None else set()
        if requested not in accepted:
            self.violate("forward", f"{requested} forwarded to {target_id}, another model's")
            return
        try:
            async with self.http.get(
                f"{endpoint}/v1/models", timeout=aiohttp.ClientTimeout(total=3)
            ) as reply:
                body = await reply.json() if reply.status == 200 else {}
                status = reply.status
        except (aiohttp.ClientError, TimeoutError, ValueError) as err:
            self.violate(
                "forward", f"{requested} forwarded to {target_id}, which does not answer: {err}"
            )
            return
        served = {m.get("id") for m in body.get("data", [])} if isinstance(body, dict) else set()
        if status != 200 or not served & accepted:
            self.violate(
                "forward",
                f"{requested} forwarded to {target_id}, which serves {sorted(map(str, served))} "
                f"(HTTP {status})",
            )
        elif (
            model is not None
            and self.engines[model].sleeps
            and await engines.is_sleeping(endpoint, 3.0) is True
        ):
            self.violate("forward", f"{requested} forwarded to {target_id}, which is asleep")

    async def _residents(self) -> list[dict[str, Any]]:
        assert self.client is not None
        if self.daemon is None or self.daemon.poll() is not None:
            return []
        state = await self._call("state", self.client.get_state())
        return list((state or {}).get("residents", []))

    async def _up_units(self) -> dict[str, int]:
        """Registry unit → main PID for every unit that is up (active/activating/reloading)."""
        assert self.units is not None
        up: dict[str, int] = {}
        for engine in self.engines.values():
            state = await self.units.state(engine.unit)
            if state.active_state in RUNNING_OR_STARTING_STATES:
                up[engine.unit] = state.main_pid
        return up

    async def _settle(self, restarted: bool) -> None:
        """Until residents == up units and no unit is in transition (or the guard ends)."""
        assert self.units is not None
        deadline = time.monotonic() + SETTLE_GUARD_S
        while True:
            transitional = False
            for engine in self.engines.values():
                state = await self.units.state(engine.unit)
                transitional |= state.active_state in ("deactivating",)
            mismatch = await self._unit_mismatch()
            if not transitional and mismatch is None:
                return
            if time.monotonic() > deadline:
                why = mismatch or "a unit stayed deactivating"
                self.violate("truth", f"not settled after {SETTLE_GUARD_S:g}s: {why}")
                return
            await asyncio.sleep(0.1)

    async def _unit_mismatch(self) -> str | None:
        residents = await self._residents()
        up = await self._up_units()
        by_unit = {r.get("unit"): r for r in residents}
        if set(by_unit) != set(up):
            return (
                f"residents {sorted(map(str, by_unit))} but units up {sorted(up)} "
                f"(residents: {[(r['model'], r['state']) for r in residents]})"
            )
        for resident in residents:
            engine = self.engines.get(str(resident.get("model")))
            if engine is None or not engine.sleeps or resident.get("state") != "hot":
                continue
            if await engines.is_sleeping(engine.endpoint, 2.0) is True:
                return f"{engine.model} is published hot but its engine is asleep"
        return None

    async def _check(self, before: list[dict[str, Any]], emptying: bool, restarted: bool) -> None:
        after = await self._residents()
        used = sum(float(r.get("gpu_mib") or 0) for r in after if r.get("device") == "gpu0")
        if used > DEVICE_MIB:
            self.violate("budget", f"residents on gpu0 add up to {used:,.0f} MiB > {DEVICE_MIB}")
        # Serving before (hot): a warming resident that never passed verify-up (an engine
        # failing at start) is nothing recovery could refill.
        had = [r for r in before if r.get("device") == "gpu0" and r.get("state") == "hot"]
        has = [r for r in after if r.get("device") == "gpu0"]
        alerted = {kind for kind, _subject in self.alerts_this_step}
        if had and not has and not emptying and not alerted & EMPTYING_ALERTS:
            lost = ", ".join(r["model"] for r in had)
            self.violate(
                "never-emptier",
                f"gpu0 had {lost} and is empty, with no alert naming why "
                f"(alerts this step: {sorted(alerted) or 'none'})",
            )
        await self._check_pending()
        if restarted:
            await self._check_probe()

    async def _check_pending(self) -> None:
        assert self.client is not None
        listed = await self._call("pending", self.client.list_pending())
        if listed is None:
            return
        live = {e["id"] for e in listed.get("pending", [])}
        now = time.time()
        for placement_id, seen_at in list(self.tracked.items()):
            if placement_id in live:
                continue
            del self.tracked[placement_id]
            if placement_id in self.resolved:
                continue
            if now - seen_at >= PENDING_TTL_S - 2:
                continue  # expired (possibly while the daemon was down: no signal then)
            self._note_durable()
            if placement_id not in self.durable:
                self.report.lost_in_write_window += 1
                continue
            self.violate("nothing-lost", f"pending {placement_id} vanished without Resolved")

    def _note_durable(self) -> None:
        """Mark the tracked entries the ledger file holds now."""
        try:
            doc = json.loads((self.root / "home" / "placement.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        for entry in doc.get("pending", []) if isinstance(doc, dict) else []:
            if isinstance(entry, dict) and entry.get("id") in self.tracked:
                self.durable.add(str(entry["id"]))

    async def _check_probe(self) -> None:
        """After a restart: every allocation is an up unit's process or a reported orphan."""
        assert self.units is not None and self.client is not None
        owned: set[int] = set()
        for unit in await self._up_units():
            owned.update(await self.units.pids(unit))
        orphans = set()
        for pidfile in self.orphan_files:
            with contextlib.suppress(OSError, ValueError):
                orphans.add(int(pidfile.read_text(encoding="ascii").strip()))
        state = await self._call("state", self.client.get_state())
        alerts = (state or {}).get("alerts", [])
        kinds = {a.get("kind") for a in alerts}
        named = reported_pids(alerts)
        for allocation in self.sim.read().allocations:
            if allocation.pid in owned or not pid_alive(allocation.pid):
                continue
            if allocation.pid in named:
                continue  # an alert names this very process
            if allocation.pid in orphans and kinds & ORPHAN_ALERTS:
                continue
            self.violate(
                "truth",
                f"pid {allocation.pid} holds {allocation.used_mib:,.0f} MiB on the GPU: no up "
                f"unit's process, and no alert reports it (alerts: {sorted(map(str, kinds))})",
            )


# --------------------------------------------------------------------------- CLI


async def _main(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    print(f"chaos: seed {seed} (replay with --seed {seed})", flush=True)
    manager = ContainedUserManager(name_prefix="uapplace-chaos")
    manager.start()
    chaos: Chaos | None = None
    try:
        root = Path(args.workdir) if args.workdir else manager.base_dir / "chaos"
        chaos = Chaos(
            manager, root, seed, say=lambda line: print(line, flush=True), verbose=args.verbose
        )
        await chaos.setup()
        report = await chaos.run(args.steps, min_kills=args.min_kills, max_steps=args.steps * 3)
    finally:
        if chaos is not None:
            await chaos.close()
        manager.stop()
    print(report.summary(), flush=True)
    for violation in report.violations:
        print(f"  {violation}", flush=True)
    return 1 if report.violations else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/chaos.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--seed", type=int, default=None, help="replay a run (printed first)")
    parser.add_argument("--min-kills", type=int, default=0, help="keep going until this many kills")
    parser.add_argument("--workdir", help="where logs and the ledger go (default: a temp dir)")
    parser.add_argument("--verbose", action="store_true", help="print every step")
    args = parser.parse_args(argv)
    return asyncio.run(_main(args))


if __name__ == "__main__":
    sys.exit(main())
