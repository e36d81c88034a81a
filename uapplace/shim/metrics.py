"""The shim's Prometheus metrics, in the text exposition format (version 0.0.4).

Written by hand: three small collector types and a renderer, no client library.
All state hangs off one :class:`ShimMetrics` the shim builds per app (in its
:class:`uapplace.shim.settings.ShimSettings`); the gateway and the handlers count
into it, and ``GET /metrics`` renders it.

What is counted where:

- Counters and histograms are updated by the shim as requests pass through it:
  admits by decision and reason, operator enforcements (resolve / load /
  unload *through the shim*) by outcome with their wall time, every bus call's
  latency by method, bus errors by method and error name, HTTP responses by
  route and status. Enforcements started elsewhere (CLI, auto policy) are not in
  ``uapplace_shim_enforcements_total``: the shim counts what it carried.
- Gauges (pending entries, residents by state, device memory, open alerts by
  kind/severity, ROLLBACK INCOMPLETE occurrences) are read from the daemon's
  ``GetState`` at scrape time, so they are never stale;
  ``uapplace_daemon_up`` says whether that read worked.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from uapplace.io.counters import render_counters, render_targets

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

BUS_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ENFORCEMENT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RESIDENT_STATES = ("hot", "warming", "paused", "draining")

LabelValues = tuple[str, ...]


def escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def sample(name: str, labels: Mapping[str, str], value: float) -> str:
    if not labels:
        return f"{name} {format_value(value)}"
    text = ",".join(f'{key}="{escape_label(val)}"' for key, val in labels.items())
    return f"{name}{{{text}}} {format_value(value)}"


@dataclass
class Counter:
    name: str
    help: str
    labelnames: tuple[str, ...]
    values: dict[LabelValues, float] = field(default_factory=dict)

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, *labels: str) -> float:
        return self.values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} counter"]
        for labels, value in sorted(self.values.items()):
            lines.append(sample(self.name, dict(zip(self.labelnames, labels, strict=True)), value))
        return lines


@dataclass
class _Series:
    bucket_counts: list[int]
    total: float = 0.0
    count: int = 0


@dataclass
class Histogram:
    name: str
    help: str
    labelnames: tuple[str, ...]
    buckets: Sequence[float]
    series: dict[LabelValues, _Series] = field(default_factory=dict)

    def observe(self, value: float, *labels: str) -> None:
        entry = self.series.get(labels)
        if entry is None:
            entry = self.series[labels] = _Series([0] * len(self.buckets))
        for index, bound in enumerate(self.buckets):
            if value <= bound:
                entry.bucket_counts[index] += 1
        entry.total += value
        entry.count += 1

    def count(self, *labels: str) -> int:
        entry = self.series.get(labels)
        return 0 if entry is None else entry.count

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        for labels, entry in sorted(self.series.items()):
            base = dict(zip(self.labelnames, labels, strict=True))
            for bound, cumulative in zip(self.buckets, entry.bucket_counts, strict=True):
                le = {**base, "le": format_value(bound)}
                lines.append(sample(f"{self.name}_bucket", le, cumulative))
            lines.append(sample(f"{self.name}_bucket", {**base, "le": "+Inf"}, entry.count))
            lines.append(sample(f"{self.name}_sum", base, entry.total))
            lines.append(sample(f"{self.name}_count", base, entry.count))
        return lines


def gauge(
    name: str, help_text: str, samples: Iterable[tuple[Mapping[str, str], float]]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} gauge"]
    lines.extend(sample(name, labels, value) for labels, value in samples)
    return lines


def state_gauges(state: Mapping[str, Any] | None) -> list[str]:
    """Gauges read from one ``GetState`` document; only ``daemon_up 0`` when there is none."""
    if state is None:
        return gauge("uapplace_daemon_up", "1 when GetState answered at this scrape.", [({}, 0)])
    lines = gauge("uapplace_daemon_up", "1 when GetState answered at this scrape.", [({}, 1)])
    pending = state.get("pending")
    pending_count = len(pending) if isinstance(pending, list | dict) else 0
    lines += gauge(
        "uapplace_pending", "Parked placements awaiting a decision.", [({}, pending_count)]
    )
    by_state = dict.fromkeys(RESIDENT_STATES, 0)
    residents = state.get("residents")
    for resident in residents if isinstance(residents, list) else []:
        if isinstance(resident, dict) and isinstance(resident.get("state"), str):
            by_state[resident["state"]] = by_state.get(resident["state"], 0) + 1
    lines += gauge(
        "uapplace_residents",
        "Residents in the ledger by state.",
        [({"state": name}, count) for name, count in by_state.items()],
    )
    lines += device_gauges(state.get("devices"))
    lines += alert_gauges(state.get("alerts"))
    lines += render_counters(state.get("counters"))  # the daemon's, however admits arrived
    lines += render_targets(state.get("targets"))
    return lines


ROLLBACK_INCOMPLETE_KIND = "rollback_incomplete"


def alert_gauges(alerts: object) -> list[str]:
    """Open alerts (``GetState.alerts``: raised and not yet acknowledged) by kind and severity.

    ``uapplace_alerts_open`` counts alerts; ``uapplace_alert_occurrences`` counts
    the raises folded into them (an alert repeated for the same subject bumps its
    ``count``). ``uapplace_rollback_incomplete`` is the occurrences of
    ``rollback_incomplete`` alone and is always present (0 when none), so a rule
    ``uapplace_rollback_incomplete > 0`` pages until someone acknowledges.
    """
    open_by: dict[tuple[str, str], int] = {}
    raised_by: dict[tuple[str, str], int] = {}
    incomplete = 0
    for alert in alerts if isinstance(alerts, list) else []:
        if not isinstance(alert, dict):
            continue
        key = (str(alert.get("kind", "unknown")), str(alert.get("severity", "unknown")))
        count = alert.get("count", 1)
        times = count if isinstance(count, int) and not isinstance(count, bool) else 1
        open_by[key] = open_by.get(key, 0) + 1
        raised_by[key] = raised_by.get(key, 0) + times
        if key[0] == ROLLBACK_INCOMPLETE_KIND:
            incomplete += times
    lines = gauge(
        "uapplace_alerts_open",
        "Open (unacknowledged) alerts by kind and severity.",
        [({"kind": k, "severity": sev}, n) for (k, sev), n in sorted(open_by.items())],
    )
    lines += gauge(
        "uapplace_alert_occurrences",
        "Raises folded into the open alerts (repeats for one subject count), by kind and severity.",
        [({"kind": k, "severity": sev}, n) for (k, sev), n in sorted(raised_by.items())],
    )
    lines += gauge(
        "uapplace_rollback_incomplete",
        "ROLLBACK INCOMPLETE runs among the open alerts (a device left emptier than before).",
        [({}, incomplete)],
    )
    return lines


def device_gauges(devices: object) -> list[str]:
    if not isinstance(devices, dict):
        return []
    lines: list[str] = []
    for metric, key, help_text in (
        ("uapplace_device_total_mib", "total_mib", "Device memory in MiB, as last probed."),
        ("uapplace_device_free_mib", "free_mib", "Free device memory in MiB, as last probed."),
    ):
        samples = [
            ({"device": str(name)}, float(info[key]))
            for name, info in sorted(devices.items())
            if isinstance(info, dict)
            and isinstance(info.get(key), int | float)
            and not isinstance(info.get(key), bool)
        ]
        lines += gauge(metric, help_text, samples)
    return lines


@dataclass
class ShimMetrics:
    admits: Counter = field(
        default_factory=lambda: Counter(
            "uapplace_shim_admits_total",
            "Admit answers given by the shim, by decision and park reason.",
            ("decision", "reason"),
        )
    )
    enforcements: Counter = field(
        default_factory=lambda: Counter(
            "uapplace_shim_enforcements_total",
            "Resolve/load/unload runs carried by the shim, by verb and outcome.",
            ("verb", "outcome"),
        )
    )
    enforcement_seconds: Histogram = field(
        default_factory=lambda: Histogram(
            "uapplace_shim_enforcement_duration_seconds",
            "Wall time of resolve/load/unload runs carried by the shim.",
            ("verb", "outcome"),
            ENFORCEMENT_BUCKETS,
        )
    )
    bus_seconds: Histogram = field(
        default_factory=lambda: Histogram(
            "uapplace_shim_bus_call_duration_seconds",
            "Latency of bus calls made by the shim, by method (errors included).",
            ("method",),
            BUS_LATENCY_BUCKETS,
        )
    )
    bus_errors: Counter = field(
        default_factory=lambda: Counter(
            "uapplace_shim_bus_errors_total",
            "Bus calls that ended in an error, by method and error name.",
            ("method", "error"),
        )
    )
    responses: Counter = field(
        default_factory=lambda: Counter(
            "uapplace_shim_http_responses_total",
            "HTTP responses by route and status code.",
            ("route", "status"),
        )
    )

    def render(self, state: Mapping[str, Any] | None) -> str:
        lines: list[str] = []
        for collector in (
            self.admits,
            self.enforcements,
            self.enforcement_seconds,
            self.bus_seconds,
            self.bus_errors,
            self.responses,
        ):
            lines += collector.render()
        lines += state_gauges(state)
        return "\n".join(lines) + "\n"
