"""Polls at the shell's pace without hammering a loading engine (issue 23).

verify-up, verify-free and drain poll with :func:`uapplace.publish.verify.backoff`: every
``first`` at first, then a tenth of the time waited so far, up to a cap. So a readiness
that comes after ``t`` is seen by ``t + max(first, t / 10)`` (never later than the cap),
and an engine that loads for seconds is asked at the cap's pace. The defaults keep
verify-up's and verify-free's pauses between 10 and 50 ms.
"""

from __future__ import annotations

from itertools import islice, pairwise

import pytest

from uapplace.files.timeouts import Timeouts
from uapplace.publish.verify import POLL_LAG_FRACTION, backoff


class SleepingClock:
    """A monotonic clock that moves only by the pauses the poll takes."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def polls_until(first: float, cap: float, seconds: float) -> list[float]:
    """The times (since the start) at which a poll paced by :func:`backoff` looks, up to
    ``seconds``: the first look at once, then one after each pause."""
    clock = SleepingClock()
    pauses = backoff(first, cap, clock)
    looks = [0.0]
    while True:
        clock.now += next(pauses)
        if clock.now - 100.0 > seconds:
            return looks
        looks.append(clock.now - 100.0)


def test_pauses_are_a_tenth_of_the_wait_between_the_first_and_the_cap() -> None:
    clock = SleepingClock()
    pauses = backoff(0.01, 0.05, clock)
    assert next(pauses) == 0.01  # nothing waited yet: the first pause
    clock.now += 0.08
    assert next(pauses) == 0.01  # 8 ms is under the first pause
    clock.now += 0.22
    assert next(pauses) == pytest.approx(0.03 * POLL_LAG_FRACTION / 0.1)
    clock.now += 10
    assert next(pauses) == 0.05  # a long load: the cap


def test_a_first_pause_above_the_cap_stays_as_it_is() -> None:
    assert list(islice(backoff(0.2, 0.05, SleepingClock()), 3)) == [0.2, 0.2, 0.2]


@pytest.mark.parametrize("ready_at", [0.0, 0.005, 0.03, 0.047, 0.06, 0.12, 0.4, 0.9, 3.0, 40.0])
def test_a_readiness_is_seen_at_most_a_tenth_or_the_first_pause_late(ready_at: float) -> None:
    looks = polls_until(0.01, 0.05, ready_at + 1.0)
    seen = min(at for at in looks if at >= ready_at)
    assert seen - ready_at <= max(0.01, ready_at * POLL_LAG_FRACTION, 0) + 1e-9
    assert seen - ready_at <= 0.05 + 1e-9


def test_the_default_polls_start_soon_and_never_wait_past_50_ms() -> None:
    timeouts = Timeouts()
    clock = SleepingClock()
    pauses = list(
        islice(backoff(timeouts.health_first_poll_s, timeouts.health_max_poll_s, clock), 1)
    )
    assert pauses == [0.01]
    looks = polls_until(timeouts.health_first_poll_s, timeouts.health_max_poll_s, 60.0)
    gaps = [b - a for a, b in pairwise(looks)]
    assert max(gaps) == pytest.approx(0.05) == timeouts.verify_free_poll_s
    assert min(gaps) == pytest.approx(0.01)
    # Gentle on an engine still loading: a long load is asked 20 times a second, and the
    # quick first polls cost a few dozen local GETs at most.
    in_first_second = sum(1 for at in looks if at <= 1.0)
    assert in_first_second <= 40
    in_last_ten_seconds = sum(1 for at in looks if at > 50.0)
    assert in_last_ten_seconds == pytest.approx(200, abs=2)
