"""files.jsonfile: the size, nesting, number and duplicate-key rules every reader shares."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from uapplace.files import jsonfile
from uapplace.files.jsonfile import (
    CONFIG_MAX_BYTES,
    MAX_DEPTH,
    ConfigFileError,
    atomic_write,
    dumps,
    first_problem,
    move_aside,
    parse_json,
    read_capped_or_none,
    read_json,
)


def nested_arrays(depth: int) -> str:
    return "[" * depth + "]" * depth


def nested_objects(depth: int) -> str:
    return '{"a":' * (depth - 1) + "{}" + "}" * (depth - 1)


def write(tmp_path: Path, text: str | bytes, name: str = "file.json") -> Path:
    path = tmp_path / name
    if isinstance(text, str):
        path.write_text(text, encoding="utf-8")
    else:
        path.write_bytes(text)
    return path


def test_a_plain_document_reads(tmp_path: Path) -> None:
    path = write(tmp_path, '{"a": [1, 2.5, "x", null, true], "b": {"c": -3e2}}')
    assert read_json(path) == {"a": [1, 2.5, "x", None, True], "b": {"c": -300.0}}


@pytest.mark.parametrize("build", [nested_arrays, nested_objects])
def test_nesting_at_the_limit_reads_and_one_more_is_refused_with_its_path(
    tmp_path: Path, build: Any
) -> None:
    assert read_json(write(tmp_path, build(MAX_DEPTH))) is not None
    with pytest.raises(ConfigFileError) as caught:
        read_json(write(tmp_path, build(MAX_DEPTH + 1)))
    err = caught.value
    assert err.message == f"nested deeper than {MAX_DEPTH} levels of arrays and objects"
    expected = "$" + ("[0]" if build is nested_arrays else ".a") * MAX_DEPTH
    assert err.json_path == expected
    assert str(err).startswith(f"{tmp_path / 'file.json'}: $")


@pytest.mark.parametrize("depth", [1_000, 100_000, 1_000_000])
def test_nesting_past_the_decoder_guard_is_a_named_error_not_a_recursion_error(
    tmp_path: Path, depth: int
) -> None:
    for text in (nested_arrays(depth), '{"k":' * depth + "1" + "}" * depth):
        with pytest.raises(ConfigFileError, match="nested deeper than 64 levels"):
            read_json(write(tmp_path, text), max_bytes=jsonfile.LEDGER_MAX_BYTES)


def test_a_deep_python_value_is_walked_without_recursion() -> None:
    value: Any = []
    for _ in range(50_000):
        value = [value]
    problem = first_problem(value)
    assert problem is not None
    assert problem[0] == "$" + "[0]" * MAX_DEPTH


def test_over_the_size_cap_is_refused_before_parsing(tmp_path: Path) -> None:
    path = write(tmp_path, '"' + "x" * CONFIG_MAX_BYTES + '"')
    with pytest.raises(ConfigFileError) as caught:
        read_json(path)
    assert caught.value.json_path == "$"
    assert "over the 4 MiB limit" in caught.value.message
    small = write(tmp_path, "[1, 2, 3]", "small.json")
    assert read_json(small, max_bytes=9) == [1, 2, 3]
    with pytest.raises(ConfigFileError, match="over the 8 bytes limit"):
        read_json(small, max_bytes=8)


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ('{"a": NaN}', "$.a", "NaN is not a finite number"),
        ('{"a": [1, Infinity]}', "$.a[1]", "Infinity is not a finite number"),
        ('{"a": {"b": -Infinity}}', "$.a.b", "-Infinity is not a finite number"),
        ('{"a": 1e999}', "$.a", "1e999 is not a finite number"),
        ('[{"x": -1E+400}]', "$[0].x", "-1E+400 is not a finite number"),
    ],
)
def test_numbers_that_are_not_finite_are_refused_with_their_path(
    tmp_path: Path, text: str, where: str, what: str
) -> None:
    with pytest.raises(ConfigFileError) as caught:
        read_json(write(tmp_path, text))
    assert caught.value.json_path == where
    assert caught.value.message.startswith(what)


def test_non_finite_numbers_can_be_kept_for_an_item_by_item_caller(tmp_path: Path) -> None:
    value = read_json(write(tmp_path, '{"a": NaN, "b": 1e999}'), allow_non_finite=True)
    assert value["a"] != value["a"] and value["b"] == float("inf")


def test_an_integer_past_the_digit_limit_is_a_named_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="invalid JSON number"):
        read_json(write(tmp_path, '{"a": ' + "9" * 5000 + "}"))


def test_a_duplicate_key_is_refused_with_the_object_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError) as caught:
        read_json(write(tmp_path, '{"m": {"ok": 1, "k": 1, "k": 2}}'))
    assert caught.value.json_path == "$.m"
    assert caught.value.message == "duplicate key 'k' in one JSON object"


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"{not json", "invalid JSON at line 1 column 2"),
        (b"", "invalid JSON at line 1 column 1"),
        (b"\xff\xfe{}", "not UTF-8 text"),
        (b"[1,]", "invalid JSON at line 1 column 4"),
    ],
)
def test_broken_text_is_a_named_error(tmp_path: Path, raw: bytes, message: str) -> None:
    with pytest.raises(ConfigFileError, match=message):
        read_json(write(tmp_path, raw))


def test_a_missing_file_is_named_and_read_capped_or_none_says_none(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="file not found"):
        read_json(tmp_path / "absent.json")
    assert read_capped_or_none(tmp_path / "absent.json") is None


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigFileError, match="not a regular file"):
        read_json(fifo)


def test_a_directory_and_a_device_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigFileError, match="not a regular file"):
        read_json(tmp_path)
    with pytest.raises(ConfigFileError, match="not a regular file"):
        read_json(Path("/dev/zero"))


def test_long_and_odd_keys_are_quoted_and_shortened_in_paths(tmp_path: Path) -> None:
    key = "a key with spaces " + "z" * 60
    with pytest.raises(ConfigFileError) as caught:
        read_json(write(tmp_path, json.dumps({key: [1, 2]})[:-1] + ', "x": NaN}'))
    assert caught.value.json_path == "$.x"
    with pytest.raises(ConfigFileError) as caught:
        parse_json(json.dumps({key: {"v": 1}}).replace("1", "NaN"), tmp_path / "f")
    assert caught.value.json_path == '$["a key with spaces zzzzzzzzzzzzzzzzzzzzzz…"].v'


def test_dumps_never_writes_a_bare_nan(caplog: pytest.LogCaptureFixture) -> None:
    value = {"ok": 1.5, "bad": [float("nan"), float("inf")], "neg": -float("inf")}
    with caplog.at_level(logging.ERROR, logger="uapplace.files.jsonfile"):
        text = dumps(value, sort_keys=True)
    assert "NaN" not in text and "Infinity" not in text
    assert json.loads(text) == {"bad": [None, None], "neg": None, "ok": 1.5}
    assert "$.bad[0] is not a finite number" in caplog.text
    assert dumps({"a": 1}) == '{"a": 1}'


def test_atomic_write_replaces_whole_with_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    atomic_write(path, "one\n", mode=0o640)
    atomic_write(path, "two\n", mode=0o600)
    assert path.read_text() == "two\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_move_aside_never_overwrites_an_earlier_copy(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    targets = []
    for text in ("first", "second", "third"):
        path.write_text(text)
        targets.append(move_aside(path))
    assert not path.exists()
    assert [t.read_text() for t in targets] == ["first", "second", "third"]
    assert len(set(targets)) == 3
    assert all(t.name.startswith("policy.json.corrupt-") for t in targets)


def test_a_failed_atomic_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "out.json"
    path.mkdir()  # the rename onto it fails
    (path / "kept").write_text("x")
    with pytest.raises(OSError):
        atomic_write(path, "new\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
    assert (path / "kept").read_text() == "x"


def test_mode_of_keeps_an_operators_mode_and_defaults_for_a_new_file(tmp_path: Path) -> None:
    path = tmp_path / "model-registry.json"
    assert jsonfile.mode_of(path, 0o644) == 0o644
    path.write_text("{}")
    path.chmod(0o640)
    assert jsonfile.mode_of(path, 0o644) == 0o640
    atomic_write(path, "{}\n", mode=jsonfile.mode_of(path, 0o644))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_move_aside_to_a_named_target_replaces_it(tmp_path: Path) -> None:
    path = tmp_path / "enforcement-journal.json"
    target = tmp_path / "enforcement-journal.json.broken"
    target.write_text("older")
    path.write_text("{broken")
    assert move_aside(path, target) == target
    assert not path.exists()
    assert target.read_text() == "{broken"


def test_ledger_and_config_caps_are_documented_constants() -> None:
    assert jsonfile.CONFIG_MAX_BYTES == 4 * 1024 * 1024
    assert jsonfile.LEDGER_MAX_BYTES == 16 * 1024 * 1024
    assert jsonfile.MAX_DEPTH == 64
