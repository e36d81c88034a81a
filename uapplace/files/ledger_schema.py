"""The ledger file's schema (docs/placement-rules.md §4.2) and its translation to the inside types.

Pydantic models for ``placement.json`` and each of its items (devices, residents,
pending entries with their options and victims, alerts), strict about what a file
may hold (unknown fields, ``NaN``, times that are not ISO-8601 UTC), and the
functions that turn a validated item into the frozen dataclasses of
:mod:`uapplace.core.model` and :mod:`uapplace.core.alerts`. Used by :mod:`uapplace.files.ledger`
(which reads, drops bad items alone and writes); nothing here touches a file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_type_hints

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, create_model

from uapplace.core.alerts import Alert, AlertKind, Severity
from uapplace.core.model import (
    DEFAULT_CELLS,
    DeviceKind,
    DeviceReading,
    Holder,
    Option,
    OptionKind,
    ParkReason,
    PendingEntry,
    ProbeSource,
    ProcessUsage,
    Resident,
    ResidentState,
    Victim,
    VictimAction,
)
from uapplace.files.registry_schema import (
    MAX_CELLS,
    MAX_MIB,
    MAX_TEXT_CHARS,
    Endpoint,
    Mib,
    NonEmpty,
    UnitName,
)

LEDGER_ID_RE = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
"""A pending entry's id (``plc-`` + 6 hex digits when uapplaced made it): never a path
(``../../x``), never a control character."""
MAX_PID = 1 << 22
"""Linux's largest ``pid_max``."""
MAX_NAME_CHARS = 1024
"""A model id, client or session in the ledger (admission cuts identities to 128)."""

LedgerId = Annotated[str, Field(pattern=LEDGER_ID_RE)]
Pid = Annotated[int, Field(ge=0, le=MAX_PID)]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS)]
Cookie = Annotated[int, Field(ge=0, le=2**32 - 1)]


def _iso_seconds(value: Any) -> float:
    if not isinstance(value, str):
        raise ValueError("expected an ISO-8601 UTC time such as 2026-10-08T14:02:11Z")
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"not an ISO-8601 time: {value!r}") from None
    if moment.tzinfo is None:
        raise ValueError(f"time without a zone (end it with Z): {value!r}")
    return moment.timestamp()


def _iso_text(value: str) -> str:
    _iso_seconds(value)
    return value


IsoSeconds = Annotated[float, BeforeValidator(_iso_seconds)]
IsoText = Annotated[str, AfterValidator(_iso_text)]


class StrictJson(BaseModel):
    # NaN / ±inf are refused: one NaN gpu_mib made every preview and park fail.
    model_config = ConfigDict(extra="forbid", populate_by_name=True, allow_inf_nan=False)


class ProcessJson(StrictJson):
    pid: Pid
    used_mib: Mib
    command: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] = ""


class DeviceJson(StrictJson):
    kind: DeviceKind
    total_mib: Mib
    free_mib: Annotated[float, Field(ge=-MAX_MIB, le=MAX_MIB)]
    source: ProbeSource
    processes: Annotated[list[ProcessJson], Field(max_length=4096)] = []
    uuid: str | None = None
    error: str | None = None
    # The registry's reserve may come next to the reading (docs/placement-rules.md §4.2);
    # accepted, not kept (the registry is where it lives).
    reserved_mib: float | None = None
    headroom_mib: float | None = None


class HolderJson(StrictJson):
    client: Name
    kind: Literal["inflight", "hold"]
    detail: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] = ""
    started_at: Annotated[str, Field(max_length=64)] | None = None
    cookie: Cookie | None = None


def schema_of(inside: type[Any], name: str, spelled: Mapping[str, tuple[Any, Any]]) -> Any:
    """A file model with ``inside``'s fields (a :mod:`uapplace.core.model` dataclass): its
    names, order, types and defaults, but for the fields in ``spelled``, each with the
    file's ``(type, default)`` (``...``: required). The dataclass is the one list of fields.
    """
    fields = dataclasses.fields(inside)
    unknown = set(spelled) - {f.name for f in fields}
    if unknown:
        raise TypeError(f"{name}: {sorted(unknown)} are not fields of {inside.__name__}")
    hints = get_type_hints(inside)
    definitions: dict[str, Any] = {
        f.name: spelled.get(f.name)
        or (hints[f.name], ... if f.default is dataclasses.MISSING else f.default)
        for f in fields
    }
    return create_model(name, __base__=StrictJson, __module__=__name__, **definitions)


if TYPE_CHECKING:  # what mypy sees: the fields typed code reads; the class is built below

    class ResidentJson(StrictJson):
        holders: list[HolderJson]

else:
    ResidentJson = schema_of(
        Resident,
        "ResidentJson",
        {
            "model": (NonEmpty, ...),
            "config": (NonEmpty, ...),
            "device": (NonEmpty, ...),
            "unit": (UnitName | None, ...),
            "endpoint": (Endpoint | None, ...),
            "gpu_mib": (Mib | None, ...),
            "host_rss_mib": (Mib | None, ...),
            "since": (IsoText, ...),
            "holders": (Annotated[list[HolderJson], Field(max_length=4096)], []),
            "main_pid": (Pid | None, None),
        },
    )
    """A resident as the file holds it: :class:`~uapplace.core.model.Resident`'s fields,
    ``since`` an ISO-8601 UTC time, ``holders`` a list; a ``unit`` systemd may be handed
    (:func:`~uapplace.core.unitnames.valid_unit_name`: never ``../../evil.service``), keys
    that are printable text, figures in range (docs/placement-rules.md §4.7)."""


class VictimJson(StrictJson):
    model: str
    config: str
    state: ResidentState
    device: str
    holders: list[HolderJson] = []
    in_flight: bool | None
    frees_mib: float
    consequence: str
    reload_mib: float | None = None
    # Issue 12: the action on this victim and what it costs (model.Victim).
    action: VictimAction = "stop"
    serve_again_s: float | None = None
    residual_mib: float = 0.0
    host_grows_mib: float = 0.0
    alternative: str = ""
    # Issue 19: host RAM it frees, and the kind of its device (the CPU tier).
    frees_host_mib: float = 0.0
    device_kind: DeviceKind = DeviceKind.GPU


class OptionJson(StrictJson):
    kind: OptionKind
    model: str
    config: str
    device: str
    cost_mib: float
    victims: list[VictimJson] = []
    affinity_match: bool = Field(default=False, alias="affinityMatch")
    # Derived from the victims by Option; accepted on input, recomputed on output.
    signature: list[str] | None = None
    frees_mib: float | None = None
    frees_host_mib: float | None = None
    expected_s: float | None = None
    host_mib: float = 0.0
    device_kind: DeviceKind = DeviceKind.GPU


class PendingJson(StrictJson):
    id: LedgerId
    requested_model: Name
    client: Name
    session: Name | None = None
    pid: Pid | None = None
    created_at: IsoSeconds
    expires_at: IsoSeconds
    reason: ParkReason
    cells: int = Field(default=DEFAULT_CELLS, gt=0, le=MAX_CELLS)
    options: Annotated[list[OptionJson], Field(max_length=256)] = []
    # ListPending's 1-based pointer into options; derived, so not kept.
    recommended: int | None = None


class AlertJson(StrictJson):
    id: str
    kind: AlertKind
    severity: Severity
    subject: str
    message: str
    raised_at: IsoSeconds
    updated_at: IsoSeconds
    count: int = Field(default=1, ge=1)
    detail: dict[str, Any] = {}


class LedgerJson(StrictJson):
    version: Literal[1]
    updated_at: IsoSeconds
    devices: dict[str, DeviceJson] = {}
    residents: list[ResidentJson] = []
    pending: list[PendingJson] = []
    usage: dict[str, IsoSeconds] = {}
    cooldowns: dict[str, IsoSeconds] = {}
    alerts: list[AlertJson] = []


class LedgerHeadJson(StrictJson):
    """What a file must get right as a whole; everything else is checked item by item."""

    version: Literal[1]
    updated_at: IsoSeconds


# --------------------------------------------------------------------------- to the inside types


def fields_of(data: BaseModel, *, leave_out: frozenset[str] = frozenset()) -> dict[str, Any]:
    """``data``'s validated fields by name, as they are (nested models not dumped).

    The file models (here and in :mod:`uapplace.files.journal`) name their fields as the
    dataclasses of :mod:`uapplace.core.model` do, so each converter passes these on and
    converts only the nested items; fields the file may carry but the inside type
    derives or drops (``leave_out``) are left out."""
    return {name: getattr(data, name) for name in type(data).model_fields if name not in leave_out}


def holder_from(data: HolderJson) -> Holder:
    return Holder(**fields_of(data))


def reading_from(key: str, data: DeviceJson) -> DeviceReading:
    """The reading under ``key``; the registry's ``reserved_mib``/``headroom_mib`` a document
    may carry beside it (docs/placement-rules.md §4.2) are not kept (the registry owns them)."""
    fields = fields_of(data, leave_out=frozenset({"reserved_mib", "headroom_mib", "processes"}))
    processes = tuple(ProcessUsage(**fields_of(p)) for p in data.processes)
    return DeviceReading(key=key, processes=processes, **fields)


def resident_from(data: ResidentJson) -> Resident:
    holders = tuple(holder_from(h) for h in data.holders)
    return Resident(**{**fields_of(data), "holders": holders})


def victim_from(data: VictimJson) -> Victim:
    holders = tuple(holder_from(h) for h in data.holders)
    return Victim(**{**fields_of(data), "holders": holders})


def option_from(data: OptionJson) -> Option:
    """``signature``, ``frees_mib`` and ``frees_host_mib`` are derived from the victims:
    recomputed, not read."""
    derived = frozenset({"signature", "frees_mib", "frees_host_mib", "victims"})
    fields = fields_of(data, leave_out=derived)
    return Option(victims=tuple(victim_from(v) for v in data.victims), **fields)


def pending_from(data: PendingJson) -> PendingEntry:
    """``recommended`` (ListPending's pointer into the options) is derived: not kept."""
    fields = fields_of(data, leave_out=frozenset({"recommended", "options"}))
    return PendingEntry(options=tuple(option_from(o) for o in data.options), **fields)


def alert_from(data: AlertJson) -> Alert:
    return Alert(**{**fields_of(data), "detail": dict(data.detail)})
