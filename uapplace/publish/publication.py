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
serves: an engine that sleeps on its own (llama.cpp ``--sleep-idle-seconds``) is shown
``asleep`` (docs/placement-rules.md §4.2, "Asleep is not paused"). Both publishers run
one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import replace
from typing import Protocol

from uapplace.core.alerts import AlertBoard, AlertKind, Severity
from uapplace.core.model import (
    DeviceReading,
    Model,
    Registry,
    Resident,
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
"""How often each ``hot`` resident's engine is asked whether it sleeps (:class:`SleepWatch`)."""


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
) -> Resident | None:
    """Check ``resident``'s engine until it passes; the resident to publish, or ``None``.

    ``current()`` is the resident as it is now (``None`` once it is gone or taken
    over: the loop ends). While the engine is loading the pause grows from
    ``first_poll_s`` to ``max_poll_s``; while it serves the wrong id or breaks
    ``metricsMustMatch`` a ``wrong_model`` alert (subject ``subject``) is raised
    once per distinct problem and the pause grows from
    :data:`WRONG_ENGINE_FIRST_S` to :data:`WRONG_ENGINE_MAX_S`.
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
            SleepWatch(host, every_s=sleep_check_s, http_s=http_s)
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

    async def _until_verified(self, resident: Resident) -> None:
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


# --------------------------------------------------------------------------- asleep

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


class SleepWatch:
    """Shows a ``hot`` resident ``asleep`` while its engine sleeps on its own.

    Every ``every_s`` each ``hot`` resident's engine is asked (:func:`engine_asleep`,
    which never wakes it), and a resident whose answer differs from what is published is
    published again with ``asleep`` set or cleared; an engine that cannot say leaves it
    as it is. A resident that is not ``hot`` is not asked, and a stale ``asleep`` on one
    is cleared. Only the flag changes: asleep is not a state (docs/placement-rules.md
    §4.2), the resident stays ``hot`` and admission keeps forwarding to it, since
    llama.cpp wakes on the next request; the planner keeps counting its measured
    footprint (§4.4).
    """

    def __init__(
        self,
        host: ResidentSink,
        *,
        every_s: float = SLEEP_CHECK_S,
        http_s: float = engines.PROBE_TIMEOUT_S,
        probe: AsleepProbe = engine_asleep,
        publish: Callable[[Resident], None] | None = None,
    ) -> None:
        self.host = host
        self.every_s = every_s
        self.http_s = http_s
        self._probe = probe
        self._publish = publish or host.put_resident
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="sleep-watch")

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                await self.check_once()
            except Exception:  # one bad round must not end the watch
                log.exception("checking whether the engines sleep failed")

    async def check_once(self) -> list[Resident]:
        """Ask every ``hot`` resident's engine once; the residents published anew."""
        registry = self.host.registry()
        asked = [r for r in self.host.residents() if r.state is ResidentState.HOT]
        answers = await asyncio.gather(*(self._probe(registry, r, self.http_s) for r in asked))
        said = {resident_key(r): a for r, a in zip(asked, answers, strict=True)}
        changed: list[Resident] = []
        for current in list(self.host.residents()):  # as they are now, after the awaits
            if current.state is not ResidentState.HOT:
                asleep: bool | None = False  # a flag only a serving resident carries
            else:
                asleep = said.get(resident_key(current))
            if asleep is None or asleep == current.asleep:
                continue
            updated = replace(current, asleep=asleep)
            log.info(
                "%s on %s: its engine %s",
                current.signature,
                current.device,
                "sleeps (shown asleep; still hot, it wakes on the next request)"
                if asleep
                else "is awake",
            )
            self._publish(updated)
            changed.append(updated)
        return changed
