"""``uapplace validate`` names a registry unit the user manager does not know (issue 21 item 8).

The live machine of :mod:`tests.systemd.live_world` (the real ``uapplaced`` on a contained
``systemd --user``): with every unit installed, ``validate`` is clean; once the registry
names a unit that has no unit file, it is an error at the entry that names it (before,
the first sign was a refused preflight when someone tried to load the model).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.systemd.live_world import LiveWorld, validate

pytestmark = pytest.mark.systemd

GHOST = "uap-ghost-engine"


async def test_validate_reports_a_registry_unit_that_does_not_exist(live: LiveWorld) -> None:
    code, report = await asyncio.to_thread(validate, live)
    assert (code, report["ok"]) == (0, True), report
    assert not [f for f in report["findings"] if f["json_path"].endswith(".unit")]

    registry = json.loads(live.uap.registry.read_text())
    registry["models"]["beta"]["unit"] = GHOST
    live.uap.write_registry(registry)
    code, report = await asyncio.to_thread(validate, live)

    assert code == 1 and report["ok"] is False, report
    (finding,) = [f for f in report["findings"] if f["json_path"] == "$.models.beta.unit"]
    assert finding["severity"] == "error"
    assert finding["file"] == str(live.uap.registry)
    assert finding["message"].startswith(
        f"unit {GHOST}.service does not exist: systemd's LoadState is 'not-found'"
    ), finding
    assert "then daemon-reload" in finding["message"]
    # alpha's unit is installed: nothing said about it.
    assert not [f for f in report["findings"] if f["json_path"] == "$.models.alpha.unit"]
