"""Authorization: polkit (python-dbusmock's polkitd on a private system bus) and the uid rule."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from pathlib import Path

import psutil
import pytest
from dbus_fast import Variant
from dbus_fast.aio import MessageBus

from tests.bus import dbusmock_fixtures
from tests.bus.dbusmock_fixtures import MockService
from uapplace.core import errors
from uapplace.daemon.authz import (
    Action,
    Authorizer,
    NotAuthorized,
    auto_policy_actions,
    polkit_subject,
    process_start_time,
    same_uid_decision,
)
from uapplace.files.paths import DEFAULT_SYSTEM_BUS_ADDRESS, Paths

session_bus = dbusmock_fixtures.session_bus
system_bus = dbusmock_fixtures.system_bus
polkitd = dbusmock_fixtures.polkitd

OWN_UID = os.getuid()


# --------------------------------------------------------------------------- pure


def test_same_uid_rule() -> None:
    same_uid_decision(1000, 1000, Action.APPLY)
    with pytest.raises(NotAuthorized) as denied:
        same_uid_decision(1001, 1000, Action.ALLOW_DISPLACE)
    assert denied.value.action is Action.ALLOW_DISPLACE
    assert str(denied.value).startswith("org.uap.placement.allow-displace: caller uid 1001 ")
    assert isinstance(denied.value, errors.NotAuthorized)
    assert denied.value.bus_name == "org.uap.Placement1.Error.NotAuthorized"


def test_start_time_is_field_22_even_with_odd_command_names(tmp_path: Path) -> None:
    fields = ["S", *[str(n) for n in range(4, 22)], "987654", "0"]
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(f"42 (a) b (c) {' '.join(fields)}\n")
    assert process_start_time(42, tmp_path) == 987654
    (tmp_path / "43").mkdir()
    (tmp_path / "43" / "stat").write_text("43 (short) S 1 2\n")
    with pytest.raises(ValueError, match="43/stat"):
        process_start_time(43, tmp_path)
    with pytest.raises(OSError):
        process_start_time(44, tmp_path)


def test_start_time_of_this_process_matches_psutil() -> None:
    ticks = process_start_time(os.getpid())
    started = psutil.boot_time() + ticks / os.sysconf("SC_CLK_TCK")
    assert started == pytest.approx(psutil.Process().create_time(), abs=0.05)


def test_polkit_subject_is_a_unix_process() -> None:
    kind, details = polkit_subject(12, 34, 1000)
    assert kind == "unix-process"
    assert details == {
        "pid": Variant("u", 12),
        "start-time": Variant("t", 34),
        "uid": Variant("i", 1000),
    }


def test_auto_policy_changes_map_to_actions() -> None:
    assert auto_policy_actions({}) == frozenset()
    assert auto_policy_actions({"enable": True}) == {Action.AUTO_ENABLE}
    assert auto_policy_actions({"disable": True}) == {Action.AUTO_RESTRICT}
    assert auto_policy_actions({"disallow_displace": ["a"], "disallow_unload": ["b"]}) == {
        Action.AUTO_RESTRICT
    }
    assert auto_policy_actions({"allow_displace": ["a"]}) == {Action.ALLOW_DISPLACE}
    assert auto_policy_actions({"allow_unload": ["a"]}) == {Action.ALLOW_UNLOAD}
    assert auto_policy_actions({"unload_idle_after_secs": 60}) == {Action.ALLOW_UNLOAD}
    assert auto_policy_actions({"enable": True, "allow_displace": ["a"]}) == {
        Action.AUTO_ENABLE,
        Action.ALLOW_DISPLACE,
    }


def test_paths_read_the_system_bus_address() -> None:
    assert Paths.from_env({"HOME": "/h"}).system_bus_address == DEFAULT_SYSTEM_BUS_ADDRESS
    env = {"HOME": "/h", "DBUS_SYSTEM_BUS_ADDRESS": "unix:path=/s"}
    assert Paths.from_env(env).system_bus_address == "unix:path=/s"
    env["UAPPLACE_SYSTEM_BUS_ADDRESS"] = "unix:path=/u"
    assert Paths.from_env(env).system_bus_address == "unix:path=/u"
    env["UAPPLACE_SYSTEM_BUS_ADDRESS"] = ""
    assert Paths.from_env(env).system_bus_address is None


# --------------------------------------------------------------------------- bus


@pytest.fixture
async def daemon_bus(session_bus: str) -> AsyncIterator[MessageBus]:
    """The connection the daemon would answer on."""
    bus = await MessageBus(bus_address=session_bus).connect()
    yield bus
    bus.disconnect()


@pytest.fixture
async def caller(session_bus: str) -> AsyncIterator[str]:
    """A client connection on the session bus; yields its unique name (the sender)."""
    bus = await MessageBus(bus_address=session_bus).connect()
    assert bus.unique_name is not None
    yield bus.unique_name
    bus.disconnect()


async def allowed(authorizer: Authorizer, sender: str) -> set[Action]:
    granted = set()
    for action in Action:
        try:
            await authorizer.check(sender, action)
        except NotAuthorized as denied:
            assert denied.action is action
            assert str(denied).startswith(f"{action.value}: ")
        else:
            granted.add(action)
    return granted


@pytest.mark.bus
async def test_polkit_grants_exactly_the_allowed_actions(
    polkitd: MockService, system_bus: str, daemon_bus: MessageBus, caller: str
) -> None:
    authorizer = Authorizer(daemon_bus, system_bus)
    try:
        for action in Action:
            polkitd.call("SetAllowed", [action.value])
            assert await allowed(authorizer, caller) == {action}
        polkitd.call("SetAllowed", [Action.APPLY.value, Action.ALLOW_DISPLACE.value])
        assert await allowed(authorizer, caller) == {Action.APPLY, Action.ALLOW_DISPLACE}
        await authorizer.check_all(caller, auto_policy_actions({"allow_displace": ["m"]}))
        with pytest.raises(NotAuthorized, match=re.escape(Action.AUTO_ENABLE.value)):
            changes = {"enable": True, "allow_displace": ["m"]}
            await authorizer.check_all(caller, auto_policy_actions(changes))
    finally:
        await authorizer.close()


@pytest.mark.bus
async def test_polkit_denying_everything_denies_every_action_by_id(
    polkitd: MockService, system_bus: str, daemon_bus: MessageBus, caller: str
) -> None:
    polkitd.call("SetAllowed", [])
    authorizer = Authorizer(daemon_bus, system_bus)
    try:
        for action in Action:
            with pytest.raises(
                NotAuthorized, match=re.escape(f"{action.value}: polkit denies it to uid")
            ):
                await authorizer.check(caller, action)
    finally:
        await authorizer.close()


@pytest.mark.bus
async def test_polkit_that_does_not_answer_is_a_no(
    polkitd: MockService, system_bus: str, daemon_bus: MessageBus, caller: str
) -> None:
    polkitd.call("SetAllowed", [Action.LOAD.value])
    polkitd.call("SimulateHang", True)
    authorizer = Authorizer(daemon_bus, system_bus, polkit_timeout=0.5)
    try:
        with pytest.raises(
            NotAuthorized,
            match=re.escape(
                "org.uap.placement.load: asking polkit failed: CheckAuthorization: no reply"
            ),
        ):
            await authorizer.check(caller, Action.LOAD)
    finally:
        polkitd.call("ReleaseHangingCalls")
        await authorizer.close()


@pytest.mark.bus
async def test_without_polkit_only_the_daemons_uid_may_mutate(
    system_bus: str, daemon_bus: MessageBus, caller: str
) -> None:
    missing_socket = "unix:path=/nonexistent/uapplace-test/system_bus_socket"
    for address in (system_bus, missing_socket, None):
        same = Authorizer(daemon_bus, address)
        other = Authorizer(daemon_bus, address, own_uid=OWN_UID + 1)
        try:
            assert await allowed(same, caller) == set(Action)
            assert await allowed(other, caller) == set()
            with pytest.raises(NotAuthorized, match=f"caller uid {OWN_UID} is not the daemon's"):
                await other.check(caller, Action.UNLOAD)
        finally:
            await same.close()
            await other.close()


@pytest.mark.bus
async def test_polkit_coming_and_going_switches_the_rule(
    system_bus: str,
    daemon_bus: MessageBus,
    caller: str,
    tmp_path: Path,
) -> None:
    authorizer = Authorizer(daemon_bus, system_bus, availability_ttl=0)
    try:
        await authorizer.check(caller, Action.MEASURE)
        with (
            dbusmock_fixtures.template_running("polkitd", system_bus, tmp_path),
            pytest.raises(NotAuthorized, match="polkit denies"),
        ):
            await authorizer.check(caller, Action.MEASURE)
        await authorizer.check(caller, Action.MEASURE)
    finally:
        await authorizer.close()


@pytest.mark.bus
async def test_an_unknown_sender_is_refused(daemon_bus: MessageBus) -> None:
    authorizer = Authorizer(daemon_bus, None)
    with pytest.raises(
        NotAuthorized, match=re.escape("org.uap.placement.apply: cannot identify caller :9.9")
    ):
        await authorizer.check(":9.9", Action.APPLY)


@pytest.mark.bus
async def test_check_polkit_has_no_same_uid_fallback(
    daemon_bus: MessageBus, caller: str, polkitd: MockService, system_bus: str
) -> None:
    """release-others acts on another connection's state: the uid rule cannot grant it."""
    without = Authorizer(daemon_bus, None)
    await without.check(caller, Action.HOLD)  # the same user: the uid rule says yes
    with pytest.raises(NotAuthorized, match="only polkit can grant this"):
        await without.check_polkit(caller, Action.RELEASE_OTHERS)
    with_polkit = Authorizer(daemon_bus, system_bus)
    try:
        polkitd.call("SetAllowed", [Action.RELEASE_OTHERS.value])
        await with_polkit.check_polkit(caller, Action.RELEASE_OTHERS)
        polkitd.call("SetAllowed", [])
        with pytest.raises(NotAuthorized, match="polkit denies it"):
            await with_polkit.check_polkit(caller, Action.RELEASE_OTHERS)
    finally:
        await with_polkit.close()
