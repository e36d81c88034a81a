"""Assembling ``uapplaced``: every collaborator created in one place, in order, and
closed in reverse. ``daemon.py`` only parses arguments, owns the bus name, the signals
and the exit codes; it calls :func:`build`, :meth:`Assembly.start` and
:meth:`Assembly.close`.

Two phases, because the daemon is the ledger's only writer and may write nothing
before the bus name is its own:

1. :func:`build` (nothing written, nothing started): the event relay, the proxy
   client, the notifier (not yet on the bus; the controller reaches it through
   :class:`QuietUntilStarted`), the auto-policy store, the drop-in writer, the
   controller (which restores the ledger), the authorizer, the bus interface
   (exported and attached to the relay) and the ``NameOwnerChanged`` watch that ends
   the holds of a connection that leaves.
2. :meth:`Assembly.start`, once the name is owned: the ledger writer and ticks, the
   notifier, then, with a systemd user manager on the bus, enforcement
   (:func:`attach_enforcement`: unit manager, crash recovery, unit sync, enforcer,
   measurer, auto runner) and the idle sweep; without one, the publication check of
   restored residents and the reason Apply/Load/Unload/Measure answer ``Unavailable``;
   last the Admit-only peer socket.

:meth:`Assembly.close` undoes phase 2 and 1 in reverse: peer socket, idle sweep,
controller (no new runs, a running one ends, ledger flushed), unit sync and unit
manager (or the publication check), notifier, authorizer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from uapplace.bus.connection import Bus
from uapplace.bus.peer import PeerListener, PeerRefused
from uapplace.bus.util import add_match, bus_daemon_message
from uapplace.consent.auto import AutoRunner, enforcement_envelope_s, option_envelope_s
from uapplace.consent.idle import IdleSweep
from uapplace.controller.configstate import ConfigState, LiveConfig
from uapplace.controller.controller import Controller
from uapplace.controller.dropins import UnitDropins
from uapplace.controller.holds import ProxyHolders
from uapplace.controller.ports import (
    Collaborators,
    EnforcementParts,
    EventRelay,
    Notifications,
)
from uapplace.core.alerts import Alert
from uapplace.core.errors import Failed
from uapplace.core.model import PendingEntry, Plan
from uapplace.daemon.authz import Authorizer
from uapplace.daemon.notify import Notifier
from uapplace.daemon.service import PlacementInterface, track_senders
from uapplace.enforce.enforcer import Enforcer
from uapplace.enforce.host import ControllerHost, ControllerRecoveryHost, ProxyRefresher
from uapplace.enforce.measuring import EnvelopeWindow
from uapplace.files.autopolicy import PolicyStore
from uapplace.files.journal import Journal
from uapplace.files.ledger import Ledger
from uapplace.files.paths import OBJECT_PATH, Paths
from uapplace.files.timeouts import Timeouts
from uapplace.io.engines import ProxyClient
from uapplace.io.units import UnitManager
from uapplace.measure.measurer import Measurer
from uapplace.publish.publication import LedgerPublication
from uapplace.publish.unitsync import EnforcementMarks, UnitSync
from uapplace.recovery.recover import recover

log = logging.getLogger(__name__)

SYSTEMD_NAME = "org.freedesktop.systemd1"
NAME_OWNER_CHANGED_RULE = (
    "type='signal',sender='org.freedesktop.DBus',path='/org/freedesktop/DBus',"
    "interface='org.freedesktop.DBus',member='NameOwnerChanged'"
)
AutoFactory = Callable[[Enforcer], AutoRunner]
"""Builds the auto runner once the enforcer exists (it runs the runner's loads)."""


# --------------------------------------------------------------------------- the bus


async def bus_call(bus: MessageBus, member: str, signature: str, body: list[Any]) -> list[Any]:
    """A call to the message bus itself; ``RuntimeError`` with its error text."""
    reply = await bus.call(bus_daemon_message(member, signature, body))
    if reply is None or reply.message_type is MessageType.ERROR:
        text = reply.body[0] if reply is not None and reply.body else "no reply"
        raise RuntimeError(f"{member}: {text}")
    return list(reply.body)


async def name_has_owner(bus: MessageBus, name: str) -> bool:
    (owned,) = await bus_call(bus, "NameHasOwner", "s", [name])
    return bool(owned)


async def why_no_user_manager(bus: MessageBus, address: str) -> str | None:
    """Why enforcement cannot run here (no systemd user manager on this bus), or ``None``."""
    if await name_has_owner(bus, SYSTEMD_NAME):
        return None
    (activatable,) = await bus_call(bus, "ListActivatableNames", "", [])
    if SYSTEMD_NAME in activatable:
        return None
    return (
        f"it needs the systemd user manager, and {SYSTEMD_NAME} is not on {address} "
        "(run uapplaced under `systemd --user`, e.g. through `uapplace install`)"
    )


# --------------------------------------------------------------------------- collaborators


def _notifier(address: str, controller: Callable[[], Controller]) -> Notifier:
    """The desktop notifier; its buttons act on the controller (``controller()``: built
    after the notifier, which it reports through; no click arrives before ``start``)."""

    async def on_apply(placement_id: str, option: int, signature: tuple[str, ...]) -> None:
        # The signature the bubble showed; a run that did not land is told back to
        # the person who clicked (Notifier answers a PlacementFailure with a bubble).
        result = await controller().enforcement.apply(
            placement_id, option, list(signature), origin="notification click"
        )
        if result.get("ok") is not True:
            raise Failed(str(result.get("error") or "the enforcement did not complete"))

    async def on_dismiss(placement_id: str) -> None:
        controller().dismiss(placement_id)

    return Notifier(address, on_apply, on_dismiss)


class UserManagerReload:
    """The drop-in writer's way to the user manager: none until enforcement started
    (``Assembly.start`` hands it the connected unit manager), and none without one."""

    def __init__(self) -> None:
        self.units: UnitManager | None = None

    async def __call__(self) -> bool:
        if self.units is None:
            return False
        await self.units.reload()
        return True


class QuietUntilStarted:
    """The notifier as the controller sees it: silent until :meth:`open` (phase 2), so
    nothing reaches the session bus before the daemon owns its name (an alert raised
    while the ledger is restored included: it shows in ``status``, not as a bubble)."""

    def __init__(self, notifier: Notifications) -> None:
        self._notifier = notifier
        self._open = False

    def open(self) -> None:
        self._open = True

    async def parked(self, entry: PendingEntry, plan: Plan, clients: Sequence[str]) -> None:
        if self._open:
            await self._notifier.parked(entry, plan, clients)

    async def resolved(self, placement_id: str, outcome: str) -> None:
        if self._open:
            await self._notifier.resolved(placement_id, outcome)

    async def alert(self, alert: Alert) -> None:
        if self._open:
            await self._notifier.alert(alert)


# --------------------------------------------------------------------------- enforcement


@dataclass
class EnforcementStack:
    """What :func:`attach_enforcement` built: close it when the daemon stops."""

    units: UnitManager
    enforcer: Enforcer
    sync: UnitSync
    measurer: Measurer
    controller: Controller

    async def reload(self) -> bool:
        """Re-read the registry (a bad one keeps the last good), then re-sync the units."""
        changed = await self.controller.reload()
        await self.sync.sync_all()
        return changed

    async def close(self) -> None:
        await self.sync.close()
        self.units.close()


async def attach_enforcement(
    controller: Controller,
    paths: Paths,
    refresher: ProxyRefresher | None,
    *,
    units: UnitManager | None = None,
    timeouts: Timeouts | None = None,
    auto: AutoFactory | None = None,
) -> EnforcementStack:
    """Connect to the user manager and give ``controller`` its enforcement parts.

    Residents then follow the units (:class:`~uapplace.publish.unitsync.UnitSync`, synced
    once now). Before that sync, a run the journal shows cut short by a crash is
    repaired (:func:`uapplace.recovery.recover.recover`). The controller gets its
    enforcer, measurer and (from ``auto``) auto runner only once all of that has
    started. Raises :class:`~uapplace.io.units.UnitError` when the user manager is
    unreachable, :class:`~uapplace.files.jsonfile.ConfigFileError` for a bad
    ``enforcement-timeouts.json``, and whatever the first sync raised; then
    ``controller`` gets no enforcement, the unit sync is closed and the
    :class:`~uapplace.io.units.UnitManager` this call made (not one passed in as
    ``units``) is closed.
    """
    if timeouts is None:
        timeouts = await asyncio.to_thread(Timeouts.load, paths.enforcement_timeouts)
    manager = units or UnitManager()
    host = ControllerHost(controller)
    marks = EnforcementMarks()
    journal = Journal(paths.enforcement_journal, crash_at=paths.test_crash_at)
    enforcer = Enforcer(
        host, manager, timeouts=timeouts, refresher=refresher, marks=marks, journal=journal
    )
    sync = UnitSync(
        host, manager, marks, http_s=timeouts.http_s, sleep_check_s=timeouts.serving_check_s
    )

    async def after_measure() -> None:
        await controller.reload()
        await sync.sync_all()

    measurer = Measurer(
        paths,
        host,
        manager,
        http_s=timeouts.http_s,
        after_write=after_measure,
        window=EnvelopeWindow(enforcer).open,
    )
    try:
        await manager.connect()
        # A run a crash cut short is repaired before the sync publishes any unit
        # and before the controller accepts a new run (uapplace.recovery.recover).
        await recover(journal, ControllerRecoveryHost(controller), manager, timeouts=timeouts)
        await sync.start()
    except BaseException:
        await sync.close()
        if units is None:
            manager.close()
        raise
    # Only now: a half-wired controller would accept an Apply it cannot see through.
    if auto is None:
        controller.enforcement.attach(EnforcementParts(enforcer, measurer, units=manager))
    else:
        parts = EnforcementParts(enforcer, measurer, auto(enforcer), units=manager)
        controller.enforcement.attach(parts)
    # Now the units can be read: a measurement taken under another ExecStart or engine
    # build than they run now stops counting (docs/placement-rules.md §4.1.1).
    await controller.reload()
    return EnforcementStack(manager, enforcer, sync, measurer, controller)


# --------------------------------------------------------------------------- the daemon


@dataclass
class Assembly:
    """The daemon's parts, as :func:`build` made them; :meth:`start`, then :meth:`close`."""

    paths: Paths
    address: str
    bus: Bus
    controller: Controller
    interface: PlacementInterface
    proxy: ProxyClient
    auto_policy: PolicyStore
    notifier: Notifier
    quiet_notifier: QuietUntilStarted
    authorizer: Authorizer
    manager_reload: UserManagerReload
    stack: EnforcementStack | None = None
    publication: LedgerPublication | None = None
    """Verifies restored residents over HTTP when no unit sync runs (no user manager)."""
    sweep: IdleSweep | None = None
    sweep_task: asyncio.Future[None] | None = None
    peer_listener: PeerListener | None = None

    async def reload(self) -> bool:
        """SIGHUP: re-read the registry; with enforcement, re-sync the units too."""
        if self.stack is not None:
            return await self.stack.reload()
        return await self.controller.reload()

    async def start(self) -> None:
        """Phase 2 (the bus name is ours): go live."""
        self.controller.start_background()
        try:
            await self.notifier.start()
        except Exception as err:
            log.warning("desktop notifications unavailable: %s", err)
        self.quiet_notifier.open()
        await self._start_enforcement()
        await self._listen_on_peer_socket()

    async def _start_enforcement(self) -> None:
        controller = self.controller
        why_not = await why_no_user_manager(self.bus, self.address)
        if why_not is not None:
            self._without_enforcement(why_not)
            return
        store = self.auto_policy

        def auto(enforcer: Enforcer) -> AutoRunner:
            runner = AutoRunner(
                controller,
                enforcer,
                store,
                controller.config.registry,
                envelope_s=enforcement_envelope_s(enforcer.timeouts),
                option_envelope=lambda option: option_envelope_s(
                    enforcer.timeouts, controller.registry, option
                ),
                on_runs=controller.set_auto_loading,
            )
            store.describe_runs = runner.status
            return runner

        try:
            stack = await attach_enforcement(controller, self.paths, self.proxy, auto=auto)
        except Exception as err:
            self._without_enforcement(f"enforcement could not start: {err}", error=True)
            return
        self.stack = stack
        self.manager_reload.units = stack.units
        # The registry may have changed while no daemon ran: a stale Conflicts= graph would
        # let systemd stop a model the planner keeps (rewritten only where drop-ins exist).
        await controller.collaborators.unit_writer.refresh()
        self.sweep = IdleSweep(controller, stack.enforcer, store, controller.config.registry)
        self.sweep_task = asyncio.ensure_future(self.sweep.run())
        log.info("enforcement, unit sync, auto runner and idle sweep wired")

    def _without_enforcement(self, why: str, *, error: bool = False) -> None:
        """No unit sync: restored residents are still verified (over HTTP) before any
        admit is forwarded to them (docs/invariants.md, invariant 2)."""
        self.controller.enforcement.unavailable(why)
        (log.error if error else log.warning)("Apply/Load/Unload/Measure unavailable: %s", why)
        self.publication = LedgerPublication(ControllerHost(self.controller))
        self.publication.start()

    async def _listen_on_peer_socket(self) -> None:
        """The Admit-only peer socket (:mod:`uapplace.bus.peer`); the bus works without it."""
        listener = PeerListener(self.paths.peer_socket, self.interface.admit_answer)
        try:
            await listener.start()
        except (PeerRefused, OSError) as err:
            log.warning("no peer-to-peer Admit socket (the shim uses the bus): %s", err)
            return
        self.peer_listener = listener
        log.info("Admit also answered on %s (peer-to-peer, same uid)", listener.path)

    async def close(self) -> None:
        """Everything :meth:`start` and :func:`build` made, in reverse."""
        if self.peer_listener is not None:
            await self.peer_listener.close()
        if self.sweep is not None:
            self.sweep.close()
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
        for name, stop in (("Notifier", self.notifier.stop), ("Authorizer", self.authorizer.close)):
            try:
                await stop()
            except Exception as err:
                log.warning("closing %s: %s", name, err)


async def build(paths: Paths, config: ConfigState, bus: Bus, address: str) -> Assembly:
    """Phase 1: every collaborator and the controller, the ledger restored, the bus
    interface exported; nothing written and nothing started (see the module docstring).

    ``config`` was read before the bus was touched (an invalid repo registry is the
    daemon's exit 2)."""
    live = LiveConfig(config)
    relay = EventRelay()
    proxy = ProxyClient(paths.proxy_url, paths.proxy_token())
    store = PolicyStore(paths.auto_policy, live.registry)
    manager_reload = UserManagerReload()
    unit_writer = UnitDropins(paths.user_unit_dir, live.registry, manager_reload)
    built: list[Controller] = []
    notifier = _notifier(address, lambda: built[0])
    quiet_notifier = QuietUntilStarted(notifier)

    async def peer_connected(name: str) -> bool:
        return await name_has_owner(bus, name)

    controller = Controller(
        live,
        Ledger(paths.ledger),
        Collaborators(
            unit_writer=unit_writer,
            events=relay,
            proxy=ProxyHolders(proxy),
            notifier=quiet_notifier,
            peer_connected=peer_connected,
        ),
    )
    built.append(controller)
    await controller.restore_from_ledger()
    authorizer = Authorizer(bus, paths.system_bus_address)
    interface = PlacementInterface(controller, authorizer, store, unit_writer)
    track_senders(bus, interface.admit_answer)
    relay.attach(interface)
    bus.export(OBJECT_PATH, interface)
    await _watch_peers(bus, controller)
    return Assembly(
        paths,
        address,
        bus,
        controller,
        interface,
        proxy,
        store,
        notifier,
        quiet_notifier,
        authorizer,
        manager_reload,
    )


async def _watch_peers(bus: MessageBus, controller: Controller) -> None:
    """Holds end when their holder's connection does: follow ``NameOwnerChanged``."""

    def on_message(message: Message) -> None:
        if (
            message.message_type is MessageType.SIGNAL
            and message.member == "NameOwnerChanged"
            and message.sender == "org.freedesktop.DBus"
        ):
            name, _old, new = message.body
            if name.startswith(":") and not new:
                controller.drop_holds_of(name)

    bus.add_message_handler(on_message)
    await add_match(bus, NAME_OWNER_CHANGED_RULE)
