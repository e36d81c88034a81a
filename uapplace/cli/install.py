"""``uapplace install`` / ``uninstall``: the activation file and the user unit.

``install`` writes two files where a user session finds them:

- ``$XDG_DATA_HOME/dbus-1/services/org.uap.Placement1.service`` (from the repo's
  ``dbus/``): the user bus starts ``uapplaced.service`` on the first call;
- ``$XDG_CONFIG_HOME/systemd/user/uapplaced.service`` (from the repo's
  ``systemd/``), with ``ExecStart=`` rewritten to this installation's ``uapplaced``;

then asks the user manager to ``Reload`` (pystemd, through :class:`UnitManager`)
and the bus to re-read its activation files. Without a reachable user manager it
says so and names the command to run. Each written file starts with a marker
line; ``uninstall`` removes only files that carry it, so it removes exactly what
``install`` wrote and never an operator's own file. Both are idempotent.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dbus_fast import MessageType

from uapplace.bus import connection as busio
from uapplace.bus.util import bus_daemon_message, user_bus_address
from uapplace.files.jsonfile import atomic_write
from uapplace.files.paths import BUS_NAME, Paths
from uapplace.io.units import UnitManager

MARKER = "# Written by `uapplace install`; `uapplace uninstall` removes it."
UNIT_NAME = "uapplaced.service"
ACTIVATION_NAME = f"{BUS_NAME}.service"
_REPO = Path(__file__).resolve().parents[2]
RELOAD_TIMEOUT_S = 10.0

Action = Literal["written", "unchanged", "removed", "absent", "kept"]


class InstallError(Exception):
    """A file cannot be written or read; the message names it."""


@dataclass(frozen=True)
class FileChange:
    path: Path
    action: Action
    detail: str = ""

    def to_json(self) -> dict[str, str]:
        return {"path": str(self.path), "action": self.action, "detail": self.detail}


@dataclass
class InstallReport:
    files: list[FileChange] = field(default_factory=list)
    reloaded: bool = False
    reload_message: str = ""
    daemon: str | None = None

    @property
    def ok(self) -> bool:
        return not any(f.action == "kept" for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "files": [f.to_json() for f in self.files],
            "reloaded": self.reloaded,
            "reload_message": self.reload_message,
            "daemon": self.daemon,
        }


def unit_path(paths: Paths) -> Path:
    return paths.user_unit_dir / UNIT_NAME


def activation_path(paths: Paths) -> Path:
    return paths.dbus_services_dir / ACTIVATION_NAME


def find_daemon() -> Path:
    """This installation's ``uapplaced``: beside the running interpreter, else on ``PATH``."""
    beside = Path(sys.executable).with_name("uapplaced")
    if beside.is_file():
        return beside
    found = shutil.which("uapplaced")
    if found is None:
        raise InstallError(
            f"no uapplaced next to {sys.executable} and none on PATH; "
            "install the package first (make setup)"
        )
    return Path(found).absolute()


def _template(relative: str) -> str:
    path = _REPO / relative
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise InstallError(f"cannot read the packaged file {path}: {err}") from None


def render_unit(daemon: Path) -> str:
    """The repo's unit with ``ExecStart=`` pointing at ``daemon``."""
    command = shlex.quote(str(daemon))
    lines = [
        f"ExecStart={command}" if line.startswith("ExecStart=") else line
        for line in _template("systemd/uapplaced.service").splitlines()
    ]
    return "\n".join([MARKER, *lines]) + "\n"


def render_activation() -> str:
    return "\n".join([MARKER, *_template("dbus/org.uap.Placement1.service").splitlines()]) + "\n"


def _ours(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as handle:
            return handle.readline().rstrip("\n") == MARKER
    except (OSError, UnicodeDecodeError):
        return False


def _put(path: Path, text: str, force: bool) -> FileChange:
    if path.exists():
        if not _ours(path) and not force:
            return FileChange(
                path,
                "kept",
                "exists and was not written by `uapplace install`; move it away or pass --force",
            )
        try:
            if path.read_text(encoding="utf-8") == text:
                return FileChange(path, "unchanged")
        except (OSError, UnicodeDecodeError):
            pass
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text, mode=0o644, sync=False)
    except OSError as err:
        raise InstallError(f"cannot write {path}: {err}") from None
    return FileChange(path, "written")


def _remove(path: Path) -> FileChange:
    if not path.exists():
        return FileChange(path, "absent")
    if not _ours(path):
        return FileChange(path, "kept", "not written by `uapplace install`; left in place")
    try:
        path.unlink()
    except OSError as err:
        raise InstallError(f"cannot remove {path}: {err}") from None
    return FileChange(path, "removed")


async def install(paths: Paths, force: bool = False) -> InstallReport:
    daemon = find_daemon()
    report = InstallReport(daemon=str(daemon))
    report.files.append(_put(unit_path(paths), render_unit(daemon), force))
    report.files.append(_put(activation_path(paths), render_activation(), force))
    await _reload(report)
    return report


async def uninstall(paths: Paths) -> InstallReport:
    report = InstallReport()
    report.files.append(_remove(unit_path(paths)))
    report.files.append(_remove(activation_path(paths)))
    await _reload(report)
    return report


async def _reload(report: InstallReport) -> None:
    """Tell the user manager (unit files) and the bus (activation files) to look again."""
    try:
        async with asyncio.timeout(RELOAD_TIMEOUT_S):
            async with UnitManager() as manager:
                await manager.reload()
        report.reloaded = True
        report.reload_message = "the user manager reloaded its unit files"
    except Exception as err:
        report.reload_message = (
            f"no systemd user manager reachable ({_one_line(err)}); "
            "run `systemctl --user daemon-reload` in your session"
        )
    await _reload_bus(report)


async def _reload_bus(report: InstallReport) -> None:
    try:
        async with asyncio.timeout(RELOAD_TIMEOUT_S):
            bus = await busio.Bus(bus_address=user_bus_address()).connect()
            try:
                reply = await bus.call(bus_daemon_message("ReloadConfig"))
            finally:
                bus.disconnect()
        if reply is not None and reply.message_type is not MessageType.ERROR:
            report.reload_message += "; the user bus re-read its activation files"
    except Exception:  # the bus watches its service directories anyway
        pass


def _one_line(err: BaseException) -> str:
    text = str(err) or type(err).__name__
    return text.splitlines()[0]
