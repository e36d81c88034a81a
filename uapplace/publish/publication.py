"""Publication: a resident is published ``hot`` only once its engine passes the check
(docs/invariants.md, invariant 2).

:func:`verify_until_ok` is the loop both publishers run:
:class:`~uapplace.publish.unitsync.UnitSync`
for a unit that came up (by hand, at start-up, or restarted) and
:class:`LedgerPublication` for the residents a daemon without a user manager
restored. It checks with :func:`uapplace.publish.verify.check` (health, served id,
``metricsMustMatch``) until it passes, raising a ``wrong_model`` alert for an
engine that serves something else and re-checking it with a growing pause.

:class:`SleepWatch` keeps what is published about a ``hot`` resident true while it
serves (docs/placement-rules.md §4.2, "Serving is re-checked"): on a cadence and on a
sign of change it looks at the engine (health, served id, sleep state) and the probe's
memory of its processes; one asleep the way no request undoes, gone, or serving another
id is unpublished at once (``warming``, a ``not_serving`` alert) and handed back to its
publisher, which re-publishes it once it serves; an engine that sleeps on its own
(llama.cpp ``--sleep-idle-seconds``) stays ``hot`` and is shown ``asleep`` ("Asleep is
not paused"). Both publishers run one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Protocol

from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.model import (
    DeviceReading,
    Model,
    ProbeSource,
    Registry,
    Resident,
    ResidentKey,
    ResidentState,
    resident_key,
)
from uapplace.core.victims import config_of, model_of
from uapplace.files.capacity import ServicePolicy
from uapplace.io import engines, router
from uapplace.publish import verify

log = logging.getLogger(__name__)

WRONG_ENGINE_FIRST_S = 1.0
"""First pause before re-checking an engine that serves the wrong id or metrics."""
WRONG_ENGINE_MAX_S = 30.0
"""Longest pause between two re-checks of a wrong engine (doubling from the first)."""
SLEEP_CHECK_S = 5.0
"""How often each ``hot`` resident's engine is re-checked (:class:`SleepWatch`); the
daemon takes ``serving_check_s`` from the timeouts file (same default)."""


class ResidentSink(Protocol):
    """The part of the controller unit sync uses (a subset of ``EnforcementHost``)."""

    alert_board: AlertBoard
    """Where this path reports what a human must see."""

    def registry(self) -> Registry: ...

    def residents(self) -> Sequence[Resident]: ...

    def put_resident(self, resident: Resident) -> None: ...

    def drop_resident(self, resident: Resident) -> None: ...

    def service_policy(self, model: Model) -> ServicePolicy | None: ...

    async def read_devices(self) -> Mapping[str, DeviceReading]: ...


# --------------------------------------------------------------------------- verification


def resident_expectation(host: ResidentSink, resident: Resident) -> verify.Expectation | None:
    """What ``resident``'s engine must serve; ``None`` when its model left the registry."""
    registry = host.registry()
    model = registry.models.get(resident.model)
    if model is None:
        return None
    config = model.configs.get(resident.config)
    return verify.expectation(model, config, None, host.service_policy(model))


async def verify_until_ok(
    host: ResidentSink,
    resident: Resident,
    subject: str,
    current: Callable[[], Resident | None],
    *,
    first_poll_s: float,
    max_poll_s: float,
    http_s: float,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ask_sleep: bool = False,
) -> Resident | None:
    """Check ``resident``'s engine until it passes; the resident to publish, or ``None``.

    ``current()`` is the resident as it is now (``None`` once it is gone or taken
    over: the loop ends). While the engine is loading the pause grows from
    ``first_poll_s`` to ``max_poll_s``; while it serves the wrong id or breaks
    ``metricsMustMatch`` a ``wrong_model`` alert (subject ``subject``) is raised
    once per distinct problem and the pause grows from
    :data:`WRONG_ENGINE_FIRST_S` to :data:`WRONG_ENGINE_MAX_S`. With ``ask_sleep`` (a
    resident the re-check unpublished) an engine asleep the way no request undoes
    (:func:`asleep_unwaking`) is polled like a loading one, whatever its config declares.
    """
    interval = first_poll_s
    wrong_interval = WRONG_ENGINE_FIRST_S
    reported: str | None = None
    while True:
        now = current()
        if now is None:
            return None
        if now.endpoint is None:
            return now  # nothing to probe: the unit's state is all there is (as in verify-up)
        expect = resident_expectation(host, now)
        if expect is None:
            return None
        verdict = await verify.check(now.endpoint, expect, http_s)
        if verdict.ok and ask_sleep and not expect.can_sleep:
            asleep = await asleep_unwaking(now.endpoint, http_s)
            if asleep is not None:
                verdict = verify.Verdict(verify.Outcome.UNHEALTHY, asleep, verdict.served)
        if verdict.ok:
            if reported is not None:
                log.info("%s now passes verify-up: %s", subject, verdict.detail)
            return current()
        if verdict.is_wrong_engine:
            if verdict.detail != reported:
                reported = verdict.detail
                _report_wrong_engine(host, now, subject, expect, verdict)
            await sleep(wrong_interval)
            wrong_interval = min(wrong_interval * 2, WRONG_ENGINE_MAX_S)
            continue
        await sleep(interval)
        interval = min(interval * 2, max_poll_s)


def _report_wrong_engine(
    host: ResidentSink,
    resident: Resident,
    subject: str,
    expect: verify.Expectation,
    verdict: verify.Verdict,
) -> None:
    what = (
        "serves the wrong model"
        if verdict.outcome is verify.Outcome.WRONG_ID
        else ("breaks the capacity policy")
    )
    host.alert_board.raise_alert(
        AlertKind.WRONG_MODEL,
        Severity.WARNING,
        subject,
        f"{subject} {what}: {verdict.detail}; {resident.signature} is never forwarded to "
        "until it passes verify-up (re-checked with backoff)",
        {
            "model": resident.model,
            "config": resident.config,
            "device": resident.device,
            "endpoint": resident.endpoint,
            "unit": resident.unit,
            "served": list(verdict.served),
            "expected": sorted(expect.accepted),
            "problem": verdict.outcome.value,
        },
    )


# --------------------------------------------------------------------------- no user manager


class LedgerPublication:
    """Verify restored residents over HTTP where no user manager (no unit sync) runs.

    Each resident that is not ``hot`` is checked like a unit's engine
    (:func:`verify_until_ok`) and published ``hot`` when it passes; one that
    never passes stays ``warming`` and is never forwarded to. Without systemd
    there is no unit to reconcile against, so nothing is dropped here. A
    :class:`SleepWatch` shows a hot resident asleep while its engine sleeps
    (``sleep_check_s`` ``None``: none runs).
    """

    def __init__(
        self,
        host: ResidentSink,
        *,
        first_poll_s: float = 0.05,
        max_poll_s: float = 1.0,
        http_s: float = engines.PROBE_TIMEOUT_S,
        sleep_check_s: float | None = SLEEP_CHECK_S,
    ) -> None:
        self.host = host
        self.first_poll_s = first_poll_s
        self.max_poll_s = max_poll_s
        self.http_s = http_s
        self._tasks: list[asyncio.Task[None]] = []
        self._sleep_watch = (
            SleepWatch(host, every_s=sleep_check_s, http_s=http_s, on_unpublished=self._reverify)
            if sleep_check_s is not None
            else None
        )

    def start(self) -> None:
        if self._sleep_watch is not None:
            self._sleep_watch.start()
        for resident in self.host.residents():
            if resident.state in (ResidentState.WARMING, ResidentState.DRAINING):
                name = f"verify-{resident.signature}"
                self._tasks.append(asyncio.create_task(self._until_verified(resident), name=name))

    def _reverify(self, resident: Resident) -> None:
        """The re-check unpublished ``resident``: verify it again, then publish it."""
        name = f"reverify-{resident.signature}"
        self._tasks = [t for t in self._tasks if not t.done()]
        task = asyncio.create_task(self._until_verified(resident, ask_sleep=True), name=name)
        self._tasks.append(task)

    async def _until_verified(self, resident: Resident, *, ask_sleep: bool = False) -> None:
        key = resident_key(resident)

        def current() -> Resident | None:
            return next((r for r in self.host.residents() if resident_key(r) == key), None)

        verified = await verify_until_ok(
            self.host,
            resident,
            resident.unit or resident.signature,
            current,
            first_poll_s=self.first_poll_s,
            max_poll_s=self.max_poll_s,
            http_s=self.http_s,
            ask_sleep=ask_sleep,
        )
        if verified is not None and verified.state is not ResidentState.HOT:
            self.host.put_resident(replace(verified, state=ResidentState.HOT))

    async def close(self) -> None:
        if self._sleep_watch is not None:
            await self._sleep_watch.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []


# --------------------------------------------------------------------------- serving re-check

AsleepProbe = Callable[[Registry, Resident, float], Awaitable[bool | None]]
"""``(registry, resident, http_s)`` → asleep, awake, or ``None`` (it cannot say)."""


async def engine_asleep(registry: Registry, resident: Resident, http_s: float) -> bool | None:
    """Whether ``resident``'s engine sleeps on its own now, asked without waking it:
    llama.cpp's ``GET /props`` ``is_sleeping``, or for a router model its status
    ``sleeping`` in the router's ``GET /models``. Never ``GET /slots``, which is a task
    to llama-server and wakes it. ``None`` when nothing says (no endpoint, no such
    route, no answer, another engine)."""
    if resident.endpoint is None:
        return None
    model = model_of(registry, resident)
    config = config_of(registry, resident)
    try:
        if model is not None and router.is_router_config(config):
            listed = await router.HTTP_ROUTER.models(resident.endpoint, http_s)
            found = router.find(listed, router.router_model_id(model))
            return None if found is None else found.status == router.SLEEPING
        return engines.props_sleeping(await engines.props(resident.endpoint, http_s))
    except engines.EngineError:
        return None


class NotServing(StrEnum):
    """Why a ``hot`` resident is unpublished by the re-check (the alert's ``problem``)."""

    ASLEEP = "asleep"
    """Its engine sleeps and does not wake on a request (vLLM ``POST /sleep``:
    ``/is_sleeping`` true): a request would fail."""
    GONE = "gone"
    """``/health`` not 200 or no answer (twice), or a router says the model is not loaded."""
    WRONG_ID = "wrong_id"
    """``/v1/models`` answers without any id the resident serves."""
    MEMORY_GONE = "memory_gone"
    """The probe shows its processes' memory collapsed and the engine cannot say it sleeps."""


NOT_SERVING_TEXT = {
    NotServing.ASLEEP: "its engine is asleep and does not wake on a request",
    NotServing.GONE: "its engine does not answer as serving",
    NotServing.WRONG_ID: "its engine serves another id",
    NotServing.MEMORY_GONE: "the probe shows its memory gone and its engine cannot say it sleeps",
}


@dataclass(frozen=True)
class ServingLook:
    """One look at a ``hot`` resident's engine (:func:`look_serving`)."""

    asleep: bool | None = None
    """Asleep on its own and waking on the next request (llama.cpp's idle sleep, a
    router's ``sleeping`` model): shown, still serving. ``None``: it cannot say."""
    problem: NotServing | None = None
    """Set when the engine does not serve: the resident must be unpublished."""
    detail: str = ""


ServingProbe = Callable[[Registry, Resident, float], Awaitable[ServingLook]]
"""``(registry, resident, http_s)`` → what the engine shows now."""


async def look_serving(registry: Registry, resident: Resident, http_s: float) -> ServingLook:
    """Health, served id (the publication check without ``metricsMustMatch``: a fact of
    the engine as started, checked at verify-up), then the sleep state, never waking it:
    ``/props`` ``is_sleeping`` (llama.cpp: asleep is shown, still serving), else vLLM's
    ``/is_sleeping`` (asleep is not serving); a router model's status in ``GET /models``."""
    if resident.endpoint is None:
        return ServingLook()  # nothing to probe: the unit's state is all there is
    model = model_of(registry, resident)
    if model is None:
        return ServingLook()  # left the registry: the reload's reconcile decides
    config = config_of(registry, resident)
    expect = replace(verify.expectation(model, config), can_sleep=False)
    verdict = await verify.check(resident.endpoint, expect, http_s)
    if verdict.is_wrong_engine:
        return ServingLook(problem=NotServing.WRONG_ID, detail=verdict.detail)
    if not verdict.ok:
        return ServingLook(problem=NotServing.GONE, detail=verdict.detail)
    if router.is_router_config(config):
        return ServingLook(asleep=await engine_asleep(registry, resident, http_s))
    state = await engines.sleep_state(resident.endpoint, http_s)
    problem = _unwaking(resident.endpoint, state)
    if problem is not None:
        return ServingLook(problem=NotServing.ASLEEP, detail=problem)
    return ServingLook(asleep=None if state is None else state.asleep)


async def asleep_unwaking(endpoint: str, http_s: float) -> str | None:
    """Why the engine does not serve when it sleeps the way no request undoes (vLLM's
    ``POST /sleep``, seen in ``/is_sleeping``); ``None`` when it is awake, sleeps on its
    own (llama.cpp ``/props``), or cannot say."""
    return _unwaking(endpoint, await engines.sleep_state(endpoint, http_s))


def _unwaking(endpoint: str, state: engines.SleepState | None) -> str | None:
    if state is None or not state.asleep or state.source == "props":
        return None
    return f"{endpoint} is asleep ({state.why_asleep()}): it does not wake on a request"


COLLAPSE_FRACTION = 0.25
"""A resident's processes holding at most this share of what they held at the last
re-check have had their memory collapse (a sleep, an unload, a crash)."""
MIN_TRACKED_MIB = 16.0
"""Below this a collapse is noise (a CPU resident's reading lists no processes)."""
CONFIRM_GONE_S = 0.5
MEMORY_TICK_S = 1.0
"""How often the probe alone is read between two re-checks (cheap: no engine is asked);
a collapse of a ``hot`` resident's memory is a sign of change that re-checks at once."""
"""An engine that does not answer is asked once more after this pause before it is
unpublished: one slow ``/health`` under load is not a crash."""


def held_mib(
    readings: Mapping[str, DeviceReading], device: str, pids: Sequence[int]
) -> float | None:
    """The memory ``pids`` hold on ``device`` in the probe's reading; ``None`` when the
    probe cannot say (no reading, device absent, no PIDs known)."""
    reading = readings.get(device)
    if reading is None or reading.source is ProbeSource.ABSENT or not pids:
        return None
    wanted = set(pids)
    return sum(p.used_mib for p in reading.processes if p.pid in wanted)


def memory_collapsed(before: float | None, now: float | None) -> bool:
    """The probe's memory of a resident fell from a real figure to a quarter or less."""
    if before is None or now is None or before < MIN_TRACKED_MIB:
        return False
    return now <= before * COLLAPSE_FRACTION


@dataclass(frozen=True)
class ServingDecision:
    """What the re-check does with one ``hot`` resident (:func:`decide_serving`)."""

    unpublish: NotServing | None
    detail: str
    asleep: bool
    """The ``asleep`` flag to show while it stays published."""


def decide_serving(current: Resident, look: ServingLook, collapsed: bool) -> ServingDecision:
    """Unpublish on any problem the engine shows; on a memory collapse only when the engine
    cannot say it sleeps (one that says it is awake is kept: its answer is newer than the
    probe's reading, and the next round looks again); otherwise keep it published, with
    ``asleep`` as the engine says (as shown when it cannot say)."""
    if look.problem is not None:
        return ServingDecision(look.problem, look.detail, False)
    if collapsed and look.asleep is None:
        return ServingDecision(
            NotServing.MEMORY_GONE,
            "its processes hold a quarter or less of the memory they held at the last "
            "re-check, and its engine answers neither /props nor /is_sleeping",
            False,
        )
    return ServingDecision(None, "", current.asleep if look.asleep is None else look.asleep)


PidsOf = Callable[[Resident], Awaitable[Sequence[int]]]
"""The PIDs whose memory is a resident's (its unit's processes)."""


async def main_pid_only(resident: Resident) -> Sequence[int]:
    return [resident.main_pid] if resident.main_pid else []


def _from_asleep_probe(probe: AsleepProbe) -> ServingProbe:
    async def look(registry: Registry, resident: Resident, http_s: float) -> ServingLook:
        return ServingLook(asleep=await probe(registry, resident, http_s))

    return look


class SleepWatch:
    """Serving means serving, continuously: re-checks every ``hot`` resident's engine.

    Every ``every_s`` (and at once on :meth:`poke`, a sign of change: its unit changed, or
    the probe, read alone every ``memory_tick_s``, shows its memory collapsed)
    each ``hot`` resident is looked at (:func:`look_serving`: health, served id, sleep
    state, never ``/slots``) and its processes' memory read from the probe. A resident
    whose engine is asleep the way no request undoes, does not answer (asked twice),
    serves another id, or whose memory collapsed while the engine cannot say it sleeps is
    **unpublished at once**: published ``warming`` (admits park ``warming``), a
    ``not_serving`` alert says why, and ``on_unpublished`` hands it to its publisher,
    which verifies it again and re-publishes it ``hot`` once it serves (the alert is then
    updated to say so). An engine that sleeps on its own and wakes on the next request
    (llama.cpp ``--sleep-idle-seconds``, a router's ``sleeping`` model) stays ``hot`` and is
    shown ``asleep`` (docs/placement-rules.md §4.2, "Asleep is not paused"; "Serving is
    re-checked"). A resident that is not ``hot`` is not asked; a stale ``asleep`` on one is
    cleared. ``probe`` (an asleep-only probe) is the older, narrower look, kept for tests.
    """

    def __init__(
        self,
        host: ResidentSink,
        *,
        every_s: float = SLEEP_CHECK_S,
        http_s: float = engines.PROBE_TIMEOUT_S,
        probe: AsleepProbe | None = None,
        look: ServingProbe | None = None,
        publish: Callable[[Resident], None] | None = None,
        on_unpublished: Callable[[Resident], None] | None = None,
        pids_of: PidsOf = main_pid_only,
        confirm_s: float = CONFIRM_GONE_S,
        memory_tick_s: float = MEMORY_TICK_S,
    ) -> None:
        self.host = host
        self.memory_tick_s = memory_tick_s
        self.every_s = every_s
        self.http_s = http_s
        self.confirm_s = min(confirm_s, every_s)
        self._look = look or (_from_asleep_probe(probe) if probe is not None else look_serving)
        self._publish = publish or host.put_resident
        self._on_unpublished = on_unpublished
        self._pids_of = pids_of
        self._held: dict[ResidentKey, float] = {}
        """Each hot resident's memory at the last re-check (for :func:`memory_collapsed`)."""
        self._pids: dict[ResidentKey, tuple[int, ...]] = {}
        """Each hot resident's PIDs at the last re-check (what the memory tick reads)."""
        self._unpublished: dict[ResidentKey, NotServing] = {}
        """Residents this watch unpublished, until they are seen ``hot`` again."""
        self._poked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._memory_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="serving-recheck")
        if self._memory_task is None or self._memory_task.done():
            self._memory_task = asyncio.create_task(self._tick(), name="serving-memory")

    def use_period(self, every_s: float) -> None:
        """A new cadence (SIGHUP re-read the timeouts file), from the next round on."""
        self.every_s = every_s
        self.confirm_s = min(CONFIRM_GONE_S, every_s)
        self.poke()

    def poke(self) -> None:
        """Re-check now rather than at the next period (a sign of change)."""
        self._poked.set()

    async def close(self) -> None:
        tasks = [t for t in (self._task, self._memory_task) if t is not None]
        self._task = self._memory_task = None
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.memory_tick_s)
            if self.memory_tick_s >= self.every_s:
                continue  # the re-checks come as often: nothing to add
            try:
                if await self.memory_sign():
                    self.poke()
            except Exception:  # the probe is advisory here: the next round looks anyway
                log.exception("reading the probe between two re-checks failed")

    async def memory_sign(self) -> bool:
        """Whether the probe shows a ``hot`` resident's memory collapsed since its last
        re-check (its PIDs then, read now); nothing is asked of the engines."""
        baselines = {
            key: (self._held[key], self._pids[key])
            for r in self.host.residents()
            if r.state is ResidentState.HOT
            and (key := resident_key(r)) in self._held
            and key in self._pids
        }
        if not baselines:
            return False
        readings = await self.host.read_devices()
        return any(
            memory_collapsed(before, held_mib(readings, key[2], pids))
            for key, (before, pids) in baselines.items()
        )

    async def _run(self) -> None:
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for can lose a cancel
            # that lands as the event is set (cpython gh-86296), and close() then waits
            # for this loop forever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.every_s):
                    await self._poked.wait()
            self._poked.clear()
            try:
                await self.check_once()
            except Exception:  # one bad round must not end the watch
                log.exception("re-checking the serving engines failed")

    async def check_once(self) -> list[Resident]:
        """Look at every ``hot`` resident's engine once; the residents published anew."""
        registry = self.host.registry()
        asked = [r for r in self.host.residents() if r.state is ResidentState.HOT]
        held = await self._memory(asked)  # before the look: a fall seen here is older
        looks = await asyncio.gather(*(self._look(registry, r, self.http_s) for r in asked))
        seen = {resident_key(r): look for r, look in zip(asked, looks, strict=True)}
        await self._confirm_gone(registry, asked, seen)
        changed: list[Resident] = []
        for current in list(self.host.residents()):  # as they are now, after the awaits
            key = resident_key(current)
            if current.state is not ResidentState.HOT:
                if current.asleep:  # a flag only a serving resident carries
                    changed.append(self._show(current, asleep=False))
                continue
            self._served_again(current)
            look = seen.get(key)
            if look is None:
                continue
            collapsed = memory_collapsed(self._held.get(key), held.get(key))
            if key in held:
                self._held[key] = held[key]
            decision = decide_serving(current, look, collapsed)
            if decision.unpublish is not None:
                changed.append(self._unpublish(current, decision))
            elif decision.asleep != current.asleep:
                changed.append(self._show(current, asleep=decision.asleep))
            if collapsed and decision.unpublish is None and not decision.asleep:
                log.warning(
                    "%s on %s: the probe shows its memory collapsed but its engine says it "
                    "serves awake; kept published, looked at again next round",
                    current.signature,
                    current.device,
                )
        return changed

    async def _memory(self, residents: Sequence[Resident]) -> dict[ResidentKey, float]:
        if not residents:
            return {}
        try:
            readings = await self.host.read_devices()
        except Exception as err:  # the probe is advisory here: the engines decide
            log.warning("serving re-check: cannot read the devices: %s", err)
            return {}
        held: dict[ResidentKey, float] = {}
        for resident in residents:
            pids = tuple(await self._pids_of(resident))
            self._pids[resident_key(resident)] = pids
            mib = held_mib(readings, resident.device, pids)
            if mib is not None:
                held[resident_key(resident)] = mib
        return held

    async def _confirm_gone(
        self, registry: Registry, asked: Sequence[Resident], seen: dict[ResidentKey, ServingLook]
    ) -> None:
        gone = [r for r in asked if seen[resident_key(r)].problem is NotServing.GONE]
        if not gone:
            return
        await asyncio.sleep(self.confirm_s)
        again = await asyncio.gather(*(self._look(registry, r, self.http_s) for r in gone))
        for resident, look in zip(gone, again, strict=True):
            seen[resident_key(resident)] = look

    def _show(self, current: Resident, *, asleep: bool) -> Resident:
        updated = replace(current, asleep=asleep)
        if current.state is ResidentState.HOT:
            log.info(
                "%s on %s: its engine %s",
                current.signature,
                current.device,
                "sleeps (shown asleep; still hot, it wakes on the next request)"
                if asleep
                else "is awake",
            )
        self._publish(updated)
        return updated

    def _unpublish(self, current: Resident, decision: ServingDecision) -> Resident:
        assert decision.unpublish is not None
        key = resident_key(current)
        updated = replace(current, state=ResidentState.WARMING, asleep=False)
        self._publish(updated)
        self._held.pop(key, None)
        self._unpublished[key] = decision.unpublish
        why = NOT_SERVING_TEXT[decision.unpublish]
        message = (
            f"{current.signature} on {current.device} is no longer published: {why} "
            f"({decision.detail}); admits for it park `warming` until its engine passes "
            "verify-up again, then it is re-published hot"
        )
        log.warning("%s", message)
        self.host.alert_board.raise_alert(
            AlertKind.NOT_SERVING,
            Severity.WARNING,
            _subject(current),
            message,
            {
                "model": current.model,
                "config": current.config,
                "device": current.device,
                "endpoint": current.endpoint,
                "unit": current.unit,
                "problem": decision.unpublish.value,
                "published": False,
            },
        )
        if self._on_unpublished is not None:
            self._on_unpublished(updated)
        return updated

    def _served_again(self, current: Resident) -> None:
        problem = self._unpublished.pop(resident_key(current), None)
        if problem is None:
            return
        message = (
            f"{current.signature} on {current.device} serves again: re-published hot after "
            f"it passed verify-up (it had been unpublished: {NOT_SERVING_TEXT[problem]})"
        )
        log.info("%s", message)
        self.host.alert_board.raise_alert(
            AlertKind.NOT_SERVING,
            Severity.INFO,
            _subject(current),
            message,
            {
                "model": current.model,
                "config": current.config,
                "device": current.device,
                "unit": current.unit,
                "problem": problem.value,
                "published": True,
            },
        )


def _subject(resident: Resident) -> str:
    return resident.unit or resident.signature
