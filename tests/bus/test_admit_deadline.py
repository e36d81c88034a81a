"""No ghost pendings (issue 13): an admit answered after its caller's deadline leaves no entry.

The real daemon and the real shim on a private bus. The daemon is frozen
(SIGSTOP) while the shim admits, so the shim gives up (503, the proxy falls back)
with the admit still queued at the daemon; thawed (SIGCONT), the daemon handles
it after the deadline the shim passed (``AdmitBy``) and must not create the
pending entry whose id nobody received.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.bus import shim_fixtures
from tests.bus.conftest import DaemonProcess, call_json, wait_until
from tests.bus.shim_fixtures import ShimProcess, request

pytestmark = pytest.mark.bus


daemon = shim_fixtures.daemon
shim = shim_fixtures.shim


def pending_clients(daemon: DaemonProcess) -> list[str]:
    (text,) = call_json(daemon.uap.bus_address, "ListPending")
    return [entry["client"] for entry in json.loads(text)["pending"]]


def now_us() -> int:
    return time.monotonic_ns() // 1000


def test_admit_by_before_the_deadline_parks_as_admit_does(daemon: DaemonProcess) -> None:
    answer = call_json(
        daemon.uap.bus_address,
        "AdmitBy",
        "sssut",
        "beta",
        "in-time",
        "",
        "0",
        str(now_us() + 30_000_000),
    )
    assert (answer[0], answer[3]) == ("park", "not_resident") and answer[2].startswith("plc-")
    assert "in-time" in pending_clients(daemon)


def test_admit_by_after_the_deadline_changes_nothing(daemon: DaemonProcess) -> None:
    answer = call_json(
        daemon.uap.bus_address,
        "AdmitBy",
        "sssut",
        "beta",
        "too-late",
        "",
        "0",
        str(now_us() - 1),
    )
    assert answer == ["park", "", "", "deadline_passed"]
    assert "too-late" not in pending_clients(daemon)


def test_a_shim_admit_the_daemon_answers_too_late_leaves_no_pending_entry(
    daemon: DaemonProcess, shim: ShimProcess
) -> None:
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        reply = request(
            shim.base_url,
            "POST",
            "/api/placement/admit",
            {"model_id": "beta", "client": "ghost-client"},
        )
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    assert reply.status == 503, reply.raw  # the shim gave up; the proxy falls back
    assert "placement daemon unavailable" in reply.json()["error"]
    # The daemon has now handled the queued admit (its log says so) and made no entry.
    wait_until(lambda: "after its caller's deadline" in daemon.log(), "the late admit handled")
    assert "ghost-client" not in pending_clients(daemon)
    # And the same admit in time parks as usual.
    again = request(
        shim.base_url,
        "POST",
        "/api/placement/admit",
        {"model_id": "beta", "client": "ghost-client"},
    )
    assert again.status == 200 and again.json()["decision"] == "park"
    assert "ghost-client" in pending_clients(daemon)
