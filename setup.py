"""The build's one step beyond pyproject.toml: the shipped files go into the package.

docs/architecture.md ("Shipped files"): the repository's top-level ``systemd/``, ``dbus/``,
``polkit/`` and ``config/`` are copied whole into ``uapplace/_shipped/`` of the build, so
that a wheel carries them as package data; ``uapplace.files.shipped`` finds them there
(or, in a checkout, where they are). An editable install needs no copy: its package is
the checkout.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
SHIPPED_DIRS = ("systemd", "dbus", "polkit", "config")
"""As ``uapplace.files.shipped.SHIPPED_DIRS`` (tests/unit/test_wheel.py checks both)."""
INSTALLED = ("uapplace", "_shipped")


class BuildPyWithShipped(build_py):
    """``build_py``, then each shipped folder copied into the built package."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib, *INSTALLED)
        for folder in SHIPPED_DIRS:
            source = ROOT / folder
            if not source.is_dir():
                raise SystemExit(f"setup.py: the shipped folder {source} is missing")
            shutil.rmtree(target / folder, ignore_errors=True)
            shutil.copytree(source, target / folder, ignore=shutil.ignore_patterns("__pycache__"))


setup(cmdclass={"build_py": BuildPyWithShipped})
