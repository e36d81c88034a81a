"""A proxy that refuses our token is named as such (issue 13), with the real daemon.

The proxy is ``uapplace.sim.gateproxy`` as its own process with token ``right``;
``uapplaced`` is given ``wrong``. ``Validate`` reports the mismatch as an error and
``GetState`` carries one critical ``token_mismatch`` alert (the drain that stops on
it at once is in tests/unit/test_enforce_unit.py; it needs units to run).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bus.conftest import (
    DaemonProcess,
    call_json,
    free_port,
    make_env,
    start_daemon,
)
from tests.worlds.gate_proxy import gate_proxy_process

pytestmark = pytest.mark.bus


@pytest.fixture
def proxy_url(tmp_path: Path) -> Iterator[str]:
    env = {"PATH": "/usr/bin:/bin", "PROXY_AUTH_TOKEN": "right", "HOME": str(tmp_path)}
    with gate_proxy_process(env, "--port", str(free_port())) as url:
        yield url


@pytest.fixture
def daemon(tmp_path: Path, bus_address: str, proxy_url: str) -> Iterator[DaemonProcess]:
    uap = make_env(tmp_path / "uap", bus_address)
    uap.env.update({"UAP_PROXY_URL": proxy_url, "PROXY_AUTH_TOKEN": "wrong"})
    started = start_daemon(uap)
    try:
        yield started
    finally:
        assert started.stop() == 0, started.log()


def test_a_wrong_proxy_token_is_an_error_and_one_critical_alert(
    daemon: DaemonProcess, proxy_url: str
) -> None:
    address = daemon.uap.bus_address
    for _ in range(2):  # asked twice: still one alert
        (text,) = call_json(address, "Validate")
        report = json.loads(text)
    assert report["ok"] is False
    (finding,) = [f for f in report["findings"] if f["file"] == proxy_url]
    assert finding["severity"] == "error"
    assert "refused the token from PROXY_AUTH_TOKEN (HTTP 401)" in finding["message"]
    assert "different tokens" in finding["message"]
    (state_text,) = call_json(address, "GetState")
    alerts = [a for a in json.loads(state_text)["alerts"] if a["kind"] == "token_mismatch"]
    assert [(a["severity"], a["subject"], a["count"]) for a in alerts] == [
        ("critical", proxy_url, 1)
    ]
    assert "HTTP 401" in daemon.log()
