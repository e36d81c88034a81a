"""Desktop notifications: texts (pure) and the bubble life cycle against python-dbusmock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

from tests.bus import dbusmock_fixtures
from tests.bus.dbusmock_fixtures import MockService, spawn_template
from tests.worlds.builders import parked
from uapplace.bus.util import bus_daemon_message
from uapplace.core.model import (
    Holder,
    Option,
    OptionKind,
    PendingEntry,
    Plan,
    PreviewReason,
    ResidentState,
    Victim,
)
from uapplace.daemon.notify import (
    URGENCY_CRITICAL,
    URGENCY_NORMAL,
    Bubble,
    Notifier,
    Shown,
    action_label,
    body_text,
    expire_timeout_ms,
    render,
    summary_text,
    urgency,
)

session_bus = dbusmock_fixtures.session_bus
notification_daemon = dbusmock_fixtures.notification_daemon

MODEL = "qwen3.8-27b"
NOW = 1_800_000_000.0
WAIT_S = 10.0
T = TypeVar("T")


def victim(
    model: str = "qwen3.8-flash-next",
    holders: tuple[Holder, ...] = (
        Holder("claude-code", "inflight"),
        Holder("opencode", "hold"),
    ),
    in_flight: bool | None = True,
    frees_mib: float = 21812.4,
    state: ResidentState = ResidentState.HOT,
) -> Victim:
    return Victim(
        model=model,
        config="q4-mtp",
        state=state,
        device="gpu0",
        holders=holders,
        in_flight=in_flight,
        frees_mib=frees_mib,
        consequence="active generation aborted; context lost",
    )


def displace(*victims: Victim) -> Option:
    return Option(OptionKind.DISPLACE, MODEL, "llama-mtp", "gpu0", 20480.0, victims or (victim(),))


def alongside() -> Option:
    return Option(OptionKind.LOAD_ALONGSIDE, MODEL, "llama-mtp", "gpu1", 12345.6)


def plan(*options: Option, reason: PreviewReason = PreviewReason.OK) -> Plan:
    return Plan(MODEL, reason, options)


def entry(
    placement_id: str = "p-1", client: str = "claude-code", model: str = MODEL
) -> PendingEntry:
    return parked(
        model, id=placement_id, client=client, session="s", created_at=NOW, expires_at=NOW + 600
    )


# --------------------------------------------------------------------------- texts


def test_summary_names_model_and_clients() -> None:
    assert summary_text(MODEL, ["claude-code"]) == f"{MODEL} requested by claude-code"
    assert summary_text(MODEL, ["a", "b", "a"]) == f"{MODEL} requested by a and b"
    assert summary_text(MODEL, ["a", "b", "c"]) == f"{MODEL} requested by a and 2 others"
    assert summary_text(MODEL, []) == f"{MODEL} requested"


def test_body_names_recommended_option_and_its_impact() -> None:
    assert body_text(plan(displace(), alongside())) == (
        f"Recommended: load {MODEL}/llama-mtp on gpu0 — stops qwen3.8-flash-next: 2 clients, "
        "1 generation in flight, frees 21,812 MiB\n"
        "Approval signature: qwen3.8-flash-next/q4-mtp\n"
        "1 other option: `uapplace pending`"
    )


def test_body_for_several_victims_states_each() -> None:
    idle = victim("small", holders=(), in_flight=False, frees_mib=1000)
    unknown = victim("warm", holders=(), in_flight=None, state=ResidentState.WARMING)
    text = body_text(plan(displace(idle, unknown)))
    assert "stops small: no clients, nothing in flight; " in text
    assert "warm (warming): no clients, in-flight work unknown, frees 22,812 MiB" in text
    assert "Approval signature: qwen3.8-flash-next/q4-mtp" not in text
    assert "Approval signature: small/q4-mtp, warm/q4-mtp" in text


def test_body_says_nothing_is_stopped_without_victims() -> None:
    assert body_text(plan(alongside())) == (
        f"Recommended: load {MODEL}/llama-mtp on gpu1 alongside — nothing is stopped, "
        "needs 12,346 MiB"
    )
    reuse = Option(OptionKind.REUSE, MODEL, "llama-mtp", "gpu0", 0.0)
    assert body_text(plan(reuse)).endswith("already loaded — nothing is stopped")


def test_body_without_options_says_why() -> None:
    assert "is in no registry file" in body_text(plan(reason=PreviewReason.NOT_IN_REGISTRY))
    assert "uapplace measure" in body_text(plan(reason=PreviewReason.NO_MEASURED_CONFIG))
    why = ("gpu0: 4,000 MiB short", "gpu1: 100 MiB short", "cpu0: not a gpu", "gpu2: gone")
    text = body_text(Plan(MODEL, PreviewReason.NO_FEASIBLE_OPTION, (), why))
    assert text == (
        "No option: nothing fits (gpu0: 4,000 MiB short; gpu1: 100 MiB short; "
        "cpu0: not a gpu (+1 more))"
    )


def test_labels_and_urgency() -> None:
    assert action_label(displace()) == "Stop qwen3.8-flash-next and load"
    assert action_label(alongside()) == "Load on gpu1"
    assert urgency(displace()) == URGENCY_CRITICAL
    assert urgency(displace(victim(in_flight=None))) == URGENCY_CRITICAL
    assert urgency(displace(victim(in_flight=False))) == URGENCY_NORMAL
    assert urgency(alongside()) == URGENCY_NORMAL
    assert urgency(None) == URGENCY_NORMAL


def test_expire_timeout_follows_the_entry() -> None:
    assert expire_timeout_ms(NOW + 600, NOW) == 600_000
    assert expire_timeout_ms(NOW - 5, NOW) == 5_000


def test_render_escapes_markup_only_for_markup_servers() -> None:
    bubble = Bubble(MODEL)
    odd = Plan("a<b", PreviewReason.NOT_IN_REGISTRY)
    bubble.shown["p-1"] = Shown(entry(), odd, ("claude-code",))
    assert "a&lt;b" in render(bubble, markup=True, now=NOW).body
    assert "a<b" in render(bubble, markup=False, now=NOW).body


# --------------------------------------------------------------------------- bus


@dataclass
class Clicks:
    applied: asyncio.Queue[tuple[str, int, tuple[str, ...]]] = field(default_factory=asyncio.Queue)
    dismissed: asyncio.Queue[str] = field(default_factory=asyncio.Queue)

    async def on_apply(self, placement_id: str, option: int, signature: tuple[str, ...]) -> None:
        await self.applied.put((placement_id, option, signature))

    async def on_dismiss(self, placement_id: str) -> None:
        await self.dismissed.put(placement_id)


@pytest.fixture
def clicks() -> Clicks:
    return Clicks()


@pytest.fixture
async def notifier(session_bus: str, clicks: Clicks) -> AsyncIterator[Notifier]:
    notifier = Notifier(session_bus, clicks.on_apply, clicks.on_dismiss, recheck_after=0)
    await notifier.start()
    yield notifier
    await notifier.stop()


async def until(condition: Callable[[], bool], what: str) -> None:
    """Wait for an effect of a signal the notifier handles on its own schedule."""
    async with asyncio.timeout(WAIT_S):
        while not condition():  # noqa: ASYNC110 (set by a bus signal handler, no event to await)
            await asyncio.sleep(0.01)


async def next_item(queue: asyncio.Queue[T]) -> T:
    async with asyncio.timeout(WAIT_S):
        return await queue.get()


def notify_calls(mock: MockService) -> list[list[Any]]:
    return mock.calls("Notify")


@pytest.mark.bus
async def test_park_shows_one_bubble_with_actions_and_texts(
    notification_daemon: MockService, notifier: Notifier
) -> None:
    await notifier.parked(entry(), plan(displace(), alongside()), ["claude-code"])

    (call,) = notify_calls(notification_daemon)
    app, replaces, icon, summary, body, actions, hints, expire = call
    assert (app, replaces, icon) == ("uapplace", 0, "")
    assert summary == f"{MODEL} requested by claude-code"
    assert body == body_text(plan(displace(), alongside()))
    assert actions == [
        "apply:p-1:1",
        "Stop qwen3.8-flash-next and load",
        "dismiss:p-1",
        "Dismiss",
    ]
    assert hints == {"urgency": URGENCY_CRITICAL, "desktop-entry": "uapplace", "resident": False}
    assert isinstance(expire, int) and expire > 0
    assert notifier.notification_id(MODEL) == 1


@pytest.mark.bus
async def test_more_parks_for_a_model_update_its_bubble(
    notification_daemon: MockService, notifier: Notifier
) -> None:
    await notifier.parked(entry(), plan(alongside()), ["claude-code"])
    await notifier.parked(entry(), plan(alongside()), ["opencode"])
    await notifier.parked(entry("p-2", "aider"), plan(alongside()), ["aider"])
    await notifier.parked(entry("p-3", model="other"), Plan("other", PreviewReason.OK), ["x"])

    calls = notify_calls(notification_daemon)
    assert [call[1] for call in calls] == [0, 1, 1, 0]
    assert [call[3] for call in calls] == [
        f"{MODEL} requested by claude-code",
        f"{MODEL} requested by claude-code and opencode",
        f"{MODEL} requested by claude-code and 2 others",
        "other requested by x",
    ]
    assert calls[2][5][0] == "apply:p-2:1"
    assert calls[3][5] == ["dismiss:p-3", "Dismiss"]
    assert calls[0][6]["urgency"] == URGENCY_NORMAL


@pytest.mark.bus
async def test_apply_click_hands_over_the_signature_shown(
    notification_daemon: MockService, notifier: Notifier, clicks: Clicks, session_bus: str
) -> None:
    await notifier.parked(entry(), plan(displace()), ["claude-code"])
    await notifier.parked(entry("p-2", "other-client"), plan(displace()), ["other-client"])
    notification_id = notifier.notification_id(MODEL)

    notification_daemon.emit("ActionInvoked", "us", 77, "apply:p-2:1")  # not our bubble
    notification_daemon.emit("ActionInvoked", "us", notification_id, "apply:p-1:1")  # replaced
    notification_daemon.emit("ActionInvoked", "us", notification_id, "apply:p-2:2")  # not shown
    await forge_action(session_bus, notification_id, "apply:p-2:1")
    notification_daemon.emit("ActionInvoked", "us", notification_id, "apply:p-2:1")

    assert await next_item(clicks.applied) == ("p-2", 1, ("qwen3.8-flash-next/q4-mtp",))
    assert clicks.applied.empty()


async def forge_action(address: str, notification_id: int | None, key: str) -> None:
    """The signal a notification daemon sends, from a connection that is not one."""
    bus = await MessageBus(bus_address=address).connect()
    try:
        await bus.send(
            Message.new_signal(
                "/org/freedesktop/Notifications",
                "org.freedesktop.Notifications",
                "ActionInvoked",
                "us",
                [notification_id or 0, key],
            )
        )
        reply = await bus.call(bus_daemon_message("GetId"))
        assert reply is not None and reply.message_type is MessageType.METHOD_RETURN
    finally:
        bus.disconnect()


@pytest.mark.bus
async def test_dismiss_click_dismisses_that_entry(
    notification_daemon: MockService, notifier: Notifier, clicks: Clicks
) -> None:
    await notifier.parked(entry(), plan(), ["claude-code"])
    notification_daemon.emit("ActionInvoked", "us", notifier.notification_id(MODEL), "dismiss:p-1")
    assert await next_item(clicks.dismissed) == "p-1"


@pytest.mark.bus
async def test_resolved_closes_the_bubble_once_no_entry_shows(
    notification_daemon: MockService, notifier: Notifier
) -> None:
    await notifier.parked(entry(), plan(displace()), ["claude-code"])
    await notifier.parked(entry("p-2", "aider"), plan(alongside()), ["aider"])

    await notifier.resolved("p-2", "dismissed")
    assert notification_daemon.calls("CloseNotification") == []
    last = notify_calls(notification_daemon)[-1]
    assert last[1] == 1
    assert last[3] == f"{MODEL} requested by claude-code"
    assert last[5][0] == "apply:p-1:1"

    await notifier.resolved("p-1", "dismissed")
    assert notification_daemon.calls("CloseNotification") == [[1]]
    assert notifier.notification_id(MODEL) is None

    await notifier.parked(entry("p-4"), plan(), ["claude-code"])
    assert notify_calls(notification_daemon)[-1][1] == 0


@pytest.mark.bus
async def test_an_applied_entry_closes_the_whole_bubble_at_once(
    notification_daemon: MockService, notifier: Notifier
) -> None:
    await notifier.parked(entry(), plan(displace()), ["claude-code"])
    await notifier.parked(entry("p-2", "aider"), plan(displace()), ["aider"])
    shown = len(notify_calls(notification_daemon))

    await notifier.resolved("p-2", "applied")
    assert notification_daemon.calls("CloseNotification") == [[1]]
    assert len(notify_calls(notification_daemon)) == shown  # no redraw with a stale button
    assert notifier.notification_id(MODEL) is None


@pytest.mark.bus
async def test_a_closed_bubble_is_forgotten(
    notification_daemon: MockService, notifier: Notifier
) -> None:
    await notifier.parked(entry(), plan(), ["claude-code"])
    notification_daemon.emit("NotificationClosed", "uu", 1, 2)
    await until(lambda: notifier.notification_id(MODEL) is None, "bubble forgotten")

    await notifier.parked(entry(), plan(), ["claude-code"])
    assert [call[1] for call in notify_calls(notification_daemon)] == [0, 0]


@pytest.mark.bus
async def test_a_new_notification_daemon_gets_new_bubbles(
    notification_daemon: MockService,
    notifier: Notifier,
    session_bus: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    await notifier.parked(entry(), plan(), ["claude-code"])
    notification_daemon.stop()
    replacement = spawn_template("notification_daemon", session_bus, tmp_path_factory.mktemp("n"))
    try:
        await until(lambda: notifier.notification_id(MODEL) is None, "old bubble dropped")
        await until(lambda: notifier.available, "new daemon seen")
        await notifier.parked(entry(), plan(), ["claude-code"])
        assert [call[1] for call in notify_calls(replacement)] == [0]
    finally:
        replacement.stop()


@pytest.mark.bus
async def test_without_a_daemon_nothing_fails_and_one_line_is_logged(
    session_bus: str,
    clicks: Clicks,
    caplog: pytest.LogCaptureFixture,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    caplog.set_level(logging.INFO, logger="uapplace.daemon.notify")
    notifier = Notifier(session_bus, clicks.on_apply, clicks.on_dismiss, recheck_after=0)
    try:
        await notifier.start()
        await notifier.parked(entry(), plan(displace()), ["claude-code"])
        await notifier.parked(entry(), plan(displace()), ["opencode"])
        await notifier.resolved("p-1", "expired")
        assert not notifier.available
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "desktop notifications off" in warnings[0].getMessage()

        mock = spawn_template("notification_daemon", session_bus, tmp_path_factory.mktemp("n"))
        try:
            await notifier.parked(entry(), plan(displace()), ["claude-code"])
            assert [call[1] for call in notify_calls(mock)] == [0]
        finally:
            mock.stop()
    finally:
        await notifier.stop()


@pytest.mark.bus
async def test_a_failing_callback_is_logged_and_later_clicks_still_work(
    notification_daemon: MockService, session_bus: str, caplog: pytest.LogCaptureFixture
) -> None:
    dismissed: asyncio.Queue[str] = asyncio.Queue()

    async def broken_apply(placement_id: str, option: int, signature: tuple[str, ...]) -> None:
        raise RuntimeError(f"apply {placement_id} blew up")

    async def on_dismiss(placement_id: str) -> None:
        await dismissed.put(placement_id)

    notifier = Notifier(session_bus, broken_apply, on_dismiss)
    try:
        await notifier.start()
        await notifier.parked(entry(), plan(alongside()), ["claude-code"])
        notification_daemon.emit("ActionInvoked", "us", 1, "apply:p-1:1")
        notification_daemon.emit("ActionInvoked", "us", 1, "dismiss:p-1")
        assert await next_item(dismissed) == "p-1"
        await until(lambda: any("apply:p-1:1" in r.getMessage() for r in caplog.records), "log")
        failure = next(r for r in caplog.records if "apply:p-1:1" in r.getMessage())
        assert failure.levelno == logging.ERROR and failure.exc_info is not None
    finally:
        await notifier.stop()


@pytest.mark.bus
@pytest.mark.parametrize(
    ("refusal", "short"),
    [
        ("victim set changed: approved [a/q4], now [b/q4]; look at the preview again", "Drifted"),
        ("another enforcement is running (run-1); retry when it has finished", "Busy"),
        ("org.uap.placement.apply: polkit denies it", "NotAuthorized"),
    ],
)
async def test_a_refused_click_is_answered_with_a_bubble_saying_why(
    notification_daemon: MockService, session_bus: str, refusal: str, short: str
) -> None:
    from uapplace.core import errors

    error_type: type[errors.PlacementFailure] = getattr(errors, short)

    async def refusing_apply(placement_id: str, option: int, signature: tuple[str, ...]) -> None:
        raise error_type(refusal)

    async def on_dismiss(placement_id: str) -> None:
        raise errors.NotFound(f"no pending placement {placement_id}")

    notifier = Notifier(session_bus, refusing_apply, on_dismiss)
    try:
        await notifier.start()
        await notifier.parked(entry(), plan(displace()), ["claude-code"])
        notification_daemon.emit("ActionInvoked", "us", 1, "apply:p-1:1")

        def answered() -> list[list[Any]]:
            return [
                c for c in notify_calls(notification_daemon) if c[3].startswith("uapplace: not")
            ]

        await until(lambda: bool(answered()), "a bubble answering the refused click")
        (call,) = answered()
        assert call[3] == f"uapplace: not applied ({short})"
        assert call[4] == refusal and call[5] == []  # says why; no buttons to click again
        notification_daemon.emit("ActionInvoked", "us", 1, "dismiss:p-1")
        await until(lambda: len(answered()) == 2, "a bubble answering the refused dismiss")
        assert answered()[1][3] == "uapplace: not dismissed (NotFound)"
    finally:
        await notifier.stop()


@pytest.mark.bus
async def test_an_alert_bubble_escapes_its_text_for_a_markup_server(
    notification_daemon: MockService, notifier: Notifier
) -> None:
    # The mock announces body-markup: an alert naming a client `<a href=…>` & co must
    # show those characters, not a link.
    await notifier.message("uapplace: alert", 'client <a href="http://x">agent</a> & more')
    await until(lambda: bool(notify_calls(notification_daemon)), "the alert bubble")
    (call,) = notify_calls(notification_daemon)
    assert call[4] == 'client &lt;a href="http://x"&gt;agent&lt;/a&gt; &amp; more'
