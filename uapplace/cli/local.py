"""``python -m uapplace.cli.local``: the commands that work on this machine's files and units.

docs/architecture.md ("The command line: light and local"). ``install``, ``uninstall``,
``demo``, ``logs`` and ``unit`` import aiohttp, pystemd, pydantic schemas and the demo's
sandbox; ``status``, ``pending`` and ``validate`` need the ledger and registry schemas
only when uapplaced is not there; ``measure --envelope`` reads the registry before it
asks for consent. The light app (:mod:`uapplace.cli.app`) execs this module for those
(:func:`uapplace.cli.forward.run_local`), so the commands around a switch never import
them. Run with ``prog_name="uapplace"``: usage lines and errors read as the user typed.
The ``offline-*`` and ``measure-envelope`` commands are hidden: the light app's entries.
"""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer

from uapplace.cli import install as installer
from uapplace.cli import logs as unit_logs
from uapplace.cli import unit as unit_cli
from uapplace.cli.enforce import measure_envelope
from uapplace.cli.files import envelope_steps, offline_pending, offline_state, validate_offline
from uapplace.cli.forward import (
    DEMO_HELP,
    INSTALL_HELP,
    LOGS_HELP,
    MEASURE_ENVELOPE,
    OFFLINE_PENDING,
    OFFLINE_STATUS,
    OFFLINE_VALIDATE,
    UNINSTALL_HELP,
)
from uapplace.cli.render import (
    print_envelope,
    print_pending,
    print_status,
    print_validation,
)
from uapplace.cli.session import EXIT_REFUSED, fail, out, print_json
from uapplace.cli.typer_app import JsonFlag, placement_app
from uapplace.demo import real_engine, walkthrough
from uapplace.files.paths import Paths
from uapplace.io.unitlogs import MAX_LINES

app = placement_app()

app.add_typer(unit_cli.app, name="unit")


# --------------------------------------------------------------------------- without uapplaced


@app.command(OFFLINE_STATUS, hidden=True)
def offline_status_command(as_json: JsonFlag = False) -> None:
    """``status`` from the ledger file (the light app found no uapplaced)."""
    state = offline_state(as_json)
    if as_json:
        print_json(state)
        return
    print_status(state)


@app.command(OFFLINE_PENDING, hidden=True)
def offline_pending_command(as_json: JsonFlag = False) -> None:
    """``pending`` from the ledger file (the light app found no uapplaced)."""
    listed = offline_pending(as_json)
    if as_json:
        print_json(listed)
        return
    print_pending(listed.get("pending", []))


@app.command(OFFLINE_VALIDATE, hidden=True)
def offline_validate_command(as_json: JsonFlag = False) -> None:
    """``validate`` from the files (the light app found no uapplaced)."""
    report = validate_offline(as_json)
    if as_json:
        print_json(report)
    else:
        print_validation(report)
    if not report["ok"]:
        raise typer.Exit(EXIT_REFUSED)


@app.command(MEASURE_ENVELOPE, hidden=True)
def measure_envelope_command(
    model: Annotated[str, typer.Argument(help="Model key.")],
    config: Annotated[str, typer.Argument(help="Config key (default: the resident one).")] = "",
    yes: Annotated[bool, typer.Option("--yes", help="Consent to taking the backend down.")] = False,
    as_json: JsonFlag = False,
) -> None:
    """``measure --envelope``: its steps come from the registry files."""
    result = measure_envelope(model, config, envelope_steps(model, config), yes, as_json)
    if as_json:
        print_json(result)
        return
    print_envelope(result)


# --------------------------------------------------------------------------- logs


@app.command(help=LOGS_HELP)
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
    unit_logs.show(model, lines, follow, as_json)


# --------------------------------------------------------------------------- install


def _print_install(report: installer.InstallReport, as_json: bool) -> None:
    """``install``/``uninstall``'s report: each file and what was done to it, then the
    reload (the text lives here, not in :mod:`uapplace.cli.render`, which the light app
    imports and which must not import :mod:`uapplace.cli.install`)."""
    if as_json:
        print_json(report.to_json())
    else:
        changes = [*report.files, *report.dirs]
        if report.manifest is not None:
            changes.append(report.manifest)
        for change in changes:
            detail = f" ({change.detail})" if change.detail else ""
            out.print(f"{change.action}: {change.path}{detail}", markup=False)
        out.print(report.reload_message, markup=False)
        if report.shim_unit:
            out.print(report.shim_unit, markup=False)
    if not report.ok:
        raise typer.Exit(EXIT_REFUSED)


@app.command(help=INSTALL_HELP)
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
    shim = None
    if with_shim or enable_shim or shim_port is not None:
        shim = installer.ShimInstall(enable=enable_shim, port=shim_port)
    try:
        report = asyncio.run(installer.install(Paths.from_env(), force, shim))
    except installer.InstallError as error:
        fail(EXIT_REFUSED, str(error))
    _print_install(report, as_json)


@app.command(help=UNINSTALL_HELP)
def uninstall(as_json: JsonFlag = False) -> None:
    try:
        report = asyncio.run(installer.uninstall(Paths.from_env()))
    except installer.InstallError as error:
        fail(EXIT_REFUSED, str(error))
    _print_install(report, as_json)


# --------------------------------------------------------------------------- demo


@app.command(help=DEMO_HELP)
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
    app(prog_name="uapplace")


if __name__ == "__main__":
    main()
