"""write_conflict_dropins: Conflicts=/After= drop-ins, stale removal, refusal of bad names."""

from __future__ import annotations

from pathlib import Path

import pytest

from uapplace.io.units import DROPIN_NAME, unit_name, write_conflict_dropins


def dropin(unit_dir: Path, unit: str) -> Path:
    return unit_dir / f"{unit}.d" / DROPIN_NAME


def unit_section(path: Path) -> dict[str, str]:
    lines = [x for x in path.read_text().splitlines() if x and not x.startswith("#")]
    assert lines[0] == "[Unit]"
    return dict(line.split("=", 1) for line in lines[1:])


def test_units_sharing_a_device_conflict_both_ways(tmp_path: Path) -> None:
    changed = write_conflict_dropins(tmp_path, {"gpu0": ["uap-b", "uap-a"], "gpu1": ["uap-c"]})

    a, b = dropin(tmp_path, "uap-a.service"), dropin(tmp_path, "uap-b.service")
    assert changed == [a, b]
    assert unit_section(a) == {"Conflicts": "uap-b.service"}
    # One order for every pair: b runs after a, so a stop of one is finished
    # before the start of the other, whichever way the swap goes.
    assert unit_section(b) == {"Conflicts": "uap-a.service", "After": "uap-a.service"}
    assert not (tmp_path / "uap-c.service.d").exists()


def test_a_unit_in_two_groups_conflicts_with_both(tmp_path: Path) -> None:
    write_conflict_dropins(tmp_path, {"gpu0": ["m", "x"], "gpu1": ["m", "y"]})

    assert unit_section(dropin(tmp_path, "m.service")) == {"Conflicts": "x.service y.service"}
    assert unit_section(dropin(tmp_path, "x.service")) == {
        "Conflicts": "m.service",
        "After": "m.service",
    }
    # x and y share no device: neither names the other.
    assert unit_section(dropin(tmp_path, "y.service")) == {
        "Conflicts": "m.service",
        "After": "m.service",
    }


def test_unchanged_files_are_not_rewritten(tmp_path: Path) -> None:
    groups = {"gpu0": ["a", "b"]}
    assert len(write_conflict_dropins(tmp_path, groups)) == 2
    before = dropin(tmp_path, "a.service").stat().st_mtime_ns

    assert write_conflict_dropins(tmp_path, groups) == []
    assert dropin(tmp_path, "a.service").stat().st_mtime_ns == before


def test_stale_dropins_are_removed_and_others_kept(tmp_path: Path) -> None:
    write_conflict_dropins(tmp_path, {"gpu0": ["a", "b", "c"]})
    operator_file = tmp_path / "a.service.d" / "10-operator.conf"
    operator_file.write_text("[Service]\nNice=5\n")

    changed = write_conflict_dropins(tmp_path, {"gpu0": ["b", "c"]})

    assert dropin(tmp_path, "a.service") in changed
    assert not dropin(tmp_path, "a.service").exists()
    assert operator_file.read_text() == "[Service]\nNice=5\n"
    assert unit_section(dropin(tmp_path, "b.service")) == {"Conflicts": "c.service"}

    write_conflict_dropins(tmp_path, {})
    assert not (tmp_path / "b.service.d").exists()
    assert not (tmp_path / "c.service.d").exists()
    assert operator_file.exists()


def test_typed_names_keep_their_suffix(tmp_path: Path) -> None:
    write_conflict_dropins(tmp_path, {"gpu0": ["llama.cpp", "vllm.service"]})

    assert unit_section(dropin(tmp_path, "llama.cpp.service"))["Conflicts"] == "vllm.service"
    assert unit_section(dropin(tmp_path, "vllm.service"))["Conflicts"] == "llama.cpp.service"


@pytest.mark.parametrize(
    "bad",
    ["../x", "a/b", "..", "x..y", "a b", "a\nb", "a\n", "", "-lead", ".hidden", "a;rm -rf"],
)
def test_malicious_names_are_refused_before_anything_is_written(tmp_path: Path, bad: str) -> None:
    with pytest.raises(ValueError) as caught:
        write_conflict_dropins(tmp_path, {"gpu0": ["fine", bad]})

    assert "groups['gpu0'][1]" in str(caught.value)
    assert repr(bad) in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_non_string_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"groups\['gpu0'\]\[0\]: unit name must be a string"):
        write_conflict_dropins(tmp_path, {"gpu0": [7, "b"]})  # type: ignore[list-item]


def test_a_symlinked_dropin_dir_pointing_outside_is_refused(tmp_path: Path) -> None:
    unit_dir = tmp_path / "units"
    outside = tmp_path / "outside"
    unit_dir.mkdir()
    outside.mkdir()
    (unit_dir / "a.service.d").symlink_to(outside)

    with pytest.raises(ValueError, match="outside"):
        write_conflict_dropins(unit_dir, {"gpu0": ["a", "b"]})

    assert list(outside.iterdir()) == []


def test_unit_name_appends_service_and_checks() -> None:
    assert unit_name("uap-strata") == "uap-strata.service"
    assert unit_name("x.target") == "x.target"
    assert unit_name("tpl@1.service") == "tpl@1.service"
    with pytest.raises(ValueError, match=r"invalid unit name '\.\./etc'"):
        unit_name("../etc")
