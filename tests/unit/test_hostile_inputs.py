"""Hostile values at every edge (issue 20): each gets a named error naming the file, field
or argument, no traceback, and nothing that was good is lost.

The values: ``10**4200`` in the registry; ``SetAutoPolicy`` with 100k-deep JSON or a
5,000-digit integer; absurd values that used to be taken silently
(``unload_idle_after_secs`` 10^30, pending ``cells`` 10^30, a pending id ``../../x``, a
resident unit ``../../evil.service``, registry keys with ESC, ``reserved_mib >
total_mib``, 5,000 pending entries); files the daemon trusts written by another user or
writable by others (docs/placement-rules.md §4.7); and the shim's own inputs (a
5,000-digit ``cells``, a malformed HTTP request). The HTTP and bus paths end to end are
in ``tests/bus/test_shim_users.py``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.http_exceptions import BadHttpMessage
from controller_fixtures import alpha_resident, registry, registry_paths

from tests.worlds.seed_docs import alpha_model, beta_model
from uapplace.cli import files as cli_files
from uapplace.controller import views
from uapplace.controller.configstate import ConfigState
from uapplace.controller.controller import Controller
from uapplace.controller.holds import MAX_HOLDS, MAX_HOLDS_PER_CLIENT
from uapplace.core.admission import MAX_PENDING
from uapplace.core.alerts import AlertKind
from uapplace.core.errors import Busy, InvalidArgument
from uapplace.core.model import Registry
from uapplace.daemon.service import (
    MAX_POLICY_JSON_CHARS,
    MAX_REASON_CHARS,
    check_list,
    check_text,
    parse_auto_changes,
    parse_signature,
)
from uapplace.files import jsonfile
from uapplace.files.autopolicy import (
    MAX_IDLE_WINDOW_S,
    AutoPolicy,
    PolicyStore,
    apply_changes,
    load_auto_policy,
)
from uapplace.files.capacity import load_capacity_policy, timeouts_findings
from uapplace.files.capacity import validate as validate_files
from uapplace.files.jsonfile import ConfigFileError, UntrustedFile
from uapplace.files.ledger import Ledger, doc_to_json, parse_ledger_text
from uapplace.files.paths import Paths
from uapplace.files.registry import load_registry
from uapplace.files.timeouts import Timeouts
from uapplace.shim.bodies import parse_cells_query
from uapplace.shim.overload import QuietBadRequests
from uapplace.shim.responses import HttpError

REGISTRY = registry({"alpha": alpha_model(rails=1), "beta": beta_model()})
HUGE = "1" + "0" * 4200
"""``10**4200`` as JSON text: past a float, within Python's 4,300-digit integer limit."""
ALPHA_RESIDENT = alpha_resident()
OTHER_UID = 65534
"""Another user (``nobody``): the owner of the files another user could have written."""
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="chown to another uid needs root (the CI runs as root)"
)


def with_huge(document: dict[str, Any], *where: str) -> str:
    """``document`` as JSON with ``10**4200`` at the path ``where``."""
    target: Any = document
    for key in where[:-1]:
        target = target[key]
    target[where[-1]] = "@HUGE@"
    return json.dumps(document).replace('"@HUGE@"', HUGE)


def local_registry(paths: Paths) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(paths.local_registry.read_text())
    return loaded


def repo_registry(paths: Paths) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(paths.repo_registry.read_text())
    return loaded


def no_traceback(text: str) -> None:
    assert "Traceback" not in text and "internal error" not in text


# --------------------------------------------------------------------------- 10**4200


@pytest.mark.parametrize(
    ("where", "message"),
    [
        (("models", "alpha", "configs", "alpha-q4", "kv_resident_cells"), "less than or equal"),
        (("models", "alpha", "configs", "alpha-q4", "resident_gpu_mib"), "4201-digit integer"),
        (("models", "alpha", "configs", "alpha-q4", "context_pool_cells"), "less than or equal"),
        (("devices", "gpu0", "total_mib"), "less than or equal"),
    ],
)
async def test_a_4200_digit_number_in_the_local_registry_is_named_and_preview_still_answers(
    tmp_path: Path, where: tuple[str, ...], message: str
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    document = local_registry(paths)
    document.setdefault("devices", {}).setdefault("gpu0", {})
    paths.local_registry.write_text(with_huge(document, *where))
    controller = Controller.open(paths)
    errors = controller.config.state.registry_load.errors
    assert [e.file for e in errors] == [paths.local_registry]
    assert errors[0].json_path == "$." + ".".join(where)
    assert message in errors[0].message
    # What used to be an internal error in every Preview and a traceback in validate:
    preview = await views.preview(controller, "beta", 0)
    assert preview["model"] == "beta"
    findings = validate_files(controller.config.state.registry_load, None)
    assert any(f.file == str(paths.local_registry) for f in findings)


def test_a_4200_digit_number_in_the_repo_registry_stops_the_start_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    document = repo_registry(paths)
    paths.repo_registry.write_text(with_huge(document, "devices", "cpu0", "reserved_mib"))
    with pytest.raises(ConfigFileError) as caught:
        ConfigState.read(paths)
    assert caught.value.file == paths.repo_registry
    assert caught.value.json_path == "$.devices.cpu0.reserved_mib"
    monkeypatch.setenv("UAPPLACE_CONFIG_DIR", str(paths.config_dir))
    monkeypatch.setenv("UAP_HOME", str(paths.uap_home))
    report = cli_files.validate_locally()
    assert report["ok"] is False
    assert report["findings"][0]["json_path"] == "$.devices.cpu0.reserved_mib"
    no_traceback(json.dumps(report))


# --------------------------------------------------------------------------- registry keys, ranges


@pytest.mark.parametrize(
    ("mutate", "where"),
    [
        (lambda d: d["models"].__setitem__("al\x1b[2Jpha", d["models"].pop("alpha")), "[key]"),
        (
            lambda d: d["models"]["alpha"]["configs"].__setitem__(
                "q4\x1b]0;pwned\x07", d["models"]["alpha"]["configs"].pop("alpha-q4")
            ),
            "configs",
        ),
        (lambda d: d["models"]["alpha"].__setitem__("advertises", ["chat\x1b[31m"]), "advertises"),
        (lambda d: d["models"]["alpha"].__setitem__("display", "Alpha\x9b2J"), "display"),
        (lambda d: d["devices"]["gpu0"].__setitem__("name", "GPU\u202egnp"), "name"),
    ],
)
def test_control_characters_in_registry_keys_and_names_are_refused_by_name(
    tmp_path: Path, mutate: Callable[[dict[str, Any]], None], where: str
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    document = repo_registry(paths)
    mutate(document)
    paths.repo_registry.write_text(json.dumps(document))
    with pytest.raises(ConfigFileError) as caught:
        load_registry(paths.repo_registry, None)
    assert caught.value.file == paths.repo_registry
    assert "control character" in str(caught.value)
    assert where.strip("[]") in caught.value.json_path or where == "[key]"


def test_reserved_above_total_is_refused_in_the_repo_file(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    document = repo_registry(paths)
    document["devices"]["gpu0"]["reserved_mib"] = 30000
    paths.repo_registry.write_text(json.dumps(document))
    with pytest.raises(ConfigFileError) as caught:
        load_registry(paths.repo_registry, None)
    assert caught.value.json_path == "$.devices.gpu0.reserved_mib"
    assert "reserved_mib 30000 exceeds total_mib 24576" in caught.value.message


def test_reserved_above_total_in_the_local_file_ignores_that_file_only(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    document = local_registry(paths)
    document["devices"] = {"gpu0": {"reserved_mib": 99999}}
    paths.local_registry.write_text(json.dumps(document))
    loaded = load_registry(paths.repo_registry, paths.local_registry)
    assert [(e.file, e.json_path) for e in loaded.errors] == [
        (paths.local_registry, "$.devices.gpu0.reserved_mib")
    ]
    assert loaded.registry.devices["gpu0"].reserved_mib == 1024  # the repo's, in force


# --------------------------------------------------------------------------- the auto policy


def nested(depth: int) -> str:
    return '{"enable": ' + "[" * depth + "]" * depth + "}"


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (nested(100_000), "over the 65,536 limit"),
        (nested(30_000), "nested deeper than 64"),
        (nested(70), "nested deeper than 64"),
        ('{"unload_idle_after_secs": ' + "9" * 5000 + "}", "invalid JSON number"),
        ('{"enable": true, "enable": false}', "duplicate key"),
        ('{"disable": ' + " " * MAX_POLICY_JSON_CHARS + "true}", "over the 65,536 limit"),
    ],
)
def test_set_auto_policy_refuses_hostile_json_by_name(text: str, named: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        parse_auto_changes(text)
    assert "policy_json" in str(caught.value) and named in str(caught.value)


def test_100k_deep_json_is_a_named_error_even_without_the_size_cap() -> None:
    with pytest.raises(jsonfile.JsonTextError, match=r"^\$: nested deeper than 64 levels"):
        jsonfile.loads_text(nested(100_000), max_chars=1 << 20)


@pytest.mark.parametrize("seconds", [10**30, MAX_IDLE_WINDOW_S + 1])
def test_an_absurd_idle_window_is_refused_at_the_bus_edge_and_in_the_policy(seconds: int) -> None:
    with pytest.raises(InvalidArgument, match="unload_idle_after_secs"):
        parse_auto_changes(json.dumps({"unload_idle_after_secs": seconds}))
    with pytest.raises(InvalidArgument, match="over the 2592000 s"):
        apply_changes(AutoPolicy(), {"unload_idle_after_secs": seconds}, True, Registry({}, {}))


def test_an_absurd_idle_window_in_the_file_turns_the_sweep_off_with_a_finding(
    tmp_path: Path,
) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(json.dumps({"enabled": True, "unload_idle_after_secs": 10**30}))
    policy, findings = load_auto_policy(path)
    assert policy.enabled and policy.idle_window_s is None
    assert findings == [
        f"{path}: unload_idle_after_secs: a 31-digit number is over the 2592000 s (30 days) "
        "limit; ignored (off)"
    ]


# --------------------------------------------------------------------------- the ledger


def ledger_with(**pending: Any) -> dict[str, Any]:
    """Two pending entries, the first with ``pending``'s values; two residents, the
    second with the unit ``../../evil.service``."""
    good = {
        "id": "plc-00000b",
        "requested_model": "beta",
        "client": "d",
        "created_at": "2026-01-01T00:00:00Z",
        "expires_at": "2999-01-01T00:00:00Z",
        "reason": "not_resident",
    }
    entry = {**good, "id": "plc-00000a", "client": "c", **pending}
    resident = {
        "model": "alpha",
        "config": "alpha-q4",
        "device": "gpu0",
        "engine": "llama.cpp",
        "endpoint": "http://127.0.0.1:18080",
        "unit": "uap-alpha",
        "state": "hot",
        "gpu_mib": 8000,
        "host_rss_mib": 2000,
        "since": "2026-01-01T00:00:00Z",
    }
    evil = {**resident, "model": "beta", "config": "beta-q8", "unit": "../../evil.service"}
    return {
        "version": 1,
        "updated_at": "2026-01-01T00:00:00Z",
        "residents": [resident, evil],
        "pending": [entry, good],
    }


@pytest.mark.parametrize(
    ("field", "value", "where"),
    [
        ("cells", 10**30, "pending[0].cells"),
        ("id", "../../x", "pending[0].id"),
        ("id", "plc-\x1b[2J", "pending[0].id"),
        ("pid", 10**30, "pending[0].pid"),
    ],
)
def test_absurd_ledger_values_drop_their_item_alone_by_name(
    field: str, value: Any, where: str
) -> None:
    doc = parse_ledger_text(json.dumps(ledger_with(**{field: value})).encode())
    assert [p.id for p in doc.pending] == ["plc-00000b"]
    assert [r.model for r in doc.residents] == ["alpha"]
    assert any(line.startswith(f"placement.json: {where}") for line in doc.dropped), doc.dropped
    assert any("residents[1].unit" in line and "invalid unit name" in line for line in doc.dropped)


async def test_5000_pending_entries_keep_the_1024_that_expire_last_and_say_so(
    tmp_path: Path,
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    entries = [
        {
            "id": f"plc-{index:06x}",
            "requested_model": "beta",
            "client": f"client-{index}",
            "created_at": "2026-01-01T00:00:00Z",
            "expires_at": f"{2100 + index // 365:04d}-01-01T00:00:00Z",
            "reason": "not_resident",
        }
        for index in range(5000)
    ]
    document = {"version": 1, "updated_at": "2026-01-01T00:00:00Z", "pending": entries}
    paths.ledger.write_text(json.dumps(document))
    doc = parse_ledger_text(paths.ledger.read_bytes(), paths.ledger)
    assert len(doc.pending) == MAX_PENDING
    assert doc.pending[-1].id == f"plc-{4999:06x}"  # the newest expiry kept
    assert doc.pending[0].id not in {f"plc-{i:06x}" for i in range(3000)}
    (line,) = [d for d in doc.dropped if "pending:" in d]
    assert "5,000 entries, over the 1,024 uapplaced keeps" in line and "dropped 3,976" in line
    controller = Controller.open(paths)
    await controller.restore_from_ledger()
    assert len(controller.admission.pending) == MAX_PENDING
    alerts = [a for a in controller.alerts.active() if a.kind is AlertKind.CONFIG_ERROR]
    assert alerts and "5,000 entries" in alerts[0].message


# --------------------------------------------------------------------------- the timeouts file


@pytest.mark.parametrize(
    ("text", "where", "named"),
    [
        ('{"drain_s": 1e30}', "$.drain_s", "less than or equal to 86400"),
        ('{"stop_s": ' + "9" * 5000 + "}", "$", "invalid JSON number"),
        ('{"drain_multiple": 1000}', "$.drain_multiple", "less than or equal to 100"),
        ('{"http_s": 0}', "$.http_s", "greater than 0"),
        ('{"stop_s": 5, "stop_s": 6}', "$", "duplicate key"),
    ],
)
def test_a_hostile_timeouts_file_is_named_and_validate_reports_it(
    tmp_path: Path, text: str, where: str, named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    paths.enforcement_timeouts.write_text(text)
    with pytest.raises(ConfigFileError) as caught:
        Timeouts.load(paths.enforcement_timeouts)
    assert caught.value.file == paths.enforcement_timeouts
    assert caught.value.json_path == where and named in caught.value.message
    (finding,) = timeouts_findings(paths.enforcement_timeouts)
    assert finding.severity == "error" and finding.json_path == where
    monkeypatch.setenv("UAPPLACE_CONFIG_DIR", str(paths.config_dir))
    monkeypatch.setenv("UAP_HOME", str(paths.uap_home))
    monkeypatch.setenv("UAPPLACE_SIM_GPU", str(tmp_path / "sim.json"))
    report = cli_files.validate_locally()
    assert report["ok"] is False
    assert [f["json_path"] for f in report["findings"] if f["file"] == str(finding.file)] == [where]


def test_no_timeouts_file_is_no_finding(tmp_path: Path) -> None:
    assert timeouts_findings(tmp_path / "enforcement-timeouts.json") == []


# --------------------------------------------------------------------------- trusted files


def foreign(path: Path, mode: int = 0o666) -> Path:
    """``path`` as another user would leave it: owned by :data:`OTHER_UID`, ``mode``."""
    os.chown(path, OTHER_UID, OTHER_UID)
    path.chmod(mode)
    return path


@needs_root
def test_a_foreign_0666_auto_policy_is_never_honoured_as_standing_consent(tmp_path: Path) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(json.dumps({"enabled": True, "allow_displace": ["beta"]}))
    foreign(path)
    policy, findings = load_auto_policy(path)
    assert policy == AutoPolicy() and not policy.may_displace_for("beta")
    (finding,) = findings
    assert f"owned by uid {OTHER_UID}" in finding and "mode 0666" in finding
    assert finding.endswith("auto is off (never honoured as consent)")


@needs_root
async def test_an_edit_moves_a_foreign_auto_policy_aside_and_writes_our_own(
    tmp_path: Path,
) -> None:
    path = tmp_path / "placement-auto.json"
    path.write_text(json.dumps({"enabled": True, "allow_displace": ["beta"]}))
    foreign(path)
    (tmp_path / "w").mkdir()
    reg = load_registry(registry_paths(tmp_path / "w", REGISTRY).repo_registry, None).registry
    store = PolicyStore(path, lambda: reg)
    status = await store.set({"enable": True}, consent=False)
    assert status["enabled"] is True and status["allow_displace"] == []
    assert owners(path) == (os.geteuid(), 0o600)
    assert moved_aside(tmp_path, "placement-auto.json") == [(OTHER_UID, 0o666)]  # the evidence


def moved_aside(directory: Path, name: str) -> list[tuple[int, int]]:
    """Owner and mode of each ``<name>.corrupt-*`` in ``directory``."""
    return [owners(p) for p in directory.glob(f"{name}.corrupt-*")]


def owners(path: Path) -> tuple[int, int]:
    info = path.stat()
    return info.st_uid, stat.S_IMODE(info.st_mode)


@needs_root
@pytest.mark.parametrize("mode", [0o644, 0o666, 0o600])
def test_a_registry_owned_by_another_user_is_refused_with_its_owner_and_mode(
    tmp_path: Path, mode: int
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    foreign(paths.repo_registry, mode)
    with pytest.raises(UntrustedFile) as caught:
        load_registry(paths.repo_registry, None)
    assert caught.value.file == paths.repo_registry
    assert caught.value.owner == OTHER_UID and caught.value.mode == mode
    assert f"owned by uid {OTHER_UID}" in str(caught.value)


@pytest.mark.parametrize("mode", [0o664, 0o646, 0o622])
def test_our_own_file_writable_by_group_or_others_is_refused_too(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "enforcement-timeouts.json"
    path.write_text('{"drain_s": 30}')
    path.chmod(mode)
    with pytest.raises(UntrustedFile) as caught:
        Timeouts.load(path)
    assert caught.value.mode == mode and f"mode {mode:04o} lets" in caught.value.message
    path.chmod(0o640)  # group may read: fine
    assert Timeouts.load(path).drain_s == 30


@needs_root
def test_a_foreign_capacity_policy_keeps_the_last_good_one(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    first = ConfigState.read(paths)
    assert first.policy_state == "loaded"
    foreign(paths.capacity_policy)
    again = first.reread()
    assert again.policy is first.policy and again.policy_state == "last-good"
    assert isinstance(again.policy_error, UntrustedFile)
    (finding,) = again.policy_findings()
    assert f"owned by uid {OTHER_UID}" in finding.message
    assert "stays in force" in finding.message
    with pytest.raises(UntrustedFile):
        load_capacity_policy(paths.capacity_policy)


@needs_root
def test_a_foreign_ledger_is_not_restored_and_is_kept_aside(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    path.write_text(json.dumps(ledger_with()))
    foreign(path, 0o644)
    ledger = Ledger(path)
    doc = ledger.read()
    assert doc.pending == [] and doc.residents == []
    assert ledger.last_error is not None and f"owned by uid {OTHER_UID}" in ledger.last_error
    assert moved_aside(tmp_path, "placement.json") == [(OTHER_UID, 0o644)]
    ledger.update(lambda d: None)  # our own from now on
    assert path.stat().st_uid == os.geteuid()


def test_check_trusted_takes_our_file_and_a_missing_one(tmp_path: Path) -> None:
    ours = tmp_path / "ours.json"
    ours.write_text("{}")
    ours.chmod(0o600)
    jsonfile.check_trusted(ours)
    jsonfile.check_trusted(tmp_path / "absent.json")


# --------------------------------------------------------------------------- bus arguments


def test_over_long_bus_arguments_are_named() -> None:
    with pytest.raises(InvalidArgument, match=r"argument reason: 1,048,576 characters"):
        check_text("reason", "r" * (1 << 20), 1024)
    with pytest.raises(InvalidArgument, match=r"argument alert_ids: 5,000 elements"):
        check_list("alert_ids", ["a"] * 5000, 1024)
    with pytest.raises(InvalidArgument, match=r"argument expected\[1\]: 2,000 characters"):
        parse_signature(["a/b", "m/" + "c" * 1998])
    assert check_text("model", "alpha") == "alpha"


@pytest.mark.parametrize("argument", ["reason", "app_id"])
def test_a_1_mib_hold_reason_or_app_id_is_named_with_its_cap(argument: str) -> None:
    with pytest.raises(InvalidArgument, match=rf"argument {argument}: 1,048,576 characters"):
        check_text(argument, "\x1b" * (1 << 20), MAX_REASON_CHARS)
    assert check_text(argument, "r" * MAX_REASON_CHARS, MAX_REASON_CHARS)


async def test_holds_are_capped_per_connection_per_app_id_and_in_all(tmp_path: Path) -> None:
    controller = Controller.open(registry_paths(tmp_path, REGISTRY))
    big = "r" * MAX_REASON_CHARS
    for _ in range(MAX_HOLDS_PER_CLIENT):
        await controller.hold("alpha", big, "app-a", ":1.1")
    with pytest.raises(Busy, match=rf"connection :1\.1 has 32 holds, the {MAX_HOLDS_PER_CLIENT}"):
        await controller.hold("alpha", big, "app-b", ":1.1")
    with pytest.raises(Busy, match=r"app_id 'app-a' has 32 holds, the 32 one app id may take"):
        await controller.hold("alpha", big, "app-a", ":1.2")
    for index in range(MAX_HOLDS - MAX_HOLDS_PER_CLIENT):
        await controller.hold("beta", big, f"app-{index}", f":2.{index}")
    assert len(controller.holds) == MAX_HOLDS
    with pytest.raises(Busy, match=r"256 holds are taken, the 256 uapplaced keeps at most"):
        await controller.hold("beta", big, "fresh", ":3.1")
    assert len(controller.holds) == MAX_HOLDS  # nothing half-taken
    controller.release(next(iter(controller.holds)), ":1.1")
    assert await controller.hold("beta", "again", "fresh", ":3.1") > 0  # room again
    controller.upsert_resident(ALPHA_RESIDENT)
    doc = controller.document({}, controller.residents_with_holders(None))
    written = jsonfile.dumps(doc_to_json(doc), indent=2)
    assert len(doc.residents[0].holders) == MAX_HOLDS_PER_CLIENT - 1
    assert len(written) < jsonfile.LEDGER_MAX_BYTES // 8  # far within the ledger's read cap


# --------------------------------------------------------------------------- the shim's inputs


@pytest.mark.parametrize("text", ["9" * 5000, "4294967296", "0", "-1", "１２"])
def test_a_5000_digit_cells_query_is_a_400_naming_cells(text: str) -> None:
    with pytest.raises(HttpError) as caught:
        parse_cells_query(text)
    assert caught.value.status == 400 and "query parameter cells" in caught.value.message


def test_a_clients_malformed_request_is_one_line_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    logger = logging.getLogger("test.aiohttp.server")
    quiet = QuietBadRequests(logger, every_s=0.0)
    caplog.set_level(logging.INFO, logger=logger.name)
    bad = BadHttpMessage("Invalid character in Content-Length:\n\n  b'Content-Length: \x1b[2J'")
    quiet.exception("Error handling request from %s", "127.0.0.1", exc_info=bad)
    (record,) = caplog.records
    assert record.levelno == logging.INFO and record.exc_info is None
    assert record.getMessage().startswith("bad HTTP request from 127.0.0.1: 400, message:")
    assert "\n" not in record.getMessage() and "\x1b" not in record.getMessage()
    caplog.clear()
    try:
        raise RuntimeError("ours")
    except RuntimeError as err:
        quiet.exception("Error handling request from %s", "127.0.0.1", exc_info=err)
    (record,) = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info is not None  # a real bug keeps it


def test_the_sandbox_registry_is_still_accepted_whole(tmp_path: Path) -> None:
    """The bounds leave every real registry alone: the repo's own file loads clean."""
    repo = Path(__file__).resolve().parents[2] / "config"
    shutil.copy(repo / "model-registry.json", tmp_path / "model-registry.json")
    loaded = load_registry(tmp_path / "model-registry.json", None)
    assert loaded.errors == () and loaded.registry.models
