"""``uapplace install`` on a contained ``systemd --user``: activation, hardening, clean stop.

The installed ``uapplaced.service`` (hardening included) is started the way a user
session starts it: the first bus call to ``org.uap.Placement1`` makes the bus ask
systemd for the unit. ``XDG_DATA_HOME`` is pointed at the runtime directory so the
activation file lands in ``$XDG_RUNTIME_DIR/dbus-1/services``, a directory the
session bus reads. A drop-in gives the daemon the bus tier's private registry,
simulated GPU and ``UAP_HOME``, so nothing shared is touched.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.bus.conftest import make_env
from uapplace.files.paths import BUS_NAME, INTERFACE, OBJECT_PATH
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

UNIT = "uapplaced.service"


def run(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), env=env, capture_output=True, text=True, timeout=60)


def show(env: dict[str, str], *props: str) -> dict[str, str]:
    done = run(env, "systemctl", "--user", "show", UNIT, "-p", ",".join(props))
    return dict(line.split("=", 1) for line in done.stdout.splitlines() if "=" in line)


@pytest.fixture
def installed(user_manager: ContainedUserManager, tmp_path: Path) -> Iterator[dict[str, str]]:
    env = {**user_manager.client_env(), "XDG_DATA_HOME": str(user_manager.runtime_dir)}
    for knob in ("UAP_HOME", "UAPPLACE_CONFIG_DIR", "UAPPLACE_SIM_GPU"):
        env.pop(knob, None)
    private = make_env(tmp_path, user_manager.bus_address).env
    done = run(env, sys.executable, "-m", "uapplace.cli", "install", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    assert json.loads(done.stdout)["reloaded"] is True
    dropin = user_manager.unit_dir / f"{UNIT}.d" / "50-test-world.conf"
    dropin.parent.mkdir(parents=True, exist_ok=True)
    knobs = ("UAP_HOME", "UAPPLACE_CONFIG_DIR", "UAPPLACE_SIM_GPU", "UAP_PROXY_URL")
    lines = [f'Environment="{k}={private[k]}"' for k in knobs]
    dropin.write_text(
        "[Service]\n" + "\n".join(lines) + '\nEnvironment="UAPPLACE_SYSTEM_BUS_ADDRESS="\n'
    )
    assert run(env, "systemctl", "--user", "daemon-reload").returncode == 0
    try:
        yield {**env, "UAP_HOME": private["UAP_HOME"]}
    finally:
        run(env, "systemctl", "--user", "stop", UNIT)
        dropin.unlink()
        dropin.parent.rmdir()
        removed = run(env, sys.executable, "-m", "uapplace.cli", "uninstall", "--json")
        assert [f["action"] for f in json.loads(removed.stdout)["files"]] == [
            "removed",
            "removed",
        ]


def test_bus_activation_starts_the_hardened_unit_and_stop_flushes(
    installed: dict[str, str],
) -> None:
    env = installed
    admit = run(
        env, "busctl", "--user", "call", BUS_NAME, OBJECT_PATH, INTERFACE,
        "Admit", "sssu", "beta", "activation-client", "s", "0",
    )  # fmt: skip
    assert admit.returncode == 0, admit.stderr
    decision, _, placement_id, reason = admit.stdout.split()[1:]
    assert (decision, reason) == ('"park"', '"not_resident"')

    state = show(env, "ActiveState", "NoNewPrivileges", "RestrictRealtime", "UMask", "Type")
    assert state == {
        "ActiveState": "active",
        "NoNewPrivileges": "yes",
        "RestrictRealtime": "yes",
        "UMask": "0077",
        "Type": "dbus",
    }

    assert run(env, "systemctl", "--user", "stop", UNIT).returncode == 0
    stopped = show(env, "ActiveState", "Result", "ExecMainStatus")
    assert stopped == {"ActiveState": "inactive", "Result": "success", "ExecMainStatus": "0"}
    ledger = Path(env["UAP_HOME"]) / "placement.json"
    assert ledger.stat().st_mode & 0o777 == 0o600
    assert [p["id"] for p in json.loads(ledger.read_text())["pending"]] == [placement_id.strip('"')]
