"""A contained ``systemd --user`` for tests and ``uapplace demo``.

docs/architecture.md ("Contained user manager").

``systemd --user`` started from a process in the root cgroup takes over the
machine's whole cgroup tree (it moves PID 1 and everything else into its
``init.scope``). This module never lets that happen:

1. As root, it creates a fresh cgroup ``/<name>`` in every hierarchy under
   ``/sys/fs/cgroup`` (``cpuset`` excluded; a hierarchy that refuses is skipped).
2. It starts a launcher (``/bin/sh``) that blocks on its stdin, writes the
   launcher's PID into each new ``cgroup.procs`` and **verifies in
   ``/proc/<pid>/cgroup`` that the ``name=systemd`` path (``0::`` on a pure
   cgroup2 host) is the new cgroup**. Only then does it tell the launcher to go;
   otherwise it kills the launcher and aborts.
3. The launcher ``exec``s ``unshare --mount --propagation private``, checks it
   really is in a mount namespace other than PID 1's, mounts a tmpfs on
   ``/run/systemd`` and creates ``/run/systemd/system`` there (never on the
   host), then ``exec``s ``/lib/systemd/systemd --user``: the manager keeps the
   launcher's PID, so it is our direct child.

The user bus is the manager's own: ``dbus.socket`` (``$XDG_RUNTIME_DIR/bus``)
and ``dbus.service`` (``dbus-daemon --session --address=systemd:``) are written
into the private unit directory and pulled in at start. A user manager only
connects to its API bus while those two units run (systemd's
``manager_dbus_is_running``), so a dbus-daemon started beside it would never
see ``org.freedesktop.systemd1``. ``XDG_RUNTIME_DIR``, ``XDG_CONFIG_HOME`` and
``HOME`` are private temporary directories.

Teardown: SIGTERM the manager (a user manager answers it by starting
``exit.target``, which stops every unit, the bus included), SIGKILL after a
timeout, SIGKILL whatever is still in the cgroups we created (and only
those), remove them depth-first, remove the temporary directory. A run killed
before its teardown is cleaned up by the next ``start()`` with the same prefix
(:func:`reap_stale_cgroups`: only cgroups named ``<prefix>-<pid>-<hex>`` whose
``<pid>`` is gone).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

CGROUP_ROOT = Path("/sys/fs/cgroup")
SYSTEMD_BINARY = Path("/lib/systemd/systemd")
_SOCKET_PATH_MAX = 107  # sockaddr_un.sun_path, less the NUL
RUN_SYSTEMD = Path("/run/systemd")
"""The private tmpfs is mounted here. Created empty on the host when missing (as
systemd-tmpfiles would at boot); ``system/`` inside it only ever exists in the namespace."""

# The manager's user bus. systemd connects to it once both units run.
_DBUS_SOCKET_UNIT = """[Unit]
Description=uapplace contained user bus socket

[Socket]
ListenStream=%t/bus
"""
_DBUS_SERVICE_UNIT = """[Unit]
Description=uapplace contained user bus
Requires=dbus.socket

[Service]
Type=notify
NotifyAccess=main
ExecStart={dbus_daemon} --session --address=systemd: --nofork --nopidfile --systemd-activation
"""

# Runs as the launcher. It waits for the parent's "go" (sent only after the
# cgroup move was verified), then enters a private mount namespace. The inner
# script refuses to touch /run/systemd unless its mount namespace differs from
# PID 1's, so a failed unshare can never create /run/systemd/system on the host.
_INNER_SCRIPT = r"""
set -eu
if [ "$(readlink /proc/self/ns/mnt)" = "$(readlink /proc/1/ns/mnt)" ]; then
  echo "uapplace: not in a private mount namespace; refusing" >&2
  exit 97
fi
mount -t tmpfs -o mode=0755,size=64m uapplace-run-systemd /run/systemd
mkdir /run/systemd/system
exec "$0" --user
"""
_LAUNCHER_SCRIPT = r"""
read -r go || exit 96
[ "$go" = go ] || exit 96
exec unshare --mount --propagation private -- /bin/sh -c "$1" "$2"
"""


class ContainmentError(RuntimeError):
    """The contained manager cannot be started here, or teardown left something behind."""


def can_contain() -> tuple[bool, str]:
    """Whether a contained user manager can run on this machine, and why not."""
    if os.geteuid() != 0:
        return False, "not root: moving a process between cgroups needs root"
    if not SYSTEMD_BINARY.exists():
        return False, f"{SYSTEMD_BINARY} is missing (install systemd)"
    for tool in ("unshare", "dbus-daemon", "busctl"):
        if shutil.which(tool) is None:
            return False, f"{tool} is not on PATH"
    if not RUN_SYSTEMD.is_dir() and not os.access(RUN_SYSTEMD.parent, os.W_OK):
        return False, f"{RUN_SYSTEMD} is missing and {RUN_SYSTEMD.parent} is not writable"
    try:
        layout = _cgroup_layout()
    except ContainmentError as err:
        return False, str(err)
    if not os.access(layout.systemd_hierarchy, os.W_OK):
        return False, f"{layout.systemd_hierarchy} is not writable"
    return True, "ok"


class _CgroupLayout:
    """The hierarchies to create the cgroup in, and the one systemd tracks processes by."""

    def __init__(self, hierarchies: list[Path], systemd_hierarchy: Path, proc_key: str) -> None:
        self.hierarchies = hierarchies
        self.systemd_hierarchy = systemd_hierarchy
        self.proc_key = proc_key
        """The controller field of the ``/proc/<pid>/cgroup`` line to verify."""


def _cgroup_layout() -> _CgroupLayout:
    if (CGROUP_ROOT / "cgroup.procs").exists():  # pure cgroup2
        return _CgroupLayout([CGROUP_ROOT], CGROUP_ROOT, "")
    hierarchies: list[Path] = []
    seen: set[Path] = set()
    for entry in sorted(CGROUP_ROOT.iterdir()):
        resolved = entry.resolve()
        if entry.name == "cpuset" or resolved in seen:
            continue
        if not (resolved / "cgroup.procs").exists():
            continue
        seen.add(resolved)
        hierarchies.append(resolved)
    systemd = CGROUP_ROOT / "systemd"
    if (systemd / "cgroup.procs").exists():
        return _CgroupLayout(hierarchies, systemd.resolve(), "name=systemd")
    unified = CGROUP_ROOT / "unified"
    if (unified / "cgroup.procs").exists():
        return _CgroupLayout(hierarchies, unified.resolve(), "")
    raise ContainmentError(f"no name=systemd or cgroup2 hierarchy under {CGROUP_ROOT}")


def _cgroup_path_of(pid: int, proc_key: str) -> str | None:
    """The path of ``pid`` in the hierarchy whose ``/proc/<pid>/cgroup`` field is ``proc_key``."""
    text = Path(f"/proc/{pid}/cgroup").read_text(encoding="utf-8")
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2)
        if controllers == proc_key:
            return path
    return None


def _procs_under(directory: Path) -> set[int]:
    pids: set[int] = set()
    for procs in directory.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            pids.update(int(x) for x in procs.read_text(encoding="utf-8").split())
    return pids


def _rmdir_tree(directory: Path) -> None:
    """Remove a cgroup and its children, deepest first (cgroupfs only allows rmdir)."""
    children = sorted(
        (p for p in directory.rglob("*") if p.is_dir()),
        key=lambda p: len(p.parts),
        reverse=True,
    )
    for child in [*children, directory]:
        with contextlib.suppress(FileNotFoundError):
            child.rmdir()


def reap_stale_cgroups(name_prefix: str) -> list[Path]:
    """Remove cgroups ``<name_prefix>-<pid>-<hex>`` whose creating process is gone.

    A run killed before its teardown (a test runner killed on timeout) leaves
    its manager running in such a cgroup. Only names of this exact pattern are
    touched, and only when the PID in the name no longer exists: a concurrent
    run's cgroups stay. Returns the directories removed.
    """
    pattern = re.compile(rf"{re.escape(name_prefix)}-(\d+)-[0-9a-f]{{6}}")
    stale: list[Path] = []
    for hierarchy in _cgroup_layout().hierarchies:
        for entry in hierarchy.iterdir():
            match = pattern.fullmatch(entry.name)
            if match and entry.is_dir() and not Path(f"/proc/{match.group(1)}").exists():
                stale.append(entry)
    if stale:
        _kill_processes_in(stale)
        for cgroup in stale:
            with contextlib.suppress(OSError):
                _rmdir_tree(cgroup)
    return [c for c in stale if not c.exists()]


def _kill_processes_in(cgroups: list[Path], patience: float = 5.0) -> list[int]:
    """SIGKILL every process in ``cgroups`` (and below); the PIDs that would not go."""
    deadline = time.monotonic() + patience
    pids: set[int] = set()
    while time.monotonic() < deadline:
        pids = set().union(*(_procs_under(c) for c in cgroups))
        if not pids:
            return []
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    return sorted(pids)


def terminate(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM ``proc`` and wait ``timeout`` seconds, then SIGKILL it; a no-op once it
    has exited. Also the demo sandbox's clean-up for the processes it spawns."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class ContainedUserManager:
    """A ``systemd --user`` confined to cgroups and a mount namespace of its own.

    Use as a context manager, or call :meth:`start` and :meth:`stop`. After
    ``start()``: :attr:`env` is what a client needs (``XDG_RUNTIME_DIR``,
    ``DBUS_SESSION_BUS_ADDRESS``, ``XDG_CONFIG_HOME``, ``HOME``), :attr:`unit_dir`
    is where units and drop-ins go, :attr:`pid` is the manager's PID.
    """

    def __init__(
        self,
        name_prefix: str = "uapplace-test",
        start_timeout: float = 20.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_-]+", name_prefix):
            raise ValueError(f"name_prefix {name_prefix!r}: letters, digits, _ and - only")
        self.name_prefix = name_prefix
        self.name = f"{name_prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._base: Path | None = None
        self._created_cgroups: list[Path] = []
        self._manager: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ public

    @property
    def base_dir(self) -> Path:
        if self._base is None:
            raise ContainmentError("the contained manager is not started")
        return self._base

    @property
    def runtime_dir(self) -> Path:
        return self.base_dir / "run"

    @property
    def config_home(self) -> Path:
        return self.base_dir / "config"

    @property
    def home(self) -> Path:
        return self.base_dir / "home"

    @property
    def unit_dir(self) -> Path:
        """``$XDG_CONFIG_HOME/systemd/user``: the same place ``Paths.user_unit_dir`` names."""
        return self.config_home / "systemd" / "user"

    @property
    def log_path(self) -> Path:
        """The manager's log and its units' stdout/stderr (removed by :meth:`stop`)."""
        return self.base_dir / "manager.log"

    @property
    def bus_address(self) -> str:
        return f"unix:path={self.runtime_dir / 'bus'}"

    @property
    def env(self) -> dict[str, str]:
        return {
            "XDG_RUNTIME_DIR": str(self.runtime_dir),
            "DBUS_SESSION_BUS_ADDRESS": self.bus_address,
            "XDG_CONFIG_HOME": str(self.config_home),
            "HOME": str(self.home),
        }

    @property
    def pid(self) -> int:
        if self._manager is None:
            raise ContainmentError("the contained manager is not started")
        return self._manager.pid

    @property
    def cgroups(self) -> list[Path]:
        """The cgroup directories this manager created (one per hierarchy)."""
        return list(self._created_cgroups)

    def client_env(self) -> dict[str, str]:
        """``os.environ`` with :attr:`env` on top: for ``busctl --user``/``systemctl --user``."""
        return {**os.environ, **self.env}

    def start(self) -> None:
        if self._manager is not None:
            raise ContainmentError(f"already started (manager PID {self._manager.pid})")
        ok, why = can_contain()
        if not ok:
            raise ContainmentError(why)
        reap_stale_cgroups(self.name_prefix)
        try:
            RUN_SYSTEMD.mkdir(mode=0o755, exist_ok=True)
            self._prepare_dirs()
            layout = _cgroup_layout()
            self._create_cgroups(layout)
            self._launch_manager(layout)
            self._wait_running()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop everything started; raise :class:`ContainmentError` if a cgroup stays."""
        if self._manager is not None:
            terminate(self._manager, self.stop_timeout)
        self._manager = None
        leftovers = _kill_processes_in(self._created_cgroups)
        remaining: list[Path] = []
        for cgroup in self._created_cgroups:
            with contextlib.suppress(OSError):
                _rmdir_tree(cgroup)
            if cgroup.exists():
                remaining.append(cgroup)
        self._created_cgroups = remaining
        if self._base is not None:
            shutil.rmtree(self._base, ignore_errors=True)
            self._base = None
        if remaining or leftovers:
            raise ContainmentError(
                f"teardown left cgroups {[str(p) for p in remaining]}, processes {leftovers}"
            )

    def __enter__(self) -> ContainedUserManager:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ----------------------------------------------------------------- details

    def _prepare_dirs(self) -> None:
        # Short base path: the bus socket path must fit sockaddr_un (108 bytes).
        self._base = Path(tempfile.mkdtemp(prefix="uap-um-"))
        if len(str(self.runtime_dir / "bus")) > _SOCKET_PATH_MAX:
            raise ContainmentError(
                f"bus socket path {self.runtime_dir / 'bus'} is longer than "
                f"{_SOCKET_PATH_MAX} bytes; point TMPDIR at a shorter directory"
            )
        self.runtime_dir.mkdir(mode=0o700)
        self.runtime_dir.chmod(0o700)
        self.home.mkdir(mode=0o700)
        self.unit_dir.mkdir(parents=True)
        # Units write to the manager's own stderr, i.e. log_path: no journald here.
        (self.config_home / "systemd" / "user.conf").write_text(
            "[Manager]\nDefaultStandardOutput=inherit\nDefaultStandardError=inherit\n",
            encoding="utf-8",
        )
        dbus_daemon = shutil.which("dbus-daemon") or "/usr/bin/dbus-daemon"
        (self.unit_dir / "dbus.socket").write_text(_DBUS_SOCKET_UNIT, encoding="utf-8")
        (self.unit_dir / "dbus.service").write_text(
            _DBUS_SERVICE_UNIT.format(dbus_daemon=dbus_daemon), encoding="utf-8"
        )
        for target, unit in (("sockets.target", "dbus.socket"), ("default.target", "dbus.service")):
            wants = self.unit_dir / f"{target}.wants"
            wants.mkdir(exist_ok=True)
            (wants / unit).symlink_to(self.unit_dir / unit)

    def _create_cgroups(self, layout: _CgroupLayout) -> None:
        for hierarchy in layout.hierarchies:
            cgroup = hierarchy / self.name
            try:
                cgroup.mkdir()
            except OSError:
                if hierarchy == layout.systemd_hierarchy:
                    raise
                continue
            self._created_cgroups.append(cgroup)

    def _launch_manager(self, layout: _CgroupLayout) -> None:
        log = self.log_path.open("wb")
        with log:
            self._manager = subprocess.Popen(
                [
                    "/bin/sh",
                    "-c",
                    _LAUNCHER_SCRIPT,
                    "uapplace-launcher",
                    _INNER_SCRIPT,
                    str(SYSTEMD_BINARY),
                ],
                stdin=subprocess.PIPE,
                stdout=log,
                stderr=log,
                env={**self.client_env(), "SYSTEMD_LOG_TARGET": "console"},
                start_new_session=True,
            )
        launcher = self._manager
        assert launcher.stdin is not None
        for cgroup in self._created_cgroups:
            try:
                (cgroup / "cgroup.procs").write_text(f"{launcher.pid}\n", encoding="ascii")
            except OSError:
                if cgroup.parent == layout.systemd_hierarchy:
                    raise
        actual = _cgroup_path_of(launcher.pid, layout.proc_key)
        expected = f"/{self.name}"
        if actual != expected:
            raise ContainmentError(
                f"launcher {launcher.pid} is in cgroup {actual!r}, not {expected!r}; aborting"
            )
        launcher.stdin.write(b"go\n")
        launcher.stdin.close()

    def _wait_running(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        state = ""
        while time.monotonic() < deadline:
            assert self._manager is not None
            if self._manager.poll() is not None:
                raise ContainmentError(
                    f"systemd --user exited with {self._manager.returncode}: {self._log_tail()}"
                )
            state = self._system_state()
            if state in ("running", "degraded"):
                return
            time.sleep(0.05)
        raise ContainmentError(
            f"systemd --user not running after {self.start_timeout}s "
            f"(SystemState {state!r}): {self._log_tail()}"
        )

    def _system_state(self) -> str:
        result = subprocess.run(
            [
                "busctl",
                "--user",
                "get-property",
                "org.freedesktop.systemd1",
                "/org/freedesktop/systemd1",
                "org.freedesktop.systemd1.Manager",
                "SystemState",
            ],
            env=self.client_env(),
            capture_output=True,
            text=True,
            timeout=5,
            check=False,
        )
        # busctl prints: s "running"
        return result.stdout.strip().removeprefix("s ").strip('"') if result.returncode == 0 else ""

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-2000:]
        except OSError:
            return "(no log)"
