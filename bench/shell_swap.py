"""The baseline every swap bench compares against: the same units swapped by a bare shell,
``systemctl --user stop A; systemctl --user start B; poll B's /health``, in the sandbox's
own user manager (its environment from :meth:`Sandbox.client_env`)."""

from __future__ import annotations

import asyncio
import shlex
import time

from uapplace.demo.sandbox import DemoModel, Sandbox

POLL_S = 0.05
"""How often the shell polls ``/health`` (the same 50 ms in every swap bench)."""

GUARD_S = 60.0
"""A hang guard for one shell swap; never an assertion about speed."""


def shell_script(box: Sandbox, stop: DemoModel, start: DemoModel) -> str:
    health = f"{box.endpoint(start)}/health"
    return (
        f"systemctl --user stop {shlex.quote(stop.unit)}; "
        f"systemctl --user start {shlex.quote(start.unit)}; "
        f"until curl -sf -o /dev/null {shlex.quote(health)}; do sleep {POLL_S:g}; done"
    )


async def shell_swap(
    box: Sandbox, stop: DemoModel, start: DemoModel, guard_s: float = GUARD_S
) -> float:
    """Seconds the bare shell swap took; a failed script raises."""
    script = shell_script(box, stop, start)
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec("bash", "-c", script, env=box.client_env())
    async with asyncio.timeout(guard_s):
        code = await proc.wait()
    elapsed = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"the shell swap failed ({code}): {script}")
    return elapsed
