"""Who may mutate: polkit when a system bus with polkit is reachable, else the daemon's own uid.

docs/bus-api.md ("Authorization"). Every privileged verb of the bus API has one polkit action
(``polkit/org.uap.placement.policy``); the service calls :meth:`Authorizer.check`
before it mutates anything and never for reads. The caller is identified on the
session bus that carried its call (PID, UID), and polkit is asked about that
process (``unix-process`` subject with the start time, so a recycled PID cannot
borrow an answer). polkit may ask the operator to authenticate, so its answer can
take a while; the call never blocks the loop and times out (``NotAuthorized``).

Where no polkit answers (no system bus, or no ``org.freedesktop.PolicyKit1`` on
it), only the user the daemon runs as may mutate. Once polkit is there, every
failure to get its yes is a no: an error or a timeout never falls back to the uid
rule.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from dbus_fast import BusType, Message, MessageType, Variant
from dbus_fast.aio import MessageBus
from dbus_fast.errors import DBusFastError

from uapplace.bus import connection as busio
from uapplace.bus.util import bus_daemon_message
from uapplace.core import errors

log = logging.getLogger(__name__)

POLKIT_NAME = "org.freedesktop.PolicyKit1"
POLKIT_PATH = "/org/freedesktop/PolicyKit1/Authority"
POLKIT_INTERFACE = "org.freedesktop.PolicyKit1.Authority"
ALLOW_USER_INTERACTION = 1
DEFAULT_POLKIT_TIMEOUT = 10.0
DEFAULT_AVAILABILITY_TTL = 5.0
BUS_CALL_TIMEOUT = 5.0


class Action(StrEnum):
    """One polkit action per privileged verb (ids as in the policy file)."""

    APPLY = "org.uap.placement.apply"
    DISMISS = "org.uap.placement.dismiss"
    LOAD = "org.uap.placement.load"
    UNLOAD = "org.uap.placement.unload"
    WRITE_UNITS = "org.uap.placement.write-units"
    MEASURE = "org.uap.placement.measure"
    HOLD = "org.uap.placement.hold"
    AUTO_ENABLE = "org.uap.placement.auto-enable"
    """Turn auto-placement on: the daemon then loads parked models without asking."""
    AUTO_RESTRICT = "org.uap.placement.auto-restrict"
    """Take standing consent back: auto off, names off the allowlists."""
    ALLOW_DISPLACE = "org.uap.placement.allow-displace"
    ALLOW_UNLOAD = "org.uap.placement.allow-unload"
    """Add names to the idle-unload allowlist, or change the idle time it acts on."""
    ACKNOWLEDGE = "org.uap.placement.acknowledge"
    """Mark alerts as seen (they leave ``GetState`` and the status banner)."""
    RELEASE_OTHERS = "org.uap.placement.release-others"
    """End a hold another bus connection took (its holder ends its own without asking).

    Only polkit can grant it (:meth:`Authorizer.check_polkit`): being the same
    user is not enough, since every client of the user bus is the same user."""


def auto_policy_actions(changes: Mapping[str, Any]) -> frozenset[Action]:
    """The actions a ``SetAutoPolicy`` body needs (docs/bus-api.md, "The auto policy").

    Granting standing consent and taking it back are separate actions, so the
    policy can make the first strict without ever making an operator
    authenticate to switch auto off. ``{}`` (status) needs none. Keys outside the
    body shape need none here; the service rejects them as ``InvalidArgument``.
    """
    needed: set[Action] = set()
    if changes.get("enable") is True:
        needed.add(Action.AUTO_ENABLE)
    if changes.get("disable") is True or "disallow_displace" in changes:
        needed.add(Action.AUTO_RESTRICT)
    if "disallow_unload" in changes:
        needed.add(Action.AUTO_RESTRICT)
    if "allow_displace" in changes:
        needed.add(Action.ALLOW_DISPLACE)
    if "allow_unload" in changes or "unload_idle_after_secs" in changes:
        needed.add(Action.ALLOW_UNLOAD)
    return frozenset(needed)


class NotAuthorized(errors.NotAuthorized):
    """The caller may not perform ``action``; the message names the polkit action id."""

    def __init__(self, action: Action, detail: str) -> None:
        super().__init__(f"{action.value}: {detail}")
        self.action = action
        self.detail = detail


@dataclass(frozen=True)
class Caller:
    """The process behind a bus connection, as the bus daemon vouches for it."""

    sender: str
    uid: int
    pid: int | None


def same_uid_decision(caller_uid: int, own_uid: int, action: Action) -> None:
    """Without polkit, only the user the daemon runs as may mutate."""
    if caller_uid != own_uid:
        raise NotAuthorized(
            action,
            f"caller uid {caller_uid} is not the daemon's uid {own_uid}, "
            "and no polkit is reachable to ask",
        )


def process_start_time(pid: int, proc: Path = Path("/proc")) -> int:
    """Field 22 of ``/proc/<pid>/stat``: start time in clock ticks since boot.

    The command name (field 2) may hold spaces and parentheses, so fields are
    counted from the last ``)``. Raises ``OSError`` when the process is gone and
    ``ValueError`` when the file does not parse.
    """
    text = (proc / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    # rest starts at field 3 (state), so field 22 is index 19.
    if not sep or len(fields) < 20:
        raise ValueError(f"{proc}/{pid}/stat: no start time field")
    return int(fields[19])


def polkit_subject(pid: int, start_time: int, uid: int) -> tuple[str, dict[str, Variant]]:
    return (
        "unix-process",
        {
            "pid": Variant("u", pid),
            "start-time": Variant("t", start_time),
            "uid": Variant("i", uid),
        },
    )


class _CallFailed(Exception):
    """A bus call that got an error reply, no reply, or no connection."""


async def _call(bus: MessageBus, message: Message, limit_s: float) -> list[Any]:
    try:
        async with asyncio.timeout(limit_s):
            reply = await bus.call(message)
    except TimeoutError:
        raise _CallFailed(f"{message.member}: no reply in {limit_s:g} s") from None
    except (DBusFastError, OSError, EOFError) as err:
        raise _CallFailed(f"{message.member}: {err}") from err
    if reply is None:
        raise _CallFailed(f"{message.member}: no reply")
    if reply.message_type is MessageType.ERROR:
        text = reply.body[0] if reply.body else ""
        raise _CallFailed(f"{message.member}: {reply.error_name}: {text}")
    return list(reply.body)


class Authorizer:
    """``await check(sender, action)`` before every mutation; raises :class:`NotAuthorized`."""

    def __init__(
        self,
        session_bus: MessageBus,
        system_bus_address: str | None,
        *,
        own_uid: int | None = None,
        polkit_timeout: float = DEFAULT_POLKIT_TIMEOUT,
        availability_ttl: float = DEFAULT_AVAILABILITY_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.session_bus = session_bus
        self.system_bus_address = system_bus_address
        self.own_uid = os.getuid() if own_uid is None else own_uid
        self.polkit_timeout = polkit_timeout
        self.availability_ttl = availability_ttl
        self._clock = clock
        self._system_bus: MessageBus | None = None
        self._polkit_seen: bool | None = None
        self._polkit_checked_at = 0.0
        self._probe_lock = asyncio.Lock()

    async def check(self, sender: str, action: Action) -> None:
        caller = await self.caller(sender, action)
        system_bus = await self._polkit_bus()
        if system_bus is None:
            same_uid_decision(caller.uid, self.own_uid, action)
            return
        await self._ask_polkit(system_bus, caller, action)

    async def check_polkit(self, sender: str, action: Action) -> None:
        """Like :meth:`check`, but with no same-uid fallback: without polkit it is a no.

        For actions that act on another connection's state (``RELEASE_OTHERS``),
        where every caller on the user bus would pass the uid rule."""
        caller = await self.caller(sender, action)
        system_bus = await self._polkit_bus()
        if system_bus is None:
            raise NotAuthorized(
                action, "only polkit can grant this, and no polkit is reachable to ask"
            )
        await self._ask_polkit(system_bus, caller, action)

    async def check_all(self, sender: str, actions: Iterable[Action]) -> None:
        """Every action in turn (stable order); the first refusal raises."""
        for action in sorted(set(actions)):
            await self.check(sender, action)

    async def caller(self, sender: str, action: Action) -> Caller:
        """PID and UID of ``sender`` from the session bus daemon (fail closed)."""
        message = bus_daemon_message("GetConnectionCredentials", "s", [sender])
        try:
            (credentials,) = await _call(self.session_bus, message, BUS_CALL_TIMEOUT)
        except _CallFailed as err:
            raise NotAuthorized(action, f"cannot identify caller {sender}: {err}") from None
        uid = credentials.get("UnixUserID")
        pid = credentials.get("ProcessID")
        if uid is None:
            raise NotAuthorized(action, f"the bus does not know caller {sender}'s uid")
        return Caller(sender, int(uid.value), None if pid is None else int(pid.value))

    async def close(self) -> None:
        if self._system_bus is not None:
            self._system_bus.disconnect()
            self._system_bus = None

    async def _ask_polkit(self, system_bus: MessageBus, caller: Caller, action: Action) -> None:
        if caller.pid is None:
            raise NotAuthorized(action, f"the bus does not know caller {caller.sender}'s pid")
        try:
            start_time = await asyncio.to_thread(process_start_time, caller.pid)
        except (OSError, ValueError) as err:
            raise NotAuthorized(action, f"caller pid {caller.pid}: {err}") from None
        message = Message(
            destination=POLKIT_NAME,
            path=POLKIT_PATH,
            interface=POLKIT_INTERFACE,
            member="CheckAuthorization",
            signature="(sa{sv})sa{ss}us",
            body=[
                polkit_subject(caller.pid, start_time, caller.uid),
                action.value,
                {},
                ALLOW_USER_INTERACTION,
                "",
            ],
        )
        try:
            ((is_authorized, is_challenge, _details),) = await _call(
                system_bus, message, self.polkit_timeout
            )
        except _CallFailed as err:
            raise NotAuthorized(action, f"asking polkit failed: {err}") from None
        if is_authorized:
            return
        if is_challenge:
            raise NotAuthorized(action, "polkit wants authentication, and none was given")
        raise NotAuthorized(action, f"polkit denies it to uid {caller.uid} (pid {caller.pid})")

    async def _polkit_bus(self) -> MessageBus | None:
        """The system bus connection when polkit is on it; the answer is cached briefly."""
        async with self._probe_lock:
            if self._probe_due():
                seen, why = await self._probe_polkit()
                if seen != self._polkit_seen:
                    self._log_decision(seen, why)
                self._polkit_seen = seen
                self._polkit_checked_at = self._clock()
            return self._system_bus if self._polkit_seen else None

    def _probe_due(self) -> bool:
        if self._polkit_seen is None:
            return True
        if self._polkit_seen and (self._system_bus is None or not self._system_bus.connected):
            return True
        return self._clock() - self._polkit_checked_at >= self.availability_ttl

    def _log_decision(self, seen: bool, why: str) -> None:
        if seen:
            log.info("authorization: asking polkit on %s", self.system_bus_address)
        else:
            log.info("authorization: %s; only uid %d may mutate", why, self.own_uid)

    async def _probe_polkit(self) -> tuple[bool, str]:
        """Whether polkit answers on the system bus, and if not, why not."""
        address = self.system_bus_address
        if address is None:
            return False, "no system bus configured"
        bus = await self._connect_system_bus()
        if bus is None:
            return False, f"no system bus at {address}"
        try:
            (owned,) = await _call(
                bus, bus_daemon_message("NameHasOwner", "s", [POLKIT_NAME]), BUS_CALL_TIMEOUT
            )
            if owned:
                return True, ""
            (names,) = await _call(
                bus, bus_daemon_message("ListActivatableNames"), BUS_CALL_TIMEOUT
            )
        except _CallFailed as err:
            await self.close()
            return False, f"system bus {address}: {err}"
        if POLKIT_NAME in names:
            return True, ""
        return False, f"no {POLKIT_NAME} on {address}"

    async def _connect_system_bus(self) -> MessageBus | None:
        if self._system_bus is not None and self._system_bus.connected:
            return self._system_bus
        try:
            async with asyncio.timeout(BUS_CALL_TIMEOUT):
                bus = busio.Bus(bus_address=self.system_bus_address, bus_type=BusType.SYSTEM)
                self._system_bus = await bus.connect()
        except (TimeoutError, DBusFastError, OSError, EOFError) as err:
            log.debug("system bus %s: %s", self.system_bus_address, err)
            self._system_bus = None
        return self._system_bus
