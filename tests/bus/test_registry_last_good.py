"""The real daemon keeps the last good machine-local registry over a SIGHUP that finds the
file broken (issue 20), says so in an alert and in ``Validate``, and takes the file again
once it is fixed."""

from __future__ import annotations

import json
import signal
from typing import Any

import pytest

from tests.bus.conftest import DaemonProcess, call_json, wait_until

pytestmark = pytest.mark.bus


def state(daemon: DaemonProcess) -> dict[str, Any]:
    (text,) = call_json(daemon.uap.bus_address, "GetState")
    loaded: dict[str, Any] = json.loads(text)
    return loaded


def local_state(daemon: DaemonProcess) -> str:
    return str(state(daemon)["registry"]["local_state"])


def measured(daemon: DaemonProcess) -> list[str]:
    (text,) = call_json(daemon.uap.bus_address, "Validate")
    rows = json.loads(text)["provenance"]
    return sorted(r["entry"] for r in rows if r.get("source") == "local")


def test_a_broken_local_registry_on_sighup_keeps_the_last_good_one(daemon: DaemonProcess) -> None:
    local = daemon.uap.local_registry
    good = local.read_text()
    assert local_state(daemon) == "loaded"
    before = measured(daemon)
    assert before, "the sandbox registry records measurements in the local file"
    try:
        local.write_text('{"version": 1, "models": {"alpha": 7}}')
        daemon.signal(signal.SIGHUP)
        wait_until(lambda: local_state(daemon) == "last-good", "the reload kept the last good")
        assert measured(daemon) == before
        (text,) = call_json(daemon.uap.bus_address, "Validate")
        findings = [f for f in json.loads(text)["findings"] if f["file"] == str(local)]
        assert findings and findings[0]["json_path"] == "$.models.alpha"
        assert "keeps the last good version it read before" in findings[0]["message"]
        alerts = [a for a in state(daemon)["alerts"] if a["subject"] == str(local)]
        assert alerts and alerts[0]["kind"] == "config_error"
        assert "the last good version read before stays in force" in alerts[0]["message"]
    finally:
        local.write_text(good)
        daemon.signal(signal.SIGHUP)
    wait_until(lambda: local_state(daemon) == "loaded", "the fixed file is taken again")
    assert "Traceback" not in daemon.log()
