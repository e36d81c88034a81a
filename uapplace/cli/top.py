"""``uapplace top``: a live terminal view of the placement, on Textual.

Why Textual and not rich's ``Live``: ``top`` takes keys (apply with a confirm dialog,
dismiss, hold/release, acknowledge, logs) and moves a cursor through tables; ``Live``
only redraws a renderable and would need a hand-made keyboard loop and focus handling.
Textual also brings a headless pilot (``App.run_test``) the bus tier drives.

Driven by the bus, not by polling: one connection subscribes to the daemon's signals
(``Parked``, ``Resolved``, ``ResidentChanged``, ``EnforcementStep``, ``AlertRaised``,
``PropertiesChanged``) and to ``NameOwnerChanged`` for ``org.uap.Placement1``; each one
schedules a re-read (``GetState``, ``ListPending``), coalesced. A daemon restart is a
``NameOwnerChanged``: ``top`` re-reads once the new daemon owns the name (its holds ended
with the old daemon, so they are dropped). A lost bus connection is reconnected with
a growing pause. The in-flight count per target is the engine's own
(``requests_processing`` of its ``/metrics``), read on each re-read.

Keys send exactly the CLI's calls: ``a`` shows the impact of the selected option
(:func:`uapplace.cli.enforce.apply_impact`, what ``uapplace apply`` shows) and, on
``y``, sends ``Apply`` with the signature shown; ``d`` dismisses; ``h`` holds the
selected resident on ``top``'s own connection (released with ``h`` again, or when
``top`` exits: a hold lives as long as its connection); ``k`` acknowledges the selected
alert; ``l`` shows the selected model's last log lines (``uapplace logs``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from typing import Any, ClassVar

from dbus_fast import Message, MessageType
from rich.text import Text
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical, VerticalScroll
from textual.coordinate import Coordinate
from textual.screen import ModalScreen
from textual.widgets import DataTable, Footer, Static

from uapplace.bus.client import PlacementClient, PlacementError
from uapplace.bus.util import MatchRefused, add_match, user_bus_address
from uapplace.cli.enforce import Impact, apply_impact
from uapplace.cli.render import WATCHED_SIGNALS
from uapplace.cli.top_view import (
    ALERT_COLUMNS,
    PENDING_COLUMNS,
    RESIDENT_COLUMNS,
    TARGET_COLUMNS,
    OptionRow,
    RunSteps,
    alert_rows,
    devices_text,
    inflight_text,
    option_impact,
    pending_rows,
    resident_rows,
    target_rows,
)
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.io import engines

BAR_WIDTH = 48
REREAD_DELAY_S = 0.05
"""Signals in a burst (a run's steps) are read once: the re-read waits this long."""
CALL_TIMEOUT_S = 10.0
INFLIGHT_TIMEOUT_S = 1.0
RECONNECT_MAX_S = 5.0
LOG_LINES = 40
HOLD_REASON = "held from uapplace top"
HOLD_APP_ID = "uapplace-top"

OUR_SIGNALS = f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}'"
OWNER_CHANGES = (
    "type='signal',sender='org.freedesktop.DBus',interface='org.freedesktop.DBus',"
    f"member='NameOwnerChanged',arg0='{BUS_NAME}'"
)


class ConfirmScreen(ModalScreen[bool]):
    """The impact of one option and a y/N question (the CLI's prompt, as a dialog)."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "No"),
    ]

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(Text(self.text), id="impact")
            yield Static("y: yes, exactly this   n / Esc: no")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)


class LogScreen(ModalScreen[None]):
    """A model's last log lines (``uapplace logs MODEL``); Esc or q closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "close", "Close"),
        Binding("q", "close", "Close"),
    ]

    def __init__(self, title: str, text: str) -> None:
        super().__init__()
        self.title_text = title
        self.text = text

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Static(Text(self.title_text, style="bold"))
            with VerticalScroll():
                yield Static(Text(self.text), id="log-lines")

    def action_close(self) -> None:
        self.dismiss(None)


class TopApp(App[None]):
    """The live view; :attr:`address` is the user bus (``None``: the environment's)."""

    TITLE = "uapplace top"
    CSS = """
    #status { height: auto; background: $boost; }
    #devices { height: auto; padding: 0 1; }
    DataTable { height: auto; max-height: 12; }
    .caption { height: 1; color: $text-muted; padding: 0 1; }
    #run { height: auto; padding: 0 1; }
    #dialog { width: 90%; height: auto; max-height: 90%; border: thick $accent;
              background: $surface; padding: 1 2; }
    ConfirmScreen, LogScreen { align: center middle; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("a", "apply", "Apply option"),
        Binding("d", "dismiss_request", "Dismiss"),
        Binding("h", "hold", "Hold/release"),
        Binding("k", "ack", "Ack alert"),
        Binding("l", "logs", "Logs"),
        Binding("r", "reread", "Re-read"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, address: str | None = None, bar_width: int = BAR_WIDTH) -> None:
        super().__init__()
        self.address = address or user_bus_address()
        self.bar_width = bar_width
        self.client: PlacementClient | None = None
        self.state: dict[str, Any] | None = None
        self.options: dict[str, OptionRow] = {}
        """The pending table's rows by key (:attr:`OptionRow.key`)."""
        self.holds: dict[str, int] = {}
        """Model → cookie of the holds ``top`` itself took (on its connection)."""
        self.run_steps = RunSteps()
        self.rereads = 0
        """Completed re-reads (tests wait on it)."""
        self._reread_task: asyncio.Task[None] | None = None
        self._again = False

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield Static("connecting…", id="status")
        with VerticalScroll():
            yield Static("Devices", classes="caption")
            yield Static("", id="devices")
            yield Static("Residents (h: hold/release, l: logs)", classes="caption")
            yield DataTable(id="residents", cursor_type="row")
            yield Static("Targets", classes="caption")
            yield DataTable(id="targets", cursor_type="row")
            yield Static("Pending requests (a: apply option, d: dismiss)", classes="caption")
            yield DataTable(id="pending", cursor_type="row")
            yield Static("Open alerts (k: acknowledge)", classes="caption")
            yield DataTable(id="alerts", cursor_type="row")
            yield Static("Enforcement", classes="caption")
            yield Static("", id="run")
        yield Footer()

    def on_mount(self) -> None:
        for table_id, columns in (
            ("residents", RESIDENT_COLUMNS),
            ("targets", TARGET_COLUMNS),
            ("pending", PENDING_COLUMNS),
            ("alerts", ALERT_COLUMNS),
        ):
            self.query_one(f"#{table_id}", DataTable).add_columns(*columns)
        self.query_one("#run", Static).update(self.run_steps.text())
        self.run_worker(self._link(), name="bus link", exit_on_error=False)

    def _say(self, text: str, style: str = "") -> None:
        self.query_one("#status", Static).update(Text(text, style=style))

    # ------------------------------------------------------------------ the bus

    async def _link(self) -> None:
        """Connect, subscribe, re-read; after a lost connection, again (module doc)."""
        pause = 0.2
        while True:
            try:
                client = await PlacementClient.connect(self.address, CALL_TIMEOUT_S)
            except Exception as error:  # no bus at all yet: say so and try again
                self._say(f"no user bus at {self.address}: {error}; retrying", "bold red")
                await asyncio.sleep(pause)
                pause = min(pause * 2, RECONNECT_MAX_S)
                continue
            pause = 0.2
            await self._serve(client)
            self.client = None
            self.holds.clear()
            self._say(f"lost the user bus at {self.address}; reconnecting", "bold red")

    async def _serve(self, client: PlacementClient) -> None:
        client.bus.add_message_handler(self._on_bus_message)
        try:
            await add_match(client.bus, OUR_SIGNALS)
            await add_match(client.bus, OWNER_CHANGES)
        except MatchRefused as error:
            self._say(f"cannot follow the daemon's signals: {error}", "bold red")
            client.disconnect()
            return
        self.client = client
        self.reread_soon()
        with contextlib.suppress(Exception):  # ended with an error or not: reconnect either way
            await client.bus.wait_for_disconnect()  # type: ignore[no-untyped-call]

    def _on_bus_message(self, message: Message) -> None:
        if message.message_type is not MessageType.SIGNAL:
            return
        if message.member == "NameOwnerChanged":
            # The daemon went away or a new one took the name: holds died with the old one.
            self.holds.clear()
            self.reread_soon()
            return
        if (
            message.interface == INTERFACE
            and message.member == "EnforcementStep"
            and message.signature == "ssbs"
        ):
            run_id, step, ok, detail = message.body
            now = time.monotonic()
            self.run_steps = self.run_steps.with_step(run_id, step, bool(ok), detail, now)
            self.query_one("#run", Static).update(self.run_steps.text())
        if message.interface == INTERFACE and message.member not in WATCHED_SIGNALS:
            return
        self.reread_soon()

    def reread_soon(self) -> None:
        """Re-read once for a burst of signals; one arriving mid-read asks for another."""
        if self._reread_task is not None and not self._reread_task.done():
            self._again = True
            return
        self._reread_task = asyncio.ensure_future(self._reread_loop())

    async def _reread_loop(self) -> None:
        self._again = True
        while self._again:
            self._again = False
            await asyncio.sleep(REREAD_DELAY_S)
            await self._reread()

    async def _reread(self) -> None:
        client = self.client
        if client is None:
            return
        try:
            state: dict[str, Any] = await client.get_state()
            listed: dict[str, Any] = await client.list_pending()
        except PlacementError as error:
            self.state = None
            self._say(
                f"uapplaced is not answering on {self.address} ({error}); waiting for it",
                "bold red",
            )
            self.rereads += 1
            return
        inflight = await _inflight(state.get("targets") or [])
        self.state = state
        self._show(state, listed.get("pending") or [], inflight)
        self.rereads += 1

    # ------------------------------------------------------------------ drawing

    def _show(
        self, state: dict[str, Any], pending: list[dict[str, Any]], inflight: dict[str, str]
    ) -> None:
        version = state.get("daemon_version", "?")
        alerts = state.get("alerts") or []
        line = f"uapplaced {version} on {self.address}; {len(pending)} pending"
        line += f", {len(alerts)} open alert(s)" if alerts else ""
        self._say(line, "bold red" if alerts else "")
        self.query_one("#devices", Static).update(devices_text(state, self.bar_width))
        residents = state.get("residents") or []
        _fill(self.query_one("#residents", DataTable), resident_rows(residents))
        targets = state.get("targets") or []
        _fill(self.query_one("#targets", DataTable), target_rows(targets, inflight))
        options = pending_rows(pending)
        self.options = {row.key: row for row, _ in options}
        _fill(self.query_one("#pending", DataTable), [(row.key, cells) for row, cells in options])
        _fill(self.query_one("#alerts", DataTable), alert_rows(alerts))

    def _selected(self, table_id: str) -> str | None:
        """The key of the selected row of a table, or ``None`` when it is empty."""
        table = self.query_one(f"#{table_id}", DataTable)
        if table.row_count == 0:
            return None
        row = min(table.cursor_row, table.row_count - 1)
        key: str | None = table.coordinate_to_cell_key(Coordinate(row, 0)).row_key.value
        return key

    def _selected_option(self) -> OptionRow | None:
        key: str | None = self._selected("pending")
        return None if key is None else self.options.get(key)

    def _need_client(self) -> PlacementClient | None:
        if self.client is None:
            self.notify("not connected to uapplaced", severity="error")
        return self.client

    # ------------------------------------------------------------------ keys

    async def action_apply(self) -> None:
        chosen = self._selected_option()
        client = self._need_client()
        if chosen is None or client is None:
            self.notify("no pending option selected", severity="warning")
            return
        if chosen.option == 0:
            self.notify(f"{chosen.placement_id} has no option to apply", severity="warning")
            return
        try:
            prepared = await apply_impact(client, chosen.placement_id, chosen.option)
        except PlacementError as error:
            self.notify(str(error), severity="error")
            return
        if not isinstance(prepared, Impact):
            return
        text = option_impact(prepared.header, prepared.victims, prepared.frees_mib)
        text += f"\n\n{prepared.question}"

        def answered(yes: bool | None) -> None:
            if yes:
                self.run_worker(self._send_apply(client, chosen, prepared.signature))
            else:
                self.notify(f"not applied: {chosen.placement_id} option {chosen.option}")

        self.push_screen(ConfirmScreen(text), answered)

    async def _send_apply(
        self, client: PlacementClient, chosen: OptionRow, signature: list[str]
    ) -> None:
        what = f"apply {chosen.placement_id} option {chosen.option}"
        # No call deadline: a drain takes as long as the requests in flight (cli/enforce.py).
        patient = PlacementClient(client.bus, call_timeout=None)
        self._outcome(f"{what}: running")
        try:
            result: dict[str, Any] = await patient.apply(
                chosen.placement_id, chosen.option, signature
            )
        except PlacementError as error:
            self._outcome(f"{what}: refused: {error}")
            self.notify(str(error), severity="error")
            return
        done = "done" if result.get("ok") else "failed"
        if result.get("rolledBack"):
            done += ", rolled back"
        if result.get("error"):
            done += f": {str(result['error']).splitlines()[0]}"
        self._outcome(f"{what}: {done}")

    def _outcome(self, text: str) -> None:
        self.run_steps = self.run_steps.with_outcome(text)
        self.query_one("#run", Static).update(self.run_steps.text())

    async def action_dismiss_request(self) -> None:
        chosen = self._selected_option()
        client = self._need_client()
        if chosen is None or client is None:
            return
        try:
            await client.dismiss(chosen.placement_id)
        except PlacementError as error:
            self.notify(str(error), severity="error")
            return
        self.notify(f"dismissed {chosen.placement_id}")
        self.reread_soon()

    async def action_hold(self) -> None:
        model: str | None = self._selected("residents")
        client = self._need_client()
        if model is None or client is None:
            self.notify("no resident selected", severity="warning")
            return
        try:
            cookie = self.holds.pop(model, None)
            if cookie is not None:
                await client.release(cookie)
                self.notify(f"released {model} (cookie {cookie})")
            else:
                self.holds[model] = await client.hold(model, HOLD_REASON, HOLD_APP_ID)
                self.notify(f"holding {model} (cookie {self.holds[model]}) while top runs")
        except PlacementError as error:
            self.notify(str(error), severity="error")
        self.reread_soon()

    async def action_ack(self) -> None:
        alert_id: str | None = self._selected("alerts")
        client = self._need_client()
        if alert_id is None or client is None:
            self.notify("no open alert selected", severity="warning")
            return
        try:
            gone = await client.acknowledge_alerts([alert_id])
        except PlacementError as error:
            self.notify(str(error), severity="error")
            return
        self.notify(f"acknowledged {', '.join(gone) or alert_id}")
        self.reread_soon()

    async def action_logs(self) -> None:
        model: str | None = self._selected("residents")
        if self.focused is self.query_one("#pending", DataTable) or model is None:
            chosen = self._selected_option()
            model = chosen.model if chosen is not None else model
        if not model:
            self.notify("select a resident or a pending request", severity="warning")
            return
        self.push_screen(LogScreen(f"uapplace logs {model}", await _log_lines(model, self.address)))

    async def action_reread(self) -> None:
        self.reread_soon()


def _fill(table: DataTable[Any], rows: list[tuple[str, tuple[str, ...]]]) -> None:
    """Replace a table's rows, keeping the cursor on the same row number. Each cell is
    shown as written: a ``str`` cell is read as markup by the table, and names come from
    any ``Admit`` caller (a client named ``[/x]`` would stop the view)."""
    row = table.cursor_row
    table.clear()
    for key, cells in rows:
        table.add_row(*(Text(cell, end="") for cell in cells), key=key)
    if rows:
        table.move_cursor(row=min(max(row, 0), len(rows) - 1))


async def _inflight(targets: list[dict[str, Any]]) -> dict[str, str]:
    """Each target's in-flight count from its engine's ``/metrics`` (``?``: no answer)."""

    async def one(endpoint: str) -> str:
        try:
            return inflight_text(await engines.metrics(endpoint, timeout_s=INFLIGHT_TIMEOUT_S))
        except engines.EngineError:
            return "?"

    probed = [t for t in targets if t.get("endpoint")]
    counts = await asyncio.gather(*(one(str(t["endpoint"])) for t in probed))
    return {str(t.get("target_id", "")): count for t, count in zip(probed, counts, strict=True)}


async def _log_lines(model: str, address: str) -> str:
    """``uapplace logs MODEL -n 40`` as run from a shell, its output as text; on ``top``'s
    bus, so it asks the same daemon (which names the registry files it reads)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uapplace.cli",
        "logs",
        model,
        "--lines",
        str(LOG_LINES),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "DBUS_SESSION_BUS_ADDRESS": address},
    )
    output, _ = await process.communicate()
    text = output.decode(errors="replace")
    return text or f"(uapplace logs {model} printed nothing; exit {process.returncode})"


def run(address: str | None = None) -> None:
    """``uapplace top``: run the view until ``q``."""
    TopApp(address).run()


if __name__ == "__main__":
    run()
