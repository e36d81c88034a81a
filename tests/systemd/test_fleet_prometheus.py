"""Two sandboxes stand in for two hosts; one real Prometheus scrapes both shims with the
shipped rules, and an alert fires for the host that has a parked request only
(docs/fleet.md).

Each sandbox is the demo's (:class:`uapplace.demo.sandbox.Sandbox`: its own contained
``systemd --user``, simulated GPU, fake engines, ``uapplaced`` and ``uapplace-shim``);
each shim runs with ``UAPPLACE_HOST_LABEL`` set, so every series names its host. The
rules are ``contrib/prometheus/uapplace.rules.yml`` with ``UapplaceRequestsParkedTooLong``
waiting 2 s instead of 10 min (as in ``test_prometheus_scrape.py``).
"""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.systemd.conftest import require_containment
from tests.worlds.prometheus import PARKED_ALERT as ALERT
from tests.worlds.prometheus import PrometheusServer, binary, rules_with_for, until
from uapplace.demo.sandbox import WRITER, Sandbox, SandboxSpec
from uapplace.demo.walkthrough import shim_admit
from uapplace.shim.metrics import HOST_LABEL_ENV

pytestmark = pytest.mark.systemd

HOSTS = ("host-a", "host-b")


def firing(server: PrometheusServer) -> list[dict[str, Any]]:
    return [
        a for a in server.alerts() if a["labels"]["alertname"] == ALERT and a["state"] == "firing"
    ]


def by_host(server: PrometheusServer, expr: str) -> dict[str, float]:
    return {row["metric"]["host"]: float(row["value"][1]) for row in server.query(expr)}


async def test_one_prometheus_two_hosts_the_same_rules_an_alert_for_one_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require_containment()
    binary("prometheus")
    async with AsyncExitStack() as stack:
        boxes = {}
        for host in HOSTS:
            # The sandbox's shim inherits this environment: its host label.
            monkeypatch.setenv(HOST_LABEL_ENV, host)
            boxes[host] = await Sandbox.create(stack, SandboxSpec(), contain=True)
        monkeypatch.delenv(HOST_LABEL_ENV)
        answer = await shim_admit(boxes["host-a"], WRITER.key, "fleet-test")
        assert answer["decision"] == "park", answer
        targets = [boxes[host].shim_url.removeprefix("http://") for host in HOSTS]
        rules = rules_with_for(ALERT, "2s")
        server = await asyncio.to_thread(PrometheusServer.start, tmp_path / "prom", targets, rules)
        stack.callback(server.stop)

        alerts = await until("the alert for host-a", server, lambda: firing(server))
        assert [a["labels"]["host"] for a in alerts] == ["host-a"]
        scraped = await asyncio.to_thread(server.targets)
        assert sorted(t["health"] for t in scraped) == ["up", "up"], scraped
        assert await asyncio.to_thread(by_host, server, "uapplace_daemon_up") == {
            "host-a": 1,
            "host-b": 1,
        }
        assert await asyncio.to_thread(by_host, server, "uapplace_pending") == {
            "host-a": 1,
            "host-b": 0,
        }
        # A recording rule keeps the host too (the rules aggregate `without`, never `by`).
        used = await until(
            "the recording rule per host",
            server,
            lambda: by_host(server, "uapplace:device_used_mib") or None,
        )
        assert set(used) == set(HOSTS)
        others = {a["labels"]["alertname"] for a in await asyncio.to_thread(server.alerts)}
        assert others == {ALERT}, others
