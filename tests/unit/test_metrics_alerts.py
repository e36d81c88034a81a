"""Alerts in the shim's ``/metrics``: open alerts by kind/severity, ROLLBACK INCOMPLETE count,
and the families the shipped rules (contrib/prometheus/) read from ``GetState``."""

from __future__ import annotations

from typing import Any

from tests.worlds.exposition import families, sample
from uapplace.shim.metrics import ShimMetrics


def alert(kind: str, severity: str, count: int = 1) -> dict[str, object]:
    return {"id": f"alr-{kind}", "kind": kind, "severity": severity, "count": count}


def exposed(**state: Any) -> str:
    return ShimMetrics().exposition(state).decode()


def test_open_alerts_by_kind_and_severity_and_rollback_incomplete_occurrences() -> None:
    text = exposed(
        alerts=[
            alert("rollback_incomplete", "critical", count=2),
            alert("config_error", "warning"),
            alert("wrong_model", "critical"),
        ]
    )
    opened = "uapplace_alerts_open"
    assert sample(text, opened, kind="rollback_incomplete", severity="critical") == 1
    assert sample(text, opened, kind="config_error", severity="warning") == 1
    occurrences = "uapplace_alert_occurrences"
    assert sample(text, occurrences, kind="rollback_incomplete", severity="critical") == 2
    assert sample(text, "uapplace_rollback_incomplete") == 2
    assert families(text)["uapplace_alerts_open"] == "gauge"


def test_rollback_incomplete_is_zero_not_absent_when_nothing_is_open() -> None:
    text = exposed(pending=[], residents=[], devices={}, alerts=[])
    assert sample(text, "uapplace_rollback_incomplete") == 0
    assert not [line for line in text.splitlines() if line.startswith("uapplace_alerts_open{")]


def test_a_malformed_alerts_field_is_ignored_not_fatal() -> None:
    assert sample(exposed(alerts="not a list"), "uapplace_rollback_incomplete") == 0
    text = exposed(
        alerts=[None, {"kind": "rollback_incomplete", "severity": "critical", "count": True}]
    )
    assert sample(text, "uapplace_rollback_incomplete") == 1


def test_the_oldest_pending_entry_is_exposed_as_a_timestamp() -> None:
    text = exposed(
        pending=[
            {"id": "plc-000002", "created_at": "2026-01-01T00:01:00Z"},
            {"id": "plc-000001", "created_at": "2026-01-01T00:00:00Z"},
            {"id": "plc-000003", "created_at": "not a time"},
        ]
    )
    assert sample(text, "uapplace_pending") == 3
    assert sample(text, "uapplace_pending_oldest_created_timestamp_seconds") == 1_767_225_600
    assert sample(exposed(pending=[]), "uapplace_pending_oldest_created_timestamp_seconds") is None


def test_device_reserve_and_what_the_residents_hold_but_not_for_host_ram() -> None:
    text = exposed(
        devices={
            "gpu0": {"kind": "gpu", "total_mib": 24576, "free_mib": 9000, "reserved_mib": 512},
            "gpu1": {"kind": "gpu", "total_mib": 24576, "free_mib": 24576},
            "cpu0": {"kind": "cpu", "total_mib": 64000, "free_mib": 30000},
        },
        residents=[
            {"model": "a", "device": "gpu0", "gpu_mib": 14000, "state": "hot"},
            {"model": "b", "device": "gpu0", "gpu_mib": 1000.5, "state": "paused"},
            {"model": "c", "device": "cpu0", "gpu_mib": 0, "state": "hot"},
            {"model": "d", "device": "gpu0", "gpu_mib": True, "state": "hot"},
        ],
    )
    assert sample(text, "uapplace_device_resident_mib", device="gpu0") == 15000.5
    assert sample(text, "uapplace_device_resident_mib", device="gpu1") == 0
    assert sample(text, "uapplace_device_resident_mib", device="cpu0") is None
    assert sample(text, "uapplace_device_reserved_mib", device="gpu0") == 512
    assert sample(text, "uapplace_device_reserved_mib", device="gpu1") == 0


def test_measurements_from_another_device_are_counted() -> None:
    text = exposed(registry={"device_mismatches": ["a", "b"]})
    assert sample(text, "uapplace_registry_device_mismatches") == 2
    assert "uapplace_registry_device_mismatches" not in exposed(registry={})
