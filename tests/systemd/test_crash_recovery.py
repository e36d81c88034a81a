"""A SIGKILL of uapplaced at each enforcement step, then a restart: the repair table holds.

The machine of :mod:`tests.systemd.placement_world` (``alpha`` 14000 MiB resident,
``beta`` 16000 MiB parked, one simulated 24 GiB GPU: applying ``beta`` displaces
``alpha``), every part real: the engines are units of the contained
``systemd --user`` running the fake engine, ``uapplaced`` runs as a process on that
manager's bus. The test hook ``UAPPLACE_TEST_CRASH_AT=<step>`` makes the daemon
SIGKILL itself right after the enforcement journal made that step durable
(:mod:`uapplace.files.journal`), which is the widest a real crash can hit: the journal
says the step is next (or, for ``verify-free``/``verify-up``, just done), nothing
more. The daemon is then started again without the hook, and the outcome must be
the one :mod:`uapplace.recovery.recover`'s table gives:

- the GPU is not emptier than before the run (``alpha`` hot again, or ``beta``
  hot and verified);
- ``alpha`` and ``beta`` never ran at the same time;
- ``GetState`` carries a ``recovery_done`` alert whose subject is the run id and
  whose detail says the outcome;
- the journal is gone; the placement is resolved when the run was finished, else
  still pending with options planned again (``alpha`` as the victim).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message, MessageType

from tests.bus.conftest import DaemonProcess, UapEnv, make_env, start_daemon
from tests.systemd.conftest import EngineUnit, Machine, UnitFiles
from tests.systemd.live_world import seed_daemon_files
from tests.systemd.placement_world import FAST, UnitTimeline, declare_pause_lever, registry_json
from tests.worlds import polling
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.util import bus_daemon_message
from uapplace.files.paths import INTERFACE
from uapplace.io import engines
from uapplace.io.units import UnitManager
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.gpu import SimGpu
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

GUARD_S = 40.0
"""Upper bound on any wait: a hang guard, never an assertion about speed."""
WIRED = "enforcement, unit sync, auto runner and idle sweep wired"


@dataclass(frozen=True)
class Case:
    crash_at: str
    beta_args: tuple[str, ...]
    outcome: str
    """``detail.outcome`` of the recovery alert."""
    serving: str
    """The model hot after the repair (the other one's unit is inactive)."""
    reapply: bool = False
    """Apply the re-planned placement again after the repair: it must now succeed."""
    pause: bool = False
    """Both engines run ``--sleep-mode``, both configs declare ``pause_lever`` and the
    apply takes the option that *pauses* alpha (issue 12) instead of stopping it."""


CASES = [
    # Before the victim's stop: nothing changed; alpha's draining mark is lifted.
    Case("stop", (), "nothing_changed", "alpha", reapply=True),
    # alpha stopped (during verify-free): restart it.
    Case("verify-free", (), "rolled_back", "alpha", reapply=True),
    # alpha stopped, beta not started yet: restart alpha.
    Case("start", (), "rolled_back", "alpha"),
    # beta's start job done (during verify-up): beta verifies → the run is finished.
    Case("verify-up", (), "finished", "beta"),
    # beta started but serves the wrong id: it never verifies → stop it, restart alpha.
    Case("verify-up", ("--wrong-id",), "rolled_back", "alpha"),
    # The run failed (beta never healthy) and was about to stop beta: stop it, restart alpha.
    Case("rollback-stop", ("--never-healthy",), "rolled_back", "alpha"),
    # beta already stopped by the rollback, alpha about to restart: restart alpha.
    Case("rollback-start", ("--never-healthy",), "rolled_back", "alpha"),
]


@dataclass
class CrashWorld:
    case: Case
    uap: UapEnv
    alpha: EngineUnit
    beta: EngineUnit
    units: UnitManager
    timeline: UnitTimeline
    daemon: DaemonProcess | None = None

    @property
    def journal(self) -> Path:
        return self.uap.home / "enforcement-journal.json"

    def unit_of(self, model: str) -> EngineUnit:
        return self.alpha if model == "alpha" else self.beta

    async def start_daemon(self, crash_at: str | None) -> PlacementClient:
        env = dict(self.uap.env)
        env.pop("UAPPLACE_TEST_CRASH_AT", None)
        if crash_at is not None:
            env["UAPPLACE_TEST_CRASH_AT"] = crash_at
        self.daemon = await asyncio.to_thread(
            start_daemon, UapEnv(self.uap.root, env, self.uap.bus_address)
        )
        return await PlacementClient.connect(self.uap.bus_address, call_timeout=GUARD_S)

    async def until(self, what: str, check: Callable[[], Any]) -> Any:
        """Await ``check()`` until it returns something truthy; fail with the daemon's log."""

        def log() -> str:
            return self.daemon.log() if self.daemon is not None else ""

        return await polling.until(what, check, log, guard_s=GUARD_S, tail=6000)

    async def until_alpha_hot(self, client: PlacementClient) -> None:
        async def alpha_hot() -> bool:
            return (await resident_states(client)).get("alpha") == "hot"

        await self.until("alpha hot", alpha_hot)

    async def until_residents(self, client: PlacementClient, want: dict[str, str]) -> None:
        """Until ``GetState``'s residents are exactly ``want`` (model → state)."""

        async def reached() -> bool:
            return await resident_states(client) == want

        await self.until(f"residents {want}", reached)

    async def until_killed(self) -> None:
        """Until the daemon the crash hook SIGKILLs has exited; it must have been killed."""
        daemon = self.daemon
        assert daemon is not None
        code = await asyncio.wait_for(asyncio.to_thread(daemon.process.wait), GUARD_S)
        assert code == -signal.SIGKILL, f"uapplaced exited {code}:\n{daemon.log()[-4000:]}"

    async def recovery_alert(self, client: PlacementClient, run_id: str) -> dict[str, Any]:
        """The alert whose subject is ``run_id``, once ``GetState`` carries it."""

        async def alert() -> dict[str, Any] | None:
            alerts = (await client.get_state())["alerts"]
            return next((a for a in alerts if a["subject"] == run_id), None)

        found: dict[str, Any] = await self.until(f"the recovery alert for {run_id}", alert)
        return found


async def wait_for_log(daemon: DaemonProcess, line: str) -> None:
    """Poll the daemon's log file (nothing signals a write to it)."""
    async with asyncio.timeout(GUARD_S):
        while line not in daemon.log():  # noqa: ASYNC110 - a file, not an event
            await asyncio.sleep(0.05)


async def resident_states(client: PlacementClient) -> dict[str, str]:
    state = await client.get_state()
    return {r["model"]: r["state"] for r in state["residents"]}


@contextlib.asynccontextmanager
async def crash_world(
    case: Case, machine: Machine, lever: Sequence[str]
) -> AsyncIterator[CrashWorld]:
    """The machine, ``alpha`` started, no daemon yet; ``lever`` is both engines' extra
    arguments (their sleep mode); ``case.pause`` gives both configs a ``pause_lever``."""
    proxy = sim_proxy.FakeProxy()
    runner, proxy_url = await sim_proxy.start(proxy)
    crash_world: CrashWorld | None = None
    try:
        units, unit_files = machine.units, machine.unit_files
        uap = machine.uap()
        sim = SimGpu(Path(uap.env["UAPPLACE_SIM_GPU"]))
        load = ["--load-secs", "0.3", "--kv", "int8", *lever]
        alpha = unit_files.engine("alpha", "alpha", sim, mib=14000, engine_args=load)
        beta_args = [*load, "--advertise", "beta-latest", *case.beta_args]
        beta = unit_files.engine("beta", "beta", sim, mib=16000, engine_args=beta_args)
        await units.reload()
        registry = registry_json(alpha, beta)
        if case.pause:
            declare_pause_lever(registry, "vllm-sleep-1")
        seed_daemon_files(uap, registry, FAST)
        uap.env["UAP_PROXY_URL"] = proxy_url
        started = await units.start_unit(alpha.name, GUARD_S)
        assert started.ok, started
        timeline = UnitTimeline(units, [alpha.name, beta.name])
        crash_world = CrashWorld(case, uap, alpha, beta, units, timeline)
        yield crash_world
    finally:
        if crash_world is not None and crash_world.daemon is not None:
            daemon = crash_world.daemon
            if daemon.process.poll() is None:
                code = await asyncio.to_thread(daemon.stop)
                assert code == 0, f"uapplaced exited {code}:\n{daemon.log()[-4000:]}"
        await runner.cleanup()


@pytest.fixture
async def world(machine: Machine, request: pytest.FixtureRequest) -> AsyncIterator[CrashWorld]:
    case: Case = request.param
    lever = ["--sleep-mode"] if case.pause else []
    async with crash_world(case, machine, lever) as world:
        yield world


async def planned_options(
    world: CrashWorld, client: PlacementClient, placement_id: str, what: str
) -> list[dict[str, Any]]:
    """The options planned for the parked ``placement_id``, once there are any."""

    async def planned() -> list[dict[str, Any]] | None:
        entries = (await client.list_pending())["pending"]
        entry = next((e for e in entries if e["id"] == placement_id), None)
        return entry["options"] if entry is not None and entry["options"] else None

    options: list[dict[str, Any]] = await world.until(what, planned)
    return options


def option_signature(option: dict[str, Any]) -> list[str]:
    """The signature an apply of ``option`` sends."""
    return sorted(
        option.get("signature") or (f"{v['model']}/{v['config']}" for v in option["victims"])
    )


async def park_beta(world: CrashWorld, client: PlacementClient) -> tuple[str, int, list[str]]:
    """Admit beta (parks), wait for its options; the displace option's index and signature."""
    decision = await client.admit("beta", "crash-test", "", 0)
    assert decision["decision"] == "park", decision
    placement_id = decision["placement_id"]
    options = await planned_options(world, client, placement_id, "beta's options")
    action = "pause" if world.case.pause else "stop"
    index, option = next(
        (i, o)
        for i, o in enumerate(options, 1)
        if o["kind"] == "displace" and all(v.get("action", "stop") == action for v in o["victims"])
    )
    return placement_id, index, option_signature(option)


async def crash_during_apply(world: CrashWorld, case: Case) -> tuple[str, dict[str, Any]]:
    """Run the apply under the crash hook; the placement id and the journal the crash left."""
    client = await world.start_daemon(case.crash_at)
    try:
        await world.until_alpha_hot(client)
        placement_id, index, signature = await park_beta(world, client)
        assert signature == ["alpha/a1@pause" if case.pause else "alpha/a1"], signature
        apply = asyncio.ensure_future(client.apply(placement_id, index, signature))
        await world.until_killed()
        with pytest.raises(PlacementError):
            await apply  # the daemon died mid-call
    finally:
        client.disconnect()
    journal = json.loads(world.journal.read_text(encoding="utf-8"))
    assert journal["step"] == case.crash_at, journal
    return placement_id, journal


async def check_recovered(
    world: CrashWorld, case: Case, placement_id: str, journal: dict[str, Any]
) -> None:
    run_id = journal["run_id"]
    client = await world.start_daemon(None)
    try:
        found = await world.recovery_alert(client, run_id)
        print(f"{case.crash_at}: {found['message']}")
        assert found["kind"] == "recovery_done", found
        assert found["severity"] == "warning", found
        assert found["detail"]["outcome"] == case.outcome, found
        assert found["detail"]["step"] == case.crash_at, found
        assert run_id in found["message"] and case.crash_at in found["message"], found

        await world.until_residents(client, {case.serving: "hot"})
        other = "beta" if case.serving == "alpha" else "alpha"
        assert (await world.units.state(world.unit_of(case.serving).name)).active_state == "active"
        assert (await world.units.state(world.unit_of(other).name)).active_state in (
            "inactive",
            "failed",
        )
        assert not world.journal.exists()
        await check_pending(client, case, placement_id)
        if case.reapply:
            await apply_again(world, client, placement_id)
    finally:
        client.disconnect()
    assert world.timeline.overlaps() == [], world.timeline.changes


async def check_pending(client: PlacementClient, case: Case, placement_id: str) -> None:
    entries = {e["id"]: e for e in (await client.list_pending())["pending"]}
    if case.outcome == "finished":
        assert placement_id not in entries, entries
        return
    entry = entries[placement_id]
    victims: Sequence[str] = [
        f"{v['model']}/{v['config']}" for o in entry["options"] for v in o["victims"]
    ]
    assert entry["options"] and victims == ["alpha/a1"], entry


async def apply_again(world: CrashWorld, client: PlacementClient, placement_id: str) -> None:
    """The re-planned options are current: applying them switches, and clears the journal."""
    entries = {e["id"]: e for e in (await client.list_pending())["pending"]}
    options = entries[placement_id]["options"]
    index, option = next((i, o) for i, o in enumerate(options, 1) if o["kind"] == "displace")
    signature = sorted(f"{v['model']}/{v['config']}" for v in option["victims"])
    result = await client.apply(placement_id, index, signature)
    assert result["ok"], result
    assert not world.journal.exists()
    assert (await resident_states(client)) == {"beta": "hot"}


@pytest.mark.parametrize(
    "world", [pytest.param(c, id=c.crash_at + "".join(c.beta_args)) for c in CASES], indirect=True
)
async def test_a_run_killed_at_a_step_is_repaired_at_restart(world: CrashWorld) -> None:
    case = world.case
    placement_id, journal = await crash_during_apply(world, case)
    await check_recovered(world, case, placement_id, journal)


async def test_a_restart_without_a_journal_repairs_nothing_and_raises_no_alert(
    user_manager: ContainedUserManager, units: UnitManager, unit_files: UnitFiles, tmp_path: Path
) -> None:
    uap = make_env(tmp_path / "uap", user_manager.bus_address)
    daemon = await asyncio.to_thread(start_daemon, uap)
    try:
        await wait_for_log(daemon, WIRED)
        client = await PlacementClient.connect(uap.bus_address, call_timeout=GUARD_S)
        try:
            state = await client.get_state()
        finally:
            client.disconnect()
        assert [a for a in state["alerts"] if a["kind"].startswith("recovery")] == []
        assert "recovering" not in daemon.log()
    finally:
        assert await asyncio.to_thread(daemon.stop) == 0


UNLOAD_CASES = [
    # Before alpha's stop: the unload changed nothing; alpha serves on.
    Case("stop", (), "nothing_changed", "alpha"),
    # alpha stopped: the unload had done its unit work, so it is finished (GPU empty, as asked).
    Case("verify-free", (), "finished", ""),
]


@pytest.mark.parametrize(
    "world",
    [pytest.param(c, id=f"unload-{c.crash_at}") for c in UNLOAD_CASES],
    indirect=True,
)
async def test_an_unload_killed_at_a_step_is_repaired_at_restart(world: CrashWorld) -> None:
    case = world.case
    client = await world.start_daemon(case.crash_at)
    try:
        await world.until_alpha_hot(client)
        signature = (await client.preview_unload("alpha"))["signature"]
        unload = asyncio.ensure_future(client.unload("alpha", signature))
        await world.until_killed()
        with pytest.raises(PlacementError):
            await unload
    finally:
        client.disconnect()
    run_id = json.loads(world.journal.read_text(encoding="utf-8"))["run_id"]

    client = await world.start_daemon(None)
    try:
        found = await world.recovery_alert(client, run_id)
        print(f"unload {case.crash_at}: {found['message']}")
        assert (found["kind"], found["detail"]["outcome"]) == ("recovery_done", case.outcome)
        await world.until_residents(client, {"alpha": "hot"} if case.serving else {})
        alpha = (await world.units.state(world.alpha.name)).active_state
        assert alpha == ("active" if case.serving else "inactive"), alpha
        assert not world.journal.exists()
    finally:
        client.disconnect()


@pytest.mark.parametrize(
    "world",
    [pytest.param(Case("start", ("--load-secs", "3"), "finished", "beta"), id="signal-start")],
    indirect=True,
)
async def test_a_kill_on_the_start_signal_while_the_new_engine_loads_finishes_the_run(
    world: CrashWorld,
) -> None:
    """The real-world way: no hook, SIGKILL from outside when ``EnforcementStep(start, ok)``
    arrives. ``beta`` takes 3 s to load, so the daemon is inside verify-up; whether its
    journal write for ``verify-up`` landed first or not, the repair waits for ``beta`` to
    verify and finishes the run."""
    case = world.case
    client = await world.start_daemon(None)
    daemon = world.daemon
    assert daemon is not None
    killed: list[str] = []

    def on_message(message: Message) -> None:
        if (
            message.message_type is MessageType.SIGNAL
            and message.member == "EnforcementStep"
            and list(message.body[1:3]) == ["start", True]
            and not killed
        ):
            os.kill(daemon.pid, signal.SIGKILL)
            killed.append(message.body[0])

    try:
        client.bus.add_message_handler(on_message)
        match = f"type='signal',interface='{INTERFACE}',member='EnforcementStep'"
        reply = await client.bus.call(bus_daemon_message("AddMatch", "s", [match]))
        assert reply is not None and reply.message_type is MessageType.METHOD_RETURN
        await world.until_alpha_hot(client)
        placement_id, index, signature = await park_beta(world, client)
        apply = asyncio.ensure_future(client.apply(placement_id, index, signature))
        code = await asyncio.wait_for(asyncio.to_thread(daemon.process.wait), GUARD_S)
        assert code == -signal.SIGKILL and killed, daemon.log()[-4000:]
        with pytest.raises(PlacementError):
            await apply
    finally:
        client.disconnect()
    journal = json.loads(world.journal.read_text(encoding="utf-8"))
    assert journal["run_id"] == killed[0]
    assert journal["step"] in ("start", "verify-up"), journal
    world.case = replace(case, crash_at=journal["step"])
    await check_recovered(world, world.case, placement_id, journal)


PAUSE_CASES = [
    # alpha asleep (the pause is done, journaled as verify-free), beta never started:
    # alpha is woken and verified before it is hot again.
    Case("verify-free", (), "rolled_back", "alpha", pause=True),
    # beta started and verifies while alpha sleeps: finished, alpha kept paused, not woken.
    Case("verify-up", (), "finished", "beta", pause=True),
]


@pytest.mark.parametrize(
    "world", [pytest.param(c, id=f"pause-{c.crash_at}") for c in PAUSE_CASES], indirect=True
)
async def test_a_pause_run_killed_after_the_pause_never_publishes_a_sleeping_victim(
    world: CrashWorld,
) -> None:
    """The victim a crashed run put to sleep answers ``/health`` 200 and lists its id, so
    only ``/is_sleeping`` tells it apart: recovery wakes and verifies it, or keeps it
    ``paused`` beside the verified new model; never ``hot`` unverified."""
    case = world.case
    placement_id, journal = await crash_during_apply(world, case)
    assert journal["victim_actions"] == {"alpha/a1": "pause"}, journal
    assert journal["paused"] == ["alpha/a1"], journal
    assert await engines.is_sleeping(world.alpha.endpoint) is True  # the crash left it asleep
    run_id = journal["run_id"]
    client = await world.start_daemon(None)
    try:
        found = await world.recovery_alert(client, run_id)
        print(f"pause {case.crash_at}: {found['message']}")
        assert (found["kind"], found["detail"]["outcome"]) == ("recovery_done", case.outcome)
        assert "alpha/a1" in found["message"], found
        want = {"alpha": "hot"} if case.serving == "alpha" else {"alpha": "paused", "beta": "hot"}
        await world.until_residents(client, want)
        asleep = await engines.is_sleeping(world.alpha.endpoint)
        if case.serving == "alpha":
            assert "woke alpha/a1" in found["message"], found
            assert asleep is False
            assert (await world.units.state(world.beta.name)).active_state in (
                "inactive",
                "failed",
            )
        else:
            assert "kept alpha/a1 paused" in found["message"], found
            assert asleep is True
            assert placement_id not in {e["id"] for e in (await client.list_pending())["pending"]}
        assert (await world.units.state(world.alpha.name)).active_state == "active"
        assert not world.journal.exists()
    finally:
        client.disconnect()
