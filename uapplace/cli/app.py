"""``uapplace``: the operator's command line. Every command is one or two bus calls.

When ``uapplaced`` is not reachable, ``status`` and ``pending`` read the ledger
file directly (and say so), ``validate`` checks the files itself, and every
write refuses with exit code 3 rather than race a live writer.

This module holds the Typer app: each command's arguments, help and output mode.
The plumbing (consoles, exit codes, the bus conversation) is in
:mod:`uapplace.cli.session`, the text rendering in :mod:`uapplace.cli.render`,
``apply``/``load``/``unload`` in :mod:`uapplace.cli.enforce`, and the fallbacks that
read the files in :mod:`uapplace.cli.files`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from typing import TYPE_CHECKING, Annotated, Any

import typer
from dbus_fast import Message, MessageType

from uapplace import __version__
from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.events import EventLog, json_line
from uapplace.cli import install as installer
from uapplace.cli import logs as unit_logs
from uapplace.cli.enforce import apply_impact, enforce, load_impact, unload_impact
from uapplace.cli.files import (
    envelope_steps,
    pending_or_ledger,
    state_or_ledger,
    validation_report,
)
from uapplace.cli.render import (
    WATCHED_SIGNALS,
    print_envelope,
    print_install,
    print_measurement,
    print_pending,
    print_preview,
    print_status,
    print_validation,
    signal_line,
)
from uapplace.cli.session import (
    EXIT_CODES_HELP,
    EXIT_REFUSED,
    EXIT_USAGE,
    Unreachable,
    call,
    err,
    fail,
    out,
    print_json,
    subscribe,
    until_stopped,
)
from uapplace.core.model import DEFAULT_CELLS
from uapplace.demo import real_engine, walkthrough
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH, Paths
from uapplace.io.unitlogs import MAX_LINES

if TYPE_CHECKING:
    from uapplace.cli.install import InstallReport

# The ledger, registry and install modules build pydantic schemas at import
# (~0.3 s); the commands that need them import them, so `status` stays quick.

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

JsonFlag = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


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
        fail(EXIT_USAGE, "alert ids are only taken with --ack (uapplace status --ack ID...)")
    if ack:
        _acknowledge(list(alert_ids or []), as_json)
        return
    state = state_or_ledger(as_json)
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
def pending(as_json: JsonFlag = False) -> None:
    """Parked requests with their ranked options."""
    listed = pending_or_ledger(as_json)
    if as_json:
        print_json(listed)
        return
    print_pending(listed.get("pending", []))


@app.command()
def preview(
    model: Annotated[str, typer.Argument(help="Model key, config key or advertised id.")],
    cells: Annotated[
        int, typer.Option("--cells", min=1, help="Context the request needs (cells).")
    ] = DEFAULT_CELLS,
    as_json: JsonFlag = False,
) -> None:
    """What placing MODEL would take: options, victims, why others are infeasible."""
    plan: dict[str, Any] = call(lambda c: c.preview(model, cells))
    if as_json:
        print_json(plan)
        return
    print_preview(plan)


# --------------------------------------------------------------------------- apply

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
    enforce(
        f"apply {placement_id} option {option}",
        "not applied",
        yes,
        as_json,
        lambda client: apply_impact(client, placement_id, option),
        lambda client, signature: client.apply(placement_id, option, signature),
    )


@app.command()
def dismiss(
    placement_id: Annotated[str, typer.Argument(metavar="ID", help="Placement id (plc-xxxxxx).")],
    as_json: JsonFlag = False,
) -> None:
    """Refuse a parked request; its client gets a clean fallback."""
    dismissed = call(lambda c: c.dismiss(placement_id))
    if as_json:
        print_json({"dismissed": dismissed, "placement_id": placement_id})
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
    enforce(
        f"load {model}",
        "not loaded",
        yes,
        as_json,
        lambda client: load_impact(client, model),
        lambda client, signature: client.load(model, signature),
    )


@app.command()
def unload(
    model: Annotated[str, typer.Argument(help="Resident model to stop.")],
    yes: YesFlag = False,
    as_json: JsonFlag = False,
) -> None:
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
        stale: list[str] = call(lambda c: c.check_units())
        if as_json:
            print_json({"stale": stale})
        else:
            for path in stale:
                out.print(f"stale {path}", markup=False)
            if not stale:
                out.print("the Conflicts= drop-ins match the registry")
        if stale:
            raise typer.Exit(EXIT_REFUSED)
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
    result: dict[str, Any] = call(lambda c: c.measure(model, config))
    if as_json:
        print_json(result)
    else:
        print_measurement(result)


def _measure_envelope(model: str, config: str, yes: bool, as_json: bool) -> None:
    if not yes:
        err.print(
            "measure --envelope takes the backend down. It will:\n"
            + "\n".join(f"  {n}. {step}" for n, step in enumerate(envelope_steps(model, config), 1))
            + "\nRun again with --yes to do it.",
            markup=False,
        )
        raise typer.Exit(EXIT_REFUSED)
    result: dict[str, Any] = call(lambda c: c.measure_envelope(model, config))
    if as_json:
        print_json(result)
        return
    print_envelope(result)


# --------------------------------------------------------------------------- validate


@app.command()
def validate(as_json: JsonFlag = False) -> None:
    """Cross-check the registry files and the capacity policy; print provenance.

    Exits 1 when there is any error. Without uapplaced, checks the files directly."""
    report = validation_report(as_json)
    if as_json:
        print_json(report)
    else:
        print_validation(report)
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
        *(f"stop other models unattended to load {m}" for m in allow_displace or []),
        *(f"unload {m} when it has been idle" for m in allow_unload or []),
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
        if await until_stopped(client.bus):
            raise Unreachable("lost the bus connection; the hold has ended")
        # Already gone (daemon restarted): nothing left to release.
        with contextlib.suppress(PlacementError):
            await client.release(cookie)

    call(work)


@app.command()
def release(
    cookie: Annotated[int, typer.Argument(min=1, help="Cookie printed by `hold`.")],
) -> None:
    """End a hold by its cookie. The holding command does this itself on exit; ending another
    connection's hold needs polkit's yes for org.uap.placement.release-others (exit 4 otherwise)."""
    call(lambda c: c.release(cookie))
    out.print(f"released hold {cookie}")


# --------------------------------------------------------------------------- logs


@app.command()
def logs(
    model: Annotated[str, typer.Argument(help="Model key, config key or advertised id.")],
    lines: Annotated[
        int,
        typer.Option(
            "--lines", "-n", min=1, max=MAX_LINES, help="How many of the last lines to print."
        ),
    ] = unit_logs.DEFAULT_LINES,
    follow: Annotated[
        bool,
        typer.Option("--follow", "-f", help="Then print each new line as it comes, until Ctrl-C."),
    ] = False,
    as_json: JsonFlag = False,
) -> None:
    """The last lines MODEL's unit wrote: its stderr's log file (StandardError=append:|file:),
    else the user journal (its latest run only), else its stdout's file. Exit 7 for an
    unknown model or one without a unit, 1 when it has no log."""
    unit_logs.show(model, lines, follow, as_json)


# --------------------------------------------------------------------------- watch


@app.command()
def watch(as_json: JsonFlag = False) -> None:
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


# --------------------------------------------------------------------------- install


def _print_install(report: InstallReport, as_json: bool) -> None:
    if as_json:
        print_json(report.to_json())
    else:
        print_install(report)
    if not report.ok:
        raise typer.Exit(EXIT_REFUSED)


@app.command()
def install(
    force: Annotated[
        bool, typer.Option("--force", help="Replace files not written by uapplace install.")
    ] = False,
    with_shim: Annotated[
        bool,
        typer.Option(
            "--with-shim",
            help="Also install the uapplace-shim user unit and its dashboard token (0600).",
        ),
    ] = False,
    enable_shim: Annotated[
        bool,
        typer.Option(
            "--enable-shim",
            help="As --with-shim, then enable the shim unit (default.target) and start it now.",
        ),
    ] = False,
    shim_port: Annotated[
        int | None,
        typer.Option(
            "--shim-port", min=1, max=65535, help="The shim unit's port (implies --with-shim)."
        ),
    ] = None,
    as_json: JsonFlag = False,
) -> None:
    """Install the D-Bus activation file and the uapplaced user unit (with --with-shim, the
    shim's unit and token too), then reload. `uapplace uninstall` removes exactly these."""

    shim = None
    if with_shim or enable_shim or shim_port is not None:
        shim = installer.ShimInstall(enable=enable_shim, port=shim_port)
    try:
        report = asyncio.run(installer.install(Paths.from_env(), force, shim))
    except installer.InstallError as error:
        fail(EXIT_REFUSED, str(error))
    _print_install(report, as_json)


@app.command()
def uninstall(as_json: JsonFlag = False) -> None:
    """Stop the shim unit it installed, remove exactly what `uapplace install` wrote
    (its manifest lists it), then reload."""

    try:
        report = asyncio.run(installer.uninstall(Paths.from_env()))
    except installer.InstallError as error:
        fail(EXIT_REFUSED, str(error))
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
    engine: Annotated[
        str,
        typer.Option(
            "--engine",
            metavar="fake|llama.cpp",
            help="fake: simulated GPU, fake engines (quick). llama.cpp: real llama-server "
            "units on the CPU, measured by uapplace (needs `make engine`; one port, so "
            "--single-upstream is implied).",
        ),
    ] = "fake",
) -> None:
    """Run the embedded demo (contained systemd; a simulated GPU and fake engines, or real
    llama-server units on the CPU with --engine llama.cpp)."""
    if engine not in ("fake", "llama.cpp"):
        raise typer.BadParameter(
            f"{engine!r} is not an engine of the demo: fake or llama.cpp", param_hint="--engine"
        )
    if proxy_url is not None and not proxy_url.startswith(("http://", "https://")):
        raise typer.BadParameter(
            f"{proxy_url!r} is not an http:// or https:// URL", param_hint="--proxy-url"
        )
    if proxy_token is not None and proxy_url is None:
        raise typer.BadParameter("needs --proxy-url", param_hint="--proxy-token")
    if engine == "llama.cpp":
        code = real_engine.run(keep, proxy_url=proxy_url, proxy_token=proxy_token)
        raise typer.Exit(int(code))
    code = walkthrough.run(
        keep, single_upstream=single_upstream, proxy_url=proxy_url, proxy_token=proxy_token
    )
    raise typer.Exit(int(code))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
