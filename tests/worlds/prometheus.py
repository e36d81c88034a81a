"""Prometheus's own tools for the tests: Debian's ``promtool`` and a real ``prometheus``
server (the ``prometheus`` package, installed by ``scripts/setup-system.sh``), and the
shipped rules of ``contrib/prometheus/``.

Without the binaries a test skips, naming the package; with
``UAPPLACE_REQUIRE_PROMETHEUS=1`` (CI) it fails instead. :class:`PrometheusServer`
runs one server on 127.0.0.1 with a temporary configuration and storage, scraping and
evaluating every second, and is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

from uapplace.sim.usermanager import terminate

REPO = Path(__file__).resolve().parents[2]
CONTRIB = REPO / "contrib" / "prometheus"
RULES = CONTRIB / "uapplace.rules.yml"
JOB = "uapplace-shim"
"""The scrape job the shipped rules name (``UapplaceShimDown``)."""
REQUIRE = "UAPPLACE_REQUIRE_PROMETHEUS"
READY_GUARD_S = 30.0
"""A hang guard for the server's start (it is ready in about a second)."""
PARKED_ALERT = "UapplaceRequestsParkedTooLong"
"""The shipped alert a parked request fires (its ``for:`` shortened by the tests)."""
UNTIL_GUARD_S = 60.0
"""A hang guard for :func:`until`: the alert fires a few seconds after the first scrapes."""
T = TypeVar("T")


def binary(name: str) -> str:
    """``promtool`` or ``prometheus`` on ``PATH``; skip (fail under :data:`REQUIRE`) without."""
    found = shutil.which(name)
    if found is None:
        why = f"no {name} on PATH (Debian's `prometheus` package; `make setup` installs it)"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"{REQUIRE}=1 but {why}")
        pytest.skip(why)
    return found


def rules_with_for(alert: str, duration: str) -> str:
    """The shipped rules with ``alert``'s ``for:`` set to ``duration``: a test copy."""
    text = RULES.read_text(encoding="utf-8")
    pattern = re.compile(rf"(- alert: {re.escape(alert)}\n(?:(?!\s*- alert:).*\n)*?\s*for: )\S+")
    copy, count = pattern.subn(rf"\g<1>{duration}", text)
    assert count == 1, f"{RULES}: no `for:` under alert {alert}"
    return copy


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def config_text(targets: list[str], rule_file: Path) -> str:
    listed = ", ".join(f'"{t}"' for t in targets)
    return (
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n"
        f"rule_files:\n  - {rule_file}\n"
        f"scrape_configs:\n  - job_name: {JOB}\n    static_configs:\n"
        f"      - targets: [{listed}]\n"
    )


@dataclass
class PrometheusServer:
    process: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @classmethod
    def start(cls, root: Path, targets: list[str], rules: str) -> PrometheusServer:
        """A server scraping ``targets`` (``host:port``) as :data:`JOB` with ``rules``."""
        program = binary("prometheus")
        root.mkdir(parents=True, exist_ok=True)
        rule_file = root / "rules.yml"
        rule_file.write_text(rules, encoding="utf-8")
        config = root / "prometheus.yml"
        config.write_text(config_text(targets, rule_file), encoding="utf-8")
        port = free_port()
        log_path = root / "prometheus.log"
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [
                    program,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={root / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        server = cls(process, f"http://127.0.0.1:{port}", log_path)
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
        return server

    def log(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")[-3000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_GUARD_S
        while True:
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited {self.process.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError):
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"prometheus never got ready:\n{self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        """SIGTERM by PID, then SIGKILL if it lingers (:func:`terminate`)."""
        terminate(self.process)

    def api(self, path: str) -> Any:
        """One ``/api/v1`` read's ``data``; a non-success answer fails with the log."""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}", timeout=5) as reply:
            body = reply.read()
        document = json.loads(body)
        assert document.get("status") == "success", (path, document, self.log())
        return document["data"]

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self.api("alerts")["alerts"]
        return alerts

    def query(self, expr: str) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.api("query?query=" + urllib.parse.quote(expr, safe=""))[
            "result"
        ]
        return result

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self.api("targets")["activeTargets"]
        return active


async def until(what: str, server: PrometheusServer, check: Callable[[], T | None]) -> T:
    """Poll ``check`` (a blocking query, run in a thread) until it returns something truthy;
    fail after :data:`UNTIL_GUARD_S` with the server's log."""
    deadline = asyncio.get_running_loop().time() + UNTIL_GUARD_S
    while True:
        found = await asyncio.to_thread(check)
        if found:
            return found
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(
                f"{what} within {UNTIL_GUARD_S:g} s; prometheus log:\n{server.log()}"
            )
        await asyncio.sleep(0.5)
