"""The real ``uapplace-shim`` process for the bus tier, and a plain HTTP client for it.

The daemon and the bus come from ``tests/bus/conftest.py`` (``make_env``,
``start_daemon``, ``private_bus``); this module only adds the shim in front:

- :func:`start_shim` runs ``python -m uapplace.shim --port 0`` against a bus and
  returns once it listens (its port read from its log line), with the token it
  created under the environment's ``XDG_RUNTIME_DIR``;
- :func:`request` sends one request with :mod:`http.client` (raw bytes in, raw
  bytes out) so tests see exactly what the proxy would;
- :func:`daemon` and :func:`shim`: module-scoped fixtures, the daemon on a ledger with
  ``alpha`` resident and the shim in front of it; a test module takes them by name
  (``daemon = shim_fixtures.daemon``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.client import HTTPConnection
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.bus.conftest import (
    SEEDED_ENDPOINT,
    DaemonProcess,
    UapEnv,
    start_daemon,
    wait_published,
    wait_until,
)
from tests.worlds.commands import shim_argv
from tests.worlds.seed_docs import alpha_ledger
from uapplace.files.paths import BUS_NAME

STARTUP_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 15.0
HTTP_TIMEOUT_S = 10.0
LISTENING = re.compile(r"listening on (http://127\.0\.0\.1:\d+)")

SEEDED_LEDGER: dict[str, Any] = alpha_ledger(SEEDED_ENDPOINT)


def without_guid(address: str) -> str:
    """``unix:path=…,guid=…`` → ``unix:path=…`` (a bus restarted on one socket has a new guid)."""
    return ",".join(part for part in address.split(",") if not part.startswith("guid="))


@dataclass
class ShimProcess:
    process: subprocess.Popen[bytes]
    base_url: str
    token: str
    log_path: Path

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> int:
        """SIGTERM by PID, wait; SIGKILL if it hangs (and fail loudly then)."""
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGTERM)
        try:
            return self.process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"uapplace-shim ignored SIGTERM; log:\n{self.log()}") from None


def start_shim(env: dict[str, str], bus_address: str, log_dir: Path, *args: str) -> ShimProcess:
    """Start the shim on an OS-picked loopback port; fail with its log if it does not listen."""
    log_path = log_dir / f"shim-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            shim_argv(without_guid(bus_address), *args),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        text = log_path.read_text(encoding="utf-8", errors="replace")
        found = LISTENING.search(text)
        if found:
            break
        if process.poll() is not None:
            raise AssertionError(f"uapplace-shim exited {process.returncode}:\n{text}")
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            raise AssertionError(f"uapplace-shim did not listen:\n{text}")
        time.sleep(0.05)
    token_file = Path(env["XDG_RUNTIME_DIR"]) / "uapplace" / "token"
    token = token_file.read_text(encoding="ascii").strip()
    return ShimProcess(process, found.group(1), token, log_path)


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    raw: bytes

    def json(self) -> Any:
        return json.loads(self.raw)


def request(
    base_url: str,
    method: str,
    path: str,
    body: Any = None,
    *,
    data: bytes | None = None,
    headers: dict[str, str] | None = None,
    token: str | None = None,
    timeout: float = HTTP_TIMEOUT_S,
) -> Reply:
    """One request on a fresh connection; ``body`` is sent as JSON, ``data`` as it is."""
    parts = urlsplit(base_url)
    connection = HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    sent = dict(headers or {})
    if token is not None:
        sent["x-uap-dashboard-token"] = token
    if body is not None:
        data = json.dumps(body).encode()
        sent.setdefault("Content-Type", "application/json")
    try:
        connection.request(method, path, body=data, headers=sent)
        response = connection.getresponse()
        raw = response.read()
        return Reply(response.status, {k.lower(): v for k, v in response.getheaders()}, raw)
    finally:
        connection.close()


def seeded_daemon(uap_env: UapEnv) -> Iterator[DaemonProcess]:
    """A module's daemon on a ledger with ``alpha`` resident, yielded once fully wired."""
    uap_env.seed_ledger(SEEDED_LEDGER)
    started = start_daemon(uap_env)
    # It logs this once every collaborator is wired: before, writes say "not available".
    wait_until(lambda: f"owns {BUS_NAME}" in started.log(), "uapplaced to finish wiring")
    try:
        wait_published(uap_env.bus_address)
        yield started
    finally:
        assert started.stop() == 0, started.log()


def running_shim(uap_env: UapEnv) -> Iterator[ShimProcess]:
    """The real ``uapplace-shim`` on the module's bus, stopped cleanly afterwards."""
    started = start_shim(uap_env.env, uap_env.bus_address, uap_env.root)
    try:
        yield started
    finally:
        assert started.stop() == 0, started.log()


@pytest.fixture(scope="module")
def daemon(uap_env: UapEnv) -> Iterator[DaemonProcess]:
    """The module's :func:`seeded_daemon`."""
    yield from seeded_daemon(uap_env)


@pytest.fixture(scope="module")
def shim(uap_env: UapEnv, daemon: DaemonProcess) -> Iterator[ShimProcess]:
    """The module's :func:`running_shim`, in front of :func:`daemon`."""
    yield from running_shim(uap_env)
