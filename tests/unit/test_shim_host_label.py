"""The shim's ``host`` label (``UAPPLACE_HOST_LABEL``, docs/fleet.md): on every series of
``/metrics`` when set, on none when not, and the page still reads as Prometheus text."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worlds.exposition import families, sample, samples
from uapplace.shim.metrics import HOST_LABEL_ENV, ShimMetrics

STATE: dict[str, Any] = {
    "pending": [],
    "residents": [{"model": "alpha", "state": "hot", "device": "gpu0", "gpu_mib": 8000}],
    "devices": {"gpu0": {"kind": "gpu", "total_mib": 24576, "free_mib": 16576}},
    "alerts": [],
}


def test_every_series_carries_the_host_label_when_set() -> None:
    metrics = ShimMetrics(host="gpu-host-a")
    metrics.count_admit("park", "not_resident")
    metrics.observe_bus_call("GetState", 0.002)
    text = metrics.exposition(STATE).decode()
    found = samples(text)
    assert found, text
    assert all(dict(labels).get("host") == "gpu-host-a" for _, labels in found)
    admits = "uapplace_shim_admits_total"
    assert sample(text, admits, decision="park", reason="not_resident", host="gpu-host-a") == 1
    assert sample(text, "uapplace_residents", state="hot", host="gpu-host-a") == 1
    assert families(text)["uapplace_shim_bus_call_duration_seconds"] == "histogram"


def test_no_host_label_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HOST_LABEL_ENV, raising=False)
    text = ShimMetrics().exposition(STATE).decode()
    assert not any("host" in dict(labels) for _, labels in samples(text))
    monkeypatch.setenv(HOST_LABEL_ENV, "gpu-host-b")
    assert ShimMetrics().host == "gpu-host-b"
