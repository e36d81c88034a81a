"""A real Prometheus scrapes the demo's shim and one of the shipped alerts fires.

The demo's sandbox (:class:`uapplace.demo.sandbox.Sandbox`: a contained ``systemd
--user``, the simulated GPU, the fake engines as units, ``uapplaced`` and
``uapplace-shim``) is built as ``uapplace demo`` builds it. A request for
``writer-13b`` parks. Debian's ``prometheus`` (:class:`tests.worlds.prometheus.PrometheusServer`,
127.0.0.1, temporary configuration and storage, scrape and evaluation every second)
scrapes the shim as job ``uapplace-shim`` with a copy of ``contrib/prometheus/uapplace.rules.yml``
in which ``UapplaceRequestsParkedTooLong`` waits 2 s instead of 10 min; it must fire,
as ``/api/v1/alerts`` shows, and the scrape must be healthy (the content type, the
names, the recording rules all as Prometheus reads them). The server is stopped by its
PID, the sandbox torn down as the demo's is.
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.systemd.conftest import require_containment
from tests.worlds.prometheus import (
    JOB,
    UNTIL_GUARD_S,
    PrometheusServer,
    binary,
    rules_with_for,
    until,
)
from tests.worlds.prometheus import PARKED_ALERT as ALERT
from uapplace.demo.sandbox import WRITER, Sandbox, SandboxSpec
from uapplace.demo.walkthrough import shim_admit

pytestmark = pytest.mark.systemd


def firing(server: PrometheusServer, name: str) -> dict[str, Any] | None:
    return next(
        (a for a in server.alerts() if a["labels"]["alertname"] == name and a["state"] == "firing"),
        None,
    )


def value(server: PrometheusServer, expr: str) -> float | None:
    result = server.query(expr)
    return float(result[0]["value"][1]) if result else None


async def test_a_real_prometheus_scrapes_the_demos_shim_and_an_alert_fires(
    tmp_path: Path,
) -> None:
    require_containment()
    binary("prometheus")
    async with AsyncExitStack() as stack:
        box = await Sandbox.create(stack, SandboxSpec(), contain=True)
        answer = await shim_admit(box, WRITER.key, "prometheus-test")
        assert answer["decision"] == "park", answer
        target = box.shim_url.removeprefix("http://")
        rules = rules_with_for(ALERT, "2s")
        server = await asyncio.to_thread(PrometheusServer.start, tmp_path / "prom", [target], rules)
        stack.callback(server.stop)

        alert = await until(f"{ALERT} firing", server, lambda: firing(server, ALERT))
        assert alert["labels"] == {
            "alertname": ALERT,
            "severity": "warning",
            "job": JOB,
            "instance": target,
        }
        assert alert["annotations"]["summary"] == (
            f"Requests have been parked for over 10 minutes on {target}"
        )
        assert "(1 pending now)" in alert["annotations"]["description"]

        (scraped,) = await asyncio.to_thread(server.targets)
        assert (scraped["health"], scraped["lastError"]) == ("up", ""), scraped
        assert await asyncio.to_thread(value, server, "uapplace_daemon_up") == 1
        assert await asyncio.to_thread(value, server, "uapplace_pending") == 1
        assert await asyncio.to_thread(value, server, 'uapplace_residents{state="hot"}') == 1
        age = await until(
            "the recording rule uapplace:pending_oldest_age_seconds",
            server,
            lambda: value(server, "uapplace:pending_oldest_age_seconds"),
        )
        assert 0 <= age < UNTIL_GUARD_S + 5
        others = {a["labels"]["alertname"] for a in await asyncio.to_thread(server.alerts)}
        assert others == {ALERT}, others  # the demo's world is healthy otherwise
