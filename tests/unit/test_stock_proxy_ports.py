"""Behind the stock proxy with one port per model (issue 20): the client got 529 after
every swap and the operator was told nothing unless ``proxy.single_upstream`` was set.
Now the proxy's own ``LLAMA_CPP_BASE`` (its environment file) is read, and ``validate``
and an alert name every model it cannot reach; with nothing known, several ports and
no word on the proxy are a ``validate`` warning."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from controller_fixtures import registry, registry_paths

from tests.worlds.seed_docs import ALPHA_ENDPOINT, BETA_ENDPOINT, alpha_model, beta_model
from uapplace.cli import files as cli_files
from uapplace.controller import views
from uapplace.controller.controller import Controller
from uapplace.core.alerts import AlertKind
from uapplace.files.capacity import validate
from uapplace.files.paths import Paths
from uapplace.files.proxyenv import ProxyUpstream, read_proxy_upstream, several_ports_problems
from uapplace.files.registry import load_registry

TWO_PORTS = registry({"alpha": alpha_model(rails=1), "beta": beta_model()})


def with_proxy(document: dict[str, Any], single_upstream: str | None) -> dict[str, Any]:
    return {**document, "proxy": {"single_upstream": single_upstream}}


def write_proxy_env(paths: Paths, *lines: str) -> Path:
    paths.proxy_env_file.parent.mkdir(parents=True, exist_ok=True)
    paths.proxy_env_file.write_text("\n".join(lines) + "\n")
    return paths.proxy_env_file


# --------------------------------------------------------------------------- the env file


def test_the_last_llama_cpp_base_line_is_the_upstream(tmp_path: Path) -> None:
    env = tmp_path / "anthropic-proxy.env"
    env.write_text(
        "PROXY_AUTH_TOKEN=t\nLLAMA_CPP_BASE=http://127.0.0.1:9000\n"
        '# LLAMA_CPP_BASE=http://ignored\nexport LLAMA_CPP_BASE="http://127.0.0.1:8080"\n'
    )
    assert read_proxy_upstream(env) == ProxyUpstream("http://127.0.0.1:8080", env)


@pytest.mark.parametrize("text", ["PROXY_AUTH_TOKEN=t\n", "LLAMA_CPP_BASE=\n", "x" * 70_000])
def test_no_usable_upstream_is_none(tmp_path: Path, text: str) -> None:
    env = tmp_path / "anthropic-proxy.env"
    env.write_text(text)
    assert read_proxy_upstream(env) is None


def test_an_absent_file_or_a_fifo_is_none(tmp_path: Path) -> None:
    assert read_proxy_upstream(tmp_path / "absent.env") is None
    fifo = tmp_path / "fifo.env"
    os.mkfifo(fifo)
    assert read_proxy_upstream(fifo) is None  # never blocks on it


# --------------------------------------------------------------------------- the rule


def loaded(tmp_path: Path, document: dict[str, Any], env: Path | None = None) -> Any:
    repo = tmp_path / "model-registry.json"
    repo.write_text(json.dumps(document))
    return load_registry(repo, None, proxy_env=env)


def test_several_ports_and_no_word_on_the_proxy_is_a_warning(tmp_path: Path) -> None:
    load = loaded(tmp_path, TWO_PORTS)
    (problem,) = several_ports_problems(load.registry, load.proxy_stated, load.proxy_upstream)
    assert (problem.severity, problem.where) == ("warning", ("proxy",))
    assert f"2 addresses ({ALPHA_ENDPOINT}, {BETA_ENDPOINT})" in problem.message
    assert "clients get 529" in problem.message and '"single_upstream": null' in problem.message
    findings = [f for f in validate(load, None) if f.json_path == "$.proxy"]
    assert [f.severity for f in findings] == ["warning"]


def test_a_proxy_said_to_route_by_target_is_fine_with_several_ports(tmp_path: Path) -> None:
    env = tmp_path / "proxy.env"
    env.write_text(f"LLAMA_CPP_BASE={ALPHA_ENDPOINT}\n")
    load = loaded(tmp_path, with_proxy(TWO_PORTS, None), env)
    assert load.proxy_stated and load.proxy_upstream is not None
    assert several_ports_problems(load.registry, True, load.proxy_upstream) == []


def test_one_port_for_all_is_no_warning(tmp_path: Path) -> None:
    one = registry({"alpha": alpha_model(rails=1), "beta": alpha_model() | {"unit": "uap-b"}})
    load = loaded(tmp_path, one)
    assert several_ports_problems(load.registry, load.proxy_stated, None) == []


def test_the_stock_proxys_upstream_makes_every_other_port_an_error(tmp_path: Path) -> None:
    env = tmp_path / "proxy.env"
    env.write_text(f"LLAMA_CPP_BASE={ALPHA_ENDPOINT}/v1\n")
    load = loaded(tmp_path, TWO_PORTS, env)
    findings = [f for f in validate(load, None) if "stock proxy" in f.message]
    assert [(f.severity, f.json_path) for f in findings] == [("error", "$.models.beta.endpoint")]
    assert f"listens on {BETA_ENDPOINT}" in findings[0].message
    assert f"LLAMA_CPP_BASE {ALPHA_ENDPOINT}/v1 ({env})" in findings[0].message


def test_a_single_upstream_the_proxy_does_not_use_is_an_error(tmp_path: Path) -> None:
    env = tmp_path / "proxy.env"
    env.write_text("LLAMA_CPP_BASE=http://127.0.0.1:9999\n")
    one = registry({"alpha": alpha_model(rails=1)})
    load = loaded(tmp_path, with_proxy(one, ALPHA_ENDPOINT), env)
    (problem,) = several_ports_problems(load.registry, load.proxy_stated, load.proxy_upstream)
    assert (problem.severity, problem.where) == ("error", ("proxy", "single_upstream"))
    assert "LLAMA_CPP_BASE in" in problem.message and "http://127.0.0.1:9999" in problem.message


# --------------------------------------------------------------------------- the daemon, the CLI


async def test_the_daemon_alerts_and_validate_errs_before_a_swap(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, TWO_PORTS)
    env = write_proxy_env(paths, "PROXY_AUTH_TOKEN=t", f"LLAMA_CPP_BASE={ALPHA_ENDPOINT}")
    controller = Controller.open(paths)
    await controller.start()
    try:
        (alert,) = [a for a in controller.alerts.active() if a.kind is AlertKind.CONFIG_ERROR]
        assert "1 model(s) unreachable through the stock proxy's one upstream" in alert.message
        assert "$.models.beta.endpoint" in alert.message and str(env) in alert.message
        report = await views.validate(controller)
        assert report["ok"] is False
        (finding,) = [f for f in report["findings"] if "stock proxy" in f["message"]]
        assert finding["json_path"] == "$.models.beta.endpoint"
    finally:
        await controller.shutdown(wait_s=1)


def test_the_cli_validate_reads_the_proxy_env_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    paths = registry_paths(tmp_path, TWO_PORTS)
    write_proxy_env(paths, f"LLAMA_CPP_BASE={ALPHA_ENDPOINT}")
    for name, value in {
        "HOME": str(tmp_path),
        "UAP_HOME": str(paths.uap_home),
        "UAPPLACE_CONFIG_DIR": str(paths.config_dir),
        "UAPPLACE_SIM_GPU": str(tmp_path / "sim.json"),
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    report = cli_files.validate_locally()
    assert report["ok"] is False
    assert any(
        f["json_path"] == "$.models.beta.endpoint" and "stock proxy" in f["message"]
        for f in report["findings"]
    )
