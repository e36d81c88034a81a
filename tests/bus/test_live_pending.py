"""Live pending views (issue 13) with the real daemon, the real CLI and the real shim.

A park whose only option stops the seeded ``alpha`` resident; a fake proxy (real
HTTP on loopback, serving docs/http-contract.md §3 ``/internal/placement/inflight`` from a
list the test sets) says what is in flight. ``ListPending``, the shim's
``/api/placement/pending``, ``uapplace pending`` and ``uapplace apply``'s
confirmation show that list as it is at the time of each call: the request
appears while the proxy lists it, goes when the proxy stops listing it, and is
"unknown (counts as busy)" while the proxy does not answer.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.bus.conftest import (
    SEEDED_ENDPOINT,
    DaemonProcess,
    UapEnv,
    alpha_resident_daemon,
    call_json,
    run_cli,
    wait_until,
)
from tests.bus.dbusmock_fixtures import private_bus
from tests.bus.shim_fixtures import ShimProcess, request, start_shim
from uapplace.io.engines import INFLIGHT_PATH

pytestmark = pytest.mark.bus

PROXY_TOKEN = "live-pending-token"
ALPHA_TARGET = f"gpu0:{SEEDED_ENDPOINT}"
IN_FLIGHT_REQUEST = {
    "id": "req-live-1",
    "client": "busy-client",
    "started_at": "2026-06-01T12:00:00Z",
}


@dataclass
class FakeProxy:
    """What the proxy answers on its in-flight route; ``targets=None`` answers 503."""

    targets: dict[str, list[dict[str, Any]]] | None = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def answer(self) -> tuple[int, bytes]:
        with self.lock:
            targets = self.targets
        if targets is None:
            return 503, b'{"error": "in-flight list unavailable"}'
        return 200, json.dumps({"targets": targets}).encode()

    def lists(self, targets: dict[str, list[dict[str, Any]]] | None) -> None:
        with self.lock:
            self.targets = targets


def proxy_handler(proxy: FakeProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.headers.get("Authorization") != f"Bearer {PROXY_TOKEN}":
                status, body = 401, b'{"error": "bad token"}'
            elif self.path != INFLIGHT_PATH:
                status, body = 404, b'{"error": "not found"}'
            else:
                status, body = proxy.answer()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # quiet: the daemon's log says what it asked

    return Handler


@pytest.fixture
def proxy() -> Iterator[tuple[FakeProxy, str]]:
    fake = FakeProxy()
    server = ThreadingHTTPServer(("127.0.0.1", 0), proxy_handler(fake))
    thread = threading.Thread(target=server.serve_forever, name="fake-proxy", daemon=True)
    thread.start()
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def own_bus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with private_bus("session", tmp_path_factory.mktemp("live-pending-bus")) as address:
        yield address


@pytest.fixture
def daemon(tmp_path: Path, own_bus: str, proxy: tuple[FakeProxy, str]) -> Iterator[DaemonProcess]:
    """uapplaced with ``alpha`` resident (the seeded engine serves it), asking our proxy."""
    proxy_env = {"UAP_PROXY_URL": proxy[1], "PROXY_AUTH_TOKEN": PROXY_TOKEN}
    with alpha_resident_daemon(tmp_path / "uap", own_bus, **proxy_env) as started:
        yield started


@pytest.fixture
def shim(daemon: DaemonProcess) -> Iterator[ShimProcess]:
    started = start_shim(daemon.uap.env, daemon.uap.bus_address, daemon.uap.root)
    try:
        yield started
    finally:
        assert started.stop() == 0, started.log()


def park_beta(uap: UapEnv) -> str:
    """Beta (20000 MiB) does not fit next to alpha (8000 MiB): one displace option."""
    answer = call_json(uap.bus_address, "Admit", "sssu", "beta", "live-asker", "", "0")
    assert answer[0] == "park", answer
    placement_id: str = answer[2]

    def planned() -> bool:
        return bool(bus_entry(uap, placement_id)["options"])

    wait_until(planned, f"options for {placement_id}")
    return placement_id


def entry_of(listed: dict[str, Any], placement_id: str) -> dict[str, Any]:
    entry: dict[str, Any] = next(e for e in listed["pending"] if e["id"] == placement_id)
    return entry


def bus_entry(uap: UapEnv, placement_id: str) -> dict[str, Any]:
    (text,) = call_json(uap.bus_address, "ListPending")
    return entry_of(json.loads(text), placement_id)


def alpha_victim(entry: dict[str, Any]) -> dict[str, Any]:
    (option,) = entry["options"]
    (victim,) = option["victims"]
    assert (victim["model"], victim["config"]) == ("alpha", "alpha-q4")
    assert option["signature"] == ["alpha/alpha-q4"]  # the planned option is unchanged
    return victim  # type: ignore[no-any-return]


def every_view(uap: UapEnv, shim: ShimProcess, placement_id: str) -> list[dict[str, Any]]:
    """The victim as ListPending, the shim and ``uapplace pending --json`` show it now."""
    over_http = request(shim.base_url, "GET", "/api/placement/pending", token=shim.token)
    assert over_http.status == 200, over_http.raw
    done = run_cli(uap, "pending", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    return [
        alpha_victim(bus_entry(uap, placement_id)),
        alpha_victim(entry_of(over_http.json(), placement_id)),
        alpha_victim(entry_of(json.loads(done.stdout), placement_id)),
    ]


def pending_text(uap: UapEnv) -> str:
    done = run_cli(uap, "pending")
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_in_flight_work_on_a_victim_is_shown_as_the_proxy_lists_it_at_call_time(
    daemon: DaemonProcess, shim: ShimProcess, proxy: tuple[FakeProxy, str]
) -> None:
    uap = daemon.uap
    fake = proxy[0]
    placement_id = park_beta(uap)
    for victim in every_view(uap, shim, placement_id):
        assert (victim["in_flight"], victim["holders"]) == (False, [])

    fake.lists({ALPHA_TARGET: [IN_FLIGHT_REQUEST]})
    holder = {
        "client": "busy-client",
        "kind": "inflight",
        "detail": "req-live-1",
        "started_at": "2026-06-01T12:00:00Z",
    }
    for victim in every_view(uap, shim, placement_id):
        assert (victim["in_flight"], victim["holders"]) == (True, [holder])
        assert victim["consequence"] == "active generation aborted; context lost"
    assert "alpha/alpha-q4 (hot): in flight yes; holders busy-client (inflight)" in pending_text(
        uap
    )

    fake.lists({})  # the request finished: the proxy no longer lists it
    for victim in every_view(uap, shim, placement_id):
        assert (victim["in_flight"], victim["holders"]) == (False, [])
    assert "alpha/alpha-q4 (hot): in flight no; holders none" in pending_text(uap)

    fake.lists(None)  # the proxy does not answer: unknown, counted as busy
    for victim in every_view(uap, shim, placement_id):
        assert (victim["in_flight"], victim["holders"]) == (None, [])
    assert "in flight unknown (counts as busy); holders none" in pending_text(uap)


def test_the_apply_confirmation_shows_the_request_in_flight_now(
    daemon: DaemonProcess, proxy: tuple[FakeProxy, str]
) -> None:
    uap = daemon.uap
    placement_id = park_beta(uap)
    proxy[0].lists({ALPHA_TARGET: [IN_FLIGHT_REQUEST]})
    # Not a terminal and no --yes: the impact is shown, nothing is applied.
    done = run_cli(uap, "apply", placement_id, "1")
    assert done.returncode != 0
    assert "busy-client (inflight)" in done.stdout
    assert "active generation aborted; context lost" in done.stdout
    assert "nothing stopped" in done.stderr + done.stdout
    assert bus_entry(uap, placement_id)["options"]  # still pending, still planned
