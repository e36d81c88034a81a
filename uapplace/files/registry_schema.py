"""The registry files' schema (docs/placement-rules.md §4.1): what a repo or local registry may say.

Pydantic models for both files (``RegistryDoc``, ``LocalRegistryDoc`` and their
parts), the field types they share with the capacity policy (``UnitName``,
``Endpoint`` …), and the translation of pydantic's errors into
:class:`~uapplace.files.jsonfile.ConfigFileError` (file, JSON path, message). Used by
:mod:`uapplace.files.registry` (load and merge), :mod:`uapplace.files.registry_write` (local
measurements) and :mod:`uapplace.files.capacity`. Nothing here reads or writes a file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from uapplace.core.model import PauseLever, parse_iso
from uapplace.core.unitnames import UNIT_NAME_RE, engineless_kind, valid_unit_name
from uapplace.files.jsonfile import ConfigFileError

DEVICE_KEY_RE = r"^[A-Za-z0-9_.-]+$"
"""Device keys become the ``<device>:`` half of a proxy ``target_id`` (docs/http-contract.md §1)."""
_CONFIG_TAGS = ("measured", "unmeasured")

# Ranges (docs/placement-rules.md §4.7): far beyond any real machine, and small enough
# that every sum and product the planner makes stays an exact, finite number.
MAX_MIB = 1 << 30
"""1 PiB, in MiB: the most any memory figure may say."""
MAX_CELLS = 2**32 - 1
"""Context cells travel as a D-Bus ``u`` (32 bits)."""
MAX_SECONDS = 86_400.0
"""A day: the most a start, stop or wake figure or bound may say."""
MAX_RAILS = 4096
MAX_KEY_CHARS = 256
"""Model, config and device keys, advertised ids, service and engine names."""
MAX_TEXT_CHARS = 4096
"""Free text (display names, reasons, launch lines, paths, flags)."""
MAX_LIST_ITEMS = 1024
_UNSAFE_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
"""C0 and C1 controls (ESC included), DEL, and the Unicode bidi overrides and isolates."""


# --------------------------------------------------------------------------- errors


def combined(errors: list[ConfigFileError]) -> ConfigFileError:
    """The first error, carrying the rest in :attr:`ConfigFileError.others`."""
    first, *rest = errors
    return ConfigFileError(first.file, first.json_path, first.message, tuple(rest))


def raise_all(errors: list[ConfigFileError]) -> None:
    """Raise :func:`combined` of ``errors``, if there are any."""
    if errors:
        raise combined(errors)


def json_path(loc: Iterable[str | int]) -> str:
    """``("models", "m", "configs", 0)`` → ``$.models.m.configs[0]``."""
    out = "$"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _clean_loc(loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """Drop the discriminator tag pydantic puts after a config key, and its ``[key]`` marker."""
    parts = list(loc)
    is_config = len(parts) > 4 and parts[0] == "models" and parts[2] == "configs"
    if is_config and parts[4] in _CONFIG_TAGS:
        del parts[4]
    return tuple(p for p in parts if p != "[key]")


def validation_errors(
    exc: ValidationError, file: Path, prefix: tuple[str | int, ...] = ()
) -> list[ConfigFileError]:
    """One :class:`ConfigFileError` per pydantic error, each naming its JSON path.

    ``prefix`` roots the paths when the validated object sits inside a larger file.
    """
    out: list[ConfigFileError] = []
    for err in exc.errors(include_url=False):
        loc = (*prefix, *err["loc"])
        message = str(err["msg"])
        given = err.get("input")
        if err["type"] == "float_type" and isinstance(given, int) and not isinstance(given, bool):
            message = f"a {len(str(abs(given)))}-digit integer is too large for this number"
        if "[key]" in loc:
            message = f"bad key: {message}"
        out.append(ConfigFileError(file, json_path(_clean_loc(loc)), message))
    return out


def _check_unit(name: str) -> str:
    if not valid_unit_name(name):
        raise ValueError(
            f"invalid unit name {name!r}: must match {UNIT_NAME_RE.pattern}, "
            "contain no '..' and no '/'"
        )
    kind = engineless_kind(name)
    if kind is not None:
        raise ValueError(
            f"unit {name!r} is a .{kind}, which runs no engine: a model's unit is the one "
            "that runs its server (a .service, or a .socket or .scope)"
        )
    return name


def check_plain_text(text: str) -> str:
    """No control character (ESC, NUL, newline …), DEL or bidi override: a key or a name
    is printed on the operator's terminal and sent over the bus and HTTP."""
    found = _UNSAFE_CHARS.search(text)
    if found is not None:
        raise ValueError(
            f"contains the control character U+{ord(found.group()):04X} at position "
            f"{found.start()}: keys, ids and names must be printable text"
        )
    return text


def _check_endpoint(url: str) -> str:
    check_plain_text(url)
    scheme, sep, rest = url.partition("://")
    if scheme not in ("http", "https") or not sep or not rest or any(c.isspace() for c in url):
        raise ValueError(f"endpoint {url!r} must be an http:// or https:// URL with no spaces")
    return url


def _check_iso(text: str) -> str:
    try:
        parse_iso(text)
    except ValueError:
        raise ValueError(f"{text!r} is not an ISO-8601 time such as 2026-10-08T14:02:00Z") from None
    return text


UnitName = Annotated[str, AfterValidator(_check_unit)]
Endpoint = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(_check_endpoint)]
IsoTime = Annotated[str, Field(max_length=64), AfterValidator(_check_iso)]
DeviceKey = Annotated[str, Field(pattern=DEVICE_KEY_RE, max_length=MAX_KEY_CHARS)]
NonEmpty = Annotated[
    str, Field(min_length=1, max_length=MAX_KEY_CHARS), AfterValidator(check_plain_text)
]
"""A key or an id: printable, at most :data:`MAX_KEY_CHARS` characters."""
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), AfterValidator(check_plain_text)]
Mib = Annotated[float, Field(ge=0, le=MAX_MIB)]
WholeMib = Annotated[int, Field(ge=0, le=MAX_MIB)]
Cells = Annotated[int, Field(ge=1, le=MAX_CELLS)]
Seconds = Annotated[float, Field(gt=0, le=MAX_SECONDS)]
SecondsOrZero = Annotated[float, Field(ge=0, le=MAX_SECONDS)]


# --------------------------------------------------------------------------- file schema


class _Doc(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True, allow_inf_nan=False)


class DeviceOverlayDoc(_Doc):
    """A device in the local file: any subset of fields, each overriding the repo's.

    The fields of :class:`DeviceDoc`, in the same order, none required."""

    kind: Literal["gpu", "cpu"] | None = None
    total_mib: Annotated[int, Field(ge=1, le=MAX_MIB)] | None = None
    reserved_mib: WholeMib | None = None
    name: Text | None = None
    reserve_reason: Text | None = None
    uuid: NonEmpty | None = None


class DeviceDoc(DeviceOverlayDoc):
    """A device in the repo file (and a merged one): ``kind`` and the sizes required."""

    kind: Literal["gpu", "cpu"]
    total_mib: Annotated[int, Field(ge=1, le=MAX_MIB)]
    reserved_mib: WholeMib
    name: Text = ""
    reserve_reason: Text = ""

    @field_validator("reserved_mib")
    @classmethod
    def _reserve_fits(cls, reserved: int, info: ValidationInfo) -> int:
        total = info.data.get("total_mib")
        if isinstance(total, int) and reserved > total:
            raise ValueError(
                f"reserved_mib {reserved} exceeds total_mib {total}: a device cannot reserve "
                "more than it has"
            )
        return reserved


class MeasuredDeviceDoc(_Doc):
    """The device a measurement was taken on, as ``measure`` read it from the probe."""

    name: NonEmpty | None = None
    uuid: NonEmpty | None = None
    total_mib: Annotated[int, Field(ge=1, le=MAX_MIB)] | None = None


class EnvelopeDoc(_Doc):
    """A config's measured enforcement envelope (``uapplace measure --envelope``; seconds)."""

    stop_s: SecondsOrZero
    free_s: SecondsOrZero
    cold_start_s: SecondsOrZero
    warm_start_s: SecondsOrZero
    sleep_s: SecondsOrZero | None = None
    sleep_freed_mib: Mib | None = None
    wake_s: SecondsOrZero | None = None
    measured_at: IsoTime
    measured_on: NonEmpty


class MeasuredConfigDoc(_Doc):
    status: Literal["measured"] = "measured"
    resident_gpu_mib: Mib
    host_rss_mib: Mib
    context_pool_cells: Cells | None = None
    per_session_cap_cells: Cells | None = None
    kv_resident_cells: Annotated[int, Field(ge=0, le=MAX_CELLS)] | None = None
    kv_mib_per_1k_cells: Mib | None = None
    kv: NonEmpty | None = None
    measured_at: IsoTime | None = None
    measured_on: NonEmpty | None = None
    measured_device: MeasuredDeviceDoc | None = None
    engine_build: NonEmpty | None = None
    flags: Annotated[list[Text], Field(max_length=MAX_LIST_ITEMS)] = []
    # What the engine ran as when measured (docs/placement-rules.md §4.1.1, stale rule):
    # the digest of the unit's live ExecStart and the build the engine itself reported.
    exec_start_sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    measured_build: NonEmpty | None = None
    unit: UnitName | None = None
    endpoint: Endpoint | None = None
    # Diagnostics `measure` records (docs/placement-rules.md §4.1.1); never in the cost.
    expert_cache_mib: Mib | None = None
    arena_mib: Mib | None = None
    host_free_mib: Mib | None = None
    # Start facts for enforcement's verify-up bound (timeouts.Timeouts.verify_up_bound).
    start_s: Seconds | None = None
    start_timeout_s: Seconds | None = None
    # The engine's in-process pause lever (model.PauseLever; issue 12), declared, not measured.
    pause_lever: PauseLever | None = None
    # The measured enforcement envelope (machine-local; measure.py, timeouts.Timeouts).
    envelope: EnvelopeDoc | None = None


class UnmeasuredConfigDoc(_Doc):
    status: Literal["unmeasured"]
    unit: UnitName | None = None
    endpoint: Endpoint | None = None
    start_timeout_s: Seconds | None = None
    pause_lever: PauseLever | None = None


def config_tag(raw: Any) -> str:
    if isinstance(raw, dict) and raw.get("status") == "unmeasured":
        return "unmeasured"
    return "measured"


ConfigDoc = Annotated[
    Annotated[MeasuredConfigDoc, Tag("measured")]
    | Annotated[UnmeasuredConfigDoc, Tag("unmeasured")],
    Discriminator(config_tag),
]


Keys = Annotated[list[NonEmpty], Field(max_length=MAX_LIST_ITEMS)]


class AffinityDoc(_Doc):
    device: Keys = []


class ModelOverlayDoc(_Doc):
    """A model in the local file: fields override the repo's; configs replace per key.

    The fields of :class:`ModelDoc`, in the same order (field provenance is listed in
    it), none required."""

    display: NonEmpty | None = None
    engine: NonEmpty | None = None
    configs: dict[NonEmpty, ConfigDoc] = {}
    unit: UnitName | None = None
    launch: Text | None = None
    profile: Text | None = None
    endpoint: Endpoint | None = None
    service: NonEmpty | None = None
    rails: Annotated[int, Field(ge=1, le=MAX_RAILS)] | None = None
    rails_source: Text | None = None
    task_affinity: Keys | None = None
    affinity: AffinityDoc | None = None
    advertises: Keys | None = None
    engine_build: NonEmpty | None = None


class ModelDoc(ModelOverlayDoc):
    """A model in the repo file (and a merged one): ``display``, ``engine`` and at least
    one config required."""

    display: NonEmpty
    engine: NonEmpty
    configs: Annotated[dict[NonEmpty, ConfigDoc], Field(min_length=1)]
    task_affinity: Keys = []
    advertises: Keys = []


class ProxyDoc(_Doc):
    """How the proxy in front reaches the engines (:mod:`uapplace.core.topology`)."""

    single_upstream: Endpoint | None = None
    """Every request goes to this one address (the stock UAP proxy's ``LLAMA_CPP_BASE``);
    null: the proxy routes by ``target_id``; absent: the same, but the registry's ports are
    checked against the proxy (:mod:`uapplace.files.proxyenv`)."""


class RegistryDoc(_Doc):
    version: Literal[1]
    devices: dict[DeviceKey, DeviceDoc] = {}
    models: dict[NonEmpty, ModelDoc] = {}
    proxy: ProxyDoc | None = None


class LocalRegistryDoc(_Doc):
    version: Literal[1] = 1
    devices: dict[DeviceKey, DeviceOverlayDoc] = {}
    models: dict[NonEmpty, ModelOverlayDoc] = {}
    proxy: ProxyDoc | None = None
    """Overrides the repo's ``proxy.single_upstream`` when it names the key (null: off)."""


DocT = TypeVar("DocT", bound=BaseModel)


def parse_doc(
    doc_type: type[DocT], raw: Any, file: Path, prefix: tuple[str | int, ...] = ()
) -> DocT:
    """Validate ``raw``; every problem becomes a :class:`ConfigFileError` at ``prefix + loc``."""
    try:
        return doc_type.model_validate(raw)
    except ValidationError as exc:
        raise_all(validation_errors(exc, file, prefix))
        raise  # unreachable: a ValidationError always carries at least one error
