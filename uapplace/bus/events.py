"""One event stream for every surface: the bus signals as numbered events.

The daemon's signals (``Parked``, ``Resolved``, ``ResidentChanged``,
``EnforcementStep``, ``AlertRaised``; dbus/org.uap.Placement1.xml) are the one
source. A subscriber turns each into an :class:`Event` with the next id of an
:class:`EventLog`; the shim relays the log as Server-Sent Events
(``GET /api/placement/events``, :func:`format_sse`) and ``uapplace watch --json``
prints the same :meth:`Event.to_json` objects as JSON lines.

Decisions (docs/bus-api.md and docs/http-contract.md are silent on them):

- **Bounded.** The log keeps the newest ``capacity`` events (1000 by default)
  in a ring; ids keep growing (1, 2, 3 … for the life of the log). A client
  that resumes with ``Last-Event-ID`` gets every event after that id that is
  still kept; when some were dropped (it was away too long, or it reads slower
  than events come), it first gets an ``EventsLost`` notice naming the missing
  id range (:class:`Gap`), so it knows to re-read ``GetState`` — never a silent
  hole.
- **A restarted stream is said so.** A ``Last-Event-ID`` above the newest id
  can only come from an earlier log (the shim restarted); the client gets an
  ``EventsLost`` notice with ``restarted: true`` and then everything kept.
- **Ids are the log's, not the daemon's.** The shim's log starts at 1 when the
  shim starts; the ``EventsLost`` notice carries no ``id:`` line, so a client's
  resume point stays on the last real event.
- Data fields are the signal's argument names, as in the XML.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from uapplace.bus.util import bus_daemon_message
from uapplace.core.model import iso
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

DEFAULT_CAPACITY = 1000
GAP_EVENT = "EventsLost"
SSE_RETRY_MS = 2000
"""What the stream tells an EventSource to wait before reconnecting."""


class EventKind(StrEnum):
    PARKED = "Parked"
    RESOLVED = "Resolved"
    RESIDENT_CHANGED = "ResidentChanged"
    ENFORCEMENT_STEP = "EnforcementStep"
    ALERT_RAISED = "AlertRaised"


SIGNAL_FIELDS: Mapping[EventKind, tuple[str, ...]] = {
    EventKind.PARKED: ("placement_id", "model", "client", "reason"),
    EventKind.RESOLVED: ("placement_id", "outcome"),
    EventKind.RESIDENT_CHANGED: ("model", "config", "device", "state"),
    EventKind.ENFORCEMENT_STEP: ("run_id", "step", "ok", "detail"),
    EventKind.ALERT_RAISED: ("alert_id", "kind", "severity", "subject", "message"),
}
"""Each signal's arguments by name, in the XML's order."""


class EventError(ValueError):
    """A signal or a ``Last-Event-ID`` that cannot become an event or a resume point."""


@dataclass(frozen=True)
class Event:
    """One signal, numbered."""

    id: int
    kind: EventKind
    at: float
    """POSIX seconds when the log took it in."""
    data: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "event": self.kind.value,
            "at": iso(self.at),
            "data": dict(self.data),
        }


@dataclass(frozen=True)
class Gap:
    """Events the reader will not see: ids ``first``..``last`` were dropped, or the
    stream restarted (``restarted``: the reader's id came from an earlier log)."""

    first: int
    last: int
    restarted: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "event": GAP_EVENT,
            "data": {"first": self.first, "last": self.last, "restarted": self.restarted},
        }


def signal_data(kind: EventKind, args: Sequence[Any]) -> dict[str, Any]:
    """A signal's arguments as the event's data; :class:`EventError` on a wrong count."""
    names = SIGNAL_FIELDS[kind]
    if len(args) != len(names):
        raise EventError(f"{kind.value}: {len(args)} arguments, the signal has {len(names)}")
    return dict(zip(names, args, strict=True))


class EventLog:
    """A bounded ring of events with growing ids, and the readers that follow it.

    Lives on one event loop; :meth:`publish` is synchronous (a signal handler
    calls it) and wakes every reader of :meth:`follow`.
    """

    def __init__(
        self, capacity: int = DEFAULT_CAPACITY, clock: Callable[[], float] = time.time
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity {capacity}: an event log keeps at least one event")
        self.capacity = capacity
        self.clock = clock
        self._events: deque[Event] = deque(maxlen=capacity)
        self._last_id = 0
        self._changed = asyncio.Event()
        self._closed = False

    @property
    def last_id(self) -> int:
        """The newest id given out (0: none yet)."""
        return self._last_id

    def publish(self, kind: EventKind, data: Mapping[str, Any]) -> Event:
        """Number ``data`` as the next event, keep it, wake the readers."""
        self._last_id += 1
        event = Event(self._last_id, kind, self.clock(), dict(data))
        self._events.append(event)
        self._wake()
        return event

    def publish_signal(self, name: str, args: Sequence[Any]) -> Event:
        """A bus signal by name and arguments; :class:`EventError` for an unknown one."""
        try:
            kind = EventKind(name)
        except ValueError:
            raise EventError(f"{name!r} is not a placement signal") from None
        return self.publish(kind, signal_data(kind, args))

    def since(self, last_id: int | None) -> tuple[Gap | None, list[Event]]:
        """What a reader that has seen up to ``last_id`` is missing (``None``: a new
        reader, which gets only what comes next)."""
        if last_id is None:
            return None, []
        kept = list(self._events)
        oldest = kept[0].id if kept else self._last_id + 1
        if last_id > self._last_id:
            return Gap(1, oldest - 1, restarted=True), kept
        gap = Gap(last_id + 1, oldest - 1) if last_id + 1 < oldest else None
        return gap, [event for event in kept if event.id > last_id]

    async def follow(
        self, last_id: int | None = None, idle_s: float | None = None
    ) -> AsyncIterator[Event | Gap | None]:
        """Every event after ``last_id`` (see :meth:`since`), then each new one as it
        comes, until :meth:`close` (what was published before it is still delivered).
        A reader slower than the ring gets a :class:`Gap`. With ``idle_s``, ``None``
        comes after each ``idle_s`` without events (an SSE keepalive's moment);
        without it, never."""
        seen = self._last_id if last_id is None else last_id
        if last_id is not None:
            gap, backlog = self.since(last_id)
            if gap is not None:
                yield gap
            for event in backlog:
                yield event
                seen = event.id
            seen = min(seen, self._last_id)  # a restarted reader is now at this log's head
        while True:
            waiter = self._changed
            gap, fresh = self.since(seen)
            if gap is not None:
                yield gap
            for event in fresh:
                yield event
                seen = event.id
            if fresh or gap is not None:
                continue
            if self._closed:
                return
            if idle_s is None:
                await waiter.wait()
                continue
            try:
                await asyncio.wait_for(waiter.wait(), idle_s)
            except TimeoutError:
                yield None

    def close(self) -> None:
        """End every :meth:`follow` (shutdown)."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


# --------------------------------------------------------------------------- the bus side

SIGNAL_MATCH_RULE = (
    f"type='signal',sender='{BUS_NAME}',path='{OBJECT_PATH}',interface='{INTERFACE}'"
)


class SignalRelay:
    """Feeds an :class:`EventLog` from the daemon's signals on one bus connection.

    :meth:`attach` after every (re)connect: the match rule lives and dies with
    the connection. A signal whose arguments do not fit (a newer daemon with
    another signature) is skipped, never allowed to break the stream.
    """

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.skipped = 0

    def on_message(self, message: Message) -> None:
        if (
            message.message_type is not MessageType.SIGNAL
            or message.interface != INTERFACE
            or message.path != OBJECT_PATH
        ):
            return
        try:
            kind = EventKind(message.member or "")
        except ValueError:
            return
        try:
            self.log.publish(kind, signal_data(kind, list(message.body)))
        except EventError:
            self.skipped += 1

    async def attach(self, bus: MessageBus) -> None:
        """Subscribe on ``bus``; :class:`EventError` when the bus refuses the match rule."""
        bus.add_message_handler(self.on_message)
        reply = await bus.call(bus_daemon_message("AddMatch", "s", [SIGNAL_MATCH_RULE]))
        if reply is None or reply.message_type is MessageType.ERROR:
            bus.remove_message_handler(self.on_message)
            raise EventError(f"the bus refused the signal subscription: {reply and reply.body}")

    def detach(self, bus: MessageBus) -> None:
        bus.remove_message_handler(self.on_message)


# --------------------------------------------------------------------------- wire formats


def parse_last_event_id(value: str | None) -> int | None:
    """The ``Last-Event-ID`` header as an id; ``None`` when absent or empty.
    :class:`EventError` naming the header for anything but a non-negative integer."""
    if value is None or not value.strip():
        return None
    text = value.strip()
    if not text.isdigit() or len(text) > 18:
        raise EventError(f"Last-Event-ID {value[:40]!r}: not an event id (a non-negative integer)")
    return int(text)


def _data_line(payload: Mapping[str, Any]) -> str:
    # Compact JSON has no newline, so one data: line carries it whole.
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def format_sse(item: Event | Gap) -> bytes:
    """One SSE message: ``id``/``event``/``data`` for an event; no ``id`` for a gap
    (the reader's resume point stays on its last real event)."""
    if isinstance(item, Gap):
        return f"event: {GAP_EVENT}\ndata: {_data_line(item.to_json()['data'])}\n\n".encode()
    body = _data_line(item.to_json())
    return f"id: {item.id}\nevent: {item.kind.value}\ndata: {body}\n\n".encode()


def sse_preamble(retry_ms: int = SSE_RETRY_MS) -> bytes:
    """The stream's first bytes: the reconnect delay, and a comment so proxies flush."""
    return f"retry: {retry_ms}\n: uapplace placement events\n\n".encode()


def sse_keepalive() -> bytes:
    """A comment line; keeps idle connections (and the proxies between) open."""
    return b": keepalive\n\n"


def json_line(item: Event | Gap) -> str:
    """What ``uapplace watch --json`` prints for one item (no trailing newline)."""
    return _data_line(item.to_json())


@dataclass(frozen=True)
class SseMessage:
    """One parsed SSE message (for clients and tests)."""

    event: str
    data: str
    id: str | None


def parse_sse(text: str) -> list[SseMessage]:
    """Complete messages in ``text`` (comments and ``retry:`` skipped); a trailing
    partial message is left out."""
    messages: list[SseMessage] = []
    for block in text.split("\n\n")[:-1]:
        fields: dict[str, list[str]] = {}
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            name, _, value = line.partition(":")
            fields.setdefault(name, []).append(value.removeprefix(" "))
        if "data" not in fields:
            continue
        event = fields.get("event", ["message"])[-1]
        ident = fields["id"][-1] if "id" in fields else None
        messages.append(SseMessage(event, "\n".join(fields["data"]), ident))
    return messages
