"""``attach_enforcement`` wires the controller only once everything started.

If the first unit sync fails (here: reading a unit's state raises something
that is not a :class:`~uapplace.io.units.UnitError`, as a pystemd surprise would),
the controller must get neither an enforcer nor a measurer (the daemon then
answers ``Failed`` saying enforcement could not start), and the user-bus
connections the call opened must be closed again, seen from the bus itself.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.bus.conftest import make_env
from tests.systemd.conftest import GUARD_S
from uapplace.controller.controller import Controller
from uapplace.daemon.wiring import attach_enforcement
from uapplace.files.paths import Paths
from uapplace.files.timeouts import Timeouts
from uapplace.io.units import UnitManager, UnitState
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd


class SyncExploded(RuntimeError):
    pass


async def _bus_call(bus: MessageBus, member: str, signature: str = "", *args: object) -> object:
    reply = await bus.call(
        Message(
            destination="org.freedesktop.DBus",
            path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus",
            member=member,
            signature=signature,
            body=list(args),
        )
    )
    assert reply is not None and reply.message_type is MessageType.METHOD_RETURN, reply
    return reply.body[0]


async def connections_of_this_process(address: str) -> int:
    """Connections on the bus at ``address`` that belong to this process (this probe excluded)."""
    bus = await MessageBus(bus_address=address).connect()
    try:
        names = await _bus_call(bus, "ListNames")
        assert isinstance(names, list)
        count = 0
        for name in names:
            if not name.startswith(":") or name == bus.unique_name:
                continue
            reply = await bus.call(
                Message(
                    destination="org.freedesktop.DBus",
                    path="/org/freedesktop/DBus",
                    interface="org.freedesktop.DBus",
                    member="GetConnectionUnixProcessID",
                    signature="s",
                    body=[name],
                )
            )
            if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
                continue  # the connection closed between ListNames and this call
            count += reply.body[0] == os.getpid()
        return count
    finally:
        bus.disconnect()


@pytest.fixture
def controller(user_manager: ContainedUserManager, tmp_path: Path) -> Controller:
    """A controller (not started) whose registry names units ``uap-alpha`` … to sync."""
    return Controller.open(Paths.from_env(make_env(tmp_path, user_manager.bus_address).env))


@pytest.fixture
def failing_state(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every ``UnitManager.state`` read raises :class:`SyncExploded`; the units asked for."""
    asked: list[str] = []

    async def state(self: UnitManager, name: str) -> UnitState:
        asked.append(name)
        raise SyncExploded(f"simulated failure reading {name}")

    monkeypatch.setattr(UnitManager, "state", state)
    return asked


async def test_a_failed_first_sync_leaves_the_controller_unwired_and_the_bus_clean(
    user_manager: ContainedUserManager,
    controller: Controller,
    failing_state: list[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    address = user_manager.bus_address
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", address)  # where UnitManager() connects
    before = await connections_of_this_process(address)

    with pytest.raises(SyncExploded):
        await attach_enforcement(controller, controller.paths, None, timeouts=Timeouts())

    assert failing_state, "the first sync never read a unit: the failure was not exercised"
    assert not controller.enforcement.attached
    # UnitManager.close() hands the socket close to its worker thread: poll the bus.
    async with asyncio.timeout(GUARD_S):
        while True:
            if await connections_of_this_process(address) == before:
                break
            await asyncio.sleep(0.05)


async def test_a_unit_manager_passed_in_stays_connected_for_its_owner(
    user_manager: ContainedUserManager,
    units: UnitManager,
    controller: Controller,
    failing_state: list[str],
) -> None:
    with pytest.raises(SyncExploded):
        await attach_enforcement(controller, controller.paths, None, units=units)
    assert not controller.enforcement.attached
    await units.reload()  # still connected: the caller closes what it owns
