"""The stale-measurement gate kept current and said out loud (issue 21 items 3 and 7;
uapplace.controller.launchgate; docs/placement-rules.md §4.1.1):

- a stale measurement raises one ``stale_measurement`` warning while it is stale, and an
  ``info`` on the same alert once it counts again;
- a resident published ``hot`` after a (re)start has its unit's launch re-read in the
  background (only that unit), and a new engine build makes its measurement unknown
  without a reload. The same on real units: tests/systemd/test_measure_stale.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Collection, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from controller_fixtures import registry, registry_paths, tiny_model, tiny_resident

from uapplace.controller.configstate import ConfigState, LiveConfig
from uapplace.controller.launchgate import LaunchGate
from uapplace.core.alerts import Alert, AlertBoard, AlertKind, Severity
from uapplace.core.model import Registry, Resident, ResidentState
from uapplace.core.staleness import LiveLaunch, exec_start_digest

UNIT = "uap-tiny.service"
LAUNCH = "/usr/bin/llama-server -m /m/tiny.gguf --port 18090 -c 4096"
BUILD = "b100-abc"
MEASURED_AT = "2026-12-03T10:00:00Z"


def tiny() -> dict[str, Any]:
    return tiny_model(
        {
            "resident_gpu_mib": 0,
            "host_rss_mib": 300,
            "kv_resident_cells": 4096,
            "measured_at": MEASURED_AT,
            "measured_on": "cpu0",
            "flags": LAUNCH.split()[1:],
            "exec_start_sha256": exec_start_digest(LAUNCH),
            "measured_build": BUILD,
        }
    )


class Reader:
    """What systemd and the engine say now; records which units each read asked for."""

    def __init__(self) -> None:
        self.build = BUILD
        self.asked: list[Collection[str] | None] = []

    async def __call__(
        self, registry: Registry, only: Collection[str] | None
    ) -> Mapping[str, LiveLaunch]:
        self.asked.append(only)
        await asyncio.sleep(0)  # a real read yields (unit worker, HTTP)
        return {UNIT: LiveLaunch(UNIT, LAUNCH, self.build)}


class Gate:
    def __init__(self, tmp_path: Path) -> None:
        self.files = ConfigState.read(registry_paths(tmp_path, registry({"tiny": tiny()})))
        """The files as read: what each reload swaps in (the gate marks its own copy)."""
        self.config = LiveConfig(self.files)
        self.raised: list[Alert] = []
        self.board = AlertBoard(lambda: 0.0, self.raised.append)
        self.read = Reader()
        self.regated = 0
        self.tasks: list[asyncio.Task[None]] = []

        def spawn(work: Awaitable[None], name: str) -> None:
            self.tasks.append(asyncio.ensure_future(work))

        def regated() -> None:
            self.regated += 1

        self.gate = LaunchGate(self.config, self.board, self.read, regated, spawn)

    def stale(self) -> bool:
        """Is tiny/c1 unknown now (``untrusted`` says why)?"""
        return bool(self.config.registry().models["tiny"].configs["c1"].untrusted)

    def stale_alerts(self) -> list[Alert]:
        return [a for a in self.raised if a.kind is AlertKind.STALE_MEASUREMENT]


def hot(pid: int) -> Resident:
    return tiny_resident(300.0, MEASURED_AT, main_pid=pid)


async def test_a_stale_measurement_raises_once_and_clears_with_info(tmp_path: Path) -> None:
    g = Gate(tmp_path)
    await g.gate.swap(g.files)
    assert not g.stale() and g.stale_alerts() == []

    g.read.build = "b200-def"  # the engine was upgraded
    await g.gate.swap(g.files)
    await g.gate.swap(g.files)  # a second reload: still one raise
    (raised,) = g.stale_alerts()
    assert raised.severity is Severity.WARNING and raised.subject == "tiny/c1"
    assert "'b200-def'" in raised.message and raised.detail["field"] == "measured_build"
    assert g.stale()

    g.read.build = BUILD  # back to the measured build
    await g.gate.swap(g.files)
    assert [a.severity for a in g.stale_alerts()] == [Severity.WARNING, Severity.INFO]
    (open_now,) = g.board.active()
    assert open_now.severity is Severity.INFO and "counts again" in open_now.message
    assert not g.stale()


async def test_a_restarted_engine_is_re_gated_without_a_reload(tmp_path: Path) -> None:
    g = Gate(tmp_path)
    await g.gate.swap(g.files)
    g.gate.resident_published(None, hot(100))  # adopted at start-up
    await asyncio.gather(*g.tasks)
    assert g.regated == 0 and not g.stale()

    g.gate.resident_published(hot(100), hot(100))  # the same engine re-published: no read
    assert len(g.tasks) == 1

    g.read.build = "b200-def"  # upgraded and restarted by hand: a new main PID
    warming = replace(hot(200), state=ResidentState.WARMING)
    g.gate.resident_published(hot(100), warming)  # not answering yet: nothing to read
    assert len(g.tasks) == 1
    g.gate.resident_published(warming, hot(200))  # verified: read now
    await asyncio.gather(*g.tasks)
    assert g.read.asked[-1] == (UNIT,)  # that unit only
    assert g.regated == 1 and g.stale()
    (raised,) = g.stale_alerts()
    assert raised.severity is Severity.WARNING


async def test_a_warning_restored_after_a_restart_clears_once_the_config_counts(
    tmp_path: Path,
) -> None:
    g = Gate(tmp_path)
    g.read.build = "b200-def"
    await g.gate.swap(g.files)
    (warned,) = g.board.active()
    assert warned.severity is Severity.WARNING

    # A restart: a new gate and board, the open warning restored from the ledger, and the
    # engine re-measured (or put back) while the daemon was down.
    (tmp_path / "restarted").mkdir()
    restarted = Gate(tmp_path / "restarted")
    restarted.board.restore([warned])
    await restarted.gate.swap(restarted.files)

    assert not restarted.stale()
    (cleared,) = restarted.stale_alerts()
    assert cleared.id == warned.id and cleared.severity is Severity.INFO
    assert "counts again" in cleared.message and "'b200-def'" in cleared.message
    assert cleared.detail["stale"] is False and cleared.detail["field"] == "measured_build"


async def test_a_restored_warning_still_true_is_not_raised_again(tmp_path: Path) -> None:
    g = Gate(tmp_path)
    g.read.build = "b200-def"
    await g.gate.swap(g.files)
    (warned,) = g.board.active()

    (tmp_path / "restarted").mkdir()
    restarted = Gate(tmp_path / "restarted")
    restarted.board.restore([warned])
    restarted.read.build = "b200-def"
    await restarted.gate.swap(restarted.files)

    assert restarted.stale() and restarted.stale_alerts() == []  # no second notification
    assert restarted.board.active() == [warned]
