"""What ``uapplace top`` shows, computed from the daemon's JSON: pure functions, no bus.

:mod:`uapplace.cli.top` asks ``GetState`` and ``ListPending`` and hands the answers
here: a memory bar per device (:func:`device_bar`), rows for the residents, targets,
pending options and alerts, the impact of one option as the confirm dialog shows it
(:func:`option_impact`), and the enforcement run followed step by step from its
``EnforcementStep`` signals (:class:`RunSteps`).

A device's bar spans its total memory: the reserved part (never placed on,
docs/placement-rules.md §4.4) at the right end, each resident's measured footprint
in its own colour, memory used by others in grey, and the rest free. The label under
it gives the same figures in MiB; ``room`` is the planner's own count of what
placement may still use.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from rich.text import Text

from uapplace.cli.render import mib, option_header, resident_state_text
from uapplace.core.model import parse_iso

RESIDENT_COLOURS = ("cyan", "magenta", "yellow", "blue", "bright_green", "bright_red")
FULL = "█"
USED_BY_OTHERS = "▓"
RESERVED = "▒"
FREE = "░"


@dataclass(frozen=True)
class Segment:
    """One stretch of a device's bar: what it stands for, its MiB and its style."""

    label: str
    mib: float
    style: str
    glyph: str


def resident_mib(resident: dict[str, Any]) -> float:
    """What a resident occupies on its device: GPU MiB, or host RSS on the CPU tier."""
    value = resident.get("gpu_mib")
    if resident.get("device_kind") == "cpu" or value is None:
        value = resident.get("host_rss_mib")
    return float(value) if isinstance(value, int | float) else 0.0


def device_segments(
    device: dict[str, Any], residents: list[dict[str, Any]], key: str
) -> list[Segment]:
    """The bar's stretches, left to right: residents, used by others, free, reserved."""
    total = float(device.get("total_mib") or 0.0)
    free = max(0.0, float(device.get("free_mib") or 0.0))
    reserved = float(device.get("reserved_mib") or 0.0)
    segments = []
    for index, resident in enumerate(r for r in residents if r.get("device") == key):
        colour = RESIDENT_COLOURS[index % len(RESIDENT_COLOURS)]
        label = f"{resident['model']}/{resident['config']}"
        segments.append(Segment(label, resident_mib(resident), colour, FULL))
    placed = sum(s.mib for s in segments)
    others = max(0.0, total - free - placed)
    segments.append(Segment("used by others", others, "grey50", USED_BY_OTHERS))
    # The reserved MiB come out of what is free (the planner never places on them).
    segments.append(Segment("free", max(0.0, free - reserved), "green", FREE))
    segments.append(Segment("reserved", min(reserved, free) if free else reserved, "red", RESERVED))
    return segments


def _cells(segments: list[Segment], width: int) -> list[int]:
    """Each segment's share of ``width`` cells; any non-empty segment gets at least one."""
    total = sum(s.mib for s in segments) or 1.0
    cells = [round(s.mib / total * width) if s.mib > 0 else 0 for s in segments]
    cells = [max(1, c) if s.mib > 0 else 0 for c, s in zip(cells, segments, strict=True)]
    while sum(cells) > width and max(cells) > 1:
        cells[cells.index(max(cells))] -= 1
    if 0 < sum(cells) < width:
        biggest = max(range(len(segments)), key=lambda i: segments[i].mib)
        cells[biggest] += width - sum(cells)
    return cells


def device_bar(
    key: str, device: dict[str, Any], residents: list[dict[str, Any]], width: int
) -> Text:
    """Two lines: ``gpu0 [████▓▓░░░▒]`` and the figures behind each stretch."""
    segments = device_segments(device, residents, key)
    bar = Text(f"{key:<6} [")
    for segment, cells in zip(segments, _cells(segments, width), strict=True):
        bar.append(segment.glyph * cells, style=segment.style)
    bar.append("]")
    total = device.get("total_mib")
    room = device.get("room_mib")
    legend = Text(f"       total {mib(total)}")
    if room is not None:
        legend.append(f", room {mib(room)}")
    for segment in segments:
        if segment.mib > 0 or segment.label in ("free", "reserved"):
            legend.append(", ")
            legend.append(segment.glyph, style=segment.style)
            legend.append(f" {segment.label} {mib(segment.mib)}")
    if device.get("error"):
        legend.append(f"  ({device['error']})", style="red")
    bar.append("\n")
    bar.append_text(legend)
    return bar


def devices_text(state: dict[str, Any], width: int) -> Text:
    residents = state.get("residents") or []
    lines = [
        device_bar(key, device, residents, width)
        for key, device in (state.get("devices") or {}).items()
    ]
    return Text("\n").join(lines) if lines else Text("no devices")


# --------------------------------------------------------------------------- rows


RESIDENT_COLUMNS = ("model", "config", "device", "state", "memory", "holders")


def resident_rows(residents: list[dict[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    """``(model, cells)`` per resident; the model key is the row's key (hold, logs)."""
    rows: list[tuple[str, tuple[str, ...]]] = []
    for resident in residents:
        holders = ", ".join(
            f"{h.get('client', '?')} ({h.get('kind', '?')})" for h in resident.get("holders", [])
        )
        cells = (
            str(resident["model"]),
            str(resident["config"]),
            str(resident["device"]),
            resident_state_text(resident),
            mib(resident_mib(resident)),
            holders or "-",
        )
        rows.append((str(resident["model"]), cells))
    return rows


TARGET_COLUMNS = ("target", "model", "in flight", "rails", "rails source", "live rails")


def target_rows(
    targets: list[dict[str, Any]], inflight: dict[str, str]
) -> list[tuple[str, tuple[str, ...]]]:
    """One row per target; ``inflight`` is what its engine says it is working on."""
    rows: list[tuple[str, tuple[str, ...]]] = []
    for target in targets:
        live = target.get("live") or {}
        live_text = (
            str(live.get("rails")) if live.get("state") == "ok" else str(live.get("state", "?"))
        )
        rails = target.get("rails")
        target_id = str(target.get("target_id", ""))
        cells = (
            target_id,
            str(target.get("model", "")),
            inflight.get(target_id, "?"),
            str(rails) if rails is not None else "unknown",
            str(target.get("rails_source") or "-"),
            live_text,
        )
        rows.append((target_id, cells))
    return rows


def inflight_text(metrics: dict[str, float | str]) -> str:
    """An engine's own count of its work (llama.cpp's ``requests_processing`` and
    ``requests_deferred``); ``?`` when its ``/metrics`` has neither."""
    processing = metrics.get("requests_processing")
    deferred = metrics.get("requests_deferred")
    if not isinstance(processing, float):
        return "?"
    text = f"{processing:g}"
    if isinstance(deferred, float) and deferred:
        text += f" (+{deferred:g} waiting)"
    return text


@dataclass(frozen=True)
class OptionRow:
    """One option of one parked request: what ``a`` applies and ``d`` dismisses."""

    placement_id: str
    option: int
    """1-based, as ``uapplace apply ID OPTION`` numbers it."""
    model: str

    @property
    def key(self) -> str:
        """The table row's key: ``plc-1a2b3c#2``."""
        return f"{self.placement_id}#{self.option}"


PENDING_COLUMNS = ("placement", "model", "client", "expires", "option", "impact")


def _expires(entry: dict[str, Any], now: float) -> str:
    try:
        seconds = parse_iso(str(entry["expires_at"])) - now
    except (KeyError, ValueError):
        return "?"
    return f"{max(0, round(seconds))} s"


def option_summary(option: dict[str, Any]) -> str:
    """The option and what it stops, in one line (the confirm dialog has the details)."""
    text = option_header(option)
    victims = option.get("victims") or []
    if victims:
        stops = ", ".join(f"{v['model']}/{v['config']}" for v in victims)
        text += f"; stops {stops}, frees {mib(option.get('frees_mib'))}"
    else:
        text += "; stops nothing"
    return text


def pending_rows(pending: list[dict[str, Any]]) -> list[tuple[OptionRow, tuple[str, ...]]]:
    """One row per option of each parked request (a request without options: one row)."""
    now = time.time()
    rows: list[tuple[OptionRow, tuple[str, ...]]] = []
    for entry in pending:
        placement_id = str(entry["id"])
        base = (
            placement_id,
            str(entry.get("requested_model", "")),
            str(entry.get("client", "")),
            _expires(entry, now),
        )
        options = entry.get("options") or []
        if not options:
            key = OptionRow(placement_id, 0, str(entry.get("requested_model", "")))
            rows.append((key, (*base, "-", "no options (none feasible, or being computed)")))
        for index, option in enumerate(options, start=1):
            mark = " *" if index == entry.get("recommended") else ""
            key = OptionRow(placement_id, index, str(option.get("model", "")))
            rows.append((key, (*base, f"{index}{mark}", option_summary(option))))
    return rows


ALERT_COLUMNS = ("alert", "severity", "kind", "subject", "message")


def alert_rows(alerts: list[dict[str, Any]]) -> list[tuple[str, tuple[str, ...]]]:
    rows: list[tuple[str, tuple[str, ...]]] = []
    for alert in alerts:
        alert_id = str(alert.get("id", ""))
        repeated = f" ({alert['count']}x)" if alert.get("count", 1) > 1 else ""
        cells = (
            alert_id,
            str(alert.get("severity", "")).upper(),
            str(alert.get("kind", "")) + repeated,
            str(alert.get("subject", "")),
            str(alert.get("message", "")),
        )
        rows.append((alert_id, cells))
    return rows


def option_impact(header: str, victims: list[dict[str, Any]], frees: Any) -> str:
    """The confirm dialog's text: what the run would stop, as ``uapplace apply`` shows it."""
    lines = [header]
    if not victims:
        lines.append("It stops nothing.")
    for victim in victims:
        in_flight = {True: "yes", False: "no", None: "unknown (counts as busy)"}[
            victim.get("in_flight")
        ]
        holders = ", ".join(f"{h['client']} ({h['kind']})" for h in victim.get("holders", []))
        lines.append(
            f"  {victim.get('action', 'stop')} {victim['model']}/{victim['config']} on "
            f"{victim.get('device', '')} ({victim.get('state', '')}): in flight {in_flight}; "
            f"holders {holders or 'none'}; {victim.get('consequence', '')}"
        )
    if victims:
        lines.append(f"Frees {mib(frees)} in total.")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run


@dataclass(frozen=True)
class Step:
    name: str
    ok: bool
    detail: str
    elapsed_s: float


@dataclass(frozen=True)
class RunSteps:
    """The latest enforcement run as its ``EnforcementStep`` signals told it."""

    run_id: str | None = None
    started: float = 0.0
    steps: tuple[Step, ...] = field(default=())
    outcome: str = ""
    """The last answer of a call ``top`` made itself (``apply``: done / failed / refused)."""

    def with_step(self, run_id: str, name: str, ok: bool, detail: str, now: float) -> RunSteps:
        """This run with one more step; a new run id starts a new list."""
        if run_id != self.run_id:
            return RunSteps(run_id, now, (Step(name, ok, detail, 0.0),))
        step = Step(name, ok, detail, now - self.started)
        return RunSteps(self.run_id, self.started, (*self.steps, step), self.outcome)

    def with_outcome(self, outcome: str) -> RunSteps:
        return RunSteps(self.run_id, self.started, self.steps, outcome)

    def text(self) -> Text:
        if self.run_id is None and not self.outcome:
            return Text("no enforcement run since top started")
        shown = Text(f"run {self.run_id or '-'}\n", style="bold")
        for step in self.steps:
            mark, style = ("ok", "green") if step.ok else ("FAILED", "bold red")
            shown.append(f"  [{step.elapsed_s:6.1f}s] ")
            shown.append(f"{mark:>6}", style=style)
            shown.append(f" {step.name}" + (f": {step.detail}" if step.detail else "") + "\n")
        if self.outcome:
            shown.append(self.outcome)
        return shown
