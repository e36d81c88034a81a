"""The two seams between the code that changes units and engines and the outside world.

Enforcement (:mod:`uapplace.enforce.enforcer` and its step modules), the start-up repair
(:mod:`uapplace.recovery.recover`) and the publication check (:mod:`uapplace.publish.verify`)
never call systemd or an engine's HTTP routes directly: they receive a
:class:`UnitControl` (the real one is :class:`uapplace.io.units.UnitManager`) and an
:class:`EngineProbe` (the real one is :class:`HttpEngines`, over
:mod:`uapplace.io.engines`). Wiring (:mod:`uapplace.daemon.wiring`) passes the real ones;
the unit tier passes in-memory fakes, so every success and rollback branch of
the docs/placement-rules.md §4.6 sequence runs in milliseconds without a user manager or engine.

One definition of each, here, so that enforcement and recovery cannot drift
apart in what they assume of a unit manager or an engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from uapplace.io import engines
from uapplace.io.units import JobOutcome, UnitState


class UnitControl(Protocol):
    """Everything enforcement and recovery use of :class:`~uapplace.io.units.UnitManager`."""

    async def state(self, name: str) -> UnitState:
        """The unit as systemd reports it now; raises ``UnitError`` when it cannot."""
        ...

    async def start_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        """Queue a start job and wait (at most ``timeout``) for how it ended."""
        ...

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        """Queue a stop job and wait (at most ``timeout``) for how it ended."""
        ...

    async def pids(self, name: str) -> list[int]:
        """Every process of the unit's cgroup; raises ``UnitError`` when it cannot."""
        ...

    def on_change(self, callback: Callable[[str, UnitState], None]) -> None:
        """Call ``callback(unit, state)`` on every state change the manager signals."""
        ...


class EngineProbe(Protocol):
    """An engine's HTTP routes as the publication check and the pause levers use them.

    ``health``, ``served_ids``, ``metrics`` and ``is_sleeping`` are what
    :func:`uapplace.publish.verify.check` reads; ``sleep`` and ``wake`` are vLLM's pause
    levers (issue 12). Failures raise :class:`~uapplace.io.engines.EngineError`.
    ``get_reply`` is one ``GET`` as answered, never raising: the drain asks an engine
    whether it is busy through it (:mod:`uapplace.io.busy`).
    """

    async def health(self, endpoint: str, timeout_s: float) -> bool: ...

    async def served_ids(self, endpoint: str, timeout_s: float) -> list[str]: ...

    async def metrics(self, endpoint: str, timeout_s: float) -> dict[str, float | str]: ...

    async def is_sleeping(self, endpoint: str, timeout_s: float) -> bool | None: ...

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None: ...

    async def wake(self, endpoint: str, timeout_s: float) -> None: ...

    async def get_reply(
        self, endpoint: str, route: str, timeout_s: float
    ) -> tuple[int | None, str]: ...


class HttpEngines:
    """:class:`EngineProbe` over :mod:`uapplace.io.engines` (real HTTP). Stateless."""

    async def health(self, endpoint: str, timeout_s: float) -> bool:
        return await engines.health(endpoint, timeout_s=timeout_s)

    async def served_ids(self, endpoint: str, timeout_s: float) -> list[str]:
        return await engines.served_ids(endpoint, timeout_s=timeout_s)

    async def metrics(self, endpoint: str, timeout_s: float) -> dict[str, float | str]:
        return await engines.metrics(endpoint, timeout_s=timeout_s)

    async def is_sleeping(self, endpoint: str, timeout_s: float) -> bool | None:
        return await engines.is_sleeping(endpoint, timeout_s)

    async def sleep(self, endpoint: str, level: int, timeout_s: float) -> None:
        await engines.sleep(endpoint, level, timeout_s)

    async def wake(self, endpoint: str, timeout_s: float) -> None:
        await engines.wake(endpoint, timeout_s)

    async def get_reply(
        self, endpoint: str, route: str, timeout_s: float
    ) -> tuple[int | None, str]:
        return await engines.get_reply(endpoint, route, timeout_s)


HTTP_ENGINES = HttpEngines()
"""The real engines; stateless, so one instance serves every caller."""
