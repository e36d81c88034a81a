"""The engines tier drives the real ``llama-server``, not the fake (issue 19, "Must show").

The process behind a world's unit is the binary ``make engine`` built (``/proc/<pid>/exe``),
alone in its unit (no wrapper); its ``--version`` names the llama.cpp build that ``/props``
``build_info`` reports; the tiny model loads and answers ``/v1/completions``; and uapplaced
adopted it as a hot resident on the CPU tier, its registry clean and its rails agreeing.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.worlds.llama import LlamaWorld, argv_of, cgroup_of, exe_of
from uapplace.sim.llamacpp import read_pin
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.engines

VERSION_LINE = re.compile(r"version: (\S+) \(build (\d+), commit ([0-9a-f]+)\)")


def version_of(binary: Path) -> re.Match[str]:
    done = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    found = VERSION_LINE.search(done.stdout + done.stderr)
    assert found is not None, done.stdout + done.stderr
    return found


async def test_the_unit_runs_the_built_llama_server_alone(
    llama: LlamaWorld, llama_server: Path
) -> None:
    pid = await llama.main_pid("alpha")
    assert exe_of(pid) == llama_server
    assert argv_of(pid) == list(llama.engine("alpha").argv)
    assert "uapplace.sim.engine" not in " ".join(llama.engine("alpha").argv)
    assert await llama.units.pids(llama.engine("alpha").name) == [pid], "no wrapper, no child"
    # The cache entry is the pinned one: llama.cpp-<llama-cpp-python version>.
    assert llama_server.parent.parent.name == read_pin().entry_name


async def test_version_and_props_name_the_same_llama_cpp_build(
    llama: LlamaWorld, llama_server: Path
) -> None:
    version = version_of(llama_server)
    props = await llama.props("alpha")
    assert props["build_info"] == f"b{version.group(2)}-{version.group(3)}"
    recorded = (llama_server.parent.parent / "VERSION").read_text(encoding="utf-8")
    assert version.group(0) in recorded, "the build script recorded the same --version"


async def test_the_tiny_model_loads_and_answers_completions(llama: LlamaWorld) -> None:
    alpha = llama.engine("alpha")
    props = await llama.props("alpha")
    assert props["model_path"] == str(alpha.model_path)
    assert (props["total_slots"], props["default_generation_settings"]["n_ctx"]) == (2, 256)
    status, listing = await llama.engine_get("alpha", "/v1/models")
    assert status == 200
    assert [(m["id"], m["meta"]["n_params"]) for m in listing["data"]] == [("alpha", 120896)]

    body = {"prompt": "hello world", "max_tokens": 8, "ignore_eos": True}
    async with llama.http.post(f"{alpha.endpoint}/v1/completions", json=body) as reply:
        assert reply.status == 200, await reply.text()
        answer = await reply.json()
    assert (answer["object"], answer["model"]) == ("text_completion", "alpha")
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["choices"][0]["finish_reason"] == "length"


async def test_uapplaced_adopted_it_hot_on_the_cpu_tier(llama: LlamaWorld) -> None:
    status = await llama.cli_json("status")
    [alpha] = [row for row in status["residents"] if row["model"] == "alpha"]
    assert (alpha["state"], alpha["device"], alpha["unit"]) == (
        "hot",
        "cpu0",
        llama.engine("alpha").name,
    )
    assert "beta" not in {row["model"] for row in status["residents"]}
    report = await llama.cli_json("validate")
    assert (report["ok"], report["findings"]) == (True, []), "the world's registry is clean"
    [target] = (await llama.state())["targets"]
    assert (target["target_id"], target["rails"], target["agrees"]) == (
        llama.engine("alpha").target,
        2,
        True,
    ), "rails: the registry's 2 and the real engine's total_slots"


async def test_the_contained_manager_is_this_tiers_own(
    llama: LlamaWorld, user_manager: ContainedUserManager
) -> None:
    """The world's units run under this tier's manager, not the host's."""
    pid = await llama.main_pid("alpha")
    assert user_manager.name in cgroup_of(pid)
