"""How the CLI shows the daemon's JSON as text: state, pending, options, impact, findings.

Pure rendering of the documents the bus returns (``GetState``, ``ListPending``,
``Preview``, ``PreviewUnload``, ``Validate``, ``MeasureEnvelope``) onto a console;
nothing here talks to the bus or decides an exit code. Called by :mod:`uapplace.cli.app`
and :mod:`uapplace.cli.enforce` (the impact table shown before consent).
"""

from __future__ import annotations

import json
import time
from typing import Any

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.panel import Panel
from rich.style import StyleType
from rich.table import Table
from rich.text import Text

from uapplace.cli.session import out
from uapplace.core.conventions import parse_iso


def mib(value: Any) -> str:
    if value is None:
        return "?"
    return f"{float(value):,.0f} MiB"


def on_host(item: dict[str, Any]) -> bool:
    """An option or victim on the CPU tier: its memory is host RAM, and its GPU figures
    (``cost_mib``, ``frees_mib``) are 0 there (docs/placement-rules.md §4.5)."""
    return item.get("device_kind") == "cpu"


def host_mib(value: Any) -> str:
    return f"{mib(value)} of host RAM"


def frees_text(item: dict[str, Any]) -> str:
    """What an option or a victim frees on its device: GPU MiB, or host RAM on the CPU tier."""
    return host_mib(item.get("frees_host_mib")) if on_host(item) else mib(item.get("frees_mib"))


def _expires_in(seconds_from_now: float) -> str:
    if seconds_from_now <= 0:
        return "expired"
    return f"in {seconds_from_now:.0f}s"


class _PlainTable(Table):
    """A table whose text cells are shown as written: Rich reads no markup and no emoji
    codes in them. Model, client and session names come from any ``Admit`` caller: a
    client named ``[/x]`` would otherwise stop ``uapplace status`` with a markup error,
    and ``[blink]`` or ``:fire:`` would change what the operator reads."""

    def add_row(
        self,
        *renderables: RenderableType | None,
        style: StyleType | None = None,
        end_section: bool = False,
    ) -> None:
        cells = (Text(cell) if isinstance(cell, str) else cell for cell in renderables)
        super().add_row(*cells, style=style, end_section=end_section)


def _table(title: str, columns: tuple[str, ...]) -> Table:
    table = _PlainTable(title=title, title_justify="left")
    for column in columns:
        table.add_column(column)
    return table


# --------------------------------------------------------------------------- status


def print_status(state: dict[str, Any]) -> None:
    """``uapplace status`` as text: alerts first, then devices, residents, targets, holds."""
    alert_banner(state.get("alerts") or [])
    out.print(_devices_table(state.get("devices", {})))
    residents = _residents_table(state.get("residents", []))
    if state.get("residents"):
        out.print(residents)
    else:
        out.print("Residents: none")
    _targets_table(state.get("targets"))
    holds = state.get("holds", [])
    for hold in holds:
        out.print(
            f"hold {hold['cookie']}: {hold['model']} by {hold['app_id'] or hold['sender']}: "
            f"{hold['reason']}",
            markup=False,
        )
    count = len(state.get("pending", []))
    out.print(f"Pending: {count}" + (" (see `uapplace pending`)" if count else ""), markup=False)
    registry = state.get("registry") or {}
    if registry.get("reload_error"):
        out.print(f"registry reload failed: {registry['reload_error']}", markup=False)


def _devices_table(devices: dict[str, Any]) -> Table:
    columns = ("device", "kind", "total", "free", "reserved", "room", "source")
    table = _table("Devices", columns)
    for key, device in devices.items():
        table.add_row(
            key,
            str(device.get("kind", "")),
            mib(device.get("total_mib")),
            mib(device.get("free_mib")),
            mib(device.get("reserved_mib")) if "reserved_mib" in device else "-",
            # What placement may still use: every resident at its measured footprint.
            mib(device.get("room_mib")) if "room_mib" in device else "-",
            str(device.get("source", ""))
            + (f" ({device['error']})" if device.get("error") else ""),
        )
    return table


def _residents_table(residents: list[dict[str, Any]]) -> Table:
    columns = ("model", "config", "device", "state", "gpu", "host", "endpoint", "holders")
    table = _table("Residents", columns)
    for resident in residents:
        holders = ", ".join(
            f"{h['client']} ({h['kind']}{': ' + h['detail'] if h.get('detail') else ''})"
            for h in resident.get("holders", [])
        )
        table.add_row(
            resident["model"],
            resident["config"],
            resident["device"],
            resident_state_text(resident),
            mib(resident.get("gpu_mib")),
            mib(resident.get("host_rss_mib")),
            str(resident.get("endpoint") or "-"),
            holders or "-",
        )
    return table


def resident_state_text(resident: dict[str, Any]) -> str:
    """``hot``, or ``hot (asleep)`` while its engine sleeps on its own (llama.cpp idle
    sleep: it still serves, waking on the next request; docs/placement-rules.md §4.2)."""
    state = str(resident.get("state", ""))
    return f"{state} (asleep)" if resident.get("asleep") else state


def _targets_table(targets: object) -> None:
    """Per-target rails (issue 13): what a proxy sizes its slots from, and where it came from."""
    if not isinstance(targets, list) or not targets:
        return
    columns = ("target", "model", "rails", "source", "state", "registry", "live")
    table = _table("Targets (rails)", columns)
    for row in targets:
        if not isinstance(row, dict):
            continue
        live = row.get("live") or {}
        live_text = (
            str(live.get("rails"))
            if live.get("state") == "ok"
            else f"{live.get('state', '?')}: {live.get('detail', '')}"
        )
        rails = row.get("rails")
        table.add_row(
            str(row.get("target_id", "")),
            str(row.get("model", "")),
            str(rails) if rails is not None else "unknown",
            str(row.get("rails_source") or "-"),
            str(row.get("state", "")),
            str(row.get("declared") if row.get("declared") is not None else "-"),
            live_text,
        )
    out.print(table)


def alert_banner(alerts: list[dict[str, Any]]) -> None:
    """Open alerts (a rollback that left a device empty, …) in red, above everything else."""
    if not alerts:
        return
    lines = []
    for alert in alerts:
        repeated = f", {alert['count']}x" if alert.get("count", 1) > 1 else ""
        lines.append(
            f"[bold]{escape(str(alert.get('severity', '')).upper())}[/] "
            f"{escape(str(alert.get('kind', '')))} {escape(str(alert.get('id', '')))} "
            f"({escape(str(alert.get('raised_at', '')))}{repeated}): "
            f"{escape(str(alert.get('subject', '')))}: {escape(str(alert.get('message', '')))}"
        )
    lines.append("Acknowledge with `uapplace status --ack [ID...]`.")
    out.print(
        Panel(
            "\n".join(lines),
            title=f"{len(alerts)} open alert(s)",
            title_align="left",
            style="bold red",
            border_style="red",
        ),
        soft_wrap=False,  # wrap inside the box: an alert's message is never cut off
    )


# --------------------------------------------------------------------------- options


def option_header(option: dict[str, Any]) -> str:
    """``load_alongside m/c on gpu0, costs 8,000 MiB``; on the CPU tier the cost is the
    host RAM it adds (``costs 814 MiB of host RAM``)."""
    target = f"{option['model']}/{option['config']} on {option['device']}"
    cost = host_mib(option.get("host_mib")) if on_host(option) else mib(option.get("cost_mib"))
    return f"{option['kind']} {target}, costs {cost}"


def _option_line(index: int, option: dict[str, Any], recommended: int | None) -> str:
    line = f"  {index}. {option_header(option)}"
    victims = option.get("victims", [])
    if victims:
        acts = "; ".join(_victim_action(v) for v in victims)
        line += f"; {acts}, frees {frees_text(option)}"
    if option.get("expected_s") is not None:
        line += f"; swap ≈ {option['expected_s']:g} s"
    if index == recommended:
        line += "  (recommended)"
    return line


def print_pending(entries: list[dict[str, Any]]) -> None:
    """``uapplace pending`` as text: each parked request and its ranked options."""
    if not entries:
        out.print("No pending placements.")
        return
    now = time.time()
    for entry in entries:
        expires = _expires_in(parse_iso(entry["expires_at"]) - now)
        out.print(
            f"{entry['id']}  {entry['requested_model']}  from {entry['client']}  "
            f"reason {entry['reason']}  expires {expires}",
            markup=False,
        )
        options = entry.get("options", [])
        if not options:
            out.print("  no options (nothing feasible, or still being computed)")
        for index, option in enumerate(options, start=1):
            out.print(_option_line(index, option, entry.get("recommended")), markup=False)
            for victim in option.get("victims", []):
                out.print(_victim_line(victim), markup=False)
    out.print("Apply one with `uapplace apply ID OPTION` (it shows the impact first).")


def print_preview(plan: dict[str, Any]) -> None:
    """``uapplace preview`` as text: options (the first is recommended), why others fail."""
    out.print(f"{plan['model']}: {plan['reason']}", markup=False)
    for index, option in enumerate(plan.get("options", []), start=1):
        out.print(_option_line(index, option, 1), markup=False)
        for victim in option.get("victims", []):
            if victim.get("alternative"):
                out.print(f"     {victim['model']}: {victim['alternative']}", markup=False)
    for line in plan.get("infeasible", []):
        out.print(f"  infeasible: {line}", markup=False)


def _victim_action(victim: dict[str, Any]) -> str:
    """``stops coder/q4, reload ≈ 38 s`` or ``pauses coder/q4, wake ≈ 1.5 s`` (issue 12)."""
    pause = victim.get("action") == "pause"
    verb, again = ("pauses", "wake") if pause else ("stops", "reload")
    seconds = victim.get("serve_again_s")
    when = f"{seconds:g} s" if isinstance(seconds, int | float) else "unmeasured"
    return f"{verb} {victim['model']}/{victim['config']}, {again} ≈ {when}"


def _in_flight_text(victim: dict[str, Any]) -> str:
    """``in_flight`` as read at the time of the call; ``null`` is the proxy not answering."""
    return {True: "yes", False: "no", None: "unknown (counts as busy)"}[victim.get("in_flight")]


def _holders_text(victim: dict[str, Any]) -> str:
    return ", ".join(f"{h['client']} ({h['kind']})" for h in victim.get("holders", [])) or "none"


def _victim_line(victim: dict[str, Any]) -> str:
    """One victim of a displace option under ``pending``: live holders and in-flight work."""
    line = (
        f"     {victim['model']}/{victim['config']} ({victim.get('state', '')}): "
        f"in flight {_in_flight_text(victim)}; holders {_holders_text(victim)}"
    )
    if victim.get("alternative"):
        line += f"; {victim['alternative']}"
    return line


# --------------------------------------------------------------------------- impact


def _victims_table(victims: list[dict[str, Any]]) -> Table:
    """The impact of stopping ``victims``: who holds them, work in flight, MiB, consequence."""
    columns = ("victim", "action", "device", "state", "holders", "in flight", "frees")
    table = _table("It stops or pauses", (*columns, "consequence"))
    for victim in victims:
        table.add_row(
            f"{victim['model']}/{victim['config']}",
            str(victim.get("action", "stop")),
            str(victim.get("device", "")),
            str(victim.get("state", "")),
            _holders_text(victim),
            _in_flight_text(victim),
            frees_text(victim),
            str(victim.get("consequence", "")),
        )
    return table


def show_impact(console: Console, header: str, victims: list[dict[str, Any]], frees: Any) -> None:
    """What a run would stop, shown before anyone consents to it."""
    console.print(header, markup=False)
    if not victims:
        console.print("It stops nothing.")
        return
    console.print(_victims_table(victims))
    console.print(f"Frees {_total_freed(victims, frees)} in total.", markup=False)


def _total_freed(victims: list[dict[str, Any]], frees: Any) -> str:
    """``frees`` (the GPU MiB the caller was told); with victims on the CPU tier, the host
    RAM they free beside it (``0 MiB and 814 MiB of host RAM``, or the host RAM alone
    when every victim is on the host)."""
    host = [v for v in victims if on_host(v)]
    if not host:
        return mib(frees)
    host_total = host_mib(sum(float(v.get("frees_host_mib") or 0.0) for v in host))
    return host_total if len(host) == len(victims) else f"{mib(frees)} and {host_total}"


# --------------------------------------------------------------------------- files


def print_validation(report: dict[str, Any]) -> None:
    """``uapplace validate`` as text: findings, the provenance table, envelopes, the count."""
    for finding in report["findings"]:
        out.print(
            f"{finding['severity']}: {finding['file']}: {finding.get('json_path', '$')}: "
            f"{finding['message']}",
            markup=False,
        )
    table = _table("Provenance", ("entry", "source", "fields", "file", "figures"))
    for (entry, source, file, counts), fields in _grouped_provenance(report.get("provenance", [])):
        table.add_row(entry, source, ", ".join(fields), file, counts)
    out.print(table)
    for row in report.get("provenance", []):
        if row.get("envelope"):
            out.print(f"envelope {row['entry']}: {row['envelope']}", markup=False)
    out.print(f"{report['errors']} error(s), {report['warnings']} warning(s)", markup=False)


def _grouped_provenance(
    rows: list[dict[str, str]],
) -> list[tuple[tuple[str, str, str, str], list[str]]]:
    """One line per entry and file: ``$.devices.gpu0 local reserved_mib, uuid``; a config
    line also says whether its figures count on this machine."""
    grouped: dict[tuple[str, str, str, str], list[str]] = {}
    for row in rows:
        key = (row["entry"], row["source"], row["file"], row.get("measurement", ""))
        grouped.setdefault(key, []).append(row["field"])
    return list(grouped.items())


MEASURED_FIGURES = (
    ("host_rss_mib", "host RSS", "MiB"),
    ("resident_gpu_mib", "GPU memory", "MiB"),
    ("per_session_cap_cells", "per-session cap", "cells"),
    ("context_pool_cells", "context pool", "cells"),
    ("kv_resident_cells", "KV resident", "cells"),
    ("kv_mib_per_1k_cells", "KV past the pool", "MiB per 1,000 cells"),
    ("kv", "KV dtype", ""),
    ("expert_cache_mib", "expert cache", "MiB"),
    ("arena_mib", "arena", "MiB"),
)
"""The figures of ``measure``'s text, in order: key, label, unit."""


def print_measurement(result: dict[str, Any]) -> None:
    """``measure``'s result as text: the footprint and KV geometry recorded, each with
    where it came from, the device, and where it was written."""
    measured: dict[str, Any] = result.get("measurement", {})
    sources: dict[str, str] = result.get("sources", {})
    pids = ", ".join(str(pid) for pid in result.get("pids", []))
    out.print(
        f"measured {result.get('model')}/{result.get('config')} "
        f"({result.get('unit')}, PIDs {pids}) on {measured.get('measured_on')}",
        markup=False,
    )
    for key, label, unit in MEASURED_FIGURES:
        if key not in measured:
            continue
        value = measured[key]
        shown = f"{value:,g} {unit}".rstrip() if isinstance(value, int | float) else str(value)
        source = f" — {sources[key]}" if key in sources else ""
        out.print(f"  {label}: {shown}{source}", markup=False)
    if "slots" in sources:
        out.print(f"  slots: {sources['slots']}", markup=False)
    out.print(_device_line(result.get("device", {})), markup=False)
    out.print(f"written to {result.get('written')}", markup=False)


def _device_line(device: dict[str, Any]) -> str:
    text = f"  device {device.get('key')}: free {device.get('free_mib', 0):,.0f} MiB"
    if "reserved_mib" in device:
        text += f", reserved {device['reserved_mib']:,} MiB ({device.get('reserve_reason')})"
    return text


def print_envelope(result: dict[str, Any]) -> None:
    """``measure --envelope``'s result as text: each timing, and where it was written."""
    envelope = result.get("envelope", {})
    out.print(f"{result.get('model')}/{result.get('config')} ({result.get('unit')}):", markup=False)
    for name, value in envelope.items():
        out.print(f"  {name}: {value}", markup=False)
    out.print(f"written to {result.get('written')}", markup=False)


# --------------------------------------------------------------------------- signals

WATCHED_SIGNALS = {
    "Parked": ("placement_id", "model", "client", "reason"),
    "Resolved": ("placement_id", "outcome"),
    "ResidentChanged": ("model", "config", "device", "state"),
    "EnforcementStep": ("run_id", "step", "ok", "detail"),
    "AlertRaised": ("alert_id", "kind", "severity", "subject", "message"),
}


def signal_line(member: str, body: list[Any], as_json: bool) -> str:
    fields = dict(zip(WATCHED_SIGNALS[member], body, strict=False))
    if as_json:
        return json.dumps({"signal": member, "at": time.time(), **fields})
    return member + " " + " ".join(f"{k}={v}" for k, v in fields.items())
