"""``uapplace units --check`` (bus ``CheckUnits``) and the truthful ``validate`` (issue 10)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bus.conftest import DaemonProcess, run_cli
from uapplace.io.units import DROPIN_NAME

pytestmark = pytest.mark.bus


def test_units_check_reports_stale_dropins_and_writes_nothing(daemon: DaemonProcess) -> None:
    uap = daemon.uap
    unit_dir = Path(uap.env["XDG_CONFIG_HOME"]) / "systemd" / "user"
    assert run_cli(uap, "units").returncode == 0
    current = run_cli(uap, "units", "--check")
    assert current.returncode == 0, current.stdout + current.stderr
    assert "match the registry" in current.stdout

    dropin = unit_dir / "uap-alpha.service.d" / DROPIN_NAME
    dropin.write_text("[Unit]\nConflicts=\n", encoding="utf-8")
    stale = run_cli(uap, "units", "--check", "--json")

    assert stale.returncode == 1
    assert json.loads(stale.stdout) == {"stale": [str(dropin.resolve())]}
    assert dropin.read_text(encoding="utf-8") == "[Unit]\nConflicts=\n"
    assert run_cli(uap, "units").returncode == 0  # rewritten from the graph
    assert run_cli(uap, "units", "--check").returncode == 0


def test_validate_says_whose_figures_count_and_which_policy_is_in_force(
    daemon: DaemonProcess,
) -> None:
    done = run_cli(daemon.uap, "validate", "--json")
    report = json.loads(done.stdout)
    rows = {r["entry"]: r for r in report["provenance"] if r["kind"] == "config"}
    alpha = rows["$.models.alpha.configs.alpha-q4"]
    assert (alpha["source"], alpha["measurement"]) == ("local", "measured here (machine-local)")
    assert report["capacity_policy"]["state"] == "loaded"
    table = run_cli(daemon.uap, "validate")
    assert "measured here" in table.stdout
