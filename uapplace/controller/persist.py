"""The controller's write-behind of ``placement.json``.

Changes mark the writer dirty; one task coalesces bursts (``debounce_s``, or
``usage_flush_s`` when only usage clocks moved) and writes in a thread
(``Ledger.update``). Shutdown flushes synchronously. While the daemon runs it is the
ledger's only writer. Owned by :class:`uapplace.controller.controller.Controller`, which hands it
a snapshot function (the document, captured on the loop) and the device probe.

A write the ledger refuses because the file would outgrow the cap it is read back with
(:class:`~uapplace.files.ledger.LedgerTooLarge`) is not retried in a loop: the file on
disk stays the last one that fit, one critical ``config_error`` alert says so (raised once
per run of refusals, since the alert itself changes the document), and the next change
tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.files.ledger import Ledger, LedgerDoc, LedgerTooLarge
from uapplace.io.devices import Probe

log = logging.getLogger(__name__)

DEFAULT_DEBOUNCE_S = 0.075
DEFAULT_USAGE_FLUSH_S = 5.0
WRITE_RETRY_S = 2.0


class LedgerWriter:
    def __init__(
        self,
        ledger: Ledger,
        snapshot: Callable[[], LedgerDoc],
        probe: Callable[[], Probe],
        *,
        debounce_s: float = DEFAULT_DEBOUNCE_S,
        usage_flush_s: float = DEFAULT_USAGE_FLUSH_S,
        alerts: AlertBoard | None = None,
    ) -> None:
        self.ledger = ledger
        self._alerts = alerts
        self._refusing: str | None = None
        self._snapshot = snapshot
        self._probe = probe
        self._debounce_s = debounce_s
        self._usage_flush_s = usage_flush_s
        self._wake = asyncio.Event()
        self._urgent = asyncio.Event()

    @property
    def refusing(self) -> str | None:
        """Why the last write was refused for size (``None``: the last write landed)."""
        return self._refusing

    def mark_dirty(self, urgent: bool = True) -> None:
        """Schedule a write: soon when ``urgent``, within ``usage_flush_s`` otherwise."""
        self._wake.set()
        if urgent:
            self._urgent.set()

    async def flush(self) -> None:
        """Write the ledger now (in a thread); a write refused for size raises the alert."""
        try:
            await asyncio.to_thread(self.write, self._snapshot())
        except LedgerTooLarge as err:
            self._refused(err)
        else:
            self._refusing = None

    def flush_blocking(self) -> None:
        """Shutdown: write now, on the caller's thread."""
        try:
            self.write(self._snapshot())
        except LedgerTooLarge as err:
            log.error("ledger not written at shutdown: %s", err)

    def _refused(self, err: LedgerTooLarge) -> None:
        if self._refusing is not None:
            return
        self._refusing = str(err)
        log.error("%s", err)
        if self._alerts is not None:
            self._alerts.raise_alert(
                AlertKind.CONFIG_ERROR,
                Severity.CRITICAL,
                str(err.path),
                f"{err}; changes since are kept in memory only until the state shrinks "
                "(release holds, dismiss pending entries)",
                {"size": err.size},
            )

    async def run(self) -> None:
        """The write-behind loop (a task of the controller's)."""
        while True:
            await self._wake.wait()
            if not self._urgent.is_set():
                with contextlib.suppress(TimeoutError):  # not wait_for: cpython gh-86296
                    async with asyncio.timeout(self._usage_flush_s):
                        await self._urgent.wait()
            await asyncio.sleep(self._debounce_s)
            self._wake.clear()
            self._urgent.clear()
            try:
                await self.flush()
            except Exception as err:  # the file may be locked or the disk full: retry later
                log.warning("ledger write failed (%s); retrying in %gs", err, WRITE_RETRY_S)
                await asyncio.sleep(WRITE_RETRY_S)
                self.mark_dirty()

    def write(self, snapshot: LedgerDoc) -> None:
        """Blocking: probe the devices and replace the ledger's content with ``snapshot``."""
        readings = self._probe().read()

        def commit(doc: LedgerDoc) -> None:
            doc.devices = dict(readings)
            doc.residents = snapshot.residents
            doc.pending = snapshot.pending
            doc.usage = snapshot.usage
            doc.cooldowns = snapshot.cooldowns
            doc.alerts = snapshot.alerts

        self.ledger.update(commit)
        self.take_error()

    def take_error(self) -> str | None:
        """The ledger's last repair message (logged), cleared; ``None`` when there was none."""
        message = self.ledger.last_error
        if message:
            log.warning("%s", message)
            self.ledger.last_error = None
        return message


def repair_report(moved: str | None, dropped: Sequence[str]) -> tuple[str, dict[str, Any]] | None:
    """The alert message and detail for a ledger repaired at start (a file moved aside,
    items dropped alone), or ``None`` when it read clean."""
    problems = ([moved] if moved else []) + list(dropped)
    if not problems:
        return None
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    shown = "; ".join(problems[:3]) + more
    return f"the ledger was repaired at start: {shown}", {"problems": problems[:20]}
