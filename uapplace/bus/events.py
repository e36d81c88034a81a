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
- **One queue per subscriber, bounded** (:meth:`EventLog.subscribe`, the shim's SSE
  streams; docs/http-contract.md §5, "Events"). Each publish appends the event to every
  subscriber's queue (O(1) each, the event's SSE bytes encoded once and shared); a
  subscriber whose queue holds ``capacity`` unread events is a slow reader: it is
  dropped at once (its queue freed, never grown), and its stream ends with a
  ``StreamClosed`` event saying why, so it can resume with ``Last-Event-ID``. No reader
  can make a publish wait or cost more than an append.
"""

from __future__ import annotations

import asyncio
import functools
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
from uapplace.core.conventions import iso
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH

DEFAULT_CAPACITY = 1000
GAP_EVENT = "EventsLost"
CLOSED_EVENT = "StreamClosed"
"""The last event of a stream the shim ends: ``{"reason", "message", "last_id"}``."""
DEFAULT_SUBSCRIBER_QUEUE = 512
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

    @functools.cached_property
    def sse(self) -> bytes:
        """The SSE message (:func:`format_sse`), encoded once for every subscriber."""
        body = _data_line(self.to_json())
        return f"id: {self.id}\nevent: {self.kind.value}\ndata: {body}\n\n".encode()


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


class Subscription:
    """One subscriber's queue of events it has not read yet, at most ``capacity`` deep
    beyond the backlog it started with (:meth:`EventLog.subscribe`).

    :meth:`take` hands over everything queued at once (one write per batch); once the
    subscriber is dropped (:attr:`dropped` says why) or the log closes, it returns
    ``None``."""

    def __init__(self, capacity: int, backlog: Sequence[Event | Gap]) -> None:
        if capacity < 1:
            raise ValueError(f"capacity {capacity}: a subscriber queues at least one event")
        self.capacity = capacity
        self._queue: deque[Event | Gap] = deque(backlog)
        self._limit = capacity + len(backlog)
        self._ready = asyncio.Event()
        if backlog:
            self._ready.set()
        self.dropped: str | None = None
        """Why this subscriber was dropped (a slow reader), ``None`` while it is not."""
        self.closed = False
        self.delivered_id = 0
        """The id of the newest event :meth:`take` handed over."""

    @property
    def ended(self) -> bool:
        return self.closed or self.dropped is not None

    @property
    def queued(self) -> int:
        return len(self._queue)

    def offer(self, event: Event) -> bool:
        """Queue ``event``; ``False`` (and dropped) when the queue is already full."""
        if self.ended:
            return False
        if len(self._queue) >= self._limit:
            self.drop(
                f"slow reader: {len(self._queue)} events were waiting unread (the limit is "
                f"{self.capacity})"
            )
            return False
        self._queue.append(event)
        self._ready.set()
        return True

    def drop(self, why: str) -> None:
        """End this subscription (its queue is freed at once)."""
        if self.dropped is None:
            self.dropped = why
        self._queue.clear()
        self._ready.set()

    def close(self) -> None:
        self.closed = True
        self._ready.set()

    async def take(self, idle_s: float | None = None) -> list[Event | Gap] | None:
        """Everything queued (waiting for something first); ``[]`` after ``idle_s`` with
        nothing (a keepalive's moment); ``None`` once dropped or closed."""
        if not self._queue and not self.ended:
            self._ready.clear()
            try:  # asyncio.timeout, not wait_for: cpython gh-86296 loses cancels on 3.11
                async with asyncio.timeout(idle_s):
                    await self._ready.wait()
            except TimeoutError:
                return []
        if self.dropped is not None or (self.closed and not self._queue):
            return None
        batch = list(self._queue)
        self._queue.clear()
        self._limit = self.capacity
        for item in reversed(batch):
            if isinstance(item, Event):
                self.delivered_id = item.id
                break
        return batch


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
        self._subscribers: set[Subscription] = set()
        self.dropped_subscribers = 0
        """Subscribers dropped as slow readers since the log began."""

    @property
    def last_id(self) -> int:
        """The newest id given out (0: none yet)."""
        return self._last_id

    def publish(self, kind: EventKind, data: Mapping[str, Any]) -> Event:
        """Number ``data`` as the next event, keep it, wake the readers."""
        self._last_id += 1
        event = Event(self._last_id, kind, self.clock(), dict(data))
        self._events.append(event)
        if self._subscribers:
            slow = [sub for sub in self._subscribers if not sub.offer(event)]
            self._subscribers.difference_update(slow)
            self.dropped_subscribers += len(slow)
        self._wake()
        return event

    def subscribe(
        self, last_id: int | None = None, capacity: int = DEFAULT_SUBSCRIBER_QUEUE
    ) -> Subscription:
        """A bounded queue of every event after ``last_id`` (:meth:`since`: a gap first when
        some are gone) and each new one; :meth:`unsubscribe` it when done."""
        gap, backlog = self.since(last_id)
        items: list[Event | Gap] = [gap] if gap is not None else []
        subscription = Subscription(capacity, [*items, *backlog])
        if self._closed:
            subscription.close()
        else:
            self._subscribers.add(subscription)
        return subscription

    def unsubscribe(self, subscription: Subscription) -> None:
        self._subscribers.discard(subscription)

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

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
        oldest = self._events[0].id if self._events else self._last_id + 1
        if last_id > self._last_id:
            return Gap(1, oldest - 1, restarted=True), list(self._events)
        gap = Gap(last_id + 1, oldest - 1) if last_id + 1 < oldest else None
        # Ids are consecutive: the newest ``fresh`` events, read from the right end
        # (a reader that is up to date costs nothing, whatever the ring holds).
        fresh = min(self._last_id - last_id, len(self._events))
        return gap, [self._events[index] for index in range(-fresh, 0)]

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
            try:  # not wait_for: cpython gh-86296
                async with asyncio.timeout(idle_s):
                    await waiter.wait()
            except TimeoutError:
                yield None

    def close(self) -> None:
        """End every :meth:`follow` and subscription (shutdown)."""
        self._closed = True
        for subscription in self._subscribers:
            subscription.close()
        self._subscribers.clear()
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
    return item.sse


def format_closed(reason: str, message: str, last_id: int) -> bytes:
    """The :data:`CLOSED_EVENT` that ends a stream: ``reason`` (``slow_reader``,
    ``shutdown``), what happened, and ``last_id``, the newest event delivered (resume
    with ``Last-Event-ID``). No ``id:`` line, as for a gap."""
    data = {"reason": reason, "message": message, "last_id": last_id}
    return f"event: {CLOSED_EVENT}\ndata: {_data_line(data)}\n\n".encode()


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
