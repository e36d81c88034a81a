"""Rails from real ``llama-server`` units, and a sleeping one never woken by our probes
(issue 19's findings, fixed).

- ``--parallel 3`` is read from ``/props`` ``total_slots`` (3); a registry that declares
  another figure is surfaced, never silently resolved: ``GetState`` targets (and the
  shim's ``/api/placement/targets``, what a proxy sizes its slots from) say
  ``disagree`` and use the smaller figure, ``status`` shows it, ``validate`` warns.
- A server started with ``--sleep-idle-seconds 1`` that fell asleep stays asleep while
  ``status``, the shim's ``/metrics``, ``/api/placement/targets`` and ``/state``,
  ``validate`` and ``measure`` look at it: ``/props`` still says ``is_sleeping`` and its
  log shows no wake (a completion, the control, does wake it and the log says so).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.worlds.llama import LlamaModel, LlamaWorld
from uapplace.cli.session import EXIT_REFUSED

pytestmark = pytest.mark.engines

TRIO = (
    LlamaModel("trio", "tiny-a", ctx_size=768, parallel=3, started=True),
    LlamaModel("odd", "tiny-a", ctx_size=768, parallel=3, started=True, entry={"rails": 2}),
)
"""Two servers of 3 slots; the registry says 3 for ``trio``, 2 for ``odd``."""
SLEEPER = (
    LlamaModel("sleepy", "tiny-c", sleep_idle_s=1, started=True),
    LlamaModel("other", "tiny-a", started=True),
)
WOKE = "server is exiting sleeping state"
"""What llama-server logs when anything wakes it (``GET /slots``, a completion)."""
ROUNDS = 3


def target_of(targets: list[dict[str, Any]], model: str) -> dict[str, Any]:
    [row] = [t for t in targets if t["model"] == model]
    return row


@pytest.mark.parametrize("world_models", [TRIO], indirect=True)
async def test_rails_come_from_props_total_slots_and_a_disagreement_is_surfaced(
    llama: LlamaWorld,
) -> None:
    for key in ("trio", "odd"):
        assert (await llama.props(key))["total_slots"] == 3, "--parallel 3, as served"

    targets = (await llama.state())["targets"]
    trio, odd = target_of(targets, "trio"), target_of(targets, "odd")
    assert (trio["rails"], trio["rails_source"], trio["state"], trio["agrees"]) == (
        3,
        "props",
        "ok",
        True,
    )
    assert trio["live"] == {"state": "ok", "rails": 3, "source": "props", "detail": "total_slots 3"}
    assert (odd["declared"], odd["live"]["rails"], odd["live"]["source"]) == (2, 3, "props")
    assert (odd["rails"], odd["rails_source"], odd["state"], odd["agrees"]) == (
        2,
        "registry",
        "disagree",
        False,
    ), "the smaller figure: two requests never overflow a target"
    shown = (await llama.shim_get("/api/placement/targets"))["targets"]
    assert target_of(shown, "odd") == odd, "the proxy reads the same verdict"

    status = await llama.cli("status")
    assert status.returncode == 0, status.stderr
    [line] = [row for row in status.stdout.splitlines() if llama.engine("odd").target in row]
    assert "disagree" in line and "registry" in line

    report = await llama.cli_json("validate")
    assert report["ok"] is True, "a disagreement warns, it does not fail"
    [warning] = [f for f in report["findings"] if f["json_path"] == "$.models.odd.rails"]
    assert warning["severity"] == "warning"
    assert warning["message"] == (
        f"model 'odd': the registry declares rails 2 but the live engine at "
        f"{llama.engine('odd').endpoint} reports 3 (from props); the gate uses 2"
    )
    assert not [f for f in report["findings"] if "trio" in f["json_path"]]


@pytest.mark.parametrize("world_models", [SLEEPER], indirect=True)
async def test_probing_a_sleeping_server_never_wakes_it(llama: LlamaWorld) -> None:
    pid = await llama.main_pid("sleepy")
    await llama.wait_asleep("sleepy")
    assert WOKE not in llama.engine_log("sleepy")

    # Another resident gone: the daemon's cached rails no longer fit its targets, so the
    # next reader probes every target again, the sleeper included.
    unloaded = await llama.cli_json("unload", "other", "--yes")
    assert unloaded["ok"] is True, unloaded

    async def shown_asleep() -> bool:
        rows = (await llama.state())["residents"]
        return any(row["model"] == "sleepy" and row.get("asleep") for row in rows)

    await llama.until("status to show sleepy asleep (from /props is_sleeping)", shown_asleep)

    status = await llama.cli_json("status")
    for _ in range(ROUNDS):
        async with llama.http.get(llama.shim.base_url + "/metrics") as reply:
            assert reply.status == 200, await reply.text()
        targets = (await llama.shim_get("/api/placement/targets"))["targets"]
        assert (await llama.state())["residents"]
    validate = await llama.cli_json("validate")
    assert validate["ok"] is True, validate["findings"]
    refused = await llama.cli("measure", "sleepy")
    assert refused.returncode == EXIT_REFUSED
    assert "engine is asleep (llama.cpp --sleep-idle-seconds)" in refused.stderr

    props = await llama.props("sleepy")
    assert props["is_sleeping"] is True, "still asleep after every probe"
    assert WOKE not in llama.engine_log("sleepy"), llama.engine_log("sleepy")[-2000:]
    assert await llama.main_pid("sleepy") == pid
    [sleepy] = [row for row in status["residents"] if row["model"] == "sleepy"]
    assert (sleepy["state"], sleepy.get("asleep")) == ("hot", True), "asleep, not failed"
    rails = target_of(targets, "sleepy")
    assert (rails["rails"], rails["live"]["detail"]) == (2, "total_slots 2"), (
        "a sleeping server's /props still counts its slots"
    )

    # The control: a request does wake it, and its log says so.
    answer = await llama.complete("sleepy", {"prompt": "hello", "max_tokens": 2})
    assert answer["usage"]["completion_tokens"] == 2
    assert (await llama.props("sleepy"))["is_sleeping"] is False
    assert WOKE in llama.engine_log("sleepy")
