"""Standing consent, part two: the idle-resident unload sweep (docs/placement-rules.md §4.4.2).

The sweep only decides *when*; the stop is the operator's own
``Enforcer.unload`` (drain, in-flight refusal, verify-free, rollback). Each
:meth:`IdleSweep.tick` (the daemon's ``wiring`` runs :meth:`IdleSweep.run`, one tick
every ~20 s, once enforcement has started) re-reads the policy file, then for each
resident model:

- **off by default**: no ``unload_idle_after_secs`` → the tick does nothing at
  all; the window floors at 60 s;
- **consent per model**: a model not in ``unload_allow`` is never touched;
- only a model whose every resident is ``hot`` or ``paused`` and not held on the bus
  (``Hold``) is considered; a held one has its clock reset. A ``paused`` resident
  (weights offloaded, host RAM still held) goes with the same consent as a hot one
  (issue 21 item 6): ``unload_allow`` and the window, nothing more;
- **demand wins**: a non-expired pending entry for the model, or a cooldown
  after a failed run, skips it;
- **the clock** is ``usage[model]``, touched by the controller on every gated
  forward. A model with no record is *seeded* now; records of models with no
  resident are pruned; a successful unload clears the record. On top of that
  the sweep acts only on a window it watched itself: idle time counts from
  the later of the usage record and the moment this sweep first saw that
  resident (armed, consented to, loaded, or after a daemon restart), so arming
  never evicts the already-idle;
- **unknown means busy**: an ESTABLISHED TCP connection whose local port is
  the engine's port (its server side; a client past the gate) resets the clock
  and skips; when the connection table cannot be read, the model is skipped;
- a refused or failed unload (``ok`` false, or an exception) puts the model in
  a 10-minute cooldown (the ledger's ``cooldowns``, shared with auto-load);
- a tick that starts while another still runs is dropped (a drain can outlast
  the cadence).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

import psutil

from uapplace.consent.auto import COOLDOWN_S
from uapplace.controller.standing import Cooldowns, UsageClocks
from uapplace.core.errors import Drifted, NotFound
from uapplace.core.model import Holder, PendingEntry, Registry, Resident, ResidentState
from uapplace.files.autopolicy import AutoPolicy, PolicySource

log = logging.getLogger(__name__)

DEFAULT_SWEEP_INTERVAL_S = 20.0
_SWEEPABLE = frozenset({ResidentState.HOT, ResidentState.PAUSED})
"""States the sweep may unload from; ``warming`` and ``draining`` are mid-change."""
_DEFAULT_PORTS = {"http": 80, "https": 443}


class IdleHost(Protocol):
    """What the sweep needs of the controller (``Controller`` has all of it); each
    change it makes persists itself."""

    @property
    def usage(self) -> UsageClocks:
        """Model key → POSIX seconds of its last gated forward (in the ledger)."""
        ...

    @property
    def cooldowns(self) -> Cooldowns: ...

    def pending_entries(self) -> list[PendingEntry]: ...

    def residents_with_holders(
        self, inflight: Mapping[str, Sequence[Holder]] | None
    ) -> list[Resident]:
        """The residents now; with ``None`` their holders are the bus holds only."""
        ...


class Unloader(Protocol):
    """``uapplace.enforce.enforcer.Enforcer``: the operator's drained, verified unload."""

    async def unload(
        self, model: str, expected: Sequence[str], *, wait: bool = False
    ) -> Mapping[str, Any]: ...


ConnectionScan = Callable[[], Collection[int]]
"""Blocking: the local ports of every ESTABLISHED TCP socket. Raises when it cannot tell."""


def established_local_ports() -> Collection[int]:
    """The local port of every ESTABLISHED TCP connection on the host (IPv4 and IPv6).

    For a server the local port is its listening port, so "the engine's port is
    among them" means a client is connected to the engine right now. Raises
    ``psutil.Error`` (``AccessDenied`` …) or ``OSError`` when the table cannot be read.
    """
    return {
        conn.laddr.port
        for conn in psutil.net_connections(kind="tcp")
        if conn.status == psutil.CONN_ESTABLISHED and conn.laddr
    }


def endpoint_port(endpoint: str | None) -> int | None:
    """``http://127.0.0.1:8080/v1`` → 8080; ``None`` when there is no usable endpoint."""
    if not endpoint:
        return None
    try:
        parts = urlsplit(endpoint)
        return parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None


@dataclass
class TickReport:
    """What one tick did, for logs and tests."""

    ran: bool = True
    """False when the tick was dropped (another still running)."""
    window_s: int | None = None
    unloaded: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    """Model → why it was left alone this tick."""


class IdleSweep:
    """The §4.4.2 sweep. Build once; the controller calls :meth:`tick` (or runs :meth:`run`)."""

    def __init__(
        self,
        host: IdleHost,
        unloader: Unloader,
        policy: PolicySource,
        registry: Callable[[], Registry],
        *,
        scan: ConnectionScan = established_local_ports,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self.unloader = unloader
        self.policy = policy
        self._registry = registry
        self._scan = scan
        self._clock = clock
        self._first_seen: dict[tuple[str, str, str, str], float] = {}
        """(model, config, device, since) → when this sweep first watched that resident."""
        self._ticking = False
        self._closing = False

    def close(self) -> None:
        """Daemon shutdown: start no unload from now on (one in progress runs to its end)."""
        self._closing = True

    async def run(self, interval_s: float = DEFAULT_SWEEP_INTERVAL_S) -> None:
        """Tick forever; an error in one tick is logged and the next tick comes anyway."""
        while not self._closing:
            await asyncio.sleep(interval_s)
            try:
                await self.tick()
            except Exception:
                log.exception("idle sweep: the tick failed")

    async def tick(self, now: float | None = None) -> TickReport:
        """One pass over the residents. Dropped (``ran=False``) while another runs."""
        if self._ticking:
            log.info("idle sweep: the previous tick is still running; this one is dropped")
            return TickReport(ran=False)
        self._ticking = True
        try:
            policy = await self.policy.refresh()
            return await self._sweep(policy, self._clock() if now is None else now)
        finally:
            self._ticking = False

    # ------------------------------------------------------------------ the pass

    async def _sweep(self, policy: AutoPolicy, now: float) -> TickReport:
        report = TickReport(window_s=policy.idle_window_s)
        if policy.idle_window_s is None:
            return report
        by_model = self._residents_by_model()
        self._prune(by_model)
        for model in sorted(by_model):
            if self._closing:
                break
            if not policy.may_unload(model):
                continue
            why = await self._reason_to_keep(model, policy.idle_window_s, now)
            if why is not None:
                report.skipped[model] = why
                continue
            # The signature of what this tick judged idle: a different set by the time
            # the unload runs is Drifted, never stopped.
            judged = self._residents_by_model().get(model, [])
            outcome = await self._unload(model, sorted(r.signature for r in judged))
            if outcome is None:
                report.skipped[model] = "no longer resident when its unload ran"
            elif outcome:
                report.unloaded.append(model)
            else:
                report.failed.append(model)
        return report

    def _residents_by_model(self) -> dict[str, list[Resident]]:
        out: dict[str, list[Resident]] = {}
        for resident in self.host.residents_with_holders(None):
            out.setdefault(resident.model, []).append(resident)
        return out

    def _prune(self, by_model: Mapping[str, Sequence[Resident]]) -> None:
        live = {_identity(r) for residents in by_model.values() for r in residents}
        self._first_seen = {k: v for k, v in self._first_seen.items() if k in live}
        self.host.usage.keep_only(by_model)

    async def _reason_to_keep(self, model: str, window_s: int, now: float) -> str | None:
        """Why ``model`` stays loaded this tick, or ``None`` when it goes.

        Looks at the residents afresh: an unload earlier in this tick may have
        awaited for a while.
        """
        residents = self._residents_by_model().get(model, [])
        if not residents:
            return "no longer resident"
        watched = self._observe(model, residents, now)
        moving = [r for r in residents if r.state not in _SWEEPABLE]
        if moving:
            return f"{moving[0].signature} is {moving[0].state.value}"
        if any(h.kind == "hold" for r in residents for h in r.holders):
            self._touch(model, now)
            return "held on the bus"
        until = self.host.cooldowns.get(model)
        if until is not None and until > now:
            return "in cooldown after a failed unload or load"
        if self._demanded(model, now):
            return "a pending request wants it"
        idle_since = max(self.host.usage[model], watched)
        if now - idle_since < window_s:
            return f"used {now - idle_since:.0f} s ago (window {window_s} s)"
        return await self._connections(model, residents, now)

    def _demanded(self, model: str, now: float) -> bool:
        registry = self._registry()
        for entry in self.host.pending_entries():
            if entry.expired(now):
                continue
            resolved = registry.lookup(entry.requested_model)
            key = resolved[0].key if resolved is not None else entry.requested_model
            if key == model:
                return True
        return False

    def _observe(self, model: str, residents: Sequence[Resident], now: float) -> float:
        """Seed the usage clock and the watch start at first sight; when watching began."""
        if model not in self.host.usage:
            self._touch(model, now)
        return max(self._first_seen.setdefault(_identity(r), now) for r in residents)

    async def _connections(
        self, model: str, residents: Sequence[Resident], now: float
    ) -> str | None:
        ports = {endpoint_port(r.endpoint) for r in residents}
        known = {port for port in ports if port is not None}
        if len(known) != len(ports):
            return "no endpoint port to check for open connections (unknown counts as busy)"
        try:
            established = await asyncio.to_thread(self._scan)
        except Exception as err:  # psutil.AccessDenied, OSError …: never guess idle
            log.warning("idle sweep: cannot read the connection table (%s); %s stays", err, model)
            return f"connection table unreadable ({type(err).__name__}); unknown counts as busy"
        open_ports = sorted(known & set(established))
        if open_ports:
            self._touch(model, now)
            return f"ESTABLISHED connection on port {', '.join(map(str, open_ports))}"
        return None

    def _touch(self, model: str, now: float) -> None:
        self.host.usage.touch(model, now)

    async def _unload(self, model: str, signature: Sequence[str]) -> bool | None:
        """True: unloaded. False: refused or failed (cooldown). None: it was already gone."""
        log.warning("idle sweep: unloading %s (idle past its window, under unload_allow)", model)
        try:
            result = await self.unloader.unload(model, signature, wait=True)
            ok = result.get("ok") is True
            detail = result.get("error", "no detail")
        except (NotFound, Drifted) as err:
            # Stopped (or changed) by someone else (an operator, an auto-load's
            # displacement) while this unload waited its turn: nothing failed, so no
            # cooldown; the next tick judges what is resident then.
            log.info("idle sweep: %s", err)
            return None
        except Exception as err:
            ok, detail = False, f"{type(err).__name__}: {err}"
        if ok:
            self.host.usage.forget(model)
            return True
        until = self._clock() + COOLDOWN_S
        self.host.cooldowns.start(model, until)
        log.warning(
            "idle sweep: unloading %s failed (%s); leaving it alone for %g s",
            model,
            detail,
            COOLDOWN_S,
        )
        return False


def _identity(resident: Resident) -> tuple[str, str, str, str]:
    return (resident.model, resident.config, resident.device, resident.since)
