"""``uapplace install`` / ``uninstall`` on files alone (uapplace/cli/install.py): what is
written, the manifest, and that uninstall takes back exactly that. The user manager is
replaced by a recorder here; ``tests/systemd/test_install_shim.py`` runs the real one."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import pytest

from uapplace.cli import install as installer
from uapplace.cli.install import InstallError, InstallReport, ShimInstall
from uapplace.files.paths import Paths


@pytest.fixture
def paths(tmp_path: Path) -> Paths:
    """Every XDG directory under ``tmp_path``; none of them exists yet."""
    return Paths.from_env(
        {
            "HOME": str(tmp_path / "home"),
            "XDG_RUNTIME_DIR": str(tmp_path / "run"),
            "XDG_CONFIG_HOME": str(tmp_path / "config"),
            "XDG_DATA_HOME": str(tmp_path / "data"),
        }
    )


@pytest.fixture
def jobs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What install asked of the user manager: reloads and shim starts/stops."""
    asked: list[str] = []

    async def reload(report: InstallReport) -> None:
        asked.append("reload")

    async def shim_job(report: InstallReport, start: bool) -> None:
        asked.append("start" if start else "stop")
        report.shim_unit = "started" if start else "stopped"

    monkeypatch.setattr(installer, "_reload", reload)
    monkeypatch.setattr(installer, "_shim_job", shim_job)
    return asked


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def actions(report: InstallReport) -> dict[str, str]:
    return {f.path.name: f.action for f in report.files}


async def test_with_shim_writes_unit_and_token_and_records_them(
    paths: Paths, jobs: list[str]
) -> None:
    report = await installer.install(paths, shim=ShimInstall(port=4000))
    assert report.ok
    assert actions(report) == {
        "uapplaced.service": "written",
        "org.uap.Placement1.service": "written",
        "uapplace-shim.service": "written",
        "token": "written",
    }
    shim_unit = installer.shim_unit_path(paths).read_text()
    assert shim_unit.startswith(installer.MARKER + "\n")
    shim = Path(sys.executable).with_name("uapplace-shim")
    assert f"\nExecStart={shim} --host 127.0.0.1 --port 4000\n" in shim_unit
    assert "LimitNOFILE=4096" in shim_unit
    token = paths.token_file
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(token.parent.stat().st_mode) == 0o700
    assert len(token.read_text().strip()) >= 32
    manifest = json.loads(installer.manifest_path(paths).read_text())
    assert [Path(e["path"]).name for e in manifest["files"]] == list(actions(report))
    assert all(len(e["sha256"]) == 64 for e in manifest["files"])
    assert str(paths.runtime_dir) in manifest["dirs"]  # created by install: taken back
    assert stat.S_IMODE(installer.manifest_path(paths).stat().st_mode) == 0o600
    assert jobs == ["reload"]  # --with-shim alone starts nothing

    again = await installer.install(paths, shim=ShimInstall(port=4000))
    assert set(actions(again).values()) == {"unchanged"}
    assert again.manifest is not None and again.manifest.action == "unchanged"


async def test_uninstall_removes_exactly_what_install_wrote(
    paths: Paths, jobs: list[str], tmp_path: Path
) -> None:
    neighbour = paths.user_unit_dir / "someone-else.service"
    await installer.install(paths, shim=ShimInstall(enable=True))
    neighbour.write_text("[Service]\nExecStart=/bin/true\n")
    assert jobs == ["reload", "start"]
    link = installer.shim_wants_path(paths)
    assert link.is_symlink() and link.readlink() == installer.shim_unit_path(paths)

    removed = await installer.uninstall(paths)
    assert removed.ok
    assert jobs[-2:] == ["stop", "reload"]  # stopped before its file goes
    assert set(actions(removed).values()) == {"removed"} and len(removed.files) == 5
    assert not link.is_symlink() and not paths.token_file.exists()
    assert not installer.manifest_path(paths).exists()
    # Only the directory holding the neighbour's file stays; every other one install made goes.
    assert tree(tmp_path) == [
        "config",
        "config/systemd",
        "config/systemd/user",
        "config/systemd/user/someone-else.service",
    ]
    kept = {d.path.name: d.action for d in removed.dirs}
    assert kept["user"] == "kept" and kept["data"] == "removed"

    twice = await installer.uninstall(paths)
    assert [f.action for f in twice.files] == ["absent", "absent"]


async def test_a_token_changed_since_install_is_kept(paths: Paths, jobs: list[str]) -> None:
    await installer.install(paths, shim=ShimInstall())
    paths.token_file.write_text("rotated-by-hand\n")
    removed = await installer.uninstall(paths)
    assert not removed.ok
    assert actions(removed)["token"] == "kept"
    assert paths.token_file.read_text() == "rotated-by-hand\n"
    assert not installer.shim_unit_path(paths).exists()


async def test_an_existing_token_is_neither_replaced_nor_taken_back(
    paths: Paths, jobs: list[str]
) -> None:
    paths.token_file.parent.mkdir(mode=0o700, parents=True)
    paths.token_file.write_text("the-shims-own\n")
    paths.token_file.chmod(0o600)
    report = await installer.install(paths, shim=ShimInstall())
    assert actions(report)["token"] == "unchanged"
    await installer.uninstall(paths)
    assert paths.token_file.read_text() == "the-shims-own\n"


async def test_a_token_directory_others_can_read_is_refused(paths: Paths, jobs: list[str]) -> None:
    paths.token_file.parent.mkdir(mode=0o755, parents=True)
    paths.token_file.parent.chmod(0o755)
    with pytest.raises(InstallError, match=r"uapplace: must be a directory .* mode 0700"):
        await installer.install(paths, shim=ShimInstall())


async def test_a_foreign_file_where_the_link_goes_stops_the_enable(
    paths: Paths, jobs: list[str]
) -> None:
    link = installer.shim_wants_path(paths)
    link.parent.mkdir(parents=True)
    link.write_text("[Unit]\n")
    report = await installer.install(paths, shim=ShimInstall(enable=True))
    assert not report.ok
    by_path = {f.path: f for f in report.files}
    assert by_path[installer.shim_unit_path(paths)].action == "written"
    kept = [by_path[link]]
    assert kept[0].action == "kept" and "is not a link" in kept[0].detail
    assert jobs == ["reload"]  # not started
    await installer.uninstall(paths)
    assert link.read_text() == "[Unit]\n"


async def test_a_broken_manifest_is_an_error_naming_it(paths: Paths, jobs: list[str]) -> None:
    manifest = installer.manifest_path(paths)
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"version": 1, "files": [{"path": "/x", "kind": "socket"}]}))
    with pytest.raises(InstallError, match=rf"{manifest}: not an install manifest \(at files"):
        await installer.uninstall(paths)


async def test_files_of_an_install_without_manifest_go_by_their_marker(
    paths: Paths, jobs: list[str]
) -> None:
    await installer.install(paths)
    installer.manifest_path(paths).unlink()
    removed = await installer.uninstall(paths)
    assert [f.action for f in removed.files] == ["removed", "removed"]
