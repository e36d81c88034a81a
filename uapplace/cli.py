"""``uapplace``: the operator's command line. Every command is one or two bus calls.

When ``uapplaced`` is not reachable, ``status`` and ``pending`` read the ledger
file directly (and say so), ``validate`` checks the files itself, and every
write refuses with exit code 3 rather than race a live writer.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from dbus_fast import Message, MessageType
from rich.console import Console
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from uapplace import __version__, textsafe
from uapplace.client import PlacementClient, PlacementError, bus_daemon_message, user_bus_address
from uapplace.model import DEFAULT_CELLS, parse_iso
from uapplace.paths import BUS_NAME, INTERFACE, OBJECT_PATH, Paths

if TYPE_CHECKING:
    from uapplace.install import InstallReport

# The ledger, registry and install modules build pydantic schemas at import
# (~0.3 s); the commands that need them import them, so `status` stays quick.

T = TypeVar("T")

EXIT_OK = 0
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_AUTHORIZED = 4
EXIT_DRIFTED = 5
EXIT_BUSY = 6
EXIT_NOT_FOUND = 7

EXIT_CODES_HELP = """\b
Exit codes:
  0  ok
  1  refused or failed: validation errors, a failed or rolled-back enforcement,
     a consent flag, or apply/load/unload that would stop something, without --yes
  2  bad usage or an invalid argument
  3  uapplaced not reachable (status/pending/validate read the files instead;
     writes never fall back)
  4  not authorized (polkit, or not the daemon's user)
  5  drifted: the victim set changed since it was shown
  6  busy: another enforcement is running, or the daemon is stopping
  7  not found: unknown placement id, hold cookie, model or config
"""

_EXIT_BY_ERROR = {
    "NotAuthorized": EXIT_NOT_AUTHORIZED,
    "Drifted": EXIT_DRIFTED,
    "Busy": EXIT_BUSY,
    "NotFound": EXIT_NOT_FOUND,
    "UnknownModel": EXIT_NOT_FOUND,
    "InvalidArgument": EXIT_USAGE,
    "org.freedesktop.DBus.Error.InvalidArgs": EXIT_USAGE,
    "Failed": EXIT_REFUSED,
    "Unavailable": EXIT_REFUSED,
}
_UNREACHABLE_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
        "org.freedesktop.DBus.Error.Timeout",
        "org.freedesktop.DBus.Error.Disconnected",
        "org.freedesktop.DBus.Error.NoServer",
        "org.freedesktop.DBus.Error.Spawn.ChildExited",
        "org.freedesktop.DBus.Error.Spawn.ExecFailed",
        "org.freedesktop.DBus.Error.Spawn.Failed",
        "org.freedesktop.systemd1.NoSuchUnit",
    }
)

app = typer.Typer(
    help=(
        "Operator-directed placement of local AI model backends. Talks to uapplaced "
        "(org.uap.Placement1 on the user bus)."
    ),
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

# Piped output (scripts, tests) gets wide lines rather than tables folded at 80 columns.
# textsafe: client, model and session names come from any Admit caller; every line these
# consoles print is stripped of escape sequences and control characters.
out = textsafe.install(
    Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)
)
err = textsafe.install(Console(stderr=True, highlight=False, soft_wrap=True))

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


# --------------------------------------------------------------------------- plumbing


class Unreachable(Exception):
    """No bus, or nobody owns org.uap.Placement1 on it."""


def _fail(code: int, message: str) -> NoReturn:
    err.print(f"uapplace: {message}", markup=False)
    raise typer.Exit(code)


def _exit_for(error: PlacementError) -> int:
    return _EXIT_BY_ERROR.get(error.short, EXIT_REFUSED)


async def _session(work: Callable[[PlacementClient], Awaitable[T]]) -> T:
    address = user_bus_address()
    try:
        client = await PlacementClient.connect(address)
    except Exception as error:
        raise Unreachable(f"cannot reach the user bus at {address}: {error}") from None
    try:
        return await work(client)
    except PlacementError as error:
        if error.name in _UNREACHABLE_ERRORS:
            if await _daemon_on_bus(client):
                # Up but silent (a timeout, a dropped reply): never call that "not running".
                raise PlacementError(
                    "org.uap.Placement1.Error.Failed",
                    f"uapplaced is running ({BUS_NAME} is owned on {address}) but did not "
                    f"answer: {error.message}; `uapplace status` shows what it is doing",
                ) from None
            raise Unreachable(
                f"uapplaced is not running ({BUS_NAME} has no owner on {address}): {error.message}"
            ) from None
        raise
    finally:
        client.disconnect()


async def _daemon_on_bus(client: PlacementClient) -> bool:
    """Whether org.uap.Placement1 has an owner now (``NameHasOwner``); False if unsure."""
    if not client.bus.connected:
        return False
    try:
        async with asyncio.timeout(5.0):
            reply = await client.bus.call(bus_daemon_message("NameHasOwner", "s", [BUS_NAME]))
    except Exception:  # no answer from the bus itself: unsure, so "not running" stands
        return False
    if reply is None or reply.message_type is not MessageType.METHOD_RETURN:
        return False
    return bool(reply.body[0])


def _call(work: Callable[[PlacementClient], Awaitable[T]]) -> T:
    """Run one bus conversation; map failures to the documented exit codes."""
    try:
        return asyncio.run(_session(work))
    except Unreachable as error:
        _fail(EXIT_UNREACHABLE, str(error))
    except PlacementError as error:
        _fail(_exit_for(error), f"{error.short}: {error.message}")


def _print_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")
    sys.stdout.flush()


def _mib(value: Any) -> str:
    if value is None:
        return "?"
    return f"{float(value):,.0f} MiB"


def _in(seconds_from_now: float) -> str:
    if seconds_from_now <= 0:
        return "expired"
    return f"in {seconds_from_now:.0f}s"


# --------------------------------------------------------------------------- version


def _version(value: bool) -> None:
    if value:
        out.print(f"uapplace {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """uapplace: operator-directed placement of local AI model backends."""


# --------------------------------------------------------------------------- reads


def _read_ledger(paths: Paths) -> dict[str, Any]:
    """The ledger file, read-only (never moved aside: that is the daemon's job)."""
    from uapplace.jsonfile import LEDGER_MAX_BYTES, ConfigFileError, read_capped_or_none
    from uapplace.ledger import LedgerFormatError, doc_to_json, parse_ledger_text

    try:
        raw = read_capped_or_none(paths.ledger, LEDGER_MAX_BYTES)
    except ConfigFileError as error:
        _fail(EXIT_UNREACHABLE, f"uapplaced is not running, and {error}")
    if raw is None:
        return {"version": 1, "devices": {}, "residents": [], "pending": [], "usage": {}}
    try:
        doc = parse_ledger_text(raw, paths.ledger)
    except LedgerFormatError as error:
        _fail(
            EXIT_REFUSED,
            f"uapplaced is not running, and {paths.ledger} is corrupt ({error}); "
            "uapplaced moves it aside when it starts",
        )
    return doc_to_json(doc)


def _offline_note(paths: Paths, as_json: bool) -> str:
    note = f"uapplaced is not running; read from {paths.ledger}"
    (err if as_json else out).print(note, markup=False)
    return note


def _state_or_ledger(as_json: bool) -> dict[str, Any]:
    try:
        state: dict[str, Any] = asyncio.run(_session(lambda c: c.get_state()))
        return state
    except Unreachable:
        paths = Paths.from_env()
        _offline_note(paths, as_json)
        doc = _read_ledger(paths)
        doc["daemon"] = False
        doc["ledger_path"] = str(paths.ledger)
        return doc
    except PlacementError as error:
        _fail(_exit_for(error), f"{error.short}: {error.message}")


@app.command()
def status(
    ack: Annotated[
        bool,
        typer.Option(
            "--ack", help="Acknowledge the alerts named (all open alerts when none is named)."
        ),
    ] = False,
    alert_ids: Annotated[
        list[str] | None,
        typer.Argument(metavar="[ID]...", help="Alert ids to acknowledge (with --ack)."),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Residents, devices (free / reserved), holders, holds, pending count, and open alerts
    as a red banner until acknowledged (`uapplace status --ack [ID...]`)."""
    if alert_ids and not ack:
        _fail(EXIT_USAGE, "alert ids are only taken with --ack (uapplace status --ack ID...)")
    if ack:
        _acknowledge(list(alert_ids or []), as_json)
        return
    state = _state_or_ledger(as_json)
    if as_json:
        _print_json(state)
        return
    _alert_banner(state.get("alerts") or [])
    devices = Table(title="Devices", title_justify="left")
    for column in ("device", "kind", "total", "free", "reserved", "source"):
        devices.add_column(column)
    for key, device in state.get("devices", {}).items():
        devices.add_row(
            key,
            str(device.get("kind", "")),
            _mib(device.get("total_mib")),
            _mib(device.get("free_mib")),
            _mib(device.get("reserved_mib")) if "reserved_mib" in device else "-",
            str(device.get("source", ""))
            + (f" ({device['error']})" if device.get("error") else ""),
        )
    out.print(devices)
    residents = Table(title="Residents", title_justify="left")
    for column in ("model", "config", "device", "state", "gpu", "endpoint", "holders"):
        residents.add_column(column)
    for resident in state.get("residents", []):
        holders = ", ".join(
            f"{h['client']} ({h['kind']}{': ' + h['detail'] if h.get('detail') else ''})"
            for h in resident.get("holders", [])
        )
        residents.add_row(
            resident["model"],
            resident["config"],
            resident["device"],
            resident["state"],
            _mib(resident.get("gpu_mib")),
            str(resident.get("endpoint") or "-"),
            holders or "-",
        )
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


def _targets_table(targets: object) -> None:
    """Per-target rails (issue 13): what a proxy sizes its slots from, and where it came from."""
    if not isinstance(targets, list) or not targets:
        return
    table = Table(title="Targets (rails)", title_justify="left")
    for column in ("target", "model", "rails", "source", "state", "registry", "live"):
        table.add_column(column)
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


def _alert_banner(alerts: list[dict[str, Any]]) -> None:
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


def _acknowledge(alert_ids: list[str], as_json: bool) -> None:
    gone: list[str] = _call(lambda c: c.acknowledge_alerts(alert_ids))
    if as_json:
        _print_json({"acknowledged": gone})
    elif gone:
        out.print(f"acknowledged {', '.join(gone)}", markup=False)
    else:
        out.print("no open alerts")


def _option_line(index: int, option: dict[str, Any], recommended: int | None) -> str:
    kind = option["kind"]
    target = f"{option['model']}/{option['config']} on {option['device']}"
    line = f"  {index}. {kind} {target}, costs {_mib(option.get('cost_mib'))}"
    victims = option.get("victims", [])
    if victims:
        acts = "; ".join(_victim_action(v) for v in victims)
        line += f"; {acts}, frees {_mib(option.get('frees_mib'))}"
    if option.get("expected_s") is not None:
        line += f"; swap ≈ {option['expected_s']:g} s"
    if index == recommended:
        line += "  (recommended)"
    return line


@app.command()
def pending(as_json: JsonFlag = False) -> None:
    """Parked requests with their ranked options."""
    try:
        listed: dict[str, Any] = asyncio.run(_session(lambda c: c.list_pending()))
    except Unreachable:
        paths = Paths.from_env()
        note = _offline_note(paths, as_json)
        listed = {"pending": _read_ledger(paths)["pending"], "daemon": False, "note": note}
    except PlacementError as error:
        _fail(_exit_for(error), f"{error.short}: {error.message}")
    if as_json:
        _print_json(listed)
        return
    entries = listed.get("pending", [])
    if not entries:
        out.print("No pending placements.")
        return
    now = time.time()
    for entry in entries:
        expires = _in(parse_iso(entry["expires_at"]) - now)
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


@app.command()
def preview(
    model: Annotated[str, typer.Argument(help="Model key, config key or advertised id.")],
    cells: Annotated[
        int, typer.Option("--cells", min=1, help="Context the request needs (cells).")
    ] = DEFAULT_CELLS,
    as_json: JsonFlag = False,
) -> None:
    """What placing MODEL would take: options, victims, why others are infeasible."""
    plan: dict[str, Any] = _call(lambda c: c.preview(model, cells))
    if as_json:
        _print_json(plan)
        return
    out.print(f"{plan['model']}: {plan['reason']}", markup=False)
    for index, option in enumerate(plan.get("options", []), start=1):
        out.print(_option_line(index, option, 1), markup=False)
        for victim in option.get("victims", []):
            if victim.get("alternative"):
                out.print(f"     {victim['model']}: {victim['alternative']}", markup=False)
    for line in plan.get("infeasible", []):
        out.print(f"  infeasible: {line}", markup=False)


# --------------------------------------------------------------------------- apply


def _victims_table(victims: list[dict[str, Any]]) -> Table:
    """The impact of stopping ``victims``: who holds them, work in flight, MiB, consequence."""
    table = Table(title="It stops or pauses", title_justify="left")
    for column in (
        "victim",
        "action",
        "device",
        "state",
        "holders",
        "in flight",
        "frees",
        "consequence",
    ):
        table.add_column(column)
    for victim in victims:
        table.add_row(
            f"{victim['model']}/{victim['config']}",
            str(victim.get("action", "stop")),
            str(victim.get("device", "")),
            str(victim.get("state", "")),
            _holders_text(victim),
            _in_flight_text(victim),
            _mib(victim.get("frees_mib")),
            str(victim.get("consequence", "")),
        )
    return table


def _show_impact(console: Console, header: str, victims: list[dict[str, Any]], frees: Any) -> None:
    console.print(header, markup=False)
    if not victims:
        console.print("It stops nothing.")
        return
    console.print(_victims_table(victims))
    console.print(f"Frees {_mib(frees)} in total.", markup=False)


def _option_header(option: dict[str, Any]) -> str:
    target = f"{option['model']}/{option['config']} on {option['device']}"
    return f"{option['kind']} {target}, costs {_mib(option.get('cost_mib'))}"


def _consented(stops: bool, yes: bool, as_json: bool, question: str) -> bool:
    """``--yes``, or a y/N answer on a terminal; nothing to stop needs neither."""
    if not stops or yes:
        return True
    if as_json or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    return bool(typer.confirm(question, default=False))


class _Progress:
    """``EnforcementStep`` signals of one run, printed as they arrive (the live display).

    Ours is the first run that *starts* (its ``revalidate`` step) once subscribed:
    one run goes at a time machine-wide, and a call that cannot start is refused
    ``Busy`` before any step. Steps of a run already under way are ignored; if the
    result names another run id anyway, :func:`_follow` prints the result's steps.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.started = time.monotonic()
        self.run_id: str | None = None
        self.shown = 0

    def on_message(self, message: Message) -> None:
        if (
            message.message_type is not MessageType.SIGNAL
            or message.interface != INTERFACE
            or message.member != "EnforcementStep"
            or message.signature != "ssbs"
        ):
            return
        run_id, step, ok, detail = message.body
        if self.run_id is None:
            if step != "revalidate":
                return
            self.run_id = run_id
        if run_id != self.run_id:
            return
        self.shown += 1
        mark = "ok" if ok else "FAILED"
        style = "green" if ok else "bold red"
        elapsed = time.monotonic() - self.started
        self.console.print(
            f"  [{elapsed:6.1f}s] [{style}]{mark:>6}[/] {escape(step)}"
            + (f": {escape(detail)}" if detail else "")
        )


async def _follow(
    client: PlacementClient, console: Console, what: str, call: Callable[[], Awaitable[Any]]
) -> Any:
    """Subscribe to ``EnforcementStep`` first, then make the call, with no call deadline:
    a drain may take as long as the requests in flight take. Returns its result."""
    progress = _Progress(console)
    client.bus.add_message_handler(progress.on_message)
    rule = (
        f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}',interface='{INTERFACE}',"
        "member='EnforcementStep'"
    )
    reply = await client.bus.call(bus_daemon_message("AddMatch", "s", [rule]))
    if reply is None or reply.message_type is MessageType.ERROR:
        raise Unreachable(f"the bus refused the signal subscription: {reply and reply.body}")
    client.call_timeout = None
    console.print(f"{what}: running (steps appear as uapplaced reports them)", markup=False)
    status = console.status(f"{what}…") if console.is_terminal else contextlib.nullcontext()
    try:
        with status:
            result = await call()
    finally:
        client.bus.remove_message_handler(progress.on_message)
    if isinstance(result, dict) and result.get("runId") != progress.run_id:
        _steps(result, console)  # not seen live (signals lost or another run's came first)
    return result


def _steps(result: dict[str, Any], console: Console) -> None:
    for step in result.get("steps", []):
        mark = "ok" if step.get("ok") else "FAILED"
        detail = f": {step['detail']}" if step.get("detail") else ""
        console.print(f"  {step['name']}: {mark}{detail}", markup=False)


def _finish_result(result: dict[str, Any], as_json: bool, what: str) -> None:
    """Print the outcome (its steps were shown live by :func:`_follow`); exit 1 unless ok."""
    if as_json:
        _print_json(result)
    else:
        if result.get("ok"):
            out.print(f"{what}: done", markup=False)
        else:
            out.print(f"[bold red]{escape(what)}: failed[/]")
        if result.get("rolledBack"):
            out.print("  rolled back to the previous residents")
        if result.get("error"):
            out.print(f"  error: {result['error']}", markup=False)
    if not result.get("ok"):
        raise typer.Exit(EXIT_REFUSED)


def _not_consented(what: str) -> NoReturn:
    _fail(EXIT_REFUSED, f"{what}: nothing stopped; re-run with --yes to do exactly this")


YesFlag = Annotated[
    bool,
    typer.Option(
        "--yes",
        help="Consent to stopping what the impact shows (otherwise asked on a terminal, "
        "refused elsewhere). The signature shown travels with the call: if it changed, "
        "nothing stops (exit 5).",
    ),
]


@app.command()
def apply(
    placement_id: Annotated[str, typer.Argument(metavar="ID", help="Placement id (plc-xxxxxx).")],
    option: Annotated[int, typer.Argument(min=1, help="1-based option number from `pending`.")],
    yes: YesFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Show the impact of OPTION for placement ID; with --yes (or y on a terminal), enforce
    exactly that and follow it step by step until the run ends."""
    console = err if as_json else out
    what = f"apply {placement_id} option {option}"

    async def work(client: PlacementClient) -> dict[str, Any] | None:
        listed = await client.list_pending()
        entry = next((e for e in listed.get("pending", []) if e["id"] == placement_id), None)
        if entry is None:
            raise PlacementError(
                "org.uap.Placement1.Error.NotFound",
                f"no pending placement {placement_id} (it may have expired or been resolved)",
            )
        options = entry.get("options", [])
        if not 1 <= option <= len(options):
            raise PlacementError(
                "org.uap.Placement1.Error.InvalidArgument",
                f"option {option} is out of range: placement {placement_id} has "
                + (f"options 1..{len(options)}" if options else "no options"),
            )
        chosen = options[option - 1]
        header = (
            f"Placement {entry['id']} ({entry['requested_model']} for {entry['client']}): "
            f"option {option} = {_option_header(chosen)}."
        )
        victims = chosen.get("victims", [])
        _show_impact(console, header, victims, chosen.get("frees_mib"))
        # Apply always asks (it is the answer to a parked request), stopping or not.
        if not _consented(True, yes, as_json, f"Apply option {option} of {placement_id}?"):
            return None
        signature = list(chosen.get("signature", []))
        result: dict[str, Any] = await _follow(
            client, console, what, lambda: client.apply(placement_id, option, signature)
        )
        return result

    result = _call(work)
    if result is None:
        _not_consented(f"not applied ({what})")
    _finish_result(result, as_json, what)


@app.command()
def dismiss(
    placement_id: Annotated[str, typer.Argument(metavar="ID", help="Placement id (plc-xxxxxx).")],
    as_json: JsonFlag = False,
) -> None:
    """Refuse a parked request; its client gets a clean fallback."""
    dismissed = _call(lambda c: c.dismiss(placement_id))
    if as_json:
        _print_json({"dismissed": dismissed, "placement_id": placement_id})
    else:
        out.print(f"dismissed {placement_id}", markup=False)


@app.command()
def load(
    model: Annotated[str, typer.Argument(help="Model to load (operator-initiated).")],
    yes: YesFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Load MODEL now with the recommended option (as `preview` ranks it).

    Shows the impact first; when it would stop a model, needs --yes (or y on a
    terminal). Then follows the run step by step until it ends."""
    console = err if as_json else out
    what = f"load {model}"

    async def work(client: PlacementClient) -> dict[str, Any] | None:
        plan: dict[str, Any] = await client.preview(model, DEFAULT_CELLS)
        options = plan.get("options", [])
        if not options:
            # Nothing can stop: let the daemon say why in its own words (UnknownModel, …).
            result: dict[str, Any] = await client.load(model, [])
            return result
        chosen = options[0]
        victims = chosen.get("victims", [])
        header = f"Load {model}: {_option_header(chosen)}."
        _show_impact(console, header, victims, chosen.get("frees_mib"))
        if not _consented(bool(victims), yes, as_json, f"Stop the models above to load {model}?"):
            return None
        signature = list(chosen.get("signature", []))
        result = await _follow(client, console, what, lambda: client.load(model, signature))
        return result

    result = _call(work)
    if result is None:
        _not_consented(f"not loaded ({what})")
    _finish_result(result, as_json, what)


@app.command()
def unload(
    model: Annotated[str, typer.Argument(help="Resident model to stop.")],
    yes: YesFlag = False,
    as_json: JsonFlag = False,
) -> None:
    """Stop MODEL (drain, in-flight refusal, verify the memory came back).

    Shows what stops first and needs --yes (or y on a terminal); then follows the
    run step by step until it ends."""
    console = err if as_json else out
    what = f"unload {model}"

    async def work(client: PlacementClient) -> dict[str, Any] | None:
        preview_json: dict[str, Any] = await client.preview_unload(model)
        victims = preview_json.get("victims", [])
        _show_impact(console, f"Unload {model}:", victims, preview_json.get("frees_mib"))
        if not _consented(bool(victims), yes, as_json, f"Stop {model}?"):
            return None
        signature = list(preview_json.get("signature", []))
        result: dict[str, Any] = await _follow(
            client, console, what, lambda: client.unload(model, signature)
        )
        return result

    result = _call(work)
    if result is None:
        _not_consented(f"not unloaded ({what})")
    _finish_result(result, as_json, what)


@app.command()
def units(
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Write nothing: list the drop-ins that differ from the registry's graph "
            "(exit 1 when any is stale).",
        ),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Write Conflicts= drop-ins for units that can never be resident together (in MiB)."""
    if check:
        stale: list[str] = _call(lambda c: c.check_units())
        if as_json:
            _print_json({"stale": stale})
        else:
            for path in stale:
                out.print(f"stale {path}", markup=False)
            if not stale:
                out.print("the Conflicts= drop-ins match the registry")
        if stale:
            raise typer.Exit(EXIT_REFUSED)
        return
    written: list[str] = _call(lambda c: c.write_units())
    if as_json:
        _print_json({"written": written})
        return
    for path in written:
        out.print(f"wrote {path}", markup=False)
    if not written:
        out.print("nothing to write")


@app.command()
def measure(
    model: Annotated[str, typer.Argument(help="Model key.")],
    config: Annotated[str, typer.Argument(help="Config key (default: the resident one).")] = "",
    envelope: Annotated[
        bool,
        typer.Option(
            "--envelope",
            help="Measure the enforcement envelope instead: takes the backend down (needs --yes).",
        ),
    ] = False,
    yes: Annotated[
        bool, typer.Option("--yes", help="Consent to taking the backend down (--envelope).")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Record MODEL's measured footprint from its live engine into the local registry.

    With --envelope: take the backend down and up to time it (stop, memory back, cold
    and warm start, sleep and wake where the config has a pause lever); needs --yes."""
    if envelope:
        _measure_envelope(model, config, yes, as_json)
        return
    result: dict[str, Any] = _call(lambda c: c.measure(model, config))
    if as_json:
        _print_json(result)
    else:
        out.print(json.dumps(result, indent=2), markup=False)


def _envelope_steps(model: str, config: str) -> list[str]:
    """What ``measure --envelope`` will do, from the registry files (no daemon needed)."""
    from uapplace.registry import ConfigFileError, load_registry

    paths = Paths.from_env()
    try:
        registry = load_registry(paths.repo_registry, paths.local_registry).registry
    except ConfigFileError:
        registry = None
    resolved = registry.resolve(model) if registry is not None else None
    found = resolved[0] if resolved else None
    chosen = found.configs.get(config) if found is not None and config else None
    unit = (found.unit_for(chosen) if chosen else found.unit) if found else None
    what = f"{model}/{config}" if config else model
    steps = [
        f"stop {unit or 'its unit'}: {what} goes down, requests for it wait or fail",
        "wait until the device probe shows its memory back",
        "start it (cold start) and wait until it is healthy and serves its id",
        "stop it and start it again (warm start)",
    ]
    if chosen is not None and chosen.sleep_level is not None:
        steps.append(f"sleep it (vLLM level {chosen.sleep_level}), read the memory freed, wake it")
    elif chosen is None:
        steps.append("if the config has a pause lever: sleep it, read the memory freed, wake it")
    steps.append("leave it running and record the envelope in the machine-local registry")
    return steps


def _measure_envelope(model: str, config: str, yes: bool, as_json: bool) -> None:
    if not yes:
        err.print(
            "measure --envelope takes the backend down. It will:\n"
            + "\n".join(
                f"  {n}. {step}" for n, step in enumerate(_envelope_steps(model, config), 1)
            )
            + "\nRun again with --yes to do it.",
            markup=False,
        )
        raise typer.Exit(EXIT_REFUSED)
    result: dict[str, Any] = _call(lambda c: c.measure_envelope(model, config))
    if as_json:
        _print_json(result)
        return
    envelope = result.get("envelope", {})
    out.print(f"{result.get('model')}/{result.get('config')} ({result.get('unit')}):", markup=False)
    for name, value in envelope.items():
        out.print(f"  {name}: {value}", markup=False)
    out.print(f"written to {result.get('written')}", markup=False)


# --------------------------------------------------------------------------- validate


def _validate_locally() -> dict[str, Any]:
    from uapplace.capacity import has_errors, load_policy
    from uapplace.capacity import validate as validate_files
    from uapplace.devices import make_probe
    from uapplace.registry import ConfigFileError, gate_on_devices, load_registry, provenance_rows

    paths = Paths.from_env()
    try:
        loaded = load_registry(paths.repo_registry, paths.local_registry)
        # As the daemon does: a measurement taken on another card than the probe sees is unknown.
        loaded = gate_on_devices(loaded, make_probe(paths, loaded.registry).read())
    except ConfigFileError as error:
        findings = [
            {
                "severity": "error",
                "file": str(e.file),
                "json_path": e.json_path,
                "message": e.message,
            }
            for e in error.every()
        ]
        return {
            "ok": False,
            "errors": len(findings),
            "warnings": 0,
            "findings": findings,
            "provenance": [],
            "daemon": False,
        }
    try:
        policy = load_policy(paths.capacity_policy)
        problems = []
    except ConfigFileError as error:
        policy = None
        problems = [
            {
                "severity": "error",
                "file": str(e.file),
                "json_path": e.json_path,
                "message": e.message,
            }
            for e in error.every()
        ]
    checked = validate_files(loaded, policy)
    findings = problems + [f.to_json() for f in checked]
    return {
        "ok": not problems and not has_errors(checked),
        "errors": sum(1 for f in findings if f["severity"] == "error"),
        "warnings": sum(1 for f in findings if f["severity"] == "warning"),
        "findings": findings,
        "provenance": provenance_rows(loaded),
        "daemon": False,
    }


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


@app.command()
def validate(as_json: JsonFlag = False) -> None:
    """Cross-check the registry files and the capacity policy; print provenance.

    Exits 1 when there is any error. Without uapplaced, checks the files directly."""
    try:
        report: dict[str, Any] = asyncio.run(_session(lambda c: c.validate()))
    except Unreachable:
        (err if as_json else out).print(
            "uapplaced is not running; validated the files directly", markup=False
        )
        report = _validate_locally()
    except PlacementError as error:
        _fail(_exit_for(error), f"{error.short}: {error.message}")
    if as_json:
        _print_json(report)
    else:
        for finding in report["findings"]:
            out.print(
                f"{finding['severity']}: {finding['file']}: {finding.get('json_path', '$')}: "
                f"{finding['message']}",
                markup=False,
            )
        table = Table(title="Provenance", title_justify="left")
        for column in ("entry", "source", "fields", "file", "figures"):
            table.add_column(column)
        for (entry, source, file, counts), fields in _grouped_provenance(
            report.get("provenance", [])
        ):
            table.add_row(entry, source, ", ".join(fields), file, counts)
        out.print(table)
        for row in report.get("provenance", []):
            if row.get("envelope"):
                out.print(f"envelope {row['entry']}: {row['envelope']}", markup=False)
        out.print(f"{report['errors']} error(s), {report['warnings']} warning(s)", markup=False)
    if not report["ok"]:
        raise typer.Exit(EXIT_REFUSED)


# --------------------------------------------------------------------------- auto


@app.command()
def auto(
    enable: Annotated[bool, typer.Option("--enable", help="Turn auto-placement on.")] = False,
    disable: Annotated[bool, typer.Option("--disable", help="Turn auto-placement off.")] = False,
    allow_displace: Annotated[
        list[str] | None,
        typer.Option(
            "--allow-displace",
            metavar="MODEL",
            help="MODEL may evict other models unattended to get loaded (the victims "
            "are chosen as in `preview`; held or busy models are never stopped).",
        ),
    ] = None,
    disallow_displace: Annotated[
        list[str] | None, typer.Option("--disallow-displace", metavar="MODEL")
    ] = None,
    allow_unload: Annotated[
        list[str] | None,
        typer.Option("--allow-unload", metavar="MODEL", help="May be unloaded when idle."),
    ] = None,
    disallow_unload: Annotated[
        list[str] | None, typer.Option("--disallow-unload", metavar="MODEL")
    ] = None,
    idle_after: Annotated[
        int | None,
        typer.Option("--idle-after", metavar="SECS", min=60, help="Idle time before unload."),
    ] = None,
    yes: Annotated[
        bool, typer.Option("--yes", help="Record the standing consent the flags grant.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Show or change the auto policy. Without flags, prints it.

    --allow-displace and --allow-unload record standing consent to stop models
    unattended: they refuse without --yes and print what they would consent to."""
    if enable and disable:
        _fail(EXIT_USAGE, "--enable and --disable contradict each other")
    changes: dict[str, Any] = {}
    if enable:
        changes["enable"] = True
    if disable:
        changes["disable"] = True
    for key, names in (
        ("allow_displace", allow_displace),
        ("disallow_displace", disallow_displace),
        ("allow_unload", allow_unload),
        ("disallow_unload", disallow_unload),
    ):
        if names:
            changes[key] = list(names)
    if idle_after is not None:
        changes["unload_idle_after_secs"] = idle_after
    granting = [
        *(f"stop other models unattended to load {m}" for m in allow_displace or []),
        *(f"unload {m} when it has been idle" for m in allow_unload or []),
    ]
    if granting and not yes:
        for line in granting:
            out.print(f"would consent to: {line}", markup=False)
        _fail(EXIT_REFUSED, "standing consent not recorded: re-run with --yes")

    async def work(client: PlacementClient) -> Any:
        if changes:
            return await client.set_auto_policy(changes, yes)
        return await client.get_auto_policy()

    policy = _call(work)
    if as_json:
        _print_json(policy)
    else:
        out.print(json.dumps(policy, indent=2), markup=False)


# --------------------------------------------------------------------------- holds


def _stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for number in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(number, stop.set)


@app.command()
def hold(
    model: Annotated[str, typer.Argument(help="Model to pin: never a victim while held.")],
    reason: Annotated[str, typer.Option("--reason", help="Why (shown to the operator).")],
    app_id: Annotated[str, typer.Option("--app-id", help="Who holds it.")] = "uapplace-cli",
    as_json: JsonFlag = False,
) -> None:
    """Pin MODEL until Ctrl-C. A hold lives as long as this command's bus connection:
    it stays running, prints the cookie, and the hold ends when it exits."""

    async def work(client: PlacementClient) -> None:
        cookie = await client.hold(model, reason, app_id)
        if as_json:
            sys.stdout.write(json.dumps({"cookie": cookie, "model": model}) + "\n")
        else:
            sys.stdout.write(f"holding {model} (cookie {cookie}); Ctrl-C releases it\n")
        sys.stdout.flush()
        stop = asyncio.Event()
        _stop_on_signals(stop)
        lost = asyncio.ensure_future(client.bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
        waiting = asyncio.ensure_future(stop.wait())
        await asyncio.wait({lost, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        if lost.done():
            raise Unreachable("lost the bus connection; the hold has ended")
        lost.cancel()
        # Already gone (daemon restarted): nothing left to release.
        with contextlib.suppress(PlacementError):
            await client.release(cookie)

    _call(work)


@app.command()
def release(
    cookie: Annotated[int, typer.Argument(min=1, help="Cookie printed by `hold`.")],
) -> None:
    """End a hold by its cookie. The holding command does this itself on exit; ending another
    connection's hold needs polkit's yes for org.uap.placement.release-others (exit 4 otherwise)."""
    _call(lambda c: c.release(cookie))
    out.print(f"released hold {cookie}")


# --------------------------------------------------------------------------- watch

_WATCHED = {
    "Parked": ("placement_id", "model", "client", "reason"),
    "Resolved": ("placement_id", "outcome"),
    "ResidentChanged": ("model", "config", "device", "state"),
    "EnforcementStep": ("run_id", "step", "ok", "detail"),
    "AlertRaised": ("alert_id", "kind", "severity", "subject", "message"),
}


def _signal_line(member: str, body: list[Any], as_json: bool) -> str:
    fields = dict(zip(_WATCHED[member], body, strict=False))
    if as_json:
        return json.dumps({"signal": member, "at": time.time(), **fields})
    return member + " " + " ".join(f"{k}={v}" for k, v in fields.items())


@app.command()
def watch(as_json: JsonFlag = False) -> None:
    """Follow Parked, Resolved, ResidentChanged, EnforcementStep and AlertRaised until Ctrl-C.

    ``--json``: one JSON object per line, the same objects as the data of the shim's
    ``GET /api/placement/events`` (``{id, event, at, data}``; ids count from 1 per watch).
    """
    from uapplace.events import EventLog, json_line

    numbered = EventLog()

    async def work(client: PlacementClient) -> None:
        bus = client.bus

        def on_message(message: Message) -> None:
            if (
                message.message_type is MessageType.SIGNAL
                and message.interface == INTERFACE
                and message.member in _WATCHED
            ):
                if as_json:
                    line = json_line(numbered.publish_signal(message.member, message.body))
                else:
                    line = _signal_line(message.member, message.body, as_json)
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

        bus.add_message_handler(on_message)
        rule = f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}',interface='{INTERFACE}'"
        reply = await bus.call(bus_daemon_message("AddMatch", "s", [rule]))
        if reply is None or reply.message_type is MessageType.ERROR:
            raise Unreachable(f"the bus refused the signal subscription: {reply and reply.body}")
        # Once this line is out the subscription is in place (scripts may wait for it).
        sys.stderr.write("watching org.uap.Placement1 signals; Ctrl-C stops\n")
        sys.stderr.flush()
        stop = asyncio.Event()
        _stop_on_signals(stop)
        lost = asyncio.ensure_future(bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
        waiting = asyncio.ensure_future(stop.wait())
        await asyncio.wait({lost, waiting}, return_when=asyncio.FIRST_COMPLETED)
        waiting.cancel()
        lost.cancel()

    _call(work)


# --------------------------------------------------------------------------- install


def _print_install(report: InstallReport, as_json: bool) -> None:
    if as_json:
        _print_json(report.to_json())
    else:
        for change in report.files:
            detail = f" ({change.detail})" if change.detail else ""
            out.print(f"{change.action}: {change.path}{detail}", markup=False)
        out.print(report.reload_message, markup=False)
    if not report.ok:
        raise typer.Exit(EXIT_REFUSED)


@app.command()
def install(
    force: Annotated[
        bool, typer.Option("--force", help="Replace files not written by uapplace install.")
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """Install the D-Bus activation file and the uapplaced user unit, then reload."""
    from uapplace import install as installer

    try:
        report = asyncio.run(installer.install(Paths.from_env(), force))
    except installer.InstallError as error:
        _fail(EXIT_REFUSED, str(error))
    _print_install(report, as_json)


@app.command()
def uninstall(as_json: JsonFlag = False) -> None:
    """Remove exactly the files `uapplace install` wrote, then reload."""
    from uapplace import install as installer

    try:
        report = asyncio.run(installer.uninstall(Paths.from_env()))
    except installer.InstallError as error:
        _fail(EXIT_REFUSED, str(error))
    _print_install(report, as_json)


# --------------------------------------------------------------------------- demo


@app.command()
def demo(
    keep: Annotated[
        bool, typer.Option("--keep", help="Leave the demo running until Ctrl-C.")
    ] = False,
    single_upstream: Annotated[
        bool,
        typer.Option(
            "--single-upstream",
            help="Both engines on one port, one at a time, as behind the stock UAP proxy.",
        ),
    ] = False,
    proxy_url: Annotated[
        str | None,
        typer.Option(
            "--proxy-url", help="An outside proxy's base URL (its /internal/placement routes)."
        ),
    ] = None,
    proxy_token: Annotated[
        str | None,
        typer.Option("--proxy-token", help="That proxy's PROXY_AUTH_TOKEN (printed either way)."),
    ] = None,
) -> None:
    """Run the embedded demo (contained systemd, simulated GPU, fake engines)."""
    if proxy_url is not None and not proxy_url.startswith(("http://", "https://")):
        raise typer.BadParameter(
            f"{proxy_url!r} is not an http:// or https:// URL", param_hint="--proxy-url"
        )
    if proxy_token is not None and proxy_url is None:
        raise typer.BadParameter("needs --proxy-url", param_hint="--proxy-token")
    module = importlib.import_module("uapplace.demo")  # slow to import: only for this command
    code = module.run(
        keep, single_upstream=single_upstream, proxy_url=proxy_url, proxy_token=proxy_token
    )
    raise typer.Exit(int(code))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
