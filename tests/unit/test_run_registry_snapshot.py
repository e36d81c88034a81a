"""A run reads one registry from start to end (issue 20: a ``Validate`` or SIGHUP during a
run swapped the registry the drain bound, verify-up and resolve read midway;
uapplace.enforce.snapshot)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from enforce_fakes import Scene, resident, swap_registry

from uapplace.core.model import ResidentState


async def test_a_reload_during_the_drain_does_not_change_what_the_run_verifies(
    tmp_path: Path,
) -> None:
    scene = Scene(tmp_path, swap_registry(), [resident("alpha", "a1")])
    entry = scene.park("beta")
    # A reload lands mid-drain: the proxy now has one upstream, where no engine answers.
    # A run that asked the host again would verify beta up there and roll back.
    reloaded = replace(swap_registry(), single_upstream="http://127.0.0.1:9/")

    def reload_now() -> None:
        scene.host.reg = reloaded

    scene.host.on_inflight = reload_now

    result = await scene.enforcer.apply(entry, 1, ["alpha/a1"])

    assert result["ok"] is True, result
    assert scene.host.reg is reloaded  # the reload itself was not held back
    assert [(r.model, r.state) for r in scene.host.live] == [("beta", ResidentState.HOT)]
    scene.assert_ended_cleanly()
