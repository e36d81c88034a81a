"""The narrow view of the controller that enforcement needs, and its adapter."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from uapplace.alerts import AlertKind, AlertSink, Severity
from uapplace.capacity import ServicePolicy, refusing_policy
from uapplace.engines import ProxyTokenRejected
from uapplace.model import (
    DeviceReading,
    Holder,
    Model,
    PendingEntry,
    Registry,
    Resident,
)
from uapplace.planner import PlanInput

if TYPE_CHECKING:
    from uapplace.controller import Controller

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the host


class EnforcementHost(AlertSink, Protocol):
    """The narrow view of the controller that enforcement needs.

    :class:`ControllerHost` implements it over :class:`~uapplace.controller.Controller`;
    a test can implement it over plain lists.
    """

    def registry(self) -> Registry:
        """The registry in force now."""
        ...

    def residents(self) -> Sequence[Resident]:
        """The residents now, without holders."""
        ...

    def pending(self, placement_id: str) -> PendingEntry | None: ...

    async def plan_input(self) -> PlanInput:
        """Fresh readings and the residents with their holders (bus holds + in-flight)."""
        ...

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        """The proxy's in-flight requests per target id; ``None`` = unknown = busy."""
        ...

    def holds(self, resident: Resident) -> Sequence[Holder]:
        """The bus holds on this resident."""
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


class ProxyRefresher(Protocol):
    async def refresh(self) -> tuple[bool, str]: ...


class ControllerHost:
    """:class:`EnforcementHost` over the daemon's :class:`~uapplace.controller.Controller`."""

    def __init__(self, controller: Controller) -> None:
        self.controller = controller

    def registry(self) -> Registry:
        return self.controller.load.registry

    def residents(self) -> Sequence[Resident]:
        return tuple(self.controller.residents)

    def pending(self, placement_id: str) -> PendingEntry | None:
        return self.controller.admission.get(placement_id, time.time())

    async def plan_input(self) -> PlanInput:
        inp, _clients = await self.controller.plan_input()
        return inp

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        proxy = self.controller.proxy
        if proxy is None:
            return None
        try:
            return await proxy.inflight()
        except ProxyTokenRejected:
            raise  # not "unknown": the drain stops on it (_drain)
        except Exception as err:  # unknown counts as busy; never guess idle
            log.warning("proxy in-flight list unavailable: %s", err)
            return None

    def holds(self, resident: Resident) -> Sequence[Holder]:
        return [
            hold.holder()
            for hold in self.controller.holds.values()
            if hold.model in (resident.model, resident.config)
        ]

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return await asyncio.to_thread(self.controller.probe.read)

    def service_policy(self, model: Model) -> ServicePolicy | None:
        policy = self.controller.policy
        refusal = self.controller.policy_refusal()
        if refusal is not None:  # no good policy ever loaded: fail closed, never silently off
            return refusing_policy(refusal)
        if policy is None or model.service is None:
            return None
        return policy.services.get(model.service)

    def put_resident(self, resident: Resident) -> None:
        current = self.controller.resident(resident.model, resident.config, resident.device)
        if current is not None and _same_publication(current, resident):
            return
        self.controller.upsert_resident(resident)

    def drop_resident(self, resident: Resident) -> None:
        self.controller.drop_resident(resident.model, resident.config, resident.device)

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        entries = self.controller.admission.resolved_by(resident)
        for entry in entries:
            self.controller.resolve(entry, outcome)
        return [e.id for e in entries]

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        entry = self.controller.admission.get(placement_id)
        if entry is None:
            return False
        self.controller.resolve(entry, outcome)
        return True

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.controller.emit_step(run_id, step, ok, detail)

    def raise_alert(
        self,
        kind: AlertKind,
        severity: Severity,
        subject: str,
        message: str,
        detail: Mapping[str, Any] | None = None,
    ) -> None:
        self.controller.raise_alert(kind, severity, subject, message, detail)


def _same_publication(a: Resident, b: Resident) -> bool:
    """Equal for everything a ``ResidentChanged`` or the ledger would show."""
    return replace(a, since=b.since, holders=b.holders) == b
