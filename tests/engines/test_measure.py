"""``uapplace measure`` on real ``llama-server`` units (issue 19's findings, fixed).

- The footprint is the real PID's ``VmRSS`` and the KV geometry is recorded from ``/props``
  and the live ``ExecStart`` (``-c 512 --parallel 2``: 256 cells per slot, a pool of 512),
  so the measured config is placeable: no "cost unknown", no "never placeable", and a
  ``load`` of it runs. Two tiny models of different sizes measure clearly apart, and the
  resident adopted before it was measured moves to ``cpu0`` with the measured figure.
- ``measure --envelope`` takes the real unit down and up, records plausible times and
  leaves it running and serving.
- A re-measure after the unit changed (a bigger model, a larger ``-c``) is what the
  ledger's resident then carries (the "285.5 MiB kept" finding).
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from tests.worlds.llama import LlamaModel, LlamaWorld, TinyModels, exe_of, rss_mib
from uapplace.cli.session import EXIT_REFUSED
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.engines

UNMEASURED_PAIR = (
    LlamaModel("alpha", "tiny-a", started=True, measured=False),
    LlamaModel("beta", "tiny-c", started=True, measured=False),
)
"""Two running units nobody has measured yet: tiny-a (~16 MiB RSS), tiny-c (~70 MiB)."""
MEASURED_ALPHA = (LlamaModel("alpha", "tiny-a", started=True, host_rss_mib=64.0),)
"""Alpha running, its registry figure 64 MiB (what the world wrote, not what it holds)."""
CLEARLY_APART_MIB = 30.0
"""tiny-c's server holds ~54 MiB more than tiny-a's; less than this would be noise."""


def near(measured: float, live: float) -> bool:
    """The recorded RSS and a later ``VmRSS`` of the same idle process: within 10% (or
    2 MiB), the page cache and allocator moving a little between the two reads."""
    return abs(measured - live) <= max(2.0, 0.1 * live)


def local_config(world: LlamaWorld, key: str) -> dict[str, Any]:
    """``key``'s one config as the machine-local registry holds it."""
    document = json.loads(world.uap.local_registry.read_text(encoding="utf-8"))
    config: dict[str, Any] = document["models"][key]["configs"][f"{key}-f32"]
    return config


async def resident(world: LlamaWorld, key: str) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [
        row for row in (await world.state())["residents"] if row["model"] == key
    ]
    assert len(rows) == 1, rows
    return rows[0]


async def resident_at(world: LlamaWorld, key: str, host_rss: float) -> dict[str, Any]:
    """Until ``key``'s resident is hot on ``cpu0`` carrying ``host_rss`` (the reload after a
    measurement is the daemon's to finish)."""

    async def carried() -> dict[str, Any] | None:
        rows: list[dict[str, Any]] = (await world.state())["residents"]
        row = next((r for r in rows if r["model"] == key), None)
        if row is None or (row["state"], row["device"], row["host_rss_mib"]) != (
            "hot",
            "cpu0",
            host_rss,
        ):
            return None
        return row

    found: dict[str, Any] = await world.until(f"{key} hot on cpu0 at {host_rss} MiB", carried)
    return found


@pytest.mark.parametrize("world_models", [UNMEASURED_PAIR], indirect=True)
async def test_measure_records_the_real_rss_and_a_placeable_geometry(llama: LlamaWorld) -> None:
    alpha_pid, beta_pid = await llama.main_pid("alpha"), await llama.main_pid("beta")

    # The human output: each figure with where it came from, and no JSON.
    done = await llama.cli("measure", "alpha")
    assert done.returncode == 0, done.stderr + done.stdout
    text = done.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)
    unit = llama.engine("alpha").name
    assert f"measured alpha/alpha-f32 ({unit}, PIDs {alpha_pid}) on cpu0" in text
    shown = re.search(r"host RSS: ([\d.,]+) MiB — VmRSS of PIDs (\d+)", text)
    assert shown is not None, text
    assert int(shown.group(2)) == alpha_pid
    assert "per-session cap: 256 cells — /props default_generation_settings.n_ctx" in text
    assert re.search(r"context pool: 512 cells — 2 slots × 256 cells per slot .*--parallel 2", text)
    assert "KV past the pool: 0 MiB per 1,000 cells — 0: llama.cpp allocates its whole pool" in text
    assert "slots: 2 (/props total_slots)" in text
    assert f"written to {llama.uap.local_registry}" in text

    # --json: the bus result, sources included.
    beta = await llama.cli_json("measure", "beta")
    assert (beta["pids"], beta["written"]) == ([beta_pid], str(llama.uap.local_registry))
    assert beta["sources"]["host_rss_mib"].startswith(f"VmRSS of PIDs {beta_pid}")
    assert beta["sources"]["per_session_cap_cells"] == "/props default_generation_settings.n_ctx"

    # The figures are the real processes' and the geometry -c 512 --parallel 2 gives.
    alpha_rss, beta_rss = rss_mib(alpha_pid), rss_mib(beta_pid)
    alpha, written_beta = local_config(llama, "alpha"), local_config(llama, "beta")
    assert written_beta == beta["measurement"]
    for config, live in ((alpha, alpha_rss), (written_beta, beta_rss)):
        assert near(config["host_rss_mib"], live), (config["host_rss_mib"], live)
        assert (config["measured_on"], config["resident_gpu_mib"]) == ("cpu0", 0)
        assert (config["per_session_cap_cells"], config["context_pool_cells"]) == (256, 512)
        assert (config["kv_resident_cells"], config["kv_mib_per_1k_cells"]) == (512, 0)
    assert float(shown.group(1).replace(",", "")) == alpha["host_rss_mib"]
    assert alpha["flags"] == list(llama.engine("alpha").argv[1:]), "the live ExecStart"
    assert written_beta["host_rss_mib"] - alpha["host_rss_mib"] > CLEARLY_APART_MIB

    # Placeable: the residents (adopted before they were measured) carry the figures on
    # cpu0; validate finds nothing; preview and load of beta place it on cpu0.
    await resident_at(llama, "alpha", alpha["host_rss_mib"])
    await resident_at(llama, "beta", written_beta["host_rss_mib"])
    report = await llama.cli_json("validate")
    assert (report["ok"], report["findings"]) == (True, []), report["findings"]
    figures = {row["entry"]: row.get("measurement") for row in report["provenance"]}
    assert figures["$.models.beta.configs.beta-f32"] == "measured here (machine-local)"

    unloaded = await llama.cli_json("unload", "beta", "--yes")
    assert unloaded["ok"] is True, unloaded
    plan = await llama.cli_json("preview", "beta")
    assert [(o["kind"], o["device"], o["host_mib"]) for o in plan["options"]] == [
        ("load_alongside", "cpu0", written_beta["host_rss_mib"])
    ]
    seen = json.dumps(plan) + json.dumps(await llama.cli_json("validate"))
    assert "cost unknown" not in seen and "never placeable" not in seen
    loaded = await llama.cli_json("load", "beta", "--yes")
    assert loaded["ok"] is True, loaded
    assert "serves beta" in next(s["detail"] for s in loaded["steps"] if s["name"] == "verify-up")
    row = await resident_at(llama, "beta", written_beta["host_rss_mib"])
    assert row["main_pid"] != beta_pid and exe_of(row["main_pid"]) == llama.binary


@pytest.mark.parametrize("world_models", [MEASURED_ALPHA], indirect=True)
async def test_measure_envelope_times_a_real_stop_and_starts_and_leaves_it_serving(
    llama: LlamaWorld,
) -> None:
    before = await llama.main_pid("alpha")
    refused = await llama.cli("measure", "--envelope", "alpha")
    assert refused.returncode == EXIT_REFUSED
    assert f"stop {llama.engine('alpha').name}" in refused.stderr
    assert "Run again with --yes" in refused.stderr
    assert await llama.main_pid("alpha") == before, "nothing stopped without --yes"

    result = await llama.cli_json("measure", "--envelope", "alpha", "--yes")
    envelope = result["envelope"]
    assert (result["model"], result["config"], envelope["measured_on"]) == (
        "alpha",
        "alpha-f32",
        "cpu0",
    )
    # Plausible for a tiny model on this tier: each part took time, none a hang.
    for name in ("stop_s", "free_s", "cold_start_s", "warm_start_s"):
        assert 0 < envelope[name] < 30, (name, envelope)
    assert envelope["free_s"] >= envelope["stop_s"], "memory back only after the stop"
    assert local_config(llama, "alpha")["envelope"] == envelope

    # Running again: a new process of the real binary, healthy, serving, hot.
    after = await llama.main_pid("alpha")
    assert after != before and exe_of(after) == llama.binary
    assert (await llama.unit_state("alpha")).active_state == "active"
    answer = await llama.complete("alpha", {"prompt": "hello", "max_tokens": 4})
    assert (answer["model"], answer["usage"]["completion_tokens"]) == ("alpha", 4)
    await llama.wait_resident("alpha", "hot")
    assert (await resident(llama, "alpha"))["main_pid"] == after


@pytest.mark.parametrize("world_models", [MEASURED_ALPHA], indirect=True)
async def test_a_re_measure_is_what_the_ledger_then_carries(
    llama: LlamaWorld, user_manager: ContainedUserManager, tiny_models: TinyModels
) -> None:
    await resident_at(llama, "alpha", 64.0)  # the registry's figure, before any measure
    first = (await llama.cli_json("measure", "alpha"))["measurement"]
    await resident_at(llama, "alpha", first["host_rss_mib"])

    # The operator changes the unit: tiny-c, a pool of 1024. The resident comes back with
    # the figure measured for tiny-a; the re-measure must replace it.
    await llama.relaunch(
        "alpha", user_manager.unit_dir, tiny_models, preset="tiny-c", ctx_size=1024
    )
    await resident_at(llama, "alpha", first["host_rss_mib"])
    second = (await llama.cli_json("measure", "alpha"))["measurement"]
    assert second["host_rss_mib"] - first["host_rss_mib"] > CLEARLY_APART_MIB
    assert near(second["host_rss_mib"], rss_mib(await llama.main_pid("alpha")))
    assert (second["per_session_cap_cells"], second["context_pool_cells"]) == (512, 1024)
    await resident_at(llama, "alpha", second["host_rss_mib"])

    def on_disk() -> float | None:
        ledger = json.loads(llama.uap.ledger.read_text(encoding="utf-8"))
        row = next(r for r in ledger["residents"] if r["model"] == "alpha")
        figure: float | None = row["host_rss_mib"]
        return figure

    wanted: float = second["host_rss_mib"]

    async def written() -> bool:
        return on_disk() == wanted

    await llama.until("the ledger file to carry the re-measured figure", written)
