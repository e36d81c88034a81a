"""The daemon's own counters: what happened, however it arrived.

The shim's ``/metrics`` counts what passed through the shim; a bus admit (the
CLI, a proxy speaking D-Bus, the peer socket), an enforcement started from the
CLI, a notification click or the auto policy never reach it. These counters
live in uapplaced (:class:`DaemonCounters`, owned by the controller), go out in
``GetState`` under ``counters`` (:meth:`DaemonCounters.to_json`), and the shim
exposes them at scrape time through ``prometheus_client``
(:func:`uapplace.shim.metrics.counter_families`):

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
    count = table.get(labels)
    if count is not None:  # the usual case: a series seen before, no bound to check
        table[labels] = count + 1
        return
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
