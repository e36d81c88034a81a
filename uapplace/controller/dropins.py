"""``WriteUnits`` / ``CheckUnits``: the ``Conflicts=`` drop-ins the registry implies.

:class:`UnitDropins` is the controller's :class:`~uapplace.controller.ports.UnitWriter`, built by
``wiring.build`` (and by tests) from the unit directory, a registry source and a way
to reload the user manager (which answers ``False`` while there is none).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from uapplace.core.conflicts import conflict_edges, dropin_groups
from uapplace.core.errors import Failed
from uapplace.core.model import Registry
from uapplace.io.units import UnitError, has_conflict_dropins, write_conflict_dropins

log = logging.getLogger(__name__)

ManagerReload = Callable[[], Awaitable[bool]]
"""Reload the systemd user manager; ``False`` when there is none to reload."""


FOLLOW_MARKER = ".uapplace-conflicts"
"""In the unit directory: ``uapplace units`` ran here, so every reload rewrites the graph."""
MARKER_TEXT = (
    "uapplace: `uapplace units` wrote Conflicts= drop-ins here; every registry reload "
    "rewrites them (remove this file and the drop-ins to stop)\n"
)


async def no_manager_to_reload() -> bool:
    """The :data:`ManagerReload` where no user manager runs."""
    return False


class UnitDropins:
    """``WriteUnits``: ``Conflicts=`` drop-ins for the units that can never be resident together.

    The edges are :func:`uapplace.core.conflicts.conflict_edges`: computed in MiB with the
    planner's own fit test, so systemd never stops a model the planner would have kept
    alongside (docs/invariants.md, invariant 1: nothing stops without a yes). ``reload``
    asks the user manager to ``Reload``; when there is none (it answers ``False``) the
    files are still written and the log says to run ``systemctl --user daemon-reload``.

    Once written, the graph follows the registry: every controller reload (SIGHUP,
    ``validate``, a finished ``measure``) calls :meth:`refresh`, which rewrites the
    drop-ins only where ``uapplace units`` ran before (a machine whose operator never
    asked for drop-ins gets none). That it ran is the hidden file :data:`FOLLOW_MARKER`
    in the unit directory (systemd ignores hidden files), written by every
    :meth:`write_units`: a reload that removed the last edge removes every drop-in, and
    the next model that needs an edge must still get one (issue 21 item 5; before, the
    presence of a drop-in was the only sign, so the graph stopped following). A unit
    directory with drop-ins of ours but no marker (written before the marker existed)
    follows too. :meth:`check_units` reports, without writing, which files differ from
    the graph the registry gives now (``uapplace units --check``).
    """

    def __init__(
        self,
        unit_dir: Path,
        registry: Callable[[], Registry],
        reload: ManagerReload,
    ) -> None:
        self.unit_dir = unit_dir
        self._registry = registry
        self._reload = reload

    @property
    def marker(self) -> Path:
        return self.unit_dir / FOLLOW_MARKER

    async def write_units(self) -> list[str]:
        changed = await self._write(dry_run=False)
        await asyncio.to_thread(self._mark_following)
        if changed and not await self._reload():
            log.warning("drop-ins written; run `systemctl --user daemon-reload` to apply them")
        return [str(path) for path in changed]

    async def check_units(self) -> list[str]:
        """The drop-in files that are stale (would be written or removed); nothing is touched."""
        return [str(path) for path in await self._write(dry_run=True)]

    async def refresh(self) -> list[str]:
        """Rewrite the drop-ins after a registry or measurement change, where ``uapplace
        units`` ran (:data:`FOLLOW_MARKER`, or drop-ins of ours already there)."""
        if not await asyncio.to_thread(self._following):
            return []
        try:
            written = await self.write_units()
        except (Failed, UnitError) as err:
            log.error("the Conflicts= drop-ins are stale (`uapplace units` rewrites them): %s", err)
            return []
        if written:
            log.info("Conflicts= drop-ins regenerated: %s", ", ".join(written))
        return written

    def _following(self) -> bool:
        return self.marker.is_file() or has_conflict_dropins(self.unit_dir)

    def _mark_following(self) -> None:
        if self.marker.is_file():
            return
        try:
            self.unit_dir.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(MARKER_TEXT, encoding="utf-8")
        except OSError as err:  # the drop-ins are written; only the following is at stake
            log.warning(
                "cannot write %s (drop-ins follow reloads only while some exist): %s",
                self.marker,
                err,
            )

    async def _write(self, *, dry_run: bool) -> list[Path]:
        groups = conflict_unit_groups(self._registry())
        try:
            return await asyncio.to_thread(
                write_conflict_dropins, self.unit_dir, groups, dry_run=dry_run
            )
        except (ValueError, OSError) as err:
            raise Failed(f"cannot write the Conflicts= drop-ins: {err}") from None


def conflict_unit_groups(registry: Registry) -> dict[str, list[str]]:
    """Every ``Conflicts=`` edge of the registry as a two-unit group (``"a + b" → [a, b]``)."""
    return dropin_groups(conflict_edges(registry))
