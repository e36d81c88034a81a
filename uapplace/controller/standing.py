"""The standing-consent state the ledger keeps: usage clocks and cooldowns.

Both belong to the controller (``Controller.usage``, ``Controller.cooldowns``). They
read like a mapping (model → POSIX seconds) and change only through their methods, each
of which tells the controller's ledger writer (``on_change(urgent)``) itself, so neither
the auto runner nor the idle sweep can forget to.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping

OnChange = Callable[[bool], None]
"""``Controller.mark_dirty``: ``True`` = write soon, ``False`` = within the usage flush."""


class UsageClocks(Mapping[str, float]):
    """Model key → POSIX seconds of its last gated forward (or idle-sweep touch)."""

    def __init__(self, on_change: OnChange) -> None:
        self._at: dict[str, float] = {}
        self._on_change = on_change

    def __getitem__(self, model: str) -> float:
        return self._at[model]

    def __iter__(self) -> Iterator[str]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)

    def restore(self, clocks: Mapping[str, float]) -> None:
        """From the ledger at start (nothing to write back)."""
        self._at = dict(clocks)

    def touch(self, model: str, now: float) -> None:
        """A gated forward, a connection, a hold, first sight: the idle clock restarts."""
        self._at[model] = now
        self._on_change(False)

    def forget(self, model: str) -> None:
        """``model`` was unloaded: its idle clock goes with it."""
        self._at.pop(model, None)
        self._on_change(True)

    def keep_only(self, models: Collection[str]) -> None:
        """Drop the clocks of models not in ``models`` (no longer resident)."""
        stale = [m for m in self._at if m not in models]
        for model in stale:
            del self._at[model]
        if stale:
            self._on_change(False)


class Cooldowns(Mapping[str, float]):
    """Model → POSIX seconds until which automation leaves it alone after a failed run."""

    def __init__(self, on_change: OnChange) -> None:
        self._until: dict[str, float] = {}
        self._on_change = on_change

    def __getitem__(self, model: str) -> float:
        return self._until[model]

    def __iter__(self) -> Iterator[str]:
        return iter(self._until)

    def __len__(self) -> int:
        return len(self._until)

    def restore(self, until: Mapping[str, float], now: float) -> None:
        """From the ledger at start; lapsed ones are dropped."""
        self._until = {m: t for m, t in until.items() if t > now}

    def start(self, model: str, until: float) -> None:
        self._until[model] = until
        self._on_change(True)

    def end(self, model: str) -> bool:
        """End ``model``'s cooldown; whether it had one."""
        had = self._until.pop(model, None) is not None
        self._on_change(True)
        return had

    def lapse(self, now: float) -> list[str]:
        """Drop the cooldowns that ended by ``now``; their models."""
        lapsed = [m for m, until in self._until.items() if until <= now]
        for model in lapsed:
            del self._until[model]
        if lapsed:
            self._on_change(True)
        return lapsed
