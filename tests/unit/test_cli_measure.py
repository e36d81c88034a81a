"""``uapplace measure``'s output: human text by default (each figure with where it came from),
JSON only with ``--json``. The daemon's answer is canned; the real command against a real
daemon is in the engines tier."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from click.testing import CliRunner

from uapplace.cli import app as cli

RESULT: dict[str, Any] = {
    "model": "tiny",
    "config": "c1",
    "unit": "uap-tiny.service",
    "pids": [4242],
    "written": "/home/u/.uap/model-registry.json",
    "measurement": {
        "status": "measured",
        "per_session_cap_cells": 256,
        "context_pool_cells": 512,
        "kv_resident_cells": 512,
        "kv_mib_per_1k_cells": 0.0,
        "kv": "f16",
        "resident_gpu_mib": 0.0,
        "host_rss_mib": 30.5,
        "measured_at": "2026-12-03T10:00:00Z",
        "measured_on": "cpu0",
        "host_free_mib": 20000.0,
    },
    "sources": {
        "per_session_cap_cells": "/props default_generation_settings.n_ctx",
        "slots": "2 (/props total_slots)",
        "context_pool_cells": "2 slots × 256 cells per slot (/props …)",
        "kv": "llama.cpp's default (no --cache-type-k/-ctk in ExecStart)",
        "host_rss_mib": "VmRSS of PIDs 4242 (resident mmap'd model pages included)",
    },
    "device": {"key": "cpu0", "kind": "cpu", "free_mib": 20000.0},
}


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """``call`` answers :data:`RESULT`; the list records each call made."""
    calls: list[str] = []

    def call(fn: Callable[[Any], Any]) -> Any:
        calls.append("measure")
        return RESULT

    monkeypatch.setattr(cli, "call", call)
    return calls


def test_measure_prints_text_by_default(measured: list[str]) -> None:
    result = CliRunner().invoke(cli.app, ["measure", "tiny"])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0] == "measured tiny/c1 (uap-tiny.service, PIDs 4242) on cpu0"
    assert "  host RSS: 30.5 MiB — VmRSS of PIDs 4242 (resident mmap'd model pages included)" in (
        lines
    )
    assert "  per-session cap: 256 cells — /props default_generation_settings.n_ctx" in lines
    assert "  context pool: 512 cells — 2 slots × 256 cells per slot (/props …)" in lines
    assert "  KV past the pool: 0 MiB per 1,000 cells" in lines
    assert "  slots: 2 (/props total_slots)" in lines
    assert "  device cpu0: free 20,000 MiB" in lines
    assert lines[-1] == "written to /home/u/.uap/model-registry.json"
    assert not result.output.lstrip().startswith("{")
    assert measured == ["measure"]


def test_measure_json_only_with_the_flag(measured: list[str]) -> None:
    result = CliRunner().invoke(cli.app, ["measure", "tiny", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output) == RESULT
