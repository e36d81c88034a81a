"""``uapplace demo --engine llama.cpp`` for real: llama.cpp's own ``llama-server`` (issue 19).

The walkthrough runs on real ``llama-server`` units on the CPU tier: each tiny model is
measured from its real PIDs (host RSS on ``cpu0``, the larger model larger), a request
for the one not loaded is parked, the swap applies with every step, the retry forwards
and the new server answers, then unload and load. Afterwards nothing is left: no
cgroup, no process carrying the sandbox (every ``llama-server`` names its model file in
it), no sandbox directory; Ctrl-C in the middle removes the same.

Needs the binary ``make engine`` caches: skipped where it is not built, a failure under
``UAPPLACE_REQUIRE_ENGINES=1`` (CI). Without it the demo exits 2 naming the command
that builds it, having started nothing: that needs no binary and always runs.
"""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import pytest

from tests.systemd.conftest import APPLY_STEPS
from tests.systemd.test_demo import (
    DemoRun,
    assert_nothing_left,
    contained,  # noqa: F401 (a fixture)
    demo_cgroups,
    demo_env,
    ended_demo,  # noqa: F401 (a fixture)
    processes_mentioning,
)
from tests.worlds.steps import UNLOAD_STEPS
from uapplace.sim.llamacpp import llama_server_path, missing_binary

pytestmark = pytest.mark.systemd

REQUIRE_ENGINES = "UAPPLACE_REQUIRE_ENGINES"
CACHE_VARIABLES = ("UAPPLACE_ENGINE_CACHE", "XDG_CACHE_HOME", "HOME")
"""What decides where the cached binary is (:func:`uapplace.sim.llamacpp.llama_server_path`)."""
MEASURED = re.compile(
    r"uapplace measure (tiny-[bc]): host RSS ([\d.,]+) MiB on (\w+), GPU ([\d.]+) MiB "
    r"\(PIDs ([\d, ]+)\)"
)
PARKED = re.compile(r"tiny-c: park (plc-[0-9a-f]{6}) \(reason: not_resident\)")
STEP = re.compile(r"^\s+✓ ([a-z-]+)  ", re.MULTILINE)


def engine_env() -> dict[str, str]:
    """:func:`demo_env` keeping what locates the cached engine."""
    env = demo_env()
    env.update({k: os.environ[k] for k in CACHE_VARIABLES if k in os.environ})
    return env


@pytest.fixture
def llama_server() -> Path:
    """The binary the demo will find; skip (fail under ``UAPPLACE_REQUIRE_ENGINES=1``)."""
    path = llama_server_path(engine_env())
    why = missing_binary(path)
    if why is not None:
        if os.environ.get(REQUIRE_ENGINES) == "1":
            pytest.fail(f"{REQUIRE_ENGINES}=1 but {why}")
        pytest.skip(why)
    return path


def section(out: str, start: str, end: str) -> str:
    """The output from the line containing ``start`` to the one containing ``end``."""
    assert start in out and end in out, out
    return out[out.index(start) : out.index(end, out.index(start))]


@pytest.fixture
def engine_demo(
    contained: None,  # noqa: F811
    ended_demo: list[DemoRun],  # noqa: F811
    llama_server: Path,
) -> DemoRun:
    """``uapplace demo --engine llama.cpp`` started; ``ended_demo`` ends it if the test does not."""
    run = DemoRun.start("--engine", "llama.cpp", env=engine_env())
    ended_demo.append(run)
    return run


def test_the_real_engine_demo_measures_swaps_unloads_and_loads(
    engine_demo: DemoRun, llama_server: Path
) -> None:
    run = engine_demo
    code = run.finish()
    out = run.output
    assert code == 0, out
    sandbox = run.sandbox()

    # The units run the real binary on the sandbox's tiny models, with the flags.
    for model in ("tiny-b", "tiny-c"):
        assert (
            f"ExecStart={llama_server} -m {sandbox}/models/{model}.gguf --alias {model} "
            "--host 127.0.0.1 --port "
        ) in out, out
    assert "-c 512 --parallel 2 --metrics --sse-ping-interval 1" in out

    # Measured, not seeded: both on cpu0, no GPU memory, the larger model the larger.
    measured = {m.group(1): m for m in MEASURED.finditer(out)}
    assert set(measured) == {"tiny-b", "tiny-c"}, out
    rss = {key: float(m.group(2).replace(",", "")) for key, m in measured.items()}
    assert all(m.group(3) == "cpu0" and float(m.group(4)) == 0 for m in measured.values()), out
    assert 0 < rss["tiny-b"] < rss["tiny-c"], rss
    assert measured["tiny-b"].group(5) != measured["tiny-c"].group(5), "one process each"

    # The swap: forward, park, the impact, every step, the retry and a real answer.
    assert re.search(r"tiny-b: forward → cpu0:http://127\.0\.0\.1:\d+", out), out
    parked = PARKED.search(out)
    assert parked, out
    placement_id = parked.group(1)
    assert f"options for tiny-c ({placement_id})" in out
    assert "stops tiny-b/f32: session idle, context lost, reload needed" in out
    swap = section(out, f"uapplace apply {placement_id} 1", "The client retries")
    assert STEP.findall(swap) == APPLY_STEPS, swap
    assert f"resolved {placement_id}" in swap
    assert "applied in 10 steps, run run-" in swap
    retry = section(out, "The client retries", "The machine now")
    assert re.search(r"tiny-c: forward → cpu0:http://127\.0\.0\.1:\d+", retry), retry
    # The text is the repr of random-weight output: quoted with " when it holds a '.
    assert re.search(r"/v1/chat/completions → model tiny-c, text ['\"]", retry), retry

    # Unload and load, each enforced and followed.
    unload = section(out, "`uapplace unload tiny-c --yes`", "`uapplace load tiny-b --yes`")
    assert STEP.findall(unload) == UNLOAD_STEPS, unload
    assert "tiny-c unloaded in " in unload
    load = section(out, "`uapplace load tiny-b --yes`", "What the real engines showed")
    assert STEP.findall(load) == APPLY_STEPS, load
    assert "tiny-b loaded in " in load
    assert re.search(r"swap tiny-b → tiny-c \(apply\)\W+\d+\.\d\d s", out), out
    assert "demo finished; nothing left behind" in out

    assert_nothing_left(run, sandbox)


def test_ctrl_c_while_real_engines_run_removes_everything(engine_demo: DemoRun) -> None:
    run = engine_demo
    run.wait_for("uapplace measure tiny-b: host RSS")  # a llama-server runs
    sandbox = run.sandbox()
    assert any(f"{sandbox}/models/" in line for line in processes_mentioning(str(sandbox))), (
        "no llama-server of the sandbox runs while the demo does"
    )
    run.process.send_signal(signal.SIGINT)
    code = run.finish()
    assert code == 130, run.output
    assert "interrupted; cleaned up" in run.output
    assert_nothing_left(run, sandbox)


def test_without_the_engine_the_demo_names_the_build_and_starts_nothing(
    tmp_path: Path,
    ended_demo: list[DemoRun],  # noqa: F811
) -> None:
    env = {**demo_env(), "UAPPLACE_ENGINE_CACHE": str(tmp_path / "no-engines")}
    run = DemoRun.start("--engine", "llama.cpp", env=env)
    ended_demo.append(run)
    code = run.finish()
    out = " ".join(run.output.split())  # the console wraps long lines
    assert code == 2, out
    expected = tmp_path / "no-engines" / "llama.cpp-"
    assert f"llama-server is not built at {expected}" in out, out
    assert "`make engine`" in out and "`scripts/build-llama-server.sh`" in out, out
    assert "Nothing was started." in out
    assert "sandbox:" not in out
    assert demo_cgroups(run.process.pid) == []
