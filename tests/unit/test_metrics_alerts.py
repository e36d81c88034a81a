"""Alerts in the shim's ``/metrics``: open alerts by kind/severity, ROLLBACK INCOMPLETE count."""

from __future__ import annotations

from uapplace.shim.metrics import alert_gauges, state_gauges


def alert(kind: str, severity: str, count: int = 1) -> dict[str, object]:
    return {"id": f"alr-{kind}", "kind": kind, "severity": severity, "count": count}


def test_open_alerts_by_kind_and_severity_and_rollback_incomplete_occurrences() -> None:
    lines = alert_gauges(
        [
            alert("rollback_incomplete", "critical", count=2),
            alert("config_error", "warning"),
            alert("wrong_model", "critical"),
        ]
    )
    assert 'uapplace_alerts_open{kind="rollback_incomplete",severity="critical"} 1' in lines
    assert 'uapplace_alerts_open{kind="config_error",severity="warning"} 1' in lines
    assert 'uapplace_alert_occurrences{kind="rollback_incomplete",severity="critical"} 2' in lines
    assert "uapplace_rollback_incomplete 2" in lines
    assert "# TYPE uapplace_alerts_open gauge" in lines


def test_rollback_incomplete_is_zero_not_absent_when_nothing_is_open() -> None:
    lines = state_gauges({"pending": [], "residents": [], "devices": {}, "alerts": []})
    assert "uapplace_rollback_incomplete 0" in lines
    assert not [line for line in lines if line.startswith("uapplace_alerts_open{")]


def test_a_malformed_alerts_field_is_ignored_not_fatal() -> None:
    assert "uapplace_rollback_incomplete 0" in alert_gauges("not a list")
    assert "uapplace_rollback_incomplete 1" in alert_gauges(
        [None, {"kind": "rollback_incomplete", "severity": "critical", "count": True}]
    )
