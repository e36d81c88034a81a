"""The daemon's own counters: what happened, however it arrived.

The shim's ``/metrics`` counts what passed through the shim; a bus admit (the
CLI, a proxy speaking D-Bus, the peer socket), an enforcement started from the
CLI, a notification click or the auto policy never reach it. These counters
live in uapplaced (:class:`DaemonCounters`, owned by the controller), go out in
``GetState`` under ``counters`` (:meth:`DaemonCounters.to_json`), and the shim
renders them at scrape time (:func:`render_counters`):

- ``uapplace_admits_total{decision,reason}``: every ``Admit`` answered;
- ``uapplace_enforcement_runs_total{verb,outcome}`` and
  ``uapplace_enforcement_run_duration_seconds{verb,outcome}`` (histogram): every
  run, ``outcome`` ``ok`` | ``rolled_back`` | ``rollback_incomplete`` | ``failed``;
- ``uapplace_enforcement_step_duration_seconds{step,ok}`` (histogram): the
  time from the previous step of the same run (or the run's start) to this one;
- ``uapplace_alerts_raised_total{kind,severity}``: every raise, repeats included.

Counters restart at zero with the daemon (Prometheus handles the reset);
``uapplace_daemon_started_seconds`` says when, so a reset is visible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

RUN_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
MAX_OPEN_RUNS = 64
"""Runs whose steps are being timed at once; more means runs that never finished
(their entries are dropped oldest first, so the map stays bounded)."""
MAX_SERIES = 512
"""Distinct label sets one counter keeps; later new ones fold into ``other``."""
OTHER = "other"


@dataclass
class _Histogram:
    buckets: Sequence[float]
    series: dict[tuple[str, ...], list[float]] = field(default_factory=dict)
    """labels → per-bucket counts (not cumulative), then sum, then count."""

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        labels = _bounded(self.series, labels)
        row = self.series.setdefault(labels, [0.0] * (len(self.buckets) + 2))
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                row[index] += 1
                break
        row[-2] += value
        row[-1] += 1

    def to_json(self, names: Sequence[str]) -> dict[str, Any]:
        rows = []
        for labels, row in sorted(self.series.items()):
            cumulative, running = [], 0.0
            for count in row[: len(self.buckets)]:
                running += count
                cumulative.append(int(running))
            rows.append(
                {
                    "labels": dict(zip(names, labels, strict=True)),
                    "buckets": cumulative,
                    "sum": row[-2],
                    "count": int(row[-1]),
                }
            )
        return {"le": list(self.buckets), "series": rows}


def _bounded(table: Mapping[tuple[str, ...], object], labels: tuple[str, ...]) -> tuple[str, ...]:
    if labels in table or len(table) < MAX_SERIES:
        return labels
    return tuple(OTHER for _ in labels)


def _count(table: dict[tuple[str, ...], int], labels: tuple[str, ...]) -> None:
    key = _bounded(table, labels)
    table[key] = table.get(key, 0) + 1


@dataclass
class _OpenRun:
    started: float
    last: float


@dataclass
class DaemonCounters:
    """Counted on the daemon's loop; every method is O(1) and never raises."""

    clock: Callable[[], float] = time.monotonic
    started_at: float = field(default_factory=time.time)
    admits: dict[tuple[str, ...], int] = field(default_factory=dict)
    runs: dict[tuple[str, ...], int] = field(default_factory=dict)
    run_seconds: _Histogram = field(default_factory=lambda: _Histogram(RUN_BUCKETS))
    step_seconds: _Histogram = field(default_factory=lambda: _Histogram(STEP_BUCKETS))
    alerts: dict[tuple[str, ...], int] = field(default_factory=dict)
    _open: dict[str, _OpenRun] = field(default_factory=dict)

    def admit(self, decision: str, reason: str = "") -> None:
        _count(self.admits, (decision, reason))

    def run_started(self, run_id: str) -> None:
        now = self.clock()
        self._open[run_id] = _OpenRun(now, now)
        while len(self._open) > MAX_OPEN_RUNS:
            del self._open[next(iter(self._open))]

    def step(self, run_id: str, step: str, ok: bool) -> None:
        """One ``EnforcementStep``; a run not seen before starts at this step."""
        now = self.clock()
        run = self._open.get(run_id)
        if run is None:
            self.run_started(run_id)
            run = self._open[run_id]
        self.step_seconds.observe((step, "true" if ok else "false"), now - run.last)
        run.last = now

    def run_finished(self, run_id: str, verb: str, outcome: str) -> None:
        run = self._open.pop(run_id, None)
        _count(self.runs, (verb, outcome))
        if run is not None:
            self.run_seconds.observe((verb, outcome), self.clock() - run.started)

    def alert(self, kind: str, severity: str) -> None:
        _count(self.alerts, (kind, severity))

    def to_json(self) -> dict[str, Any]:
        """``GetState``'s ``counters``."""
        return {
            "started_at": self.started_at,
            "admits": _rows(self.admits, ("decision", "reason")),
            "enforcement_runs": _rows(self.runs, ("verb", "outcome")),
            "enforcement_run_seconds": self.run_seconds.to_json(("verb", "outcome")),
            "enforcement_step_seconds": self.step_seconds.to_json(("step", "ok")),
            "alerts_raised": _rows(self.alerts, ("kind", "severity")),
        }


def run_outcome(ok: bool, rolled_back: bool | None) -> str:
    """An enforcement result's outcome label."""
    if ok:
        return "ok"
    if rolled_back is True:
        return "rolled_back"
    if rolled_back is False:
        return "rollback_incomplete"
    return "failed"


def _rows(table: Mapping[tuple[str, ...], int], names: tuple[str, str]) -> list[dict[str, Any]]:
    return [
        {**dict(zip(names, labels, strict=True)), "count": count}
        for labels, count in sorted(table.items())
    ]


# --------------------------------------------------------------------------- exposition


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(value)


def _sample(name: str, labels: Mapping[str, str], value: float) -> str:
    if not labels:
        return f"{name} {_number(value)}"
    text = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return f"{name}{{{text}}} {_number(value)}"


def _is_count(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value >= 0


def _counter_lines(name: str, help_text: str, rows: object, names: tuple[str, str]) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} counter"]
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and _is_count(row.get("count")):
            labels = {n: str(row.get(n, "")) for n in names}
            lines.append(_sample(name, labels, float(row["count"])))
    return lines


def _histogram_lines(name: str, help_text: str, doc: object) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
    if not isinstance(doc, dict) or not isinstance(doc.get("le"), list):
        return lines
    bounds = doc["le"]
    for row in doc.get("series") or []:
        if not isinstance(row, dict) or not isinstance(row.get("labels"), dict):
            continue
        base = {str(k): str(v) for k, v in row["labels"].items()}
        buckets = row.get("buckets")
        if not isinstance(buckets, list) or len(buckets) != len(bounds):
            continue
        for bound, count in zip(bounds, buckets, strict=True):
            lines.append(_sample(f"{name}_bucket", {**base, "le": _number(bound)}, count))
        lines.append(_sample(f"{name}_bucket", {**base, "le": "+Inf"}, row.get("count", 0)))
        lines.append(_sample(f"{name}_sum", base, float(row.get("sum", 0.0))))
        lines.append(_sample(f"{name}_count", base, row.get("count", 0)))
    return lines


def render_counters(counters: object) -> list[str]:
    """Prometheus lines for ``GetState``'s ``counters`` (nothing for a missing or
    malformed document: an older daemon)."""
    if not isinstance(counters, dict):
        return []
    lines = [
        "# HELP uapplace_daemon_started_seconds When uapplaced started (its counters reset then).",
        "# TYPE uapplace_daemon_started_seconds gauge",
    ]
    if _is_count(counters.get("started_at")):
        lines.append(_sample("uapplace_daemon_started_seconds", {}, counters["started_at"]))
    lines += _counter_lines(
        "uapplace_admits_total",
        "Admit answers the daemon gave, however they arrived (bus, peer socket, shim).",
        counters.get("admits"),
        ("decision", "reason"),
    )
    lines += _counter_lines(
        "uapplace_enforcement_runs_total",
        "Enforcement runs by verb and outcome, whoever started them.",
        counters.get("enforcement_runs"),
        ("verb", "outcome"),
    )
    lines += _histogram_lines(
        "uapplace_enforcement_run_duration_seconds",
        "Wall time of enforcement runs, by verb and outcome.",
        counters.get("enforcement_run_seconds"),
    )
    lines += _histogram_lines(
        "uapplace_enforcement_step_duration_seconds",
        "Time each enforcement step took (since the previous step of its run).",
        counters.get("enforcement_step_seconds"),
    )
    lines += _counter_lines(
        "uapplace_alerts_raised_total",
        "Alerts raised, repeats included, by kind and severity.",
        counters.get("alerts_raised"),
        ("kind", "severity"),
    )
    return lines


def render_targets(targets: object) -> list[str]:
    """``uapplace_target_rails{target_id,model,source,state}`` from ``GetState.targets``;
    a target with unknown rails (probe failed, nothing declared) is left out of the
    gauge and shown in ``uapplace_target_rails_known`` as 0, never as a number."""
    rails = [
        "# HELP uapplace_target_rails Parallel requests each target takes (registry x live).",
        "# TYPE uapplace_target_rails gauge",
    ]
    known = [
        "# HELP uapplace_target_rails_known 1 when the target's rails are known, else 0.",
        "# TYPE uapplace_target_rails_known gauge",
    ]
    for row in targets if isinstance(targets, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("target_id"), str):
            continue
        labels = {
            "target_id": row["target_id"],
            "model": str(row.get("model", "")),
            "source": str(row.get("rails_source") or "none"),
            "state": str(row.get("state", "")),
        }
        value = row.get("rails")
        is_known = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, int) and is_known:
            rails.append(_sample("uapplace_target_rails", labels, value))
        known.append(_sample("uapplace_target_rails_known", labels, 1 if is_known else 0))
    return rails + known
