"""The shim under hostile or careless HTTP clients (issue 11), real shim and daemon processes.

- slow clients: headers that never finish, or no request at all, are cut after
  ``--header-timeout``; a body that stalls gets ``408`` and the connection closed;
- the connection cap: over ``--max-connections`` a connection gets ``503`` at
  once and is closed, with one log line rather than one per connection; the
  descriptor limit lowers the cap so ``accept()`` never hits ``EMFILE`` (no log
  flood), and admits work again as soon as the flood is gone;
- admit refuses non-JSON bodies (``415``) and any foreign ``Origin`` (``403``)
  before anything reaches the daemon: no pending entry appears;
- a client hanging up mid-body is neither an error nor a traceback in the log.

Timeouts here are cut to 1 s so the tests wait little; nothing asserts a duration.
"""

from __future__ import annotations

import json
import resource
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.bus import shim_fixtures
from tests.bus.conftest import DaemonProcess, UapEnv, call_json, wait_until
from tests.bus.shim_fixtures import (
    LISTENING,
    STARTUP_TIMEOUT_S,
    ShimProcess,
    request,
    start_shim,
    without_guid,
)
from tests.worlds.commands import shim_argv
from uapplace.shim.routes import ROUTES

pytestmark = pytest.mark.bus

ADMIT = ROUTES["admit"]
SOCKET_TIMEOUT_S = 30.0
"""Far above the shim's 1 s timeouts: a test that reaches it fails (the shim held on)."""


daemon = shim_fixtures.daemon


@pytest.fixture(scope="module")
def shim(uap_env: UapEnv, daemon: DaemonProcess) -> Iterator[ShimProcess]:
    started = start_shim(
        uap_env.env,
        uap_env.bus_address,
        uap_env.root,
        "--header-timeout",
        "1",
        "--body-timeout",
        "1",
    )
    try:
        yield started
    finally:
        assert started.stop() == 0, started.log()


def connect(shim: ShimProcess) -> socket.socket:
    parts = urlsplit(shim.base_url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=SOCKET_TIMEOUT_S)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the shim sends until it closes (a timeout here fails the test)."""
    data = bytearray()
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return bytes(data)


def pending_clients(address: str) -> set[str]:
    (text,) = call_json(address, "ListPending")
    return {entry["client"] for entry in json.loads(text)["pending"]}


def admit(shim: ShimProcess, client: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    body = json.dumps({"model_id": "beta", "client": client}).encode()
    reply = request(shim.base_url, "POST", ADMIT, data=body, headers=headers)
    parsed: dict[str, str] = reply.json()
    return reply.status, parsed


# --------------------------------------------------------------------------- slow clients


def test_headers_that_never_finish_are_cut(shim: ShimProcess) -> None:
    with connect(shim) as sock:
        sock.sendall(b"POST /api/placement/admit HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        for _ in range(3):  # a slow-loris keeps dribbling bytes
            time.sleep(0.4)
            try:
                sock.sendall(b"a")
            except (BrokenPipeError, ConnectionResetError):
                break
        assert read_until_closed(sock) == b""  # closed without an answer: nothing was asked


def test_a_connection_that_sends_nothing_is_closed(shim: ShimProcess) -> None:
    with connect(shim) as sock:
        assert read_until_closed(sock) == b""


def test_a_stalled_body_is_408_and_the_connection_closed(shim: ShimProcess) -> None:
    with connect(shim) as sock:
        sock.sendall(
            b"POST /api/placement/admit HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
            b'{"model_id": "be'
        )
        answer = read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 ")
    assert json.loads(body) == {"error": "request body not received within 1 s"}


def test_a_client_that_hangs_up_mid_body_is_not_an_error(
    shim: ShimProcess, uap_env: UapEnv
) -> None:
    before = shim.log()
    for _ in range(5):
        with connect(shim) as sock:
            sock.sendall(
                b"POST /api/placement/admit HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{"
            )
            time.sleep(0.05)
    status, parsed = admit(shim, "after-hangups", {"Content-Type": "application/json"})
    assert status == 200, parsed  # still serving; and it logged nothing for the hang-ups
    new = shim.log()[len(before) :]
    assert "Traceback" not in new and "ERROR" not in new, new


# --------------------------------------------------------------------------- admit refusals


@pytest.mark.parametrize(
    ("content_type", "shown"),
    [
        ("text/plain", "Content-Type 'text/plain'"),
        ("text/plain;charset=UTF-8", "Content-Type 'text/plain;charset=UTF-8'"),
        ("application/x-www-form-urlencoded", "Content-Type 'application/x-www-form-urlencoded'"),
        ("multipart/form-data; boundary=x", "Content-Type 'multipart/form-data; boundary=x'"),
        (None, "no Content-Type"),
    ],
)
def test_admit_refuses_anything_but_json_with_415(
    shim: ShimProcess, uap_env: UapEnv, content_type: str | None, shown: str
) -> None:
    client = f"ctype-{content_type}"
    headers = {} if content_type is None else {"Content-Type": content_type}
    status, parsed = admit(shim, client, headers)
    assert (status, parsed) == (415, {"error": f"admit takes application/json, got {shown}"})
    assert client not in pending_clients(uap_env.bus_address)


def test_admit_takes_json_with_a_charset(shim: ShimProcess) -> None:
    status, parsed = admit(
        shim, "json-charset", {"Content-Type": "application/json; charset=utf-8"}
    )
    assert status == 200 and parsed["decision"] == "park", parsed


@pytest.mark.parametrize(
    "origin", ["https://evil.example", "http://127.0.0.1.evil.example", "null", "file://"]
)
def test_admit_refuses_a_foreign_origin_with_403(
    shim: ShimProcess, uap_env: UapEnv, origin: str
) -> None:
    client = f"origin-{origin}"
    status, parsed = admit(shim, client, {"Content-Type": "application/json", "Origin": origin})
    assert status == 403
    assert parsed["error"].startswith(f"Origin {origin!r} is not a loopback origin")
    assert client not in pending_clients(uap_env.bus_address)


@pytest.mark.parametrize(
    "origin", ["http://127.0.0.1:4000", "http://localhost:8080", "http://[::1]:3847"]
)
def test_admit_from_a_loopback_origin_is_served(shim: ShimProcess, origin: str) -> None:
    status, parsed = admit(
        shim, f"loopback-{origin}", {"Content-Type": "application/json", "Origin": origin}
    )
    assert status == 200, parsed


def test_other_routes_refuse_a_foreign_origin_too(shim: ShimProcess) -> None:
    reply = request(
        shim.base_url, "GET", ROUTES["state"], headers={"Origin": "https://evil.example"}
    )
    assert reply.status == 403


# --------------------------------------------------------------------------- connection cap


def start_capped_shim(uap: UapEnv, *args: str, nofile: int | None = None) -> ShimProcess:
    """``start_shim`` with a long header timeout (held connections stay held), optionally
    under an ``RLIMIT_NOFILE`` of ``nofile`` (soft and hard, as ``LimitNOFILE=`` sets it)."""
    log_path = uap.root / f"shim-capped-{time.monotonic_ns()}.log"
    argv = shim_argv(without_guid(uap.bus_address), "--header-timeout", "60", *args)

    def limit() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    with log_path.open("wb") as log:
        process = subprocess.Popen(
            argv, env=uap.env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=limit
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while not (found := LISTENING.search(log_path.read_text(errors="replace"))):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise AssertionError(f"uapplace-shim did not listen:\n{log_path.read_text()}")
        time.sleep(0.05)
    token = (Path(uap.env["XDG_RUNTIME_DIR"]) / "uapplace" / "token").read_text().strip()
    return ShimProcess(process, found.group(1), token, log_path)


def test_over_the_cap_a_connection_gets_503_at_once_and_one_log_line(
    uap_env: UapEnv, daemon: DaemonProcess
) -> None:
    shim = start_capped_shim(uap_env, "--max-connections", "4")
    held: list[socket.socket] = []
    try:
        held = [connect(shim) for _ in range(4)]
        wait_until(lambda: _probe_refused(shim), "the cap to be reached", timeout=10)
        for _ in range(30):
            assert _probe_refused(shim)
        assert shim.log().count("new ones are answered 503") == 1, shim.log()
        for sock in held:
            sock.close()
        held = []
        reply = wait_until(
            lambda: _admit_ok(shim), "admits to be served once the cap frees", timeout=10
        )
        assert reply
    finally:
        for sock in held:
            sock.close()
        assert shim.stop() == 0, shim.log()


def _probe_refused(shim: ShimProcess) -> bool:
    """A new connection is answered 503 and closed (``False``: it was taken in instead)."""
    with connect(shim) as sock:
        sock.settimeout(2.0)
        try:
            answer = read_until_closed(sock)
        except TimeoutError:
            return False  # served (it waits for our request): the cap is not reached yet
    if not answer:
        return False
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 "), answer
    assert json.loads(body) == {"error": "uapplace-shim is at its connection limit; retry"}
    return True


def _admit_ok(shim: ShimProcess) -> bool:
    reply = request(shim.base_url, "POST", ADMIT, {"model_id": "alpha", "client": "after-cap"})
    return reply.status == 200


def test_a_low_descriptor_limit_lowers_the_cap_and_a_flood_does_not_flood_the_log(
    uap_env: UapEnv, daemon: DaemonProcess
) -> None:
    """The issue's case: RLIMIT_NOFILE 256 and 600 connections at once."""
    shim = start_capped_shim(uap_env, nofile=256)
    flood: list[socket.socket] = []
    try:
        assert "serving at most 64 connections, not 512" in shim.log()
        parts = urlsplit(shim.base_url)
        for _ in range(600):
            sock = socket.socket()
            sock.setblocking(False)  # no waiting on a full backlog: a flood, not a queue
            sock.connect_ex((parts.hostname, parts.port))
            flood.append(sock)
        wait_until(lambda: _probe_refused(shim), "the lowered cap to be reached", timeout=20)
        for sock in flood:
            sock.close()
        flood = []
        wait_until(lambda: _admit_ok(shim), "admits to be served after the flood", timeout=20)
        log = shim.log()
        assert log.count("socket.accept() out of system resource") == 0, log[-2000:]
        assert log.count("accept() failed") <= 1, log[-2000:]
        assert log.count("new ones are answered 503") <= 2, log[-2000:]
    finally:
        for sock in flood:
            sock.close()
        assert shim.stop() == 0, shim.log()
