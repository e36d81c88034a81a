"""The shim's Prometheus metrics, through ``prometheus_client`` (docs/http-contract.md §4,
"Metrics": every name, its labels and where it comes from).

One :class:`ShimMetrics` per shim (built in its
:class:`uapplace.shim.settings.ShimSettings`) owns one
:class:`prometheus_client.CollectorRegistry`; nothing is registered in the client's
global default registry. The registry holds

- the shim's own instruments, updated as requests pass through it: admits by decision
  and reason, operator enforcements (resolve / load / unload *through the shim*) by
  outcome with their wall time, every bus call's latency by method, bus errors by
  method and error name, HTTP responses by route and status. Enforcements started
  elsewhere (CLI, auto policy) are not in ``uapplace_shim_enforcements_total``: the
  shim counts what it carried;
- :class:`DaemonStateCollector`, a custom collector whose families are read from the
  daemon's ``GetState`` document fetched for this scrape, so they are never stale:
  pending entries, residents by state, device memory, open alerts, per-target rails,
  and the daemon's own counters (``GetState.counters``, :mod:`uapplace.io.counters`:
  admits and runs however they arrived). ``uapplace_daemon_up`` says whether that read
  worked.

``GET /metrics`` fetches the document, then :meth:`ShimMetrics.exposition` hands it to
the collector and asks ``prometheus_client`` for the text format 0.0.4 in one
synchronous step, so two scrapes on the event loop never see each other's document.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from uapplace.core.alerts import AlertKind
from uapplace.core.model import parse_iso

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
"""The classic text format, whatever the scraper's ``Accept`` offers: Prometheus takes it."""

BUS_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ENFORCEMENT_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RESIDENT_STATES = ("hot", "warming", "paused", "draining")
_go_float: Callable[[float], str] = floatToGoString
"""The client's own bucket-bound text (``5.0``, ``+Inf``), as its histograms write ``le``;
named with a type because the client leaves this helper unannotated."""
CPU_KIND = "cpu"
"""A device of this kind is host RAM: everything on the machine uses it, so the ledger's
residents are never compared with its used memory (no ``uapplace_device_resident_mib``)."""


def _number(value: object) -> float | None:
    """A JSON number (never a boolean) as a float, else ``None``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _count(value: object) -> float | None:
    number = _number(value)
    return number if number is not None and number >= 0 else None


# --------------------------------------------------------------------------- GetState


def daemon_up(up: bool) -> GaugeMetricFamily:
    return GaugeMetricFamily(
        "uapplace_daemon_up", "1 when GetState answered at this scrape.", value=1 if up else 0
    )


def pending_families(pending: object) -> Iterator[Metric]:
    entries = pending if isinstance(pending, list) else []
    yield GaugeMetricFamily(
        "uapplace_pending", "Parked placements awaiting a decision.", value=len(entries)
    )
    created = [
        parse_iso(entry["created_at"])
        for entry in entries
        if isinstance(entry, dict) and _is_iso(entry.get("created_at"))
    ]
    oldest = GaugeMetricFamily(
        "uapplace_pending_oldest_created_timestamp_seconds",
        "When the oldest pending entry was parked (absent when none is pending).",
    )
    if created:
        oldest.add_metric([], min(created))
    yield oldest


def _is_iso(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        parse_iso(value)
    except ValueError:
        return False
    return True


def resident_families(residents: object) -> GaugeMetricFamily:
    by_state = dict.fromkeys(RESIDENT_STATES, 0)
    for resident in residents if isinstance(residents, list) else []:
        if isinstance(resident, dict) and isinstance(resident.get("state"), str):
            by_state[resident["state"]] = by_state.get(resident["state"], 0) + 1
    family = GaugeMetricFamily(
        "uapplace_residents", "Residents in the ledger by state.", labels=["state"]
    )
    for state, count in by_state.items():
        family.add_metric([state], count)
    return family


def device_families(devices: object, residents: object) -> Iterator[Metric]:
    """Device memory as probed, the registry's reserve, and what the ledger's residents hold.

    ``total - free - resident`` is memory the ledger cannot account for: the footprint
    drift the shipped rules watch (contrib/prometheus/README.md).
    """
    table = devices if isinstance(devices, dict) else {}
    rows = sorted((str(k), v) for k, v in table.items() if isinstance(v, dict))
    for metric, key, help_text in (
        ("uapplace_device_total_mib", "total_mib", "Device memory in MiB, as last probed."),
        ("uapplace_device_free_mib", "free_mib", "Free device memory in MiB, as last probed."),
    ):
        family = GaugeMetricFamily(metric, help_text, labels=["device"])
        for name, info in rows:
            value = _number(info.get(key))
            if value is not None:
                family.add_metric([name], value)
        yield family
    probed = [(name, info) for name, info in rows if _number(info.get("total_mib")) is not None]
    reserved = GaugeMetricFamily(
        "uapplace_device_reserved_mib",
        "Device memory the registry keeps out of every budget (reserved_mib; 0 when none).",
        labels=["device"],
    )
    for name, info in probed:
        reserved.add_metric([name], _count(info.get("reserved_mib")) or 0.0)
    yield reserved
    held = GaugeMetricFamily(
        "uapplace_device_resident_mib",
        "Device memory the ledger's residents hold (their gpu_mib), per non-host device.",
        labels=["device"],
    )
    totals = _resident_mib(residents)
    for name, info in probed:
        if info.get("kind") != CPU_KIND:
            held.add_metric([name], totals.get(name, 0.0))
    yield held


def _resident_mib(residents: object) -> dict[str, float]:
    totals: dict[str, float] = {}
    for resident in residents if isinstance(residents, list) else []:
        if not isinstance(resident, dict) or not isinstance(resident.get("device"), str):
            continue
        mib = _count(resident.get("gpu_mib"))
        if mib is not None:
            totals[resident["device"]] = totals.get(resident["device"], 0.0) + mib
    return totals


def alert_families(alerts: object) -> Iterator[Metric]:
    """Open alerts (``GetState.alerts``: raised and not yet acknowledged) by kind and severity.

    ``uapplace_alerts_open`` counts alerts; ``uapplace_alert_occurrences`` counts the
    raises folded into them (an alert repeated for the same subject bumps its
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
        if key[0] == AlertKind.ROLLBACK_INCOMPLETE.value:
            incomplete += times
    opened = GaugeMetricFamily(
        "uapplace_alerts_open",
        "Open (unacknowledged) alerts by kind and severity.",
        labels=["kind", "severity"],
    )
    raised = GaugeMetricFamily(
        "uapplace_alert_occurrences",
        "Raises folded into the open alerts (repeats for one subject count), by kind and severity.",
        labels=["kind", "severity"],
    )
    for (kind, severity), number in sorted(open_by.items()):
        opened.add_metric([kind, severity], number)
        raised.add_metric([kind, severity], raised_by[(kind, severity)])
    yield opened
    yield raised
    yield GaugeMetricFamily(
        "uapplace_rollback_incomplete",
        "ROLLBACK INCOMPLETE runs among the open alerts (a device left emptier than before).",
        value=incomplete,
    )


def target_families(targets: object) -> Iterator[Metric]:
    """Per-target rails from ``GetState.targets``. A target with unknown rails (probe
    failed, nothing declared) is left out of ``uapplace_target_rails`` and shown in
    ``uapplace_target_rails_known`` as 0, never as a number; ``uapplace_target_rails_agree``
    exists only where both the registry and the live engine give a figure."""
    labels = ["target_id", "model", "source", "state"]
    rails = GaugeMetricFamily(
        "uapplace_target_rails",
        "Parallel requests each target takes (registry x live).",
        labels=labels,
    )
    known = GaugeMetricFamily(
        "uapplace_target_rails_known",
        "1 when the target's rails are known, else 0.",
        labels=labels,
    )
    agree = GaugeMetricFamily(
        "uapplace_target_rails_agree",
        "1 when the registry's rails equal the live engine's, 0 when they disagree.",
        labels=["target_id", "model"],
    )
    for row in targets if isinstance(targets, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("target_id"), str):
            continue
        values = [
            row["target_id"],
            str(row.get("model", "")),
            str(row.get("rails_source") or "none"),
            str(row.get("state", "")),
        ]
        value = row.get("rails")
        is_known = isinstance(value, int) and not isinstance(value, bool)
        if isinstance(value, int) and is_known:
            rails.add_metric(values, value)
        known.add_metric(values, 1 if is_known else 0)
        if isinstance(row.get("agrees"), bool):
            agree.add_metric(values[:2], 1 if row["agrees"] else 0)
    yield rails
    yield known
    yield agree


def registry_families(registry: object) -> Iterator[Metric]:
    """Measurements set aside because they were taken on another device than the probe sees
    (docs/placement-rules.md §4.1): such configs count as unmeasured until re-measured."""
    doc = registry if isinstance(registry, dict) else {}
    mismatches = doc.get("device_mismatches")
    if isinstance(mismatches, list):
        yield GaugeMetricFamily(
            "uapplace_registry_device_mismatches",
            "Local measurements not used because the probe reads another device under measured_on.",
            value=len(mismatches),
        )


def counter_families(counters: object) -> Iterator[Metric]:
    """The daemon's own counters (``GetState.counters``, :meth:`DaemonCounters.to_json`);
    nothing for a missing or malformed document (an older daemon), a malformed row skipped."""
    if not isinstance(counters, dict):
        return
    started = GaugeMetricFamily(
        "uapplace_daemon_started_seconds", "When uapplaced started (its counters reset then)."
    )
    started_at = _count(counters.get("started_at"))
    if started_at is not None:
        started.add_metric([], started_at)
    yield started
    yield _counter_family(
        "uapplace_admits_total",
        "Admit answers the daemon gave, however they arrived (bus, peer socket, shim).",
        counters.get("admits"),
        ("decision", "reason"),
    )
    yield _counter_family(
        "uapplace_enforcement_runs_total",
        "Enforcement runs by verb and outcome, whoever started them.",
        counters.get("enforcement_runs"),
        ("verb", "outcome"),
    )
    yield _histogram_family(
        "uapplace_enforcement_run_duration_seconds",
        "Wall time of enforcement runs, by verb and outcome.",
        counters.get("enforcement_run_seconds"),
        ("verb", "outcome"),
    )
    yield _histogram_family(
        "uapplace_enforcement_step_duration_seconds",
        "Time each enforcement step took (since the previous step of its run).",
        counters.get("enforcement_step_seconds"),
        ("step", "ok"),
    )
    yield _counter_family(
        "uapplace_alerts_raised_total",
        "Alerts raised, repeats included, by kind and severity.",
        counters.get("alerts_raised"),
        ("kind", "severity"),
    )


def _counter_family(
    name: str, help_text: str, rows: object, names: tuple[str, str]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=list(names))
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict):
            count = _count(row.get("count"))
            if count is not None:
                family.add_metric([str(row.get(n, "")) for n in names], count)
    return family


def _histogram_family(
    name: str, help_text: str, doc: object, names: tuple[str, str]
) -> HistogramMetricFamily:
    """``{le: [...], series: [{labels, buckets (cumulative), sum, count}]}`` as a histogram."""
    family = HistogramMetricFamily(name, help_text, labels=list(names))
    bounds = _numbers(doc.get("le")) if isinstance(doc, dict) else None
    if not isinstance(doc, dict) or bounds is None:
        return family
    for row in doc.get("series") or []:
        if not isinstance(row, dict) or not isinstance(row.get("labels"), dict):
            continue
        cumulative = _numbers(row.get("buckets"))
        count = _count(row.get("count"))
        if cumulative is None or len(cumulative) != len(bounds) or count is None:
            continue
        buckets = [(_go_float(b), c) for b, c in zip(bounds, cumulative, strict=True)]
        buckets.append(("+Inf", count))
        values = [str(row["labels"].get(n, "")) for n in names]
        family.add_metric(values, buckets, _number(row.get("sum")) or 0.0)
    return family


def _numbers(values: object) -> list[float] | None:
    """A JSON list of non-negative numbers, else ``None``."""
    if not isinstance(values, list):
        return None
    numbers = [_count(v) for v in values]
    return [n for n in numbers if n is not None] if None not in numbers else None


def state_families(state: Mapping[str, Any] | None) -> Iterator[Metric]:
    """Every family read from one ``GetState`` document; only ``daemon_up 0`` when none."""
    yield daemon_up(state is not None)
    if state is None:
        return
    yield from pending_families(state.get("pending"))
    yield resident_families(state.get("residents"))
    yield from device_families(state.get("devices"), state.get("residents"))
    yield from alert_families(state.get("alerts"))
    yield from counter_families(state.get("counters"))  # the daemon's, however admits arrived
    yield from target_families(state.get("targets"))
    yield from registry_families(state.get("registry"))


class DaemonStateCollector:
    """A custom collector: the families of the ``GetState`` document handed to it for the
    scrape in progress (:meth:`ShimMetrics.exposition`), ``daemon_up 0`` without one."""

    def __init__(self) -> None:
        self.state: Mapping[str, Any] | None = None

    def collect(self) -> Iterable[Metric]:
        return list(state_families(self.state))


# --------------------------------------------------------------------------- the shim's


def _registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


HOST_LABEL_ENV = "UAPPLACE_HOST_LABEL"
"""When set (the shim unit's ``Environment=``), every series carries ``host="<value>"``:
for a fleet whose scraper cannot add the host itself (docs/fleet.md)."""


def _host_from_env() -> str | None:
    return os.environ.get(HOST_LABEL_ENV) or None


class HostLabelled:
    """A collector that is ``registry`` with ``host`` added to every sample's labels."""

    def __init__(self, registry: CollectorRegistry, host: str) -> None:
        self.registry = registry
        self.host = host

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [
                sample._replace(labels={**sample.labels, "host": self.host})
                for sample in metric.samples
            ]
            yield labelled


@dataclass
class ShimMetrics:
    """The shim's registry and its instruments (``.labels(...).inc()`` / ``.observe()``)."""

    registry: CollectorRegistry = field(default_factory=_registry)
    daemon_state: DaemonStateCollector = field(default_factory=DaemonStateCollector)
    host: str | None = field(default_factory=_host_from_env)
    """The ``host`` label on every series (:data:`HOST_LABEL_ENV`); ``None``: none."""
    admits: Counter = field(init=False)
    enforcements: Counter = field(init=False)
    enforcement_seconds: Histogram = field(init=False)
    bus_seconds: Histogram = field(init=False)
    bus_errors: Counter = field(init=False)
    responses: Counter = field(init=False)
    # prometheus_client's ``labels()`` costs a lock and a few µs per call: every request
    # pays for it, so the label sets seen (a handful of routes, statuses, reasons) keep
    # their children here (issue 23).
    _responses: dict[tuple[str, int], Counter] = field(init=False, default_factory=dict)
    _admits: dict[tuple[str, str], Counter] = field(init=False, default_factory=dict)
    _bus_seconds: dict[str, Histogram] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.admits = Counter(
            "uapplace_shim_admits_total",
            "Admit answers given by the shim, by decision and park reason.",
            ("decision", "reason"),
            registry=self.registry,
        )
        self.enforcements = Counter(
            "uapplace_shim_enforcements_total",
            "Resolve/load/unload runs carried by the shim, by verb and outcome.",
            ("verb", "outcome"),
            registry=self.registry,
        )
        self.enforcement_seconds = Histogram(
            "uapplace_shim_enforcement_duration_seconds",
            "Wall time of resolve/load/unload runs carried by the shim.",
            ("verb", "outcome"),
            registry=self.registry,
            buckets=ENFORCEMENT_BUCKETS,
        )
        self.bus_seconds = Histogram(
            "uapplace_shim_bus_call_duration_seconds",
            "Latency of bus calls made by the shim, by method (errors included).",
            ("method",),
            registry=self.registry,
            buckets=BUS_LATENCY_BUCKETS,
        )
        self.bus_errors = Counter(
            "uapplace_shim_bus_errors_total",
            "Bus calls that ended in an error, by method and error name.",
            ("method", "error"),
            registry=self.registry,
        )
        self.responses = Counter(
            "uapplace_shim_http_responses_total",
            "HTTP responses by route and status code.",
            ("route", "status"),
            registry=self.registry,
        )
        self.registry.register(self.daemon_state)

    def count_response(self, route: str, status: int) -> None:
        """``uapplace_shim_http_responses_total{route,status}`` + 1 (its child cached)."""
        child = self._responses.get((route, status))
        if child is None:
            child = self._responses[(route, status)] = self.responses.labels(route, str(status))
        child.inc()

    def count_admit(self, decision: str, reason: str) -> None:
        """``uapplace_shim_admits_total{decision,reason}`` + 1 (its child cached)."""
        child = self._admits.get((decision, reason))
        if child is None:
            child = self._admits[(decision, reason)] = self.admits.labels(decision, reason)
        child.inc()

    def observe_bus_call(self, method: str, seconds: float) -> None:
        """``uapplace_shim_bus_call_duration_seconds{method}`` (its child cached)."""
        child = self._bus_seconds.get(method)
        if child is None:
            child = self._bus_seconds[method] = self.bus_seconds.labels(method)
        child.observe(seconds)

    def exposition(self, state: Mapping[str, Any] | None) -> bytes:
        """The text format 0.0.4 of everything, ``state`` being this scrape's ``GetState``."""
        self.daemon_state.state = state
        exposed = self.registry if self.host is None else HostLabelled(self.registry, self.host)
        try:
            return generate_latest(exposed)
        finally:
            self.daemon_state.state = None

    def value(self, name: str, **labels: str) -> float:
        """One sample's current value (0 when it was never set): for tests and checks."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found
