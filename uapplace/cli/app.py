"""``uapplace``: the operator's command line. Every command is one or two bus calls.

When ``uapplaced`` is not reachable, ``status`` and ``pending`` read the ledger
file directly (and say so), ``validate`` checks the files itself, and every
write refuses with exit code 3 rather than race a live writer.

This module holds the click app: each command's arguments, help and output mode (in
the help and error format of the typer app it was: :mod:`uapplace.cli.params`).
The plumbing (consoles, exit codes, the bus conversation) is in
:mod:`uapplace.cli.session`, the text rendering in :mod:`uapplace.cli.render`,
``apply``/``load``/``unload`` in :mod:`uapplace.cli.enforce`.

It is the *light* app (docs/architecture.md, "The command line: light and local"): it
imports click, rich, dbus-fast and the bus client, nothing that reads the files with
pydantic, controls units (pystemd) or speaks HTTP (aiohttp). ``install``,
``uninstall``, ``demo``, ``logs``, ``unit``, ``measure --envelope`` and the file
fallbacks of ``status``/``pending``/``validate`` run in :mod:`uapplace.cli.local`,
exec'd in this process (:mod:`uapplace.cli.forward`); ``top`` in :mod:`uapplace.cli.top`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any, NoReturn

import click
from dbus_fast import Message, MessageType

from uapplace import __version__
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.events import EventLog, json_line
from uapplace.cli.enforce import apply_impact, enforce, load_impact, unload_impact
from uapplace.cli.forward import (
    LOCAL_COMMANDS,
    MEASURE_ENVELOPE,
    OFFLINE_PENDING,
    OFFLINE_STATUS,
    OFFLINE_VALIDATE,
    PASS_THROUGH,
    forward_argv,
    run_local,
)
from uapplace.cli.params import Arg, F, Group, Integer, Opt, flag, json_flag
from uapplace.cli.render import (
    WATCHED_SIGNALS,
    print_measurement,
    print_pending,
    print_preview,
    print_status,
    print_validation,
    signal_line,
)
from uapplace.cli.session import (
    APP_HELP,
    EXIT_CODES_HELP,
    EXIT_REFUSED,
    EXIT_USAGE,
    Unreachable,
    call,
    call_or,
    exit_status,
    fail,
    out,
    print_json,
    subscribe,
    until_stopped,
)
from uapplace.core.conventions import DEFAULT_CELLS
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH


def _version(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    if value:
        out.print(f"uapplace {__version__}")
        ctx.exit()


@click.group(cls=Group, help=APP_HELP, epilog=EXIT_CODES_HELP, no_args_is_help=True)
@click.option(
    "--version",
    cls=Opt,
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_version,
    help="Print the version.",
)
def app() -> None:
    """uapplace: operator-directed placement of local AI model backends."""


def _local(command: str, as_json: bool) -> Callable[[Unreachable], NoReturn]:
    """Without uapplaced: exec the local app's ``command`` (it reads the files)."""

    def offline(_: Unreachable) -> NoReturn:
        run_local([command, *(["--json"] if as_json else [])])

    return offline


# --------------------------------------------------------------------------- reads


@app.command()
@flag("--ack", "ack", "Acknowledge the alerts named (all open alerts when none is named).")
@click.argument(
    "alert_ids",
    cls=Arg,
    nargs=-1,
    required=False,
    metavar="[ID]...",
    help="Alert ids to acknowledge (with --ack).",
)
@json_flag
def status(ack: bool, alert_ids: tuple[str, ...], as_json: bool) -> None:
    """Residents, devices (free / reserved), holders, holds, pending count, and open alerts
    as a red banner until acknowledged (`uapplace status --ack [ID...]`)."""
    if alert_ids and not ack:
        fail(EXIT_USAGE, "alert ids are only taken with --ack (uapplace status --ack ID...)")
    if ack:
        _acknowledge(list(alert_ids or []), as_json)
        return
    state: dict[str, Any] = call_or(lambda c: c.get_state(), _local(OFFLINE_STATUS, as_json))
    if as_json:
        print_json(state)
        return
    print_status(state)


def _acknowledge(alert_ids: list[str], as_json: bool) -> None:
    gone: list[str] = call(lambda c: c.acknowledge_alerts(alert_ids))
    if as_json:
        print_json({"acknowledged": gone})
    elif gone:
        out.print(f"acknowledged {', '.join(gone)}", markup=False)
    else:
        out.print("no open alerts")


@app.command()
@json_flag
def pending(as_json: bool) -> None:
    """Parked requests with their ranked options."""
    listed: dict[str, Any] = call_or(lambda c: c.list_pending(), _local(OFFLINE_PENDING, as_json))
    if as_json:
        print_json(listed)
        return
    print_pending(listed.get("pending", []))


@app.command()
@click.argument("model", cls=Arg, help="Model key, config key or advertised id.")
@click.option(
    "--cells",
    cls=Opt,
    type=Integer(1),
    default=DEFAULT_CELLS,
    help="Context the request needs (cells).",
)
@json_flag
def preview(model: str, cells: int, as_json: bool) -> None:
    """What placing MODEL would take: options, victims, why others are infeasible."""
    plan: dict[str, Any] = call(lambda c: c.preview(model, cells))
    if as_json:
        print_json(plan)
        return
    print_preview(plan)


# --------------------------------------------------------------------------- apply

yes_flag = flag(
    "--yes",
    "yes",
    "Consent to stopping what the impact shows (otherwise asked on a terminal, "
    "refused elsewhere). The signature shown travels with the call: if it changed, "
    "nothing stops (exit 5).",
)
placement_id_argument = click.argument(
    "placement_id", cls=Arg, metavar="ID", help="Placement id (plc-xxxxxx)."
)


@app.command()
@placement_id_argument
@click.argument("option", cls=Arg, type=Integer(1), help="1-based option number from `pending`.")
@yes_flag
@json_flag
def apply(placement_id: str, option: int, yes: bool, as_json: bool) -> None:
    """Show the impact of OPTION for placement ID; with --yes (or y on a terminal), enforce
    exactly that and follow it step by step until the run ends."""
    enforce(
        f"apply {placement_id} option {option}",
        "not applied",
        yes,
        as_json,
        lambda client: apply_impact(client, placement_id, option),
        lambda client, signature: client.apply(placement_id, option, signature),
    )


@app.command()
@placement_id_argument
@json_flag
def dismiss(placement_id: str, as_json: bool) -> None:
    """Refuse a parked request; its client gets a clean fallback."""
    dismissed = call(lambda c: c.dismiss(placement_id))
    if as_json:
        print_json({"dismissed": dismissed, "placement_id": placement_id})
    else:
        out.print(f"dismissed {placement_id}", markup=False)


@app.command()
@click.argument("model", cls=Arg, help="Model to load (operator-initiated).")
@yes_flag
@json_flag
def load(model: str, yes: bool, as_json: bool) -> None:
    """Load MODEL now with the recommended option (as `preview` ranks it).

    Shows the impact first; when it would stop a model, needs --yes (or y on a
    terminal). Then follows the run step by step until it ends."""
    enforce(
        f"load {model}",
        "not loaded",
        yes,
        as_json,
        lambda client: load_impact(client, model),
        lambda client, signature: client.load(model, signature),
    )


@app.command()
@click.argument("model", cls=Arg, help="Resident model to stop.")
@yes_flag
@json_flag
def unload(model: str, yes: bool, as_json: bool) -> None:
    """Stop MODEL (drain, in-flight refusal, verify the memory came back).

    Shows what stops first and needs --yes (or y on a terminal); then follows the
    run step by step until it ends."""
    enforce(
        f"unload {model}",
        "not unloaded",
        yes,
        as_json,
        lambda client: unload_impact(client, model),
        lambda client, signature: client.unload(model, signature),
    )


@app.command()
@flag(
    "--check",
    "check",
    "Write nothing: list the drop-ins that differ from the registry's graph "
    "(exit 1 when any is stale).",
)
@json_flag
def units(check: bool, as_json: bool) -> None:
    """Write Conflicts= drop-ins for units that can never be resident together (in MiB)."""
    if check:
        stale: list[str] = call(lambda c: c.check_units())
        if as_json:
            print_json({"stale": stale})
        else:
            for path in stale:
                out.print(f"stale {path}", markup=False)
            if not stale:
                out.print("the Conflicts= drop-ins match the registry")
        if stale:
            raise SystemExit(EXIT_REFUSED)
        return
    written: list[str] = call(lambda c: c.write_units())
    if as_json:
        print_json({"written": written})
        return
    for path in written:
        out.print(f"wrote {path}", markup=False)
    if not written:
        out.print("nothing to write")


@app.command()
@click.argument("model", cls=Arg, help="Model key.")
@click.argument(
    "config", cls=Arg, required=False, default="", help="Config key (default: the resident one)."
)
@flag(
    "--envelope",
    "envelope",
    "Measure the enforcement envelope instead: takes the backend down, a switch "
    "like unload (shows who stops; needs --yes).",
)
@flag("--yes", "yes", "Consent to taking the backend down (--envelope), as unload.")
@json_flag
def measure(model: str, config: str, envelope: bool, yes: bool, as_json: bool) -> None:
    """Record MODEL's measured footprint from its live engine into the local registry.

    With --envelope: take the backend down and up to time it (stop, memory back, cold
    and warm start, sleep and wake where the config has a pause lever); needs --yes."""
    if envelope:
        _measure_envelope(model, config, yes, as_json)
        return
    result: dict[str, Any] = call(lambda c: c.measure(model, config))
    if as_json:
        print_json(result)
    else:
        print_measurement(result)


def _measure_envelope(model: str, config: str, yes: bool, as_json: bool) -> NoReturn:
    # Its steps are read from the registry files before consent is asked.
    flags = [*(["--yes"] if yes else []), *(["--json"] if as_json else [])]
    run_local([MEASURE_ENVELOPE, model, config, *flags])


# --------------------------------------------------------------------------- validate


@app.command()
@json_flag
def validate(as_json: bool) -> None:
    """Cross-check the registry files and the capacity policy; print provenance.

    Exits 1 when there is any error. Without uapplaced, checks the files directly."""
    report: dict[str, Any] = call_or(lambda c: c.validate(), _local(OFFLINE_VALIDATE, as_json))
    if as_json:
        print_json(report)
    else:
        print_validation(report)
    if not report["ok"]:
        raise SystemExit(EXIT_REFUSED)


# --------------------------------------------------------------------------- auto


def _models(name: str, help: str | None = None) -> Callable[[F], F]:
    """A repeatable ``--name MODEL``."""
    return click.option(name, cls=Opt, multiple=True, metavar="MODEL", help=help)


@app.command()
@flag("--enable", "enable", "Turn auto-placement on.")
@flag("--disable", "disable", "Turn auto-placement off.")
@_models(
    "--allow-displace",
    "MODEL may evict other models unattended to get loaded (the victims "
    "are chosen as in `preview`; held or busy models are never stopped).",
)
@_models("--disallow-displace")
@_models("--allow-unload", "May be unloaded when idle.")
@_models("--disallow-unload")
@click.option(
    "--idle-after",
    cls=Opt,
    type=Integer(0),
    metavar="SECS",
    help="Idle time before unload; 0 turns the idle sweep off (under 60 counts as 60).",
)
@flag("--yes", "yes", "Record the standing consent the flags grant.")
@json_flag
def auto(
    enable: bool,
    disable: bool,
    allow_displace: tuple[str, ...],
    disallow_displace: tuple[str, ...],
    allow_unload: tuple[str, ...],
    disallow_unload: tuple[str, ...],
    idle_after: int | None,
    yes: bool,
    as_json: bool,
) -> None:
    """Show or change the auto policy. Without flags, prints it.

    --allow-displace and --allow-unload record standing consent to stop models
    unattended: they refuse without --yes and print what they would consent to."""
    if enable and disable:
        fail(EXIT_USAGE, "--enable and --disable contradict each other")
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
        *(f"stop other models unattended to load {m}" for m in allow_displace),
        *(f"unload {m} when it has been idle" for m in allow_unload),
    ]
    if granting and not yes:
        for line in granting:
            out.print(f"would consent to: {line}", markup=False)
        fail(EXIT_REFUSED, "standing consent not recorded: re-run with --yes")

    async def work(client: PlacementClient) -> Any:
        if changes:
            return await client.set_auto_policy(changes, yes)
        return await client.get_auto_policy()

    policy = call(work)
    if as_json:
        print_json(policy)
    else:
        out.print(json.dumps(policy, indent=2), markup=False)


# --------------------------------------------------------------------------- holds


@app.command()
@click.argument("model", cls=Arg, help="Model to pin: never a victim while held.")
@click.option("--reason", cls=Opt, required=True, help="Why (shown to the operator).")
@click.option("--app-id", cls=Opt, default="uapplace-cli", help="Who holds it.")
@json_flag
def hold(model: str, reason: str, app_id: str, as_json: bool) -> None:
    """Pin MODEL until Ctrl-C. A hold lives as long as this command's bus connection:
    it stays running, prints the cookie, and the hold ends when it exits."""

    async def work(client: PlacementClient) -> None:
        cookie = await client.hold(model, reason, app_id)
        if as_json:
            sys.stdout.write(json.dumps({"cookie": cookie, "model": model}) + "\n")
        else:
            sys.stdout.write(f"holding {model} (cookie {cookie}); Ctrl-C releases it\n")
        sys.stdout.flush()
        if await until_stopped(client.bus):
            raise Unreachable("lost the bus connection; the hold has ended")
        # Already gone (daemon restarted): nothing left to release.
        with contextlib.suppress(PlacementError):
            await client.release(cookie)

    call(work)


@app.command()
@click.argument("cookie", cls=Arg, type=Integer(1), help="Cookie printed by `hold`.")
def release(cookie: int) -> None:
    """End a hold by its cookie. The holding command does this itself on exit; ending another
    connection's hold needs polkit's yes for org.uap.placement.release-others (exit 4 otherwise)."""
    call(lambda c: c.release(cookie))
    out.print(f"released hold {cookie}")


# --------------------------------------------------------------------------- local


def _forward(name: str) -> None:
    """Register ``name`` as a command that execs the local app's (its help, its exit code).

    ``main`` execs before click parses anything (``--`` survives); this command is what
    ``--help`` lists, and what runs when the app is invoked without ``main``."""

    @click.pass_context
    def forward(ctx: click.Context) -> NoReturn:
        run_local([name, *ctx.args])

    app.command(
        name, help=LOCAL_COMMANDS[name], context_settings=PASS_THROUGH, add_help_option=False
    )(forward)


_forward("logs")


# --------------------------------------------------------------------------- watch


@app.command()
@json_flag
def watch(as_json: bool) -> None:
    """Follow Parked, Resolved, ResidentChanged, EnforcementStep and AlertRaised until Ctrl-C.

    ``--json``: one JSON object per line, the same objects as the data of the shim's
    ``GET /api/placement/events`` (``{id, event, at, data}``; ids count from 1 per watch).
    """

    numbered = EventLog()

    async def work(client: PlacementClient) -> None:
        bus = client.bus

        def on_message(message: Message) -> None:
            if (
                message.message_type is MessageType.SIGNAL
                and message.interface == INTERFACE
                and message.member in WATCHED_SIGNALS
            ):
                if as_json:
                    line = json_line(numbered.publish_signal(message.member, message.body))
                else:
                    line = signal_line(message.member, message.body, as_json)
                sys.stdout.write(line + "\n")
                sys.stdout.flush()

        bus.add_message_handler(on_message)
        await subscribe(
            bus, f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}',interface='{INTERFACE}'"
        )
        # Once this line is out the subscription is in place (scripts may wait for it).
        sys.stderr.write("watching org.uap.Placement1 signals; Ctrl-C stops\n")
        sys.stderr.flush()
        await until_stopped(bus)

    call(work)


# --------------------------------------------------------------------------- top


@app.command()
def top() -> None:
    """A live view: devices with memory bars, residents, targets (in flight, rails),
    pending requests with their options and impact, open alerts, the enforcement run.

    Keys: a apply the selected option (shows the impact, y confirms), d dismiss, h hold or
    release the selected resident (while top runs), k acknowledge the selected alert,
    l the selected model's logs, q quit. Follows uapplaced's signals and reconnects
    when it restarts."""
    # Its own process: Textual takes a second to import, which every other command
    # would pay if this module imported uapplace.cli.top.
    os.execv(sys.executable, [sys.executable, "-m", "uapplace.cli.top"])


for _name in ("install", "uninstall", "demo", "unit"):
    _forward(_name)


def main() -> None:
    """The ``uapplace`` console entry: exec a local command, or run the light app and end
    the process at once (docs/architecture.md, "The command line: light and local")."""
    forward_argv(sys.argv)
    try:
        app()
    except SystemExit as done:
        code = exit_status(done)
        # Past this point nothing is left to lose: each command's bus conversation ended
        # (closed) inside it, and the output is flushed here (a flush that fails, e.g. a
        # closed pipe, propagates and Python's own teardown reports it). Python's teardown
        # of its modules and their objects took 0.1-0.3 s of every `uapplace apply`.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    main()
