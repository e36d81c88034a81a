"""The files uapplace ships beside its code, found in a checkout and in an installed wheel.

docs/architecture.md ("Shipped files"): the repository keeps them in its top-level
folders (:data:`SHIPPED_DIRS`): the user units ``uapplace install`` writes
(``systemd/*.service``), the backend unit templates ``uapplace unit add`` fills
(``systemd/templates/``), the D-Bus activation file and interface (``dbus/``), the polkit
actions (``polkit/``) and the stock registry and capacity policy uapplaced reads when
``UAPPLACE_CONFIG_DIR`` is unset (``config/``).

A wheel carries them as package data: the build (``setup.py``'s ``build_py``) copies each
folder whole into ``uapplace/_shipped/<folder>/``, so an installation from a wheel —
site-packages, ``pip install --user``, ``--target`` — holds them next to its code, with no
``sys.prefix``/``share/`` lookup that a ``--user`` or ``--target`` install would defeat.

:func:`path` is the one resolver: the installed copy when the package has one, else the
checkout's folders (a checkout never has ``uapplace/_shipped``: the build writes that
copy into its build directory, not into the source tree). The answer is one ``stat``,
taken once per process.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path, PurePosixPath

SHIPPED_DIRS = ("systemd", "dbus", "polkit", "config")
"""The repository's folders a wheel carries (``setup.py`` names the same four)."""
INSTALLED_DIR = "_shipped"
"""Where in the installed package the build puts them: ``uapplace/_shipped/``."""

_PACKAGE = Path(__file__).resolve().parents[1]


class ShippedPathError(ValueError):
    """A relative path that names no shipped folder; the message names it."""


@cache
def root() -> Path:
    """The directory holding :data:`SHIPPED_DIRS`: the installed copy, else the checkout."""
    installed = _PACKAGE / INSTALLED_DIR
    if installed.is_dir():
        return installed
    return _PACKAGE.parent


def path(relative: str) -> Path:
    """The shipped file or folder ``relative`` (``"systemd/uapplaced.service"``, ``"config"``)."""
    parts = PurePosixPath(relative).parts
    if not parts or parts[0] not in SHIPPED_DIRS or ".." in parts:
        raise ShippedPathError(
            f"{relative!r} is not under a shipped folder (one of {', '.join(SHIPPED_DIRS)})"
        )
    return root().joinpath(*parts)


def files() -> list[str]:
    """Every shipped file, relative to :func:`root` (``"dbus/org.uap.Placement1.xml"`` …)."""
    base = root()
    return sorted(
        found.relative_to(base).as_posix()
        for folder in SHIPPED_DIRS
        for found in (base / folder).rglob("*")
        if found.is_file() and "__pycache__" not in found.parts
    )
