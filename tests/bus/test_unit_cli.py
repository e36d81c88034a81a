"""``uapplace unit`` without a daemon: what it writes, what it refuses (the systemd tier's
``test_unit_templates.py`` drives add → measure → load → remove with one)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bus.conftest import UapEnv, make_env, run_cli

pytestmark = pytest.mark.bus


@pytest.fixture
def uap(tmp_path: Path) -> UapEnv:
    """A private world whose bus address has nobody behind it: uapplaced is not running."""
    return make_env(tmp_path / "uap", f"unix:path={tmp_path / 'no-bus'}")


def unit_file(uap: UapEnv, name: str) -> Path:
    return Path(uap.env["XDG_CONFIG_HOME"]) / "systemd" / "user" / f"uap-{name}.service"


def test_add_writes_the_hardened_unit_and_the_unmeasured_entry(uap: UapEnv) -> None:
    done = run_cli(
        uap,
        "unit",
        "add",
        "tiny",
        "--engine",
        "fake",
        "--port",
        "18080",
        "--env",
        "A=1%",
        "--",
        "--load-secs",
        "0.3",
        "--mib",
        "5%",
    )
    assert done.returncode == 0, done.stderr
    assert "uapplaced is not running" in done.stdout
    text = unit_file(uap, "tiny").read_text()
    assert text.startswith("# Written by `uapplace unit add`")
    assert "--model-id tiny --load-secs 0.3 --mib 5%%\n" in text  # % doubled for systemd
    assert 'Environment="A=1%%"' in text
    assert "\n[Install]" not in text and "Restart=no" in text  # never enabled
    entry = json.loads(uap.local_registry.read_text())["models"]["tiny"]
    assert entry["configs"] == {"default": {"status": "unmeasured"}}
    shown = run_cli(uap, "unit", "show", "tiny")
    assert shown.returncode == 0 and '"unit": "uap-tiny"' in shown.stdout
    listed = run_cli(uap, "unit", "list", "--json")
    (row,) = json.loads(listed.stdout)["units"]
    assert row["name"] == "tiny" and row["resident"] is None  # no daemon to ask


def test_add_refuses_what_it_must_not_overwrite(uap: UapEnv) -> None:
    # alpha is the repo registry's: a local entry would overlay it.
    taken = run_cli(uap, "unit", "add", "alpha", "--engine", "fake", "--port", "18080")
    assert taken.returncode == 1 and "already defines the model 'alpha'" in taken.stderr
    assert not unit_file(uap, "alpha").exists()
    assert run_cli(uap, "unit", "add", "tiny", "--engine", "fake", "--port", "1").returncode == 0
    again = run_cli(uap, "unit", "add", "tiny", "--engine", "fake", "--port", "1")
    assert again.returncode == 1 and "--force replaces it" in again.stderr
    bad = run_cli(uap, "unit", "add", "Tiny!", "--engine", "fake", "--port", "1")
    assert bad.returncode == 2 and "Invalid value for NAME" in bad.stderr
    no_model = run_cli(uap, "unit", "add", "big", "--engine", "vllm", "--port", "1")
    assert no_model.returncode == 2 and "needs the weights" in no_model.stderr


def test_remove_asks_the_daemon_and_refuses_without_it(uap: UapEnv) -> None:
    assert run_cli(uap, "unit", "add", "tiny", "--engine", "fake", "--port", "1").returncode == 0
    refused = run_cli(uap, "unit", "remove", "tiny")
    assert refused.returncode == 3 and "cannot reach the user bus" in refused.stderr
    assert unit_file(uap, "tiny").exists()
    assert run_cli(uap, "unit", "remove", "nothing").returncode == 7
