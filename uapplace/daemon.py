"""``uapplaced``: the placement daemon on the user bus (``org.uap.Placement1``).

Start-up order matters, because the daemon is the ledger's only writer:

1. read the registry (an invalid repo registry is exit 2, naming file and JSON path);
2. connect to the user bus; if ``org.uap.Placement1`` already has an owner, exit 1
   without touching anything;
3. restore residents, usage and live pending entries from the ledger;
4. export the interface, then ask for the name with ``DO_NOT_QUEUE`` (losing a race
   for it is exit 1, still without a write);
5. only then install the signal handlers and start the ledger writer and the expiry
   tick, and wire the collaborators: authorizer, proxy, notifier, auto policy, unit
   drop-ins and, when a systemd user manager is on the bus, enforcement
   (``wiring.attach_enforcement``), the auto runner and the idle sweep. Without a
   user manager, Apply/Load/Unload/Measure answer ``Failed`` saying so;
6. listen on the Admit-only peer socket ``$XDG_RUNTIME_DIR/uapplace/bus``
   (:mod:`uapplace.peer`, the shim's short way round the bus); if that cannot be
   done safely, a warning, and admits go over the bus only.

SIGTERM/SIGINT: refuse new enforcement, let a running one finish or roll back
(bounded), flush the ledger, release the name, exit 0. SIGHUP re-reads the registry
(a bad file keeps the last good one). Losing the bus connection flushes and exits 1.

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
from typing import Any

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus
from dbus_fast.constants import NameFlag, RequestNameReply

from uapplace import __version__, busio
from uapplace.authz import Authorizer
from uapplace.auto import AutoRunner, PolicyStore, enforcement_envelope_s
from uapplace.client import bus_daemon_message, user_bus_address
from uapplace.controller import Controller, ProxyHolders, UnitDropins
from uapplace.enforce_host import ControllerHost
from uapplace.engines import ProxyClient
from uapplace.errors import Failed
from uapplace.idle import IdleSweep
from uapplace.model import PendingEntry, Plan, Registry
from uapplace.notify import Notifier
from uapplace.paths import BUS_NAME, OBJECT_PATH, Paths
from uapplace.peer import PeerListener, PeerRefused
from uapplace.planner import plan
from uapplace.registry import ConfigFileError
from uapplace.service import PlacementInterface, track_senders
from uapplace.unitsync import LedgerPublication
from uapplace.wiring import EnforcementStack, attach_enforcement

log = logging.getLogger("uapplaced")

EXIT_OK = 0
EXIT_BUS = 1
EXIT_CONFIG = 2
SYSTEMD_NAME = "org.freedesktop.systemd1"
NAME_OWNER_CHANGED_RULE = (
    "type='signal',sender='org.freedesktop.DBus',path='/org/freedesktop/DBus',"
    "interface='org.freedesktop.DBus',member='NameOwnerChanged'"
)


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
            "already owned, or bus lost, 2 invalid configuration. SIGHUP re-reads the registry."
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
        controller = Controller.open(paths)
    except ConfigFileError as err:
        for problem in err.every():
            print(f"uapplaced: invalid configuration: {problem}", file=sys.stderr)
        return EXIT_CONFIG
    address = user_bus_address()
    try:
        return asyncio.run(Daemon(controller, paths, address).run())
    except KeyboardInterrupt:  # a second Ctrl-C during shutdown
        return EXIT_OK


class Daemon:
    def __init__(self, controller: Controller, paths: Paths, address: str) -> None:
        self.controller = controller
        self.paths = paths
        self.address = address
        self.stop = asyncio.Event()
        self.bus: MessageBus | None = None
        self.stack: EnforcementStack | None = None
        self.publication: LedgerPublication | None = None
        """Verifies restored residents over HTTP when no unit sync runs (no user manager)."""
        self.sweep_task: asyncio.Future[None] | None = None
        self.peer_listener: PeerListener | None = None
        self.interface: PlacementInterface | None = None

    async def run(self) -> int:
        try:
            bus = await busio.connect(self.address)
        except Exception as err:
            log.error("cannot connect to the user bus at %s: %s", self.address, err)
            return EXIT_BUS
        self.bus = bus
        if await self._owned(bus, BUS_NAME):
            return self._already_owned(bus)
        await self.controller.restore_from_ledger()
        track_senders(bus)
        self.interface = PlacementInterface(self.controller)
        bus.export(OBJECT_PATH, self.interface)
        await self._watch_peers(bus)
        reply = await bus.request_name(BUS_NAME, NameFlag.DO_NOT_QUEUE)
        if reply is not RequestNameReply.PRIMARY_OWNER:
            return self._already_owned(bus)
        # From here on a SIGTERM flushes the ledger, even one that comes during wiring.
        self._install_signal_handlers()
        self.controller.start_background()
        await self._wire_collaborators(bus)
        await self._listen_on_peer_socket()
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
        await self._shutdown(bus, connected=not lost.done())
        lost.cancel()
        return code

    def _already_owned(self, bus: MessageBus) -> int:
        print(
            f"uapplaced: another uapplaced owns {BUS_NAME} on {self.address}",
            file=sys.stderr,
        )
        bus.disconnect()
        return EXIT_BUS

    async def _shutdown(self, bus: MessageBus, connected: bool) -> None:
        log.info("stopping: no new enforcement; flushing the ledger")
        if self.peer_listener is not None:
            await self.peer_listener.close()
        await self.controller.shutdown()
        if self.sweep_task is not None:
            self.sweep_task.cancel()
        if self.stack is not None:
            try:
                await self.stack.close()
            except Exception as err:
                log.warning("closing the unit manager: %s", err)
        if self.publication is not None:
            await self.publication.close()
        for closer in (self.controller.notifier, self.controller.authorizer):
            stop = getattr(closer, "stop", None) or getattr(closer, "close", None)
            if stop is not None:
                try:
                    await stop()
                except Exception as err:
                    log.warning("closing %s: %s", type(closer).__name__, err)
        if connected:
            try:
                await bus.release_name(BUS_NAME)
            except Exception as err:
                log.warning("releasing %s: %s", BUS_NAME, err)
            bus.disconnect()
        log.info("stopped")

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self.stop.set)
        loop.add_signal_handler(signal.SIGINT, self.stop.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)

    def _reload(self) -> None:
        log.info("SIGHUP: re-reading the registry")
        reload = self.stack.reload() if self.stack is not None else self.controller.reload()
        task = asyncio.ensure_future(reload)
        task.add_done_callback(_log_failure)

    async def _wire_collaborators(self, bus: MessageBus) -> None:
        """Authorizer, proxy, notifier, auto policy, unit drop-ins, and (with a systemd
        user manager on the bus) the enforcer, measurer, unit sync, auto runner and
        idle sweep."""
        controller = self.controller
        controller.authorizer = Authorizer(bus, self.paths.system_bus_address)
        proxy = ProxyClient(self.paths.proxy_url, self.paths.proxy_token())
        controller.proxy = ProxyHolders(proxy, controller.proxy_token_rejected)

        def registry() -> Registry:
            return controller.load.registry

        store = PolicyStore(self.paths.auto_policy, registry)
        controller.auto_policy = store
        controller.unit_writer = UnitDropins(controller, None)
        await self._wire_notifier(controller)

        why_not = await self._no_user_manager(bus)
        if why_not is not None:
            controller.enforcement_unavailable = why_not
            log.warning("Apply/Load/Unload/Measure unavailable: %s", why_not)
            self._publish_restored(controller)
            return
        try:
            stack = await attach_enforcement(controller, self.paths, proxy)
        except Exception as err:
            controller.enforcer = controller.measurer = None
            controller.enforcement_unavailable = f"enforcement could not start: {err}"
            log.error("Apply/Load/Unload/Measure unavailable: %s", err)
            self._publish_restored(controller)
            return
        self.stack = stack
        controller.unit_writer = UnitDropins(controller, stack.units.reload)
        # The registry may have changed while no daemon ran: a stale Conflicts= graph would
        # let systemd stop a model the planner keeps (rewritten only where drop-ins exist).
        await controller.unit_writer.refresh()

        async def replan(entry: PendingEntry) -> Plan:
            inp, _clients = await controller.plan_input()
            return await asyncio.to_thread(plan, inp, entry.requested_model, entry.cells)

        runner = AutoRunner(
            controller,
            stack.enforcer,
            store,
            registry,
            replan,
            envelope_s=enforcement_envelope_s(stack.enforcer.timeouts),
        )
        store.describe_runs = runner.status
        sweep = IdleSweep(controller, stack.enforcer, store, registry)
        controller.auto_runner = runner
        controller.idle_sweep = sweep
        self.sweep_task = asyncio.ensure_future(sweep.run())
        log.info("enforcement, unit sync, auto runner and idle sweep wired")

    def _publish_restored(self, controller: Controller) -> None:
        """No unit sync: restored residents are still verified (over HTTP) before any
        admit is forwarded to them (DESIGN §5a invariant 2)."""
        self.publication = LedgerPublication(ControllerHost(controller))
        self.publication.start()

    async def _listen_on_peer_socket(self) -> None:
        """The Admit-only peer socket (:mod:`uapplace.peer`); the bus works without it."""
        interface = self.interface
        assert interface is not None
        listener = PeerListener(self.paths.peer_socket, interface.admit_answer)
        try:
            await listener.start()
        except (PeerRefused, OSError) as err:
            log.warning("no peer-to-peer Admit socket (the shim uses the bus): %s", err)
            return
        self.peer_listener = listener
        log.info("Admit also answered on %s (peer-to-peer, same uid)", listener.path)

    async def _wire_notifier(self, controller: Controller) -> None:
        async def on_apply(placement_id: str, option: int, signature: tuple[str, ...]) -> None:
            # The signature the bubble showed; a run that did not land is told back to
            # the person who clicked (Notifier answers a PlacementFailure with a bubble).
            result = await controller.apply(
                placement_id, option, list(signature), origin="notification click"
            )
            if result.get("ok") is not True:
                raise Failed(str(result.get("error") or "the enforcement did not complete"))

        async def on_dismiss(placement_id: str) -> None:
            controller.dismiss(placement_id)

        notifier = Notifier(self.address, on_apply, on_dismiss)
        try:
            await notifier.start()
        except Exception as err:
            log.warning("desktop notifications unavailable: %s", err)
        controller.notifier = notifier

    async def _no_user_manager(self, bus: MessageBus) -> str | None:
        """Why enforcement cannot run here (no systemd user manager on this bus), or ``None``."""
        if await self._owned(bus, SYSTEMD_NAME):
            return None
        (activatable,) = await _bus_call(bus, "ListActivatableNames", "", [])
        if SYSTEMD_NAME in activatable:
            return None
        return (
            f"it needs the systemd user manager, and {SYSTEMD_NAME} is not on {self.address} "
            "(run uapplaced under `systemd --user`, e.g. through `uapplace install`)"
        )

    async def _watch_peers(self, bus: MessageBus) -> None:
        """Holds end when their holder's connection does: follow ``NameOwnerChanged``."""

        def on_message(message: Message) -> None:
            if (
                message.message_type is MessageType.SIGNAL
                and message.member == "NameOwnerChanged"
                and message.sender == "org.freedesktop.DBus"
            ):
                name, _old, new = message.body
                if name.startswith(":") and not new:
                    self.controller.drop_holds_of(name)

        bus.add_message_handler(on_message)
        await _bus_call(bus, "AddMatch", "s", [NAME_OWNER_CHANGED_RULE])

        async def peer_alive(name: str) -> bool:
            return await self._owned(bus, name)

        self.controller.peer_alive = peer_alive

    @staticmethod
    async def _owned(bus: MessageBus, name: str) -> bool:
        (owned,) = await _bus_call(bus, "NameHasOwner", "s", [name])
        return bool(owned)


async def _bus_call(bus: MessageBus, member: str, signature: str, body: list[Any]) -> list[Any]:
    reply = await bus.call(bus_daemon_message(member, signature, body))
    if reply is None or reply.message_type is MessageType.ERROR:
        text = reply.body[0] if reply is not None and reply.body else "no reply"
        raise RuntimeError(f"{member}: {text}")
    return list(reply.body)


def _disconnect_reason(lost: asyncio.Future[Any]) -> str:
    """What ``wait_for_disconnect`` ended with (and the error marked as seen)."""
    if lost.cancelled():
        return "cancelled"
    err = lost.exception()
    return "closed by the other end" if err is None else f"{type(err).__name__}: {err}"


def _log_failure(task: asyncio.Future[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("registry reload failed: %s", task.exception())


if __name__ == "__main__":
    sys.exit(main())
