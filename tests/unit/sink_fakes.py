"""A :class:`~uapplace.publish.publication.ResidentSink` over a plain list: what the
sleep watch and the serving re-check read residents from and publish them through."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from uapplace.core.alerts import AlertBoard
from uapplace.core.model import DeviceReading, Model, Registry, Resident
from uapplace.files.capacity import ServicePolicy


class ListSink:
    """Residents in ``list``, keyed by (model, config, device); no service policies and no
    device readings (a subclass that needs readings overrides :meth:`read_devices`)."""

    def __init__(self, reg: Registry, residents: Sequence[Resident]) -> None:
        self._registry = reg
        self.list = list(residents)
        self.alert_board = AlertBoard(lambda: 0.0)

    def registry(self) -> Registry:
        return self._registry

    def residents(self) -> list[Resident]:
        return self.list

    def put_resident(self, resident: Resident) -> None:
        key = (resident.model, resident.config, resident.device)
        self.list = [r for r in self.list if (r.model, r.config, r.device) != key] + [resident]

    def drop_resident(self, resident: Resident) -> None:
        self.list.remove(resident)

    def service_policy(self, model: Model) -> ServicePolicy | None:
        return None

    async def read_devices(self) -> Mapping[str, DeviceReading]:
        return {}
