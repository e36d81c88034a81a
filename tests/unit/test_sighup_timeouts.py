"""SIGHUP re-reads ``enforcement-timeouts.json`` (issue 20): a good file is what the next
run waits by; a bad or untrusted one keeps the timeouts in force, with a
``config_error`` alert naming it. And the alert for each file uapplaced could not take.

The daemon's handler (:mod:`uapplace.daemon.main`) end to end is
``tests/bus/test_shim_users.py``; here the pieces it calls, on the unit fakes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from controller_fixtures import registry, registry_paths
from enforce_fakes import FakeUnits, ListHost

from tests.worlds.seed_docs import alpha_model
from uapplace.controller.configstate import ConfigState
from uapplace.core.alerts import AlertBoard, AlertKind
from uapplace.daemon.main import reload_timeouts, report_config_problems
from uapplace.enforce.enforcer import Enforcer
from uapplace.files.timeouts import Timeouts

REGISTRY = registry({"alpha": alpha_model(rails=1)})


def board() -> AlertBoard:
    return AlertBoard(lambda: 1_790_000_000.0)


def config_alerts(alerts: AlertBoard) -> list[tuple[str, str]]:
    return [(a.subject, a.message) for a in alerts.active() if a.kind is AlertKind.CONFIG_ERROR]


def test_use_timeouts_is_what_every_step_of_the_next_run_reads() -> None:
    enforcer = Enforcer(ListHost(), FakeUnits())
    fresh = Timeouts(drain_s=7.0, stop_s=11.0)
    enforcer.use_timeouts(fresh)
    assert enforcer.timeouts is fresh
    assert enforcer.ctx.timeouts is fresh and enforcer.ctx.follower.timeouts is fresh


async def test_a_good_file_is_handed_to_the_enforcer(tmp_path: Path) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text(json.dumps({"drain_s": 42}))
    path.chmod(0o600)
    enforcer = Enforcer(ListHost(), FakeUnits())
    alerts = board()
    read = await reload_timeouts(path, enforcer, alerts)
    assert read is not None and read.drain_s == 42
    assert enforcer.ctx.timeouts.drain_s == 42 and config_alerts(alerts) == []


@pytest.mark.parametrize(
    ("text", "mode", "named"),
    [
        ('{"drain_s": 1e30}', 0o600, "$.drain_s"),
        ('{"stop_s": 5}', 0o666, "mode 0666 lets group and others write it"),
        ('{"bogus": 1}', 0o600, "Extra inputs are not permitted"),
    ],
)
async def test_a_bad_file_keeps_the_timeouts_in_force_and_says_so(
    tmp_path: Path, text: str, mode: int, named: str
) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text(text)
    path.chmod(mode)
    enforcer = Enforcer(ListHost(), FakeUnits(), timeouts=Timeouts(drain_s=30.0))
    alerts = board()
    assert await reload_timeouts(path, enforcer, alerts) is None
    assert enforcer.ctx.timeouts.drain_s == 30.0  # the ones in force stay
    ((subject, message),) = config_alerts(alerts)
    assert subject == str(path) and named in message


async def test_no_file_means_the_defaults(tmp_path: Path) -> None:
    enforcer = Enforcer(ListHost(), FakeUnits(), timeouts=Timeouts(drain_s=30.0))
    read = await reload_timeouts(tmp_path / "absent.json", enforcer, board())
    assert read == Timeouts() and enforcer.timeouts == Timeouts()


async def test_every_file_uapplaced_could_not_take_is_an_alert(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    paths.local_registry.write_text('{"version": 1, "devices": {"gpu0": {"total_mib": 0}}}')
    paths.capacity_policy.write_text('{"services": "none"}')
    paths.auto_policy.write_text('{"enabled": true}')
    paths.auto_policy.chmod(0o646)
    alerts = board()
    raised = await report_config_problems(ConfigState.read(paths), paths, alerts)
    assert raised == 3
    found = dict(config_alerts(alerts))
    assert "$.devices.gpu0.total_mib" in found[str(paths.local_registry)]
    assert "verify-up refuses" in found[str(paths.capacity_policy)]
    assert "never honoured as standing consent" in found[str(paths.auto_policy)]
    assert f"owner uid {os.geteuid()}, mode 0646" in found[str(paths.auto_policy)]


async def test_clean_files_raise_nothing(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    alerts = board()
    assert await report_config_problems(ConfigState.read(paths), paths, alerts) == 0
    assert config_alerts(alerts) == []
