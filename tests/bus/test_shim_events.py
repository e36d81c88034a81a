"""Issue 13 through the real ``uapplace-shim`` in front of the real daemon (bus tier):

- ``GET /api/placement/events``: a park and its resolution as SSE, in order, and a
  reconnect with ``Last-Event-ID`` that loses nothing; a bad resume point is a 400;
- ``GET /api/placement/targets``: the seeded resident's rails, registry × live ``/slots``;
- ``/metrics``: admits that never touched the shim (busctl on the bus) are counted.
"""

from __future__ import annotations

import json
import re
import socket
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.bus import shim_fixtures
from tests.bus.conftest import (
    SEEDED_ENDPOINT,
    DaemonProcess,
    call,
    call_json,
    run_cli,
)
from tests.bus.shim_fixtures import (
    ShimProcess,
    request,
)
from tests.worlds.exposition import sample
from uapplace.bus.events import parse_sse

pytestmark = pytest.mark.bus

GUARD_S = 20.0


daemon = shim_fixtures.daemon
shim = shim_fixtures.shim


class SseReader:
    """A raw HTTP/1.1 SSE client (socket level, like a dashboard's EventSource)."""

    def __init__(self, base_url: str, last_event_id: str | None = None) -> None:
        parts = urlsplit(base_url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=GUARD_S)
        head = "GET /api/placement/events HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        if last_event_id is not None:
            head += f"Last-Event-ID: {last_event_id}\r\n"
        self.sock.sendall((head + "\r\n").encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self._more()
        status_line, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        self.head = status_line.decode()
        self.text = ""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise AssertionError(f"the stream ended; so far: {self.buffer!r}")
        self.buffer += chunk

    def events(self, count: int) -> list[tuple[str, str | None, Any]]:
        """The next ``count`` messages (chunked framing stripped, keepalives skipped)."""
        while True:
            self.text += _dechunk(self)
            messages = parse_sse(self.text)
            if len(messages) >= count:
                return [(m.event, m.id, json.loads(m.data)) for m in messages[:count]]
            self._more()

    def close(self) -> None:
        self.sock.close()


def _dechunk(reader: SseReader) -> str:
    """Take every complete chunk out of ``reader.buffer`` (HTTP/1.1 chunked encoding)."""
    out = b""
    while True:
        size_line, sep, rest = reader.buffer.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line.split(b";")[0], 16)
        if len(rest) < size + 2:
            break
        out += rest[:size]
        reader.buffer = rest[size + 2 :]
    return out.decode()


def admit_over_shim(shim: ShimProcess, model: str, client: str) -> str:
    reply = request(
        shim.base_url, "POST", "/api/placement/admit", {"model_id": model, "client": client}
    )
    assert reply.status == 200, reply.raw
    body = reply.json()
    assert body["decision"] == "park"
    return str(body["placement_id"])


def test_sse_shows_a_park_and_its_resolution_and_resumes_without_loss(
    shim: ShimProcess, daemon: DaemonProcess
) -> None:
    reader = SseReader(shim.base_url)
    try:
        assert reader.head.startswith("HTTP/1.1 200")
        assert "text/event-stream" in reader.head.lower()
        first = admit_over_shim(shim, "beta", "sse-one")
        dismissed = request(
            shim.base_url,
            "POST",
            "/api/placement/dismiss",
            {"placement_id": first},
            token=shim.token,
        )
        assert dismissed.status == 200, dismissed.raw
        parked, resolved = reader.events(2)
    finally:
        reader.close()  # the client leaves
    assert (parked[0], parked[2]["data"]["placement_id"]) == ("Parked", first)
    assert resolved[0] == "Resolved"
    assert resolved[2]["data"] == {"placement_id": first, "outcome": "dismissed"}
    # While nobody listens: two more parks. The reconnect with Last-Event-ID gets both.
    away = [admit_over_shim(shim, "beta", f"sse-away-{n}") for n in (1, 2)]
    resumed_reader = SseReader(shim.base_url, last_event_id=resolved[1])
    try:
        resumed = resumed_reader.events(2)
    finally:
        resumed_reader.close()
    assert [r[0] for r in resumed] == ["Parked", "Parked"]
    assert [r[2]["data"]["placement_id"] for r in resumed] == away
    assert [int(r[1] or 0) for r in resumed] == [
        int(resolved[1] or 0) + 1,
        int(resolved[1] or 0) + 2,
    ]


def test_a_bad_last_event_id_is_a_400_naming_the_header(shim: ShimProcess) -> None:
    reply = request(
        shim.base_url, "GET", "/api/placement/events", headers={"Last-Event-ID": "yesterday"}
    )
    assert reply.status == 400
    assert "Last-Event-ID" in reply.json()["error"]


def test_targets_give_the_rails_of_each_resident_target(shim: ShimProcess) -> None:
    reply = request(shim.base_url, "GET", "/api/placement/targets")
    assert reply.status == 200, reply.raw
    (target,) = reply.json()["targets"]
    assert target["target_id"] == f"gpu0:{SEEDED_ENDPOINT}"
    # The registry declares 1 and the seeded fake engine runs one slot (/props total_slots,
    # read before /slots, which would wake a sleeping llama.cpp): they agree.
    assert (target["rails"], target["rails_source"], target["state"]) == (1, "props", "ok")
    assert target["agrees"] is True


def test_bus_admits_are_counted_in_metrics(shim: ShimProcess, daemon: DaemonProcess) -> None:
    for client in ("metrics-bus-1", "metrics-bus-2"):
        decision = call_json(daemon.uap.bus_address, "Admit", "sssu", "gamma", client, "", "0")
        assert decision[0] == "park"
    done = call(daemon.uap.bus_address, "Admit", "sssu", "alpha", "metrics-bus-3", "", "0")
    assert done.returncode == 0, done.stderr
    reply = request(shim.base_url, "GET", "/metrics")
    metrics = reply.raw.decode()
    parked = sample(metrics, "uapplace_admits_total", decision="park", reason="no_measured_config")
    assert parked is not None and parked >= 2
    forwarded = sample(metrics, "uapplace_admits_total", decision="forward", reason="")
    assert forwarded is not None and forwarded >= 1
    # The shim carried none of those: its own counter has no gamma parks.
    shim_parks = "uapplace_shim_admits_total"
    assert sample(metrics, shim_parks, decision="park", reason="no_measured_config") is None
    target = {"target_id": f"gpu0:{SEEDED_ENDPOINT}", "model": "alpha"}
    assert sample(metrics, "uapplace_target_rails", **target, source="props", state="ok") == 1
    assert sample(metrics, "uapplace_target_rails_agree", **target) == 1


def test_status_shows_the_rails_of_each_target(daemon: DaemonProcess) -> None:
    shown = run_cli(daemon.uap, "status", env={**daemon.uap.env, "COLUMNS": "250"})
    assert shown.returncode == 0, shown.stderr
    assert "Targets (rails)" in shown.stdout
    row = next(line for line in shown.stdout.splitlines() if f"gpu0:{SEEDED_ENDPOINT}" in line)
    assert re.search(r"alpha\s*│\s*1\s*│\s*props\s*│\s*ok", row), shown.stdout
