"""The shipped Prometheus rules (contrib/prometheus/): ``promtool check`` and ``promtool test
rules`` pass, every alert has its promtool test, and every ``uapplace_*`` series a rule
reads is one the shim exports (a rename in uapplace/shim/metrics.py fails here, not on an
operator's dashboard)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.worlds.prometheus import CONTRIB, RULES, binary, rules_with_for
from uapplace.io.counters import DaemonCounters
from uapplace.shim.metrics import ShimMetrics

TESTS = sorted((CONTRIB / "tests").glob("*.yml"))


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [binary("promtool"), *args],
        cwd=CONTRIB,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_rules_and_the_example_configuration_check() -> None:
    rules = promtool("check", "rules", str(RULES))
    assert rules.returncode == 0, rules.stdout + rules.stderr
    assert "SUCCESS: 17 rules found" in rules.stdout
    config = promtool("check", "config", "prometheus.example.yml")
    assert config.returncode == 0, config.stdout + config.stderr


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert [p.name for p in TESTS] == ["alerts.yml", "recording.yml"]
    done = promtool("test", "rules", *(str(p.relative_to(CONTRIB)) for p in TESTS))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("SUCCESS") == len(TESTS), done.stdout


def test_a_wrong_expectation_fails_promtool(tmp_path: Path) -> None:
    """The unit tests can fail: the same test with the alert expected a minute early."""
    text = (CONTRIB / "tests" / "alerts.yml").read_text()
    fires = "- eval_time: {}\n        alertname: UapplaceRollbackIncomplete"
    broken = text.replace(fires.format("2m"), fires.format("1m"), 1)
    broken = broken.replace("../uapplace.rules.yml", str(RULES))
    assert broken != text
    copy = tmp_path / "alerts.yml"
    copy.write_text(broken)
    done = promtool("test", "rules", str(copy))
    assert done.returncode == 1 and "FAILED" in done.stdout + done.stderr


def test_every_alert_has_a_promtool_test() -> None:
    alerts = set(re.findall(r"^\s*- alert: (\w+)$", RULES.read_text(), re.M))
    tests = (CONTRIB / "tests" / "alerts.yml").read_text()
    tested = set(re.findall(r"alertname: (\w+)$", tests, re.M))
    assert len(alerts) == 10
    assert alerts == tested


def test_every_series_the_rules_read_is_exported() -> None:
    read = set(re.findall(r"\b(uapplace_[a-z_]+?)(?:_bucket)?\b", RULES.read_text()))
    counters = DaemonCounters(started_at=1.0)
    counters.run_started("run")
    counters.run_finished("run", "apply", "ok")
    metrics = ShimMetrics()
    metrics.bus_seconds.labels("Admit").observe(0.001)
    state = {
        "pending": [{"id": "plc-1", "created_at": "2026-01-01T00:00:00Z"}],
        "residents": [{"state": "hot", "device": "gpu0", "gpu_mib": 1}],
        "devices": {"gpu0": {"kind": "gpu", "total_mib": 2, "free_mib": 1}},
        "alerts": [],
        "counters": counters.to_json(),
        "targets": [{"target_id": "t", "model": "m", "rails": 1, "agrees": True}],
        "registry": {"device_mismatches": []},
    }
    page = metrics.exposition(state).decode()
    declared = set(re.findall(r"^# TYPE (\w+) ", page, re.M))
    assert read - declared == set()
    assert "uapplace_pending" in read and "uapplace_target_rails_agree" in read


def test_the_test_copy_changes_one_for_clause_only() -> None:
    copy = rules_with_for("UapplaceRequestsParkedTooLong", "2s")
    original = RULES.read_text()
    assert copy.count("for: 2s") == 1 and "for: 2s" not in original
    assert len(copy.splitlines()) == len(original.splitlines())
