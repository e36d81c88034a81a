"""The real shim and daemon at their edges (issue 20): only the user gets in, and every
hostile value over HTTP or the bus gets a named error, never a traceback.

- a second uid (a client run under ``setpriv --reuid 65534`` with the system Python)
  gets ``403`` with a named error on every route, before any route runs, and the shim
  logs one line; the shim's own user is served; ``--allow-uid`` lets a named uid in;
- a 5,000-digit ``cells`` (query or body) is a ``400`` naming it; a malformed HTTP
  request is one log line, no traceback;
- ``SetAutoPolicy`` with 30,000-deep JSON or a 5,000-digit integer is
  ``InvalidArgument`` naming ``policy_json``;
- SIGHUP re-reads ``enforcement-timeouts.json``: a bad one is an error line and a
  ``config_error`` alert, and ``Validate`` names it; a foreign auto policy is an alert.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.bus import shim_fixtures
from tests.bus.conftest import DaemonProcess, UapEnv, busctl, call_json, wait_until
from tests.bus.shim_fixtures import ShimProcess, request, start_shim
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.shim.routes import ROUTES

pytestmark = pytest.mark.bus

OTHER_UID = 65534
SYSTEM_PYTHON = "/usr/bin/python3"
"""The other user's client runs the system Python: ours may sit where only root may go."""
AS_OTHER_USER = ("setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups")
ADMIT_BODY = {"model_id": "alpha", "client": "x-uap-client-id:t"}
REFUSED = (
    "uapplace-shim serves its own user only: this connection comes from uid 65534 (nobody); "
    "it serves uid 0 (root)"
)
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="running a client as another uid needs root (the CI runs as root)"
)

daemon = shim_fixtures.daemon
shim = shim_fixtures.shim


def as_other_user(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request from uid :data:`OTHER_UID`: ``(status, JSON body)``."""
    code = (
        "import http.client, json, sys\n"
        f"c = http.client.HTTPConnection('127.0.0.1', {port}, timeout=10)\n"
        "body = sys.argv[3] or None\n"
        "c.request(sys.argv[1], sys.argv[2], body=body,"
        " headers={'Content-Type': 'application/json'} if body else {})\n"
        "r = c.getresponse()\n"
        "print(json.dumps([r.status, r.read().decode()]))\n"
    )
    payload = json.dumps(body) if body is not None else ""
    argv = [*AS_OTHER_USER, SYSTEM_PYTHON, "-c", code, method, path, payload]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True)
    status, text = json.loads(done.stdout)
    return int(status), json.loads(text)


# --------------------------------------------------------------------------- other users


@needs_root
@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", ROUTES["admit"], ADMIT_BODY),
        ("GET", ROUTES["state"], None),
        ("GET", ROUTES["events"], None),
        ("GET", ROUTES["metrics"], None),
        ("GET", "/no/such/route", None),
    ],
)
def test_another_user_is_refused_before_any_route_and_we_are_served(
    shim: ShimProcess, method: str, path: str, body: Any
) -> None:
    status, answer = as_other_user(shim.port, method, path, body)
    assert (status, answer) == (403, {"error": REFUSED})
    wait_until(lambda: "refused a connection: " + REFUSED in shim.log(), "the refusal logged")
    own = request(shim.base_url, "POST", ROUTES["admit"], ADMIT_BODY)
    assert own.status == 200 and own.json()["decision"] == "forward"


@needs_root
def test_refused_connections_do_not_hold_a_slot_or_flood_the_log(
    shim: ShimProcess,
) -> None:
    for _ in range(20):
        assert as_other_user(shim.port, "GET", ROUTES["state"])[0] == 403
    lines = [line for line in shim.log().splitlines() if "refused a connection" in line]
    assert len(lines) <= 3, lines  # one line per 10 s with a count, not one per connection
    assert request(shim.base_url, "GET", ROUTES["state"]).status == 200


@needs_root
def test_allow_uid_lets_a_named_user_in(uap_env: UapEnv, daemon: DaemonProcess) -> None:
    allowing = start_shim(
        uap_env.env, uap_env.bus_address, uap_env.root, "--allow-uid", str(OTHER_UID)
    )
    try:
        status, answer = as_other_user(allowing.port, "POST", ROUTES["admit"], ADMIT_BODY)
        assert status == 200 and answer["decision"] == "forward"
    finally:
        assert allowing.stop() == 0, allowing.log()


# --------------------------------------------------------------------------- hostile HTTP


def test_a_5000_digit_cells_is_a_400_naming_it(shim: ShimProcess) -> None:
    query = f"{ROUTES['preview']}?model=alpha&cells={'9' * 5000}"
    preview = request(shim.base_url, "GET", query)
    assert preview.status == 400 and "query parameter cells" in preview.json()["error"]
    raw = b'{"model_id": "alpha", "cells": ' + b"9" * 5000 + b"}"
    admit = request(
        shim.base_url,
        "POST",
        ROUTES["admit"],
        data=raw,
        headers={"Content-Type": "application/json"},
    )
    assert admit.status == 400 and "not valid JSON" in admit.json()["error"]
    assert "Traceback" not in shim.log() and "internal error" not in shim.log()


def test_a_malformed_request_is_one_log_line_without_a_traceback(shim: ShimProcess) -> None:
    with socket.create_connection(("127.0.0.1", shim.port), timeout=10) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: \x1b[2Jabc\r\n\r\n")
        answer = sock.recv(200)
    assert answer.startswith(b"HTTP/1.0 400 Bad Request")
    wait_until(lambda: "bad HTTP request from 127.0.0.1" in shim.log(), "the one line")
    assert "Traceback" not in shim.log() and "\x1b" not in shim.log()


# --------------------------------------------------------------------------- the bus


def set_auto_policy(address: str, text: str) -> subprocess.CompletedProcess[str]:
    return busctl(
        address, "call", BUS_NAME, OBJECT_PATH, INTERFACE, "SetAutoPolicy", "sb", text, "true"
    )


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ('{"enable": ' + "[" * 30_000 + "]" * 30_000 + "}", "nested deeper than 64"),
        ('{"unload_idle_after_secs": ' + "9" * 5000 + "}", "invalid JSON number"),
        ('{"unload_idle_after_secs": 1000000000000000000000000000000}', "less than or equal"),
    ],
)
def test_set_auto_policy_answers_hostile_json_with_invalid_argument(
    uap_env: UapEnv, daemon: DaemonProcess, text: str, named: str
) -> None:
    done = set_auto_policy(uap_env.bus_address, text)
    assert done.returncode != 0
    assert "InvalidArgument" in done.stderr or "policy_json" in done.stderr
    assert "policy_json" in done.stderr and named in done.stderr
    assert "Traceback" not in daemon.log() and "internal error" not in daemon.log()


# --------------------------------------------------------------------------- SIGHUP


def alerts(address: str) -> list[dict[str, Any]]:
    state = json.loads(call_json(address, "GetState")[0])
    found: list[dict[str, Any]] = state["alerts"]
    return found


@pytest.fixture
def timeouts_file(uap_env: UapEnv) -> Iterator[Any]:
    path = uap_env.home / "enforcement-timeouts.json"
    yield path
    path.unlink(missing_ok=True)


def test_sighup_rereads_the_timeouts_file_and_validate_names_a_bad_one(
    uap_env: UapEnv, daemon: DaemonProcess, timeouts_file: Any
) -> None:
    timeouts_file.write_text('{"drain_s": 1e30}')
    daemon.signal(signal.SIGHUP)
    wait_until(
        lambda: "enforcement timeouts reload failed" in daemon.log(), "the reload error logged"
    )
    wait_until(
        lambda: any(a["subject"] == str(timeouts_file) for a in alerts(uap_env.bus_address)),
        "a config_error alert naming the file",
    )
    report = json.loads(call_json(uap_env.bus_address, "Validate")[0])
    (finding,) = [f for f in report["findings"] if f["file"] == str(timeouts_file)]
    assert finding["severity"] == "error" and finding["json_path"] == "$.drain_s"
    assert report["ok"] is False
    timeouts_file.write_text('{"drain_s": 30}')
    report = json.loads(call_json(uap_env.bus_address, "Validate")[0])
    assert not [f for f in report["findings"] if f["file"] == str(timeouts_file)]


@needs_root
def test_sighup_raises_an_alert_for_a_foreign_auto_policy(
    uap_env: UapEnv, daemon: DaemonProcess
) -> None:
    path = uap_env.home / "placement-auto.json"
    path.write_text(json.dumps({"enabled": True, "allow_displace": ["beta"]}))
    os.chown(path, OTHER_UID, OTHER_UID)
    path.chmod(0o666)
    try:
        daemon.signal(signal.SIGHUP)
        wait_until(
            lambda: any(a["subject"] == str(path) for a in alerts(uap_env.bus_address)),
            "a config_error alert naming the auto policy",
        )
        (alert,) = [a for a in alerts(uap_env.bus_address) if a["subject"] == str(path)]
        assert f"owned by uid {OTHER_UID}" in alert["message"]
        assert "never honoured as standing consent" in alert["message"]
        policy = json.loads(call_json(uap_env.bus_address, "GetAutoPolicy")[0])
        assert policy["enabled"] is False and policy["allow_displace"] == []
    finally:
        path.unlink()
