"""The desktop bubble's apply button runs a real enforcement (issue 6), end to end.

The real ``uapplaced`` process runs on the contained ``systemd --user``'s own
bus, next to python-dbusmock's ``notification_daemon`` template on that same
bus; the models are real units running the fake engine on one simulated 24 GiB
GPU, and the proxy's internal routes are :mod:`uapplace.sim.proxy` over real
HTTP. The machine:

- ``alpha`` (10000 MiB) is resident;
- ``beta`` (17000 MiB) does not fit beside it: its recommended option stops
  ``alpha`` (approval signature ``[alpha/a1]``);
- ``gamma`` (8000 MiB) fits beside ``alpha``; started by hand, it makes the
  minimal set for ``beta`` ``[alpha/a1, gamma/g1]``.

A click on a bubble has no bus caller to receive an error, so every refusal is
proved by its outcome: nothing stopped, the revalidate step that says why, the
pending entry still there.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.bus.conftest import DaemonProcess, UapEnv, start_daemon
from tests.bus.dbusmock_fixtures import MockService, spawn_template
from tests.systemd.conftest import APPLY_STEPS, EngineUnit, UnitFiles
from tests.worlds import polling
from tests.worlds.registries import unit_registry
from uapplace.bus.client import PlacementClient
from uapplace.bus.util import add_match
from uapplace.files.paths import INTERFACE
from uapplace.io.units import UnitManager
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.gpu import SimGpu
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

GUARD_S = 30.0
"""Upper bound on any wait: a hang guard, never an assertion about speed."""
T = TypeVar("T")

MIB = {"alpha": 10000, "beta": 17000, "gamma": 8000}
TIMEOUTS = {
    "drain_s": 2.0,
    "stop_s": 15.0,
    "verify_free_s": 5.0,
    "start_s": 15.0,
    "verify_up_s": 20.0,
    "rollback_up_s": 20.0,
}


class Signals:
    """Every ``org.uap.Placement1`` signal seen on the bus, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, list[Any]]] = []

    def on_message(self, message: Message) -> None:
        if message.message_type is MessageType.SIGNAL and message.interface == INTERFACE:
            self.seen.append((message.member or "", list(message.body)))

    def of(self, member: str) -> list[list[Any]]:
        return [body for name, body in self.seen if name == member]

    def steps(self) -> list[tuple[str, bool, str]]:
        """``EnforcementStep`` as ``(step, ok, detail)``."""
        return [(step, ok, detail) for _run, step, ok, detail in self.of("EnforcementStep")]


@dataclass
class Machine:
    daemon: DaemonProcess
    notifications: MockService
    client: PlacementClient
    signals: Signals
    units: UnitManager
    engines: dict[str, EngineUnit]
    extra_clients: list[PlacementClient] = field(default_factory=list)

    async def until(self, what: str, check: Callable[[], T | None]) -> T:
        """Poll ``check`` until it returns something truthy; fail with the daemon's log."""
        return await polling.until_sync(what, check, self.daemon.log, guard_s=GUARD_S)

    async def resident_states(self) -> dict[str, str]:
        state = await self.client.get_state()
        return {r["model"]: r["state"] for r in state["residents"]}

    async def until_hot(self, model: str) -> None:
        async def hot() -> bool:
            return (await self.resident_states()).get(model) == "hot"

        await polling.until(f"{model} to be a hot resident", hot, self.daemon.log, guard_s=GUARD_S)

    async def active(self, model: str) -> str:
        return (await self.units.state(self.engines[model].name)).active_state

    def notify_calls(self) -> list[list[Any]]:
        """``Notify(app, replaces_id, icon, summary, body, actions, hints, expire)`` calls."""
        return self.notifications.calls("Notify")

    async def park(self, model: str, client: str) -> str:
        decision = await self.client.admit(model, client, "", 0)
        assert decision["decision"] == "park", decision
        return decision["placement_id"]

    async def bubble_for(self, placement_id: str) -> tuple[int, list[Any]]:
        """The bubble id and the last ``Notify`` call that shows ``placement_id``'s apply button.

        The mock numbers new bubbles 1, 2, … (a ``Notify`` with ``replaces_id`` 0 makes
        one); an update names the id it replaces.
        """

        def shown() -> tuple[int, list[Any]] | None:
            calls = self.notify_calls()
            for index in reversed(range(len(calls))):
                if apply_key(placement_id) in calls[index][5]:
                    made = sum(1 for call in calls[: index + 1] if call[1] == 0)
                    return (calls[index][1] or made), calls[index]
            return None

        return await self.until(f"a bubble with {apply_key(placement_id)}", shown)

    async def pending_ids(self) -> list[str]:
        return [e["id"] for e in (await self.client.list_pending())["pending"]]


def apply_key(placement_id: str) -> str:
    return f"apply:{placement_id}:1"


async def connect_signals(address: str) -> tuple[MessageBus, Signals]:
    bus = await MessageBus(bus_address=address).connect()
    signals = Signals()
    bus.add_message_handler(signals.on_message)
    await add_match(bus, f"type='signal',interface='{INTERFACE}'")
    return bus, signals


@pytest.fixture
async def machine(
    uap: UapEnv, units: UnitManager, unit_files: UnitFiles, tmp_path: Path
) -> AsyncIterator[Machine]:
    # The proxy binds first, so the free ports picked for the engines cannot be its.
    runner, proxy_url = await sim_proxy.start(sim_proxy.FakeProxy())
    address = uap.bus_address
    sim = SimGpu(uap.root / "sim-gpu.json")
    engines = {
        model: unit_files.engine(
            model, model, sim, mib=MIB[model], engine_args=["--load-secs", "0.3"]
        )
        for model in MIB
    }
    await units.reload()
    uap.write_registry(unit_registry(engines, MIB))
    (uap.home / "enforcement-timeouts.json").write_text(json.dumps(TIMEOUTS), encoding="utf-8")
    uap.env["UAP_PROXY_URL"] = proxy_url
    started = await units.start_unit(engines["alpha"].name, GUARD_S)
    assert started.ok, started

    notifications = spawn_template("notification_daemon", address, tmp_path)
    daemon: DaemonProcess | None = None
    bus: MessageBus | None = None
    client: PlacementClient | None = None
    try:
        daemon = await asyncio.to_thread(start_daemon, uap)
        bus, signals = await connect_signals(address)
        client = await PlacementClient.connect(address)
        world = Machine(daemon, notifications, client, signals, units, engines)
        await world.until_hot("alpha")
        yield world
        for extra in world.extra_clients:
            extra.disconnect()
    finally:
        if client is not None:
            client.disconnect()
        if bus is not None:
            bus.disconnect()
        code = await asyncio.to_thread(daemon.stop) if daemon is not None else 0
        notifications.stop()
        await runner.cleanup()
    assert code == 0, f"uapplaced exited {code}"


# --------------------------------------------------------------------------- the bubble


async def test_a_park_shows_one_bubble_and_a_second_client_updates_it(machine: Machine) -> None:
    first = await machine.park("beta", "client-1")
    bubble_id, shown = await machine.bubble_for(first)
    assert bubble_id == 1 and shown[1] == 0, "the first park opens a new bubble"
    app, _replaces, _icon, summary, body, actions, hints, _expire = shown
    assert app == "uapplace"
    assert summary == "beta requested by client-1"
    assert actions == [apply_key(first), "Stop alpha and load", f"dismiss:{first}", "Dismiss"]
    assert body.splitlines()[0] == (
        "Recommended: load beta/b1 on gpu0 — stops alpha: no clients, nothing in flight, "
        "frees 10,000 MiB"
    )
    assert "Approval signature: alpha/a1" in body
    assert hints["desktop-entry"] == "uapplace"

    second = await machine.park("beta", "client-2")
    assert second != first
    replaced_id, updated = await machine.bubble_for(second)
    assert replaced_id == bubble_id and updated[1] == bubble_id, "the same bubble is replaced"
    assert updated[3] == "beta requested by client-1 and client-2"
    assert updated[5][0] == apply_key(second)
    assert [c[1] for c in machine.notify_calls()] == [0, bubble_id]
    assert machine.notifications.calls("CloseNotification") == []


# --------------------------------------------------------------------------- apply


async def test_the_apply_button_runs_the_enforcement(machine: Machine) -> None:
    first = await machine.park("beta", "client-1")
    second = await machine.park("beta", "client-2")
    # Both parks are planned concurrently, so either may be the one the bubble shows
    # last: click the button of the bubble's final version, as an operator would.
    final = await machine.until(
        "the bubble naming both clients",
        lambda: next(
            (c for c in machine.notify_calls()[-1:] if "client-1" in c[3] and "client-2" in c[3]),
            None,
        ),
    )
    shown = next(p for p in (first, second) if apply_key(p) in final[5])
    bubble_id, _ = await machine.bubble_for(shown)

    machine.notifications.emit("ActionInvoked", "us", bubble_id, apply_key(shown))

    def both_resolved() -> dict[str, str] | None:
        outcomes = {
            placement_id: outcome for placement_id, outcome in machine.signals.of("Resolved")
        }
        return outcomes if {first, second} <= outcomes.keys() else None

    resolved = await machine.until("both parks resolved", both_resolved)
    assert resolved[first] == resolved[second] == "applied"
    # Resolved is signalled inside the resolve step, before that step's own signal.
    steps = await machine.until(
        "every step signalled",
        lambda: (
            machine.signals.steps() if len(machine.signals.steps()) >= len(APPLY_STEPS) else None
        ),
    )
    assert [s for s, _ok, _d in steps] == APPLY_STEPS
    assert all(ok for _s, ok, _d in steps), steps
    assert await machine.active("alpha") == "inactive"
    assert await machine.active("beta") == "active"

    forwarded = await machine.client.admit("beta", "client-1", "", 0)
    assert forwarded == {
        "decision": "forward",
        "target_id": f"gpu0:{machine.engines['beta'].endpoint}",
    }
    assert await machine.pending_ids() == []
    closed = await machine.until(
        "the bubble closed", lambda: machine.notifications.calls("CloseNotification")
    )
    assert closed == [[bubble_id]]


# --------------------------------------------------------------------------- drift


async def assert_refused_and_untouched(
    machine: Machine, placement_id: str, why: str, *, or_replanned_away: bool = False
) -> None:
    """The click ran revalidate, which refused; nothing else happened.

    ``or_replanned_away``: the change since the bubble also re-plans the entry, and when
    that re-plan lands before the click, the approved option no longer exists at all: the
    click is then refused before any run starts (no step), which is as safe."""
    prefix = f"notification action {apply_key(placement_id)} refused: "
    refusal = await machine.until(
        "the click's refusal in the log",
        lambda: next((line for line in machine.daemon.log().splitlines() if prefix in line), None),
    )
    replanned_away = f"InvalidArgument: placement {placement_id} has no options"
    if or_replanned_away and replanned_away in refusal:
        assert machine.signals.steps() == []
    else:
        assert f"{prefix}Drifted: {why}" in refusal, refusal
        _step, ok, detail = await machine.until(
            "the click's revalidate step",
            lambda: next((s for s in machine.signals.steps() if s[0] == "revalidate"), None),
        )
        assert not ok and why in detail, detail
        assert [s for s, _ok, _d in machine.signals.steps()] == ["revalidate"]
    assert placement_id in await machine.pending_ids()
    assert [pid for pid, _ in machine.signals.of("Resolved")] == []
    assert await machine.active("alpha") == "active"
    assert await machine.active("beta") == "inactive"
    assert machine.notifications.calls("CloseNotification") == []


async def test_a_hold_on_the_victim_since_the_bubble_makes_the_click_drift(
    machine: Machine, user_manager: ContainedUserManager
) -> None:
    placement_id = await machine.park("beta", "client-1")
    bubble_id, _ = await machine.bubble_for(placement_id)
    holder = await PlacementClient.connect(user_manager.bus_address)
    machine.extra_clients.append(holder)
    await holder.hold("alpha", "an agent is mid-task", "test-agent")

    machine.notifications.emit("ActionInvoked", "us", bubble_id, apply_key(placement_id))

    await assert_refused_and_untouched(
        machine,
        placement_id,
        "the approved option (displace beta/b1 on gpu0, stopping alpha/a1)",
        or_replanned_away=True,  # the hold re-plans the entry: its only option goes
    )


async def test_a_resident_started_by_hand_since_the_bubble_makes_the_click_drift(
    machine: Machine,
) -> None:
    placement_id = await machine.park("beta", "client-1")
    bubble_id, _ = await machine.bubble_for(placement_id)
    started = await machine.units.start_unit(machine.engines["gamma"].name, GUARD_S)
    assert started.ok, started
    await machine.until_hot("gamma")

    machine.notifications.emit("ActionInvoked", "us", bubble_id, apply_key(placement_id))

    await assert_refused_and_untouched(
        machine, placement_id, "victim set changed: approved [alpha/a1], now [alpha/a1, gamma/g1]"
    )
    assert await machine.active("gamma") == "active"
