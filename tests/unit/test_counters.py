"""The daemon's counters (uapplace/io/counters.py) and their exposition in the shim's
``/metrics`` (:func:`uapplace.shim.metrics.counter_families`)."""

from __future__ import annotations

import json
from typing import Any

from tests.worlds.exposition import sample
from uapplace.io import counters as counters_module
from uapplace.io.counters import DaemonCounters, run_outcome
from uapplace.shim.metrics import ShimMetrics


def exposed(**state: Any) -> str:
    """The shim's page for a ``GetState`` document with these fields."""
    return ShimMetrics().exposition(state).decode()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_admits_runs_steps_and_alerts_are_counted_and_rendered() -> None:
    clock = Clock()
    counters = DaemonCounters(clock=clock, started_at=1_790_000_000.0)
    counters.admit("forward")
    counters.admit("park", "not_resident")
    counters.admit("park", "not_resident")
    counters.run_started("run-1")
    clock.now += 0.02
    counters.step("run-1", "drain", True)
    clock.now += 3.0
    counters.step("run-1", "start", False)
    counters.run_finished("run-1", "apply", run_outcome(False, True))
    counters.alert("token_mismatch", "critical")
    doc = json.loads(json.dumps(counters.to_json()))  # what GetState carries
    assert doc["admits"] == [
        {"decision": "forward", "reason": "", "count": 1},
        {"decision": "park", "reason": "not_resident", "count": 2},
    ]
    assert doc["enforcement_runs"] == [{"verb": "apply", "outcome": "rolled_back", "count": 1}]
    text = exposed(counters=doc)
    assert sample(text, "uapplace_admits_total", decision="park", reason="not_resident") == 2
    runs = "uapplace_enforcement_runs_total"
    assert sample(text, runs, verb="apply", outcome="rolled_back") == 1
    step = "uapplace_enforcement_step_duration_seconds_bucket"
    assert sample(text, step, step="drain", ok="true", le="0.025") == 1
    assert sample(text, step, step="start", ok="false", le="2.5") == 0
    assert sample(text, step, step="start", ok="false", le="5.0") == 1
    assert sample(text, step, step="start", ok="false", le="+Inf") == 1
    run = "uapplace_enforcement_run_duration_seconds_sum"
    total = sample(text, run, verb="apply", outcome="rolled_back")
    assert total is not None and abs(total - 3.02) < 1e-9
    raised = "uapplace_alerts_raised_total"
    assert sample(text, raised, kind="token_mismatch", severity="critical") == 1
    assert sample(text, "uapplace_daemon_started_seconds") == 1_790_000_000.0


def test_outcomes() -> None:
    assert [run_outcome(True, None), run_outcome(False, None), run_outcome(False, False)] == [
        "ok",
        "failed",
        "rollback_incomplete",
    ]


def test_a_step_of_an_unseen_run_starts_it_and_open_runs_stay_bounded() -> None:
    counters = DaemonCounters(clock=Clock())
    for index in range(counters_module.MAX_OPEN_RUNS + 10):
        counters.step(f"run-{index}", "drain", True)
    assert len(counters._open) == counters_module.MAX_OPEN_RUNS
    counters.run_finished("never-started", "load", "ok")
    assert counters.to_json()["enforcement_runs"] == [{"verb": "load", "outcome": "ok", "count": 1}]


def test_label_sets_are_bounded() -> None:
    counters = DaemonCounters()
    for index in range(counters_module.MAX_SERIES + 5):
        counters.admit("park", f"reason_{index}")
    assert len(counters.admits) == counters_module.MAX_SERIES + 1
    assert counters.admits[("other", "other")] == 5


def test_missing_or_malformed_counters_render_nothing_or_skip_rows() -> None:
    assert "uapplace_admits_total" not in exposed(counters=None)
    text = exposed(counters={"admits": [{"decision": "x", "count": "many"}], "alerts_raised": 3})
    assert "# TYPE uapplace_admits_total counter" in text
    assert not any(line.startswith("uapplace_admits_total{") for line in text.splitlines())


def test_target_rails_gauges_leave_unknown_rails_out() -> None:
    text = exposed(
        targets=[
            {
                "target_id": "gpu0:http://a",
                "model": "a",
                "rails": 2,
                "rails_source": "slots",
                "state": "ok",
                "agrees": True,
            },
            {
                "target_id": "gpu0:http://b",
                "model": "b",
                "rails": None,
                "rails_source": None,
                "state": "probe_failed",
                "agrees": None,
            },
            "junk",
        ]
    )
    a = {"target_id": "gpu0:http://a", "model": "a", "source": "slots", "state": "ok"}
    b = {"target_id": "gpu0:http://b", "model": "b", "source": "none", "state": "probe_failed"}
    assert sample(text, "uapplace_target_rails", **a) == 2
    assert sample(text, "uapplace_target_rails", **b) is None
    assert sample(text, "uapplace_target_rails_known", **b) == 0
    assert sample(text, "uapplace_target_rails_agree", target_id="gpu0:http://a", model="a") == 1
    assert sample(text, "uapplace_target_rails_agree", target_id="gpu0:http://b", model="b") is None
