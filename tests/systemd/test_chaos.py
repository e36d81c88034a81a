"""The chaos harness, bounded for CI (``bench/chaos.py`` runs it long).

At least :data:`STEPS` random operations with at least :data:`MIN_KILLS` SIGKILLs
of ``uapplaced`` (at enforcement steps, rollback steps included, and idle), on
the tier's contained ``systemd --user`` with real units running the fake engine
and the real daemon; docs/invariants.md's invariants are checked after every step (see
:mod:`bench.chaos`). The seed is printed first and named in the failure;
``UAPPLACE_CHAOS_SEED=<n>`` (or ``bench/chaos.py --seed <n>``) replays it.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from bench.chaos import Chaos
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

STEPS = 200
MIN_KILLS = 20
MAX_STEPS = 600
"""A run that has not seen MIN_KILLS kills by STEPS goes on, up to this many steps."""


async def test_chaos_keeps_every_invariant(
    user_manager: ContainedUserManager, tmp_path: Path
) -> None:
    seed_text = os.environ.get("UAPPLACE_CHAOS_SEED")
    seed = int(seed_text) if seed_text else random.SystemRandom().randrange(2**31)
    lines: list[str] = []
    print(f"chaos seed {seed} (replay: UAPPLACE_CHAOS_SEED={seed})", flush=True)
    chaos = Chaos(user_manager, tmp_path / "chaos", seed, say=lines.append, verbose=True)
    try:
        await chaos.setup()
        report = await chaos.run(STEPS, min_kills=MIN_KILLS, max_steps=MAX_STEPS)
    finally:
        await chaos.close()
    print(report.summary(), flush=True)
    trail = "\n".join(lines[-60:])
    assert report.violations == [], (
        f"{report.summary()}\n"
        + "\n".join(map(str, report.violations))
        + f"\nlast steps:\n{trail}\nuapplaced log tail:\n{chaos.log_tail()}"
    )
    assert report.steps >= STEPS
    assert report.kills >= MIN_KILLS, report.summary()
    assert report.forwards_checked > 0, report.summary()
