"""A real llama-server that cannot load its model: uapplace says why, in the engine's words.

Issue 19 ("engine stderr of a failed start is nowhere in uapplace's output"), issue 21
item 2, issue 22 (``uapplace logs``); docs/placement-rules.md §4.6 ("Failed start").
Alpha (tiny-a) runs; beta's GGUF is cut short, so the real ``llama-server`` prints
``failed to load model`` and ``exiting due to model loading error`` to stderr and exits
1. Its unit appends stdout and stderr to its log file (``tests/worlds/llama.py``), which
is where uapplace reads them from (the contained manager has no journald). ``cpu0`` holds
both, so ``uapplace load beta`` displaces nothing: start → verify-up fails → rollback
stops beta.

- The CLI prints beta's last lines under the failed ``verify-up`` step; its ``error:``
  line stays one line; ``--json``'s step detail and ``error`` carry the lines below
  their first line.
- ``uapplace logs beta`` prints them from the log file; ``uapplace logs alpha -n 5``
  prints five lines of the running server's own log.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.worlds.llama import CORRUPT, LlamaModel, LlamaWorld
from tests.worlds.steps import LOAD_FAILED_STEPS
from uapplace.io.unitlogs import BLOCK_INDENT, DEFAULT_LINES, block_lines, split_last_lines

pytestmark = pytest.mark.engines

MODELS = (LlamaModel("alpha", "tiny-a", started=True), LlamaModel("beta", CORRUPT))


def failed_step(result: dict[str, Any]) -> dict[str, Any]:
    [step] = [s for s in result["steps"] if not s["ok"]]
    assert isinstance(step, dict)
    return step


@pytest.mark.parametrize("world_models", [MODELS], indirect=True, ids=["corrupt-beta"])
async def test_a_model_that_cannot_load_is_reported_with_the_engines_own_lines(
    llama: LlamaWorld,
) -> None:
    beta = llama.engine("beta")

    done = await llama.cli("load", "beta", "--yes")

    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    [failed] = [line for line in lines if "FAILED" in line]
    assert "verify-up: " in failed and f"{beta.name} went failed/failed" in failed, done.stdout
    assert failed.endswith(f"of {beta.name} (from {beta.log_path}):"), failed
    below = lines[lines.index(failed) + 1 : lines.index(failed) + 1 + DEFAULT_LINES]
    assert all(line.startswith(BLOCK_INDENT) for line in below), done.stdout
    assert any("failed to load model" in line for line in below), done.stdout
    assert below[-1].endswith("exiting due to model loading error"), done.stdout
    [error] = [line for line in lines if line.startswith("  error: ")]
    assert error.startswith(f"  error: verify-up: {beta.name} went failed/failed"), error
    assert error.endswith("; rolled back"), error

    # The same run again, as JSON: the step detail and the error carry the lines.
    done = await llama.cli("load", "beta", "--yes", "--json")
    assert done.returncode == 1, done.stderr
    result = json.loads(done.stdout)
    assert [s["name"] for s in result["steps"]] == LOAD_FAILED_STEPS, result["steps"]
    step = failed_step(result)
    assert step["name"] == "verify-up"
    detail = str(step["detail"])
    head, block = split_last_lines(detail)
    assert head.endswith(f"of {beta.name} (from {beta.log_path})"), head
    engine_lines = block_lines(block)
    assert len(engine_lines) == DEFAULT_LINES, engine_lines
    assert any("failed to load model" in line for line in engine_lines), engine_lines
    assert engine_lines[-1].endswith("exiting due to model loading error"), engine_lines
    # What the engine really wrote, last lines first to last, control characters stripped.
    written = [line.strip() for line in llama.engine_log("beta").splitlines() if line.strip()]
    assert engine_lines == written[-DEFAULT_LINES:], (engine_lines, written[-DEFAULT_LINES:])
    assert result["error"] == f"verify-up: {head}; rolled back{block}", result["error"]
    assert await llama.resident_states() == {"alpha": "hot"}
    assert await llama.units.pids(beta.name) == []

    # `uapplace logs`: beta's file, and the running alpha's own log.
    done = await llama.cli("logs", "beta", "-n", "3")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == written[-3:], done.stdout
    assert f"last 3 lines of {beta.name} (from {beta.log_path}), model beta" in done.stderr

    done = await llama.cli("logs", "alpha", "-n", "5", "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    alpha = llama.engine("alpha")
    assert (answer["unit"], answer["source"]) == (alpha.name, str(alpha.log_path))
    assert answer["unit_from"] == "its resident alpha/alpha-f32"
    alpha_lines = [line.strip() for line in llama.engine_log("alpha").splitlines()]
    assert len(answer["lines"]) == 5 and set(answer["lines"]) <= set(alpha_lines), answer
