"""Tiny, deterministic GGUF model files for a real ``llama-server`` on the CPU.

docs/architecture.md ("Test tiers", tier 4). The files are valid llama-architecture
models with random weights: they load in llama.cpp's ``llama-server`` on the CPU in
well under a second, tokenize any text (a SentencePiece-style vocabulary with the 256
byte-fallback tokens) and generate nonsense tokens, which is all a placement test
needs. Nothing is downloaded; the same :class:`TinyModelSpec` always gives the same
bytes.

- :data:`SIZES`: presets with clearly different memory footprints (``tiny-a`` about
  16 MiB of server RSS, ``tiny-b`` 30 MiB, ``tiny-c`` 70 MiB with ``-c 512 --parallel 2``);
  :func:`preset` finds one by name.
- :func:`write_tiny_model` writes one (atomically); :func:`write_corrupt_model` writes a
  file whose header is valid but whose tensor data is cut short, so a server exits 1
  while loading it.

Needs the ``gguf`` package (ggml-org, the ``engines`` extra: ``pip install -e
'.[engines]'``); tested with gguf 0.19.0 and the llama.cpp that
:mod:`uapplace.sim.llamacpp` pins. ``python -m uapplace.sim.gguf_models DIR`` writes
every preset and ``corrupt.gguf`` into ``DIR``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import numpy.typing as npt

SPACE = "\u2581"  # SentencePiece's word-boundary marker
# A few ordinary pieces on top of the byte tokens ("_" stands for SPACE); longer
# pieces score higher, so the tokenizer merges them first.
_LETTERS = "_etaoinshrdlucmfwypvbgkjqxz"
_MERGES = "_t th he _th _the _a in er _h el ll lo _he _hel _hell _hello"
_PIECES: tuple[str, ...] = tuple(p.replace("_", SPACE) for p in [*_LETTERS, *_MERGES.split()])
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape of one tiny llama model; ``name`` becomes ``general.name``."""

    name: str
    n_embd: int = 64
    n_layer: int = 2
    n_ff: int = 128
    n_head: int = 4
    context_length: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.n_embd, self.n_layer, self.n_ff, self.n_head, self.context_length) < 1:
            raise ValueError(f"{self}: every size must be positive")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"{self}: n_embd / n_head must be an even integer")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


# Approximate file sizes: tiny-a 0.4 MiB, tiny-b 13 MiB, tiny-c 52 MiB (all F32).
SIZES: tuple[TinyModelSpec, ...] = (
    TinyModelSpec("tiny-a", n_embd=64, n_layer=2, n_ff=128, n_head=4, seed=1),
    TinyModelSpec("tiny-b", n_embd=256, n_layer=4, n_ff=704, n_head=4, seed=2),
    TinyModelSpec("tiny-c", n_embd=512, n_layer=4, n_ff=1408, n_head=8, seed=3),
)


def preset(name: str) -> TinyModelSpec:
    """The :data:`SIZES` preset called ``name``; a :class:`KeyError` names the known ones."""
    for spec in SIZES:
        if spec.name == name:
            return spec
    raise KeyError(f"no tiny model preset {name!r} (known: {', '.join(s.name for s in SIZES)})")


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    """Tokens, scores and token types of the shared SPM vocabulary."""
    tokens = ["<unk>", "<s>", "</s>"]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [gguf.TokenType.BYTE] * 256
    tokens += list(_PIECES)
    types += [gguf.TokenType.NORMAL] * len(_PIECES)
    scores = [0.0] * 259 + [-100.0 + len(p) for p in _PIECES]
    return tokens, scores, [int(t) for t in types]


def _tensors(spec: TinyModelSpec, n_vocab: int) -> dict[str, npt.NDArray[np.float32]]:
    """Weights in numpy order, which is ggml's shape reversed: (rows, n_embd)."""
    rng = np.random.default_rng(spec.seed)

    def mat(rows: int, cols: int) -> npt.NDArray[np.float32]:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)

    def ones(n: int) -> npt.NDArray[np.float32]:
        return np.ones(n, dtype=np.float32)

    e, f = spec.n_embd, spec.n_ff
    out: dict[str, npt.NDArray[np.float32]] = {"token_embd.weight": mat(n_vocab, e)}
    for i in range(spec.n_layer):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = ones(e)
        out[b + "attn_q.weight"] = mat(e, e)
        out[b + "attn_k.weight"] = mat(e, e)
        out[b + "attn_v.weight"] = mat(e, e)
        out[b + "attn_output.weight"] = mat(e, e)
        out[b + "ffn_norm.weight"] = ones(e)
        out[b + "ffn_gate.weight"] = mat(f, e)
        out[b + "ffn_up.weight"] = mat(f, e)
        out[b + "ffn_down.weight"] = mat(e, f)
    out["output_norm.weight"] = ones(e)
    out["output.weight"] = mat(n_vocab, e)
    return out


def write_tiny_model(path: Path, spec: TinyModelSpec) -> Path:
    """Write ``spec`` as a GGUF file at ``path`` (atomically) and return ``path``."""
    path = Path(path)
    tokens, scores, types = vocabulary()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(tmp, "llama")
    try:
        w.add_name(spec.name)
        w.add_file_type(gguf.LlamaFileType.ALL_F32)
        w.add_context_length(spec.context_length)
        w.add_embedding_length(spec.n_embd)
        w.add_block_count(spec.n_layer)
        w.add_feed_forward_length(spec.n_ff)
        w.add_head_count(spec.n_head)
        w.add_head_count_kv(spec.n_head)
        w.add_rope_dimension_count(spec.head_dim)
        w.add_rope_freq_base(10000.0)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(len(tokens))
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(UNK_ID)
        w.add_bos_token_id(BOS_ID)
        w.add_eos_token_id(EOS_ID)
        w.add_add_bos_token(True)
        for name, data in _tensors(spec, len(tokens)).items():
            w.add_tensor(name, data)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        os.replace(tmp, path)
    finally:
        w.close()
        tmp.unlink(missing_ok=True)
    return path


def write_corrupt_model(path: Path) -> Path:
    """Write a GGUF file whose header is valid but whose tensor data is cut short."""
    path = Path(path)
    full = path.with_name(f".{path.name}.{os.getpid()}.full")
    try:
        write_tiny_model(full, SIZES[0])
        data = full.read_bytes()
    finally:
        full.unlink(missing_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data[: len(data) // 2])
    os.replace(tmp, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Write every preset and ``corrupt.gguf`` into the folder named on the command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) > 1 or (args and args[0].startswith("-")):
        print("usage: python -m uapplace.sim.gguf_models [DIR]", file=sys.stderr)
        return 2
    out_dir = Path(args[0] if args else ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    for spec in SIZES:
        written = write_tiny_model(out_dir / f"{spec.name}.gguf", spec)
        print(f"{written} {written.stat().st_size} bytes")
    print(write_corrupt_model(out_dir / "corrupt.gguf"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
