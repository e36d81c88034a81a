"""``uapplace top`` in a real terminal: tmux runs it against the live world, and
``tmux capture-pane`` reads the screen as an operator sees it.

The live world (:mod:`tests.systemd.live_world`) has ``alpha`` resident and hot on the
simulated GPU; a parked ``beta`` needs alpha stopped. The screen shows the GPU's memory
bar with alpha's stretch and the parked request with its option; ``a`` then ``y``
applies it through the keys, and beta becomes the resident.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.bus.conftest import call_json
from tests.systemd.live_world import LiveWorld

pytestmark = pytest.mark.systemd

GUARD_S = 30.0
"""A hang guard for what the screen shows: never an assertion about speed."""


class Tmux:
    """A tmux server of its own (its socket under the test's directory)."""

    def __init__(self, socket: Path) -> None:
        self.socket = socket

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = ["tmux", "-S", str(self.socket), "-f", "/dev/null", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)

    def screen(self) -> str:
        return self.run("capture-pane", "-p", "-t", "top").stdout

    async def until(self, what: str, check: Callable[[str], bool]) -> str:
        deadline = time.monotonic() + GUARD_S
        while True:
            shown = self.screen()
            if check(shown):
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(f"gave up waiting for {what}; the screen:\n{shown}")
            await asyncio.sleep(0.1)


async def test_top_in_tmux_shows_bars_and_a_pending_request_and_applies_it(
    live: LiveWorld, tmp_path: Path
) -> None:
    if shutil.which("tmux") is None:
        pytest.fail("tmux is not installed (scripts/setup-system.sh installs it)")
    uap = live.uap
    answer = call_json(uap.bus_address, "Admit", "sssu", "beta", "tmux-client", "", "0")
    assert answer[0] == "park", answer
    placement_id = answer[2]
    await live.options_of(placement_id)
    command = shlex.join([sys.executable, "-m", "uapplace.cli", "top"])
    # Textual takes COLUMNS and LINES over the terminal's size: the pane's own size counts.
    env = f"-u COLUMNS -u LINES DBUS_SESSION_BUS_ADDRESS={shlex.quote(uap.bus_address)}"
    tmux = Tmux(tmp_path / "tmux.sock")
    started = tmux.run(
        "new-session", "-d", "-s", "top", "-x", "200", "-y", "60", f"env {env} {command}"
    )
    assert started.returncode == 0, started.stderr
    try:
        shown = await tmux.until(
            "the bars and the parked request",
            lambda s: placement_id in s and "alpha/a1" in s and "gpu0" in s,
        )
        (tmp_path / "top-screen.txt").write_text(shown, encoding="utf-8")
        print(shown)  # the capture, for the record (pytest -s)
        bar = next(line for line in shown.splitlines() if line.lstrip().startswith("gpu0"))
        assert "█" in bar and "░" in bar  # alpha's stretch, then the free one
        assert "alpha/a1 14,000 MiB" in shown and "free 10,576 MiB" in shown
        (row,) = _rows_of(shown, placement_id)
        assert "beta" in row and "tmux-client" in row and "stops alpha/a1" in row
        tmux.run("send-keys", "-t", "top", "a")
        dialog = await tmux.until("the impact dialog", lambda s: "Apply option 1 of" in s)
        assert "stop alpha/a1" in dialog and "in flight no" in dialog
        tmux.run("send-keys", "-t", "top", "y")
        await live.until(
            "beta resident after the apply sent from top",
            lambda: _beta_hot(live),
        )
        final = await tmux.until(
            "the run's outcome, then the screen re-read from the signals",
            lambda s: "option 1: done" in s and not _rows_of(s, placement_id) and _beta_row(s),
        )
        assert "ok verify-up" in final and "ok resolve" in final
        print(dialog, final, sep="\n")
    finally:
        tmux.run("kill-server")


def _rows_of(screen: str, first: str) -> list[str]:
    """The table rows whose first cell is ``first``."""
    return [line for line in screen.splitlines() if line.split()[:1] == [first]]


def _beta_row(screen: str) -> bool:
    """The residents table's row for beta, hot on gpu0."""
    return any(line.split()[:4] == ["beta", "b1", "gpu0", "hot"] for line in screen.splitlines())


async def _beta_hot(live: LiveWorld) -> bool:
    states = await live.resident_states()
    return states.get("beta") == "hot" and "alpha" not in states
