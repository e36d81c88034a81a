"""Single-upstream proxy topology checks (uapplace/core/topology.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.worlds.builders import cpu, cpu_reading, gpu, gpu_reading, measured
from uapplace.core.model import (
    Config,
    ConfigStatus,
    Holder,
    Model,
    OptionKind,
    Plan,
    Registry,
    Resident,
    ResidentState,
)
from uapplace.core.planner import PlanInput, plan
from uapplace.core.topology import (
    UNREACHABLE,
    normalize_endpoint,
    same_endpoint,
    single_upstream_problems,
    verify_endpoint,
)
from uapplace.files.capacity import validate
from uapplace.files.jsonfile import ConfigFileError
from uapplace.files.registry import load_registry

UPSTREAM = "http://127.0.0.1:8080"


def model(key: str, endpoint: str | None, **config_endpoints: str | None) -> Model:
    configs = {
        name: Config(name, ConfigStatus.UNMEASURED, endpoint=ep)
        for name, ep in (config_endpoints or {"c": None}).items()
    }
    return Model(key, key.title(), "llama.cpp", configs, endpoint=endpoint)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("http://127.0.0.1:8080", "HTTP://LocalHost:8080/v1/"),
        ("http://example:80", "http://example"),
        ("https://h/", "https://h:443"),
        ("http://[::1]:8080", "http://[::1]:8080/"),
    ],
)
def test_same_endpoint(a: str, b: str) -> None:
    assert same_endpoint(a, b)


def test_different_ports_and_hosts_differ() -> None:
    assert not same_endpoint("http://127.0.0.1:8080", "http://127.0.0.1:8081")
    assert not same_endpoint("http://127.0.0.1:8080", "https://127.0.0.1:8080")
    assert normalize_endpoint("http://h:9/x/") == "http://h:9/x"


def test_two_ports_under_a_single_upstream_are_named() -> None:
    registry = Registry(
        {},
        {
            "alpha": model("alpha", UPSTREAM),
            "beta": model("beta", "http://127.0.0.1:8081"),
            "gamma": model("gamma", None),
            "delta": model("delta", UPSTREAM, own="http://127.0.0.1:9000", shared=None),
        },
    )
    problems = single_upstream_problems(registry, "http://localhost:8080/")
    assert [(p.model, p.config, p.endpoint) for p in problems] == [
        ("beta", None, "http://127.0.0.1:8081"),
        ("delta", "own", "http://127.0.0.1:9000"),
        ("gamma", None, None),
    ]
    assert all(UNREACHABLE in p.message for p in problems)
    assert "model 'beta' listens on http://127.0.0.1:8081" in problems[0].message
    assert "model 'gamma' declares no endpoint" in problems[2].message


def test_one_shared_port_has_no_problems() -> None:
    registry = Registry({}, {"a": model("a", UPSTREAM), "b": model("b", UPSTREAM + "/v1")})
    assert single_upstream_problems(registry, UPSTREAM) == []


def test_verify_endpoint_prefers_the_upstream() -> None:
    assert verify_endpoint("http://h:1", UPSTREAM) == UPSTREAM
    assert verify_endpoint("http://h:1", None) == "http://h:1"


# --------------------------------------------------------------------------- the registry setting


def registry_doc(single_upstream: object = UPSTREAM) -> dict[str, object]:
    config = {"status": "unmeasured"}
    return {
        "version": 1,
        "devices": {"gpu0": {"kind": "gpu", "total_mib": 24576, "reserved_mib": 0}},
        "proxy": {"single_upstream": single_upstream},
        "models": {
            "alpha": {
                "display": "Alpha",
                "engine": "llama.cpp",
                "endpoint": "http://127.0.0.1:8080",
                "configs": {"a": config},
            },
            "beta": {
                "display": "Beta",
                "engine": "llama.cpp",
                "endpoint": "http://127.0.0.1:8081",
                "configs": {"b": config},
            },
        },
    }


def test_validate_flags_two_ports_under_a_single_upstream(tmp_path: Path) -> None:
    repo = tmp_path / "model-registry.json"
    repo.write_text(json.dumps(registry_doc()))
    load = load_registry(repo, None)
    assert load.registry.single_upstream == UPSTREAM
    findings = [f for f in validate(load, None) if UNREACHABLE in f.message]
    assert [(f.severity, f.file, f.json_path) for f in findings] == [
        ("error", str(repo), "$.models.beta.endpoint")
    ]


def test_the_local_file_can_set_or_clear_the_single_upstream(tmp_path: Path) -> None:
    repo = tmp_path / "model-registry.json"
    local = tmp_path / "local.json"
    doc = registry_doc()
    del doc["proxy"]
    repo.write_text(json.dumps(doc))
    assert load_registry(repo, None).registry.single_upstream is None
    local.write_text(json.dumps({"version": 1, "proxy": {"single_upstream": UPSTREAM}}))
    assert load_registry(repo, local).registry.single_upstream == UPSTREAM
    repo.write_text(json.dumps(registry_doc()))
    local.write_text(json.dumps({"version": 1, "proxy": {"single_upstream": None}}))
    assert load_registry(repo, local).registry.single_upstream is None
    local.write_text(json.dumps({"version": 1, "proxy": {}}))
    assert load_registry(repo, local).registry.single_upstream == UPSTREAM


def test_a_bad_single_upstream_names_the_field(tmp_path: Path) -> None:
    repo = tmp_path / "model-registry.json"
    repo.write_text(json.dumps(registry_doc("127.0.0.1:8080")))
    with pytest.raises(ConfigFileError) as raised:
        load_registry(repo, None)
    assert "$.proxy.single_upstream" in str(raised.value)


# --------------------------------------------------------------------------- the planner


def planned(single_upstream: str | None, holders: tuple[Holder, ...] = ()) -> Plan:
    """Plan ``beta`` (4 GiB) on a 24 GiB card where ``alpha`` (4 GiB) is resident."""
    models = {
        key: Model(
            key, key, "llama.cpp", {f"{key}-q": measured(f"{key}-q", 4096)}, endpoint=UPSTREAM
        )
        for key in ("alpha", "beta")
    }
    devices = {"gpu0": gpu(reserved=1024), "cpu0": cpu(65536, 1024)}
    registry = Registry(devices, models, single_upstream=single_upstream)
    alpha = Resident(
        "alpha",
        "alpha-q",
        "gpu0",
        "llama.cpp",
        UPSTREAM,
        "uap-alpha",
        ResidentState.HOT,
        4096,
        1000,
        "2026-10-08T14:02:00Z",
        holders,
    )
    readings = {"gpu0": gpu_reading(24576, 20000), "cpu0": cpu_reading(65536, 60000)}
    return plan(PlanInput(registry, (alpha,), readings), "beta")


def test_a_single_upstream_never_offers_load_alongside() -> None:
    assert [o.kind for o in planned(None).options] == [OptionKind.LOAD_ALONGSIDE]
    (option,) = planned(UPSTREAM).options
    assert option.kind is OptionKind.DISPLACE
    assert option.signature == ("alpha/alpha-q",)


def test_a_held_port_owner_leaves_no_option_and_says_why() -> None:
    found = planned(UPSTREAM, (Holder("editor", "hold", "writing"),))
    assert found.options == ()
    assert any(f"owns the single upstream {UPSTREAM}" in line for line in found.infeasible)
