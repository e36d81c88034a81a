"""What the systemd and engines tiers share about their contained ``systemd --user``
(docs/architecture.md, "Contained user manager").

Each tier's conftest starts its own session-wide ``user_manager`` and re-exports
:func:`units`; :func:`log_tail` is what a failed test's report shows of the manager.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from uapplace.io.units import UnitManager
from uapplace.sim.usermanager import ContainedUserManager

LOG_TAIL = 4000
"""How much of the manager's log a failure report shows, in characters."""


@pytest.fixture
async def units(user_manager: ContainedUserManager) -> AsyncIterator[UnitManager]:
    """A :class:`UnitManager` connected to the tier's ``user_manager``'s bus."""
    manager = UnitManager(user_manager.bus_address)
    await manager.connect()
    yield manager
    manager.close()


def log_tail(manager: ContainedUserManager) -> str:
    """The end of the manager's log (its units' output included), or ``(no log)``."""
    try:
        return manager.log_path.read_text(encoding="utf-8", errors="replace")[-LOG_TAIL:]
    except (OSError, RuntimeError):
        return "(no log)"
