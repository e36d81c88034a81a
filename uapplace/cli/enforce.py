"""``apply``, ``load``, ``unload`` and ``measure --envelope``: show the impact, get consent,
follow the run live.

The three commands differ only in what they ask first (:func:`apply_impact`,
:func:`load_impact`, :func:`unload_impact`) and which call they send; :func:`enforce`
is the one sequence they share: the impact table, ``--yes`` or a y/N prompt, the
shown signature sent with the call, ``EnforcementStep`` signals printed as they
arrive, and exit 1 unless the run ended ok. Called by :mod:`uapplace.cli.app`.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import click
from dbus_fast import Message, MessageType
from rich.console import Console
from rich.markup import escape

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.cli.render import option_header, show_impact
from uapplace.cli.session import (
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    Unreachable,
    call,
    call_or,
    err,
    fail,
    out,
    print_json,
    subscribe,
)
from uapplace.core.conventions import DEFAULT_CELLS, check_option_index
from uapplace.core.errors import InvalidArgument
from uapplace.core.steps import REVALIDATE, split_last_lines
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH


@dataclass(frozen=True)
class Impact:
    """What one run would do, as shown before consent, and the signature that travels."""

    header: str
    victims: list[dict[str, Any]]
    frees_mib: Any
    question: str
    signature: list[str]
    always_ask: bool = False
    """Apply asks even when it stops nothing: it is the answer to a parked request."""


Prepared = Impact | dict[str, Any]
"""An impact to consent to, or a result already in hand (nothing could be shown)."""


async def apply_impact(client: PlacementClient, placement_id: str, option: int) -> Prepared:
    listed = await client.list_pending()
    entry = next((e for e in listed.get("pending", []) if e["id"] == placement_id), None)
    if entry is None:
        raise PlacementError(
            "org.uap.Placement1.Error.NotFound",
            f"no pending placement {placement_id} (it may have expired or been resolved)",
        )
    options = entry.get("options", [])
    try:
        check_option_index(placement_id, option, len(options))
    except InvalidArgument as bad:
        raise PlacementError(bad.bus_name, str(bad)) from None
    chosen = options[option - 1]
    header = (
        f"Placement {entry['id']} ({entry['requested_model']} for {entry['client']}): "
        f"option {option} = {option_header(chosen)}."
    )
    return Impact(
        header,
        chosen.get("victims", []),
        chosen.get("frees_mib"),
        f"Apply option {option} of {placement_id}?",
        list(chosen.get("signature", [])),
        always_ask=True,
    )


async def load_impact(client: PlacementClient, model: str) -> Prepared:
    """The recommended option (``Preview``'s first); with none, the daemon's own answer."""
    plan: dict[str, Any] = await client.preview(model, DEFAULT_CELLS)
    options = plan.get("options", [])
    if not options:
        # Nothing can stop: let the daemon say why in its own words (UnknownModel, …).
        result: dict[str, Any] = await client.load(model, [])
        return result
    chosen = options[0]
    return Impact(
        f"Load {model}: {option_header(chosen)}.",
        chosen.get("victims", []),
        chosen.get("frees_mib"),
        f"Stop the models above to load {model}?",
        list(chosen.get("signature", [])),
    )


async def unload_impact(client: PlacementClient, model: str) -> Prepared:
    preview_json: dict[str, Any] = await client.preview_unload(model)
    return Impact(
        f"Unload {model}:",
        preview_json.get("victims", []),
        preview_json.get("frees_mib"),
        f"Stop {model}?",
        list(preview_json.get("signature", [])),
    )


def enforce(
    what: str,
    refused: str,
    yes: bool,
    as_json: bool,
    prepare: Callable[[PlacementClient], Awaitable[Prepared]],
    send: Callable[[PlacementClient, list[str]], Awaitable[Any]],
) -> None:
    """Show ``prepare``'s impact; with consent, ``send`` its signature and follow the run.

    ``refused`` starts the line printed (exit 1) when consent is missing.
    """
    console = err if as_json else out

    async def work(client: PlacementClient) -> dict[str, Any] | None:
        prepared = await prepare(client)
        if not isinstance(prepared, Impact):
            return prepared
        show_impact(console, prepared.header, prepared.victims, prepared.frees_mib)
        stops = prepared.always_ask or bool(prepared.victims)
        if not _consented(stops, yes, as_json, prepared.question):
            return None
        result: dict[str, Any] = await _follow(
            client, console, what, lambda: send(client, prepared.signature)
        )
        return result

    result = call(work)
    if result is None:
        _not_consented(f"{refused} ({what})")
    _finish_result(result, as_json, what)


def _consented(stops: bool, yes: bool, as_json: bool, question: str) -> bool:
    """``--yes``, or a y/N answer on a terminal; nothing to stop needs neither."""
    if not stops or yes:
        return True
    if as_json or not (sys.stdin.isatty() and sys.stdout.isatty()):
        return False
    try:
        return bool(click.confirm(question, default=False))
    except click.Abort:
        # Ctrl-C or end of input at the prompt. Ended here, as click's main would: the
        # local app (``measure --envelope``) is typer, whose main does not know click's Abort.
        click.echo("Aborted!", err=True)
        raise SystemExit(EXIT_REFUSED) from None


def _not_consented(what: str) -> NoReturn:
    fail(EXIT_REFUSED, f"{what}: nothing stopped; re-run with --yes to do exactly this")


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
            if step != REVALIDATE:
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
    client: PlacementClient, console: Console, what: str, request: Callable[[], Awaitable[Any]]
) -> Any:
    """Subscribe to ``EnforcementStep`` first, then make the call, with no call deadline:
    a drain may take as long as the requests in flight take. Returns its result."""
    progress = _Progress(console)
    client.bus.add_message_handler(progress.on_message)
    await subscribe(
        client.bus,
        f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}',interface='{INTERFACE}',"
        "member='EnforcementStep'",
    )
    client.call_timeout = None
    console.print(f"{what}: running (steps appear as uapplaced reports them)", markup=False)
    status = console.status(f"{what}…") if console.is_terminal else contextlib.nullcontext()
    try:
        with status:
            result = await request()
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
        print_json(result)
    else:
        if result.get("ok"):
            out.print(f"{what}: done", markup=False)
        else:
            out.print(f"[bold red]{escape(what)}: failed[/]")
        if result.get("rolledBack"):
            out.print("  rolled back to the previous residents")
        if result.get("error"):
            # A failed unit's last lines were printed under its step (docs/placement-rules.md
            # §4.6, "Failed start"): the error's first line says the rest.
            error, _last_lines = split_last_lines(str(result["error"]))
            out.print(f"  error: {error}", markup=False)
    if not result.get("ok"):
        raise SystemExit(EXIT_REFUSED)


# --------------------------------------------------------------------------- measure --envelope


def measure_envelope(
    model: str, config: str, steps: list[str], yes: bool, as_json: bool
) -> dict[str, Any]:
    """``measure --envelope``: a switch like ``unload`` (issue 21, item 1).

    Shows who stops (``PreviewUnload``: the model's residents, their clients and
    in-flight work) and what the measurement does (``steps``, from the registry files),
    takes ``--yes`` or a y/N answer, then sends ``PreviewUnload``'s signature with the
    call; the daemon refuses any other set (``Drifted``), a held model (``Busy``) and
    drains first. With no daemon to ask, the steps alone are shown and nothing is sent.
    Returns the result; exits 1 without consent."""
    console = err if as_json else out

    async def work(client: PlacementClient) -> dict[str, Any] | None:
        signature: list[str] = []
        try:
            impact = await unload_impact(client, model)
        except PlacementError as error:
            # Not resident (or no daemon part to ask): the daemon's own call says why.
            console.print(f"Who stops: unknown ({error.short}: {error.message})", markup=False)
        else:
            assert isinstance(impact, Impact)
            show_impact(console, f"measure --envelope {model} stops:", impact.victims, None)
            signature = impact.signature
        err.print(_envelope_plan(steps), markup=False)
        if not _consented(True, yes, as_json, f"Take {model} down and up to time it?"):
            return None
        client.call_timeout = None  # a drain may take as long as the work in flight
        result: dict[str, Any] = await client.measure_envelope(model, config, signature)
        return result

    def offline(error: Unreachable) -> dict[str, Any] | None:
        err.print(_envelope_plan(steps), markup=False)
        if not yes:
            return None
        fail(EXIT_UNREACHABLE, str(error))

    result = call_or(work, offline)
    if result is None:
        err.print("Run again with --yes to do it.", markup=False)
        raise SystemExit(EXIT_REFUSED)
    if not as_json:
        _steps(result, out)
    return result


def _envelope_plan(steps: list[str]) -> str:
    return "measure --envelope takes the backend down. It will:\n" + "\n".join(
        f"  {n}. {step}" for n, step in enumerate(steps, 1)
    )
