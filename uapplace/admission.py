"""The admit decision: forward to a resident, or park with a reason (spec §4.3, CONTRACT.md §1).

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
a resident that can serve the id                       forward ``<device>:<endpoint>``
a live pending entry for ``(client, model)``           park, same id, the entry's reason
id not in the registry                                 park ``unknown_model``
no measured config it could load                       park ``no_measured_config``
otherwise                                              park ``not_resident``
=====================================================  ===================================

"Can serve" deviates from CONTRACT.md's wording ("not ``draining``") in one
way: a ``paused`` resident does not serve either. Its weights are offloaded,
so forwarding to it would send a request to an engine that cannot answer; it
parks ``not_resident`` like any unloaded model. A ``warming`` resident does
forward: the proxy's retry reaches it once it is up.

An id is served when it is the resident's model key, its config key or one of
its model's advertised ids. "No measured config" looks at the config a config
key pins, else at every config of the model.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from types import MappingProxyType

from uapplace.model import (
    DEFAULT_CELLS,
    Config,
    Decision,
    ParkReason,
    PendingEntry,
    Registry,
    Resident,
    ResidentState,
)

DEFAULT_TTL_SECONDS = 120.0
MAX_IDENTITY_CHARS = 128
PLACEMENT_ID = re.compile(r"^plc-[0-9a-f]{6}$")
_ID_ATTEMPTS = 64
_STATE_PREFERENCE = {ResidentState.HOT: 0, ResidentState.WARMING: 1}
"""When two residents serve one id, a hot one wins over a warming one."""


def new_placement_id() -> str:
    """``plc-`` + 6 lowercase hex digits (24 bits; CONTRACT.md §1)."""
    return "plc-" + secrets.token_hex(3)


def can_serve(resident: Resident) -> bool:
    """Draining residents refuse new work; paused ones have no weights loaded."""
    return resident.state in _STATE_PREFERENCE


def served_ids(registry: Registry, resident: Resident) -> tuple[str, ...]:
    """The ids a resident answers to: model key, config key, the model's advertised ids."""
    model = registry.models.get(resident.model)
    if model is None:
        resolved = registry.resolve(resident.model)
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
        self._pending: dict[str, PendingEntry] = {}
        self._by_key: dict[tuple[str, str], str] = {}
        self._index_registry()

    # ----------------------------------------------------------------- inputs

    @property
    def ttl(self) -> float:
        return self._ttl

    def set_registry(self, registry: Registry) -> None:
        """A new registry: re-index its ids and the residents' advertised ids."""
        self._registry = registry
        self._index_registry()
        self._index_residents()

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
        ranked = sorted(
            (r for r in self._residents if can_serve(r)),
            key=lambda r: (_STATE_PREFERENCE[r.state], r.device),
        )
        for resident in ranked:
            for model_id in served_ids(self._registry, resident):
                serving.setdefault(model_id, resident)
        self._serving = serving

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
        client = client[:MAX_IDENTITY_CHARS]
        known = self._live_entry(client, model, now)
        if known is not None:
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
        self._store(entry)
        return _park(entry), entry

    def _park_reason(self, model: str) -> ParkReason:
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
            if entry.expired(now):
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

    def _drop(self, placement_id: str) -> PendingEntry | None:
        entry = self._pending.pop(placement_id, None)
        if entry is not None:
            key = (entry.client, entry.requested_model)
            if self._by_key.get(key) == placement_id:
                del self._by_key[key]
        return entry


def _loadable(configs: Iterable[Config]) -> ParkReason:
    if any(c.is_measured for c in configs):
        return ParkReason.NOT_RESIDENT
    return ParkReason.NO_MEASURED_CONFIG


def _park(entry: PendingEntry) -> Decision:
    return Decision("park", placement_id=entry.id, reason=entry.reason.value)


def _truncated(entry: PendingEntry) -> PendingEntry:
    session = entry.session[:MAX_IDENTITY_CHARS] if entry.session is not None else None
    return replace(entry, client=entry.client[:MAX_IDENTITY_CHARS], session=session)
