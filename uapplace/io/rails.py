"""Per-target rails: how many requests a target takes at once (docs/placement-rules.md §4.3, §5).

A *target* is a resident's ``<device>:<endpoint>`` (docs/http-contract.md §1), the key of the
proxy's per-target concurrency budget. Its rails come from two places that must
agree, and a disagreement is surfaced, never silently resolved:

- the registry's ``rails`` (the operator's declared figure, per model), and
- the live engine, probed by engine kind (backend-aware, docs/placement-rules.md §5 item 3):

  ============  ============================================================
  engine        sources, in order
  ============  ============================================================
  llama.cpp     ``GET /props`` ``total_slots`` → ``GET /slots`` (the number of
                slot objects), asked only when ``/props`` has no
                ``total_slots`` and does not say ``is_sleeping: true``:
                ``GET /slots`` wakes a sleeping llama.cpp, ``/props`` does not
                (:mod:`uapplace.io.engines`). A sleeping engine without
                ``total_slots`` reads as ``not_probed``, never woken to count
  strata        ``GET /metrics`` ``rails``, else a ``slots`` gauge. Not
                ``expert_slots``: it is 7736 on a one-rail server (expert-cache
                slots, docs/placement-rules.md §5 item 3), although a registry
                may name it as its ``rails_source``
  vllm          ``GET /metrics``: a ``max_num_seqs`` sample or info label. Stock
                vLLM exports none (``vllm:num_requests_running`` is load, not
                capacity; ``vllm:cache_config_info`` carries cache settings
                only; ``/v1/models`` has ``max_model_len`` only), so for vLLM the
                reliable source is the launch flag ``--max-num-seqs`` written into
                the registry's ``rails``; a live vLLM without the metric reads as
                ``unsupported``, never as a number.
  other         ``/props`` → ``/slots`` (the same guard) → ``/metrics`` ``slots``
  ============  ============================================================

Probe states (:class:`ProbeState`): ``ok`` (a live number), ``probe_failed``
(the engine did not answer usably: unreachable, timeout, 5xx, a body that is
not what the route serves), ``unsupported`` (the engine answered but has no
rail source: ``/slots`` 404/405/501 and no ``total_slots``; vLLM without the
metric), ``not_probed`` (no endpoint to ask, a sleeping engine that only
``/slots`` could answer for, or a ``paused`` target: its weights are offloaded, so it
has no usable rails, declared or live, until a wake; issue 21 item 6). A failed probe
is never read as
one rail: that is the bug docs/placement-rules.md §5 item 3 names (a default rail count
standing in for a failed probe).

The effective figure (:attr:`TargetRails.rails`) is decided here, where
docs/placement-rules.md is silent: with both numbers, the **smaller** one, so a
disagreement never overflows a target (two requests handed to a one-rail Strata is
the overflow of docs/placement-rules.md §4.3; one request at a time on a two-slot
llama.cpp only throttles), with ``agrees: false`` shown and ``validate`` warning; with one
number, that one; with none, ``None`` — the proxy's gate then runs that target
one request at a time (:class:`uapplace.gate.TargetSemaphores`), and every
surface shows the state rather than a made-up ``1``.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

import aiohttp

from uapplace.core.model import Model, Resident, ResidentState
from uapplace.io.engines import engine_root, parse_prometheus, props_sleeping
from uapplace.io.router import is_router_config, router_model_id
from uapplace.io.router import model_query as router_model_query

RAILS_PROBE_TIMEOUT_S = 2.0
LiveSource = Literal["slots", "props", "metrics"]
RailsSource = Literal["registry", "slots", "props", "metrics"]
UNSUPPORTED_STATUSES = frozenset({404, 405, 501})
"""Answers that mean "this server has no such route", not "it failed" (llama.cpp
answers 501 at ``/slots`` when started with ``--no-slots``)."""


class ProbeState(StrEnum):
    OK = "ok"
    FAILED = "probe_failed"
    UNSUPPORTED = "unsupported"
    NOT_PROBED = "not_probed"


class EngineKind(StrEnum):
    LLAMA_CPP = "llama.cpp"
    STRATA = "strata"
    VLLM = "vllm"
    OTHER = "other"


_KIND_BY_NAME = {
    "llama.cpp": EngineKind.LLAMA_CPP,
    "llamacpp": EngineKind.LLAMA_CPP,
    "llama-cpp": EngineKind.LLAMA_CPP,
    "llama-server": EngineKind.LLAMA_CPP,
    "strata": EngineKind.STRATA,
    "vllm": EngineKind.VLLM,
}


def engine_kind(engine: str) -> EngineKind:
    """The registry's ``engine`` string as a kind (case-insensitive); unknown → ``other``."""
    return _KIND_BY_NAME.get(engine.strip().lower(), EngineKind.OTHER)


@dataclass(frozen=True)
class LiveRails:
    """What the live engine said about its rails."""

    state: ProbeState
    rails: int | None = None
    source: LiveSource | None = None
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state.value,
            "rails": self.rails,
            "source": self.source,
            "detail": self.detail,
        }


NOT_PROBED = LiveRails(ProbeState.NOT_PROBED, detail="no endpoint to probe")
PAUSED = LiveRails(
    ProbeState.NOT_PROBED, detail="paused (weights offloaded): no usable rails until a wake"
)


@dataclass(frozen=True)
class TargetRails:
    """One target's rails: the registry's figure, the live one, and the verdict."""

    target_id: str
    model: str
    engine: str
    endpoint: str | None
    declared: int | None
    """The registry's ``rails`` for the model (``None``: not declared)."""
    declared_source: str | None
    """The registry's ``rails_source`` note, shown as it was written."""
    live: LiveRails
    paused: bool = False
    """Every resident on the target is ``paused``: no usable rails (module doc)."""

    @property
    def rails(self) -> int | None:
        """The figure to size a semaphore from (module doc: the smaller of the two)."""
        if self.paused:
            return None
        live = self.live.rails if self.live.state is ProbeState.OK else None
        known = [n for n in (self.declared, live) if n is not None]
        return min(known) if known else None

    @property
    def rails_source(self) -> RailsSource | None:
        """Where :attr:`rails` came from; the live source wins a tie (it confirmed it)."""
        if self.paused:
            return None
        if self.live.state is ProbeState.OK and self.live.rails == self.rails:
            return self.live.source
        if self.declared is not None:
            return "registry"
        return None

    @property
    def agrees(self) -> bool | None:
        """Registry and live engine agree; ``None`` when one of them has no figure."""
        if self.declared is None or self.live.state is not ProbeState.OK:
            return None
        return self.declared == self.live.rails

    @property
    def state(self) -> str:
        """One word for a status line: ``ok``, ``disagree``, or the probe's state."""
        if self.agrees is False:
            return "disagree"
        return self.live.state.value

    def to_json(self) -> dict[str, Any]:
        return {
            "target_id": self.target_id,
            "model": self.model,
            "engine": self.engine,
            "endpoint": self.endpoint,
            "rails": self.rails,
            "rails_source": self.rails_source,
            "state": self.state,
            "declared": self.declared,
            "declared_source": self.declared_source,
            "live": self.live.to_json(),
            "agrees": self.agrees,
        }

    def disagreement(self) -> str | None:
        """The warning ``validate`` shows, or ``None`` when there is nothing to say."""
        if self.agrees is False:
            return (
                f"model {self.model!r}: the registry declares rails {self.declared} but the "
                f"live engine at {self.endpoint} reports {self.live.rails} "
                f"(from {self.live.source}); the gate uses {self.rails}"
            )
        return None


# --------------------------------------------------------------------------- probes


@dataclass(frozen=True)
class _Answer:
    url: str
    status: int | None
    """``None`` when nothing answered (the error is in ``error``)."""
    text: str = ""
    error: str = ""


async def _fetch(http: aiohttp.ClientSession, url: str) -> _Answer:
    try:
        async with http.get(url) as response:
            return _Answer(url, response.status, await response.text())
    except TimeoutError:
        return _Answer(url, None, error="timed out")
    except aiohttp.ClientError as err:
        return _Answer(url, None, error=str(err) or type(err).__name__)


def _failed(answer: _Answer, why: str) -> LiveRails:
    return LiveRails(ProbeState.FAILED, detail=f"GET {answer.url}: {why}")


def _problem(answer: _Answer) -> str:
    """Why an answer is not a 200, for a detail line."""
    if answer.status is None:
        return answer.error
    return f"HTTP {answer.status}: {answer.text[:120]}"


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and value >= 1:
        return value
    if isinstance(value, float) and math.isfinite(value) and value >= 1 and value.is_integer():
        return int(value)
    return None


def _json(answer: _Answer) -> object:
    try:
        return json.loads(answer.text)
    except ValueError:
        return None


def read_slots(answer: _Answer) -> LiveRails | None:
    """``/slots``: ``None`` when the route is absent (try the next source)."""
    if answer.status in UNSUPPORTED_STATUSES:
        return None
    if answer.status != 200:
        return _failed(answer, _problem(answer))
    body = _json(answer)
    if not isinstance(body, list) or not body or not all(isinstance(s, dict) for s in body):
        return _failed(answer, "not a non-empty list of slot objects")
    return LiveRails(ProbeState.OK, len(body), "slots", f"{len(body)} slot objects")


def asleep_in_props(answer: _Answer) -> bool:
    """``/props`` answered and says ``is_sleeping: true`` (then ``/slots`` is not asked)."""
    body = _json(answer) if answer.status == 200 else None
    return isinstance(body, dict) and props_sleeping(body) is True


def read_props(answer: _Answer) -> LiveRails | None:
    """``/props`` ``total_slots``: ``None`` when absent (route or field)."""
    if answer.status in UNSUPPORTED_STATUSES:
        return None
    if answer.status != 200:
        return _failed(answer, _problem(answer))
    body = _json(answer)
    if not isinstance(body, dict):
        return _failed(answer, "not a JSON object")
    if "total_slots" not in body:
        return None
    total = _positive_int(body["total_slots"])
    if total is None:
        return _failed(answer, f"total_slots is {body['total_slots']!r}, not a positive integer")
    return LiveRails(ProbeState.OK, total, "props", f"total_slots {total}")


METRIC_KEYS: Mapping[EngineKind, tuple[str, ...]] = {
    EngineKind.STRATA: ("rails", "slots"),
    EngineKind.VLLM: ("max_num_seqs",),
    EngineKind.LLAMA_CPP: (),
    EngineKind.OTHER: ("slots",),
}


def read_metrics(answer: _Answer, keys: Iterable[str]) -> LiveRails | None:
    """The first of ``keys`` in ``/metrics`` (a sample, or a label of an ``*_info``
    metric); ``None`` when the route or every key is absent."""
    if answer.status in UNSUPPORTED_STATUSES:
        return None
    if answer.status != 200:
        return _failed(answer, _problem(answer))
    try:
        parsed = parse_prometheus(answer.text)
    except ValueError as err:
        return _failed(answer, str(err))
    for key in keys:
        if key not in parsed:
            continue
        value = parsed[key]
        number = _positive_int(float(value) if _is_number(value) else value)
        if number is None:
            return _failed(answer, f"{key} is {value!r}, not a positive integer")
        return LiveRails(ProbeState.OK, number, "metrics", f"metrics {key} {number}")
    return None


def _is_number(value: object) -> bool:
    if isinstance(value, float):
        return True
    if isinstance(value, str):
        try:
            float(value)
        except ValueError:
            return False
        return True
    return False


_SOURCES: Mapping[EngineKind, tuple[LiveSource, ...]] = {
    EngineKind.LLAMA_CPP: ("props", "slots"),
    EngineKind.STRATA: ("metrics",),
    EngineKind.VLLM: ("metrics",),
    EngineKind.OTHER: ("props", "slots", "metrics"),
}


async def probe_rails(
    endpoint: str | None,
    engine: str,
    timeout_s: float = RAILS_PROBE_TIMEOUT_S,
    router_model: str | None = None,
) -> LiveRails:
    """Ask the live engine at ``endpoint`` how many rails it runs (module doc table).

    Never raises. The first source that answers with a number wins; a source
    that fails ends the probe as ``probe_failed`` (a server that errors on
    ``/props`` is not trusted on ``/slots`` either); when every source is
    absent the answer is ``unsupported``. ``/slots`` is skipped when ``/props``
    said ``is_sleeping: true`` (it would wake the engine); a sleeping engine with
    no other source is ``not_probed``. ``router_model``: one model of a llama.cpp
    router, asked only ``/props?model=ID&autoload=false`` (:func:`_probe_router_model`).
    """
    if not endpoint:
        return NOT_PROBED
    if router_model is not None:
        return await _probe_router_model(endpoint, router_model, timeout_s)
    kind = engine_kind(engine)
    root = engine_root(endpoint)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    absent: list[str] = []
    asleep = False
    async with aiohttp.ClientSession(timeout=timeout) as http:
        for source in _SOURCES[kind]:
            if source == "slots" and asleep:
                continue
            answer = await _fetch(http, f"{root}/{source}")
            if answer.status is None:
                return _failed(answer, answer.error)
            if source == "slots":
                result = read_slots(answer)
            elif source == "props":
                result = read_props(answer)
                asleep = asleep_in_props(answer)
            else:
                result = read_metrics(answer, METRIC_KEYS[kind])
            if result is not None:
                return result
            absent.append(f"/{source}")
    if asleep:
        return LiveRails(
            ProbeState.NOT_PROBED,
            detail=f"{engine} at {root} is asleep (/props is_sleeping) and /props has no "
            "total_slots; /slots not asked: it would wake the engine",
        )
    return LiveRails(
        ProbeState.UNSUPPORTED,
        detail=f"{engine} at {root} has no rail source ({', '.join(absent)} absent)",
    )


async def _probe_router_model(endpoint: str, model_id: str, timeout_s: float) -> LiveRails:
    """A router model's rails: its child's ``total_slots``, read through the router with
    ``?model=ID&autoload=false`` — never ``/slots``, and never without ``autoload=false``:
    either would load the model (and evict another under ``--models-max``). A model the
    router has not loaded is ``not_probed`` (docs/placement-rules.md §4.2)."""
    url = f"{engine_root(endpoint)}/props?{router_model_query(model_id)}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as http:
        answer = await _fetch(http, url)
    if answer.status == 400 and "not loaded" in answer.text:
        return LiveRails(
            ProbeState.NOT_PROBED, detail=f"{model_id} is not loaded in the router at {endpoint}"
        )
    if answer.status is None:
        return _failed(answer, answer.error)
    result = read_props(answer)
    if result is not None:
        return result
    return LiveRails(ProbeState.UNSUPPORTED, detail=f"GET {url}: no total_slots")


@dataclass(frozen=True)
class RailsQuery:
    """One target to probe, with what the registry declares for it."""

    target_id: str
    model: str
    engine: str
    endpoint: str | None
    declared: int | None = None
    declared_source: str | None = None
    router_model: str | None = None
    """The router model id, for one model of a llama.cpp router."""
    paused: bool = False
    """Only ``paused`` residents on the target: not probed, no usable rails."""


async def target_rails(
    queries: Iterable[RailsQuery], timeout_s: float = RAILS_PROBE_TIMEOUT_S
) -> list[TargetRails]:
    """Probe every target at once; the answers come back in the same order."""
    rows = list(queries)
    lives = await asyncio.gather(*(_probe(q, timeout_s) for q in rows))
    return [
        TargetRails(
            q.target_id,
            q.model,
            q.engine,
            q.endpoint,
            q.declared,
            q.declared_source,
            live,
            paused=q.paused,
        )
        for q, live in zip(rows, lives, strict=True)
    ]


async def _probe(query: RailsQuery, timeout_s: float) -> LiveRails:
    if query.paused:  # nothing loaded to count, and a probe must not wake it
        return PAUSED
    return await probe_rails(query.endpoint, query.engine, timeout_s, query.router_model)


def queries_for(residents: Iterable[Resident], models: Mapping[str, Model]) -> list[RailsQuery]:
    """One :class:`RailsQuery` per target of ``residents``, declared figures from ``models``.

    Two residents on one target (one engine serving both) give one query, the first's;
    a paused one comes last (the models of one llama.cpp router share a target, and a
    paused one has nothing loaded to count).
    """
    seen: dict[str, RailsQuery] = {}
    for resident in sorted(residents, key=lambda r: r.state is ResidentState.PAUSED):
        model = models.get(resident.model)
        config = model.configs.get(resident.config) if model is not None else None
        seen.setdefault(
            resident.target_id,
            RailsQuery(
                resident.target_id,
                resident.model,
                resident.engine,
                resident.endpoint,
                model.rails if model is not None else None,
                model.rails_source if model is not None else None,
                router_model_id(model) if model is not None and is_router_config(config) else None,
                paused=resident.state is ResidentState.PAUSED,
            ),
        )
    return list(seen.values())


RAILS_CACHE_S = 10.0
"""How long a probe of the same targets is reused (GetState is read often: status,
every ``/metrics`` scrape); a change of residents probes at once."""
RAILS_CACHED_PROBE_TIMEOUT_S = 1.0
"""Per engine, on the read path (``GetState``): a hung engine costs a reader at most this."""


class RailsCache:
    """The rails of the residents' targets, probed at most every ``ttl_s`` for one set
    of targets (any change of the set, or of a declared figure, probes again)."""

    def __init__(
        self,
        ttl_s: float = RAILS_CACHE_S,
        timeout_s: float = RAILS_CACHED_PROBE_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self.clock = clock
        self._key: tuple[RailsQuery, ...] | None = None
        self._rows: list[TargetRails] = []
        self._at = 0.0
        self._lock = asyncio.Lock()

    async def current(
        self, residents: Iterable[Resident], models: Mapping[str, Model]
    ) -> list[TargetRails]:
        key = tuple(queries_for(residents, models))
        async with self._lock:  # concurrent readers share one probe
            if key == self._key and self.clock() - self._at < self.ttl_s:
                return self._rows
            self._rows = await target_rails(key, self.timeout_s)
            self._key, self._at = key, self.clock()
            return self._rows

    def invalidate(self) -> None:
        self._key = None


__all__ = [
    "NOT_PROBED",
    "EngineKind",
    "LiveRails",
    "ProbeState",
    "RailsCache",
    "RailsQuery",
    "TargetRails",
    "engine_kind",
    "probe_rails",
    "queries_for",
    "target_rails",
]
