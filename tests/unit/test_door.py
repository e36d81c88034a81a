"""The controller's one late-bound part: enforcement, attached once or said unavailable."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Collection, Mapping
from typing import Any

import pytest

from tests.worlds.builders import parked
from uapplace.controller.door import NOT_YET_WIRED, EnforcementDoor
from uapplace.controller.ports import EnforcementParts, Signature
from uapplace.core.errors import Busy, InvalidArgument, NotFound, Unavailable, UnknownModel
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Model,
    Option,
    OptionKind,
    PendingEntry,
    Registry,
)
from uapplace.core.staleness import LiveLaunch

ALPHA = Model(
    key="alpha",
    display="Alpha",
    engine="llama.cpp",
    unit="uap-alpha",
    endpoint="http://127.0.0.1:18080",
    configs={"a1": Config(key="a1", status=ConfigStatus.MEASURED, resident_gpu_mib=100.0)},
)
ENTRY = parked(
    "alpha", Option(OptionKind.LOAD_ALONGSIDE, "alpha", "a1", "gpu0", 100.0, ()), client="c"
)


class Recorder:
    """Enforcer and measurer at once: records what the door let through."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.idle_waits = 0
        self.running: str | None = None
        """The run in progress (a test sets it: "busy means busy")."""
        self.applying: str | None = None
        self.drained: frozenset[str] = frozenset()

    async def apply(
        self,
        entry: PendingEntry,
        option: int,
        expected: Signature | None,
        *,
        origin: str | None = None,
    ) -> dict[str, Any]:
        self.calls.append(("apply", entry.id, option, origin))
        return {"ok": True}

    async def load(self, model: str, expected: Signature) -> dict[str, Any]:
        self.calls.append(("load", model))
        return {"ok": True}

    async def unload(self, model: str, expected: Signature) -> dict[str, Any]:
        self.calls.append(("unload", model))
        return {"ok": True}

    async def wait_idle(self) -> None:
        self.idle_waits += 1

    async def measure(self, model: str, config: str) -> dict[str, Any]:
        self.calls.append(("measure", model, config))
        return {}

    async def live_launch(
        self, registry: Registry, only: Collection[str] | None = None
    ) -> Mapping[str, LiveLaunch]:
        return {}

    async def measure_envelope(
        self, model: str, config: str, expected: Signature
    ) -> dict[str, Any]:
        self.calls.append(("envelope", model, config))
        return {}


class Door:
    def __init__(self) -> None:
        self.flushes = 0
        self.door = EnforcementDoor(self.flush, self.entry, self.model_named)
        self.recorder = Recorder()

    async def flush(self) -> None:
        self.flushes += 1

    def entry(self, placement_id: str) -> PendingEntry | None:
        return ENTRY if placement_id == ENTRY.id else None

    def model_named(self, model: str) -> Model:
        if model != "alpha":
            raise UnknownModel(f"model {model!r} is in no registry file")
        return ALPHA

    def attach(self) -> None:
        self.door.attach(EnforcementParts(self.recorder, self.recorder))


async def test_before_attach_every_request_is_unavailable_saying_why() -> None:
    made = Door()
    requests: list[Callable[[], Awaitable[dict[str, Any]]]] = [
        lambda: made.door.apply(ENTRY.id, 1, []),
        lambda: made.door.load("alpha", []),
        lambda: made.door.unload("alpha", []),
        lambda: made.door.measure("alpha", "a1"),
    ]
    for request in requests:
        with pytest.raises(Unavailable, match=re.escape(NOT_YET_WIRED)):
            await request()
    made.door.unavailable("it needs the systemd user manager")
    with pytest.raises(Unavailable, match="MeasureEnvelope is not available: it needs the"):
        await made.door.measure("alpha", "a1", envelope=True)
    assert made.flushes == 0 and not made.door.attached


async def test_bad_ids_are_refused_before_anything_else() -> None:
    made = Door()
    with pytest.raises(NotFound, match="no pending placement plc-999999"):
        await made.door.apply("plc-999999", 1, [])
    with pytest.raises(InvalidArgument, match=r"option 2 is out of range: .* options 1\.\.1"):
        await made.door.apply(ENTRY.id, 2, [])
    with pytest.raises(UnknownModel):
        await made.door.load("nope", [])
    with pytest.raises(NotFound, match="has no config 'zz'"):
        await made.door.measure("alpha", "zz")


async def test_an_attached_door_flushes_the_ledger_before_each_run() -> None:
    made = Door()
    made.attach()
    await made.door.apply(ENTRY.id, 1, ["beta/b1"], origin="notification click")
    await made.door.load("alpha", [])
    await made.door.unload("alpha", ["alpha/a1"])
    await made.door.measure("alpha", "a1", envelope=True)
    assert made.recorder.calls == [
        ("apply", ENTRY.id, 1, "notification click"),
        ("load", "alpha"),
        ("unload", "alpha"),
        ("envelope", "alpha", "a1"),
    ]
    # One durable write per run; measuring the envelope is a switch (issue 21), so it
    # counts as one too.
    assert made.flushes == 4


async def test_attach_is_once_and_close_refuses_new_runs() -> None:
    made = Door()
    made.attach()
    with pytest.raises(RuntimeError, match="attached once"):
        made.attach()
    await made.door.close(wait_s=1)
    assert made.recorder.idle_waits == 1
    with pytest.raises(Busy, match="shutting down"):
        await made.door.load("alpha", [])
