"""The real uapplaced on a private bus: Admit, signals, errors, properties, lifecycle."""

from __future__ import annotations

import asyncio
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.constants import MessageFlag

from tests.bus.conftest import (
    SEEDED_ENDPOINT,
    DaemonProcess,
    alpha_resident_daemon,
    busctl,
    call,
    call_json,
    make_env,
    spawn_daemon,
    start_daemon,
    wait_until,
)
from tests.bus.dbusmock_fixtures import private_bus
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.util import add_match
from uapplace.files.ledger import parse_ledger_text
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

pytestmark = pytest.mark.bus

PLACEMENT_ID = re.compile(r"^plc-[0-9a-f]{6}$")
SIGNAL_WAIT_S = 10.0


def pending_entry(address: str, placement_id: str) -> dict[str, Any] | None:
    (text,) = call_json(address, "ListPending")
    return next((e for e in json.loads(text)["pending"] if e["id"] == placement_id), None)


# --------------------------------------------------------------------------- Admit via busctl


def test_busctl_admit_parks_with_a_placement_id(daemon: DaemonProcess) -> None:
    address = daemon.uap.bus_address
    done = call(address, "Admit", "sssu", "alpha", "busctl-client", "sess-1", "0")
    assert done.returncode == 0, done.stderr
    signature, decision, target, placement_id, reason = done.stdout.split()
    assert (signature, decision, target, reason) == ("ssss", '"park"', '""', '"not_resident"')
    assert PLACEMENT_ID.match(placement_id.strip('"'))

    again = call_json(address, "Admit", "sssu", "alpha", "busctl-client", "sess-2", "4096")
    assert again == ["park", "", placement_id.strip('"'), "not_resident"]


def test_admit_reasons_follow_the_registry(daemon: DaemonProcess) -> None:
    address = daemon.uap.bus_address
    unknown = call_json(address, "Admit", "sssu", "no-such-model", "reasons", "", "0")
    unmeasured = call_json(address, "Admit", "sssu", "gamma", "reasons", "", "0")
    empty = call_json(address, "Admit", "sssu", "", "reasons", "", "0")
    assert unknown[0] == "park" and unknown[3] == "unknown_model"
    assert unmeasured[0] == "park" and unmeasured[3] == "no_measured_config"
    assert empty == ["park", "", "", "invalid_request"]


def test_a_park_gets_options_attached_after_the_answer(daemon: DaemonProcess) -> None:
    address = daemon.uap.bus_address
    _, _, placement_id, _ = call_json(address, "Admit", "sssu", "alpha", "options", "", "0")
    entry = wait_until(
        lambda: (e := pending_entry(address, placement_id)) and e["options"] and e,
        "options on the parked entry",
    )
    assert entry["recommended"] == 1
    first = entry["options"][0]
    assert (first["kind"], first["model"], first["config"], first["device"]) == (
        "load_alongside",
        "alpha",
        "alpha-q4",
        "gpu0",
    )


# --------------------------------------------------------------------------- signals


async def subscribe(address: str) -> tuple[MessageBus, asyncio.Queue[Message]]:
    bus = await MessageBus(bus_address=address).connect()
    queue: asyncio.Queue[Message] = asyncio.Queue()

    def on_message(message: Message) -> None:
        if message.message_type is MessageType.SIGNAL and message.path == OBJECT_PATH:
            queue.put_nowait(message)

    bus.add_message_handler(on_message)
    await add_match(bus, f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}'")
    return bus, queue


async def next_signal(queue: asyncio.Queue[Message], member: str) -> Message:
    async with asyncio.timeout(SIGNAL_WAIT_S):
        while True:
            message = await queue.get()
            if message.member == member:
                return message


async def test_parked_then_resolved_on_dismiss(
    daemon: DaemonProcess, client: PlacementClient
) -> None:
    bus, queue = await subscribe(daemon.uap.bus_address)
    try:
        answer = await client.admit("beta", "signal-watcher", "s", 0)
        parked = await next_signal(queue, "Parked")
        assert parked.interface == INTERFACE
        assert parked.body == [answer["placement_id"], "beta", "signal-watcher", "not_resident"]
        changed = await next_signal(queue, "PropertiesChanged")
        assert changed.body[0] == INTERFACE and "PendingCount" in changed.body[1]

        assert await client.dismiss(answer["placement_id"]) is True
        resolved = await next_signal(queue, "Resolved")
        assert resolved.body == [answer["placement_id"], "dismissed"]
    finally:
        bus.disconnect()


async def test_a_repeated_admit_parks_silently(
    daemon: DaemonProcess, client: PlacementClient
) -> None:
    first = await client.admit("beta", "repeat-client", "s", 0)
    bus, queue = await subscribe(daemon.uap.bus_address)
    try:
        second = await client.admit("beta", "repeat-client", "s", 0)
        other = await client.admit("beta", "repeat-client-2", "s", 0)
        parked = await next_signal(queue, "Parked")
        assert second["placement_id"] == first["placement_id"]
        assert parked.body[0] == other["placement_id"]  # the first Parked is the new one
    finally:
        bus.disconnect()


# --------------------------------------------------------------------------- errors


async def test_unknown_placement_id_is_not_found(client: PlacementClient) -> None:
    with pytest.raises(PlacementError) as caught:
        await client.dismiss("plc-00beef")
    assert caught.value.name == "org.uap.Placement1.Error.NotFound"
    assert caught.value.message == (
        "no pending placement plc-00beef (it may have expired or been resolved)"
    )


def test_busctl_shows_the_error_message(daemon: DaemonProcess) -> None:
    done = call(daemon.uap.bus_address, "Dismiss", "s", "plc-00beef")
    assert done.returncode != 0
    assert "no pending placement plc-00beef" in done.stderr


def test_wrong_signature_names_the_expected_arguments(daemon: DaemonProcess) -> None:
    done = call(daemon.uap.bus_address, "Admit", "ss", "alpha", "x")
    assert done.returncode != 0
    assert "Admit takes signature 'sssu'" in done.stderr
    assert "cells (u)" in done.stderr


async def test_wrong_signature_is_invalid_args(client: PlacementClient) -> None:
    with pytest.raises(PlacementError) as caught:
        await client.call("Preview", "ss", ["alpha", "many"])
    assert caught.value.name == "org.freedesktop.DBus.Error.InvalidArgs"


@pytest.mark.parametrize(
    ("member", "signature", "body", "error"),
    [
        ("Load", "sas", ["no-such-model", []], "UnknownModel"),
        ("Unload", "sas", ["no-such-model", []], "UnknownModel"),
        ("PreviewUnload", "s", ["no-such-model"], "UnknownModel"),
        ("PreviewUnload", "s", ["alpha"], "NotFound"),
        ("Load", "sas", ["alpha", ["no-slash"]], "InvalidArgument"),
        ("Unload", "sas", ["alpha", ["alpha/"]], "InvalidArgument"),
        ("Hold", "sss", ["no-such-model", "why", "app"], "UnknownModel"),
        ("Hold", "sss", ["alpha", "  ", "app"], "InvalidArgument"),
        ("Release", "u", [4000000], "NotFound"),
        ("Apply", "suas", ["plc-00beef", 1, []], "NotFound"),
        ("Apply", "suas", ["plc-00beef", 1, ["/alpha-q4"]], "InvalidArgument"),
        ("Apply", "suas", ["plc-00beef", 1, ["a/b", "a/b"]], "InvalidArgument"),
        ("SetAutoPolicy", "sb", ['{"bogus": 1}', False], "InvalidArgument"),
        ("SetAutoPolicy", "sb", ['{"allow_displace": ["beta"]}', False], "InvalidArgument"),
        ("Measure", "ss", ["alpha", "no-such-config"], "NotFound"),
    ],
)
async def test_bad_arguments_get_named_errors(
    client: PlacementClient, member: str, signature: str, body: list[Any], error: str
) -> None:
    with pytest.raises(PlacementError) as caught:
        await client.call(member, signature, body)
    assert caught.value.name == f"org.uap.Placement1.Error.{error}"
    assert caught.value.message


async def test_apply_checks_the_option_range(client: PlacementClient) -> None:
    answer = await client.admit("alpha", "range-check", "", 0)
    placement_id = answer["placement_id"]
    listed = await wait_for_options(client, placement_id)
    with pytest.raises(PlacementError) as caught:
        await client.apply(placement_id, len(listed["options"]) + 1, [])
    assert caught.value.short == "InvalidArgument"
    assert "out of range" in caught.value.message


async def wait_for_options(client: PlacementClient, placement_id: str) -> dict[str, Any]:
    async with asyncio.timeout(SIGNAL_WAIT_S):
        while True:
            listed = await client.list_pending()
            entry = next((e for e in listed["pending"] if e["id"] == placement_id), None)
            if entry is not None and entry["options"]:
                return dict(entry)
            await asyncio.sleep(0.05)


NO_MANAGER = "is not available: it needs the systemd user manager"


@pytest.mark.parametrize(
    ("member", "signature", "body"),
    [
        ("Load", "sas", ["alpha", []]),
        ("Unload", "sas", ["alpha", ["alpha/alpha-q4"]]),
        ("Measure", "ss", ["alpha", "alpha-q4"]),
    ],
)
async def test_enforcement_without_a_user_manager_says_so(
    client: PlacementClient, member: str, signature: str, body: list[Any]
) -> None:
    with pytest.raises(PlacementError) as caught:
        await client.call(member, signature, body)
    assert caught.value.name == "org.uap.Placement1.Error.Unavailable"
    assert caught.value.message.startswith(f"{member} {NO_MANAGER}")
    assert "org.freedesktop.systemd1" in caught.value.message


async def test_apply_on_a_live_entry_without_a_user_manager_says_so(
    client: PlacementClient,
) -> None:
    answer = await client.admit("alpha", "apply-no-manager", "", 0)
    await wait_for_options(client, answer["placement_id"])
    with pytest.raises(PlacementError) as caught:
        await client.apply(answer["placement_id"], 1, [])
    assert caught.value.short == "Unavailable"
    assert caught.value.message.startswith(f"Apply {NO_MANAGER}")


async def test_auto_policy_round_trip(daemon: DaemonProcess, client: PlacementClient) -> None:
    before = await client.get_auto_policy()
    assert before["enabled"] is False
    enabled = await client.set_auto_policy({"enable": True}, False)
    assert enabled["enabled"] is True
    stored = json.loads((daemon.uap.home / "placement-auto.json").read_text())
    assert stored["enabled"] is True
    assert (await client.set_auto_policy({"disable": True}, False))["enabled"] is False


async def test_write_units_writes_conflict_dropins(
    daemon: DaemonProcess, client: PlacementClient
) -> None:
    unit_dir = Path(daemon.uap.env["XDG_CONFIG_HOME"]) / "systemd" / "user"
    written = await client.write_units()
    assert sorted(Path(p).parent.name for p in written) == [
        "uap-alpha.service.d",
        "uap-beta.service.d",
        "uap-gamma.service.d",
    ]
    alpha = (unit_dir / "uap-alpha.service.d" / Path(written[0]).name).read_text()
    assert "Conflicts=" in alpha and "uap-beta.service" in alpha
    assert await client.write_units() == []  # unchanged files are not rewritten


# --------------------------------------------------------------------------- reads


def test_properties_read_with_busctl(daemon: DaemonProcess) -> None:
    address = daemon.uap.bus_address
    call_json(address, "Admit", "sssu", "beta", "property-reader", "", "0")
    done = busctl(
        address,
        "get-property",
        BUS_NAME,
        OBJECT_PATH,
        INTERFACE,
        "Version",
        "PendingCount",
        "Residents",
    )
    assert done.returncode == 0, done.stderr
    version, pending, residents = done.stdout.splitlines()
    assert version == 's "0.1.0"'
    kind, count = pending.split()
    assert kind == "u" and int(count) >= 1
    assert residents == "a(ssss) 0"


async def test_get_state_and_preview(client: PlacementClient) -> None:
    state = await client.get_state()
    assert state["daemon"] is True
    assert state["devices"]["gpu0"]["source"] == "sim"
    assert state["devices"]["gpu0"]["reserved_mib"] == 1024
    assert state["residents"] == []

    plan = await client.preview("alpha-chat", 0)
    assert plan["reason"] == "ok"
    assert plan["options"][0]["kind"] == "load_alongside"
    assert (await client.preview("no-such-model", 0))["reason"] == "not_in_registry"
    assert (await client.preview("gamma", 0))["reason"] == "no_measured_config"


async def test_validate_reports_findings_and_provenance(client: PlacementClient) -> None:
    report = await client.validate()
    assert report["ok"] is True
    assert report["errors"] == 0
    assert {"kind", "entry", "field", "source", "file"} <= set(report["provenance"][0])


# --------------------------------------------------------------------------- holds


async def test_hold_shows_in_state_until_released(client: PlacementClient) -> None:
    cookie = await client.hold("alpha-chat", "benchmark running", "bench-app")
    held = [h for h in (await client.get_state())["holds"] if h["cookie"] == cookie]
    assert held and held[0]["model"] == "alpha" and held[0]["reason"] == "benchmark running"
    await client.release(cookie)
    assert all(h["cookie"] != cookie for h in (await client.get_state())["holds"])
    with pytest.raises(PlacementError) as caught:
        await client.release(cookie)
    assert caught.value.short == "NotFound"


async def test_only_the_holding_connection_may_release_its_hold(
    daemon: DaemonProcess, client: PlacementClient
) -> None:
    """(h) A second connection's Release is NotAuthorized and the hold stays.

    Without polkit (this bus has none) release-others is never granted: every
    client of a user bus is the same user, so the uid rule cannot tell them apart."""
    holder = await PlacementClient.connect(daemon.uap.bus_address)
    try:
        cookie = await holder.hold("alpha", "benchmark running", "bench-app")
        with pytest.raises(PlacementError) as refused:
            await client.release(cookie)
        assert refused.value.short == "NotAuthorized"
        assert f"hold {cookie} on alpha belongs to bus connection" in refused.value.message
        assert "(bench-app)" in refused.value.message
        held = [h for h in (await client.get_state())["holds"] if h["cookie"] == cookie]
        assert held and held[0]["reason"] == "benchmark running", "the refused Release ended it"
        await holder.release(cookie)  # its own connection may
        assert all(h["cookie"] != cookie for h in (await client.get_state())["holds"])
    finally:
        holder.disconnect()


async def test_hold_ends_when_the_holder_disconnects(
    daemon: DaemonProcess, client: PlacementClient
) -> None:
    holder = await PlacementClient.connect(daemon.uap.bus_address)
    cookie = await holder.hold("beta", "short-lived", "holder-app")
    assert any(h["cookie"] == cookie for h in (await client.get_state())["holds"])
    holder.disconnect()
    async with asyncio.timeout(SIGNAL_WAIT_S):
        while True:
            holds = (await client.get_state())["holds"]
            if all(h["cookie"] != cookie for h in holds):
                break
            await asyncio.sleep(0.05)


# ------------------------------------------------------------------ lifecycle (own daemons)


@pytest.fixture
def exclusive_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bus of the test's own, for a daemon of the test's own (one owner per bus)."""
    with private_bus("session", tmp_path_factory.mktemp("own-bus")) as address:
        yield address


def test_a_seeded_resident_forwards_and_its_use_is_recorded(
    tmp_path: Path, exclusive_bus: str
) -> None:
    with alpha_resident_daemon(tmp_path, exclusive_bus) as daemon:
        forward = call_json(exclusive_bus, "Admit", "sssu", "alpha", "fwd", "s", "0")
        advertised = call_json(exclusive_bus, "Admit", "sssu", "alpha-chat", "fwd", "s", "0")
        residents = busctl(
            exclusive_bus, "get-property", BUS_NAME, OBJECT_PATH, INTERFACE, "Residents"
        )
    assert forward == ["forward", f"gpu0:{SEEDED_ENDPOINT}", "", ""]
    assert advertised == forward
    assert residents.stdout.strip() == 'a(ssss) 1 "alpha" "alpha-q4" "gpu0" "hot"'
    ledger = daemon.uap.read_ledger()
    assert "alpha" in ledger["usage"]
    assert ledger["residents"][0]["model"] == "alpha"


def test_sigterm_leaves_a_valid_ledger_with_the_pending_entries(
    tmp_path: Path, exclusive_bus: str
) -> None:
    uap = make_env(tmp_path, exclusive_bus)
    daemon = start_daemon(uap)
    parked = call_json(exclusive_bus, "Admit", "sssu", "beta", "before-stop", "s", "0")
    assert daemon.stop() == 0
    doc = parse_ledger_text(uap.ledger.read_bytes())
    assert [p.id for p in doc.pending] == [parked[2]]
    assert "stopped" in daemon.log()

    again = start_daemon(uap)
    try:
        (text,) = call_json(exclusive_bus, "ListPending")
        repeat = call_json(exclusive_bus, "Admit", "sssu", "beta", "before-stop", "s", "0")
    finally:
        assert again.stop() == 0
    assert [e["id"] for e in json.loads(text)["pending"]] == [parked[2]]
    assert repeat[2] == parked[2]  # dedupe survives the restart


def test_a_second_instance_is_refused(tmp_path: Path, exclusive_bus: str) -> None:
    uap = make_env(tmp_path, exclusive_bus)
    first = start_daemon(uap)
    try:
        second = spawn_daemon(uap, "second")
        code = second.process.wait(timeout=30)
    finally:
        assert first.stop() == 0
    assert code == 1
    assert f"another uapplaced owns org.uap.Placement1 on {exclusive_bus}" in second.log()


def test_an_invalid_repo_registry_is_exit_2_naming_file_and_path(
    tmp_path: Path, exclusive_bus: str
) -> None:
    uap = make_env(tmp_path, exclusive_bus)
    broken = json.loads(uap.registry.read_text())
    broken["devices"]["gpu0"]["total_mib"] = "lots"
    uap.registry.write_text(json.dumps(broken))
    daemon = spawn_daemon(uap)
    assert daemon.process.wait(timeout=30) == 2
    log = daemon.log()
    assert str(uap.registry) in log
    assert "$.devices.gpu0.total_mib" in log


def test_a_corrupt_registry_on_reload_keeps_the_last_good_one(
    tmp_path: Path, exclusive_bus: str
) -> None:
    uap = make_env(tmp_path, exclusive_bus)
    daemon = start_daemon(uap)
    good = uap.registry.read_text()
    try:
        uap.registry.write_text("{ not json")
        (text,) = call_json(exclusive_bus, "Validate")
        report = json.loads(text)
        still = call_json(exclusive_bus, "Admit", "sssu", "alpha", "after-reload", "", "0")
        daemon.signal(signal.SIGHUP)
        wait_until(lambda: "registry reload failed" in daemon.log(), "SIGHUP reload logged")
        uap.registry.write_text(good)
        (fixed,) = call_json(exclusive_bus, "Validate")
    finally:
        assert daemon.stop() == 0
    assert report["ok"] is False
    error = report["findings"][0]
    assert error["severity"] == "error" and error["file"] == str(uap.registry)
    assert "invalid JSON" in error["message"]
    assert "keeps running on the registry it loaded before" in error["message"]
    assert still[3] == "not_resident"  # alpha is still known: the old registry runs
    assert json.loads(fixed)["ok"] is True


def test_a_corrupt_ledger_is_moved_aside_and_the_daemon_runs(
    tmp_path: Path, exclusive_bus: str
) -> None:
    uap = make_env(tmp_path, exclusive_bus)
    uap.home.mkdir(parents=True, exist_ok=True)
    uap.ledger.write_text("{ this is not a ledger")
    daemon = start_daemon(uap)
    try:
        parked = call_json(exclusive_bus, "Admit", "sssu", "alpha", "after-corrupt", "", "0")
    finally:
        assert daemon.stop() == 0
    assert parked[0] == "park"
    assert list(uap.home.glob("placement.json.corrupt-*"))
    assert "was corrupt" in daemon.log()
    assert parse_ledger_text(uap.ledger.read_bytes()).pending[0].id == parked[2]


# --------------------------------------------------------------------------- Admit's first handler


async def raw_call(address: str, message: Message) -> Message | None:
    """Send ``message`` on a fresh connection; its reply (``None`` when none was asked)."""
    bus = await MessageBus(bus_address=address).connect()
    try:
        if message.flags & MessageFlag.NO_REPLY_EXPECTED:
            await bus.send(message)
            return None
        async with asyncio.timeout(SIGNAL_WAIT_S):
            return await bus.call(message)
    finally:
        bus.disconnect()


def admit_message(path: str = OBJECT_PATH, flags: MessageFlag = MessageFlag.NONE) -> Message:
    return Message(
        destination=BUS_NAME,
        path=path,
        interface=INTERFACE,
        member="Admit",
        signature="sssu",
        body=["beta", "first-handler", "", 0],
        flags=flags,
    )


async def test_admit_at_another_object_path_is_not_answered(daemon: DaemonProcess) -> None:
    # Admit is answered before dbus-fast's own dispatch only on the object itself.
    reply = await raw_call(daemon.uap.bus_address, admit_message(path="/org/uap/Other"))
    assert reply is not None and reply.message_type is MessageType.ERROR
    # dbus-fast's own answer for a method no object at that path has
    assert reply.error_name == "org.freedesktop.DBus.Error.UnknownMethod"


async def test_an_admit_that_asks_no_reply_still_parks(
    daemon: DaemonProcess, client: PlacementClient
) -> None:
    bus, queue = await subscribe(daemon.uap.bus_address)
    try:
        flags = MessageFlag.NO_REPLY_EXPECTED
        assert await raw_call(daemon.uap.bus_address, admit_message(flags=flags)) is None
        parked = await next_signal(queue, "Parked")
        assert parked.body[1:3] == ["beta", "first-handler"]
        assert pending_entry(daemon.uap.bus_address, parked.body[0]) is not None
    finally:
        bus.disconnect()
