"""Polls at the shell's pace without hammering a loading engine (issue 23).

verify-up, verify-free and drain poll with :func:`uapplace.publish.verify.backoff`: a
short first pause, then ×1.5 up to a cap. The defaults keep verify-up's and verify-free's
pauses between 10 and 50 ms.
"""

from __future__ import annotations

from itertools import accumulate, islice, pairwise

import pytest

from uapplace.files.timeouts import Timeouts
from uapplace.publish.verify import HEALTH_BACKOFF, backoff


def test_pauses_grow_from_the_first_to_the_cap_and_stay_there() -> None:
    pauses = list(islice(backoff(0.01, 0.05), 8))
    assert pauses[:4] == pytest.approx([0.01, 0.015, 0.0225, 0.03375])
    assert pauses[4:] == [0.05] * 4
    for before, after in pairwise(pauses):
        assert after == pytest.approx(min(before * HEALTH_BACKOFF, 0.05))


def test_a_first_pause_above_the_cap_stays_as_it_is() -> None:
    assert list(islice(backoff(0.2, 0.05), 3)) == [0.2, 0.2, 0.2]


def test_the_default_polls_start_soon_and_never_wait_past_50_ms() -> None:
    timeouts = Timeouts()
    pauses = list(islice(backoff(timeouts.health_first_poll_s, timeouts.health_max_poll_s), 40))
    assert pauses[0] == 0.01
    assert max(pauses) == 0.05 == timeouts.verify_free_poll_s
    polls_in_first_second = sum(1 for at in accumulate(pauses) if at <= 1.0)
    assert 15 <= polls_in_first_second <= 24  # gentle on an engine still loading
