"""Who is using a resident right now: bus holds (``Hold``/``Release``) and the proxy's
in-flight requests, both as :class:`~uapplace.core.model.Holder` lists.

:class:`HoldTable` is the controller's (its one owner); the enforcer and the planner see
holds only through ``Controller.holders_for``. :class:`ProxyHolders` is the daemon's
:class:`~uapplace.controller.ports.InflightSource`, built by ``wiring.build``.

Holds are bounded (docs/bus-api.md, "Bounds"): at most :data:`MAX_HOLDS` in all and
:data:`MAX_HOLDS_PER_CLIENT` per bus connection and per app id, so no caller can grow the
daemon's memory, every ``GetState`` and the ledger without end (issue 20: 300 holds took
the daemon to 2.48 GB). The reason and app id are capped by the bus edge
(``MAX_REASON_CHARS``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from uapplace.core.errors import Busy, NotAuthorized, NotFound
from uapplace.core.model import Holder, Resident, iso
from uapplace.io.engines import ProxyClient

log = logging.getLogger(__name__)

MAX_COOKIE = 0xFFFFFFFF
MAX_HOLDS = 256
"""Bus holds in all: far more pins than any machine has models."""
MAX_HOLDS_PER_CLIENT = 32
"""Bus holds per bus connection and per app id (a client pins what it uses, a few models)."""


@dataclass(frozen=True)
class BusHold:
    """A ``Hold`` on the bus: lives until ``Release`` or until ``sender`` disconnects."""

    cookie: int
    model: str
    reason: str
    app_id: str
    sender: str
    since: float

    def holder(self) -> Holder:
        return Holder(
            client=self.app_id or self.sender,
            kind="hold",
            detail=self.reason,
            started_at=iso(self.since),
            cookie=self.cookie,
        )

    def holds(self, resident: Resident) -> bool:
        """The one hold matching: a hold names a model key or a config key."""
        return self.model in (resident.model, resident.config)

    def to_json(self) -> dict[str, Any]:
        return {
            "cookie": self.cookie,
            "model": self.model,
            "reason": self.reason,
            "app_id": self.app_id,
            "sender": self.sender,
            "since": iso(self.since),
        }


class HoldTable(Mapping[int, BusHold]):
    """The bus holds by cookie (read like a mapping, changed only by its methods);
    cookies count up and wrap within 32 bits."""

    def __init__(self) -> None:
        self._holds: dict[int, BusHold] = {}
        self._next_cookie = 1

    def __getitem__(self, cookie: int) -> BusHold:
        return self._holds[cookie]

    def __iter__(self) -> Iterator[int]:
        return iter(self._holds)

    def __len__(self) -> int:
        return len(self._holds)

    def take(self, model: str, reason: str, app_id: str, sender: str, since: float) -> BusHold:
        """A new hold; ``Busy`` naming the cap when it would exceed one (nothing taken)."""
        self._check_room(app_id, sender)
        cookie = self._next_cookie
        self._next_cookie = cookie % MAX_COOKIE + 1
        held = BusHold(cookie, model, reason, app_id, sender, since)
        self._holds[cookie] = held
        return held

    def _check_room(self, app_id: str, sender: str) -> None:
        if len(self._holds) >= MAX_HOLDS:
            raise Busy(
                f"Hold: {len(self._holds):,} holds are taken, the {MAX_HOLDS:,} uapplaced keeps "
                "at most; release one first (holds are listed in GetState)"
            )
        by_sender = sum(1 for h in self._holds.values() if h.sender == sender)
        if sender and by_sender >= MAX_HOLDS_PER_CLIENT:
            raise Busy(
                f"Hold: bus connection {sender} has {by_sender:,} holds, the "
                f"{MAX_HOLDS_PER_CLIENT:,} one connection may take; release one first"
            )
        by_app = sum(1 for h in self._holds.values() if h.app_id == app_id)
        if app_id and by_app >= MAX_HOLDS_PER_CLIENT:
            raise Busy(
                f"Hold: app_id {app_id[:64]!r} has {by_app:,} holds, the "
                f"{MAX_HOLDS_PER_CLIENT:,} one app id may take; release one first"
            )

    def existing(self, cookie: int) -> BusHold:
        """The hold ``cookie`` (``NotFound`` when there is none)."""
        held = self._holds.get(cookie)
        if held is None:
            raise NotFound(
                f"no hold with cookie {cookie} (it was released, or its holder's bus "
                "connection closed)"
            )
        return held

    def release(self, cookie: int, sender: str, *, may_release_others: bool) -> BusHold:
        """End hold ``cookie``. Only the connection that took it may, unless the caller
        was authorized for ``org.uap.placement.release-others``."""
        held = self.existing(cookie)
        if held.sender != sender and not may_release_others:
            raise NotAuthorized(
                f"hold {cookie} on {held.model} belongs to bus connection {held.sender}"
                + (f" ({held.app_id})" if held.app_id else "")
                + "; only that connection may release it (or a caller polkit authorizes for "
                "org.uap.placement.release-others); it also ends when that connection closes"
            )
        return self._holds.pop(cookie)

    def drop_sender(self, sender: str) -> list[BusHold]:
        """End every hold ``sender`` took; the ones ended."""
        gone = [c for c, h in self._holds.items() if h.sender == sender]
        return [self._holds.pop(cookie) for cookie in gone]

    def holders_for(self, resident: Resident) -> list[Holder]:
        """The bus holds on ``resident``, as holders."""
        return [h.holder() for h in self._holds.values() if h.holds(resident)]


class ProxyHolders:
    """The proxy's ``/internal/placement/inflight`` as :class:`Holder` lists (kind ``inflight``).

    A 401 raises :class:`~uapplace.io.engines.ProxyTokenRejected`; ``Controller.inflight``
    raises the ``token_mismatch`` alert for it.
    """

    def __init__(self, proxy: ProxyClient) -> None:
        self.proxy = proxy

    async def inflight(self) -> Mapping[str, Sequence[Holder]] | None:
        targets = await self.proxy.inflight()
        if targets is None:
            return None
        return {
            target: [_inflight_holder(r) for r in requests] for target, requests in targets.items()
        }

    async def check(self) -> tuple[str, str] | None:
        """``(proxy URL, problem)`` when the proxy refuses or cannot be reached, else ``None``."""
        problem = await self.proxy.check()
        return None if problem is None else (self.proxy.base_url, problem)


def _inflight_holder(request: Mapping[str, Any]) -> Holder:
    started = request.get("started_at")
    return Holder(
        client=str(request.get("client") or "unknown client"),
        kind="inflight",
        detail=str(request.get("id") or ""),
        started_at=str(started) if started else None,
    )
