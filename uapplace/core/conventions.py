"""What a bus caller and the daemon agree on without the model: timestamps, the context a
request needs when it names none, and 1-based option numbers.

Its own module so that the light ``uapplace`` (docs/architecture.md, "The command line:
light and local") imports these three rules without the fifteen dataclasses of
:mod:`uapplace.core.model` or the admission table (``ctypes`` included), which every
``uapplace apply`` paid for at start (docs/performance.md, "The light CLI on click").
:mod:`uapplace.core.model` and :mod:`uapplace.core.admission` re-export them.
"""

from __future__ import annotations

from datetime import UTC, datetime

from uapplace.core.errors import InvalidArgument

DEFAULT_CELLS = 32768
"""Context a request is assumed to need when it names none (docs/http-contract.md §1)."""


def iso(ts: float) -> str:
    """POSIX seconds → ``2026-10-08T14:02:00Z``."""
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(text: str) -> float:
    """ISO-8601 (``Z`` or offset) → POSIX seconds. Raises ``ValueError``."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def check_option_index(placement_id: str, option: int, count: int) -> None:
    """Raise :class:`~uapplace.core.errors.InvalidArgument` unless ``option`` is in
    ``1..count``, the options placement ``placement_id`` has (none when ``count`` is 0)."""
    if count == 0:
        raise InvalidArgument(
            f"placement {placement_id} has no options (see `uapplace pending`); "
            "nothing can be applied"
        )
    if not 1 <= option <= count:
        raise InvalidArgument(
            f"option {option} is out of range: placement {placement_id} has options 1..{count}"
        )
