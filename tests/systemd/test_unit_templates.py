"""``uapplace unit add`` → ``measure`` → ``load`` of a generated unit on a contained
``systemd --user``, then ``unit remove`` (refused while resident).

The unit comes from ``systemd/templates/fake.service`` (the simulated engine, claiming
3000 MiB of the simulated GPU); the CLI writes it where the contained manager reads
units (``$XDG_CONFIG_HOME/systemd/user``) and registers the model unmeasured in the
machine-local registry. Placement refuses it until ``measure`` records its footprint;
then ``load`` starts it through enforcement like any hand-written backend.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.bus.conftest import TEST_REGISTRY, DaemonProcess, UapEnv, start_daemon
from tests.systemd.conftest import GUARD_S, free_port
from tests.systemd.placement_world import FAST
from uapplace.sim import proxy as sim_proxy
from uapplace.sim.gpu import sim_uuid
from uapplace.sim.usermanager import ContainedUserManager

pytestmark = pytest.mark.systemd

NAME = "tiny"
UNIT = f"uap-{NAME}.service"
MIB = 3000


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


async def cli(uap: UapEnv, *args: str) -> subprocess.CompletedProcess[str]:
    """The CLI in a thread: the test's loop keeps serving the fake proxy meanwhile."""
    argv = [sys.executable, "-m", "uapplace.cli", *args]
    return await asyncio.to_thread(_run, argv, uap.env)


async def cli_json(uap: UapEnv, *args: str) -> Any:
    """``--json`` before a ``--`` (what follows it goes to the engine as it is)."""
    cut = args.index("--") if "--" in args else len(args)
    done = await cli(uap, *args[:cut], "--json", *args[cut:])
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout)


async def systemctl(uap: UapEnv, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(_run, ["systemctl", "--user", *args], uap.env)


async def residents(uap: UapEnv) -> dict[str, str]:
    state = await cli_json(uap, "status")
    return {r["model"]: r["state"] for r in state["residents"]}


@pytest.fixture
async def daemon(uap: UapEnv, user_manager: ContainedUserManager) -> AsyncIterator[DaemonProcess]:
    # The CLI and the daemon see the contained manager's unit directory; the drain asks
    # a fake proxy (nothing in flight) for what is in flight.
    uap.env["XDG_CONFIG_HOME"] = str(user_manager.config_home)
    runner, proxy_url = await sim_proxy.start(sim_proxy.FakeProxy())
    uap.env["UAP_PROXY_URL"] = proxy_url
    # The tier's devices and no model: the one model here is the generated one.
    uap.write_registry({"version": 1, "devices": TEST_REGISTRY["devices"], "models": {}})
    timeouts = uap.home / "enforcement-timeouts.json"
    timeouts.write_text(json.dumps(FAST.to_json()), encoding="utf-8")
    started = await asyncio.to_thread(start_daemon, uap)
    try:
        yield started
    finally:
        await systemctl(uap, "stop", UNIT)
        (user_manager.unit_dir / UNIT).unlink(missing_ok=True)
        await systemctl(uap, "daemon-reload")
        code = await asyncio.to_thread(started.stop)
        await runner.cleanup()
        assert code == 0, started.log()


async def engine_healthy(port: int) -> None:
    """Until the engine on ``port`` answers ``/health`` 200 (loaded), within the tier's guard."""

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    async with asyncio.timeout(GUARD_S):
        while True:
            if await asyncio.to_thread(healthy):
                return
            await asyncio.sleep(0.05)


async def test_unit_add_then_measure_then_load_then_remove(
    daemon: DaemonProcess, user_manager: ContainedUserManager
) -> None:
    uap = daemon.uap
    port = free_port()
    engine_flags = ["--gpu-uuid", sim_uuid(0), "--mib", str(MIB), "--load-secs", "0.2"]
    added = await cli_json(
        uap,
        "unit",
        "add",
        NAME,
        "--engine",
        "fake",
        "--port",
        str(port),
        "--device",
        "gpu0",
        "--env",
        f"UAPPLACE_SIM_GPU={uap.env['UAPPLACE_SIM_GPU']}",
        "--",
        *engine_flags,
    )
    unit_file = user_manager.unit_dir / UNIT
    assert added["unit"] == str(unit_file) and added["status"] == "unmeasured"
    assert added["reload"] == "the user manager reloaded its unit files"
    text = unit_file.read_text()
    assert text.startswith("# Written by `uapplace unit add`")
    assert "NoNewPrivileges=yes" in text and "SystemCallFilter=@system-service" in text
    shown = await systemctl(uap, "show", UNIT, "-p", "LoadState,NoNewPrivileges,UMask")
    assert sorted(shown.stdout.split()) == ["LoadState=loaded", "NoNewPrivileges=yes", "UMask=0077"]
    local = json.loads(uap.local_registry.read_text())
    assert local["models"][NAME] == {
        "display": NAME,
        "engine": "llama.cpp",
        "unit": f"uap-{NAME}",
        "endpoint": f"http://127.0.0.1:{port}",
        "configs": {"default": {"status": "unmeasured"}},
        "affinity": {"device": ["gpu0"]},
    }
    listed = (await cli_json(uap, "unit", "list"))["units"]
    assert listed == [
        {
            "name": NAME,
            "unit": UNIT,
            "engine": "llama.cpp",
            "endpoint": f"http://127.0.0.1:{port}",
            "configs": {"default": "unmeasured"},
            "resident": "no",
        }
    ]
    # Validate checks it like a hand-written unit: the daemon re-read the registry.
    validation = await cli_json(uap, "validate")
    assert validation["ok"] is True, validation
    assert {
        "severity": "warning",
        "file": str(uap.registry),
        "json_path": f"$.models.{NAME}.rails",
        "message": "rails unknown; concurrency not trusted",
    } in validation["findings"], validation
    config_rows = [
        row
        for row in validation["provenance"]
        if row["kind"] == "config" and f"models.{NAME}." in row["entry"]
    ]
    assert [(row["source"], row["file"]) for row in config_rows] == [
        ("local", str(uap.local_registry))
    ], validation

    # Unmeasured: placement refuses it.
    refused = await cli(uap, "load", NAME, "--yes")
    assert refused.returncode != 0
    assert "unmeasured" in refused.stdout + refused.stderr

    # measure reads the running engine; then it is stopped and placed by load.
    assert (await systemctl(uap, "start", UNIT)).returncode == 0
    # The CLI starts in ~0.3 s now (issue 23), less than the fake engine's load: wait for it.
    await engine_healthy(port)
    measured = await cli_json(uap, "measure", NAME, "default")
    assert measured["unit"] == UNIT, measured
    assert measured["measurement"]["resident_gpu_mib"] == pytest.approx(MIB, abs=1), measured
    local = json.loads(uap.local_registry.read_text())
    assert local["models"][NAME]["configs"]["default"]["status"] == "measured"
    if NAME in await residents(uap):
        assert (await cli(uap, "unload", NAME, "--yes")).returncode == 0
    assert (await systemctl(uap, "stop", UNIT)).returncode == 0

    loaded = await cli_json(uap, "load", NAME, "--yes")
    assert loaded["ok"] is True, loaded
    assert (await residents(uap)).get(NAME) == "hot"
    assert (await systemctl(uap, "is-active", UNIT)).stdout.strip() == "active"

    # remove refuses a resident, then takes exactly what add wrote.
    busy = await cli(uap, "unit", "remove", NAME)
    assert busy.returncode == 1 and f"{NAME} is resident" in busy.stderr
    assert unit_file.exists()
    assert (await cli(uap, "unload", NAME, "--yes")).returncode == 0
    removed = await cli_json(uap, "unit", "remove", NAME)
    assert removed["registry_entry_removed"] is True
    assert not unit_file.exists()
    assert NAME not in json.loads(uap.local_registry.read_text()).get("models", {})
    assert await cli_json(uap, "unit", "list") == {"units": []}
