"""The baseline every swap bench compares against: the same units swapped by a bare shell,
``systemctl --user stop A; systemctl --user start B; poll B's /health``, in the sandbox's
own user manager (its environment from :meth:`Sandbox.client_env`).

The script stamps bash's ``$EPOCHREALTIME`` (a builtin: no process, no cost) between its
three parts, so a bench can set uapplace's steps against the shell's own ``stop``,
``start`` and ``poll`` (:class:`ShellParts`) instead of against the total alone."""

from __future__ import annotations

import asyncio
import shlex
import statistics
import time
from dataclasses import dataclass

from uapplace.demo.sandbox import DemoModel, Sandbox

POLL_S = 0.05
"""How often the shell polls ``/health`` (the same 50 ms in every swap bench)."""

GUARD_S = 60.0
"""A hang guard for one shell swap; never an assertion about speed."""


@dataclass(frozen=True)
class ShellParts:
    """One shell swap, in seconds: the whole script and its three parts."""

    total: float
    stop: float
    """``systemctl --user stop A`` (the process and its stop job)."""
    start: float
    """``systemctl --user start B`` (the process and its start job)."""
    poll: float
    """From the start's return until ``/health`` answered 200 (curl every 50 ms)."""

    @property
    def outside(self) -> float:
        """The script's time outside its three parts (bash's own start-up and exit)."""
        return self.total - self.stop - self.start - self.poll


def shell_script(box: Sandbox, stop: DemoModel, start: DemoModel) -> str:
    health = f"{box.endpoint(start)}/health"
    return (
        "t0=$EPOCHREALTIME; "
        f"systemctl --user stop {shlex.quote(stop.unit)}; t1=$EPOCHREALTIME; "
        f"systemctl --user start {shlex.quote(start.unit)}; t2=$EPOCHREALTIME; "
        f"until curl -sf -o /dev/null {shlex.quote(health)}; do sleep {POLL_S:g}; done; "
        'echo "$t0 $t1 $t2 $EPOCHREALTIME"'
    )


async def shell_swap_parts(
    box: Sandbox, stop: DemoModel, start: DemoModel, guard_s: float = GUARD_S
) -> ShellParts:
    """The bare shell swap, timed whole and by part; a failed script raises."""
    script = shell_script(box, stop, start)
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        "bash", "-c", script, env=box.client_env(), stdout=asyncio.subprocess.PIPE
    )
    async with asyncio.timeout(guard_s):
        out, _ = await proc.communicate()
    elapsed = time.perf_counter() - started
    if proc.returncode != 0:
        raise RuntimeError(f"the shell swap failed ({proc.returncode}): {script}")
    t0, t1, t2, t3 = (float(stamp) for stamp in out.split())
    return ShellParts(elapsed, t1 - t0, t2 - t1, t3 - t2)


async def shell_swap(
    box: Sandbox, stop: DemoModel, start: DemoModel, guard_s: float = GUARD_S
) -> float:
    """Seconds the bare shell swap took; a failed script raises."""
    return (await shell_swap_parts(box, stop, start, guard_s)).total


def spread(values: list[float]) -> str:
    """``median [q1 – q3] (min – max)`` of ``values`` (seconds or ratios), as both swap
    benches print them."""
    ordered = sorted(values)
    q1, _, q3 = statistics.quantiles(ordered, n=4) if len(ordered) > 1 else (ordered[0],) * 3
    return (
        f"{statistics.median(ordered):.3f} [{q1:.3f} – {q3:.3f}] "
        f"({ordered[0]:.3f} – {ordered[-1]:.3f})"
    )
