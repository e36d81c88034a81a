"""``uapplace install --with-shim`` on a contained ``systemd --user``: the shim as a unit.

A complete install as an operator would run it: ``uapplace install --with-shim`` writes
the daemon's activation file and unit, the shim's unit and its dashboard token; then
``systemctl --user start uapplace-shim`` (the contained manager's, through its bus)
starts the hardened shim, whose ``GET /api/placement/pending`` is one bus call that
D-Bus-activates ``uapplaced.service``. ``--enable-shim`` links the unit into
``default.target.wants`` and starts it at once. ``uapplace uninstall`` stops the shim
and leaves nothing it wrote behind: no unit, link, token, manifest, nor directory.

As in ``test_uapplaced_unit.py``, ``XDG_DATA_HOME`` is the runtime directory (the
session bus reads ``$XDG_RUNTIME_DIR/dbus-1/services``) and a drop-in gives the daemon
the bus tier's private registry, simulated GPU and ``UAP_HOME``.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.bus.conftest import make_env
from tests.systemd.conftest import free_port
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

DAEMON = "uapplaced.service"
SHIM = "uapplace-shim.service"
GUARD_S = 30.0
"""A hang guard for the shim to listen: it takes about a second."""


def run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=120)


def cli(env: dict[str, str], *args: str) -> dict[str, Any]:
    done = run(env, sys.executable, "-m", "uapplace.cli", *args, "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    return report


def show(env: dict[str, str], unit: str, *props: str) -> dict[str, str]:
    done = run(env, "systemctl", "--user", "show", unit, "-p", ",".join(props))
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


def http(url: str, method: str = "GET", token: str | None = None) -> tuple[int, Any]:
    data = b"{}" if method == "POST" else None
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("x-uap-dashboard-token", token)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def answers_pending(base: str) -> dict[str, Any]:
    """``GET /api/placement/pending`` once the shim listens (a hang guard, not a timing)."""
    deadline = time.monotonic() + GUARD_S
    while True:
        try:
            status, body = http(base + "/api/placement/pending")
        except (urllib.error.URLError, ConnectionError) as err:
            if time.monotonic() > deadline:
                raise AssertionError(f"the shim never listened on {base}: {err}") from None
            time.sleep(0.1)
            continue
        assert status == 200, body
        assert isinstance(body, dict)
        return body


@pytest.fixture
def session_env(user_manager: ContainedUserManager, tmp_path: Path) -> Iterator[dict[str, str]]:
    """The contained session's environment, the daemon pointed at a private world."""
    env = {**user_manager.client_env(), "XDG_DATA_HOME": str(user_manager.runtime_dir)}
    for knob in ("UAP_HOME", "UAPPLACE_CONFIG_DIR", "UAPPLACE_SIM_GPU", "UAPPLACE_SHIM_PORT"):
        env.pop(knob, None)
    private = make_env(tmp_path, user_manager.bus_address).env
    dropin = user_manager.unit_dir / f"{DAEMON}.d" / "50-test-world.conf"
    dropin.parent.mkdir(parents=True, exist_ok=True)
    knobs = ("UAP_HOME", "UAPPLACE_CONFIG_DIR", "UAPPLACE_SIM_GPU", "UAP_PROXY_URL")
    lines = [f'Environment="{k}={private[k]}"' for k in knobs]
    dropin.write_text(
        "[Service]\n" + "\n".join(lines) + '\nEnvironment="UAPPLACE_SYSTEM_BUS_ADDRESS="\n'
    )
    try:
        yield env
    finally:
        for unit in (SHIM, DAEMON):
            run(env, "systemctl", "--user", "stop", unit)
        dropin.unlink()
        dropin.parent.rmdir()
        cli(env, "uninstall")  # idempotent: nothing left whatever the test reached


def token_file(user_manager: ContainedUserManager) -> Path:
    return user_manager.runtime_dir / "uapplace" / "token"


def test_install_with_shim_then_systemctl_start_answers_pending(
    session_env: dict[str, str], user_manager: ContainedUserManager
) -> None:
    env = session_env
    port = free_port()
    report = cli(env, "install", "--with-shim", "--shim-port", str(port))
    assert report["ok"] and report["reloaded"] is True, report
    unit = user_manager.unit_dir / SHIM
    token = token_file(user_manager)
    activation = user_manager.runtime_dir / "dbus-1" / "services" / "org.uap.Placement1.service"
    assert [(f["path"], f["action"]) for f in report["files"]] == [
        (str(user_manager.unit_dir / DAEMON), "written"),
        (str(activation), "written"),
        (str(unit), "written"),
        (str(token), "written"),
    ]
    shim_binary = Path(sys.executable).with_name("uapplace-shim")
    assert f"ExecStart={shim_binary} --host 127.0.0.1 --port {port}\n" in unit.read_text()
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert show(env, SHIM, "LoadState", "ActiveState") == {
        "LoadState": "loaded",
        "ActiveState": "inactive",
    }

    started = run(env, "systemctl", "--user", "start", SHIM)
    assert started.returncode == 0, started.stderr
    base = f"http://127.0.0.1:{port}"
    assert answers_pending(base) == {"pending": []}
    # That read went over the bus: it activated the installed daemon.
    assert show(env, DAEMON, "ActiveState") == {"ActiveState": "active"}
    hardened = show(env, SHIM, "ActiveState", "NoNewPrivileges", "UMask", "LimitNOFILE")
    assert hardened == {
        "ActiveState": "active",
        "NoNewPrivileges": "yes",
        "UMask": "0077",
        "LimitNOFILE": "4096",
    }
    # The shim uses the token install wrote: a write without it is 401, with it gets through.
    secret = token.read_text().strip()
    assert http(base + "/api/placement/auto", "POST")[0] == 401
    assert http(base + "/api/placement/auto", "POST", token=secret)[0] == 200

    again = cli(env, "install", "--with-shim", "--shim-port", str(port))
    assert [f["action"] for f in again["files"]] == ["unchanged"] * 4
    assert again["manifest"]["action"] == "unchanged"

    removed = cli(env, "uninstall")
    assert removed["shim_unit"] == f"{SHIM} stopped"
    assert [f["action"] for f in removed["files"]] == ["removed"] * 4
    assert removed["manifest"]["action"] == "removed"
    assert not unit.exists() and not token.exists()
    assert show(env, SHIM, "LoadState") == {"LoadState": "not-found"}


def test_enable_shim_links_and_starts_it_and_uninstall_takes_exactly_that_back(
    session_env: dict[str, str], user_manager: ContainedUserManager
) -> None:
    env = session_env
    token = token_file(user_manager)
    token.parent.mkdir(mode=0o700, exist_ok=True)
    token.write_text("the-operators-own-token\n")
    token.chmod(0o600)
    wants = user_manager.unit_dir / "default.target.wants"
    before = set(wants.iterdir()) if wants.is_dir() else set()
    port = free_port()

    report = cli(env, "install", "--enable-shim", "--shim-port", str(port))
    assert report["ok"], report
    assert report["shim_unit"] == f"{SHIM} started"
    link = wants / SHIM
    assert link.is_symlink() and link.readlink() == user_manager.unit_dir / SHIM
    changes = {Path(f["path"]).name: (f["action"], f["detail"]) for f in report["files"]}
    assert changes["token"] == ("unchanged", "already there; left as it is (uninstall keeps it)")
    assert show(env, SHIM, "UnitFileState", "ActiveState") == {
        "UnitFileState": "enabled",
        "ActiveState": "active",
    }
    assert answers_pending(f"http://127.0.0.1:{port}") == {"pending": []}

    removed = cli(env, "uninstall")
    assert removed["shim_unit"] == f"{SHIM} stopped"
    assert not link.exists() and not link.is_symlink()
    assert token.read_text() == "the-operators-own-token\n"  # not install's: kept
    assert (set(wants.iterdir()) if wants.is_dir() else set()) == before
    assert show(env, SHIM, "LoadState", "ActiveState") == {
        "LoadState": "not-found",
        "ActiveState": "inactive",
    }
    token.unlink()
