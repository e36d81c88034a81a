"""Forward leases: when admission last answered ``forward`` for each target.

The proxy puts a request in its in-flight list only once it sends it, a moment after
``Admit`` answered ``forward``: a drain that asks the list in that moment sees nothing
and would let a swap overtake the request (issue 20; docs/placement-rules.md §4.6,
"Forward leases"). So each ``forward`` answer leaves a lease on its target, and the
drain counts the target busy until the lease has run out and the list has been asked
again. Recording is one dictionary write on ``admit``'s path (it never blocks); the
table holds one time per target id admission has forwarded to, which are the residents'.

Written by :meth:`uapplace.controller.controller.Controller.admit`; read by the drain
(:mod:`uapplace.enforce.steps`) through the enforcement host.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class ForwardLeases:
    """Target id → the monotonic time of the last ``forward`` answered for it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: dict[str, float] = {}

    def granted(self, target_id: str) -> None:
        """``Admit`` has just answered ``forward`` to ``target_id``."""
        self._last[target_id] = self._clock()

    def age(self, target_id: str) -> float | None:
        """Seconds since the last ``forward`` to ``target_id``; ``None``: none in this
        daemon's life."""
        last = self._last.get(target_id)
        return None if last is None else max(0.0, self._clock() - last)
