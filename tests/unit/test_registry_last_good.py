"""A broken machine-local registry keeps its last good version, as the capacity policy
does (issue 20): before, a reload over a broken local file dropped every measurement
(everything failed closed) with only an alert to say so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from controller_fixtures import registry, registry_paths

from tests.worlds.seed_docs import alpha_model, beta_model
from uapplace.controller import views
from uapplace.controller.controller import Controller
from uapplace.core.alerts import AlertBoard, AlertKind
from uapplace.daemon.main import report_config_problems
from uapplace.files.paths import Paths
from uapplace.files.registry import load_registry

REGISTRY = registry({"alpha": alpha_model(rails=1), "beta": beta_model()})


def alpha_gpu_mib(controller: Controller) -> float | None:
    """alpha-q4's measured GPU figure; ``None`` when it does not count as measured."""
    config = controller.registry.models["alpha"].configs["alpha-q4"]
    return config.resident_gpu_mib if config.is_measured else None


def local_document(paths: Paths) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(paths.local_registry.read_text())
    return loaded


def test_the_loader_merges_the_last_good_local_document_over_a_broken_file(
    tmp_path: Path,
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    good = load_registry(paths.repo_registry, paths.local_registry)
    assert good.local_state == "loaded" and good.local_doc is not None
    measured = good.registry.models["alpha"].configs["alpha-q4"]
    assert measured.is_measured
    paths.local_registry.write_text('{"version": 1, "models": {"alpha": 7}}')
    kept = load_registry(paths.repo_registry, paths.local_registry, good.local_doc)
    assert kept.local_kept and kept.local_state == "last-good"
    assert kept.local_doc is good.local_doc
    assert [e.json_path for e in kept.errors] == ["$.models.alpha"]
    assert kept.registry.models["alpha"].configs["alpha-q4"] == measured
    alone = load_registry(paths.repo_registry, paths.local_registry)  # the CLI: nothing kept
    assert alone.local_state == "ignored" and not alone.local_kept
    assert not alone.registry.models["alpha"].configs["alpha-q4"].is_measured


def test_a_last_good_document_the_new_repo_file_no_longer_fits_gives_the_repo_defaults(
    tmp_path: Path,
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    good = load_registry(paths.repo_registry, paths.local_registry)
    paths.repo_registry.write_text(json.dumps(registry({"beta": beta_model()})))
    paths.local_registry.write_text("{ broken")
    load = load_registry(paths.repo_registry, paths.local_registry, good.local_doc)
    assert load.local_state == "ignored" and "alpha" not in load.registry.models
    assert [e.file for e in load.errors] == [paths.local_registry]


def test_a_deleted_local_file_is_no_local_file(tmp_path: Path) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    good = load_registry(paths.repo_registry, paths.local_registry)
    paths.local_registry.unlink()
    load = load_registry(paths.repo_registry, paths.local_registry, good.local_doc)
    assert load.local_state == "none" and load.errors == ()


async def test_a_reload_over_a_broken_local_registry_keeps_its_measurements_and_says_so(
    tmp_path: Path,
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    controller = Controller.open(paths)
    before = alpha_gpu_mib(controller)
    assert before is not None
    good_text = paths.local_registry.read_text()
    paths.local_registry.write_text("{ not json")
    await controller.reload()
    load = controller.config.state.registry_load
    assert load.local_state == "last-good" and alpha_gpu_mib(controller) == before
    report = await views.validate(controller)
    (finding,) = [f for f in report["findings"] if f["file"] == str(paths.local_registry)]
    assert finding["severity"] == "error" and "invalid JSON" in finding["message"]
    assert "keeps the last good version it read before" in finding["message"]
    board = AlertBoard(lambda: 0.0)
    assert await report_config_problems(controller.config.state, paths, board) == 1
    (alert,) = board.active()
    assert alert.kind is AlertKind.CONFIG_ERROR and alert.subject == str(paths.local_registry)
    assert "the last good version read before stays in force" in alert.message
    # A second broken reload still keeps the same good version, not nothing.
    await controller.reload()
    assert alpha_gpu_mib(controller) == before
    # Fixed with a new figure: the file as it is now is taken.
    fixed = json.loads(good_text)
    fixed["models"]["alpha"]["configs"]["alpha-q4"]["resident_gpu_mib"] = before + 100
    paths.local_registry.write_text(json.dumps(fixed))
    await controller.reload()
    assert controller.config.state.registry_load.local_state == "loaded"
    assert alpha_gpu_mib(controller) == before + 100


def test_a_broken_local_registry_at_start_is_ignored_with_nothing_to_keep(
    tmp_path: Path,
) -> None:
    paths = registry_paths(tmp_path, REGISTRY)
    paths.local_registry.write_text("[]")
    controller = Controller.open(paths)
    assert controller.config.state.registry_load.local_state == "ignored"
    assert alpha_gpu_mib(controller) is None
