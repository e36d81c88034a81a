"""``uapplace logs MODEL``: which unit a model's lines are read from (:mod:`uapplace.cli.logs`).

docs/placement-rules.md §4.6 ("Failed start"). Without a daemon the registry files of
the environment decide (as ``status`` and ``validate`` fall back to the files); with one,
the unit of the resident serving the model wins. Unknown models and models without a
unit exit 7, a model whose configs run under several units and none resident exits 2.
Reading the lines from a real unit is ``tests/systemd/test_failed_start_logs.py`` and
``tests/engines/test_failed_start.py``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.worlds.registries import measured, sim_devices
from uapplace.cli import logs as cli_logs
from uapplace.cli.logs import ModelUnit, resolve_unit


@pytest.fixture
def registry_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A registry in a private config dir; no bus, so no daemon answers."""
    config = tmp_path / "config"
    config.mkdir()
    document = {
        "version": 1,
        "devices": sim_devices(),
        "models": {
            "alpha": {
                "display": "Alpha",
                "engine": "llama.cpp",
                "unit": "uap-alpha",
                "advertises": ["alpha-latest"],
                "configs": {"a1": measured(1000)},
            },
            "beta": {
                "display": "Beta",
                "engine": "llama.cpp",
                "configs": {
                    "b1": {**measured(1000), "unit": "uap-beta-1.service"},
                    "b2": {**measured(2000), "unit": "uap-beta-2.service"},
                },
            },
            "gamma": {"display": "Gamma", "engine": "llama.cpp", "configs": {"g1": measured(1000)}},
        },
    }
    registry = config / "model-registry.json"
    registry.write_text(json.dumps(document), encoding="utf-8")
    monkeypatch.setenv("UAPPLACE_CONFIG_DIR", str(config))
    monkeypatch.setenv("UAP_HOME", str(tmp_path / "uap"))
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={tmp_path / 'no-bus'}")
    return registry


def exit_code(call: Callable[[], Any]) -> int:
    with pytest.raises(SystemExit) as ended:
        call()
    code = ended.value.code
    assert isinstance(code, int)
    return code


def test_without_a_daemon_the_registry_files_name_the_unit(registry_env: Path) -> None:
    assert resolve_unit("alpha") == ModelUnit("alpha", "uap-alpha.service", "the registry")
    assert resolve_unit("alpha-latest").unit == "uap-alpha.service"  # an advertised id
    assert resolve_unit("b2") == ModelUnit("beta", "uap-beta-2.service", "the registry")


def test_unknown_models_and_models_without_one_unit_are_refused(
    registry_env: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exit_code(lambda: resolve_unit("nosuch")) == 7
    assert "unknown model 'nosuch'" in capsys.readouterr().err
    assert exit_code(lambda: resolve_unit("gamma")) == 7
    assert "model gamma has no unit in the registry" in capsys.readouterr().err
    assert exit_code(lambda: resolve_unit("beta")) == 2
    said = " ".join(capsys.readouterr().err.split())
    assert "b1: uap-beta-1.service, b2: uap-beta-2.service" in said
    assert "name the config (uapplace logs CONFIG)" in said


def test_the_daemons_resident_and_registry_files_come_first(
    registry_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    elsewhere = tmp_path / "elsewhere"  # the files this environment would read: not these
    monkeypatch.setenv("UAPPLACE_CONFIG_DIR", str(elsewhere))
    state = {
        "registry": {"repo": str(registry_env), "local": None},
        "residents": [{"model": "beta", "config": "b1", "unit": "uap-beta-1.service"}],
    }

    def answered(_work: Any, _offline: Any) -> dict[str, Any]:
        return state

    monkeypatch.setattr(cli_logs, "call_or", answered)

    assert resolve_unit("beta") == ModelUnit("beta", "uap-beta-1.service", "its resident beta/b1")
    assert resolve_unit("b2").unit == "uap-beta-2.service"  # the config named, not resident
    assert resolve_unit("alpha").how == "the registry"
