"""``apply``/``load``/``unload`` against a scripted client: impact, consent, the live steps.

No bus: :meth:`PlacementClient.connect` is replaced by a fake whose bus answers
``AddMatch`` and whose enforcement calls emit ``EnforcementStep`` signals the way
uapplaced does (a run already under way first, then ours from ``revalidate``).
The real commands against the real daemon are in ``tests/bus/test_cli.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner
from dbus_fast import Message, MessageType

from uapplace.bus.client import PlacementClient
from uapplace.cli import app as cli
from uapplace.cli.session import EXIT_NOT_FOUND, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE
from uapplace.files.paths import INTERFACE, OBJECT_PATH

Handler = Callable[[Message], None]

VICTIM = {
    "model": "beta",
    "config": "f16",
    "device": "gpu0",
    "state": "serving",
    "in_flight": False,
    "holders": [],
    "frees_mib": 8000,
    "consequence": "stops",
}
DISPLACE = {
    "kind": "displace",
    "model": "alpha",
    "config": "q4",
    "device": "gpu0",
    "cost_mib": 9000,
    "victims": [VICTIM],
    "frees_mib": 8000,
    "signature": ["beta/f16"],
}
LOAD = {"kind": "load", "model": "alpha", "config": "q2", "device": "gpu0", "cost_mib": 2000}
OK_RESULT = {"ok": True, "runId": "run-1", "steps": [{"name": "revalidate", "ok": True}]}


class FakeBus:
    """The little of dbus-fast's ``MessageBus`` the CLI uses; ``AddMatch`` may be refused."""

    connected = True

    def __init__(self, refuse_match: bool) -> None:
        self.handlers: list[Handler] = []
        self.refuse_match = refuse_match
        self.members: list[str] = []

    def add_message_handler(self, handler: Handler) -> None:
        self.handlers.append(handler)

    def remove_message_handler(self, handler: Handler) -> None:
        self.handlers.remove(handler)

    async def call(self, message: Message) -> Message:
        self.members.append(message.member or "")
        if self.refuse_match and message.member == "AddMatch":
            return Message(
                message_type=MessageType.ERROR,
                error_name="org.freedesktop.DBus.Error.AccessDenied",
                reply_serial=1,
                signature="s",
                body=["no"],
            )
        return Message(message_type=MessageType.METHOD_RETURN, reply_serial=1)

    def step(self, run_id: str, step: str, ok: bool, detail: str = "") -> None:
        signal = Message(
            message_type=MessageType.SIGNAL,
            path=OBJECT_PATH,
            interface=INTERFACE,
            member="EnforcementStep",
            signature="ssbs",
            body=[run_id, step, ok, detail],
        )
        for handler in list(self.handlers):
            handler(signal)

    def disconnect(self) -> None:
        pass


class FakeClient:
    """Scripted answers; ``sent`` records every enforcement call with its signature."""

    def __init__(self, options: list[dict[str, Any]], result: dict[str, Any], refuse: bool) -> None:
        self.bus = FakeBus(refuse)
        self.call_timeout: float | None = 30.0
        self.options = options
        self.result = result
        self.sent: list[tuple[str, str, list[str]]] = []

    def disconnect(self) -> None:
        pass

    async def list_pending(self) -> dict[str, Any]:
        entry = {"id": "plc-aaaaaa", "requested_model": "alpha", "client": "c1"}
        return {"pending": [dict(entry, options=self.options)]}

    async def preview(self, model: str, cells: int) -> dict[str, Any]:
        return {"model": model, "reason": "ok", "options": self.options, "infeasible": []}

    async def preview_unload(self, model: str) -> dict[str, Any]:
        return {"model": model, "victims": [VICTIM], "signature": ["beta/f16"], "frees_mib": 8000}

    async def _run(self, call: str, target: str, signature: list[str]) -> dict[str, Any]:
        self.sent.append((call, target, signature))
        if not signature:
            return self.result
        assert self.call_timeout is None  # a drain takes as long as it takes
        self.bus.step("run-0", "stop", True, "another run's step")
        self.bus.step("run-1", "revalidate", True)
        self.bus.step("run-1", "stop", True, "stopped beta")
        return self.result

    async def apply(self, placement_id: str, option: int, signature: list[str]) -> dict[str, Any]:
        return await self._run("apply", f"{placement_id}#{option}", signature)

    async def load(self, model: str, signature: list[str]) -> dict[str, Any]:
        return await self._run("load", model, signature)

    async def unload(self, model: str, signature: list[str]) -> dict[str, Any]:
        return await self._run("unload", model, signature)


def scripted(
    monkeypatch: pytest.MonkeyPatch,
    options: list[dict[str, Any]] | None = None,
    result: dict[str, Any] | None = None,
    refuse_match: bool = False,
) -> FakeClient:
    client = FakeClient(
        [DISPLACE, LOAD] if options is None else options, result or OK_RESULT, refuse_match
    )

    async def connect(address: str | None = None) -> FakeClient:
        return client

    monkeypatch.setattr(PlacementClient, "connect", connect)
    return client


def run(*args: str) -> Any:
    return CliRunner().invoke(cli.app, list(args))


def test_load_without_yes_shows_the_impact_and_stops_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = scripted(monkeypatch)
    done = run("load", "alpha")
    assert done.exit_code == EXIT_REFUSED
    assert "Load alpha: displace alpha/q4 on gpu0, costs 9,000 MiB." in done.stdout
    assert "beta/f16" in done.stdout and "Frees 8,000 MiB in total." in done.stdout
    assert "uapplace: not loaded (load alpha): nothing stopped; re-run with --yes" in done.stderr
    assert client.sent == []


def test_load_with_yes_sends_the_signature_shown_and_prints_its_own_steps_live(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = scripted(monkeypatch)
    done = run("load", "alpha", "--yes")
    assert done.exit_code == 0, done.output
    assert client.sent == [("load", "alpha", ["beta/f16"])]
    assert "AddMatch" in client.bus.members
    assert "ok revalidate" in done.stdout and "ok stop: stopped beta" in done.stdout
    assert "another run's step" not in done.stdout
    assert done.stdout.rstrip().endswith("load alpha: done")


def test_apply_asks_even_when_the_option_stops_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    client = scripted(monkeypatch)
    done = run("apply", "plc-aaaaaa", "2")
    assert done.exit_code == EXIT_REFUSED
    assert "option 2 = load alpha/q2 on gpu0" in done.stdout and "It stops nothing." in done.stdout
    assert "not applied (apply plc-aaaaaa option 2)" in done.stderr
    assert client.sent == []


def test_apply_out_of_range_and_unknown_ids_are_refused_before_anything_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = scripted(monkeypatch)
    out_of_range = run("apply", "plc-aaaaaa", "3", "--yes")
    assert out_of_range.exit_code == EXIT_USAGE
    assert "option 3 is out of range: placement plc-aaaaaa has options 1..2" in out_of_range.stderr
    unknown = run("apply", "plc-bbbbbb", "1", "--yes")
    assert unknown.exit_code == EXIT_NOT_FOUND
    assert client.sent == []


def test_a_failed_run_not_seen_live_prints_the_result_steps_and_exits_1(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failed = {
        "ok": False,
        "runId": "run-9",
        "steps": [{"name": "start", "ok": False, "detail": "unit failed"}],
        "rolledBack": True,
        "error": "start failed",
    }
    client = scripted(monkeypatch, result=failed)
    done = run("unload", "beta", "--yes")
    assert done.exit_code == EXIT_REFUSED
    assert client.sent == [("unload", "beta", ["beta/f16"])]
    assert "  start: FAILED: unit failed" in done.stdout
    assert "unload beta: failed" in done.stdout
    assert "rolled back to the previous residents" in done.stdout
    assert "error: start failed" in done.stdout


def test_load_with_no_option_takes_the_daemons_own_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    answer = {"ok": False, "steps": [], "error": "UnknownModel: zeta"}
    client = scripted(monkeypatch, options=[], result=answer)
    done = run("load", "zeta", "--json")
    assert done.exit_code == EXIT_REFUSED
    assert client.sent == [("load", "zeta", [])]
    assert "AddMatch" not in client.bus.members  # nothing to follow


def test_a_refused_subscription_sends_nothing_and_exits_3(monkeypatch: pytest.MonkeyPatch) -> None:
    client = scripted(monkeypatch, refuse_match=True)
    done = run("load", "alpha", "--yes")
    assert done.exit_code == EXIT_UNREACHABLE
    assert "uapplace: the bus refused the signal subscription: ['no']" in done.stderr
    assert client.sent == []
