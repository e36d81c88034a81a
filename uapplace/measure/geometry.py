"""The KV geometry ``uapplace measure`` records, from what the engine reports
(docs/placement-rules.md §4.1.1), each figure with where it came from.

Two kinds of engine report it:

- **Strata-like** engines export it in ``/metrics``: ``max_context`` is the context
  pool and the ``kv`` label of an ``*_info`` gauge the KV dtype.
- **llama.cpp** exports no setting in ``/metrics``. Its ``/props`` has
  ``default_generation_settings.n_ctx``, one slot's context (the per-session cap), and
  ``total_slots``; the pool follows from how the slots share the KV cache, which only
  the launch flags say (the unit's live ``ExecStart``):

  - split (``--parallel N`` given, no ``--kv-unified``): each slot owns its share, so
    the pool is ``n_ctx × total_slots``. Not ``-c``: llama.cpp rounds each slot's share
    up to whole 256-cell blocks (measured: ``-c 500 --parallel 3`` allocates 3 × 256 =
    768 cells, ``-c 256 --parallel 2`` 2 × 256 = 512);
  - unified (``-kvu``/``--kv-unified``, or no ``--parallel``: llama.cpp's automatic
    slot count turns the unified pool on; measured: ``-c 512`` alone gives 4 slots of
    512 cells each, ``kv_unified = 'true'``): every slot sees the one pool, so it is
    ``n_ctx``, or ``-c`` when that is larger (``--kv-unified-per-slot`` caps each slot
    below the pool), or ``n_ctx × total_slots`` with ``--kv-unified-per-slot`` and no
    ``-c`` (llama.cpp then sizes the pool so).

  The KV dtype is ``--cache-type-k``/``-ctk``, else llama.cpp's default ``f16``.
  llama.cpp allocates the whole pool at start (it is inside the measured footprint)
  and never grows it: a session past its slot's ``n_ctx`` is cut, not given more
  memory, so the marginal KV rate ``kv_mib_per_1k_cells`` is recorded as 0 — without
  it every request past the pool (the 32,768 cells a request names by default) would
  cost "unknown" and the config could never be placed (docs/placement-rules.md §4.4).

- **vLLM** exports its cache in ``/metrics`` under the ``vllm:`` prefix (issue 21 item 8):
  the labels of ``vllm:cache_config_info`` (``num_gpu_blocks``, ``block_size``,
  ``cache_dtype``). Its pool is ``num_gpu_blocks × block_size`` cells, allocated at start
  (``--gpu-memory-utilization``) and never grown, so ``kv_mib_per_1k_cells`` is 0 as for
  llama.cpp; the KV dtype is ``cache_dtype`` (``auto``: the model's own dtype, recorded
  as reported), the per-session cap ``--max-model-len`` from the live ``ExecStart``.

Flags set through the environment (``LLAMA_ARG_N_PARALLEL``, ``LLAMA_ARG_CTX_SIZE``, …)
or hidden in a wrapper script are not seen: without ``--parallel`` in ``ExecStart`` the
pool recorded is one slot's ``n_ctx`` (unified), the least the pool can be.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from uapplace.core.model import Config
from uapplace.io import engines

LLAMA_CPP_DEFAULT_KV = "f16"
"""llama.cpp's ``--cache-type-k`` default."""
FIXED_POOL_RATE = 0.0
"""``kv_mib_per_1k_cells`` of an engine whose pool is fixed at start (module doc)."""
VLLM_PREFIX = "vllm:"
"""vLLM's ``/metrics`` series prefix."""
VLLM_CACHE_INFO = "vllm:cache_config_info"
"""The vLLM info gauge whose labels describe its KV cache."""
DIAGNOSTICS = ("expert_cache_mib", "arena_mib")
"""``/metrics`` figures recorded for diagnosis only, never in the cost."""

_CTX = ("-c", "--ctx-size")
_PARALLEL = ("-np", "--parallel")
_UNIFIED = ("-kvu", "--kv-unified")
_NOT_UNIFIED = ("-no-kvu", "--no-kv-unified")
_PER_SLOT = ("--kv-unified-per-slot",)
_CACHE_TYPE_K = ("-ctk", "--cache-type-k")
_MAX_MODEL_LEN = "--max-model-len"


@dataclass(frozen=True)
class LaunchFlags:
    """The llama-server flags of a unit's ``ExecStart`` that shape its KV cache."""

    seen: bool
    """An ``ExecStart`` was read (``False``: none, so nothing below is known)."""
    ctx_size: int | None = None
    """``-c``/``--ctx-size`` when positive (0 means the model's own context)."""
    parallel: int | None = None
    """``-np``/``--parallel`` when positive (-1, the default, means automatic)."""
    kv_unified: bool | None = None
    """``-kvu``/``--kv-unified`` (``True``) or ``-no-kvu`` (``False``), the last one given."""
    per_slot_limit: bool = False
    """``--kv-unified-per-slot`` was given."""
    cache_type_k: str | None = None
    max_model_len: int | None = None
    """vLLM's ``--max-model-len`` when positive: one request's context cap."""

    @property
    def unified(self) -> bool:
        """The slots share one KV pool: asked for, or the automatic slot count's default
        (which llama.cpp applies even over ``-no-kvu``, measured)."""
        return self.kv_unified is True or self.parallel is None


def launch_flags(exec_start: str) -> LaunchFlags:
    """The flags of :class:`LaunchFlags` in ``exec_start`` (``UnitState.exec_start``: each
    command's argv joined by spaces, commands by ``"; "``); the last occurrence wins, as
    in llama.cpp. ``--flag=value`` is not llama.cpp syntax and is not read."""
    tokens = exec_start.replace("; ", " ").split()
    if not tokens:
        return LaunchFlags(seen=False)
    ctx = parallel = None
    unified: bool | None = None
    per_slot = False
    cache_type: str | None = None
    max_len: int | None = None
    for index, token in enumerate(tokens):
        value = tokens[index + 1] if index + 1 < len(tokens) else None
        if token in _CTX:
            ctx = _int_flag(value)
        elif token in _PARALLEL:
            parallel = _int_flag(value)
        elif token in _UNIFIED:
            unified = True
        elif token in _NOT_UNIFIED:
            unified = False
        elif token in _PER_SLOT:
            per_slot = True
        elif token in _CACHE_TYPE_K and value is not None:
            cache_type = value
        elif token == _MAX_MODEL_LEN:
            max_len = _int_flag(value)
    return LaunchFlags(True, ctx, parallel, unified, per_slot, cache_type, max_len)


def launch_args(exec_start: str) -> tuple[str, ...]:
    """The arguments of ``exec_start`` (``UnitState.exec_start``) after each command's
    program: the launch line a measurement was taken under, recorded as the config's
    ``flags`` so ``validate`` checks ``execStartMustContain`` against what really ran."""
    return tuple(arg for command in exec_start.split("; ") for arg in command.split()[1:])


def _int_flag(value: str | None) -> int | None:
    try:
        number = int(value) if value is not None else 0
    except ValueError:
        return None
    return number if number >= 1 else None


@dataclass(frozen=True)
class Geometry:
    """The config fields to record and, for each, where it came from."""

    fields: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)
    """Field (and ``slots``) → a phrase for the operator: ``/props total_slots``."""


def kv_geometry(
    config: Config,
    metrics: Mapping[str, float | str],
    props: Mapping[str, Any] | None,
    slot_list: Sequence[Mapping[str, Any]] | None,
    flags: LaunchFlags,
) -> Geometry:
    """What ``measure`` records for ``config`` from the engine's answers (module doc):
    ``/metrics`` first (Strata-like), then llama.cpp's ``/props`` with the launch flags;
    ``/slots`` only for a per-slot context ``/props`` does not have. Nothing is invented
    where the engine reports nothing."""
    out = Geometry()
    per_slot, slots = _slot_figures(props, slot_list, out)
    llama = props is not None and _props_n_ctx(props) is not None
    pool = _positive_int(metrics.get("max_context"))
    vllm = _vllm_pool(metrics)
    if pool is not None:
        out.sources["context_pool_cells"] = "/metrics max_context"
    elif vllm is not None:
        pool = vllm
        _vllm_geometry(config, metrics, flags, out)
    elif llama and per_slot is not None:
        pool, why = llama_cpp_pool(per_slot, slots, flags)
        out.sources["context_pool_cells"] = why
        if config.kv_mib_per_1k_cells is None:
            out.fields["kv_mib_per_1k_cells"] = FIXED_POOL_RATE
            out.sources["kv_mib_per_1k_cells"] = (
                "0: llama.cpp allocates its whole pool at start and never grows it (a "
                "longer session is cut at its slot's n_ctx)"
            )
    if pool is not None:
        out.fields["context_pool_cells"] = pool
        out.fields["kv_resident_cells"] = config.kv_resident_cells or pool
        out.sources["kv_resident_cells"] = (
            "the registry's kv_resident_cells"
            if config.kv_resident_cells
            else "the whole pool: allocated at start"
        )
    _kv_dtype(metrics, llama, flags, out)
    for name in DIAGNOSTICS:
        value = metrics.get(name)
        if isinstance(value, float) and value >= 0:
            out.fields[name] = value
            out.sources[name] = f"/metrics {name} (diagnostic, never in the cost)"
    return out


def _vllm_pool(metrics: Mapping[str, float | str]) -> int | None:
    """vLLM's pool in cells from ``vllm:cache_config_info``'s labels (module doc)."""
    if not any(key.startswith(VLLM_PREFIX) for key in metrics):
        return None
    blocks = _label_int(metrics.get("num_gpu_blocks"))
    size = _label_int(metrics.get("block_size"))
    return blocks * size if blocks is not None and size is not None else None


def _vllm_geometry(
    config: Config, metrics: Mapping[str, float | str], flags: LaunchFlags, out: Geometry
) -> None:
    """The rest of a vLLM's geometry beside its pool (module doc)."""
    out.sources["context_pool_cells"] = (
        f"/metrics {VLLM_CACHE_INFO} num_gpu_blocks {metrics.get('num_gpu_blocks')} × "
        f"block_size {metrics.get('block_size')}"
    )
    if config.kv_mib_per_1k_cells is None:
        out.fields["kv_mib_per_1k_cells"] = FIXED_POOL_RATE
        out.sources["kv_mib_per_1k_cells"] = (
            "0: vLLM allocates its whole KV pool at start (--gpu-memory-utilization) and "
            "never grows it"
        )
    dtype = metrics.get("cache_dtype")
    if isinstance(dtype, str) and dtype and not isinstance(metrics.get("kv"), str):
        out.fields["kv"] = dtype
        out.sources["kv"] = f"/metrics {VLLM_CACHE_INFO} cache_dtype"
    if flags.max_model_len is not None and "per_session_cap_cells" not in out.fields:
        out.fields["per_session_cap_cells"] = flags.max_model_len
        out.sources["per_session_cap_cells"] = "ExecStart --max-model-len"


def _label_int(value: float | str | None) -> int | None:
    """A label value (a string in the flattened ``/metrics``) as a positive integer."""
    try:
        number = float(value) if value is not None else 0.0
    except ValueError:
        return None
    return _positive_int(number)


def llama_cpp_pool(per_slot: int, slots: int | None, flags: LaunchFlags) -> tuple[int, str]:
    """llama.cpp's whole KV pool in cells, and why (module doc)."""
    share = f"{per_slot} cells per slot (/props default_generation_settings.n_ctx)"
    if not flags.seen:
        return per_slot, f"{share}; no ExecStart read, so one slot's context, the least it is"
    if slots is None or slots == 1:
        return per_slot, f"{share}, one slot" if slots == 1 else f"{share}, slot count unknown"
    if not flags.unified:
        asked = f"; ExecStart -c {flags.ctx_size}" if flags.ctx_size else ""
        return per_slot * slots, (
            f"{slots} slots × {share}: split KV (ExecStart --parallel {flags.parallel}, no "
            f"--kv-unified){asked}"
        )
    how = "--kv-unified" if flags.kv_unified else "no --parallel in ExecStart: automatic slots"
    if flags.ctx_size is not None and flags.ctx_size > per_slot:
        return (
            flags.ctx_size,
            f"ExecStart -c {flags.ctx_size}: one KV pool for {slots} slots ({how})",
        )
    if flags.ctx_size is None and flags.per_slot_limit:
        return per_slot * slots, (
            f"{slots} slots × {share}: --kv-unified-per-slot without -c sizes the pool so"
        )
    return per_slot, f"{share}: one KV pool shared by {slots} slots ({how})"


def _slot_figures(
    props: Mapping[str, Any] | None, slot_list: Sequence[Mapping[str, Any]] | None, out: Geometry
) -> tuple[int | None, int | None]:
    """One slot's context and the slot count, recorded in ``out``."""
    per_slot = _props_n_ctx(props) if props is not None else None
    slots = _positive_int(props.get("total_slots")) if props is not None else None
    if per_slot is not None:
        out.sources["per_session_cap_cells"] = "/props default_generation_settings.n_ctx"
    elif slot_list:
        per_slot = _positive_int(slot_list[0].get("n_ctx"))
        if per_slot is not None:
            out.sources["per_session_cap_cells"] = "/slots n_ctx"
    if slots is not None:
        out.sources["slots"] = f"{slots} (/props total_slots)"
    elif slot_list:
        slots = len(slot_list)
        out.sources["slots"] = f"{slots} (/slots)"
    if per_slot is not None:
        out.fields["per_session_cap_cells"] = per_slot
    return per_slot, slots


def _kv_dtype(
    metrics: Mapping[str, float | str], llama: bool, flags: LaunchFlags, out: Geometry
) -> None:
    kv = metrics.get("kv")
    if isinstance(kv, str) and kv:
        out.fields["kv"], out.sources["kv"] = kv, "/metrics kv label"
    elif llama and flags.cache_type_k:
        out.fields["kv"] = flags.cache_type_k
        out.sources["kv"] = "ExecStart --cache-type-k"
    elif llama and flags.seen:
        out.fields["kv"] = LLAMA_CPP_DEFAULT_KV
        out.sources["kv"] = "llama.cpp's default (no --cache-type-k/-ctk in ExecStart)"


def _props_n_ctx(props: Mapping[str, Any]) -> int | None:
    settings = props.get(engines.N_CTX_SETTING)
    return _positive_int(settings.get("n_ctx")) if isinstance(settings, dict) else None


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value) if math.isfinite(value) and value >= 1 else None
