"""One registry per run (issue 20: "a reload never swaps what a running switch reads").

A run reads the registry from its revalidation to its last step: the drain bound and the
stop bound (each victim's envelope), the device and host it verifies free, the endpoint
it verifies up, what it resolves. A reload (``Validate``, SIGHUP, a ``measure``, a unit
re-gated by the stale-measurement rule) swaps the controller's registry at any await, so
a run that asked the host each time could wait by one registry's bounds and verify by
another's. :class:`RegistrySnapshot` is the run's host with the registry taken once, when
the run starts (``Enforcer._enforce`` puts it in the run's context); everything else is
the live host's. The reload itself is not held back: the next run reads the new registry.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

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
from uapplace.enforce.host import EnforcementHost
from uapplace.files.capacity import ServicePolicy


class RegistrySnapshot:
    """:class:`~uapplace.enforce.host.EnforcementHost` over ``host`` whose registry is the
    one ``host`` had when this was made."""

    def __init__(self, host: EnforcementHost) -> None:
        self.live = host
        self._registry = host.registry()
        self.alert_board: AlertBoard = host.alert_board

    def registry(self) -> Registry:
        return self._registry

    def residents(self) -> Sequence[Resident]:
        return self.live.residents()

    async def plan_for(self, model: str, cells: int) -> Plan:
        return await self.live.plan_for(model, cells)

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        return await self.live.inflight()

    def holds(self, resident: Resident) -> Sequence[Holder]:
        return self.live.holds(resident)

    def forward_age(self, target_id: str) -> float | None:
        return self.live.forward_age(target_id)

    def pending_entry(self, placement_id: str) -> PendingEntry | None:
        return self.live.pending_entry(placement_id)

    def durable_resolutions(self) -> contextlib.AbstractAsyncContextManager[None]:
        return self.live.durable_resolutions()

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return await self.live.read_devices()

    def service_policy(self, model: Model) -> ServicePolicy | None:
        return self.live.service_policy(model)

    def put_resident(self, resident: Resident) -> None:
        self.live.put_resident(resident)

    def drop_resident(self, resident: Resident) -> None:
        self.live.drop_resident(resident)

    def resolve_served(self, resident: Resident, outcome: str) -> list[str]:
        return self.live.resolve_served(resident, outcome)

    def resolve_entry(self, placement_id: str, outcome: str) -> bool:
        return self.live.resolve_entry(placement_id, outcome)

    def emit_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.live.emit_step(run_id, step, ok, detail)

    def run_finished(self, run_id: str, verb: str, outcome: str) -> None:
        self.live.run_finished(run_id, verb, outcome)
