"""A new llama-server that cannot serve rolls the swap back, on the real engine.

Issue 19 ("Build", tier 4: "rollback when the new server cannot load"). As in
``test_swap.py``, ``cpu0`` holds one of the two models, so beta's only option displaces
alpha (tiny-a, running). Beta is each of the three ways a real llama-server fails to come
up (``tests/engines/test_world.py`` proves each does so on the real binary):

- a GGUF cut short: llama-server exits 1 while loading the tensors;
- a wrong ``--alias``: it comes up healthy, but ``/v1/models`` serves another id;
- a port already taken: it cannot bind its HTTP socket and exits 1.

Each time alpha is stopped, beta started, verify-up fails naming the cause, and the
rollback stops beta and restarts alpha (docs/placement-rules.md §4.6 step 8): alpha is a
new process, verified again, ``hot`` and serving; the parked request is still pending (a
complete rollback leaves it to the operator), beta is not a resident, and nothing of
beta runs.

The engine's own words for an exit 1 (``exiting due to model loading error``, ``couldn't
bind HTTP server socket``) are in its log file, which the unit appends to; uapplace's
step detail names the unit that failed and how systemd saw it end, and below that its
last lines from that file (docs/placement-rules.md §4.6, "Failed start").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import psutil
import pytest

from tests.worlds.llama import CORRUPT, LLAMA_TIMEOUTS, LlamaModel, LlamaWorld
from tests.worlds.steps import ROLLED_BACK_STEPS, detail
from uapplace.io.units import CLD_EXITED

pytestmark = pytest.mark.engines

RESERVED_MIB = 256
MODEL_MIB = 100.0


@dataclass(frozen=True)
class Failure:
    """One way beta cannot serve, and what is seen of it."""

    beta: LlamaModel
    engine_says: str | None
    """The line llama-server writes to its log before it exits 1 (``None``: it runs)."""


VICTIM = LlamaModel("alpha", "tiny-a", started=True, host_rss_mib=MODEL_MIB)
FAILURES = {
    "corrupt-gguf": Failure(
        LlamaModel("beta", CORRUPT, host_rss_mib=MODEL_MIB),
        "exiting due to model loading error",
    ),
    "wrong-alias": Failure(
        LlamaModel("beta", "tiny-a", alias="someone-else", host_rss_mib=MODEL_MIB), None
    ),
    "port-taken": Failure(
        LlamaModel("beta", "tiny-a", port_taken=True, host_rss_mib=MODEL_MIB),
        "couldn't bind HTTP server socket",
    ),
}


@pytest.fixture
def world_options() -> dict[str, Any]:
    """``cpu0`` holds one of the two (the reserve + 150 MiB)."""
    return {
        "timeouts": replace(LLAMA_TIMEOUTS, drain_s=10.0),
        "cpu_total_mib": RESERVED_MIB + 150,
        "cpu_reserved_mib": RESERVED_MIB,
    }


def expected_cause(world: LlamaWorld, how: str) -> str:
    """What verify-up names as the cause."""
    beta = world.engine("beta")
    if how == "wrong-alias":
        return (
            f"verify-up: {beta.endpoint} serves [someone-else], not beta "
            "(nor any id beta advertises)"
        )
    return f"verify-up: {beta.name} went failed/failed (result exit-code) while loading"


@pytest.mark.parametrize(
    ("how", "world_models"),
    [(how, (VICTIM, failure.beta)) for how, failure in FAILURES.items()],
    indirect=["world_models"],
    ids=list(FAILURES),
)
async def test_a_newcomer_that_cannot_serve_rolls_back_to_the_running_victim(
    llama: LlamaWorld, how: str
) -> None:
    alpha, beta = llama.engine("alpha"), llama.engine("beta")
    failure = FAILURES[how]
    placement = await llama.park("beta", "rollback-client")
    [option] = await llama.options_of(placement)
    assert (option["kind"], [v["model"] for v in option["victims"]]) == ("displace", ["alpha"])
    victim_pid = await llama.main_pid("alpha")

    result = await llama.resolve(placement, 1)

    assert (result["ok"], result["rolledBack"]) == (False, True), result
    assert [s["name"] for s in result["steps"]] == ROLLED_BACK_STEPS, result["steps"]
    assert result["error"].startswith(expected_cause(llama, how)), result["error"]
    # Its first line ends the error; a dead engine's own last lines follow below it
    # (docs/placement-rules.md §4.6, "Failed start"; tests/engines/test_failed_start.py).
    assert result["error"].splitlines()[0].endswith("; rolled back"), result["error"]
    if failure.engine_says is not None:
        assert failure.engine_says in result["error"], result["error"]
    assert detail(result, "stop") == f"stopped {alpha.name}"
    assert detail(result, "start") == f"started {beta.name}"

    # The rollback: beta down (seen), alpha restarted and verified on its own engine.
    rollback_stop = detail(result, "rollback-stop")
    assert rollback_stop.startswith(f"{beta.name}, which this run started, is "), rollback_stop
    assert rollback_stop.endswith("nothing of it runs"), rollback_stop
    assert detail(result, "rollback-start") == f"restarted {alpha.name} (alpha/alpha-f32)"
    assert detail(result, "rollback-verify").startswith(
        f"alpha/alpha-f32 healthy again: {alpha.name} active, {alpha.endpoint} healthy, "
        "serves alpha"
    ), detail(result, "rollback-verify")
    assert [(r["model"], r["unit"]) for r in result["runningAfter"]] == [("alpha", alpha.name)]

    # Alpha is a new process, hot and serving; nothing of beta runs; the request waits on.
    new_pid = await llama.main_pid("alpha")
    assert new_pid != victim_pid and not psutil.pid_exists(victim_pid)
    assert await llama.units.pids(beta.name) == []
    # Published hot again (the unit sync re-verifies the new process: warming for a moment).
    await llama.wait_resident("alpha", "hot")
    assert await llama.resident_states() == {"alpha": "hot"}
    assert await llama.admit("alpha") == {"decision": "forward", "target_id": alpha.target}
    answer = await llama.complete("alpha", {"prompt": "hello", "max_tokens": 4})
    assert (answer["model"], answer["usage"]["completion_tokens"]) == ("alpha", 4)
    entry = await llama.pending_entry(placement)
    assert entry is not None and entry["requested_model"] == "beta", entry
    assert await llama.alerts("rollback_incomplete") == []

    # How beta ended, as systemd and the engine saw it.
    state = await llama.unit_state("beta")
    if failure.engine_says is None:  # it ran, serving the wrong id, until the rollback stopped it
        assert (state.active_state, state.result) == ("inactive", "success")
    else:
        assert (state.active_state, state.result) == ("failed", "exit-code")
        assert (state.exec_main_code, state.exec_main_status) == (CLD_EXITED, 1)
        assert failure.engine_says in llama.engine_log("beta")
