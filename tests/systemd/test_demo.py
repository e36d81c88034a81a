"""``uapplace demo`` for real: the venv's CLI entry, as a subprocess, non-interactive.

The walkthrough must really happen (the park with its placement id, the impact,
every enforcement step, the forward and the new engine's answer), and afterwards
nothing the demo started may be left: no cgroup named after the demo's PID (so
no ``systemd --user`` and no user-bus ``dbus-daemon`` it started, which live in
it), no process that carries the sandbox in its command line or environment
(``uapplaced``, the shim, the fake proxy, the engines), no sandbox directory.
``--keep`` keeps all of it running until Ctrl-C, which removes it the same way.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.systemd.conftest import APPLY_STEPS
from uapplace.demo.sandbox import UNIT_PREFIX
from uapplace.sim.usermanager import CGROUP_ROOT, ContainedUserManager

pytestmark = pytest.mark.systemd

UAPPLACE = Path(sys.executable).parent / "uapplace"
DEMO_TIMEOUT_S = 240.0
"""A hang guard for one whole demo run; it takes seconds."""
PLACEMENT_ID = re.compile(r"writer-13b: park (plc-[0-9a-f]{6}) \(reason: not_resident\)")
SANDBOX = re.compile(r"sandbox: (/\S+)")


def demo_env() -> dict[str, str]:
    """The caller's environment without any bus, uapplace or XDG setting; wide, unbuffered."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DBUS_", "UAP", "XDG_"))}
    env.update({"COLUMNS": "200", "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "TERM": "dumb"})
    return env


@dataclass
class DemoRun:
    """A running ``uapplace demo``; its output is collected as it comes."""

    process: subprocess.Popen[str]
    lines: list[str] = field(default_factory=list)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, *args: str, env: Mapping[str, str] | None = None) -> DemoRun:
        """``uapplace demo ARGS`` in ``env`` (default :func:`demo_env`)."""
        process = subprocess.Popen(
            [str(UAPPLACE), "demo", *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=dict(env) if env is not None else demo_env(),
        )
        run = cls(process)
        run.reader = threading.Thread(target=run._read, daemon=True)
        run.reader.start()
        return run

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + DEMO_TIMEOUT_S
        while text not in self.output:
            if self.process.poll() is not None and self.reader and not self.reader.is_alive():
                raise AssertionError(
                    f"demo exited {self.process.returncode} before {text!r}:\n{self.output}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no {text!r} from the demo in {DEMO_TIMEOUT_S:g}s:\n{self.output}"
                )
            time.sleep(0.05)

    def finish(self) -> int:
        try:
            code = self.process.wait(DEMO_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGINT)
            self.process.wait(60)
            raise AssertionError(
                f"the demo did not end in {DEMO_TIMEOUT_S:g}s:\n{self.output}"
            ) from None
        if self.reader is not None:
            self.reader.join(10)
        return code

    def sandbox(self) -> Path:
        found = SANDBOX.search(self.output)
        assert found, f"the demo printed no sandbox path:\n{self.output}"
        return Path(found.group(1))


@pytest.fixture
def contained(user_manager: ContainedUserManager) -> None:
    """The demo needs what the tier needs (root, a writable cgroup tree): same skip rule."""


@pytest.fixture
def ended_demo() -> Iterator[list[DemoRun]]:
    """Demo runs of a test; any still running at the end gets a Ctrl-C, then SIGKILL."""
    runs: list[DemoRun] = []
    yield runs
    for run in runs:
        if run.process.poll() is None:
            run.process.send_signal(signal.SIGINT)
            try:
                run.process.wait(60)
            except subprocess.TimeoutExpired:
                run.process.kill()
                run.process.wait()


def demo_cgroups(pid: int) -> list[Path]:
    """Cgroups the demo's contained manager made: ``uapplace-demo-<demo pid>-<hex>``."""
    pattern = f"{UNIT_PREFIX}-{pid}-*"
    return sorted(p for hierarchy in CGROUP_ROOT.iterdir() for p in hierarchy.glob(pattern))


def processes_mentioning(text: str) -> list[str]:
    """``pid: command line`` of every process whose command line or environment has ``text``."""
    needle = text.encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or a kernel thread
        if needle in cmdline or needle in environ:
            command = cmdline.replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{entry.name}: {command}")
    return found


def assert_nothing_left(run: DemoRun, sandbox: Path, *more: Path) -> None:
    assert demo_cgroups(run.process.pid) == [], "the demo's contained manager left its cgroups"
    assert processes_mentioning(str(sandbox)) == [], "demo processes outlived it"
    for path in (sandbox, *more):
        assert not path.exists(), f"{path} was not removed"


def test_the_demo_walks_through_a_park_and_an_applied_swap(
    contained: None, ended_demo: list[DemoRun]
) -> None:
    run = DemoRun.start()
    ended_demo.append(run)
    code = run.finish()
    out = run.output
    assert code == 0, out

    parked = PLACEMENT_ID.search(out)
    assert parked, out
    placement_id = parked.group(1)
    assert "coder-7b: forward → gpu0:http://127.0.0.1:" in out
    assert f"options for writer-13b ({placement_id})" in out
    assert "stops coder-7b/q4_k_m: session idle, context lost, reload needed" in out
    # The engines can sleep (issue 12): option 1 pauses coder-7b, option 2 stops it;
    # the walkthrough's first switch is the stop and start one.
    assert "pauses coder-7b/q4_k_m: session idle, context lost; paused" in out
    assert f"The operator says yes: `uapplace apply {placement_id} 2`" in out

    shown = [m.group(1) for m in re.finditer(r"^\s+✓ ([a-z-]+)  ", out, re.MULTILINE)]
    assert shown == APPLY_STEPS, out
    assert (
        f"resolve  removed coder-7b/q4_k_m; writer-13b/q5_k_m hot on gpu0; resolved {placement_id}"
        in out
    )
    assert "applied in 10 steps, run run-" in out
    retry = out[out.index("The client retries") :]
    assert "writer-13b: forward → gpu0:http://127.0.0.1:" in retry
    assert "/v1/chat/completions → 'Hello from writer-13b.'" in retry
    paused = out[out.index("Pause instead of stop") :]
    assert "writer-13b woken, pausing coder-7b:" in paused
    assert "pause coder-7b, wake writer-13b" in paused
    assert "demo finished; nothing left behind" in out

    assert_nothing_left(run, run.sandbox())


def test_keep_runs_until_ctrl_c_then_removes_everything(
    contained: None, ended_demo: list[DemoRun]
) -> None:
    run = DemoRun.start("--keep")
    ended_demo.append(run)
    run.wait_for("Ctrl-C ends it and removes everything")
    exports = dict(re.findall(r"^export (\w+)=(\S+)$", run.output, re.MULTILINE))
    sandbox = run.sandbox()
    runtime_dir = Path(exports["XDG_RUNTIME_DIR"])
    assert demo_cgroups(run.process.pid), "no contained manager while the demo is kept"

    # The kept sandbox answers the CLI exactly as the printed export lines say.
    env = {**demo_env(), **exports}
    status = subprocess.run(
        [str(UAPPLACE), "pending", "--json"], env=env, capture_output=True, text=True, timeout=60
    )
    assert status.returncode == 0, status.stdout + status.stderr
    assert processes_mentioning(str(sandbox)), "nothing of the sandbox runs while kept"

    run.process.send_signal(signal.SIGINT)
    code = run.finish()
    assert code == 0, run.output
    assert "cleaning up: units, daemon, shim, manager, files" in run.output
    assert_nothing_left(run, sandbox, runtime_dir.parent)


def test_ctrl_c_twice_mid_walkthrough_still_removes_everything(
    contained: None, ended_demo: list[DemoRun]
) -> None:
    run = DemoRun.start()
    ended_demo.append(run)
    run.wait_for("A client asks for the resident model")
    sandbox = run.sandbox()
    run.process.send_signal(signal.SIGINT)
    run.process.send_signal(signal.SIGINT)  # an impatient operator
    code = run.finish()
    assert code == 130, run.output
    assert "interrupted; cleaned up" in run.output
    assert_nothing_left(run, sandbox)
