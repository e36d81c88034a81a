"""A run's view of a unit never goes back to a stale read (issue 19, found on the real engine).

llama-server with a corrupt GGUF exits 1 about 20 ms after systemd starts it. The user
manager's signal that the unit ``failed`` can then be handled while a state read is in
flight; the read (several calls, answered before the exit) says ``active/running``. If
that read overwrote the signalled state, verify-up waited out its whole bound on a unit
that was long dead (seen: "not healthy after 10s (unit active/running)" for a unit that
was ``failed``). :meth:`UnitFollower.fresh` keeps what the signal said.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from uapplace.enforce.run import UnitFollower
from uapplace.files.timeouts import Timeouts
from uapplace.io.seams import HTTP_ENGINES
from uapplace.io.units import JobOutcome, UnitState
from uapplace.publish import verify

UNIT = "beta.service"
RUNNING = UnitState("active", "running", "loaded", 4242, "/usr/bin/llama-server -m x.gguf")
FAILED = UnitState(
    "failed", "failed", "", 0, "", result="exit-code", exec_main_code=1, exec_main_status=1
)


@dataclass
class UnitFailsMidRead:
    """A manager whose unit fails while a read is in flight: the signal is handled
    first, the read then answers what it saw before the exit."""

    reads: int = 0
    fail_on_read: int = 1
    _listeners: list[Callable[[str, UnitState], None]] = field(default_factory=list)

    async def state(self, name: str) -> UnitState:
        self.reads += 1
        await asyncio.sleep(0)
        if self.reads == self.fail_on_read:
            for listener in self._listeners:
                listener(name, FAILED)
        await asyncio.sleep(0)
        return RUNNING if self.reads <= self.fail_on_read else FAILED

    async def start_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        return JobOutcome(name, "done")

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        return JobOutcome(name, "done")

    async def pids(self, name: str) -> list[int]:
        return []

    def on_change(self, callback: Callable[[str, UnitState], None]) -> None:
        self._listeners.append(callback)


async def test_a_change_signalled_during_a_read_wins_over_the_read() -> None:
    units = UnitFailsMidRead()
    follower = UnitFollower(units, Timeouts(), HTTP_ENGINES)

    state = await follower.fresh(UNIT)

    assert state is not None
    assert (state.active_state, state.result, state.exec_main_status) == ("failed", "exit-code", 1)
    assert state.exec_start == RUNNING.exec_start, "what only a read gives is the read's"
    assert follower.cached(UNIT) == state


async def test_a_read_with_no_change_in_flight_is_taken_as_read() -> None:
    units = UnitFailsMidRead(fail_on_read=0)
    follower = UnitFollower(units, Timeouts(), HTTP_ENGINES)

    assert await follower.fresh(UNIT) == FAILED  # read 1 > fail_on_read 0: the read says failed
    assert follower.cached(UNIT) == FAILED


async def test_verify_up_ends_at_once_for_a_unit_that_failed_during_its_first_read() -> None:
    follower = UnitFollower(UnitFailsMidRead(), Timeouts(), HTTP_ENGINES)
    nothing_listens = "http://127.0.0.1:9"

    async with asyncio.timeout(5):
        why = await verify.wait_up(UNIT, nothing_listens, 30.0, follower.up_watch(UNIT))

    assert why == f"{UNIT} went failed/failed (result exit-code) while loading"
