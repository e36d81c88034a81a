"""The narrow view of the controller that enforcement needs, and its adapter.

:class:`EnforcementHost` is everything the enforcement modules (:mod:`uapplace.enforce.enforcer`
and its steps) read or change of the controller; :class:`ProxyRefresher` the proxy's
one call. Enforcement receives both (with the :mod:`uapplace.io.seams` for units and
engines), so the unit tier runs it over plain lists. :class:`ControllerHost` is the
daemon's implementation over :class:`~uapplace.controller.controller.Controller`
    .
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol

from uapplace.core.alerts import AlertBoard
from uapplace.core.model import (
    DeviceReading,
    Holder,
    Model,
    PendingEntry,
    Plan,
    Registry,
    Resident,
)
from uapplace.files.capacity import ServicePolicy

if TYPE_CHECKING:
    from uapplace.controller.controller import Controller

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the host


class EnforcementHost(Protocol):
    """The narrow view of the controller that enforcement needs.

    :class:`ControllerHost` implements it over :class:`~uapplace.controller.controller.Controller`;
    a test can implement it over plain lists.
    """

    alert_board: AlertBoard
    """Where this path reports what a human must see."""

    def registry(self) -> Registry:
        """The registry in force now."""
        ...

    def residents(self) -> Sequence[Resident]:
        """The residents now, without holders."""
        ...

    async def plan_for(self, model: str, cells: int) -> Plan:
        """The planner's options for ``model`` now: fresh readings, the residents with
        their holders (bus holds + in-flight); the revalidate step's one call."""
        ...

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """The proxy's in-flight requests per target id; ``None`` = unknown = busy."""
        ...

    def holds(self, resident: Resident) -> Sequence[Holder]:
        """The bus holds on this resident."""
        ...

    def forward_age(self, target_id: str) -> float | None:
        """Seconds since admission last answered ``forward`` to ``target_id`` (``None``:
        never): the drain's forward lease (docs/placement-rules.md §4.6, "Forward leases")."""
        ...

    def pending_entry(self, placement_id: str) -> PendingEntry | None:
        """The pending entry, unless it expired or was resolved (dismissed …)."""
        ...

    def durable_resolutions(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Entries resolved inside are announced (``Resolved``) once the ledger without
        them is on disk (one ``Resolved`` per placement, even across a crash)."""
        ...

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        """A fresh probe of every device (runs the blocking probe in a thread)."""
        ...

    def service_policy(self, model: Model) -> ServicePolicy | None:
        """The capacity policy's service entry for ``model`` (its ``service`` name)."""
        ...

    def put_resident(self, resident: Resident) -> None:
        """Add or replace (same model/config/device); emits ``ResidentChanged``."""
        ...

    def drop_resident(self, resident: Resident) -> None:
        """Remove it if present; emits ``ResidentChanged(…, "gone")``."""
        ...

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        """Resolve every pending entry ``resident`` serves with ``outcome``; their ids."""
        ...

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        """Resolve one pending entry (if still there) with ``outcome``."""
        ...

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        """One ``EnforcementStep`` signal."""
        ...

    def run_finished(self, run_id: str, verb: str, outcome: str) -> None:
        """Count a run that ended (``GetState.counters``: every run, whoever started it)."""
        ...


class ProxyRefresher(Protocol):
    """The proxy's cache of upstreams, invalidated by the ``refresh-proxy`` step after a
    swap (:class:`~uapplace.io.engines.ProxyClient`; absent when no proxy is configured)."""

    async def refresh(self) -> tuple[bool, str]:
        """``(ok, detail)``; a failure is a failed step, never a failed run."""
        ...


class ControllerHost:
    """:class:`EnforcementHost` over the daemon's
    :class:`~uapplace.controller.controller.Controller`.

    Only forwards to the controller's API: every change (residents, pending entries)
    is the controller's own method, which signals and persists it.
    """

    def __init__(self, controller: Controller) -> None:
        self.controller = controller
        self.alert_board = controller.alert_board
        """The controller's board: it records, signals, notifies and persists."""
        self.emit_step = controller.emit_step
        self.run_finished = controller.counters.run_finished
        self.read_devices = controller.read_devices
        self.plan_for = controller.plan_for
        self.service_policy = controller.service_policy
        self.resolve_served = controller.resolve_served
        self.resolve_entry = controller.resolve_pending_id
        self.forward_age = controller.forward_age
        self.durable_resolutions = controller.durable_resolutions
        self.pending_entry = controller.live_pending_entry

    def registry(self) -> Registry:
        return self.controller.registry

    def residents(self) -> Sequence[Resident]:
        return tuple(self.controller.residents)

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """Unknown counts as busy; a 401 is not "unknown": the drain stops on it."""
        return await self.controller.inflight(raise_token_rejected=True)

    def holds(self, resident: Resident) -> Sequence[Holder]:
        return self.controller.holders_for(resident)

    def put_resident(self, resident: Resident) -> None:
        current = self.controller.resident(resident.model, resident.config, resident.device)
        if current is not None and _same_publication(current, resident):
            return
        self.controller.upsert_resident(resident)

    def drop_resident(self, resident: Resident) -> None:
        self.controller.drop_resident(resident.model, resident.config, resident.device)


class ControllerRecoveryHost(ControllerHost):
    """:class:`~uapplace.recovery.checks.RecoveryHost` over the controller: the enforcement
    host plus the re-plan of every pending entry a repair ends with."""

    def __init__(self, controller: Controller) -> None:
        super().__init__(controller)
        self.replan_pending = controller.planning.replan_pending


def _same_publication(a: Resident, b: Resident) -> bool:
    """Equal for everything a ``ResidentChanged`` or the ledger would show."""
    return replace(a, since=b.since, holders=b.holders) == b
