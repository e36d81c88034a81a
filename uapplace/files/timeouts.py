"""How long each enforcement step may wait: the operator's file, the measured envelope.

Timeouts (:class:`Timeouts`) are **unvalidated defaults** (docs/placement-rules.md §4.3,
"Timeouts before an envelope is measured"): conservative guesses until a
planned switch on the real machine measures the envelope. Override any of them
in ``$UAP_HOME/enforcement-timeouts.json`` (:meth:`Timeouts.load`). The
verify-up wait comes from facts where the registry has them
(:meth:`Timeouts.verify_up_bound`): a config's measured start time beats the
operator's per-config bound, which beats the global value. Once ``uapplace measure
--envelope`` has measured a config's envelope (:class:`~uapplace.core.model.Envelope`),
drain, verify-free and verify-up derive from it: a documented multiple of the
measured figure plus a floor (:meth:`Timeouts.drain_bound`,
:meth:`Timeouts.verify_free_bound`, :meth:`Timeouts.verify_up_bound`,
:meth:`Timeouts.wake_bound`); each step's detail names the bound it used and why.
Without an envelope, the bounded defaults.

Read by :mod:`uapplace.daemon.wiring` at start-up; used by every enforcement step module,
the start-up repair and the measurer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from uapplace.core.model import (
    Config,
    Envelope,
)
from uapplace.core.validation import first_error
from uapplace.files.jsonfile import ConfigFileError, read_json

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------- timeouts


@dataclass(frozen=True)
class Timeouts:
    """Every wait of the sequence, in seconds. **Unvalidated defaults**: nobody has
    measured this machine's teardown/start envelope yet (docs/placement-rules.md §4.3, §4.6)."""

    drain_s: float = 60.0
    """How long in-flight work and holds may take to finish before rolling back."""
    drain_poll_s: float = 0.25
    """Pause between two in-flight checks (≤ 250 ms)."""
    forward_lease_s: float = 0.3
    """How long after answering ``forward`` for a victim the drain still counts that request
    as in flight (issue 20): the proxy registers it in its in-flight list only once it sends
    it, so for this long after an answer its list may not show it yet
    (docs/placement-rules.md §4.6, "Forward leases")."""
    stop_s: float = 90.0
    """A stop job's deadline (systemd's own ``TimeoutStopSec`` default)."""
    verify_free_s: float = 15.0
    """How long freed memory may take to show in the probe after the stop."""
    verify_free_poll_s: float = 0.05
    """The longest pause between two probe reads in verify-free: they start at 10 ms and
    slow down with the wait to this (``publish.verify.backoff``, issue 23)."""
    start_s: float = 90.0
    """The start job's deadline (``Type=simple`` units finish it at fork)."""
    verify_up_s: float = 120.0
    """Load time when the config records no start facts: from the start job until
    ``/health`` is 200. 120 s, not the former 600 s: an engine that never turns healthy
    held the device for ten minutes. A config slower than this records ``start_s``
    (measured) or ``start_timeout_s`` (the operator's bound); see :meth:`verify_up_bound`."""
    health_first_poll_s: float = 0.01
    health_max_poll_s: float = 0.05
    """The pause between ``/health`` polls: 10 ms at first, then a tenth of the time
    waited so far, up to this (``publish.verify.backoff``): a local GET is cheap, and
    every 50 ms of pause is up to 50 ms added to a swap (issue 23: capped at 100 ms a
    fake-engine swap took 1.043× the shell's, at 50 ms 1.005×); an engine loading for
    half a second or more is asked 20 times a second, which does not slow it."""
    http_s: float = 2.0
    """One engine probe (``/health``, ``/v1/models``, ``/metrics``)."""
    rollback_up_s: float = 120.0
    """How long a restarted victim may take to turn healthy again when its config has no
    start facts (otherwise the victim's own :meth:`verify_up_bound`)."""
    measured_start_multiple: float = 3.0
    measured_start_margin_s: float = 5.0
    measured_start_floor_s: float = 10.0
    """With a measured cold start (the envelope's ``cold_start_s``, else ``start_s``),
    verify-up waits ``max(floor, multiple × start + margin)``: three times what this
    machine took, plus a margin for a cold page cache, never under 10 s (a 1 s engine
    gets 10 s). A waking victim's bound is the same formula over its measured ``wake_s``."""
    verify_free_multiple: float = 3.0
    verify_free_margin_s: float = 2.0
    verify_free_floor_s: float = 5.0
    """With every victim's envelope, verify-free waits ``max(floor, multiple × release +
    margin)``, ``release`` the longest victim's ``free_s − stop_s`` (how long its memory
    took to show in the probe after the stop job ended): a driver that frees lazily is
    waited on, an orphan is named after seconds, not after the blind 15 s."""
    drain_multiple: float = 2.0
    drain_floor_s: float = 30.0
    """With the envelopes of the victims and of the config that starts, drain waits
    ``max(floor, multiple × switch)``, ``switch`` = Σ victims' ``stop_s`` + the new
    config's cold start: what the operator already accepted to wait for the switch. Past
    twice that, waiting on in-flight work costs more than the switch itself; roll back."""
    serving_check_s: float = 5.0
    """How often every ``hot`` resident is re-checked while it serves (health, served id,
    sleep state, the probe's memory; docs/placement-rules.md §4.2, "Serving is
    re-checked"). One that stopped serving is unpublished within
    :meth:`serving_bound_s` of the change."""

    def serving_bound_s(self) -> float:
        """The longest a ``hot`` resident that stopped serving stays published: one period,
        a look that times out (``http_s`` per route: health, served ids, sleep state) and
        the second look a silent engine gets (``CONFIRM_GONE_S`` plus another look)."""
        look = 3 * self.http_s
        return self.serving_check_s + look + min(0.5, self.serving_check_s) + look

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"Timeouts.{item.name}: must be a positive number, got {value!r}")

    @classmethod
    def load(cls, path: Path | None) -> Timeouts:
        """Defaults, overridden by the JSON object in ``path`` when that file exists.

        Raises :class:`~uapplace.files.jsonfile.ConfigFileError` naming the file and key
        for a bad file (unknown key, not a positive number).
        """
        if path is None or not path.exists():
            return cls()
        raw = read_json(path, trusted=True)
        try:
            doc = _TimeoutsDoc.model_validate(raw)
        except ValidationError as err:
            first = first_error(err)
            where = "$" + first.where(part=".{}", sep="")
            raise ConfigFileError(path, where, first.msg) from None
        return cls(**doc.model_dump(exclude_none=True))

    def to_json(self) -> dict[str, float]:
        return {item.name: getattr(self, item.name) for item in fields(self)}

    def verify_up_bound(self, label: str, config: Config | None, fallback: float) -> UpBound:
        """How long an engine of ``config`` may take to turn healthy, and why that long.

        Precedence (most specific fact first):

        1. the config's measured envelope ``cold_start_s``, then its measured cold start
           ``start_s`` (counted only when its figures count on this machine,
           ``Config.untrusted`` empty):
           ``max(measured_start_floor_s, measured_start_multiple × start +
           measured_start_margin_s)``;
        2. the config's ``start_timeout_s``, the operator's explicit bound;
        3. ``fallback``: :attr:`verify_up_s` for a new resident, :attr:`rollback_up_s`
           for a restarted victim (the defaults, or what
           ``enforcement-timeouts.json`` says: the file overrides the defaults, never
           a config's own facts).

        ``label`` (``model/config``) only names the config in :attr:`UpBound.source`.
        """
        envelope = _counted_envelope(config)
        if envelope is not None:
            return self._measured(label, "envelope cold start", envelope.cold_start_s)
        if config is not None and config.start_s is not None and not config.untrusted:
            derived = self.measured_start_multiple * config.start_s + self.measured_start_margin_s
            seconds = max(self.measured_start_floor_s, derived)
            start = f"{config.start_s:g}s"
            source = (
                f"{label} measured start {start}: max({self.measured_start_floor_s:g}s, "
                f"{self.measured_start_multiple:g} × {start} + {self.measured_start_margin_s:g}s)"
            )
            return UpBound(seconds, source)
        if config is not None and config.start_timeout_s is not None:
            return UpBound(config.start_timeout_s, f"start_timeout_s of {label}")
        return UpBound(fallback, f"default: {label} records no start_s or start_timeout_s")

    def _measured(self, label: str, what: str, seconds: float) -> UpBound:
        derived = self.measured_start_multiple * seconds + self.measured_start_margin_s
        bound = max(self.measured_start_floor_s, derived)
        taken = f"{seconds:g}s"
        source = (
            f"{label} {what} {taken}: max({self.measured_start_floor_s:g}s, "
            f"{self.measured_start_multiple:g} × {taken} + {self.measured_start_margin_s:g}s)"
        )
        return UpBound(bound, source)

    def wake_bound(self, label: str, config: Config | None, fallback: float) -> UpBound:
        """How long a paused engine of ``config`` may take to wake and serve again: the
        verify-up formula over its measured ``wake_s``; ``fallback`` without one."""
        envelope = _counted_envelope(config)
        if envelope is not None and envelope.wake_s is not None:
            return self._measured(label, "measured wake", envelope.wake_s)
        return UpBound(fallback, f"default: {label} has no measured wake_s")

    def verify_free_bound(self, victims: Sequence[tuple[str, Config | None]]) -> UpBound:
        """How long freed memory may take to show in the probe after the stops
        (:attr:`verify_free_multiple`); :attr:`verify_free_s` unless every victim has an
        envelope that counts here."""
        if not victims:
            return UpBound(self.verify_free_s, "default: no victims")
        releases: list[tuple[float, str]] = []
        for label, config in victims:
            envelope = _counted_envelope(config)
            if envelope is None:
                return UpBound(self.verify_free_s, f"default: {label} has no measured envelope")
            releases.append((max(0.0, envelope.free_s - envelope.stop_s), label))
        release, label = max(releases)
        derived = self.verify_free_multiple * release + self.verify_free_margin_s
        source = (
            f"{label} memory back {release:g}s after its stop: max("
            f"{self.verify_free_floor_s:g}s, {self.verify_free_multiple:g} × {release:g}s + "
            f"{self.verify_free_margin_s:g}s)"
        )
        return UpBound(max(self.verify_free_floor_s, derived), source)

    def drain_bound(
        self,
        starting: tuple[str, Config | None] | None,
        victims: Sequence[tuple[str, Config | None]],
    ) -> UpBound:
        """How long to wait for the victims' in-flight work (:attr:`drain_multiple`);
        :attr:`drain_s` unless the victims and the config that starts (``starting``,
        ``None`` for an unload) all have envelopes that count here."""
        switch = 0.0
        parts: list[str] = []
        for label, config in victims:
            envelope = _counted_envelope(config)
            if envelope is None:
                return UpBound(self.drain_s, f"default: {label} has no measured envelope")
            switch += envelope.stop_s
            parts.append(f"stop {label} {envelope.stop_s:g}s")
        if starting is not None:
            label, config = starting
            envelope = _counted_envelope(config)
            if envelope is None:
                return UpBound(self.drain_s, f"default: {label} has no measured envelope")
            switch += envelope.cold_start_s
            parts.append(f"start {label} {envelope.cold_start_s:g}s")
        derived = max(self.drain_floor_s, self.drain_multiple * switch)
        source = (
            f"switch {switch:g}s ({' + '.join(parts) or 'nothing'}): max("
            f"{self.drain_floor_s:g}s, {self.drain_multiple:g} × {switch:g}s)"
        )
        return UpBound(derived, source)


def _counted_envelope(config: Config | None) -> Envelope | None:
    """The config's envelope when its figures count on this machine (``untrusted`` empty)."""
    if config is None or config.untrusted:
        return None
    return config.envelope


@dataclass(frozen=True)
class UpBound:
    """A verify-up wait and where it came from (shown in the step detail)."""

    seconds: float
    source: str

    def text(self) -> str:
        return f"bound {self.seconds:g}s ({self.source})"


MAX_WAIT_S = 86_400.0
"""A day: the most any wait of the file may say (docs/placement-rules.md §4.7)."""
MAX_POLL_S = 10.0
MAX_MULTIPLE = 100.0
MAX_LEASE_S = 10.0
"""A forward lease longer than this would hold every drain for nothing."""

_Wait = Annotated[float, Field(gt=0, le=MAX_WAIT_S)]
_Poll = Annotated[float, Field(gt=0, le=MAX_POLL_S)]
_Multiple = Annotated[float, Field(ge=1, le=MAX_MULTIPLE)]


class _TimeoutsDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    drain_s: _Wait | None = None
    drain_poll_s: float | None = Field(default=None, gt=0, le=0.25)
    forward_lease_s: float | None = Field(default=None, gt=0, le=MAX_LEASE_S)
    stop_s: _Wait | None = None
    verify_free_s: _Wait | None = None
    verify_free_poll_s: _Poll | None = None
    start_s: _Wait | None = None
    verify_up_s: _Wait | None = None
    health_first_poll_s: float | None = Field(default=None, gt=0, le=0.05)
    health_max_poll_s: _Poll | None = None
    http_s: float | None = Field(default=None, gt=0, le=60.0)
    rollback_up_s: _Wait | None = None
    measured_start_multiple: _Multiple | None = None
    measured_start_margin_s: _Wait | None = None
    measured_start_floor_s: _Wait | None = None
    verify_free_multiple: _Multiple | None = None
    verify_free_margin_s: _Wait | None = None
    verify_free_floor_s: _Wait | None = None
    drain_multiple: _Multiple | None = None
    drain_floor_s: _Wait | None = None
    serving_check_s: float | None = Field(default=None, gt=0, le=60.0)
