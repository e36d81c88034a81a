"""A unit that fails to start says why, in uapplace's own words (issue 19, issue 21 item 2).

docs/placement-rules.md §4.6 ("Failed start"). The world of :mod:`tests.systemd.live_world`
(real units, the real ``uapplaced`` and ``uapplace-shim``) and python-dbusmock's
``notification_daemon`` on the same bus; ``beta``'s engine is started with
``--fail-at-start`` (it writes ``uapplace.sim.engine: failing at start`` to stderr and
exits 1) and a drop-in sends its output to a file (``StandardError=append:FILE``: the
contained manager has no journald). Then, on the real daemon:

- ``uapplace load beta --yes`` fails and rolls back; the CLI prints the engine's line
  under the failed step, and its ``error:`` line stays one line ending ``rolled back``;
- an auto-load of beta (standing consent to displace alpha) fails the same way, and the
  ``enforcement_failed`` alert (``GetState``, its ``detail.lastLines``) and its desktop
  notification carry the line;
- ``uapplace logs beta`` prints beta's lines from the file (``--json`` too), ``--follow``
  prints each new one until SIGINT (exit 0); ``uapplace logs alpha`` (output to a journal
  that has nothing) says ``no log available (no journal, no log file)`` and exits 1; an
  unknown model exits 7.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bus.dbusmock_fixtures import MockService
from tests.systemd.live_world import GUARD_S, LiveWorld, cli
from uapplace.io.unitlogs import BLOCK_INDENT
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

ENGINE_SAYS = "uapplace.sim.engine: failing at start (--fail-at-start)"


@pytest.fixture
def world_options() -> dict[str, Any]:
    """Beta fails as it starts."""
    return {"beta_args": ["--fail-at-start"]}


@pytest.fixture
def world(notifications: MockService, live: LiveWorld) -> LiveWorld:
    """The live machine, started after the notification daemon it notifies through."""
    return live


async def log_to_file(world: LiveWorld, unit_dir: Path, log: Path) -> None:
    """A drop-in sending beta's stdout and stderr to ``log`` (removed with the unit)."""
    dropins = unit_dir / f"{world.beta.name}.d"
    dropins.mkdir(exist_ok=True)
    (dropins / "20-log.conf").write_text(
        f"[Service]\nStandardOutput=append:{log}\nStandardError=append:{log}\n",
        encoding="utf-8",
    )
    await world.units.reload()


def write_auto_policy(world: LiveWorld, **policy: Any) -> None:
    path = world.uap.home / "placement-auto.json"
    path.write_text(json.dumps(policy), encoding="utf-8")
    path.chmod(0o600)


async def test_a_failed_start_shows_the_engines_last_lines_everywhere(
    world: LiveWorld,
    notifications: MockService,
    user_manager: ContainedUserManager,
    tmp_path: Path,
) -> None:
    log = tmp_path / "beta-engine.log"
    await log_to_file(world, user_manager.unit_dir, log)
    beta = world.beta.name

    # The operator's load: the line below the failed step; the error stays one line.
    code, out, err = await cli(world, "load", "beta", "--yes")
    assert code == 1, out + err
    failed = [line for line in out.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and f"{beta} went failed/failed" in failed[0], out
    assert failed[0].endswith(f"last 1 line of {beta} (from {log}):"), out
    below = out.splitlines()[out.splitlines().index(failed[0]) + 1]
    assert below == f"{BLOCK_INDENT}{ENGINE_SAYS}", out
    [error] = [line for line in out.splitlines() if line.startswith("  error: ")]
    assert error.endswith("; rolled back"), out

    async def alpha_hot_again() -> bool:  # restarted: warming until the unit sync verifies it
        return await world.resident_states() == {"alpha": "hot"}

    await world.until("alpha hot again", alpha_hot_again)

    # Unattended: an auto-load of beta fails the same way; the alert and the bubble say why.
    write_auto_policy(world, enabled=True, allow_displace=["beta"])
    status, parked = await world.shim_post(
        "/api/placement/admit", {"model_id": "beta", "client": "auto-client"}
    )
    assert status == 200 and parked["decision"] == "park", parked

    async def alerted() -> dict[str, Any] | None:
        state = await world.shim_get("/api/placement/state")
        found = [a for a in state["alerts"] if a["kind"] == "enforcement_failed"]
        return found[0] if found else None

    alert = await world.until("the enforcement_failed alert", alerted)
    assert alert["subject"] == "beta"
    head, *lines = alert["message"].split("\n")
    assert head.startswith("auto-load: apply ") and "Running now: alpha/a1" in head, head
    # A log file is not split by run: this run's line and the operator's load's.
    assert f"last 2 lines of {beta} (from {log}); rolled back. Running now" in head, head
    assert lines == [f"{BLOCK_INDENT}{ENGINE_SAYS}"] * 2, alert["message"]
    assert alert["detail"]["lastLines"] == [ENGINE_SAYS] * 2, alert["detail"]

    async def bubble() -> list[Any] | None:
        calls = notifications.calls("Notify")
        return next((c for c in calls if c[3] == "uapplace: enforcement failed"), None)

    shown = await world.until("the enforcement_failed notification", bubble)
    assert f"{BLOCK_INDENT}{ENGINE_SAYS}" in shown[4].split("\n"), shown[4]

    # `uapplace logs`: beta's file (both runs appended to it), alpha has none, an unknown model.
    code, out, err = await cli(world, "logs", "beta")
    assert code == 0, err
    assert out.splitlines() == [ENGINE_SAYS, ENGINE_SAYS], out
    assert f"last 2 lines of {beta} (from {log}), model beta" in err, err
    code, out, _ = await cli(world, "logs", "beta", "--lines", "1", "--json")
    assert code == 0
    answer = json.loads(out)
    assert (answer["unit"], answer["source"], answer["lines"]) == (beta, str(log), [ENGINE_SAYS])

    code, out, err = await cli(world, "logs", "alpha")
    assert code == 1 and out == "", out
    assert err.strip() == (
        f"uapplace: {world.alpha.name} (model alpha): no log available (no journal, no log file)"
    ), err
    code, _, err = await cli(world, "logs", "no-such-model")
    assert code == 7 and "unknown model 'no-such-model'" in err, err


async def test_logs_follow_prints_new_lines_until_interrupted(
    world: LiveWorld, user_manager: ContainedUserManager, tmp_path: Path
) -> None:
    log = tmp_path / "beta-engine.log"
    log.write_text("an earlier line\n", encoding="utf-8")
    await log_to_file(world, user_manager.unit_dir, log)
    started = await world.units.start_unit(world.beta.name, GUARD_S)  # fails at once
    assert started.ok, started

    follower = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "uapplace.cli",
        "logs",
        "beta",
        "--follow",
        "-n",
        "5",
        env=world.uap.env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout = follower.stdout
        assert stdout is not None
        seen: list[str] = []

        async def saw(text: str) -> None:
            while text not in seen:
                seen.append((await stdout.readline()).decode().rstrip("\n"))

        await asyncio.wait_for(saw(ENGINE_SAYS), GUARD_S)
        assert seen[:2] == ["an earlier line", ENGINE_SAYS], seen
        with log.open("a", encoding="utf-8") as out:
            out.write("\x1b[31mwritten while followed\x1b[0m\n")
        await asyncio.wait_for(saw("written while followed"), GUARD_S)

        follower.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(follower.communicate(), GUARD_S)
        assert follower.returncode == 0, err.decode()
        assert f"following {world.beta.name} (model beta) from {log}" in err.decode()
    finally:
        if follower.returncode is None:
            follower.kill()
            await follower.wait()
