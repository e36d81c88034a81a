"""The admit decision: forward to a resident, or park with a reason.

docs/placement-rules.md §4.3; the wire format is docs/http-contract.md §1.

This is the hot path the proxy holds to a 2 s timeout, so ``decide`` does
dictionary look-ups only: the resident index and the registry index are
rebuilt when the controller hands over new residents or a new registry, and
the planner is never run here (the controller attaches options afterwards
with :meth:`Admission.replace`).

Decision table, in order:

=====================================================  ===================================
condition                                              answer
=====================================================  ===================================
empty model id (a bus caller; the shim answers 400)    park ``invalid_request``, no entry
a ``hot`` resident that serves the id                 forward ``<device>:<endpoint>``
id over 1,024 characters the registry does not name    park ``invalid_request``, no entry
a live pending entry for ``(client, model)``           park, same id, the entry's reason
                                                       (``warming`` while only a warming
                                                       resident serves the id)
only a ``warming`` resident serves the id              park ``warming``
id not in the registry                                 park ``unknown_model``
no measured config it could load                       park ``no_measured_config``
otherwise                                              park ``not_resident``
=====================================================  ===================================

"Can serve" is narrower than docs/http-contract.md §1 (which only rules out
``draining``): only a ``hot`` resident serves (docs/invariants.md, invariant 2:
publication). ``hot`` is set
only by a verify-up that passed in this daemon's life (health 200, the id in
``/v1/models``, ``metricsMustMatch``): by an enforcement run or by the unit sync
(:mod:`uapplace.publish.unitsync`). A ``warming`` resident (loading, restored from the
ledger, found running at start-up or started by hand, or serving a wrong id) is
never forwarded to: an admit for an id only a warming resident serves parks with
reason ``warming`` (the proxy's retry forwards once it is published). A
``paused`` resident has its weights offloaded, so it parks ``not_resident`` like
any unloaded model; a ``draining`` one refuses new work.

**Bounded state.** Every admit that parks a new ``(client, model)`` pair creates an
entry, so a flood of distinct pairs must not grow memory (or the ledger) without end:

- ``client`` and ``session`` are cut to 128 characters (docs/http-contract.md §1) here, on every
  path (bus, peer socket, shim). A model id over 1,024 characters that the registry
  does not name parks ``invalid_request`` with no entry, like an empty one (the shim
  answers 400 for both; its 10 KiB body bound is the same kind of limit).
- At most 32 pending entries per client and 1,024 in all. Over a cap, the admit still
  parks with a new entry and its true reason (the only answers the contract lets a
  proxy act on are forward and a park with a valid ``plc-`` id; a park without an id,
  or a 429, makes the proxy fall back to its read-only mode and answer
  ``no_controller``, which would be false). Room is made by expiring early the oldest
  entry of that client (first cap) or the oldest entry overall (second cap): the
  newest request is the one a human or a retrying client is waiting on, and a client
  whose entry was pushed out gets a fresh one on its next retry (the proxy retries
  every 2 s). The controller takes the pushed-out entries with :meth:`take_evicted`
  and resolves them ``expired``. A flood therefore churns through the oldest entries;
  it cannot grow state, and the other clients' entries survive a single client's flood.
- Expired, resolved and pushed-out entries leave every index (:meth:`_drop`), so the
  memory is released, not just hidden.

An id is served when it is the resident's model key, its config key or one of
its model's advertised ids. "No measured config" looks at the config a config
key pins, else at every config of the model.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from uapplace.core.errors import InvalidArgument
from uapplace.core.model import (
    DEFAULT_CELLS,
    Config,
    Decision,
    Option,
    ParkReason,
    PendingEntry,
    Registry,
    Resident,
    ResidentState,
)

DEFAULT_TTL_SECONDS = 120.0
MAX_IDENTITY_CHARS = 128
MAX_MODEL_ID_CHARS = 1024
"""Longer model ids park ``invalid_request`` with no entry unless the registry names them
(the shim answers 400 for them, as for a missing id)."""
MAX_PENDING_PER_CLIENT = 32
MAX_PENDING = 1024
PLACEMENT_ID = re.compile(r"^plc-[0-9a-f]{6}$")
_ID_ATTEMPTS = 64
_SERVING_STATES = frozenset({ResidentState.HOT})
"""Only a resident that passed verify-up in this daemon's life is forwarded to."""


TRIM_AFTER_EXPIRED = 64
"""An expiry sweep that frees at least this many entries hands freed heap back to the OS."""


def return_freed_memory() -> None:
    """Ask glibc to give freed heap pages back to the OS (``malloc_trim(0)``).

    After a flood the entries, their 1 KB ids, the signals and the ledger texts are
    freed, but glibc keeps freed blocks in its arenas: RSS stays at the flood's peak
    (measured by ``bench/flood_rss.py``). ``malloc_trim`` releases what is free, in a
    few milliseconds; the controller runs it in a thread after a large expiry. Where the
    C library has no ``malloc_trim`` (musl) it does nothing: RSS stays high, bounded by
    the caps.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)


async def return_freed_memory_soon(delay_s: float = 1.0) -> None:
    """:func:`return_freed_memory` in a thread, once the ledger write that follows an
    expiry sweep has dropped its (large) texts too."""
    await asyncio.sleep(delay_s)
    await asyncio.to_thread(return_freed_memory)


def new_placement_id() -> str:
    """``plc-`` + 6 lowercase hex digits (24 bits; docs/http-contract.md §1)."""
    return "plc-" + secrets.token_hex(3)


def can_serve(resident: Resident) -> bool:
    """Only ``hot`` serves: verified in this daemon's life (see the module doc)."""
    return resident.state in _SERVING_STATES


def served_ids(registry: Registry, resident: Resident) -> tuple[str, ...]:
    """The ids a resident answers to: model key, config key, the model's advertised ids."""
    model = registry.models.get(resident.model)
    if model is None:
        resolved = registry.lookup(resident.model)
        model = resolved[0] if resolved is not None else None
    advertised = model.advertises if model is not None else ()
    return (resident.model, resident.config, *advertised)


class Admission:
    """Pending entries and the §4.3 decision; all state in memory, owned by the controller."""

    def __init__(
        self,
        registry: Registry,
        new_id: Callable[[], str] | None = None,
        ttl: float = DEFAULT_TTL_SECONDS,
    ) -> None:
        if ttl <= 0:
            raise ValueError(f"ttl: must be positive seconds, got {ttl}")
        self._new_id = new_id or new_placement_id
        self._ttl = ttl
        self._registry = registry
        self._residents: tuple[Resident, ...] = ()
        self._park_reasons: dict[str, ParkReason] = {}
        """Why each registry id parks when nothing serves it, precomputed."""
        self._serving: dict[str, Resident] = {}
        self._warming: frozenset[str] = frozenset()
        """Ids that only a ``warming`` resident serves: they park ``warming``."""
        self._pending: dict[str, PendingEntry] = {}
        """Insertion order is creation order (a replace keeps the slot): oldest first."""
        self._by_key: dict[tuple[str, str], str] = {}
        self._by_client: dict[str, dict[str, None]] = {}
        """Client → its entry ids, oldest first (a dict used as an ordered set)."""
        self._evicted: list[PendingEntry] = []
        """Entries pushed out by the caps, until :meth:`take_evicted` hands them over."""
        self._index_registry()

    # ----------------------------------------------------------------- inputs

    @property
    def ttl(self) -> float:
        return self._ttl

    def set_registry(self, registry: Registry) -> None:
        """A new registry: re-index its ids and the residents' advertised ids; a pending
        entry parked for what the registry said (unknown, unmeasured, loadable) now says
        what the new one says (issue 19: a model measured meanwhile is ``not_resident``)."""
        self._registry = registry
        self._index_registry()
        self._index_residents()
        for entry in list(self._pending.values()):
            if entry.reason in _REGISTRY_REASONS:
                reason = self._park_reason(entry.requested_model)
                if reason is not entry.reason:
                    self._pending[entry.id] = replace(entry, reason=reason)

    def set_residents(self, residents: Sequence[Resident]) -> None:
        """The ledger's residents now; the forward index is rebuilt from them."""
        self._residents = tuple(residents)
        self._index_residents()

    def _index_registry(self) -> None:
        # Same precedence as Registry.resolve: a model key wins, then the first
        # model (in order) advertising the id or owning the config key.
        reasons: dict[str, ParkReason] = {}
        for model in self._registry.models.values():
            for advertised in model.advertises:
                reasons.setdefault(advertised, _loadable(model.configs.values()))
            for config in model.configs.values():
                reasons.setdefault(config.key, _loadable((config,)))
        for model in self._registry.models.values():
            reasons[model.key] = _loadable(model.configs.values())
        self._park_reasons = reasons

    def _index_residents(self) -> None:
        serving: dict[str, Resident] = {}
        warming: set[str] = set()
        for resident in sorted(self._residents, key=lambda r: r.device):
            ids = served_ids(self._registry, resident)
            if can_serve(resident):
                for model_id in ids:
                    serving.setdefault(model_id, resident)
            elif resident.state is ResidentState.WARMING:
                warming.update(ids)
        self._serving = serving
        self._warming = frozenset(warming - serving.keys())
        self._refresh_warming_reasons()

    def _refresh_warming_reasons(self) -> None:
        """Pending entries say ``warming`` exactly while only a warming resident serves
        their id (``not_resident`` again when it goes away unpublished)."""
        for entry in list(self._pending.values()):
            requested = entry.requested_model
            if entry.reason is ParkReason.WARMING and requested not in self._warming:
                fallback = self._park_reasons.get(requested, ParkReason.UNKNOWN_MODEL)
                self._pending[entry.id] = replace(entry, reason=fallback)
            elif entry.reason is ParkReason.NOT_RESIDENT and requested in self._warming:
                self._pending[entry.id] = replace(entry, reason=ParkReason.WARMING)

    # ----------------------------------------------------------------- the decision

    def decide(
        self, model: str, client: str, session: str | None, cells: int | None, now: float
    ) -> tuple[Decision, PendingEntry | None]:
        """Forward or park one admit. The second item is the entry this call created."""
        if not model or not model.strip():
            return Decision("park", reason=ParkReason.INVALID_REQUEST.value), None
        resident = self._serving.get(model)
        if resident is not None:
            return Decision("forward", target_id=resident.target_id), None
        if self._too_long(model):
            return Decision("park", reason=ParkReason.INVALID_REQUEST.value), None
        client = client[:MAX_IDENTITY_CHARS]
        known = self._live_entry(client, model, now)
        if known is not None:
            if model in self._warming and known.reason is not ParkReason.WARMING:
                known = replace(known, reason=ParkReason.WARMING)
                self._pending[known.id] = known
            return _park(known), None
        entry = PendingEntry(
            id=self._fresh_id(),
            requested_model=model,
            client=client,
            session=session[:MAX_IDENTITY_CHARS] if session is not None else None,
            created_at=now,
            expires_at=now + self._ttl,
            reason=self._park_reason(model),
            cells=cells if cells is not None and cells > 0 else DEFAULT_CELLS,
        )
        self._evicted.extend(self._make_room(client))
        self._store(entry)
        return _park(entry), entry

    def _make_room(self, client: str) -> list[PendingEntry]:
        """Drop the oldest entries so one more for ``client`` stays within both caps."""
        gone: list[PendingEntry] = []
        own = self._by_client.get(client)
        while own and len(own) >= MAX_PENDING_PER_CLIENT:
            dropped = self._drop(next(iter(own)))
            gone += [dropped] if dropped is not None else []
            own = self._by_client.get(client)
        while len(self._pending) >= MAX_PENDING:
            dropped = self._drop(next(iter(self._pending)))
            gone += [dropped] if dropped is not None else []
        return gone

    def take_evicted(self) -> list[PendingEntry]:
        """The entries the caps pushed out since the last call (the caller says ``expired``)."""
        gone, self._evicted = self._evicted, []
        return gone

    def _too_long(self, model: str) -> bool:
        return len(model) > MAX_MODEL_ID_CHARS and model not in self._park_reasons

    def _park_reason(self, model: str) -> ParkReason:
        if model in self._warming:
            return ParkReason.WARMING
        return self._park_reasons.get(model, ParkReason.UNKNOWN_MODEL)

    def _live_entry(self, client: str, model: str, now: float) -> PendingEntry | None:
        entry_id = self._by_key.get((client, model))
        if entry_id is None:
            return None
        entry = self._pending[entry_id]
        if entry.expired(now):
            self._drop(entry_id)
            return None
        return entry

    def _fresh_id(self) -> str:
        for _ in range(_ID_ATTEMPTS):
            candidate = self._new_id()
            if not PLACEMENT_ID.match(candidate):
                raise ValueError(f"new_id: {candidate!r} is not plc- + 6 lowercase hex digits")
            if candidate not in self._pending:
                return candidate
        raise RuntimeError(f"no unused placement id after {_ID_ATTEMPTS} attempts")

    # ----------------------------------------------------------------- pending entries

    @property
    def pending(self) -> Mapping[str, PendingEntry]:
        """Read-only view, id → entry. May hold entries past expiry until ``expire`` runs."""
        return MappingProxyType(self._pending)

    def get(self, placement_id: str, now: float | None = None) -> PendingEntry | None:
        """The entry, or ``None``; with ``now``, an expired entry is dropped and not returned."""
        entry = self._pending.get(placement_id)
        if entry is not None and now is not None and entry.expired(now):
            self._drop(placement_id)
            return None
        return entry

    def remove(self, placement_id: str) -> PendingEntry | None:
        return self._drop(placement_id)

    def expire(self, now: float) -> list[PendingEntry]:
        """Drop and return every entry whose ``expires_at`` has passed."""
        gone = [e.id for e in self._pending.values() if e.expired(now)]
        return [e for e in (self._drop(i) for i in gone) if e is not None]

    def replace(self, entry: PendingEntry) -> None:
        """Update an existing entry (reason, options, expiry). Raises ``KeyError`` if unknown.

        The dedupe key ``(client, requested_model)`` is the entry's identity and
        must not change (``ValueError``).
        """
        current = self._pending.get(entry.id)
        if current is None:
            raise KeyError(f"no pending placement {entry.id!r}")
        if (current.client, current.requested_model) != (entry.client, entry.requested_model):
            raise ValueError(
                f"placement {entry.id}: client and requested_model cannot change "
                f"({current.client!r}, {current.requested_model!r})"
            )
        self._pending[entry.id] = entry

    def restore(self, entries: Iterable[PendingEntry], now: float) -> list[PendingEntry]:
        """Load entries from the ledger at start; returns the ones not kept.

        Expired entries are dropped. Two live entries for one ``(client, model)``
        keep the one that expires last. Identities are re-truncated to 128.
        """
        dropped: list[PendingEntry] = []
        for raw in sorted(entries, key=lambda e: e.expires_at):
            entry = _truncated(raw)
            if entry.expired(now) or self._too_long(entry.requested_model):
                dropped.append(raw)
                continue
            earlier = self._by_key.get((entry.client, entry.requested_model))
            if earlier is not None:
                superseded = self._drop(earlier)
                if superseded is not None:
                    dropped.append(superseded)
            clash = self._drop(entry.id)
            if clash is not None:
                dropped.append(clash)
            dropped += self._make_room(entry.client)
            self._store(entry)
        return dropped

    def resolved_by(self, resident: Resident) -> list[PendingEntry]:
        """The pending entries this resident satisfies (it can serve their requested id)."""
        if not can_serve(resident):
            return []
        ids = set(served_ids(self._registry, resident))
        return [e for e in self._pending.values() if e.requested_model in ids]

    def _store(self, entry: PendingEntry) -> None:
        self._pending[entry.id] = entry
        self._by_key[(entry.client, entry.requested_model)] = entry.id
        self._by_client.setdefault(entry.client, {})[entry.id] = None

    def _drop(self, placement_id: str) -> PendingEntry | None:
        entry = self._pending.pop(placement_id, None)
        if entry is not None:
            key = (entry.client, entry.requested_model)
            if self._by_key.get(key) == placement_id:
                del self._by_key[key]
            own = self._by_client.get(entry.client)
            if own is not None:
                own.pop(placement_id, None)
                if not own:
                    del self._by_client[entry.client]  # no empty dicts left behind
        return entry


def chosen_option(entry: PendingEntry, option: int) -> Option:
    """Option ``option`` (1-based, as ``ListPending`` numbers them) of ``entry``.

    The one range check of ``Apply``: the controller and the enforcer both ask here
    (the CLI, which holds ``ListPending``'s JSON, asks :func:`check_option_index`).
    Raises :class:`~uapplace.core.errors.InvalidArgument` when the entry has no options
    or the index is out of range.
    """
    check_option_index(entry.id, option, len(entry.options))
    return entry.options[option - 1]


def check_option_index(placement_id: str, option: int, count: int) -> None:
    """Raise :class:`~uapplace.core.errors.InvalidArgument` unless ``option`` is in
    ``1..count``, the options placement ``placement_id`` has (none when ``count`` is 0)."""
    if count == 0:
        raise InvalidArgument(
            f"placement {placement_id} has no options (see `uapplace pending`); "
            "nothing can be applied"
        )
    if not 1 <= option <= count:
        raise InvalidArgument(
            f"option {option} is out of range: placement {placement_id} has options 1..{count}"
        )


_REGISTRY_REASONS = frozenset(
    {ParkReason.UNKNOWN_MODEL, ParkReason.NO_MEASURED_CONFIG, ParkReason.NOT_RESIDENT}
)
"""Park reasons that only restate the registry, recomputed when it changes."""


def _loadable(configs: Iterable[Config]) -> ParkReason:
    if any(c.is_measured for c in configs):
        return ParkReason.NOT_RESIDENT
    return ParkReason.NO_MEASURED_CONFIG


def _park(entry: PendingEntry) -> Decision:
    return Decision("park", placement_id=entry.id, reason=entry.reason.value)


def _truncated(entry: PendingEntry) -> PendingEntry:
    session = entry.session[:MAX_IDENTITY_CHARS] if entry.session is not None else None
    return replace(entry, client=entry.client[:MAX_IDENTITY_CHARS], session=session)
