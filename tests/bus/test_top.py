"""``uapplace top`` driven by Textual's headless pilot against a live ``uapplaced``.

The daemon starts with ``alpha`` resident (the seeded fake engine serves it), so a
parked ``beta`` (20000 MiB beside alpha's 8000 on a 24 GiB GPU) has a displace option
whose impact names alpha. Each key sends the CLI's own call; the tests check the
daemon's answer over the bus, not only the screen.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable, Static

from tests.bus.conftest import (
    DaemonProcess,
    UapEnv,
    alpha_resident_daemon,
    call_json,
    make_env,
    run_cli,
    start_daemon,
)
from tests.bus.dbusmock_fixtures import private_bus
from uapplace.cli.top import ConfirmScreen, LogScreen, TopApp

pytestmark = pytest.mark.bus

SIZE = (180, 70)
GUARD_S = 20.0


@pytest.fixture(scope="module")
def alpha_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    root = tmp_path_factory.mktemp("top")
    with (
        private_bus("session", root) as address,
        alpha_resident_daemon(root / "uap", address) as started,
    ):
        yield started


def park(uap: UapEnv, model: str, client: str) -> str:
    answer = call_json(uap.bus_address, "Admit", "sssu", model, client, "", "0")
    assert answer[0] == "park", answer
    placement_id: str = answer[2]
    return placement_id


def state(uap: UapEnv) -> dict[str, Any]:
    (text,) = call_json(uap.bus_address, "GetState")
    found: dict[str, Any] = json.loads(text)
    return found


def pending_ids(uap: UapEnv) -> list[str]:
    (text,) = call_json(uap.bus_address, "ListPending")
    return [entry["id"] for entry in json.loads(text)["pending"]]


async def until(pilot: Pilot[None], what: str, condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + GUARD_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        await pilot.pause(0.05)


def shown(app: TopApp, widget_id: str) -> str:
    return str(app.query_one(f"#{widget_id}", Static).content)


def row_keys(app: TopApp, table_id: str) -> list[str]:
    table = app.query_one(f"#{table_id}", DataTable)
    return [str(key.value) for key in table.rows]


def select(app: TopApp, table_id: str, key: str) -> None:
    table = app.query_one(f"#{table_id}", DataTable)
    table.focus()
    table.move_cursor(row=table.get_row_index(key))


async def select_parked(pilot: Pilot[None], app: TopApp, placement_id: str) -> None:
    """Once the parked request's first option shows, select it."""
    row = f"{placement_id}#1"
    await until(pilot, "the parked request", lambda: row in app.options)
    select(app, "pending", row)


async def test_bars_residents_targets_and_a_pending_request(alpha_daemon: DaemonProcess) -> None:
    uap = alpha_daemon.uap
    placement_id = park(uap, "beta", "top-shows[/x]:fire:")  # shown as written
    app = TopApp(uap.bus_address)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "the parked request", lambda: f"{placement_id}#1" in app.options)
        devices = shown(app, "devices")
        assert "gpu0" in devices and "█" in devices and "░" in devices
        assert "alpha/alpha-q4" in devices and "reserved 1,024 MiB" in devices
        assert "alpha" in row_keys(app, "residents")
        targets = app.query_one("#targets", DataTable)
        assert targets.row_count == 1
        assert str(targets.get_row_at(0)[2]) == "0"  # the fake engine's requests_processing
        row = [
            str(cell) for cell in app.query_one("#pending", DataTable).get_row(f"{placement_id}#1")
        ]
        assert row[1] == "beta" and row[2] == "top-shows[/x]:fire:"
        assert "stops alpha/alpha-q4" in row[5]


async def test_dismiss_key_refuses_the_request(alpha_daemon: DaemonProcess) -> None:
    uap = alpha_daemon.uap
    placement_id = park(uap, "beta", "top-dismiss")
    app = TopApp(uap.bus_address)
    async with app.run_test(size=SIZE) as pilot:
        await select_parked(pilot, app, placement_id)
        await pilot.press("d")
        await until(pilot, "the dismissal", lambda: placement_id not in pending_ids(uap))
        await until(pilot, "the row to go", lambda: f"{placement_id}#1" not in app.options)


async def test_apply_key_shows_the_impact_and_sends_its_signature(
    alpha_daemon: DaemonProcess,
) -> None:
    uap = alpha_daemon.uap
    placement_id = park(uap, "beta", "top-apply")
    app = TopApp(uap.bus_address)
    async with app.run_test(size=SIZE) as pilot:
        await select_parked(pilot, app, placement_id)
        await pilot.press("a")
        await until(pilot, "the confirm dialog", lambda: isinstance(app.screen, ConfirmScreen))
        impact = str(app.screen.query_one("#impact", Static).content)
        assert f"Placement {placement_id} (beta for top-apply)" in impact
        assert "stop alpha/alpha-q4 on gpu0" in impact and "Frees 8,000 MiB" in impact
        await pilot.press("n")  # no: nothing is sent
        await until(pilot, "the dialog to close", lambda: not isinstance(app.screen, ConfirmScreen))
        assert placement_id in pending_ids(uap)
        await pilot.press("a")
        await until(pilot, "the confirm dialog", lambda: isinstance(app.screen, ConfirmScreen))
        await pilot.press("y")
        # The bus tier has no user manager: the daemon itself answers the Apply it got.
        await until(pilot, "the daemon's answer", lambda: "refused" in app.run_steps.outcome)
        assert "Apply is not available: it needs the systemd user manager" in (
            app.run_steps.outcome
        )
        assert f"apply {placement_id} option 1" in shown(app, "run")


async def test_hold_key_holds_and_releases_the_selected_resident(
    alpha_daemon: DaemonProcess,
) -> None:
    uap = alpha_daemon.uap
    app = TopApp(uap.bus_address)

    def holders() -> list[tuple[str, str]]:
        return [(h["model"], h["app_id"]) for h in state(uap)["holds"]]

    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, "alpha's row", lambda: "alpha" in row_keys(app, "residents"))
        select(app, "residents", "alpha")
        await pilot.press("h")
        await until(pilot, "the hold", lambda: ("alpha", "uapplace-top") in holders())
        assert "alpha" in app.holds
        await until(
            pilot,
            "the hold on screen",
            lambda: "uapplace-top" in str(app.query_one("#residents", DataTable).get_row("alpha")),
        )
        await pilot.press("h")
        await until(pilot, "the release", lambda: ("alpha", "uapplace-top") not in holders())
        # l: the selected model's `uapplace logs` (no user manager here: it says so).
        await pilot.press("l")
        await until(pilot, "the log screen", lambda: isinstance(app.screen, LogScreen))
        log_text = str(app.screen.query_one("#log-lines", Static).content)
        # No user manager in this tier: the command's own clear refusal, no traceback.
        assert "no systemd user manager answers about uap-alpha.service" in log_text, log_text
        assert "Traceback" not in log_text
        await pilot.press("escape")
        await until(pilot, "the log screen to close", lambda: not isinstance(app.screen, LogScreen))


async def test_ack_key_acknowledges_the_selected_alert(alpha_daemon: DaemonProcess) -> None:
    uap = alpha_daemon.uap
    good = uap.registry.read_text(encoding="utf-8")
    uap.registry.write_text("{ not json")
    try:
        assert run_cli(uap, "validate").returncode == 1  # the reload that raises the alert
        alerts = state(uap)["alerts"]
        assert [a["kind"] for a in alerts] == ["config_error"]
        app = TopApp(uap.bus_address)
        async with app.run_test(size=SIZE) as pilot:
            await until(pilot, "the alert row", lambda: alerts[0]["id"] in row_keys(app, "alerts"))
            assert "1 open alert(s)" in shown(app, "status")
            select(app, "alerts", alerts[0]["id"])
            await pilot.press("k")
            await until(pilot, "the acknowledgement", lambda: not state(uap)["alerts"])
            await until(pilot, "the row to go", lambda: not row_keys(app, "alerts"))
    finally:
        uap.registry.write_text(good, encoding="utf-8")
        assert run_cli(uap, "validate").returncode == 0


async def test_top_follows_a_daemon_restart(tmp_path: Path) -> None:
    with private_bus("session", tmp_path) as address:
        uap = make_env(tmp_path / "uap", address)
        daemon = start_daemon(uap)
        app = TopApp(address)
        try:
            async with app.run_test(size=SIZE) as pilot:
                await until(pilot, "the first read", lambda: app.state is not None)
                assert daemon.stop() == 0
                await until(pilot, "the daemon gone", lambda: app.state is None)
                assert "not answering" in shown(app, "status")
                daemon = start_daemon(uap)
                placement_id = park(uap, "beta", "top-restart")
                await until(pilot, "the new daemon's state", lambda: app.state is not None)
                await until(pilot, "its pending", lambda: f"{placement_id}#1" in app.options)
                assert shown(app, "status").startswith("uapplaced 0.1.0")
        finally:
            daemon.stop()
