"""``uapplace install`` / ``uninstall``: the activation file, the user units, the shim's token.

``install`` writes, where a user session finds them:

- ``$XDG_DATA_HOME/dbus-1/services/org.uap.Placement1.service`` (from the shipped
  ``dbus/``): the user bus starts ``uapplaced.service`` on the first call;
- ``$XDG_CONFIG_HOME/systemd/user/uapplaced.service`` (from the shipped ``systemd/``),
  with ``ExecStart=`` rewritten to this installation's ``uapplaced``;

and with ``--with-shim`` (:class:`ShimInstall`) also

- ``$XDG_CONFIG_HOME/systemd/user/uapplace-shim.service``, ``ExecStart=`` this
  installation's ``uapplace-shim`` (``--port N`` with ``--shim-port``);
- the shim's dashboard token ``$XDG_RUNTIME_DIR/uapplace/token`` (0600 in a 0700
  directory, :mod:`uapplace.files.token`) when there is none yet; an existing one is
  left as it is (a running shim holds it);
- with ``--enable-shim``, the ``default.target.wants/uapplace-shim.service`` link
  (what ``systemctl --user enable`` makes), and the unit is started at once.

then asks the user manager to ``Reload`` (pystemd, through :class:`UnitManager`) and
the bus to re-read its activation files. Without a reachable user manager it says so
and names the command to run.

What was written is recorded in a manifest, ``$XDG_DATA_HOME/uapplace/install-manifest.json``
(each file with its SHA-256, each link with its target, each directory ``install``
created). ``uninstall`` stops the shim unit it installed, then removes exactly those:
a unit file only while it still carries the marker line ``install`` puts first, the
token only while it is the one ``install`` wrote, a link only while it points where
``install`` pointed it, a directory only when empty; anything else is reported ``kept``.
The two daemon files are also recognised by their marker alone (an install from before
the manifest existed). Both commands are idempotent.

The shipped files are found by :mod:`uapplace.files.shipped`: the checkout's folders, or
the copy a wheel installed with the package (docs/architecture.md, "Shipped files").
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex
import shutil
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from dbus_fast import MessageType
from pydantic import BaseModel, ConfigDict, ValidationError

from uapplace.bus import connection as busio
from uapplace.bus.util import bus_daemon_message, user_bus_address
from uapplace.files import shipped
from uapplace.files.jsonfile import ConfigFileError, atomic_write, dumps, read_json
from uapplace.files.paths import BUS_NAME, Paths
from uapplace.files.token import create_token
from uapplace.io.units import RUNNING_OR_STARTING_STATES, UnitManager, outcome_text

MARKER = "# Written by `uapplace install`; `uapplace uninstall` removes it."
UNIT_NAME = "uapplaced.service"
SHIM_UNIT_NAME = "uapplace-shim.service"
ACTIVATION_NAME = f"{BUS_NAME}.service"
WANTED_BY = "default.target"
"""The shipped shim unit's ``[Install] WantedBy=``: where ``--enable-shim`` links it."""
MANIFEST_NAME = "install-manifest.json"
RELOAD_TIMEOUT_S = 10.0
UNIT_JOB_TIMEOUT_S = 30.0
"""Starting or stopping the shim unit: it listens within a second; a hang guard."""

Action = Literal["written", "unchanged", "removed", "absent", "kept"]


class InstallError(Exception):
    """A file cannot be written or read; the message names it."""


@dataclass(frozen=True)
class ShimInstall:
    """``--with-shim``: the shim's unit and token; ``enable``: linked and started now."""

    enable: bool = False
    port: int | None = None
    """``--shim-port``: the unit's ``--port``; ``None``: the shim's default
    (``UAPPLACE_SHIM_PORT`` in the manager's environment, else 3847)."""


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
    dirs: list[FileChange] = field(default_factory=list)
    manifest: FileChange | None = None
    reloaded: bool = False
    reload_message: str = ""
    daemon: str | None = None
    shim: str | None = None
    """The ``uapplace-shim`` the installed unit runs (``None`` without ``--with-shim``)."""
    shim_unit: str = ""
    """What was done to the running shim unit (started, stopped), or why not."""

    @property
    def ok(self) -> bool:
        return not any(f.action == "kept" for f in self.files)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "files": [f.to_json() for f in self.files],
            "dirs": [d.to_json() for d in self.dirs],
            "manifest": self.manifest.to_json() if self.manifest is not None else None,
            "reloaded": self.reloaded,
            "reload_message": self.reload_message,
            "daemon": self.daemon,
            "shim": self.shim,
            "shim_unit": self.shim_unit,
        }


# --------------------------------------------------------------------------- where


def unit_path(paths: Paths) -> Path:
    return paths.user_unit_dir / UNIT_NAME


def activation_path(paths: Paths) -> Path:
    return paths.dbus_services_dir / ACTIVATION_NAME


def shim_unit_path(paths: Paths) -> Path:
    return paths.user_unit_dir / SHIM_UNIT_NAME


def shim_wants_path(paths: Paths) -> Path:
    return paths.user_unit_dir / f"{WANTED_BY}.wants" / SHIM_UNIT_NAME


def manifest_path(paths: Paths) -> Path:
    return paths.data_home / "uapplace" / MANIFEST_NAME


def find_program(name: str) -> Path:
    """This installation's ``name``: beside the running interpreter, else on ``PATH``."""
    beside = Path(sys.executable).with_name(name)
    if beside.is_file():
        return beside
    found = shutil.which(name)
    if found is None:
        raise InstallError(
            f"no {name} next to {sys.executable} and none on PATH; "
            "install the package first (make setup)"
        )
    return Path(found).absolute()


def find_daemon() -> Path:
    return find_program("uapplaced")


# --------------------------------------------------------------------------- what


def _template(relative: str) -> str:
    path = shipped.path(relative)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as err:
        raise InstallError(f"cannot read the packaged file {path}: {err}") from None


def _with_exec_start(template: str, command: str) -> str:
    lines = [
        f"ExecStart={command}" if line.startswith("ExecStart=") else line
        for line in _template(template).splitlines()
    ]
    return "\n".join([MARKER, *lines]) + "\n"


def render_unit(daemon: Path) -> str:
    """The shipped unit with ``ExecStart=`` pointing at ``daemon``."""
    return _with_exec_start("systemd/uapplaced.service", shlex.quote(str(daemon)))


def render_shim_unit(shim: Path, port: int | None) -> str:
    """The shipped shim unit with ``ExecStart=`` pointing at ``shim`` (on ``port``)."""
    argv = [str(shim), "--host", "127.0.0.1"]
    if port is not None:
        argv += ["--port", str(port)]
    return _with_exec_start("systemd/uapplace-shim.service", shlex.join(argv))


def render_activation() -> str:
    return "\n".join([MARKER, *_template("dbus/org.uap.Placement1.service").splitlines()]) + "\n"


# --------------------------------------------------------------------------- the manifest


class ManifestEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str
    kind: Literal["file", "link"]
    sha256: str | None = None
    """A file's content when ``install`` wrote it."""
    target: str | None = None
    """Where a link pointed when ``install`` made it."""


class Manifest(BaseModel):
    """What ``install`` wrote: the one list ``uninstall`` removes (module doc)."""

    model_config = ConfigDict(extra="forbid")

    version: Literal[1] = 1
    files: list[ManifestEntry] = []
    dirs: list[str] = []
    """Directories ``install`` created, parents first; removed only when empty."""

    def record(self, entry: ManifestEntry) -> None:
        """Add ``entry``, or replace the one for its path where it stands."""
        if self.entry(Path(entry.path)) is None:
            self.files = [*self.files, entry]
        else:
            self.files = [entry if e.path == entry.path else e for e in self.files]

    def forget(self, path: Path) -> None:
        self.files = [e for e in self.files if e.path != str(path)]

    def entry(self, path: Path) -> ManifestEntry | None:
        return next((e for e in self.files if e.path == str(path)), None)

    def add_dirs(self, created: Iterable[Path]) -> None:
        self.dirs += [str(d) for d in created if str(d) not in self.dirs]


def load_manifest(paths: Paths) -> Manifest:
    """The manifest, empty when there is none; a broken one is an error naming it."""
    path = manifest_path(paths)
    if not path.exists():
        return Manifest()
    try:
        return Manifest.model_validate(read_json(path))
    except ConfigFileError as err:
        raise InstallError(str(err)) from None
    except ValidationError as err:
        where = ".".join(str(p) for p in err.errors()[0]["loc"])
        raise InstallError(f"{path}: not an install manifest (at {where or '$'}): {err}") from None


def _save_manifest(paths: Paths, manifest: Manifest) -> FileChange:
    path = manifest_path(paths)
    manifest.add_dirs(_make_dirs(path.parent, mode=0o700))
    text = dumps(manifest.model_dump(), indent=2) + "\n"
    if _read_or_none(path) == text:
        return FileChange(path, "unchanged")
    try:
        atomic_write(path, text, mode=0o600, sync=False)
    except OSError as err:
        raise InstallError(f"cannot write {path}: {err}") from None
    return FileChange(path, "written")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _make_dirs(directory: Path, mode: int = 0o755) -> list[Path]:
    """Create ``directory`` and its missing parents; the ones created, parents first."""
    missing: list[Path] = []
    probe = directory
    while not probe.exists() and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    created: list[Path] = []
    for path in reversed(missing):
        try:
            path.mkdir(mode=mode)
        except FileExistsError:
            continue
        except OSError as err:
            raise InstallError(f"cannot create {path}: {err}") from None
        created.append(path)
    return created


# --------------------------------------------------------------------------- writing


def _ours(path: Path) -> bool:
    try:
        with path.open(encoding="utf-8") as handle:
            return handle.readline().rstrip("\n") == MARKER
    except (OSError, UnicodeDecodeError):
        return False


def _put(path: Path, text: str, force: bool, manifest: Manifest) -> FileChange:
    """Write a marked file (unless a foreign one is there) and record it."""
    change = _put_file(path, text, force, manifest)
    if change.action in ("written", "unchanged"):
        manifest.record(ManifestEntry(path=str(path), kind="file", sha256=_sha256(text)))
    return change


def _put_file(path: Path, text: str, force: bool, manifest: Manifest) -> FileChange:
    if path.exists():
        if not _ours(path) and not force:
            return FileChange(
                path,
                "kept",
                "exists and was not written by `uapplace install`; move it away or pass --force",
            )
        if _read_or_none(path) == text:
            return FileChange(path, "unchanged")
    manifest.add_dirs(_make_dirs(path.parent))
    try:
        atomic_write(path, text, mode=0o644, sync=False)
    except OSError as err:
        raise InstallError(f"cannot write {path}: {err}") from None
    return FileChange(path, "written")


def _link(link: Path, target: Path, manifest: Manifest) -> FileChange:
    """``link`` → ``target`` as ``systemctl enable`` makes it; an existing other file is kept."""
    if link.is_symlink() and Path(os.readlink(link)) == target:
        change = FileChange(link, "unchanged")
    elif link.exists() or link.is_symlink():
        return FileChange(link, "kept", f"exists and is not a link to {target}; left in place")
    else:
        manifest.add_dirs(_make_dirs(link.parent))
        try:
            link.symlink_to(target)
        except OSError as err:
            raise InstallError(f"cannot link {link} to {target}: {err}") from None
        change = FileChange(link, "written", f"-> {target}")
    manifest.record(ManifestEntry(path=str(link), kind="link", target=str(target)))
    return change


def _token(path: Path, manifest: Manifest) -> FileChange:
    """The shim's token: written when missing, recorded only when ``install`` wrote it."""
    recorded = manifest.entry(path)
    if path.exists():
        current = _read_or_none(path)
        if recorded is not None and current is not None and _sha256(current) == recorded.sha256:
            return FileChange(path, "unchanged")
        manifest.forget(path)
        return FileChange(path, "unchanged", "already there; left as it is (uninstall keeps it)")
    try:
        manifest.add_dirs(_make_dirs(path.parent, mode=0o700))
        token = create_token(path)
    except (OSError, ValueError) as err:
        raise InstallError(f"cannot create the shim's token: {err}") from None
    if token is None:  # appeared meanwhile (a shim starting): not ours
        return FileChange(path, "unchanged", "already there; left as it is (uninstall keeps it)")
    manifest.record(ManifestEntry(path=str(path), kind="file", sha256=_sha256(token + "\n")))
    return FileChange(path, "written", "mode 0600")


async def install(
    paths: Paths, force: bool = False, shim: ShimInstall | None = None
) -> InstallReport:
    daemon = find_daemon()
    report = InstallReport(daemon=str(daemon))
    manifest = load_manifest(paths)
    report.files.append(_put(unit_path(paths), render_unit(daemon), force, manifest))
    report.files.append(_put(activation_path(paths), render_activation(), force, manifest))
    if shim is not None:
        program = find_program("uapplace-shim")
        report.shim = str(program)
        text = render_shim_unit(program, shim.port)
        report.files.append(_put(shim_unit_path(paths), text, force, manifest))
        if shim.enable:
            report.files.append(_link(shim_wants_path(paths), shim_unit_path(paths), manifest))
        report.files.append(_token(paths.token_file, manifest))
    report.manifest = _save_manifest(paths, manifest)
    await _reload(report)
    if shim is not None and shim.enable and report.ok:
        await _shim_job(report, start=True)
    return report


# --------------------------------------------------------------------------- removing


def _remove(path: Path, entry: ManifestEntry | None) -> FileChange:
    """Remove ``path`` if it is what ``install`` wrote there (module doc)."""
    if not path.exists() and not path.is_symlink():
        return FileChange(path, "absent")
    why_not = _not_ours(path, entry)
    if why_not:
        return FileChange(path, "kept", why_not)
    try:
        path.unlink()
    except OSError as err:
        raise InstallError(f"cannot remove {path}: {err}") from None
    return FileChange(path, "removed")


def _not_ours(path: Path, entry: ManifestEntry | None) -> str:
    """Why ``path`` is not what ``install`` left there, or "" when it is."""
    if entry is not None and entry.kind == "link":
        if path.is_symlink() and os.readlink(path) == entry.target:
            return ""
        return f"no longer the link to {entry.target} install made; left in place"
    if _ours(path):
        return ""
    if entry is not None and entry.sha256 is not None:
        current = _read_or_none(path)
        if current is not None and _sha256(current) == entry.sha256:
            return ""
        return "changed since `uapplace install` wrote it; left in place"
    return "not written by `uapplace install`; left in place"


def _remove_manifest(path: Path) -> FileChange:
    try:
        path.unlink()
    except FileNotFoundError:
        return FileChange(path, "absent")
    except OSError as err:
        raise InstallError(f"cannot remove {path}: {err}") from None
    return FileChange(path, "removed")


def _remove_dirs(dirs: list[str]) -> list[FileChange]:
    changes = []
    for text in reversed(dirs):  # children before their parents
        path = Path(text)
        if not path.is_dir():
            changes.append(FileChange(path, "absent"))
            continue
        try:
            path.rmdir()
        except OSError:
            changes.append(FileChange(path, "kept", "not empty; left in place"))
            continue
        changes.append(FileChange(path, "removed"))
    return changes


async def uninstall(paths: Paths) -> InstallReport:
    report = InstallReport()
    manifest = load_manifest(paths)
    shim_unit = shim_unit_path(paths)
    if manifest.entry(shim_unit) is not None or _ours(shim_unit):
        await _shim_job(report, start=False)
    known = [unit_path(paths), activation_path(paths)]
    for path in known:
        report.files.append(_remove(path, manifest.entry(path)))
    for entry in manifest.files:
        if Path(entry.path) not in known:
            report.files.append(_remove(Path(entry.path), entry))
    if not manifest.entry(shim_unit) and _ours(shim_unit):
        report.files.append(_remove(shim_unit, None))
    report.manifest = _remove_manifest(manifest_path(paths))
    report.dirs = _remove_dirs(manifest.dirs)
    await _reload(report)
    return report


# --------------------------------------------------------------------------- the manager


async def _reload(report: InstallReport) -> None:
    """Tell the user manager (unit files) and the bus (activation files) to look again."""
    try:
        async with asyncio.timeout(RELOAD_TIMEOUT_S):
            async with UnitManager(in_process=True) as manager:
                await manager.reload()
        report.reloaded = True
        report.reload_message = "the user manager reloaded its unit files"
    except Exception as err:
        report.reload_message = (
            f"no systemd user manager reachable ({_one_line(err)}); "
            "run `systemctl --user daemon-reload` in your session"
        )
    await _reload_bus(report)


async def _shim_job(report: InstallReport, start: bool) -> None:
    """Start the shim unit (``--enable-shim``) or stop it before its file goes (uninstall)."""
    verb = "start" if start else "stop"
    try:
        async with UnitManager(in_process=True) as manager:
            if not start:
                state = await manager.state(SHIM_UNIT_NAME)
                if state.active_state not in RUNNING_OR_STARTING_STATES:
                    report.shim_unit = f"{SHIM_UNIT_NAME} was not running"
                    return
            job = manager.start_unit if start else manager.stop_unit
            outcome = await job(SHIM_UNIT_NAME, UNIT_JOB_TIMEOUT_S)
    except Exception as err:
        report.shim_unit = (
            f"could not {verb} {SHIM_UNIT_NAME}: no systemd user manager reachable "
            f"({_one_line(err)}); run `systemctl --user {verb} {SHIM_UNIT_NAME}`"
        )
        return
    done = "started" if start else "stopped"
    report.shim_unit = (
        f"{SHIM_UNIT_NAME} {done}"
        if outcome.ok
        else f"{SHIM_UNIT_NAME} did not {verb}: {outcome_text(outcome)} "
        f"(`journalctl --user -u {SHIM_UNIT_NAME}`)"
    )


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
