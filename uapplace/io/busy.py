"""Whether an engine has work in flight, asked of the engine itself (the drain's second source).

The proxy's in-flight list knows only what went through the proxy; a request sent straight
to the engine is invisible there. So the drain (docs/placement-rules.md §4.6 step 2) also
asks each victim's engine, in this order, and stops at the first route that decides:

1. ``GET /props`` ``is_sleeping`` (llama.cpp): a sleeping server has nothing in flight.
   Asked first because ``GET /slots`` **wakes** a sleeping llama-server (it is a task),
   while ``/props`` answers from its cache.
2. ``GET /slots``: any slot ``is_processing`` is busy; every slot idle is idle. llama.cpp
   answers 501 with ``--no-slots``; other engines have no such route.
3. ``GET /metrics``: ``llamacpp:requests_processing`` + ``llamacpp:requests_deferred``
   (llama.cpp with ``--metrics``), ``vllm:num_requests_running`` +
   ``vllm:num_requests_waiting`` (vLLM; labelled samples summed) above 0 is busy.

What no route decides (docs/placement-rules.md §4.6, "Drain: the engine's own word"):

- **unreachable**: some route got no HTTP answer at all (refused, reset, timed out) and
  none decided. Unknown, so it counts as busy, as the proxy not answering does.
- **no signal**: every route answered, none with a busy signal (404, 501, 400, a body
  without the field). The engine cannot tell, and waiting will not make it tell: it does
  not block the drain (else no switch away from it could ever succeed); the proxy's list
  and bus holds decide alone, and the step detail says so.

:func:`ask` reads the routes through a ``fetch(route)`` callable
(:meth:`uapplace.io.seams.EngineProbe.get_reply`), so the unit tier's fakes answer with
real bodies and this module's reading of them is what runs there too.
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from uapplace.io.engines import parse_prometheus, props_sleeping

PROPS = "/props"
SLOTS = "/slots"
METRICS = "/metrics"

BUSY_GAUGES = (
    "llamacpp:requests_processing",
    "llamacpp:requests_deferred",
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)
"""The ``/metrics`` gauges that count requests an engine holds (running or queued)."""

Fetch = Callable[[str], Awaitable[tuple[int | None, str]]]
"""``GET route`` at one engine: ``(status, body)``, or ``(None, why)`` when nothing answered."""


class Verdict(StrEnum):
    IDLE = "idle"
    BUSY = "busy"
    ASLEEP = "asleep"
    NO_SIGNAL = "no signal"
    UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Said:
    """What one route said, as the drain's detail shows it."""

    route: str
    said: str

    def text(self) -> str:
        return f"{self.route} {self.said}"


@dataclass(frozen=True)
class EngineWork:
    """The engine's own word on its in-flight work: the verdict and each route asked."""

    verdict: Verdict
    said: tuple[Said, ...]

    @property
    def blocks_drain(self) -> bool:
        """Busy, or unknown because it did not answer (unknown counts as busy)."""
        return self.verdict in (Verdict.BUSY, Verdict.UNREACHABLE)

    def text(self) -> str:
        """``idle (/props is_sleeping false, /slots 0 of 2 slots processing)``."""
        asked = ", ".join(s.text() for s in self.said)
        return f"{self.verdict.value} ({asked})"


@dataclass(frozen=True)
class _Reading:
    """One route read: ``decides`` is the verdict it gives, ``None`` when it gives none."""

    said: Said
    decides: Verdict | None
    answered: bool


async def ask(fetch: Fetch) -> EngineWork:
    """Ask ``/props``, then ``/slots``, then ``/metrics`` until one decides (module doc)."""
    readings: list[_Reading] = []
    for route, read in ((PROPS, _props), (SLOTS, _slots), (METRICS, _metrics)):
        status, body = await fetch(route)
        reading = _unanswered(route, body) if status is None else read(status, body)
        readings.append(reading)
        if reading.decides is not None:
            return EngineWork(reading.decides, tuple(r.said for r in readings))
        if route == PROPS and not reading.answered:
            break  # /slots would wake a server that may be asleep; nothing answers anyway
    said = tuple(r.said for r in readings)
    if all(r.answered for r in readings):
        return EngineWork(Verdict.NO_SIGNAL, said)
    return EngineWork(Verdict.UNREACHABLE, said)


def _unanswered(route: str, why: str) -> _Reading:
    return _Reading(Said(route, f"no answer ({why})"), None, answered=False)


def _not_ok(route: str, status: int) -> _Reading:
    return _Reading(Said(route, f"HTTP {status}"), None, answered=True)


def _json(body: str) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _props(status: int, body: str) -> _Reading:
    if status != 200:
        return _not_ok(PROPS, status)
    props = _json(body)
    sleeping = props_sleeping(props) if isinstance(props, dict) else None
    if sleeping is True:
        return _Reading(Said(PROPS, "is_sleeping true: nothing in flight"), Verdict.ASLEEP, True)
    if sleeping is False:
        return _Reading(Said(PROPS, "is_sleeping false"), None, True)
    return _Reading(Said(PROPS, "no is_sleeping"), None, True)


def _slots(status: int, body: str) -> _Reading:
    if status != 200:
        return _not_ok(SLOTS, status)
    slots = _json(body)
    if not isinstance(slots, list) or not slots:
        return _Reading(Said(SLOTS, "not a list of slots"), None, True)
    flags = [s.get("is_processing") if isinstance(s, dict) else None for s in slots]
    if not all(isinstance(flag, bool) for flag in flags):
        return _Reading(Said(SLOTS, "no is_processing"), None, True)
    processing = sum(1 for flag in flags if flag)
    said = Said(SLOTS, f"{processing} of {len(slots)} slots processing")
    return _Reading(said, Verdict.BUSY if processing else Verdict.IDLE, True)


def _metrics(status: int, body: str) -> _Reading:
    if status != 200:
        return _not_ok(METRICS, status)
    try:
        samples = parse_prometheus(body)
    except ValueError:
        return _Reading(Said(METRICS, "not Prometheus text"), None, True)
    found = _gauges(samples)
    if not found:
        return _Reading(Said(METRICS, "no requests gauge"), None, True)
    shown = ", ".join(f"{name} {value:g}" for name, value in found.items())
    busy = sum(found.values()) > 0
    return _Reading(Said(METRICS, shown), Verdict.BUSY if busy else Verdict.IDLE, True)


def _gauges(samples: Mapping[str, float | str]) -> dict[str, float]:
    """Each of :data:`BUSY_GAUGES` served, its samples summed over their labels."""
    found: dict[str, float] = {}
    for series, value in samples.items():
        if not isinstance(value, float) or math.isnan(value):
            continue
        name = series.split("{", 1)[0]
        if name in BUSY_GAUGES:
            found[name] = found.get(name, 0.0) + value
    return found
