"""docs/http-contract.md §1 and §4 against the real ``uapplace-shim`` before the real ``uapplaced``.

One private bus and one daemon per module (``tests/bus/conftest.py``), with a
ledger seeded with one resident (``alpha`` on ``gpu0``), and the shim as its own
process (``tests/bus/shim_fixtures.py``). Requests go over plain HTTP/1.1 and
the answers are checked byte for byte where the proxy reads bytes.

Each test uses its own client names so pending entries never collide.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.bus import shim_fixtures
from tests.bus.conftest import (
    SEEDED_ENDPOINT,
    DaemonProcess,
    UapEnv,
    call_json,
    make_env,
    start_daemon,
    wait_published,
    wait_until,
)
from tests.bus.dbusmock_fixtures import private_bus
from tests.bus.shim_fixtures import (
    SEEDED_LEDGER,
    Reply,
    ShimProcess,
    request,
    start_shim,
)
from tests.worlds.exposition import sample

pytestmark = pytest.mark.bus

ADMIT = "/api/placement/admit"
FORWARD_ALPHA = f'{{"decision":"forward","target_id":"gpu0:{SEEDED_ENDPOINT}"}}'.encode()
PARK_BYTES = re.compile(
    rb'^\{"decision":"park","placement_id":"(plc-[0-9a-f]{6})","reason":"([a-z_]+)"\}$'
)
TARGET_ID = re.compile(r"^[A-Za-z0-9_.\-]+:\S+$")


daemon = shim_fixtures.daemon
shim = shim_fixtures.shim


def admit(shim: ShimProcess, body: Any) -> Reply:
    return request(shim.base_url, "POST", ADMIT, body)


def parked(reply: Reply) -> tuple[str, str]:
    assert reply.status == 200, reply.raw
    found = PARK_BYTES.match(reply.raw)
    assert found, reply.raw
    return found.group(1).decode(), found.group(2).decode()


def pending_entry(shim: ShimProcess, placement_id: str) -> dict[str, Any]:
    entries = request(shim.base_url, "GET", "/api/placement/pending").json()["pending"]
    matching = [e for e in entries if e["id"] == placement_id]
    assert len(matching) == 1, entries
    entry: dict[str, Any] = matching[0]
    return entry


# --------------------------------------------------------------------------- §1 admit


@pytest.mark.parametrize("model_id", ["alpha", "alpha-chat", "alpha-q4"])
def test_admit_forwards_a_resident_by_model_advertised_id_or_config(
    shim: ShimProcess, model_id: str
) -> None:
    reply = admit(shim, {"model_id": model_id, "client": "fwd-client", "session": None})
    assert reply.status == 200
    assert reply.headers["content-type"] == "application/json; charset=utf-8"
    assert reply.raw == FORWARD_ALPHA
    assert TARGET_ID.match(reply.json()["target_id"])


@pytest.mark.parametrize(
    ("model_id", "reason"),
    [("beta", "not_resident"), ("gamma", "no_measured_config"), ("no-such-model", "unknown_model")],
)
def test_admit_parks_with_the_machine_computed_reason(
    shim: ShimProcess, model_id: str, reason: str
) -> None:
    reply = admit(shim, {"model_id": model_id, "client": f"park-{model_id}", "session": "s1"})
    placement_id, got_reason = parked(reply)
    assert got_reason == reason
    assert list(reply.json()) == ["decision", "placement_id", "reason"]
    entry = pending_entry(shim, placement_id)
    assert (entry["requested_model"], entry["client"], entry["reason"]) == (
        model_id,
        f"park-{model_id}",
        reason,
    )


def test_a_second_admit_for_the_same_client_and_model_gets_the_same_id(shim: ShimProcess) -> None:
    first, _ = parked(admit(shim, {"model_id": "beta", "client": "dedupe-a", "session": "1"}))
    again, _ = parked(admit(shim, {"model_id": "beta", "client": "dedupe-a", "session": "2"}))
    other, _ = parked(admit(shim, {"model_id": "beta", "client": "dedupe-b", "session": "1"}))
    assert again == first
    assert other != first


def test_client_and_session_are_cut_to_128_characters(shim: ShimProcess) -> None:
    client = "long-client-" + "c" * 300
    session = "s" * 300
    placement_id, _ = parked(
        admit(shim, {"model_id": "beta", "client": client, "session": session})
    )
    entry = pending_entry(shim, placement_id)
    assert entry["client"] == client[:128]
    assert entry["session"] == session[:128]


@pytest.mark.parametrize(
    ("cells", "stored"),
    [(40000, 40000), (1, 1), (0, 32768), (-5, 32768), (True, 32768), (1.5, 32768), ("9", 32768)],
)
def test_cells_are_used_only_when_a_positive_integer(
    shim: ShimProcess, cells: Any, stored: int
) -> None:
    client = f"cells-{json.dumps(cells)}"
    placement_id, _ = parked(admit(shim, {"model_id": "beta", "client": client, "cells": cells}))
    assert pending_entry(shim, placement_id)["cells"] == stored


def test_missing_cells_and_missing_client_are_accepted(shim: ShimProcess) -> None:
    reply = admit(shim, {"model_id": "alpha"})
    assert (reply.status, reply.raw) == (200, FORWARD_ALPHA)


@pytest.mark.parametrize("body", [{}, {"model_id": ""}, {"client": "c", "session": "s"}])
def test_missing_model_id_is_400(shim: ShimProcess, body: dict[str, Any]) -> None:
    reply = admit(shim, body)
    assert (reply.status, reply.raw) == (400, b'{"error":"missing model_id"}')


def test_oversized_admit_is_413(shim: ShimProcess) -> None:
    reply = admit(shim, {"model_id": "alpha", "client": "x" * 11000})
    assert (reply.status, reply.raw) == (413, b'{"error":"request body over 10240 bytes"}')


def test_the_park_is_announced_on_the_bus_and_counted(shim: ShimProcess, uap_env: UapEnv) -> None:
    placement_id, _ = parked(admit(shim, {"model_id": "beta", "client": "metrics-client"}))
    state = call_json(uap_env.bus_address, "GetState")
    ledger_ids = [p["id"] for p in json.loads(state[0])["pending"]]
    assert placement_id in ledger_ids
    metrics = request(shim.base_url, "GET", "/metrics").raw.decode()
    shim_parks = "uapplace_shim_admits_total"
    counted = sample(metrics, shim_parks, decision="park", reason="not_resident")
    assert counted is not None and counted >= 1
    assert sample(metrics, "uapplace_daemon_up") == 1
    assert sample(metrics, "uapplace_residents", state="hot") == 1
    pending_now = len(request(shim.base_url, "GET", "/api/placement/pending").json()["pending"])
    assert sample(metrics, "uapplace_pending") == pending_now
    assert sample(metrics, "uapplace_shim_bus_call_duration_seconds_count", method="Admit")


# --------------------------------------------------------------------------- §4 reads


def test_state_is_the_daemons_document(shim: ShimProcess, uap_env: UapEnv) -> None:
    reply = request(shim.base_url, "GET", "/api/placement/state")
    assert reply.status == 200
    state = reply.json()
    assert state["daemon"] is True
    assert state["version"] == 1
    assert [(r["model"], r["config"], r["state"]) for r in state["residents"]] == [
        ("alpha", "alpha-q4", "hot")
    ]
    assert {"devices", "residents", "pending", "usage", "updated_at"} <= set(state)
    assert set(json.loads(call_json(uap_env.bus_address, "GetState")[0])) == set(state)


def test_pending_lists_entries_in_the_contract_shape(shim: ShimProcess) -> None:
    placement_id, _ = parked(admit(shim, {"model_id": "beta", "client": "shape", "session": "x"}))
    entry = pending_entry(shim, placement_id)
    assert {
        "id",
        "requested_model",
        "client",
        "session",
        "created_at",
        "expires_at",
        "reason",
        "cells",
        "options",
        "recommended",
    } <= set(entry)


def test_preview_passes_the_plan_through(shim: ShimProcess) -> None:
    ok = request(shim.base_url, "GET", "/api/placement/preview?model=beta&cells=1000").json()
    assert ok["model"] == "beta"
    assert ok["reason"] in ("ok", "no_feasible_option")
    for option in ok["options"]:
        assert option["kind"] in ("reuse", "load_alongside", "displace")
        assert {"model", "config", "device", "cost_mib"} <= set(option)
    unknown = request(shim.base_url, "GET", "/api/placement/preview?model=no-such").json()
    assert unknown["reason"] == "not_in_registry"
    unmeasured = request(shim.base_url, "GET", "/api/placement/preview?model=gamma").json()
    assert unmeasured["reason"] == "no_measured_config"


def test_preview_of_a_resident_offers_reuse(shim: ShimProcess) -> None:
    plan = request(shim.base_url, "GET", "/api/placement/preview?model=alpha").json()
    assert plan["reason"] == "ok"
    assert plan["options"][0]["kind"] == "reuse"


# --------------------------------------------------------------------------- §4 writes


WRITES: list[tuple[str, dict[str, Any]]] = [
    ("/api/placement/resolve", {"placement_id": "plc-000000", "option": 1}),
    ("/api/placement/dismiss", {"placement_id": "plc-000000"}),
    ("/api/placement/load", {"model": "beta"}),
    ("/api/placement/unload", {"model": "alpha"}),
    ("/api/placement/auto", {}),
]


@pytest.mark.parametrize(("path", "body"), WRITES)
def test_writes_without_the_right_token_are_401(
    shim: ShimProcess, path: str, body: dict[str, Any]
) -> None:
    missing = request(shim.base_url, "POST", path, body)
    assert (missing.status, missing.raw) == (
        401,
        b'{"error":"missing x-uap-dashboard-token header"}',
    )
    wrong = request(shim.base_url, "POST", path, body, token=shim.token[:-1])
    assert (wrong.status, wrong.raw) == (401, b'{"error":"wrong x-uap-dashboard-token header"}')


def test_the_token_file_is_private(shim: ShimProcess, uap_env: UapEnv) -> None:
    token_file = Path(uap_env.env["XDG_RUNTIME_DIR"]) / "uapplace" / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    assert token_file.parent.stat().st_mode & 0o777 == 0o700
    assert token_file.read_text().strip() == shim.token


def test_dismiss_a_parked_placement(shim: ShimProcess) -> None:
    placement_id, _ = parked(admit(shim, {"model_id": "beta", "client": "dismiss-me"}))
    reply = request(
        shim.base_url,
        "POST",
        "/api/placement/dismiss",
        {"placement_id": placement_id},
        token=shim.token,
    )
    assert (reply.status, reply.raw) == (200, b'{"dismissed":true}')
    again = request(
        shim.base_url,
        "POST",
        "/api/placement/dismiss",
        {"placement_id": placement_id},
        token=shim.token,
    )
    assert again.status == 404
    assert placement_id in again.json()["error"]
    entries = request(shim.base_url, "GET", "/api/placement/pending").json()["pending"]
    assert placement_id not in [e["id"] for e in entries]
    # Issue 21 item 2: the same client's retry is refused under the dismissed id, byte-exact
    # on the wire, and parks nothing new (no new prompt); another client parks as before.
    retry = admit(shim, {"model_id": "beta", "client": "dismiss-me"})
    assert retry.raw == (
        b'{"decision":"park","placement_id":"' + placement_id.encode() + b'","reason":"refused"}'
    )
    other, reason = parked(admit(shim, {"model_id": "beta", "client": "someone-else"}))
    assert other != placement_id and reason == "not_resident"
    entries = request(shim.base_url, "GET", "/api/placement/pending").json()["pending"]
    assert [e["client"] for e in entries if e["requested_model"] == "beta"].count("dismiss-me") == 0


def test_resolve_of_an_unknown_placement_is_404(shim: ShimProcess) -> None:
    reply = request(
        shim.base_url,
        "POST",
        "/api/placement/resolve",
        {"placement_id": "plc-ffffff", "option": 1},
        token=shim.token,
    )
    assert reply.status == 404
    assert list(reply.json()) == ["error"]
    assert "plc-ffffff" in reply.json()["error"]


def test_resolve_with_an_option_out_of_range_is_400(shim: ShimProcess) -> None:
    placement_id, _ = parked(admit(shim, {"model_id": "beta", "client": "range"}))
    wait_until(lambda: pending_entry(shim, placement_id)["options"], "options for the park")
    reply = request(
        shim.base_url,
        "POST",
        "/api/placement/resolve",
        {"placement_id": placement_id, "option": 99},
        token=shim.token,
    )
    assert reply.status == 400
    assert "option 99 is out of range" in reply.json()["error"]


def test_resolve_without_a_user_manager_is_503_and_keeps_the_park(shim: ShimProcess) -> None:
    """No ``systemd --user`` on this bus: the daemon is up but cannot enforce (a 503, not a 500).

    The live victim-set check (409 "victim set changed") needs the enforcer, so it
    runs on the systemd tier (``tests/systemd/test_e2e_proxy.py``).
    """
    placement_id, _ = parked(admit(shim, {"model_id": "beta", "client": "no-manager"}))
    options = wait_until(lambda: pending_entry(shim, placement_id)["options"], "options")
    reply = request(
        shim.base_url,
        "POST",
        "/api/placement/resolve",
        {"placement_id": placement_id, "option": len(options), "expected_victims": []},
        token=shim.token,
    )
    assert reply.status == 503, reply.raw
    assert list(reply.json()) == ["error"]
    assert reply.json()["error"].startswith(
        "Apply is not available: it needs the systemd user manager"
    )
    assert pending_entry(shim, placement_id)["id"] == placement_id


@pytest.mark.parametrize("path", ["/api/placement/load", "/api/placement/unload"])
def test_load_and_unload_of_an_unknown_model_are_404(shim: ShimProcess, path: str) -> None:
    reply = request(shim.base_url, "POST", path, {"model": "no-such-model"}, token=shim.token)
    assert reply.status == 404
    assert "no-such-model" in reply.json()["error"]


def test_granting_consent_without_yes_is_refused_by_the_daemon(shim: ShimProcess) -> None:
    reply = request(
        shim.base_url,
        "POST",
        "/api/placement/auto",
        {"allow_displace": ["alpha"]},
        token=shim.token,
    )
    assert reply.status == 400
    assert "consent" in reply.json()["error"]


# --------------------------------------------------------------------------- daemon down


def test_admit_answers_503_while_the_daemon_is_frozen_then_recovers(
    shim: ShimProcess, daemon: DaemonProcess
) -> None:
    """SIGSTOP the daemon: admit must give up at its deadline, never hang the proxy."""
    daemon.signal(signal.SIGSTOP)
    try:
        frozen = admit(shim, {"model_id": "alpha", "client": "frozen"})
    finally:
        daemon.signal(signal.SIGCONT)
    assert frozen.status == 503
    assert frozen.json() == {"error": "placement daemon unavailable: Admit: no answer within 1.5 s"}
    assert admit(shim, {"model_id": "alpha", "client": "thawed"}).raw == FORWARD_ALPHA


def test_no_daemon_on_the_bus_is_503(tmp_path: Path) -> None:
    with private_bus("session", tmp_path) as address:
        uap = make_env(tmp_path / "world", address)
        lonely = start_shim(uap.env, address, tmp_path)
        try:
            reply = admit(lonely, {"model_id": "alpha"})
            state = request(lonely.base_url, "GET", "/api/placement/state")
        finally:
            assert lonely.stop() == 0
    assert reply.status == 503
    assert reply.json()["error"].startswith("placement daemon unavailable: Admit: ")
    assert state.status == 503


def test_the_shim_reconnects_after_the_bus_restarts(tmp_path: Path) -> None:
    """Bus gone → 503 (can't connect); bus and daemon back → the same shim serves again."""
    bus_dir = tmp_path / "bus"
    bus_dir.mkdir()
    with private_bus("session", bus_dir) as address:
        uap = make_env(tmp_path / "world", address)
        uap.seed_ledger(SEEDED_LEDGER)
        first = start_daemon(uap)
        survivor = start_shim(uap.env, address, tmp_path)
        try:
            wait_published(address)
            before = admit(survivor, {"model_id": "alpha"})
        finally:
            assert first.stop() == 0
    try:
        while_down = admit(survivor, {"model_id": "alpha"})
        with private_bus("session", bus_dir) as address_again:
            second = start_daemon(make_env_on(uap, address_again))
            try:
                wait_published(address_again)
                after = admit(survivor, {"model_id": "alpha"})
            finally:
                assert second.stop() == 0
    finally:
        assert survivor.stop() == 0
    assert before.raw == FORWARD_ALPHA
    assert while_down.status == 503
    assert "cannot connect to the bus" in while_down.json()["error"]
    assert after.raw == FORWARD_ALPHA


def make_env_on(uap: UapEnv, address: str) -> UapEnv:
    """The same private world (ledger, registry) on a restarted bus."""
    return UapEnv(uap.root, {**uap.env, "DBUS_SESSION_BUS_ADDRESS": address}, address)


# --------------------------------------------------------------------------- routing


def test_unknown_route_and_wrong_method_are_json(shim: ShimProcess) -> None:
    missing = request(shim.base_url, "GET", "/api/placement/nothing")
    assert missing.status == 404
    assert missing.headers["content-type"] == "application/json; charset=utf-8"
    assert "error" in missing.json()
    wrong = request(shim.base_url, "PUT", ADMIT, {"model_id": "alpha"})
    assert wrong.status == 405
    assert wrong.headers["allow"] == "POST"


def test_openapi_is_served(shim: ShimProcess) -> None:
    document = request(shim.base_url, "GET", "/openapi.json").json()
    assert document["openapi"] == "3.1.0"
    assert ADMIT in document["paths"]
