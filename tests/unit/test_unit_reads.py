"""How :meth:`uapplace.io.units.UnitManager.state` asks systemd (issue 23).

A unit last seen running is read with ``GetAll`` of the ``Unit`` interface and one ``Get``
per ``Service`` property it uses (a ``GetAll`` there makes systemd read every cgroup
counter); any other unit with one ``GetAll`` of each (each call on an unloaded unit loads it
again). Both give the same :class:`~uapplace.io.units.UnitState`. The real manager's
answers: ``tests/systemd/test_units.py``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from uapplace.io.units import SERVICE_PROPERTIES, UnitManager, UnitState
from uapplace.io.unitworker import Call

UNIT = b"chat.service"
UNIT_PROPS = {
    b"ActiveState": b"active",
    b"SubState": b"running",
    b"LoadState": b"loaded",
    b"FragmentPath": b"/etc/systemd/user/chat.service",
}
SERVICE = {
    b"MainPID": 4242,
    b"ExecStart": [(b"/usr/bin/engine", [b"/usr/bin/engine", b"--port", b"8001"])],
    b"Result": b"success",
    b"ExecMainCode": 0,
    b"ExecMainStatus": 0,
    b"TimeoutStopUSec": 90_000_000,
    b"StandardOutput": b"journal",
    b"StandardError": b"inherit",
    b"MemoryCurrent": 123_456_789,  # one of the ~300 only GetAll returns
}


class Recorded:
    """Answers a read's calls as systemd would; keeps each request's methods."""

    def __init__(self) -> None:
        self.requests: list[list[bytes]] = []

    async def __call__(self, calls: list[Call]) -> list[Any]:
        self.requests.append([call[3] for call in calls])
        bodies: list[Any] = []
        for _destination, _path, _interface, method, _signature, args in calls:
            if method == b"LoadUnit":
                bodies.append(b"/org/freedesktop/systemd1/unit/chat_2eservice")
            elif method == b"GetAll":
                bodies.append(UNIT_PROPS if args[0].endswith(b"Unit") else SERVICE)
            else:
                bodies.append(SERVICE[args[1]])
        return bodies


async def read(
    signalled: str | None, monkeypatch: pytest.MonkeyPatch
) -> tuple[UnitState, Recorded]:
    manager = UnitManager("unix:path=/nonexistent", in_process=True)
    recorded = Recorded()
    monkeypatch.setattr(manager, "_run", recorded)
    manager._loop = asyncio.get_running_loop()  # as connect() leaves it
    if signalled is not None:
        manager._states[UNIT.decode()] = UnitState(signalled, "", "", 0, "")
    try:
        return await manager.state(UNIT.decode()), recorded
    finally:
        manager._loop = None
        manager.close()


@pytest.mark.parametrize("signalled", ["active", "activating", "deactivating", "reloading"])
async def test_a_unit_seen_running_is_read_property_by_property(
    signalled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, recorded = await read(signalled, monkeypatch)
    assert recorded.requests == [[b"LoadUnit", b"GetAll", *([b"Get"] * len(SERVICE_PROPERTIES))]]


@pytest.mark.parametrize("signalled", [None, "inactive", "failed"])
async def test_any_other_unit_is_read_with_one_getall_per_interface(
    signalled: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, recorded = await read(signalled, monkeypatch)
    assert recorded.requests == [[b"LoadUnit", b"GetAll", b"GetAll"]]


async def test_both_ways_read_the_same_state(monkeypatch: pytest.MonkeyPatch) -> None:
    by_name, _ = await read("active", monkeypatch)
    whole, _ = await read(None, monkeypatch)

    assert by_name == whole
    assert (by_name.main_pid, by_name.timeout_stop_s) == (4242, 90.0)
    assert by_name.exec_start == "/usr/bin/engine --port 8001"
    assert (by_name.log_facts.stdout, by_name.log_facts.stderr) == ("journal", "inherit")
