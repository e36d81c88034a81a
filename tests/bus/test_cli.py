"""Every ``uapplace`` command against the live daemon, and without it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bus.conftest import (
    DaemonProcess,
    UapEnv,
    call_json,
    make_env,
    run_cli,
    start_daemon,
    wait_until,
)
from tests.bus.dbusmock_fixtures import private_bus, spawn_template

pytestmark = pytest.mark.bus


def cli_json(uap: UapEnv, *args: str) -> Any:
    done = run_cli(uap, *args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


def park(uap: UapEnv, model: str, client: str) -> str:
    answer = call_json(uap.bus_address, "Admit", "sssu", model, client, "", "0")
    assert answer[0] == "park"
    placement_id: str = answer[2]
    return placement_id


def pending_with_options(uap: UapEnv, placement_id: str) -> dict[str, Any]:
    def found() -> dict[str, Any] | None:
        (text,) = call_json(uap.bus_address, "ListPending")
        listed = json.loads(text)
        entry = next((e for e in listed["pending"] if e["id"] == placement_id), None)
        return entry if entry and entry["options"] else None

    entry: dict[str, Any] = wait_until(found, f"options for {placement_id}")
    return entry


# --------------------------------------------------------------------------- reads


def test_version_and_help() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uapplace.cli", "--version"], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "uapplace 0.1.0"
    helped = subprocess.run(
        [sys.executable, "-m", "uapplace.cli", "--help"], capture_output=True, text=True
    )
    assert "Exit codes:" in helped.stdout
    assert "  3  uapplaced not reachable" in helped.stdout


def test_status(daemon: DaemonProcess) -> None:
    state = cli_json(daemon.uap, "status")
    assert state["daemon"] is True and "gpu0" in state["devices"]
    text = run_cli(daemon.uap, "status")
    assert text.returncode == 0
    assert "gpu0" in text.stdout and "Residents: none" in text.stdout


def test_pending_lists_a_park_with_its_options(daemon: DaemonProcess) -> None:
    placement_id = park(daemon.uap, "alpha", "cli-pending")
    entry = pending_with_options(daemon.uap, placement_id)
    assert entry["requested_model"] == "alpha"
    listed = cli_json(daemon.uap, "pending")
    assert placement_id in [e["id"] for e in listed["pending"]]
    text = run_cli(daemon.uap, "pending")
    assert text.returncode == 0
    assert placement_id in text.stdout
    assert "load_alongside alpha/alpha-q4 on gpu0" in text.stdout


def test_preview(daemon: DaemonProcess) -> None:
    plan = cli_json(daemon.uap, "preview", "beta", "--cells", "4096")
    assert plan["reason"] == "ok" and plan["options"][0]["config"] == "beta-q8"
    unknown = run_cli(daemon.uap, "preview", "no-such-model")
    assert unknown.returncode == 0 and "not_in_registry" in unknown.stdout
    bad = run_cli(daemon.uap, "preview", "beta", "--cells", "0")
    assert bad.returncode == 2


def test_validate_prints_provenance(daemon: DaemonProcess) -> None:
    report = cli_json(daemon.uap, "validate")
    assert report["ok"] is True and report["provenance"]
    text = run_cli(daemon.uap, "validate")
    assert text.returncode == 0
    assert "Provenance" in text.stdout and "$.devices.gpu0" in text.stdout


# --------------------------------------------------------------------------- apply / dismiss


def test_apply_without_yes_prints_the_impact_and_refuses(daemon: DaemonProcess) -> None:
    placement_id = park(daemon.uap, "beta", "cli-apply")
    pending_with_options(daemon.uap, placement_id)
    done = run_cli(daemon.uap, "apply", placement_id, "1")
    assert done.returncode == 1
    assert f"Placement {placement_id} (beta for cli-apply)" in done.stdout
    assert "load_alongside beta/beta-q8 on gpu0" in done.stdout
    assert "It stops nothing." in done.stdout
    assert "re-run with --yes" in done.stderr


def test_apply_with_yes_reaches_the_daemon(daemon: DaemonProcess) -> None:
    placement_id = park(daemon.uap, "beta", "cli-apply-yes")
    pending_with_options(daemon.uap, placement_id)
    done = run_cli(daemon.uap, "apply", placement_id, "1", "--yes")
    assert done.returncode == 1
    assert "Apply is not available: it needs the systemd user manager" in done.stderr


def test_apply_unknown_id_and_option(daemon: DaemonProcess) -> None:
    assert run_cli(daemon.uap, "apply", "plc-00beef", "1").returncode == 7
    placement_id = park(daemon.uap, "alpha", "cli-apply-range")
    pending_with_options(daemon.uap, placement_id)
    out_of_range = run_cli(daemon.uap, "apply", placement_id, "9")
    assert out_of_range.returncode == 2 and "out of range" in out_of_range.stderr


def test_dismiss(daemon: DaemonProcess) -> None:
    placement_id = park(daemon.uap, "alpha", "cli-dismiss")
    assert cli_json(daemon.uap, "dismiss", placement_id) == {
        "dismissed": True,
        "placement_id": placement_id,
    }
    again = run_cli(daemon.uap, "dismiss", placement_id)
    assert again.returncode == 7
    assert f"no pending placement {placement_id}" in again.stderr


# --------------------------------------------------------------------------- no user manager


@pytest.mark.parametrize(
    ("args", "method"),
    [
        (("load", "alpha"), "Load"),
        (("measure", "alpha"), "Measure"),
        (("measure", "--envelope", "alpha", "--yes"), "MeasureEnvelope"),
    ],
)
def test_enforcement_commands_without_a_user_manager(
    daemon: DaemonProcess, args: tuple[str, ...], method: str
) -> None:
    done = run_cli(daemon.uap, *args)
    assert done.returncode == 1
    assert f"{method} is not available: it needs the systemd user manager" in done.stderr


def test_measure_envelope_without_yes_says_what_it_does_and_refuses(
    daemon: DaemonProcess,
) -> None:
    done = run_cli(daemon.uap, "measure", "--envelope", "alpha")
    assert done.returncode == 1
    assert "measure --envelope takes the backend down" in done.stderr
    assert "1. drain alpha: new requests for it park" in done.stderr
    assert "2. stop uap-alpha: alpha goes down" in done.stderr
    assert "Run again with --yes" in done.stderr
    assert "is not available" not in done.stderr, "nothing reached the daemon"


def test_load_shows_the_impact_before_the_daemon_refuses(daemon: DaemonProcess) -> None:
    done = run_cli(daemon.uap, "load", "alpha")
    # alpha fits alongside: nothing stops, so no --yes is needed and the call goes out.
    assert "Load alpha: load_alongside alpha/" in done.stdout
    assert "It stops nothing." in done.stdout
    assert "Load is not available" in done.stderr


def test_unload_of_a_model_that_is_not_resident_stops_nothing(daemon: DaemonProcess) -> None:
    done = run_cli(daemon.uap, "unload", "alpha", "--yes")
    assert done.returncode == 7
    assert "NotFound: alpha is not resident: nothing to unload" in done.stderr


def test_units_and_auto(daemon: DaemonProcess) -> None:
    written = cli_json(daemon.uap, "units")["written"]
    assert all(p.endswith("50-uapplace-conflicts.conf") for p in written)
    again = run_cli(daemon.uap, "units")
    assert again.returncode == 0
    assert "nothing to write" in again.stdout or "wrote" in again.stdout
    assert cli_json(daemon.uap, "auto")["enabled"] is False
    assert cli_json(daemon.uap, "auto", "--enable")["enabled"] is True
    assert cli_json(daemon.uap, "auto", "--disable")["enabled"] is False
    consent = cli_json(daemon.uap, "auto", "--allow-displace", "alpha", "--yes")
    assert consent["allow_displace"] == ["alpha"]
    assert cli_json(daemon.uap, "auto", "--disallow-displace", "alpha")["allow_displace"] == []
    # Issue 21 item 8: `--idle-after 0` turns the sweep off (it was refused: min 60).
    assert cli_json(daemon.uap, "auto", "--idle-after", "900")["unload_idle_after_secs"] == 900
    off = cli_json(daemon.uap, "auto", "--idle-after", "0")
    assert off["unload_idle_after_secs"] is None and off["idle_window_secs"] is None
    refused = run_cli(daemon.uap, "auto", "--idle-after", "-1")
    assert refused.returncode == 2 and "--idle-after" in refused.stderr


def test_unknown_model_is_exit_7(daemon: DaemonProcess) -> None:
    done = run_cli(daemon.uap, "load", "no-such-model")
    assert done.returncode == 7
    assert "UnknownModel" in done.stderr and "no-such-model" in done.stderr


def test_consent_flags_refuse_without_yes(daemon: DaemonProcess) -> None:
    done = run_cli(daemon.uap, "auto", "--allow-displace", "beta", "--allow-unload", "alpha")
    assert done.returncode == 1
    # allow_displace names the model that may evict others (what the daemon records).
    assert "would consent to: stop other models unattended to load beta" in done.stdout
    assert "would consent to: unload alpha when it has been idle" in done.stdout
    assert "re-run with --yes" in done.stderr


def test_demo_is_a_command(daemon: DaemonProcess) -> None:
    done = run_cli(daemon.uap, "demo", "--help")
    assert done.returncode == 0
    assert "--keep" in done.stdout


# --------------------------------------------------------------------------- hold / watch


def test_hold_lives_until_ctrl_c(daemon: DaemonProcess) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-m", "uapplace.cli", "hold", "alpha", "--reason", "eval run", "--json"],
        env=daemon.uap.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        first = json.loads(holder.stdout.readline())
        cookie = first["cookie"]
        held = cli_json(daemon.uap, "status")["holds"]
        assert [h["reason"] for h in held if h["cookie"] == cookie] == ["eval run"]
        holder.send_signal(signal.SIGINT)
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    assert all(h["cookie"] != cookie for h in cli_json(daemon.uap, "status")["holds"])
    released = run_cli(daemon.uap, "release", str(cookie))
    assert released.returncode == 7


def test_watch_prints_signals_as_json_lines(daemon: DaemonProcess) -> None:
    watcher = subprocess.Popen(
        [sys.executable, "-m", "uapplace.cli", "watch", "--json"],
        env=daemon.uap.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert watcher.stdout is not None and watcher.stderr is not None
        assert "watching" in watcher.stderr.readline()  # subscribed from here on
        park(daemon.uap, "beta", "watched")
        line = json.loads(watcher.stdout.readline())
        # The shim's SSE data objects (uapplace.bus.events.Event.to_json).
        assert (line["id"], line["event"], line["data"]["model"]) == (1, "Parked", "beta")
        placement_id = line["data"]["placement_id"]
        dismissed = run_cli(daemon.uap, "dismiss", placement_id)
        assert dismissed.returncode == 0
        resolved = json.loads(watcher.stdout.readline())
        while resolved["event"] != "Resolved":
            resolved = json.loads(watcher.stdout.readline())
        assert resolved["data"] == {"placement_id": placement_id, "outcome": "dismissed"}
        assert resolved["id"] > line["id"]
        watcher.send_signal(signal.SIGINT)
        assert watcher.wait(timeout=30) == 0
    finally:
        if watcher.poll() is None:
            watcher.kill()
            watcher.wait()


# --------------------------------------------------------------------------- install


def test_install_and_uninstall_are_idempotent_and_exact(daemon: DaemonProcess) -> None:
    uap = daemon.uap
    unit = Path(uap.env["XDG_CONFIG_HOME"]) / "systemd" / "user" / "uapplaced.service"
    activation = (
        Path(uap.env["XDG_DATA_HOME"]) / "dbus-1" / "services" / "org.uap.Placement1.service"
    )
    first = cli_json(uap, "install")
    assert [f["action"] for f in first["files"]] == ["written", "written"]
    assert "systemctl --user daemon-reload" in first["reload_message"]
    daemon_path = Path(sys.executable).with_name("uapplaced")
    assert f"ExecStart={daemon_path}\n" in unit.read_text()
    assert "Type=dbus" in unit.read_text() and "BusName=org.uap.Placement1" in unit.read_text()
    assert "SystemdService=uapplaced.service" in activation.read_text()

    second = cli_json(uap, "install")
    assert [f["action"] for f in second["files"]] == ["unchanged", "unchanged"]

    neighbour = unit.with_name("other.service")
    neighbour.write_text("[Service]\nExecStart=/bin/true\n")
    removed = cli_json(uap, "uninstall")
    assert [f["action"] for f in removed["files"]] == ["removed", "removed"]
    assert not unit.exists() and not activation.exists() and neighbour.exists()
    assert [f["action"] for f in cli_json(uap, "uninstall")["files"]] == ["absent", "absent"]


def test_install_leaves_a_foreign_file_alone(daemon: DaemonProcess) -> None:
    uap = daemon.uap
    unit = Path(uap.env["XDG_CONFIG_HOME"]) / "systemd" / "user" / "uapplaced.service"
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text("[Service]\nExecStart=/opt/mine\n")
    try:
        done = run_cli(uap, "install")
        assert done.returncode == 1
        assert "was not written by `uapplace install`" in done.stdout
        assert unit.read_text() == "[Service]\nExecStart=/opt/mine\n"
    finally:
        unit.unlink()
        run_cli(uap, "uninstall")


# --------------------------------------------------------------------------- daemon down


@pytest.fixture
def idle_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A bus with no uapplaced on it."""
    with private_bus("session", tmp_path_factory.mktemp("idle-bus")) as address:
        yield address


def seed_pending_ledger(uap: UapEnv) -> None:
    uap.seed_ledger(
        {
            "version": 1,
            "updated_at": "2026-01-01T00:00:00Z",
            "residents": [],
            "pending": [
                {
                    "id": "plc-0ff11e",
                    "requested_model": "alpha",
                    "client": "offline-client",
                    "created_at": "2026-01-01T00:00:00Z",
                    "expires_at": "2026-01-01T00:02:00Z",
                    "reason": "not_resident",
                }
            ],
            "usage": {},
        }
    )


@pytest.mark.parametrize("bus", ["no-owner", "no-bus"])
def test_without_the_daemon_reads_fall_back_and_writes_refuse(
    tmp_path: Path, idle_bus: str, bus: str
) -> None:
    address = idle_bus if bus == "no-owner" else f"unix:path={tmp_path}/no-such-socket"
    uap = make_env(tmp_path, address)
    seed_pending_ledger(uap)
    note = f"uapplaced is not running; read from {uap.ledger}"

    status = run_cli(uap, "status")
    assert status.returncode == 0 and note in status.stdout
    assert "Pending: 1" in status.stdout
    pending = run_cli(uap, "pending", "--json")
    assert pending.returncode == 0 and note in pending.stderr
    assert [e["id"] for e in json.loads(pending.stdout)["pending"]] == ["plc-0ff11e"]
    state = json.loads(run_cli(uap, "status", "--json").stdout)
    assert state["daemon"] is False

    writes = [("dismiss", "plc-0ff11e"), ("hold", "alpha", "--reason", "x")]
    if bus == "no-owner":
        writes += [
            ("apply", "plc-0ff11e", "1", "--yes"),
            ("load", "alpha"),
            ("unload", "alpha"),
            ("units",),
            ("auto", "--enable"),
            ("release", "1"),
        ]
    for args in writes:
        done = run_cli(uap, *args)
        assert done.returncode == 3, (args, done.stderr)
        assert "uapplaced is not running" in done.stderr or "cannot reach" in done.stderr

    offline = run_cli(uap, "validate", "--json")
    assert offline.returncode == 0
    assert "validated the files directly" in offline.stderr
    assert json.loads(offline.stdout)["daemon"] is False


# --------------------------------------------------------------------------- alerts


def test_an_alert_is_notified_and_bannered_until_acknowledged(tmp_path: Path) -> None:
    """A real alert path: a registry edit that does not load (CONFIG_ERROR, warning).

    The notification reaches the notification daemon (python-dbusmock) on the
    daemon's bus; `status` shows the red banner until `status --ack` drops it."""
    (tmp_path / "bus").mkdir()
    with private_bus("session", tmp_path / "bus") as address:
        notifications = spawn_template("notification_daemon", address, tmp_path)
        try:
            uap = make_env(tmp_path / "uap", address)
            daemon = start_daemon(uap)
            try:
                uap.registry.write_text("{ not json")
                assert run_cli(uap, "validate").returncode == 1  # the reload that fails
                alerts = cli_json(uap, "status")["alerts"]
                assert [(a["kind"], a["severity"]) for a in alerts] == [("config_error", "warning")]
                assert alerts[0]["subject"] == str(uap.registry)

                def notified() -> list[Any] | None:
                    calls = notifications.calls("Notify")
                    return next((c for c in calls if c[3] == "uapplace: config error"), None)

                bubble = wait_until(notified, "the alert's notification")
                assert str(uap.registry) in bubble[4] and "uapplace status --ack" in bubble[4]
                assert bubble[6]["urgency"] == 1  # a warning: normal urgency, not critical

                shown = run_cli(uap, "status")
                assert shown.returncode == 0
                assert "1 open alert(s)" in shown.stdout
                assert f"WARNING config_error {alerts[0]['id']}" in shown.stdout
                assert "uapplace status --ack" in shown.stdout

                assert run_cli(uap, "status", "alr-nope").returncode == 2  # ids need --ack
                unknown = run_cli(uap, "status", "--ack", "alr-00000000")
                assert unknown.returncode == 7 and "no open alert alr-00000000" in unknown.stderr
                acked = cli_json(uap, "status", "--ack", alerts[0]["id"])
                assert acked == {"acknowledged": [alerts[0]["id"]]}
                assert cli_json(uap, "status")["alerts"] == []
                assert "open alert" not in run_cli(uap, "status").stdout
            finally:
                assert daemon.stop() == 0
        finally:
            notifications.stop()
