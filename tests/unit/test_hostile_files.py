"""Hostile files: every reader refuses deep, oversized and non-finite input by name.

Per file, the README's fallback rule holds: a broken repo registry, capacity policy or
timeouts file is a named :class:`ConfigFileError`; a broken local registry is ignored
and reported (never a start failure); a broken auto policy means auto is off; a broken
ledger is moved aside; a broken simulated GPU file is a named error the probe reports.
Bad items inside a usable ledger are dropped alone. The CLI prints no escape sequences.
"""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from rich.table import Table

from uapplace.cli import files as cli_files
from uapplace.cli import session as cli_session
from uapplace.controller.controller import Controller
from uapplace.core import textsafe
from uapplace.core.alerts import AlertKind
from uapplace.files import jsonfile
from uapplace.files.autopolicy import AutoPolicy, load_auto_policy
from uapplace.files.capacity import load_capacity_policy
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.ledger import (
    Ledger,
    LedgerDoc,
    LedgerFileError,
    LedgerFormatError,
    parse_ledger_text,
)
from uapplace.files.paths import Paths
from uapplace.files.registry import load_registry
from uapplace.files.timeouts import Timeouts
from uapplace.sim.gpu import SimGpu, SimGpuError, SimGpuFileError

SAMPLE_LEDGER: dict[str, Any] = {
    "version": 1,
    "updated_at": "2026-10-08T14:02:11Z",
    "devices": {
        "gpu0": {
            "kind": "gpu",
            "total_mib": 24576.0,
            "free_mib": 1016.25,
            "source": "nvml",
            "processes": [
                {"pid": 4242, "used_mib": 21812.0, "command": "strata-server --port 8080"}
            ],
            "uuid": "GPU-5c1e",
        },
        "gpu1": {
            "kind": "gpu",
            "total_mib": 0.0,
            "free_mib": 0.0,
            "source": "absent",
            "processes": [],
            "error": "NVML: Not Found",
        },
        "cpu0": {
            "kind": "cpu",
            "total_mib": 126944.0,
            "free_mib": 30424.0,
            "source": "MemAvailable",
            "processes": [],
        },
    },
    "residents": [
        {
            "model": "qwen3.8-flash",
            "config": "strata-iq3_s",
            "device": "gpu0",
            "engine": "strata",
            "endpoint": "http://127.0.0.1:8080",
            "unit": "uap-strata-server.service",
            "state": "hot",
            "gpu_mib": 21812.0,
            "host_rss_mib": 52857.0,
            "holders": [
                {"client": "ide", "kind": "hold", "detail": "pinned for a demo", "cookie": 7}
            ],
            "since": "2026-10-08T09:14:02Z",
            "main_pid": 4242,
        },
        {
            "model": "small",
            "config": "cpu",
            "device": "cpu0",
            "engine": "llama.cpp",
            "endpoint": None,
            "unit": None,
            "state": "warming",
            "gpu_mib": None,
            "host_rss_mib": None,
            "holders": [],
            "since": "2026-10-08T14:00:00Z",
        },
    ],
    "pending": [
        {
            "id": "plc-7f2a",
            "requested_model": "qwen3.8-27b",
            "client": "claude-code",
            "session": "sess-1",
            "pid": 41122,
            "created_at": "2026-10-08T14:02:00Z",
            "expires_at": "2026-10-08T14:04:00Z",
            "reason": "not_resident",
            "cells": 65536,
            "options": [
                {
                    "kind": "reuse",
                    "model": "qwen3.8-27b",
                    "config": "q4",
                    "device": "gpu1",
                    "cost_mib": 0.0,
                },
                {
                    "kind": "load_alongside",
                    "model": "qwen3.8-27b",
                    "config": "q4",
                    "device": "gpu1",
                    "cost_mib": 18000.5,
                    "affinityMatch": True,
                },
                {
                    "kind": "displace",
                    "model": "qwen3.8-27b",
                    "config": "q4",
                    "device": "gpu0",
                    "cost_mib": 19999.125,
                    "victims": [
                        {
                            "model": "qwen3.8-flash",
                            "config": "strata-iq3_s",
                            "state": "hot",
                            "device": "gpu0",
                            "holders": [
                                {
                                    "client": "claude-code",
                                    "kind": "inflight",
                                    "detail": "sess-1",
                                    "started_at": "2026-10-08T14:01:00Z",
                                }
                            ],
                            "in_flight": None,
                            "frees_mib": 21812.0,
                            "consequence": "kill: reload from disk takes ~90 s",
                            "reload_mib": 21812.0,
                        }
                    ],
                    "signature": ["qwen3.8-flash/strata-iq3_s"],
                    "frees_mib": 21812.0,
                },
            ],
        },
        {
            "id": "plc-0001",
            "requested_model": "mystery",
            "client": "curl",
            "session": None,
            "pid": None,
            "created_at": "2026-10-08T14:02:00Z",
            "expires_at": "2026-10-08T14:04:00Z",
            "reason": "unknown_model",
            "cells": 32768,
            "options": [],
        },
    ],
    "usage": {"qwen3.8-flash": "2026-10-08T14:01:30Z"},
    "cooldowns": {"small": "2026-10-08T14:12:00Z"},
    "alerts": [],
}
"""A valid ledger (``test_ledger.full_doc()`` as JSON): devices, residents, pending, usage."""

REPO_CONFIG = Path(__file__).resolve().parents[2] / "config"
DEEP = "[" * 100_000 + "]" * 100_000
JUST_TOO_DEEP = '{"a":' * 64 + "{}" + "}" * 64


def oversized(limit: int) -> str:
    return '{"pad": "' + "x" * limit + '"}'


HOSTILE = {
    "deep": DEEP,
    "just too deep": JUST_TOO_DEEP,
    "oversized": oversized(jsonfile.CONFIG_MAX_BYTES),
    "nan": '{"version": 1, "x": NaN}',
    "infinity": '{"version": 1, "x": [Infinity]}',
    "overflow": '{"version": 1, "x": 1e999}',
}
REASONS = {
    "deep": "nested deeper than 64 levels",
    "just too deep": "nested deeper than 64 levels",
    "oversized": "over the 4 MiB limit",
    "nan": "NaN is not a finite number",
    "infinity": "Infinity is not a finite number",
    "overflow": "1e999 is not a finite number",
}
CASES = pytest.mark.parametrize("case", list(HOSTILE))


def put(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def sandbox(tmp_path: Path) -> Paths:
    config = tmp_path / "config"
    config.mkdir()
    for name in ("model-registry.json", "capacity-policy.json"):
        shutil.copy(REPO_CONFIG / name, config / name)
    (tmp_path / "home").mkdir()
    return Paths.from_env(
        {
            "HOME": str(tmp_path),
            "UAP_HOME": str(tmp_path / "home"),
            "UAPPLACE_CONFIG_DIR": str(config),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),
        }
    )


# --------------------------------------------------------------------------- registries


@CASES
def test_repo_registry_is_a_named_error(tmp_path: Path, case: str) -> None:
    repo = put(tmp_path / "model-registry.json", HOSTILE[case])
    with pytest.raises(ConfigFileError, match=REASONS[case]) as caught:
        load_registry(repo, None)
    assert caught.value.file == repo


@CASES
def test_local_registry_is_ignored_and_reported_not_fatal(tmp_path: Path, case: str) -> None:
    local = put(tmp_path / "local.json", HOSTILE[case])
    loaded = load_registry(REPO_CONFIG / "model-registry.json", local)
    assert loaded.registry.models  # the repo defaults are in force
    assert [e.file for e in loaded.errors] == [local]
    assert REASONS[case] in loaded.errors[0].message


@CASES
def test_the_daemon_starts_with_a_hostile_local_registry(tmp_path: Path, case: str) -> None:
    paths = sandbox(tmp_path)
    put(paths.local_registry, HOSTILE[case])
    controller = Controller.open(paths)
    assert controller.registry.models
    assert REASONS[case] in controller.config.state.registry_load.errors[0].message


@CASES
def test_validate_prints_the_named_error_not_a_traceback(
    tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = sandbox(tmp_path)
    put(paths.repo_registry, HOSTILE[case])
    put(paths.capacity_policy, HOSTILE[case])
    monkeypatch.setenv("UAPPLACE_CONFIG_DIR", str(paths.config_dir))
    monkeypatch.setenv("UAP_HOME", str(paths.uap_home))
    report = cli_files.validate_locally()
    assert report["ok"] is False
    assert [f["file"] for f in report["findings"]] == [str(paths.repo_registry)]
    assert REASONS[case] in report["findings"][0]["message"]


# --------------------------------------------------------------------------- policies, timeouts


@CASES
def test_capacity_policy_is_a_named_error(tmp_path: Path, case: str) -> None:
    path = put(tmp_path / "capacity-policy.json", HOSTILE[case])
    with pytest.raises(ConfigFileError, match=REASONS[case]):
        load_capacity_policy(path)


def test_capacity_policy_refuses_a_non_finite_metric(tmp_path: Path) -> None:
    text = '{"services": [{"name": "s", "metricsMustMatch": {"m": NaN}}]}'
    with pytest.raises(ConfigFileError) as caught:
        load_capacity_policy(put(tmp_path / "capacity-policy.json", text))
    assert caught.value.json_path == "$.services[0].metricsMustMatch.m"


@CASES
def test_auto_policy_means_auto_off_and_says_why(tmp_path: Path, case: str) -> None:
    path = put(tmp_path / "placement-auto.json", HOSTILE[case])
    policy, findings = load_auto_policy(path)
    assert policy == AutoPolicy() and not policy.enabled
    assert len(findings) == 1
    assert REASONS[case] in findings[0] and findings[0].endswith("auto is off")


def test_auto_policy_with_an_infinite_window_is_off(tmp_path: Path) -> None:
    text = '{"enabled": true, "allow_displace": ["m"], "unload_idle_after_secs": 1e999}'
    policy, findings = load_auto_policy(put(tmp_path / "placement-auto.json", text))
    assert not policy.enabled and policy.idle_window_s is None
    assert "$.unload_idle_after_secs" in findings[0]


@CASES
def test_enforcement_timeouts_file_is_a_named_error(tmp_path: Path, case: str) -> None:
    path = put(tmp_path / "enforcement-timeouts.json", HOSTILE[case])
    with pytest.raises(ConfigFileError, match=REASONS[case]):
        Timeouts.load(path)


def test_an_infinite_timeout_is_refused(tmp_path: Path) -> None:
    path = put(tmp_path / "enforcement-timeouts.json", '{"stop_s": Infinity}')
    with pytest.raises(ConfigFileError) as caught:
        Timeouts.load(path)
    assert caught.value.json_path == "$.stop_s"


# --------------------------------------------------------------------------- simulated GPU


@CASES
def test_sim_gpu_state_is_a_named_error(tmp_path: Path, case: str) -> None:
    path = put(tmp_path / "sim-gpu.json", HOSTILE[case])
    with pytest.raises(SimGpuFileError, match=REASONS[case]) as caught:
        SimGpu(path).read()
    assert isinstance(caught.value, ConfigFileError) and isinstance(caught.value, SimGpuError)


def test_sim_gpu_refuses_a_nan_allocation(tmp_path: Path) -> None:
    gpu = SimGpu(tmp_path / "sim-gpu.json")
    state = gpu.create([("sim", 24576)])
    text = (tmp_path / "sim-gpu.json").read_text()
    data = json.loads(text)
    data["allocations"] = [{"pid": 1, "used_mib": 1, "uuid": state.devices[0].uuid, "command": "x"}]
    put(tmp_path / "sim-gpu.json", json.dumps(data).replace('"used_mib": 1', '"used_mib": NaN'))
    with pytest.raises(SimGpuFileError) as caught:
        gpu.read()
    assert caught.value.json_path == "$.allocations[0].used_mib"


# --------------------------------------------------------------------------- the ledger


LEDGER_CASES = {
    "deep": DEEP,
    "just too deep": JUST_TOO_DEEP,
    "oversized": oversized(jsonfile.LEDGER_MAX_BYTES),
    "not an object": "[]",
    "not json": "{",
}


@pytest.mark.parametrize("case", list(LEDGER_CASES))
def test_a_hostile_ledger_is_moved_aside_and_work_continues(tmp_path: Path, case: str) -> None:
    path = put(tmp_path / "placement.json", LEDGER_CASES[case])
    ledger = Ledger(path)
    assert ledger.read() == LedgerDoc()
    aside = list(tmp_path.glob("placement.json.corrupt-*"))
    assert len(aside) == 1 and not path.exists()
    assert ledger.last_error is not None and str(aside[0]) in ledger.last_error
    ledger.update(lambda doc: doc.usage.update(m=1.0e9))
    assert ledger.read().usage == {"m": 1.0e9}


def test_an_unknown_top_level_field_is_ignored_and_said(tmp_path: Path) -> None:
    data = dict(SAMPLE_LEDGER, journal={"deep": json.loads("[" * 70 + "]" * 70)})
    doc = parse_ledger_text(json.dumps(data).encode())
    assert doc.dropped == ["placement.json: journal: unknown top-level field, ignored"]
    assert len(doc.pending) == len(SAMPLE_LEDGER["pending"])


def test_a_ledger_between_the_config_cap_and_its_own_cap_reads(tmp_path: Path) -> None:
    data = json.loads(json.dumps(SAMPLE_LEDGER))
    data["residents"][0]["engine"] = "e" * (jsonfile.CONFIG_MAX_BYTES + 10)
    path = put(tmp_path / "placement.json", json.dumps(data))
    assert Ledger(path).read().residents[0].engine.startswith("eee")


def ledger_text(mutate: Callable[[dict[str, Any]], None]) -> bytes:
    data = json.loads(json.dumps(SAMPLE_LEDGER))
    mutate(data)
    return json.dumps(data).encode()


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_non_finite_gpu_mib_drops_that_resident_alone(literal: str) -> None:
    def mutate(data: dict[str, Any]) -> None:
        data["residents"].append(dict(data["residents"][0], model="other"))
        data["residents"][0]["gpu_mib"] = "@@"

    raw = ledger_text(mutate).replace(b'"@@"', literal.encode())
    doc = parse_ledger_text(raw)
    assert [r.model for r in doc.residents] == ["small", "other"]
    assert len(doc.dropped) == 1
    assert "residents[0].gpu_mib" in doc.dropped[0] and "resident alone" in doc.dropped[0]
    assert "finite" in doc.dropped[0]


def test_an_unknown_field_in_one_pending_entry_drops_that_entry_alone() -> None:
    def mutate(data: dict[str, Any]) -> None:
        first = data["pending"][0]
        data["pending"] = [
            dict(first, id="plc-00000a"),
            dict(first, id="plc-00000b", surprise=1),
            dict(first, id="plc-00000c", client="c"),
        ]

    doc = parse_ledger_text(ledger_text(mutate))
    assert [p.id for p in doc.pending] == ["plc-00000a", "plc-00000c"]
    assert doc.dropped == [
        "placement.json: pending[1].surprise: Extra inputs are not permitted; "
        "dropped this pending entry alone"
    ]


def sizes(doc: LedgerDoc) -> int:
    return sum(
        len(items) for items in (doc.pending, doc.residents, doc.devices, doc.usage, doc.cooldowns)
    )


TOO_DEEP_VALUE = "[" * 70 + "]" * 70


@pytest.mark.parametrize(
    ("mutate", "literal", "where", "added"),
    [
        (lambda d: d["pending"][0].update(options="x"), "", "pending[0].options", 0),
        (lambda d: d["pending"].insert(0, 5), "", "pending[0]", 1),
        (
            lambda d: d["pending"][0]["options"][0].update(cost_mib="@@"),
            "NaN",
            "pending[0].options[0].cost_mib",
            0,
        ),
        (lambda d: d["residents"][0].update(state="asleep"), "", "residents[0].state", 0),
        (lambda d: d["devices"]["gpu0"].update(free_mib="@@"), "-Infinity", "devices.gpu0", 0),
        (lambda d: d["usage"].update(m="soon"), "", "usage.m", 1),
        (lambda d: d["cooldowns"].update(small=[1]), "", "cooldowns.small", 0),
        (lambda d: d["pending"][0].update(deep="@@"), TOO_DEEP_VALUE, "pending[0].deep", 0),
        (lambda d: d["residents"][0].update(dup="@@"), '{"k": 1, "k": 2}', "residents[0].dup", 0),
    ],
)
def test_every_bad_item_is_dropped_alone_and_named(
    mutate: Any, literal: str, where: str, added: int
) -> None:
    before = parse_ledger_text(ledger_text(lambda d: None))
    doc = parse_ledger_text(ledger_text(mutate).replace(b'"@@"', literal.encode()))
    assert len(doc.dropped) == 1 and where in doc.dropped[0], doc.dropped
    assert sizes(doc) == sizes(before) + added - 1


def test_items_dropped_on_update_are_gone_from_the_file(tmp_path: Path) -> None:
    def mutate(data: dict[str, Any]) -> None:
        data["pending"][0]["surprise"] = True

    path = tmp_path / "placement.json"
    path.write_bytes(ledger_text(mutate))
    ledger = Ledger(path)
    ledger.update(lambda doc: None)
    assert parse_ledger_text(path.read_bytes()).dropped == []
    assert not list(tmp_path.glob("*.corrupt-*"))
    assert "NaN" not in path.read_text()


def test_a_nan_in_memory_is_written_as_null_not_nan(tmp_path: Path) -> None:
    ledger = Ledger(tmp_path / "placement.json")
    broken = replace(parse_ledger_text(json.dumps(SAMPLE_LEDGER).encode()).residents[0])
    ledger.update(lambda doc: doc.residents.append(replace(broken, gpu_mib=float("nan"))))
    text = (tmp_path / "placement.json").read_text()
    assert "NaN" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} written"))
    assert ledger.read().residents[0].gpu_mib is None


def test_whole_file_problems_are_ledger_file_errors_with_the_file() -> None:
    with pytest.raises(LedgerFileError) as caught:
        parse_ledger_text(b'{"version": 2, "updated_at": "2026-10-08T14:02:11Z"}', Path("/x/p"))
    assert isinstance(caught.value, ConfigFileError)
    assert isinstance(caught.value, LedgerFormatError)
    assert caught.value.file == Path("/x/p") and "version" in caught.value.message


# --------------------------------------------------------------------------- the CLI


ESCAPES = [
    "\x1b[2J\x1b[H",
    "\x1b]0;owned\x07",
    "\x1b]8;;http://evil\x1b\\link\x1b]8;;\x1b\\",
    "\x9b31m",
    "\x1bc",
    "bell\x07",
    "\u202egnp.exe",
    "\x00nul\x7fdel\x85nel",
]


@pytest.mark.parametrize("hostile", ESCAPES)
def test_printable_leaves_no_control_character(hostile: str) -> None:
    shown = textsafe.printable("client-" + hostile + "-end")
    assert shown.isprintable()
    assert shown.startswith("client-") and shown.endswith("-end")


def test_printable_keeps_ordinary_text_and_turns_whitespace_into_spaces() -> None:
    assert textsafe.printable("qwen3.8 — 日本語 é") == "qwen3.8 — 日本語 é"
    assert textsafe.printable("a\tb\nc\r\nd") == "a b c d"
    assert textsafe.printable("a\nb", keep_newlines=True) == "a\nb"


def render(console_print: Callable[[Console], None]) -> str:
    buffer = io.StringIO()
    console = textsafe.install(Console(file=buffer, width=120, force_terminal=True))
    console_print(console)
    return buffer.getvalue()


def test_an_installed_console_strips_data_but_keeps_its_own_styling() -> None:
    def show(console: Console) -> None:
        table = Table(title="Pending")
        table.add_column("client")
        for hostile in ESCAPES:
            table.add_row("c" + hostile)
        console.print(table)
        console.print("[bold]plain[/] \x1b[31mred", markup=True)

    text = render(show)
    assert "\x1b[1m" in text  # Rich's bold survives
    for bad in ("\x1b[2J", "\x1b]0;", "\x1b]8;", "\x9b", "\x1bc", "\x07", "\u202e", "\x00"):
        assert bad not in text
    assert "\x1b[31m" not in text


def test_the_cli_consoles_are_installed() -> None:
    for console in (cli_session.out, cli_session.err):
        with console.capture() as captured:
            console.print("model \x1b]0;x\x07 from \x1b[2Jclient", markup=False)
        assert "\x1b" not in captured.get() and "\x07" not in captured.get()


async def test_the_daemon_restores_the_good_items_and_raises_an_alert_for_the_bad(
    tmp_path: Path,
) -> None:
    paths = sandbox(tmp_path)

    def mutate(data: dict[str, Any]) -> None:
        data["pending"][1]["expires_at"] = "2999-01-01T00:00:00Z"
        data["pending"][0]["surprise"] = True
        data["residents"][0]["gpu_mib"] = "@@"

    paths.ledger.write_bytes(ledger_text(mutate).replace(b'"@@"', b"NaN"))
    controller = Controller.open(paths)
    await controller.restore_from_ledger()
    assert [e.requested_model for e in controller.admission.pending.values()] == ["mystery"]
    assert [r.model for r in controller.residents] == ["small"]
    alerts = [a for a in controller.alerts.active() if a.kind is AlertKind.CONFIG_ERROR]
    assert len(alerts) == 1 and alerts[0].subject == str(paths.ledger)
    assert "pending[0].surprise" in alerts[0].message
    assert "residents[0].gpu_mib" in alerts[0].message
    assert not list(paths.uap_home.glob("placement.json.corrupt-*"))
