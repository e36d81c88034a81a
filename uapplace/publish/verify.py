"""The one publication check (docs/invariants.md, invariant 2): may admission forward here?

An engine is *published* (its resident ``hot``, the only state admission
forwards to) only after this check passed for it in this daemon's life:

1. its unit is ``active`` (checked by the caller: :func:`wait_up` for a run,
   the unit sync for units it follows);
2. ``GET /health`` answers 200 (a loading llama.cpp answers 503);
3. ``GET /v1/models`` lists the requested id, the model's key, its config's key
   or an id the model advertises (:func:`expectation`);
4. the capacity policy's ``metricsMustMatch`` for the model's service holds
   against the engine's facts: ``GET /metrics`` (parsed by
   :func:`uapplace.io.engines.parse_prometheus`), and for a key ``/metrics`` lacks,
   ``GET /props`` (:func:`uapplace.io.engines.props_facts`: llama.cpp keeps its
   settings there, ``n_ctx``, ``total_slots``, ``build_info``, ``model_alias`` …).
   One extra ``GET``, only when needed; never ``/slots``, which wakes a sleeping
   llama.cpp. README.md ("Model registry") lists which facts are checkable where;
5. for one model of a llama.cpp router (``pause_lever: llamacpp-router``): the
   router's ``GET /models`` says that model is ``loaded`` (or idle-``sleeping``, which
   wakes on the next request). A router lists every model it knows, loaded or not, and
   its ``/health`` is always 200, so 2 and 3 alone prove nothing there
   (docs/placement-rules.md §4.2, "What paused is"); its ``/metrics`` is read with
   ``?model=ID&autoload=false``, and so is its ``/props`` (:mod:`uapplace.io.router`).

Enforcement (:mod:`uapplace.enforce.steps`: ``verify-up``; :mod:`uapplace.enforce.rollback`:
``rollback-verify``) and the unit sync (:mod:`uapplace.publish.unitsync`: units found
running at start-up, started by hand, residents restored from the ledger) both
call these functions, so the two paths cannot disagree about what "verified"
means. Every engine route is read through an :class:`~uapplace.io.seams.EngineProbe`
(the real HTTP one by default; the unit tier passes a fake).

:func:`check` classifies a failure: ``unhealthy`` (no answer, 503, a route not
ready: keep polling), ``wrong_id`` (``/v1/models`` answered, without any
accepted id: never publish, report), ``metrics`` (the policy does not hold:
never publish, report). The last two are facts about the engine as started, so
the caller re-checks them with a long backoff rather than a tight poll (an
operator may swap the engine to the right model in place).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from uapplace.core.model import Config, Model
from uapplace.files.capacity import ServicePolicy
from uapplace.io import engines, router
from uapplace.io.router import HTTP_ROUTER, RouterProbe
from uapplace.io.seams import HTTP_ENGINES, EngineProbe
from uapplace.io.units import DOWN_STATES, UnitState, state_text

POLL_LAG_FRACTION = 0.1
"""How late a poll may see what it waits for, as a share of the time waited so far
(``/health`` in :func:`wait_up`, the probe in verify-free, the in-flight look in drain):
a readiness that comes after ``t`` is seen by ``t + max(first, 0.1 t)`` at the latest,
and no later than the cap; an engine that loads for seconds is asked at the cap's pace."""


FIRST_POLL_S = 0.01
"""The first pause of verify-free's and drain's polls (verify-up's is the timeouts'
``health_first_poll_s``, 10 ms by default)."""


def backoff(
    first_s: float, max_s: float, clock: Callable[[], float] = time.monotonic
) -> Iterator[float]:
    """The pauses of one poll, paced by the time waited so far: :data:`POLL_LAG_FRACTION`
    of it, never less than ``first_s`` and never more than ``max_s`` (``first_s`` itself
    when it is the larger). Issue 23: a swap is felt at the pace of its polls, so they come
    every ``first_s`` while a quick engine is likely to turn ready, and slow down only as
    the wait shows a long load (a pause that grew ×1.5 per poll left a 34 ms gap at 50–80
    ms, where a small llama-server turns healthy)."""
    started = clock()
    while True:
        yield max(min((clock() - started) * POLL_LAG_FRACTION, max_s), first_s)


@dataclass(frozen=True)
class Expectation:
    """What ``/v1/models`` must show, and which policy ``/metrics`` must satisfy."""

    requested: str
    """The id asked for (named in messages)."""
    model_key: str
    accepted: frozenset[str]
    """Any of these in ``/v1/models`` is enough."""
    policy: ServicePolicy | None = None
    can_sleep: bool = False
    """The config declares an executable pause lever (issue 12): a sleeping vLLM still
    answers ``/health`` 200 and lists its id, so ``/is_sleeping`` must say false too."""
    router_id: str | None = None
    """The id of a llama.cpp router model (:func:`uapplace.io.router.router_model_id`):
    the router's ``GET /models`` must say it is loaded."""


def expectation(
    model: Model,
    config: Config | None,
    requested: str | None = None,
    policy: ServicePolicy | None = None,
) -> Expectation:
    """The ids an engine of ``model`` (running ``config``) may serve to count as right.

    ``requested`` defaults to the model key (a unit nobody asked for: started by
    hand, or found at start-up).
    """
    asked = requested or model.key
    accepted = {asked, model.key, *model.advertises}
    if config is not None:
        accepted.add(config.key)
    can_sleep = config is not None and config.sleep_level is not None
    router_id = router.router_model_id(model) if router.is_router_config(config) else None
    return Expectation(asked, model.key, frozenset(accepted), policy, can_sleep, router_id)


class Outcome(StrEnum):
    OK = "ok"
    UNHEALTHY = "unhealthy"
    """Not answering, ``/health`` not 200, or a route not ready: poll again soon."""
    WRONG_ID = "wrong_id"
    """``/v1/models`` answered without any accepted id."""
    METRICS = "metrics"
    """The capacity policy's ``metricsMustMatch`` does not hold."""


@dataclass(frozen=True)
class Verdict:
    outcome: Outcome
    detail: str
    served: tuple[str, ...] = ()
    """What ``/v1/models`` listed, when it answered."""

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK

    @property
    def is_wrong_engine(self) -> bool:
        """A fact about the running engine, not a passing state: report it, back off."""
        return self.outcome in (Outcome.WRONG_ID, Outcome.METRICS)


async def served_problem(
    endpoint: str, expect: Expectation, http_s: float, probe: EngineProbe = HTTP_ENGINES
) -> str | None:
    """``/v1/models`` must list an accepted id; ``None`` when it does, else why not."""
    problem, _ids = await _served(endpoint, expect, http_s, probe)
    return problem


async def _served(
    endpoint: str, expect: Expectation, http_s: float, probe: EngineProbe = HTTP_ENGINES
) -> tuple[str | None, tuple[str, ...] | None]:
    """(problem, served ids); served is ``None`` when ``/v1/models`` gave no usable list."""
    try:
        served = await probe.served_ids(endpoint, http_s)
    except engines.EngineError as err:
        return str(err), None
    if expect.accepted.intersection(served):
        return None, tuple(served)
    return (
        f"{endpoint} serves [{', '.join(served) or 'nothing'}], not {expect.requested} "
        f"(nor any id {expect.model_key} advertises)"
    ), tuple(served)


async def metrics_problem(
    policy: ServicePolicy,
    endpoint: str,
    http_s: float,
    probe: EngineProbe = HTTP_ENGINES,
    routed: tuple[RouterProbe, str] | None = None,
) -> str | None:
    """The capacity policy's ``metricsMustMatch`` against what the engine serves
    (:func:`served_facts`; ``routed``: a router and the model id whose child's routes
    count). Each mismatch names the key, the value served and where it came from, and
    what the policy wants."""
    if not policy.metrics_must_match:
        return None
    served = await served_facts(policy.metrics_must_match, endpoint, http_s, probe, routed)
    wrong = [
        _mismatch(key, want, served)
        for key, want in policy.metrics_must_match.items()
        if not metric_matches(want, served.values.get(key))
    ]
    if wrong:
        return f"metricsMustMatch of service {policy.name}: {'; '.join(wrong)}"
    return None


@dataclass(frozen=True)
class ServedFacts:
    """What the engine serves for the keys asked: each value with where it came from."""

    values: dict[str, float | str]
    sources: dict[str, str]
    """Key → ``/metrics`` or ``/props <path>``."""
    errors: tuple[str, ...] = ()
    """Why a route asked gave nothing (``GET …: HTTP 501: …``), for a missing key."""


async def served_facts(
    keys: Iterable[str],
    endpoint: str,
    http_s: float,
    probe: EngineProbe = HTTP_ENGINES,
    routed: tuple[RouterProbe, str] | None = None,
) -> ServedFacts:
    """``keys`` as the engine serves them: ``/metrics`` first, ``/props`` for the rest
    (through a router: its child's, ``?model=ID&autoload=false``).

    ``/props`` is asked only when a key is not in ``/metrics`` (or ``/metrics`` gave no
    usable answer: llama-server without ``--metrics`` answers 501, yet its ``n_ctx`` is
    in ``/props``). Never raises for an engine that does not answer: the errors are
    kept for the message of a key that stays missing.
    """
    wanted = list(keys)
    values: dict[str, float | str] = {}
    sources: dict[str, str] = {}
    errors: list[str] = []
    try:
        if routed is not None:
            metrics = await routed[0].metrics(endpoint, routed[1], http_s)
        else:
            metrics = await probe.metrics(endpoint, http_s)
    except engines.EngineError as err:
        metrics, errors = {}, [str(err)]
    for key in wanted:
        if key in metrics:
            values[key], sources[key] = metrics[key], "/metrics"
    if all(key in values for key in wanted):
        return ServedFacts(values, sources, tuple(errors))
    route = engines.PROPS_ROUTE
    if routed is not None:
        route += f"?{router.model_query(routed[1])}"
    status, text = await probe.get_reply(endpoint, route, http_s)
    try:
        body: dict[str, Any] = engines.props_body(
            f"{engines.engine_root(endpoint)}{route}", status, text
        )
    except engines.EngineError as err:
        return ServedFacts(values, sources, (*errors, str(err)))
    facts = engines.props_facts(body)
    for key in wanted:
        if key not in values and key in facts:
            values[key], sources[key] = facts[key], engines.props_fact_source(key, body)
    return ServedFacts(values, sources, tuple(errors))


def _mismatch(key: str, want: str | int | float, served: ServedFacts) -> str:
    if key not in served.values:
        why = f": {'; '.join(served.errors)}" if served.errors else ""
        return f"{key} is missing, policy wants {want!r} (in neither /metrics nor /props{why})"
    value = served.values[key]
    shown = int(value) if isinstance(value, float) and value.is_integer() else value
    return f"{key} is {shown!r}, policy wants {want!r} (from {served.sources[key]})"


def metric_matches(want: str | int | float, seen: str | float | None) -> bool:
    if seen is None:
        return False
    if isinstance(want, int | float) and isinstance(seen, int | float):
        return float(want) == float(seen)
    return str(want).strip().lower() == str(seen).strip().lower()


async def router_problem(
    endpoint: str, model_id: str, http_s: float, routers: RouterProbe = HTTP_ROUTER
) -> str | None:
    """A router model's check (module doc, 5): ``None`` when the router says it serves."""
    try:
        seen = await router.status_of(routers, endpoint, model_id, http_s)
    except engines.EngineError as err:
        return str(err)
    if seen.serving:
        return None
    return f"the router at {endpoint} says {seen.text()}: not loaded, so not serving"


async def check(
    endpoint: str,
    expect: Expectation,
    http_s: float,
    probe: EngineProbe = HTTP_ENGINES,
    routers: RouterProbe = HTTP_ROUTER,
) -> Verdict:
    """One full look at a running engine: health, served id, metrics (in that order);
    for a router model, its status in the router between the last two."""
    if not await probe.health(endpoint, http_s):
        return Verdict(Outcome.UNHEALTHY, f"{endpoint}/health is not 200 yet")
    problem, served = await _served(endpoint, expect, http_s, probe)
    if problem is not None:
        if served is None:
            return Verdict(Outcome.UNHEALTHY, problem)
        return Verdict(Outcome.WRONG_ID, problem, served)
    assert served is not None
    if expect.can_sleep:
        asleep = await probe.is_sleeping(endpoint, http_s)
        if asleep is not False:
            why = (
                "is asleep (paused): only a wake publishes it"
                if asleep
                else "cannot say whether it is asleep (neither /props nor /is_sleeping says)"
            )
            return Verdict(Outcome.UNHEALTHY, f"{endpoint} {why}", served)
    routed = None
    if expect.router_id is not None:
        problem = await router_problem(endpoint, expect.router_id, http_s, routers)
        if problem is not None:
            return Verdict(Outcome.UNHEALTHY, problem, served)
        routed = (routers, expect.router_id)
    checked = ""
    if expect.policy is not None and expect.policy.metrics_must_match:
        problem = await metrics_problem(expect.policy, endpoint, http_s, probe, routed)
        if problem is not None:
            return Verdict(Outcome.METRICS, problem, served)
        checked = f"; metricsMustMatch {', '.join(expect.policy.metrics_must_match)} as policy"
    return Verdict(Outcome.OK, f"{endpoint} healthy, serves {expect.requested}{checked}", served)


@dataclass(frozen=True)
class UnitWatch:
    """How :func:`wait_up` follows one unit and its engine while it comes up.

    ``changed`` is set by whoever follows the unit's state (the wait wakes early on
    a change); ``cached_state`` is that follower's last state, ``fresh_state`` a read
    from the manager. Polls start at ``first_poll_s`` and slow down with the wait
    (:func:`backoff`) up to ``max_poll_s``; each HTTP call is bounded by ``http_s``
    and goes through ``probe``.
    """

    changed: asyncio.Event
    fresh_state: Callable[[], Awaitable[UnitState | None]]
    cached_state: Callable[[], UnitState | None]
    first_poll_s: float
    max_poll_s: float
    http_s: float
    probe: EngineProbe = HTTP_ENGINES
    routers: RouterProbe = HTTP_ROUTER


async def wait_up(unit: str, endpoint: str | None, limit: float, watch: UnitWatch) -> str | None:
    """Wait until ``unit`` is active and its ``/health`` is 200; ``None`` when it is,
    else why not. A unit that goes down ends the wait at once."""
    deadline = time.monotonic() + limit
    pauses = backoff(watch.first_poll_s, watch.max_poll_s)
    state = await watch.fresh_state()
    while True:
        watch.changed.clear()
        if state is not None and state.active_state in DOWN_STATES:
            return f"{unit} went {state_text(state)} while loading"
        if state is not None and state.active_state == "active":
            if endpoint is None:
                return None
            remaining = deadline - time.monotonic()
            probe_s = max(0.05, min(watch.http_s, remaining))
            if await watch.probe.health(endpoint, probe_s):
                return None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            text = state_text(state) if state is not None else "unknown"
            return f"{unit} not healthy after {limit:g}s (unit {text})"
        with contextlib.suppress(TimeoutError):  # not wait_for: cpython gh-86296
            async with asyncio.timeout(min(next(pauses), remaining)):
                await watch.changed.wait()
        state = watch.cached_state() or await watch.fresh_state()


async def verify_up(
    unit: str, endpoint: str | None, expect: Expectation, limit: float, watch: UnitWatch
) -> Verdict:
    """:func:`wait_up`, then :func:`check` once: the whole verify-up of a run."""
    why = await wait_up(unit, endpoint, limit, watch)
    if why is not None:
        return Verdict(Outcome.UNHEALTHY, why)
    if endpoint is None:
        return Verdict(Outcome.OK, f"{unit} active; no endpoint in the registry to probe")
    verdict = await check(endpoint, expect, watch.http_s, watch.probe, watch.routers)
    if verdict.ok:
        return Verdict(Outcome.OK, f"{unit} active, {verdict.detail}", verdict.served)
    return verdict
