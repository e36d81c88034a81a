"""uapplace installed from a wheel finds its shipped files (docs/architecture.md, "Shipped files").

The wheel is built offline from an sdist-like copy of the tree (what MANIFEST.in names:
the package, ``setup.py``, ``pyproject.toml`` and the shipped folders), its file list must
hold every shipped file under ``uapplace/_shipped/``, and it is installed with
``pip --target`` into a throwaway directory. From outside the checkout (cwd a temporary
directory, ``PYTHONPATH`` that directory, the dependencies from this venv), that
installation must resolve every shipped file to one that exists in it, render the units
``uapplace install`` writes and every ``unit add`` template, default its config to the
installed copy, and run ``uapplace install`` and ``uapplace unit add`` for real in a
sandboxed home.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from uapplace.files import shipped

ROOT = Path(__file__).resolve().parents[2]
SDIST_FILES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md")
"""The top-level files the build reads (the package and the shipped folders besides)."""
TIMEOUT_S = 120.0
PLACEHOLDER = re.compile(r"@[A-Z_]+@")

PROBE = """
import json, sys
from pathlib import Path
import uapplace
from uapplace.cli import install
from uapplace.files import shipped, unit_template
from uapplace.files.jsonfile import read_json
from uapplace.files.paths import Paths
from uapplace.io import unitworker

paths = Paths.from_env({})

print(json.dumps({
    "package": uapplace.__file__,
    "root": str(shipped.root()),
    "files": shipped.files(),
    "missing": [f for f in shipped.files() if not shipped.path(f).is_file()],
    "unit": install.render_unit(Path("/opt/uapplaced")),
    "shim_unit": install.render_shim_unit(Path("/opt/uapplace-shim"), 4000),
    "activation": install.render_activation(),
    "templates": {
        engine: unit_template.render_unit(
            unit_template.EngineUnit(engine, "m", "m", ("/bin/true",), "probe")
        )
        for engine in unit_template.ENGINES
    },
    "config_dir": str(paths.config_dir),
    # As uapplaced reads them: trusted (owned by this user or root, not group-writable).
    "registry_models": sorted(read_json(paths.repo_registry, trusted=True)["models"]),
    "capacity_keys": sorted(read_json(paths.capacity_policy, trusted=True)),
    "worker_path": str(unitworker._PACKAGE_ROOT),
}))
"""


@dataclass(frozen=True)
class Installed:
    wheel: Path
    target: Path
    """Where ``pip install --target`` put the package, its data and its scripts."""
    home: Path
    """A sandboxed home and cwd: every XDG directory below it, no checkout above it."""

    def env(self) -> dict[str, str]:
        kept = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("UAP", "XDG_", "DBUS_", "PYTHON"))
        }
        return kept | {
            "PYTHONPATH": str(self.target),
            "HOME": str(self.home),
            "XDG_RUNTIME_DIR": str(self.home / "run"),
            "XDG_CONFIG_HOME": str(self.home / "config"),
            "XDG_DATA_HOME": str(self.home / "data"),
            # A bus that is not there: install's reload says so at once.
            "DBUS_SESSION_BUS_ADDRESS": f"unix:path={self.home / 'no-bus'}",
        }

    def run(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.home,
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=False,
        )


def _pip(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"


def _sdist_tree(into: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SDIST_FILES:
        shutil.copy2(ROOT / name, into / name)
    for folder in ("uapplace", *shipped.SHIPPED_DIRS):
        shutil.copytree(ROOT / folder, into / folder, ignore=ignore)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    base = tmp_path_factory.mktemp("wheel")
    source = base / "source"
    source.mkdir()
    _sdist_tree(source)
    dist = base / "dist"
    _pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        str(dist),
        str(source),
    )
    (wheel,) = dist.glob("uapplace-*.whl")
    target = base / "target"
    _pip("install", "--no-deps", "--no-index", "-q", "--target", str(target), str(wheel))
    home = base / "home"
    home.mkdir()
    return Installed(wheel, target, home)


@pytest.fixture(scope="module")
def probe(installed: Installed) -> dict[str, Any]:
    done = installed.run(sys.executable, "-c", PROBE)
    assert done.returncode == 0, done.stderr
    found: dict[str, Any] = json.loads(done.stdout)
    return found


def test_setup_py_copies_the_folders_the_resolver_names() -> None:
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    copied = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "SHIPPED_DIRS" for t in node.targets)
    ]
    assert copied == [shipped.SHIPPED_DIRS]


def test_the_checkout_resolves_to_its_own_folders() -> None:
    assert shipped.root() == ROOT
    assert "systemd/uapplaced.service" in shipped.files()
    assert "polkit/org.uap.placement.policy" in shipped.files()
    assert shipped.path("config") == ROOT / "config"


@pytest.mark.parametrize("bad", ["", "uapplace/gate.py", "config/../setup.py", "/etc/passwd"])
def test_a_path_outside_the_shipped_folders_is_refused(bad: str) -> None:
    with pytest.raises(shipped.ShippedPathError, match="not under a shipped folder"):
        shipped.path(bad)


def test_the_wheel_carries_every_shipped_file(installed: Installed) -> None:
    with zipfile.ZipFile(installed.wheel) as wheel:
        names = set(wheel.namelist())
    missing = [f for f in shipped.files() if f"uapplace/_shipped/{f}" not in names]
    assert not missing, f"{installed.wheel.name} lacks {missing}"
    assert "uapplace/files/shipped.py" in names


def test_the_installed_package_resolves_every_shipped_file_in_itself(
    installed: Installed, probe: dict[str, Any]
) -> None:
    package = installed.target / "uapplace"
    assert Path(probe["package"]) == package / "__init__.py", "the checkout was imported"
    assert Path(probe["root"]) == package / "_shipped"
    assert probe["files"] == shipped.files()
    assert probe["missing"] == []
    assert Path(probe["config_dir"]) == package / "_shipped" / "config"
    stock = json.loads((ROOT / "config" / "model-registry.json").read_text(encoding="utf-8"))
    assert probe["registry_models"] == sorted(stock["models"])
    assert probe["capacity_keys"]
    # The unit worker's PYTHONPATH: the directory that holds the installed package.
    assert Path(probe["worker_path"]) == installed.target


def test_the_installed_package_renders_what_install_and_unit_add_write(
    probe: dict[str, Any],
) -> None:
    assert "ExecStart=/opt/uapplaced\n" in probe["unit"]
    assert "ExecStart=/opt/uapplace-shim --host 127.0.0.1 --port 4000\n" in probe["shim_unit"]
    assert "Name=org.uap.Placement1\n" in probe["activation"]
    for engine, text in probe["templates"].items():
        assert text.startswith("# probe\n"), engine
        assert "ExecStart=/bin/true\n" in text, engine
        assert not PLACEHOLDER.search(text), f"{engine}: a placeholder left unfilled"


def test_uapplace_install_runs_from_the_wheel(installed: Installed) -> None:
    program = str(installed.target / "bin" / "uapplace")
    helped = installed.run(program, "install", "--help")
    assert helped.returncode == 0, helped.stderr
    assert "--with-shim" in helped.stdout
    done = installed.run(program, "install", "--with-shim", "--json")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    report = json.loads(done.stdout)
    assert report["reloaded"] is False, "the sandbox reached a real user manager"
    written = {Path(f["path"]).name: f["action"] for f in report["files"]}
    assert written["uapplaced.service"] == "written"
    assert written["org.uap.Placement1.service"] == "written"
    assert written["uapplace-shim.service"] == "written"
    unit = installed.home / "config" / "systemd" / "user" / "uapplaced.service"
    assert "[Service]" in unit.read_text(encoding="utf-8")


def test_uapplace_unit_add_reads_its_template_from_the_wheel(installed: Installed) -> None:
    program = str(installed.target / "bin" / "uapplace")
    done = installed.run(program, "unit", "add", "wheeled", "--engine", "fake", "--port", "18999")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    unit = installed.home / "config" / "systemd" / "user" / "uap-wheeled.service"
    text = unit.read_text(encoding="utf-8")
    assert "ExecStart=" in text
    assert "TimeoutStartSec=60s" in text
