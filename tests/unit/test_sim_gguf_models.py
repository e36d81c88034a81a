"""Tiny GGUF models (``uapplace.sim.gguf_models``): valid, deterministic, of different sizes.

Read back with the ``gguf`` package's own reader; whether llama-server loads them is the
engines tier's (``tests/engines``).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import gguf
import pytest

from uapplace.sim.gguf_models import (
    SIZES,
    TinyModelSpec,
    preset,
    write_corrupt_model,
    write_tiny_model,
)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_same_spec_gives_the_same_bytes(tmp_path: Path) -> None:
    first = write_tiny_model(tmp_path / "one.gguf", preset("tiny-a"))
    second = write_tiny_model(tmp_path / "two.gguf", preset("tiny-a"))
    assert digest(first) == digest(second)
    other_seed = TinyModelSpec("tiny-a", seed=99)
    assert digest(write_tiny_model(tmp_path / "three.gguf", other_seed)) != digest(first)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.gguf", "three.gguf", "two.gguf"]


def test_a_tiny_model_reads_back_as_a_llama(tmp_path: Path) -> None:
    reader = gguf.GGUFReader(write_tiny_model(tmp_path / "a.gguf", preset("tiny-a")))
    fields = reader.fields

    def text(key: str) -> str:
        field = fields[key]
        return bytes(field.parts[field.data[0]]).decode()

    def number(key: str) -> int:
        field = fields[key]
        return int(field.parts[field.data[0]][0])

    assert (text("general.architecture"), text("general.name")) == ("llama", "tiny-a")
    assert (number("llama.embedding_length"), number("llama.block_count")) == (64, 2)
    assert number("llama.context_length") == 2048
    assert len(fields["tokenizer.ggml.tokens"].data) == 302
    assert len(reader.tensors) == 3 + 9 * 2


def test_the_presets_differ_in_size(tmp_path: Path) -> None:
    sizes = [
        write_tiny_model(tmp_path / f"{spec.name}.gguf", spec).stat().st_size for spec in SIZES[:2]
    ]
    assert sizes[0] < sizes[1] / 10
    assert [spec.name for spec in SIZES] == ["tiny-a", "tiny-b", "tiny-c"]


def test_a_corrupt_model_is_half_a_valid_one(tmp_path: Path) -> None:
    whole = write_tiny_model(tmp_path / "a.gguf", preset("tiny-a")).read_bytes()
    corrupt = write_corrupt_model(tmp_path / "corrupt.gguf").read_bytes()
    assert corrupt == whole[: len(whole) // 2]
    assert corrupt[:4] == b"GGUF"


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"n_layer": 0}, "every size must be positive"),
        ({"n_embd": 60, "n_head": 8}, "must be an even integer"),
    ],
)
def test_a_bad_spec_is_refused(fields: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TinyModelSpec("x", **fields)


def test_an_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="known: tiny-a, tiny-b, tiny-c"):
        preset("tiny-z")


def test_the_command_line_writes_every_preset_and_the_corrupt_file(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uapplace.sim.gguf_models", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["corrupt.gguf", "tiny-a.gguf", "tiny-b.gguf", "tiny-c.gguf"]
    assert "tiny-c.gguf" in done.stdout
