"""The import contracts bite: ``lint-imports`` fails a copy of the package with a planted edge.

Each case copies ``uapplace/`` and ``pyproject.toml`` into a temporary directory,
plants one import (or one new module) there and runs the ``lint-imports`` next to this
interpreter in that directory, with ``PYTHONPATH`` naming it, so that it reads the
copy's contracts and analyses the copy's modules, not the installed package. The copy
as it is passes; that it then fails with the one planted edge proves both that the
run reads the copy and that the contract named breaks on that edge.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")

LAYERS = "Layers: core < files < bus < io < controller < machinery < daemon < edges"
OVER_THE_BUS = "The CLI and the shim talk to the daemon over the bus only"
LIGHT_CLI = "The light CLI imports no aiohttp, pystemd, pydantic, typer, Textual or demo"


@dataclass(frozen=True)
class Plant:
    path: str
    """The module to append ``line`` to (created when it does not exist), under ``uapplace/``."""
    line: str
    broken: str
    """The contract that must break."""
    named: str
    """What the report of the broken contract names: the planted edge, or the module."""


CASES = {
    "cli-imports-the-controller": Plant(
        "cli/__init__.py",
        "from uapplace.controller import door",
        OVER_THE_BUS,
        "uapplace.cli -> uapplace.controller.door",
    ),
    "shim-imports-the-controller": Plant(
        "shim/__init__.py",
        "from uapplace.controller import door",
        OVER_THE_BUS,
        "uapplace.shim -> uapplace.controller.door",
    ),
    "core-imports-files-a-higher-layer": Plant(
        "core/__init__.py",
        "from uapplace.files import paths",
        LAYERS,
        "uapplace.core -> uapplace.files.paths",
    ),
    "the-light-cli-imports-aiohttp": Plant(
        "cli/enforce.py",
        "import aiohttp",
        LIGHT_CLI,
        "uapplace.cli.enforce -> aiohttp",
    ),
    "the-light-cli-imports-pydantic-through-the-files": Plant(
        "cli/app.py",
        "from uapplace.files import ledger",
        LIGHT_CLI,
        "uapplace.cli.app -> uapplace.files.ledger",
    ),
    "the-light-cli-imports-the-local-app": Plant(
        "cli/render.py",
        "from uapplace.cli import local",
        LIGHT_CLI,
        "uapplace.cli.render -> uapplace.cli.local",
    ),
    "an-unplaced-top-level-module": Plant(
        "newcomer.py",
        '"""A module the layers contract does not place."""',
        LAYERS,
        "- uapplace.newcomer",
    ),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the package and its contracts, as the working tree has them."""
    copy = tmp_path_factory.mktemp("layering") / "pristine"
    shutil.copytree(
        ROOT / "uapplace", copy / "uapplace", ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copy2(ROOT / "pyproject.toml", copy / "pyproject.toml")
    return copy


def lint_imports(where: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports --no-cache`` on the copy in ``where`` (its config, its modules)."""
    env = {**os.environ, "PYTHONPATH": str(where)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_copy_as_it_is_keeps_every_contract(pristine: Path) -> None:
    done = lint_imports(pristine)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{LAYERS} KEPT" in done.stdout
    assert f"{OVER_THE_BUS} KEPT" in done.stdout
    assert f"{LIGHT_CLI} KEPT" in done.stdout
    assert "BROKEN" not in done.stdout


@pytest.mark.parametrize("plant", list(CASES.values()), ids=list(CASES))
def test_a_planted_edge_breaks_its_contract(pristine: Path, tmp_path: Path, plant: Plant) -> None:
    copy = tmp_path / "planted"
    shutil.copytree(pristine, copy)
    target = copy / "uapplace" / plant.path
    before = target.read_text(encoding="utf-8") if target.exists() else ""
    target.write_text(f"{before}\n{plant.line}\n", encoding="utf-8")

    done = lint_imports(copy)

    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{plant.broken} BROKEN" in done.stdout, done.stdout
    assert plant.named in done.stdout, done.stdout
