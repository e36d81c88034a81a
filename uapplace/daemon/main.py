"""``uapplaced``: the placement daemon on the user bus (``org.uap.Placement1``).

Start-up order matters, because the daemon is the ledger's only writer:

1. read the registry (an invalid repo registry is exit 2, naming file and JSON path);
2. connect to the user bus; if ``org.uap.Placement1`` already has an owner, exit 1
   without touching anything;
3. restore residents, usage and live pending entries from the ledger;
4. export the interface, then ask for the name with ``DO_NOT_QUEUE`` (losing a race
   for it is exit 1, still without a write);
5. only then install the signal handlers and start the rest (``Assembly.start``):
   the ledger writer and the expiry tick, the notifier and, when a systemd user
   manager is on the bus, enforcement, the auto runner and the idle sweep. Without a
   user manager, Apply/Load/Unload/Measure answer ``Unavailable`` saying so;
6. listen on the Admit-only peer socket ``$XDG_RUNTIME_DIR/uapplace/bus``
   (:mod:`uapplace.bus.peer`, the shim's short way round the bus); if that cannot be
   done safely, a warning, and admits go over the bus only.

Every collaborator is created and closed in :mod:`uapplace.daemon.wiring` (steps 3–6);
this module owns the arguments, the bus connection and name, the signals and the
exit codes.

SIGTERM/SIGINT: refuse new enforcement, let a running one finish or roll back
(bounded), flush the ledger, release the name, exit 0. SIGHUP re-reads the registry,
the capacity policy and ``enforcement-timeouts.json`` (a bad or untrusted file keeps
the last good one, with an error line and a ``config_error`` alert naming the file;
the next enforcement run waits by the new timeouts). Losing the bus connection flushes
and exits 1.

Exit codes: 0 clean stop, 1 bus unreachable / name owned / bus lost, 2 invalid
configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dbus_fast.aio import MessageBus
from dbus_fast.constants import NameFlag, RequestNameReply

from uapplace import __version__
from uapplace.bus import connection as busio
from uapplace.bus.util import user_bus_address
from uapplace.controller.alertdesk import file_not_taken, files_not_taken
from uapplace.controller.configstate import ConfigState
from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.daemon.wiring import Assembly, build, name_has_owner
from uapplace.enforce.enforcer import Enforcer
from uapplace.files.jsonfile import ConfigFileError, check_trusted
from uapplace.files.paths import BUS_NAME, Paths
from uapplace.files.timeouts import Timeouts

log = logging.getLogger("uapplaced")

EXIT_OK = 0
EXIT_BUS = 1
EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="uapplaced",
        description=(
            "The uapplace placement daemon: owns org.uap.Placement1 on the user bus "
            "(DBUS_SESSION_BUS_ADDRESS, else $XDG_RUNTIME_DIR/bus). Usually started by "
            "systemd (uapplaced.service) through D-Bus activation."
        ),
        epilog=(
            "Exit codes: 0 stopped cleanly (SIGTERM/SIGINT), 1 bus unreachable, name "
            "already owned, or bus lost, 2 invalid configuration. SIGHUP re-reads the registry, "
            "the capacity policy and the enforcement timeouts."
        ),
    )
    parser.add_argument("--version", action="version", version=f"uapplaced {__version__}")
    parser.add_argument(
        "--log-level",
        default=os.environ.get("UAPPLACED_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="log level on stderr (default INFO, or $UAPPLACED_LOG_LEVEL)",
    )
    return parser


def configure_logging(level: str) -> None:
    """stderr; no timestamps under systemd (the journal adds its own)."""
    if os.environ.get("JOURNAL_STREAM"):
        fmt = "%(levelname)s %(name)s: %(message)s"
    else:
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, stream=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    paths = Paths.from_env()
    try:
        config = ConfigState.read(paths)
    except ConfigFileError as err:
        for problem in err.every():
            print(f"uapplaced: invalid configuration: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    address = user_bus_address()
    try:
        return asyncio.run(Daemon(config, paths, address).run())
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return EXIT_OK


class Daemon:
    def __init__(self, config: ConfigState, paths: Paths, address: str) -> None:
        self.config = config
        self.paths = paths
        self.address = address
        self.stop = asyncio.Event()
        self.assembly: Assembly | None = None

    async def run(self) -> int:
        try:
            bus = await busio.connect(self.address)
        except Exception as err:
            log.error("cannot connect to the user bus at %s: %s", self.address, err)
            return EXIT_BUS
        if await name_has_owner(bus, BUS_NAME):
            return self._already_owned(bus)
        assembly = await build(self.paths, self.config, bus, self.address)
        reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply is not RequestNameReply.PRIMARY_OWNER:
            return self._already_owned(bus)
        self.assembly = assembly
        # From here on a SIGTERM flushes the ledger, even one that comes during wiring.
        self._install_signal_handlers()
        await assembly.start()
        board = assembly.controller.alert_board
        await report_config_problems(assembly.controller.config.state, self.paths, board)
        log.info("uapplaced %s owns %s on %s", __version__, BUS_NAME, self.address)
        lost = asyncio.ensure_future(bus.wait_for_disconnect())  # type: ignore[no-untyped-call]
        stopped = asyncio.ensure_future(self.stop.wait())
        await asyncio.wait({lost, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        # A lost bus is exit 1 even when systemd's SIGTERM (it stops a Type=dbus unit
        # whose name vanished) lands first: only a failure makes Restart=on-failure fire.
        code = EXIT_BUS if lost.done() else EXIT_OK
        if code != EXIT_OK:
            log.error(
                "lost the bus connection to %s (%s); flushing and exiting %d",
                self.address,
                _disconnect_reason(lost),
                code,
            )
        log.info("stopping: no new enforcement; flushing the ledger")
        await assembly.close()
        if not lost.done():
            try:
                await bus.release_name(BUS_NAME)
            except Exception as err:
                log.warning("releasing %s: %s", BUS_NAME, err)
            bus.disconnect()
        log.info("stopped")
        lost.cancel()
        return code

    def _already_owned(self, bus: MessageBus) -> int:
        print(
            f"uapplaced: another uapplaced owns {BUS_NAME} on {self.address}",
            file=sys.stderr,
        )
        bus.disconnect()
        return EXIT_BUS

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, self.stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)

    def _reload(self) -> None:
        log.info("SIGHUP: re-reading the registry, the capacity policy and the timeouts")
        assert self.assembly is not None
        task = asyncio.ensure_future(self._reread(self.assembly))
        task.add_done_callback(_log_failure)

    async def _reread(self, assembly: Assembly) -> None:
        await assembly.reload()
        enforcer = assembly.stack.enforcer if assembly.stack is not None else None
        board = assembly.controller.alert_board
        timeouts = await reload_timeouts(self.paths.enforcement_timeouts, enforcer, board)
        if timeouts is not None and assembly.stack is not None:
            assembly.stack.sync.sleep_watch.use_period(timeouts.serving_check_s)
        await report_config_problems(assembly.controller.config.state, self.paths, board)


async def report_config_problems(state: ConfigState, paths: Paths, alerts: AlertBoard) -> int:
    """A ``config_error`` alert per file uapplaced could not take (at start and after each
    SIGHUP): the machine-local registry (its last good version, or the repo figures, in
    force), the capacity policy (the last good one, or none: verify-up refuses) and an
    untrusted auto policy (auto off).
    A broken repo registry and ledger raise their own. Returns how many it raised."""
    taken = files_not_taken(state)
    try:
        await asyncio.to_thread(check_trusted, paths.auto_policy)
    except ConfigFileError as untrusted:
        taken.append((untrusted, "auto is off: it is never honoured as standing consent"))
    for problem, kept in taken:
        file_not_taken(alerts, problem, kept)  # once: a reload may have raised it already
    return len(taken)


async def reload_timeouts(
    path: Path, enforcer: Enforcer | None, alerts: AlertBoard
) -> Timeouts | None:
    """SIGHUP: ``path`` re-read (in a thread) and handed to ``enforcer`` (``None``: nothing
    enforces here); a bad or untrusted file keeps the timeouts in force, with an error
    line and a ``config_error`` alert naming it. Returns the timeouts read, or ``None``."""
    try:
        timeouts = await asyncio.to_thread(Timeouts.load, path)
    except ConfigFileError as err:
        log.error("enforcement timeouts reload failed, keeping the ones in force: %s", err)
        alerts.raise_alert(
            AlertKind.CONFIG_ERROR,
            Severity.WARNING,
            str(err.file),
            f"the enforcement timeouts do not load ({err}); uapplaced keeps the timeouts it "
            "had until the file is fixed",
        )
        return None
    if enforcer is not None:
        enforcer.use_timeouts(timeouts)
        log.info("enforcement timeouts re-read from %s (defaults where it is silent)", path)
    return timeouts


def _disconnect_reason(lost: asyncio.Future[Any]) -> str:
    """What ``wait_for_disconnect`` ended with (and the error marked as seen)."""
    if lost.cancelled():
        return "cancelled"
    err = lost.exception()
    return "closed by the other end" if err is None else f"{type(err).__name__}: {err}"


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("SIGHUP reload failed: %s", task.exception())


if __name__ == "__main__":
    sys.exit(main())
