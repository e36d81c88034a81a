"""Desktop notifications for parked requests: one bubble per requested model.

A park shows (or updates, through ``replaces_id``) a bubble naming the model, who
asked, the recommended option and what it would stop. Its "apply" button is the
operator's yes for exactly the victim signature the bubble showed; the click is
handed to the controller (``on_apply``), which refuses with ``Drifted`` when the
machine has changed since. Notifications are a convenience: without a
notification daemon every call here is a no-op (logged once), and parked requests
are still listed by ``uapplace pending``.

Only signals sent by the current owner of ``org.freedesktop.Notifications`` and
carrying an action key this module put on one of its own bubbles are acted on.
"""

from __future__ import annotations

import asyncio
import html
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dbus_fast import Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusFastError

from uapplace.bus import connection as busio
from uapplace.bus.util import bus_daemon_message
from uapplace.core.alerts import Alert, Severity
from uapplace.core.errors import PlacementFailure
from uapplace.core.model import (
    Option,
    OptionKind,
    PendingEntry,
    Plan,
    PreviewReason,
    ResidentState,
    Victim,
)
from uapplace.core.textsafe import printable

log = logging.getLogger(__name__)

NOTIFICATIONS_NAME = "org.freedesktop.Notifications"
NOTIFICATIONS_PATH = "/org/freedesktop/Notifications"
NOTIFICATIONS_INTERFACE = "org.freedesktop.Notifications"
BUS_DAEMON = "org.freedesktop.DBus"
APP_NAME = "uapplace"
DESKTOP_ENTRY = "uapplace"
URGENCY_NORMAL = 1
URGENCY_CRITICAL = 2
DEFAULT_RECHECK_S = 30.0
CALL_TIMEOUT_S = 5.0
MIN_EXPIRE_MS = 5_000
MAX_EXPIRE_MS = 2**31 - 1
SHOWN_INFEASIBLE = 3

ApplyCallback = Callable[[str, int, tuple[str, ...]], Awaitable[None]]
DismissCallback = Callable[[str], Awaitable[None]]


# --------------------------------------------------------------------------- texts


def mib_text(mib: float) -> str:
    return f"{round(mib):,} MiB"


def host_text(mib: float) -> str:
    return f"{mib_text(mib)} of host RAM"


def counted(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def unique(names: Iterable[str]) -> list[str]:
    """Non-empty names, first occurrence kept, in order."""
    return list(dict.fromkeys(name for name in names if name))


def summary_text(model: str, clients: Sequence[str]) -> str:
    """``qwen3.8-27b requested by claude-code and 2 others``."""
    names = unique(clients)
    if not names:
        return f"{model} requested"
    if len(names) == 1:
        return f"{model} requested by {names[0]}"
    if len(names) == 2:
        return f"{model} requested by {names[0]} and {names[1]}"
    return f"{model} requested by {names[0]} and {len(names) - 1} others"


def victim_impact(victim: Victim) -> str:
    """``qwen3.8-flash-next: 2 clients, 1 generation in flight``."""
    clients = unique(holder.client for holder in victim.holders)
    who = "no clients" if not clients else counted(len(clients), "client")
    if victim.in_flight is None:
        work = "in-flight work unknown"
    elif victim.in_flight:
        generations = sum(1 for holder in victim.holders if holder.kind == "inflight")
        work = f"{counted(max(generations, 1), 'generation')} in flight"
    else:
        work = "nothing in flight"
    state = "" if victim.state is ResidentState.HOT else f" ({victim.state.value})"
    return f"{victim.model}{state}: {who}, {work}"


def recommendation_text(option: Option) -> str:
    target = f"{option.model}/{option.config} on {option.device}"
    if option.kind is OptionKind.REUSE:
        return f"use {target}, already loaded — nothing is stopped"
    swap = f"; swap ≈ {seconds_text(option.expected_s)}" if option.expected_s is not None else ""
    if option.kind is OptionKind.LOAD_ALONGSIDE:
        # The CPU tier's cost is host RAM (docs/placement-rules.md §4.5).
        needs = host_text(option.host_mib) if option.on_host else mib_text(option.cost_mib)
        return f"load {target} alongside — nothing is stopped, needs {needs}{swap}"
    verb = "load"
    if option.kind is OptionKind.WAKE:
        verb = "wake"
        if not option.victims:
            return f"wake {target} (paused) — nothing is stopped{swap}"
    stopped = [victim_action_text(v) for v in option.victims if v.action == "stop"]
    paused = [victim_action_text(v) for v in option.victims if v.action == "pause"]
    parts = [f"stops {'; '.join(stopped)}"] if stopped else []
    parts += [f"pauses {'; '.join(paused)}"] if paused else []
    frees = host_text(option.frees_host_mib) if option.on_host else mib_text(option.frees_mib)
    return f"{verb} {target} — {'; '.join(parts)}, frees {frees}{swap}"


def seconds_text(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def victim_action_text(victim: Victim) -> str:
    """``coder-7b: no clients, nothing in flight, reload ≈ 38 s`` (issue 12: how long
    until the victim serves again, where the envelope measured it; a pause always says
    its wake, measured or not, so "pause" never reads as free)."""
    text = victim_impact(victim)
    if victim.action == "pause":
        when = seconds_text(victim.serve_again_s) if victim.serve_again_s is not None else None
        return f"{text}, wake ≈ {when or 'unmeasured'}"
    if victim.serve_again_s is not None:
        return f"{text}, reload ≈ {seconds_text(victim.serve_again_s)}"
    return text


def no_option_text(plan: Plan) -> str:
    if plan.reason is PreviewReason.NOT_IN_REGISTRY:
        return f"No option: {plan.requested} is in no registry file"
    if plan.reason is PreviewReason.NO_MEASURED_CONFIG:
        return (
            f"No option: {plan.requested} has no measured config; "
            "measure one with `uapplace measure`"
        )
    why = "; ".join(plan.infeasible[:SHOWN_INFEASIBLE])
    more = len(plan.infeasible) - SHOWN_INFEASIBLE
    if more > 0:
        why += f" (+{more} more)"
    return f"No option: nothing fits ({why})" if why else "No option: nothing fits"


def body_text(plan: Plan) -> str:
    if not plan.options:
        return no_option_text(plan)
    option = plan.options[0]
    lines = [f"Recommended: {recommendation_text(option)}"]
    lines += [f"{v.model}: {v.alternative}" for v in option.victims if v.alternative]
    if option.victims:
        lines.append(f"Approval signature: {', '.join(option.signature)}")
    others = len(plan.options) - 1
    if others:
        lines.append(f"{counted(others, 'other option')}: `uapplace pending`")
    return "\n".join(lines)


def action_label(option: Option) -> str:
    if option.kind is OptionKind.REUSE:
        return f"Use {option.model}"
    if option.kind is OptionKind.LOAD_ALONGSIDE:
        return f"Load on {option.device}"
    if option.kind is OptionKind.WAKE and not option.victims:
        return f"Wake {option.model}"
    verb = "Pause" if all(v.action == "pause" for v in option.victims) else "Stop"
    then = "wake" if option.kind is OptionKind.WAKE else "load"
    return f"{verb} {', '.join(unique(v.model for v in option.victims))} and {then}"


def urgency(option: Option | None) -> int:
    """Critical when the recommended option would stop work in flight (unknown counts)."""
    if option is not None and any(victim.in_flight is not False for victim in option.victims):
        return URGENCY_CRITICAL
    return URGENCY_NORMAL


def expire_timeout_ms(expires_at: float, now: float) -> int:
    """Show the bubble until the parked request expires (never less than a few seconds)."""
    return max(MIN_EXPIRE_MS, min(int((expires_at - now) * 1000), MAX_EXPIRE_MS))


def apply_key(placement_id: str, option: int) -> str:
    return f"apply:{placement_id}:{option}"


def dismiss_key(placement_id: str) -> str:
    return f"dismiss:{placement_id}"


# --------------------------------------------------------------------------- bubbles


@dataclass(frozen=True)
class ApplyTarget:
    """What an apply button stands for: the option the operator saw, with its signature."""

    placement_id: str
    option: int
    signature: tuple[str, ...]


@dataclass(frozen=True)
class Shown:
    """One parked entry that a bubble stands for."""

    entry: PendingEntry
    plan: Plan
    clients: tuple[str, ...]


@dataclass
class Bubble:
    """The notification of one requested model; ``notification_id`` 0 until the server answers."""

    model: str
    notification_id: int = 0
    shown: dict[str, Shown] = field(default_factory=dict)
    """By placement id, oldest park first; the bubble displays the newest."""
    applies: dict[str, ApplyTarget] = field(default_factory=dict)
    dismissals: dict[str, str] = field(default_factory=dict)

    def clients(self) -> list[str]:
        return unique(name for shown in self.shown.values() for name in shown.clients)


@dataclass(frozen=True)
class Rendered:
    """The arguments of one ``Notify`` call, and the action keys it carries."""

    summary: str
    body: str
    actions: tuple[str, ...]
    hints: dict[str, Variant]
    expire_timeout: int
    applies: dict[str, ApplyTarget]
    dismissals: dict[str, str]


def render(bubble: Bubble, markup: bool, now: float) -> Rendered:
    latest = list(bubble.shown.values())[-1]
    entry, plan = latest.entry, latest.plan
    option = plan.options[0] if plan.options else None
    applies: dict[str, ApplyTarget] = {}
    actions: list[str] = []
    if option is not None:
        key = apply_key(entry.id, 1)
        applies[key] = ApplyTarget(entry.id, 1, option.signature)
        actions += [key, action_label(option)]
    dismissals = {dismiss_key(entry.id): entry.id}
    actions += [dismiss_key(entry.id), "Dismiss"]
    body = printable(body_text(plan), keep_newlines=True)  # names come from Admit callers
    return Rendered(
        summary=printable(summary_text(bubble.model, bubble.clients())),
        body=html.escape(body, quote=False) if markup else body,
        actions=tuple(actions),
        hints={
            "urgency": Variant("y", urgency(option)),
            "desktop-entry": Variant("s", DESKTOP_ENTRY),
            "resident": Variant("b", False),
        },
        expire_timeout=expire_timeout_ms(entry.expires_at, now),
        applies=applies,
        dismissals=dismissals,
    )


# --------------------------------------------------------------------------- the bus side


class _CallFailed(Exception):
    def __init__(self, text: str, *, gone: bool) -> None:
        super().__init__(text)
        self.gone = gone
        """The peer or the connection is gone (as opposed to one call going wrong)."""


_GONE_ERRORS = frozenset(
    {
        "org.freedesktop.DBus.Error.ServiceUnknown",
        "org.freedesktop.DBus.Error.NameHasNoOwner",
        "org.freedesktop.DBus.Error.NoReply",
        "org.freedesktop.DBus.Error.Disconnected",
    }
)


class Notifier:
    """Parked requests as desktop notifications on the session bus at ``address``."""

    def __init__(
        self,
        address: str,
        on_apply: ApplyCallback,
        on_dismiss: DismissCallback,
        *,
        recheck_after: float = DEFAULT_RECHECK_S,
    ) -> None:
        self.address = address
        self.on_apply = on_apply
        self.on_dismiss = on_dismiss
        self.recheck_after = recheck_after
        self._bus: MessageBus | None = None
        self._owner: str | None = None
        self._activatable = False
        self._markup = False
        self._available: bool | None = None
        self._checked_at: float | None = None
        self._bubbles: dict[str, Bubble] = {}
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def available(self) -> bool:
        """A notification daemon owns the name, or the bus can start one."""
        return self._bus is not None and (self._owner is not None or self._activatable)

    def notification_id(self, model: str) -> int | None:
        """The id of the bubble shown for ``model``, or ``None`` when none is."""
        bubble = self._bubbles.get(model)
        return bubble.notification_id if bubble is not None and bubble.notification_id else None

    async def start(self) -> None:
        async with self._lock:
            await self._detect()

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._bus is not None:
            self._bus.disconnect()
            self._bus = None

    async def parked(self, entry: PendingEntry, plan: Plan, clients: Sequence[str]) -> None:
        """Show the park, or fold it into the bubble already shown for the same model."""
        async with self._lock:
            if not await self._ready():
                return
            bubble = self._bubbles.setdefault(entry.requested_model, Bubble(entry.requested_model))
            earlier = bubble.shown.pop(entry.id, None)
            known = earlier.clients if earlier else ()
            bubble.shown[entry.id] = Shown(entry, plan, tuple(unique([*known, *clients])))
            await self._show(bubble)

    async def resolved(self, placement_id: str, outcome: str) -> None:
        """The entry is gone (applied, dismissed, expired): close its bubble unless others show.

        ``applied``/``forwarded`` mean the model is served now: every other park for it
        resolves in the same pass, so the bubble closes at once rather than being redrawn
        with a button that would stop what is already stopped.
        """
        async with self._lock:
            bubble = next((b for b in self._bubbles.values() if placement_id in b.shown), None)
            if bubble is None:
                return
            log.debug("notification for %s: %s %s", bubble.model, placement_id, outcome)
            del bubble.shown[placement_id]
            if outcome in ("applied", "forwarded"):
                bubble.shown.clear()
            if bubble.shown:
                await self._show(bubble)
                return
            del self._bubbles[bubble.model]
            if bubble.notification_id and self.available:
                await self._close(bubble.notification_id)

    async def alert(self, alert: Alert) -> None:
        """An alert as its own bubble: critical urgency stays until the user closes it."""
        critical = alert.severity is Severity.CRITICAL
        await self.message(
            f"uapplace: {alert.kind.value.replace('_', ' ')}",
            f"{alert.subject}: {alert.message}\n(acknowledge with `uapplace status --ack`)",
            critical=critical,
        )

    async def message(self, summary: str, body: str, *, critical: bool = False) -> None:
        """A plain bubble without actions (an alert, a refused click)."""
        async with self._lock:
            if not await self._ready() or self._bus is None:
                return
            hints = {"urgency": Variant("y", URGENCY_CRITICAL if critical else URGENCY_NORMAL)}
            summary, body = printable(summary), printable(body, keep_newlines=True)
            if self._markup:  # alert texts carry names from Admit callers and units
                body = html.escape(body, quote=False)
            message = _notifications_call(
                "Notify",
                "susssasa{sv}i",
                [APP_NAME, 0, "", summary, body, [], hints, 0 if critical else -1],
            )
            try:
                await self._call_with_sender(self._bus, message)
            except _CallFailed as err:
                self._call_failed("Notify", err)

    # ----------------------------------------------------------------- daemon presence

    async def _ready(self) -> bool:
        if self.available:
            return True
        now = time.monotonic()
        if self._checked_at is not None and now - self._checked_at < self.recheck_after:
            return False
        await self._detect()
        return self.available

    async def _detect(self) -> None:
        self._checked_at = time.monotonic()
        bus = await self._connect()
        if bus is None:
            self._note_availability(f"no session bus at {self.address}")
            return
        try:
            self._owner = await self._name_owner(bus)
            if self._owner is None:
                (names,) = await self._call(bus, bus_daemon_message("ListActivatableNames"))
                self._activatable = NOTIFICATIONS_NAME in names
            if self.available:
                await self._read_capabilities(bus)
        except _CallFailed as err:
            self._owner, self._activatable = None, False
            self._note_availability(str(err))
            return
        self._note_availability(f"no {NOTIFICATIONS_NAME} on the session bus")

    async def _name_owner(self, bus: MessageBus) -> str | None:
        try:
            get_owner = bus_daemon_message("GetNameOwner", "s", [NOTIFICATIONS_NAME])
            (owner,) = await self._call(bus, get_owner)
        except _CallFailed as err:
            if err.gone:
                return None
            raise
        return str(owner)

    async def _read_capabilities(self, bus: MessageBus) -> None:
        """Whether bodies are markup (then ``&`` and ``<`` must be escaped); plain if unsure."""
        try:
            (capabilities,) = await self._call(bus, _notifications_call("GetCapabilities"))
        except _CallFailed as err:
            log.debug("notification daemon capabilities: %s", err)
            capabilities = []
        self._markup = "body-markup" in capabilities

    def _note_availability(self, why_not: str) -> None:
        """Log the transitions only: one warning when notifications go away, not one per park."""
        available = self.available
        if available == self._available:
            return
        self._available = available
        if available:
            log.info("desktop notifications on (%s)", self._owner or "activatable")
        else:
            log.warning(
                "desktop notifications off: %s; parked requests show in `uapplace pending`; "
                "looking again at most every %g s",
                why_not,
                self.recheck_after,
            )

    async def _connect(self) -> MessageBus | None:
        if self._bus is not None and self._bus.connected:
            return self._bus
        self._bus, self._owner, self._activatable = None, None, False
        self._bubbles.clear()
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                bus = await busio.Bus(bus_address=self.address).connect()
        except (TimeoutError, DBusFastError, OSError, EOFError) as err:
            log.debug("session bus %s: %s", self.address, err)
            return None
        bus.add_message_handler(self._on_message)
        try:
            for rule in _match_rules():
                await self._call(bus, bus_daemon_message("AddMatch", "s", [rule]))
        except _CallFailed as err:
            log.debug("session bus %s: %s", self.address, err)
            bus.disconnect()
            return None
        self._bus = bus
        return bus

    # ----------------------------------------------------------------- calls

    async def _show(self, bubble: Bubble) -> None:
        bus = self._bus
        if bus is None:
            return
        shown = render(bubble, self._markup, time.time())
        message = _notifications_call(
            "Notify",
            "susssasa{sv}i",
            [
                APP_NAME,
                bubble.notification_id,
                "",
                shown.summary,
                shown.body,
                list(shown.actions),
                shown.hints,
                shown.expire_timeout,
            ],
        )
        try:
            (notification_id,), sender = await self._call_with_sender(bus, message)
        except _CallFailed as err:
            self._call_failed("Notify", err)
            return
        if self._owner is None:
            self._owner = sender
        bubble.notification_id = int(notification_id)
        bubble.applies = shown.applies
        bubble.dismissals = shown.dismissals

    async def _close(self, notification_id: int) -> None:
        if self._bus is None:
            return
        message = _notifications_call("CloseNotification", "u", [notification_id])
        try:
            await self._call(self._bus, message)
        except _CallFailed as err:
            self._call_failed("CloseNotification", err)

    def _call_failed(self, what: str, err: _CallFailed) -> None:
        log.warning("desktop notification %s failed: %s", what, err)
        if err.gone:
            self._owner, self._activatable = None, False
            self._bubbles.clear()
            self._checked_at = time.monotonic()
            self._note_availability(str(err))

    async def _call(self, bus: MessageBus, message: Message) -> list[Any]:
        body, _ = await self._call_with_sender(bus, message)
        return body

    async def _call_with_sender(self, bus: MessageBus, message: Message) -> tuple[list[Any], str]:
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S):
                reply = await bus.call(message)
        except TimeoutError:
            raise _CallFailed(
                f"{message.member}: no reply in {CALL_TIMEOUT_S:g} s", gone=False
            ) from None
        except (DBusFastError, OSError, EOFError) as err:
            raise _CallFailed(f"{message.member}: {err}", gone=True) from err
        if reply is None:
            raise _CallFailed(f"{message.member}: no reply", gone=True)
        if reply.message_type is MessageType.ERROR:
            name = reply.error_name or "unknown error"
            text = reply.body[0] if reply.body else ""
            raise _CallFailed(f"{message.member}: {name}: {text}", gone=name in _GONE_ERRORS)
        return list(reply.body), reply.sender or ""

    # ----------------------------------------------------------------- signals

    def _on_message(self, message: Message) -> None:
        """dbus-fast handler: returns nothing, so every message goes on to its usual handling."""
        if message.message_type is not MessageType.SIGNAL:
            return
        if message.sender == BUS_DAEMON and message.member == "NameOwnerChanged":
            if message.signature == "sss" and message.body[0] == NOTIFICATIONS_NAME:
                self._owner_changed(str(message.body[2]))
            return
        if self._owner is None or message.sender != self._owner:
            return
        if message.interface != NOTIFICATIONS_INTERFACE:
            return
        if message.member == "ActionInvoked" and message.signature == "us":
            self._action_invoked(int(message.body[0]), str(message.body[1]))
        elif message.member == "NotificationClosed" and message.signature == "uu":
            self._forget(int(message.body[0]))

    def _owner_changed(self, new_owner: str) -> None:
        owner = new_owner or None
        if owner == self._owner:
            return
        if self._owner is not None:
            # Bubble ids belonged to the daemon that left; a new one knows none of them.
            self._bubbles.clear()
        self._owner = owner
        self._checked_at = time.monotonic()
        self._note_availability("the notification daemon left the session bus")

    def _action_invoked(self, notification_id: int, key: str) -> None:
        bubble = self._bubble(notification_id)
        if bubble is None:
            return
        target = bubble.applies.get(key)
        if target is not None:
            self._spawn(self.on_apply(target.placement_id, target.option, target.signature), key)
            return
        placement_id = bubble.dismissals.get(key)
        if placement_id is not None:
            self._spawn(self.on_dismiss(placement_id), key)
            return
        log.debug("notification %d: action %r is not one it shows", notification_id, key)

    def _forget(self, notification_id: int) -> None:
        bubble = self._bubble(notification_id)
        if bubble is not None:
            del self._bubbles[bubble.model]

    def _bubble(self, notification_id: int) -> Bubble | None:
        if notification_id == 0:
            return None
        return next(
            (b for b in self._bubbles.values() if b.notification_id == notification_id), None
        )

    def _spawn(self, callback: Awaitable[None], key: str) -> None:
        task = asyncio.get_running_loop().create_task(self._guarded(callback, key))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded(self, callback: Awaitable[None], key: str) -> None:
        """Run a click; a refusal (Drifted, Busy, NotAuthorized, a failed run …) is answered
        with a bubble saying why, since the person who clicked has no terminal to read."""
        try:
            await callback
        except PlacementFailure as err:
            log.warning("notification action %s refused: %s: %s", key, type(err).__name__, err)
            await self.message(refusal_summary(key, err), str(err))
        except Exception:
            log.exception("notification action %s failed", key)


def refusal_summary(key: str, err: PlacementFailure) -> str:
    """``uapplace: not applied (Drifted)`` / ``… not dismissed (NotFound)``."""
    verb = "dismissed" if key.startswith("dismiss:") else "applied"
    return f"uapplace: not {verb} ({err.short})"


def _match_rules() -> tuple[str, ...]:
    return (
        f"type='signal',sender='{BUS_DAEMON}',interface='{BUS_DAEMON}',"
        f"member='NameOwnerChanged',arg0='{NOTIFICATIONS_NAME}'",
        f"type='signal',sender='{NOTIFICATIONS_NAME}',interface='{NOTIFICATIONS_INTERFACE}',"
        f"path='{NOTIFICATIONS_PATH}'",
    )


def _notifications_call(member: str, signature: str = "", body: list[Any] | None = None) -> Message:
    return Message(
        destination=NOTIFICATIONS_NAME,
        path=NOTIFICATIONS_PATH,
        interface=NOTIFICATIONS_INTERFACE,
        member=member,
        signature=signature,
        body=body or [],
    )
