"""polkit decides every write of the real ``uapplaced`` (power-profiles-daemon style).

The daemon runs on a private session bus with ``UAPPLACE_SYSTEM_BUS_ADDRESS``
pointing at a private system bus where python-dbusmock's ``polkitd`` answers
``CheckAuthorization``. ``SetAllowed([...])`` on the mock is the operator's
polkit configuration: each write must succeed exactly when its own action id is
allowed, and fail with ``org.uap.Placement1.Error.NotAuthorized`` naming that id
otherwise. Reads and ``Admit`` are never gated.

The test process is the caller (the daemon asks polkit about its PID), through
:class:`~uapplace.bus.client.PlacementClient`; properties are read with ``busctl``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.bus.conftest import DaemonProcess, busctl, make_env, start_daemon
from tests.bus.dbusmock_fixtures import MockService, private_bus, spawn_template
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.daemon.authz import Action
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

pytestmark = pytest.mark.bus

NOT_AUTHORIZED = f"{INTERFACE}.Error.NotAuthorized"
EVERY_ACTION = [action.value for action in Action]


@dataclass
class PolkitWorld:
    daemon: DaemonProcess
    polkitd: MockService

    @property
    def address(self) -> str:
        return self.daemon.uap.bus_address

    def allow(self, *actions: str) -> None:
        """What polkit says yes to from now on (nothing else)."""
        self.polkitd.call("SetAllowed", list(actions))


@pytest.fixture(scope="module")
def system_bus_address(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with private_bus("system", tmp_path_factory.mktemp("system-bus")) as address:
        yield address


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory, bus_address: str, system_bus_address: str
) -> Iterator[PolkitWorld]:
    # polkit is up before the daemon's first check, and stays up for the whole module:
    # the daemon's "polkit is there" answer is cached, and once polkit is seen every
    # failure to get its yes is a no.
    polkitd = spawn_template("polkitd", system_bus_address, tmp_path_factory.mktemp("polkitd"))
    try:
        uap = make_env(tmp_path_factory.mktemp("uap"), bus_address)
        uap.env["UAPPLACE_SYSTEM_BUS_ADDRESS"] = system_bus_address
        daemon = start_daemon(uap)
        try:
            yield PolkitWorld(daemon, polkitd)
        finally:
            daemon.stop()
    finally:
        polkitd.stop()


@pytest.fixture
async def client(world: PolkitWorld) -> AsyncIterator[PlacementClient]:
    world.allow()
    connected = await PlacementClient.connect(world.address)
    try:
        yield connected
    finally:
        connected.disconnect()


async def park(client: PlacementClient, caller: str) -> str:
    decision = await client.admit("beta", caller, "", 0)
    assert decision["decision"] == "park", decision
    return decision["placement_id"]


# --------------------------------------------------------------------------- the writes


Write = Callable[[PlacementClient], Awaitable[Any]]


@dataclass(frozen=True)
class Gated:
    """One write and the polkit actions it needs."""

    name: str
    call: Write
    actions: tuple[str, ...]


def _auto(changes: dict[str, Any], consent: bool = False) -> Write:
    def call(client: PlacementClient) -> Awaitable[Any]:
        return client.set_auto_policy(changes, consent)

    return call


GATED = [
    Gated("Dismiss", lambda c: c.dismiss("plc-000000"), (Action.DISMISS,)),
    Gated("Apply", lambda c: c.apply("plc-000000", 1, []), (Action.APPLY,)),
    Gated("Load", lambda c: c.load("alpha", []), (Action.LOAD,)),
    Gated("Unload", lambda c: c.unload("alpha", ["alpha/alpha-q4"]), (Action.UNLOAD,)),
    Gated("WriteUnits", lambda c: c.write_units(), (Action.WRITE_UNITS,)),
    Gated("Measure", lambda c: c.measure("alpha", "alpha-q4"), (Action.MEASURE,)),
    # A switch like Unload (issue 21): Unload's action, not the routine measure one.
    Gated(
        "MeasureEnvelope",
        lambda c: c.measure_envelope("alpha", "alpha-q4", ["alpha/alpha-q4"]),
        (Action.UNLOAD,),
    ),
    Gated("Hold", lambda c: c.hold("alpha", "polkit test", "test"), (Action.HOLD,)),
    Gated("Release", lambda c: c.release(4_000_000), (Action.HOLD,)),
    Gated("SetAutoPolicy enable", _auto({"enable": True}), (Action.AUTO_ENABLE,)),
    Gated("SetAutoPolicy disable", _auto({"disable": True}), (Action.AUTO_RESTRICT,)),
    Gated(
        "SetAutoPolicy disallow_unload",
        _auto({"disallow_unload": ["alpha"]}),
        (Action.AUTO_RESTRICT,),
    ),
    Gated(
        "SetAutoPolicy allow_displace",
        _auto({"allow_displace": ["alpha"]}, consent=True),
        (Action.ALLOW_DISPLACE,),
    ),
    Gated(
        "SetAutoPolicy allow_unload",
        _auto({"allow_unload": ["alpha"]}, consent=True),
        (Action.ALLOW_UNLOAD,),
    ),
    Gated(
        "SetAutoPolicy unload_idle_after_secs",
        _auto({"unload_idle_after_secs": 900}),
        (Action.ALLOW_UNLOAD,),
    ),
    Gated(
        "SetAutoPolicy enable + allow_displace",
        _auto({"enable": True, "allow_displace": ["alpha"]}, consent=True),
        (Action.AUTO_ENABLE, Action.ALLOW_DISPLACE),
    ),
]


async def refusal(write: Write, client: PlacementClient) -> PlacementError | None:
    """The ``NotAuthorized`` the write got, or ``None`` when polkit let it through.

    Any other error is the verb's own answer after the authorization passed
    (``NotFound`` for a made-up id, ``Failed`` where no user manager runs).
    """
    try:
        await write(client)
    except PlacementError as err:
        return err if err.name == NOT_AUTHORIZED else None
    return None


@pytest.mark.parametrize("gated", GATED, ids=[g.name for g in GATED])
async def test_each_write_needs_exactly_its_own_actions(
    world: PolkitWorld, client: PlacementClient, gated: Gated
) -> None:
    world.allow(*gated.actions)
    assert await refusal(gated.call, client) is None

    for missing in gated.actions:
        world.allow(*(a for a in EVERY_ACTION if a != missing))
        denied = await refusal(gated.call, client)
        assert denied is not None, f"{gated.name} went through without {missing}"
        assert denied.message.startswith(f"{missing}: polkit denies it"), denied.message


async def test_with_nothing_allowed_every_write_is_refused_naming_its_action(
    world: PolkitWorld, client: PlacementClient
) -> None:
    placement_id = await park(client, "polkit-nothing")
    world.allow()
    writes: list[tuple[tuple[str, ...], Write]] = [(g.actions, g.call) for g in GATED]
    writes += [
        ((Action.DISMISS,), lambda c: c.dismiss(placement_id)),
        (
            (Action.APPLY,),
            lambda c: c.apply(placement_id, 1, ["alpha/alpha-q4"]),
        ),
    ]
    for actions, write in writes:
        denied = await refusal(write, client)
        assert denied is not None, f"a write needing {', '.join(actions)} went through"
        named = denied.message.split(": ", 1)[0]
        assert named in actions, denied.message

    pending = await client.list_pending()
    assert placement_id in [e["id"] for e in pending["pending"]], "a refused Dismiss dismissed"
    assert (await client.get_state())["holds"] == [], "a refused Hold took a hold"


async def test_reads_and_admit_need_no_authorization(
    world: PolkitWorld, client: PlacementClient
) -> None:
    world.allow()
    placement_id = await park(client, "polkit-reads")
    assert (await client.admit("beta", "polkit-reads", "", 0))["placement_id"] == placement_id

    state = await client.get_state()
    assert state["daemon"] is True
    pending = await client.list_pending()
    assert placement_id in [e["id"] for e in pending["pending"]]
    assert (await client.preview("beta", 0))["model"] == "beta"
    assert "findings" in await client.validate()
    assert isinstance(await client.get_auto_policy(), dict)
    # An empty SetAutoPolicy body is a status read: it needs no action either.
    assert isinstance(await client.set_auto_policy({}, False), dict)

    for prop, prefix in (("Version", "s "), ("PendingCount", "u "), ("Residents", "a(ssss) ")):
        done = busctl(world.address, "get-property", BUS_NAME, OBJECT_PATH, INTERFACE, prop)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(prefix), done.stdout
    assert int(busctl(
        world.address, "get-property", BUS_NAME, OBJECT_PATH, INTERFACE, "PendingCount"
    ).stdout.split()[1]) >= 1  # fmt: skip


async def test_allowing_dismiss_grants_dismiss_and_nothing_else(
    world: PolkitWorld, client: PlacementClient
) -> None:
    placement_id = await park(client, "polkit-dismiss")
    world.allow(Action.DISMISS)

    with pytest.raises(PlacementError) as load:
        await client.load("alpha", [])
    assert load.value.name == NOT_AUTHORIZED
    assert load.value.message.startswith(f"{Action.LOAD.value}: polkit denies it to uid ")

    assert await client.dismiss(placement_id) is True
    pending = await client.list_pending()
    assert placement_id not in [e["id"] for e in pending["pending"]]


async def test_the_granted_writes_really_happen(
    world: PolkitWorld, client: PlacementClient
) -> None:
    """Not only "not refused": with the action allowed, the write takes effect."""
    world.allow(Action.HOLD, Action.AUTO_ENABLE, Action.WRITE_UNITS)
    cookie = await client.hold("alpha", "polkit granted", "polkit-test")
    holds = (await client.get_state())["holds"]
    assert [(h["cookie"], h["model"]) for h in holds] == [(cookie, "alpha")]
    await client.release(cookie)
    assert (await client.get_state())["holds"] == []

    assert (await client.set_auto_policy({"enable": True}, False))["enabled"] is True
    assert (await client.get_auto_policy())["enabled"] is True

    unit_dir = Path(world.daemon.uap.env["XDG_CONFIG_HOME"]) / "systemd" / "user"
    for earlier in unit_dir.glob("*.service.d/50-uapplace-conflicts.conf"):
        earlier.unlink()  # an earlier test's grant wrote them; unchanged files are not listed
    written = [Path(p) for p in await client.write_units()]
    assert written, "WriteUnits wrote nothing"
    assert all(p.parent.parent == unit_dir and p.is_file() for p in written), written


async def test_releasing_another_connections_hold_needs_release_others(
    world: PolkitWorld, client: PlacementClient
) -> None:
    """HOLD lets a connection release its own hold only; another's needs release-others."""
    world.allow(Action.HOLD)
    holder = await PlacementClient.connect(world.address)
    try:
        cookie = await holder.hold("alpha", "pinned by another app", "holder-app")
        with pytest.raises(PlacementError) as refused:
            await client.release(cookie)
        assert refused.value.name == NOT_AUTHORIZED
        assert "holder-app" in refused.value.message
        assert Action.RELEASE_OTHERS.value in refused.value.message
        holds = (await client.get_state())["holds"]
        assert [h["cookie"] for h in holds] == [cookie], "a refused Release ended the hold"

        world.allow(Action.HOLD, Action.RELEASE_OTHERS)
        await client.release(cookie)
        assert (await client.get_state())["holds"] == []
    finally:
        holder.disconnect()
