"""The event log behind ``GET /api/placement/events`` and ``uapplace watch --json``."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator

import pytest

from uapplace.bus.events import (
    GAP_EVENT,
    Event,
    EventError,
    EventKind,
    EventLog,
    Gap,
    format_sse,
    json_line,
    parse_last_event_id,
    parse_sse,
    signal_data,
    sse_keepalive,
    sse_preamble,
)


def log_with(count: int, capacity: int = 10) -> EventLog:
    log = EventLog(capacity, clock=lambda: 1_790_000_000.0)
    for index in range(count):
        log.publish_signal("Resolved", [f"plc-{index:06x}", "applied"])
    return log


async def take(log: EventLog, count: int, last_id: int | None) -> list[Event | Gap]:
    """The first ``count`` items a reader resuming at ``last_id`` gets."""
    items: list[Event | Gap] = []
    async with asyncio.timeout(10):
        async for item in log.follow(last_id):
            assert item is not None, "without idle_s, follow never yields a keepalive"
            items.append(item)
            if len(items) == count:
                break
    return items


def ids(items: list[Event | Gap]) -> list[int | str]:
    return [item.id if isinstance(item, Event) else GAP_EVENT for item in items]


def test_signals_become_numbered_events_with_named_fields() -> None:
    log = EventLog(clock=lambda: 1_790_000_000.0)
    parked = log.publish_signal("Parked", ["plc-00000a", "beta", "cli", "not_resident"])
    step = log.publish_signal("EnforcementStep", ["run-1", "drain", True, "idle"])
    assert (parked.id, step.id, log.last_id) == (1, 2, 2)
    assert parked.to_json() == {
        "id": 1,
        "event": "Parked",
        "at": "2026-09-21T14:13:20Z",
        "data": {
            "placement_id": "plc-00000a",
            "model": "beta",
            "client": "cli",
            "reason": "not_resident",
        },
    }
    assert step.data == {"run_id": "run-1", "step": "drain", "ok": True, "detail": "idle"}


def test_unknown_signals_and_wrong_arity_are_refused_by_name() -> None:
    log = EventLog()
    with pytest.raises(EventError, match="'Nope' is not a placement signal"):
        log.publish_signal("Nope", [])
    with pytest.raises(EventError, match="Resolved: 1 arguments, the signal has 2"):
        signal_data(EventKind.RESOLVED, ["plc-000001"])
    assert log.last_id == 0
    with pytest.raises(ValueError, match="capacity 0"):
        EventLog(0)


def test_since_replays_after_the_id_and_names_what_the_ring_dropped() -> None:
    log = log_with(15, capacity=10)  # ids 6..15 kept
    gap, events = log.since(12)
    assert gap is None and [e.id for e in events] == [13, 14, 15]
    gap, events = log.since(3)
    assert gap == Gap(4, 5) and [e.id for e in events] == list(range(6, 16))
    gap, events = log.since(5)
    assert gap is None and len(events) == 10
    assert log.since(None) == (None, [])


def test_an_id_from_an_earlier_log_is_a_restart() -> None:
    log = log_with(3)
    gap, events = log.since(40)
    assert gap == Gap(1, 0, restarted=True)
    assert [e.id for e in events] == [1, 2, 3]


async def test_a_new_reader_gets_only_what_comes_next() -> None:
    log = log_with(3)
    reader = asyncio.ensure_future(take(log, 2, None))
    await asyncio.sleep(0)
    log.publish_signal("Resolved", ["plc-00000f", "dismissed"])
    log.publish_signal("ResidentChanged", ["m", "c", "gpu0", "hot"])
    assert ids(await reader) == [4, 5]


async def test_resume_after_a_reconnect_loses_nothing() -> None:
    log = EventLog()
    first = asyncio.ensure_future(take(log, 2, None))
    await asyncio.sleep(0)
    for step in ("drain", "stop", "start"):
        log.publish_signal("EnforcementStep", ["run-1", step, True, ""])
    seen = await first  # disconnects after two
    log.publish_signal("Resolved", ["plc-000001", "applied"])
    last = seen[-1]
    assert isinstance(last, Event)
    resumed = await take(log, 2, last.id)
    assert ids(seen) + ids(resumed) == [1, 2, 3, 4]
    assert [e.kind for e in resumed if isinstance(e, Event)] == [
        EventKind.ENFORCEMENT_STEP,
        EventKind.RESOLVED,
    ]


async def test_a_reader_resuming_past_the_ring_gets_a_gap_first() -> None:
    log = log_with(15, capacity=10)
    items = await take(log, 3, 2)
    assert items[0] == Gap(3, 5)
    assert ids(items[1:]) == [6, 7]


async def test_a_restarted_reader_gets_the_notice_then_everything_then_new_events() -> None:
    log = log_with(2)
    reader = asyncio.ensure_future(take(log, 4, 99))
    await asyncio.sleep(0)
    log.publish_signal("Resolved", ["plc-000009", "expired"])
    items = await reader
    assert items[0] == Gap(1, 0, restarted=True)
    assert ids(items[1:]) == [1, 2, 3]


async def test_a_slow_reader_is_told_what_it_missed() -> None:
    log = EventLog(capacity=3)
    reader = log.follow(0)
    log.publish_signal("Resolved", ["plc-000001", "applied"])
    first = await anext(reader)
    assert isinstance(first, Event) and first.id == 1
    for index in range(2, 8):
        log.publish_signal("Resolved", [f"plc-{index:06x}", "applied"])
    assert await anext(reader) == Gap(2, 4)
    assert [(await anext(reader)).id for _ in range(3)] == [5, 6, 7]  # type: ignore[union-attr]
    assert isinstance(reader, AsyncGenerator)  # follow is one; the narrowing lets us close it
    await reader.aclose()


async def test_close_ends_every_reader() -> None:
    log = EventLog()
    reader = asyncio.ensure_future(take(log, 5, None))
    await asyncio.sleep(0)
    log.publish_signal("Resolved", ["plc-000001", "applied"])
    log.close()
    assert ids(await reader) == [1]


def test_sse_wire_format_round_trips() -> None:
    log = log_with(0)
    event = log.publish_signal(
        "AlertRaised", ["a-1", "token_mismatch", "critical", "proxy", "line one\nline two"]
    )
    stream = (
        sse_preamble().decode()
        + format_sse(event).decode()
        + sse_keepalive().decode()
        + format_sse(Gap(4, 9)).decode()
        + "id: 9\nevent: Partial\ndata: {"
    )
    assert stream.startswith("retry: 2000\n")
    messages = parse_sse(stream)
    assert [(m.event, m.id) for m in messages] == [("AlertRaised", "1"), (GAP_EVENT, None)]
    assert json.loads(messages[0].data) == event.to_json()
    assert json.loads(messages[0].data)["data"]["message"] == "line one\nline two"
    assert json.loads(messages[1].data) == {"first": 4, "last": 9, "restarted": False}
    assert json.loads(json_line(event)) == event.to_json()
    assert "\n" not in json_line(event)


@pytest.mark.parametrize(("header", "expected"), [(None, None), ("", None), (" 42 ", 42)])
def test_last_event_id_header(header: str | None, expected: int | None) -> None:
    assert parse_last_event_id(header) == expected


@pytest.mark.parametrize("header", ["-1", "abc", "1.5", "9" * 19])
def test_bad_last_event_id_names_the_header(header: str) -> None:
    with pytest.raises(EventError, match="Last-Event-ID"):
        parse_last_event_id(header)
