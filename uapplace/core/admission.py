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
a ``hot`` resident that serves the id (and whose      forward ``<device>:<endpoint>``
config's ``per_session_cap_cells`` holds the request's
``cells``, when the request carries them)
id over 1,024 characters the registry does not name    park ``invalid_request``, no entry
a live pending entry for ``(client, model)``           park, same id, the entry's reason
                                                       (``warming`` while only a warming
                                                       resident serves the id; ``failed``
                                                       after its switch failed)
an entry for ``(client, model)`` dismissed or expired  park ``refused``, that entry's id,
within ``REFUSED_WINDOW_S`` (or expired, not yet       no new entry (no new prompt)
swept)
only a ``warming`` resident serves the id              park ``warming``
only a ``paused`` resident serves the id               park ``paused``
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
``paused`` resident has its weights offloaded: an id only it serves parks ``paused``
(a ``wake`` option brings it back); a ``draining`` one refuses new work.

**Clean fallbacks** (issue 21). A client whose request the operator dismissed, or that
expired unanswered, gets ``refused`` with that entry's id on its retries for
``REFUSED_WINDOW_S``: the proxy answers it with a 409 naming the refused placement, and
nobody is prompted again (before, the retry parked under a new id and prompted again). The
controller records the refusal (:meth:`Admission.refuse`) when it resolves the entry; at
most ``MAX_REFUSED`` are kept, oldest forgotten first, in memory only (a restarted daemon
has forgotten them: the retry parks afresh). An entry whose approved switch failed
stays pending with reason ``failed`` (:meth:`Admission.mark_failed`), so the client can
tell "failed" from "waiting" and the operator can pick another option; one resolved
``failed`` (an incomplete rollback) answers ``failed`` for the window, like a refusal.

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

**Context fits** (issue 21 item 8). A request that carries ``cells`` (docs/http-contract.md
§1) is forwarded only to a resident whose config's ``per_session_cap_cells`` (the context
one session gets, as measured) is at least that; a resident with no recorded cap takes
any. When no serving resident fits, the admit parks like an unloaded model (the planner
then offers configs that fit). A request without ``cells`` is forwarded as before; so is
one asking exactly ``DEFAULT_CELLS`` (32,768), the figure the contract and the shim put in
for a missing ``cells``, so it cannot be told from one.

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

from uapplace.core.conventions import check_option_index as check_option_index
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
REFUSED_WINDOW_S = 60.0
"""How long a dismissed or expired entry's client is answered ``refused`` (no new prompt)."""
MAX_REFUSED = MAX_PENDING
"""Refusals kept at once; a flood of distinct pairs forgets the oldest first."""
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
        self._model_keys: dict[str, str] = {}
        """Each registry id → the key of the model it names."""
        self._auto_loading: frozenset[str] = frozenset()
        """Model keys an unattended load is scheduled for (:meth:`set_auto_loading`)."""
        self._serving: dict[str, Resident] = {}
        self._forwards: dict[str, Decision] = {}
        """``_serving``'s answers, built once per index: a forward allocates nothing."""
        self._serving_all: dict[str, tuple[Resident, ...]] = {}
        """Every ``hot`` resident serving each id, device order (the context check)."""
        self._cap_cells: dict[tuple[str, str], int] = {}
        """``(model, config)`` of a resident → its measured ``per_session_cap_cells``."""
        self._warming: frozenset[str] = frozenset()
        """Ids that only a ``warming`` resident serves: they park ``warming``."""
        self._paused: frozenset[str] = frozenset()
        """Ids that only a ``paused`` resident serves: they park ``paused``."""
        self._refused: dict[tuple[str, str], tuple[str, float, ParkReason]] = {}
        """``(client, model)`` → (the dismissed, expired or failed entry's id, refused
        until, the reason answered); oldest first."""
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
        keys: dict[str, str] = {}
        for model in self._registry.models.values():
            for advertised in model.advertises:
                reasons.setdefault(advertised, _loadable(model.configs.values()))
                keys.setdefault(advertised, model.key)
            for config in model.configs.values():
                reasons.setdefault(config.key, _loadable((config,)))
                keys.setdefault(config.key, model.key)
        for model in self._registry.models.values():
            reasons[model.key] = _loadable(model.configs.values())
            keys[model.key] = model.key
        self._park_reasons = reasons
        self._model_keys = keys

    def set_auto_loading(self, models: frozenset[str]) -> None:
        """The model keys an unattended load is scheduled for: a new park of one of them
        answers ``auto_loading`` at once (the auto runner joins it to the run), not
        ``not_resident`` first (issue 21 item 8)."""
        self._auto_loading = models

    def _index_residents(self) -> None:
        serving: dict[str, Resident] = {}
        serving_all: dict[str, list[Resident]] = {}
        warming: set[str] = set()
        paused: set[str] = set()
        caps: dict[tuple[str, str], int] = {}
        for resident in sorted(self._residents, key=lambda r: r.device):
            ids = served_ids(self._registry, resident)
            if can_serve(resident):
                cap = _cap_cells(self._registry, resident)
                if cap is not None:
                    caps[(resident.model, resident.config)] = cap
                for model_id in ids:
                    serving.setdefault(model_id, resident)
                    serving_all.setdefault(model_id, []).append(resident)
            elif resident.state is ResidentState.WARMING:
                warming.update(ids)
            elif resident.state is ResidentState.PAUSED:
                paused.update(ids)
        self._serving = serving
        self._forwards = {m: _forward(r) for m, r in serving.items()}
        self._serving_all = {k: tuple(v) for k, v in serving_all.items()}
        self._cap_cells = caps
        self._warming = frozenset(warming - serving.keys())
        self._paused = frozenset(paused - serving.keys() - warming)
        self._refresh_state_reasons()

    def _state_reason(self, model: str) -> ParkReason | None:
        """``warming`` or ``paused`` while only such a resident serves ``model``."""
        if model in self._warming:
            return ParkReason.WARMING
        if model in self._paused:
            return ParkReason.PAUSED
        return None

    def _refresh_state_reasons(self) -> None:
        """Pending entries say ``warming`` (``paused``) exactly while only a warming
        (paused) resident serves their id (``not_resident`` again when it goes away)."""
        for entry in list(self._pending.values()):
            requested = entry.requested_model
            wanted = self._state_reason(requested)
            if entry.reason in _STATE_REASONS and entry.reason is not wanted:
                fallback = wanted or self._park_reasons.get(requested, ParkReason.UNKNOWN_MODEL)
                self._pending[entry.id] = replace(entry, reason=fallback)
            elif entry.reason is ParkReason.NOT_RESIDENT and wanted is not None:
                self._pending[entry.id] = replace(entry, reason=wanted)

    # ----------------------------------------------------------------- the decision

    def decide(
        self, model: str, client: str, session: str | None, cells: int | None, now: float
    ) -> tuple[Decision, PendingEntry | None]:
        """Forward or park one admit. The second item is the entry this call created."""
        if not model or not model.strip():
            return Decision("park", reason=ParkReason.INVALID_REQUEST.value), None
        forward = self._forwards.get(model)
        if forward is not None:
            if not (self._cap_cells and _stated(cells)):
                return forward, None
            fitting = self._fitting(model, cells or DEFAULT_CELLS)
            if fitting is not None:
                return _forward(fitting), None
        if self._too_long(model):
            return Decision("park", reason=ParkReason.INVALID_REQUEST.value), None
        client = client[:MAX_IDENTITY_CHARS]
        known = self._live_entry(client, model, now)
        if known is not None:
            if known.expired(now):  # the tick resolves it ``expired`` (and refuses then)
                return _refused(known.id), None
            if model in self._warming and known.reason is not ParkReason.WARMING:
                known = replace(known, reason=ParkReason.WARMING)
                self._pending[known.id] = known
            return _park(known), None
        refused = self._refusal(client, model, now)
        if refused is not None:
            return refused, None
        entry = PendingEntry(
            id=self._fresh_id(),
            requested_model=model,
            client=client,
            session=session[:MAX_IDENTITY_CHARS] if session is not None else None,
            created_at=now,
            expires_at=now + self._ttl,
            reason=self._new_park_reason(model),
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

    def _fitting(self, model: str, cells: int) -> Resident | None:
        """The first resident serving ``model`` whose context holds ``cells``."""
        for resident in self._serving_all.get(model, ()):
            cap = self._cap_cells.get((resident.model, resident.config))
            if cap is None or cells <= cap:
                return resident
        return None

    def take_evicted(self) -> list[PendingEntry]:
        """The entries the caps pushed out since the last call (the caller says ``expired``)."""
        gone, self._evicted = self._evicted, []
        return gone

    def _too_long(self, model: str) -> bool:
        return len(model) > MAX_MODEL_ID_CHARS and model not in self._park_reasons

    def _new_park_reason(self, model: str) -> ParkReason:
        reason = self._park_reason(model)
        if (
            reason in _AUTO_JOINABLE
            and self._auto_loading
            and self._model_keys.get(model) in self._auto_loading
        ):
            return ParkReason.AUTO_LOADING
        return reason

    def _park_reason(self, model: str) -> ParkReason:
        return self._state_reason(model) or self._park_reasons.get(model, ParkReason.UNKNOWN_MODEL)

    def _live_entry(self, client: str, model: str, now: float) -> PendingEntry | None:
        """The entry for ``(client, model)``, expired or not: an expired one stays until
        the controller's tick resolves it ``expired`` (and records the refusal)."""
        entry_id = self._by_key.get((client, model))
        return self._pending[entry_id] if entry_id is not None else None

    # ----------------------------------------------------------------- refusals

    def refuse(
        self, entry: PendingEntry, now: float, reason: ParkReason = ParkReason.REFUSED
    ) -> None:
        """``entry`` was dismissed or expired unanswered (``refused``), or resolved after a
        switch that failed (``failed``): its client's retries for the same id are answered
        ``reason`` with its id for ``REFUSED_WINDOW_S`` (no new entry)."""
        key = (entry.client, entry.requested_model)
        self._refused.pop(key, None)  # re-inserted last: the dict stays oldest first
        self._refused[key] = (entry.id, now + REFUSED_WINDOW_S, reason)
        while len(self._refused) > MAX_REFUSED:
            del self._refused[next(iter(self._refused))]

    def _refusal(self, client: str, model: str, now: float) -> Decision | None:
        found = self._refused.get((client, model))
        if found is None:
            return None
        placement_id, until, reason = found
        if until <= now:
            del self._refused[(client, model)]
            return None
        return Decision("park", placement_id=placement_id, reason=reason.value)

    def forget_refusals(self, now: float) -> None:
        """Drop the refusals whose window has passed (the controller's tick)."""
        self._refused = {k: v for k, v in self._refused.items() if v[1] > now}

    @property
    def refused_count(self) -> int:
        return len(self._refused)

    def mark_failed(self, placement_id: str) -> PendingEntry | None:
        """The switch approved for this entry failed or was refused: it stays pending,
        reason ``failed``; the entry now, or ``None`` when it is gone."""
        entry = self._pending.get(placement_id)
        if entry is None:
            return None
        failed = replace(entry, reason=ParkReason.FAILED)
        self._pending[placement_id] = failed
        return failed

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


_AUTO_JOINABLE = frozenset({ParkReason.NOT_RESIDENT, ParkReason.PAUSED})
"""Reasons a new park trades for ``auto_loading`` while its model's unattended load runs."""

_STATE_REASONS = frozenset({ParkReason.WARMING, ParkReason.PAUSED})
"""Park reasons that follow a resident's state, recomputed when the residents change."""

_REGISTRY_REASONS = frozenset(
    {ParkReason.UNKNOWN_MODEL, ParkReason.NO_MEASURED_CONFIG, ParkReason.NOT_RESIDENT}
)
"""Park reasons that only restate the registry, recomputed when it changes."""


def _stated(cells: int | None) -> bool:
    """The request said how much context it needs (not the contract's stand-in)."""
    return cells is not None and cells > 0 and cells != DEFAULT_CELLS


def _cap_cells(registry: Registry, resident: Resident) -> int | None:
    """The measured context one session of ``resident`` gets, if recorded."""
    model = registry.models.get(resident.model)
    config = model.configs.get(resident.config) if model is not None else None
    return config.per_session_cap_cells if config is not None else None


def _loadable(configs: Iterable[Config]) -> ParkReason:
    if any(c.is_measured for c in configs):
        return ParkReason.NOT_RESIDENT
    return ParkReason.NO_MEASURED_CONFIG


def _forward(resident: Resident) -> Decision:
    return Decision("forward", target_id=resident.target_id)


def _park(entry: PendingEntry) -> Decision:
    return Decision("park", placement_id=entry.id, reason=entry.reason.value)


def _refused(placement_id: str) -> Decision:
    return Decision("park", placement_id=placement_id, reason=ParkReason.REFUSED.value)


def _truncated(entry: PendingEntry) -> PendingEntry:
    session = entry.session[:MAX_IDENTITY_CHARS] if entry.session is not None else None
    return replace(entry, client=entry.client[:MAX_IDENTITY_CHARS], session=session)
