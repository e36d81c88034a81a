"""Standing consent, part one: the auto-resolution policy (spec §4.4.1).

The policy file ``$UAP_HOME/placement-auto.json`` (``UAP_PLACEMENT_AUTO``)::

    {"enabled": true, "allow_displace": ["qwen3.8-27b"],
     "unload_idle_after_secs": 900, "unload_allow": ["qwen3.8-27b"]}

**Fail-closed.** A missing file, a file that is not a JSON object, or an
``enabled`` that is not literally ``true`` means auto is off: every park waits
for the operator. Each other knob that is invalid is dropped on its own (and
reported, naming the file and the field); the rest still applies. The file is
re-read whenever its stat (inode, size, mtime, ctime) changes, so an edit takes
effect without a restart. A save spreads the edited knobs over the document as
read (unknown keys and untouched knobs survive), and is atomic (tmp + fsync +
rename) with mode 0600.

**What the allowlists mean.** ``allow_displace`` names *requested* models: "to
load this model, uapplaced may stop other residents unattended". Consent is
about what the operator wants loaded; the planner, not the operator, picks the
victims (the minimal set, never a held resident), so a victim-side list could
not be given meaningfully ahead of time. ``unload_allow`` names the residents
the idle sweep (``idle.py``) may stop. Both are recorded only with consent
(``--yes`` / ``consent=true``), because what they record is consent to stop a
model with nobody watching.

:class:`AutoRunner` turns a new park into at most one unattended enforcement
per requested model, single-flight machine-wide; see its docstring.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from pydantic import StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError

from uapplace import jsonfile
from uapplace.errors import Failed, InvalidArgument
from uapplace.jsonfile import ConfigFileError, atomic_write
from uapplace.model import (
    Option,
    OptionKind,
    ParkReason,
    PendingEntry,
    Plan,
    PreviewReason,
    Registry,
)

log = logging.getLogger(__name__)

MIN_IDLE_WINDOW_S = 60
"""Spec §4.4.2: under a minute the sweep would oscillate (unload, auto-load, unload)."""
COOLDOWN_S = 600.0
"""After a failed unattended run (load or unload), automation leaves the model alone this long."""
MAX_SCHEDULED_RUNS = 2
"""Auto runs that may exist at once, the running one included (spec: AUTO_MAX_CONCURRENT_RUNS)."""
ENVELOPE_MARGIN_S = 30.0
"""Added to the enforcement envelope when extending a pending entry's expiry."""
DEFAULT_ENVELOPE_S = 60.0 + 90.0 + 15.0 + 90.0 + 600.0
"""drain + stop + verify-free + start + verify-up, the enforcer's default timeouts."""

KNOBS = ("enabled", "allow_displace", "unload_idle_after_secs", "unload_allow")
CHANGE_KEYS = frozenset(
    {
        "enable",
        "disable",
        "allow_displace",
        "disallow_displace",
        "allow_unload",
        "disallow_unload",
        "unload_idle_after_secs",
    }
)
NEVER_AUTO = frozenset(
    {
        ParkReason.UNKNOWN_MODEL,
        ParkReason.NO_MEASURED_CONFIG,
        ParkReason.INVALID_REQUEST,
        ParkReason.WARMING,
    }
)
"""Parks with nothing to enforce: their reason always stands (a ``warming`` resident
publishes itself once verify-up passes)."""
_NON_DISPLACING = frozenset({OptionKind.REUSE, OptionKind.LOAD_ALONGSIDE})

_BOOL: TypeAdapter[bool] = TypeAdapter(StrictBool)
_NAMES: TypeAdapter[list[str]] = TypeAdapter(list[StrictStr])
_SECONDS: TypeAdapter[int | None] = TypeAdapter(StrictInt | None)


# --------------------------------------------------------------------------- the policy


@dataclass(frozen=True)
class AutoPolicy:
    """The policy in force. The default is everything off."""

    enabled: bool = False
    allow_displace: tuple[str, ...] = ()
    unload_idle_after_secs: int | None = None
    """As written; ``None`` (or 0 in the file) is off. See :attr:`idle_window_s`."""
    unload_allow: tuple[str, ...] = ()
    document: Mapping[str, Any] = field(default_factory=dict)
    """The file's JSON object as read: a save spreads the edited knobs over it."""

    @property
    def idle_window_s(self) -> int | None:
        """The idle sweep's window: the knob floored at 60 s, or ``None`` when off."""
        if not self.unload_idle_after_secs:
            return None
        return max(MIN_IDLE_WINDOW_S, self.unload_idle_after_secs)

    def may_displace_for(self, model: str) -> bool:
        return self.enabled and model in self.allow_displace

    def may_unload(self, model: str) -> bool:
        return self.idle_window_s is not None and model in self.unload_allow

    def to_file_json(self) -> dict[str, Any]:
        """What a save writes: every knob present, other keys of the file kept."""
        defaults: dict[str, Any] = {
            "enabled": False,
            "allow_displace": [],
            "unload_idle_after_secs": None,
            "unload_allow": [],
        }
        return {**defaults, **self.document}

    def to_json(self) -> dict[str, Any]:
        """The knobs in force (invalid ones already dropped)."""
        return {
            "enabled": self.enabled,
            "allow_displace": list(self.allow_displace),
            "unload_idle_after_secs": self.unload_idle_after_secs,
            "idle_window_secs": self.idle_window_s,
            "unload_allow": list(self.unload_allow),
        }


def _problem(err: ValidationError) -> str:
    first = err.errors(include_url=False)[0]
    where = "".join(f"[{p}]" for p in first["loc"])
    return f"{where + ': ' if where else ''}{first['msg']}, got {json.dumps(first['input'])}"


def _unique(names: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(names))


def policy_from_document(document: Mapping[str, Any], source: str) -> tuple[AutoPolicy, list[str]]:
    """A parsed JSON object → the policy, dropping each invalid knob alone with a finding."""
    findings: list[str] = []

    def invalid(knob: str, why: str, effect: str) -> None:
        findings.append(f"{source}: {knob}: {why}; ignored ({effect})")

    enabled = False
    if "enabled" in document:
        try:
            enabled = _BOOL.validate_python(document["enabled"])
        except ValidationError as err:
            invalid("enabled", f"must be true or false: {_problem(err)}", "auto is off")
    lists: dict[str, tuple[str, ...]] = {}
    for knob, effect in (
        ("allow_displace", "no model is loaded by displacement unattended"),
        ("unload_allow", "the idle sweep unloads nothing"),
    ):
        lists[knob] = ()
        if document.get(knob) is None:
            continue
        try:
            lists[knob] = _unique(_NAMES.validate_python(document[knob]))
        except ValidationError as err:
            invalid(knob, f"must be a list of model keys: {_problem(err)}", effect)
    seconds: int | None = None
    try:
        seconds = _SECONDS.validate_python(document.get("unload_idle_after_secs"))
    except ValidationError as err:
        invalid("unload_idle_after_secs", f"must be whole seconds or null: {_problem(err)}", "off")
    if seconds is not None and seconds < 0:
        invalid("unload_idle_after_secs", f"must not be negative, got {seconds}", "off")
        seconds = None
    if seconds is not None and 0 < seconds < MIN_IDLE_WINDOW_S:
        findings.append(
            f"{source}: unload_idle_after_secs: {seconds} is under the {MIN_IDLE_WINDOW_S} s "
            f"floor; the sweep uses {MIN_IDLE_WINDOW_S} s"
        )
    findings.extend(
        f"{source}: {key}: unknown key, ignored (the knobs are {', '.join(KNOBS)})"
        for key in document
        if key not in KNOBS
    )
    policy = AutoPolicy(
        enabled=enabled,
        allow_displace=lists["allow_displace"],
        unload_idle_after_secs=seconds or None,
        unload_allow=lists["unload_allow"],
        document=dict(document),
    )
    return policy, findings


def load_policy(path: Path) -> tuple[AutoPolicy, list[str]]:
    """Read the policy file; never raises. Missing → off, no finding; unreadable → off."""
    try:
        raw = jsonfile.read_capped_or_none(path)
        if raw is None:
            return AutoPolicy(), []
        document = jsonfile.parse_json(raw, path)
    except ConfigFileError as err:
        problem = f"{err.json_path}: {err.message}"
        return AutoPolicy(), [f"{path}: not valid JSON ({problem}); auto is off"]
    if not isinstance(document, dict):
        kind = type(document).__name__
        return AutoPolicy(), [f"{path}: expected a JSON object, got {kind}; auto is off"]
    return policy_from_document(document, str(path))


def save_policy(path: Path, policy: AutoPolicy) -> None:
    """Atomic replace, mode 0600; creates ``$UAP_HOME`` (0700) when it is missing."""
    if not path.parent.is_dir():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    text = jsonfile.dumps(policy.to_file_json(), indent=2) + "\n"
    atomic_write(path, text, mode=0o600, sync=True)


# --------------------------------------------------------------------------- edits


class ConsentRequired(InvalidArgument):
    """A change that records standing consent was sent without it; nothing was written."""


def _consent_text(kind: str, models: Sequence[str], window: int | None) -> str:
    names = ", ".join(models)
    if kind == "allow_displace":
        what = (
            f"while auto is enabled, whenever a request for {names} parks and displacement is "
            "the only way to load it, uapplaced may stop (evict) the other models the planner "
            "picks on that device, with nobody watching: their in-flight work gets the drain "
            "timeout, then their context is lost"
        )
        undo = f"--disallow-displace {' '.join(models)}"
    else:
        after = f"{window} s" if window is not None else "the unload_idle_after_secs window"
        what = (
            f"uapplaced may stop {names} with nobody watching once no gated request has reached "
            f"it for {after} and no connection is open to its port"
        )
        undo = f"--disallow-unload {' '.join(models)}"
    return (
        f"{kind}: not recorded. It records standing consent: {what}. "
        f"Re-run with --yes (bus: consent=true) to record it; take it back any time with "
        f"{undo}. Nothing was changed."
    )


def _names(changes: Mapping[str, Any], key: str) -> list[str]:
    value = changes[key]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise InvalidArgument(f"{key}: expected a list of model keys (non-empty strings)")
    return list(dict.fromkeys(value))


def _check_models(registry: Registry, key: str, names: Sequence[str]) -> None:
    for name in names:
        if name in registry.models:
            continue
        resolved = registry.resolve(name)
        if resolved is not None:
            raise InvalidArgument(
                f"{key}: {name!r} is an id of model {resolved[0].key!r}; the allowlists "
                f"name model keys: use {resolved[0].key}"
            )
        known = ", ".join(sorted(registry.models)) or "none"
        raise InvalidArgument(f"{key}: {name!r} is not a model in the registry (models: {known})")


def _check_removable(
    registry: Registry, key: str, names: Sequence[str], listed: Sequence[str]
) -> None:
    # A model since removed from the registry must stay removable from a list.
    stale = [n for n in names if n not in listed]
    if stale:
        _check_models(registry, key, stale)


def _seconds(value: Any) -> int | None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise InvalidArgument(
            "unload_idle_after_secs: expected whole seconds ≥ 0 (0 or null turns the "
            f"idle sweep off), got {json.dumps(value)}"
        )
    return value or None


def apply_changes(
    policy: AutoPolicy, changes: Mapping[str, Any], consent: bool, registry: Registry
) -> AutoPolicy:
    """The shim/bus ``auto`` body applied to ``policy`` (``{}`` returns it unchanged).

    Raises :class:`~uapplace.errors.InvalidArgument` naming the key for a bad body
    or a model not in the registry, and :class:`ConsentRequired` (an
    ``InvalidArgument``) when ``allow_displace``/``allow_unload`` add names
    without ``consent``. Edits only the knobs named; the rest of the document stays.
    """
    unknown = sorted(set(changes) - CHANGE_KEYS)
    if unknown:
        raise InvalidArgument(
            f"unknown key(s) {', '.join(unknown)} (accepted: {', '.join(sorted(CHANGE_KEYS))})"
        )
    for key in ("enable", "disable"):
        if key in changes and changes[key] is not True:
            other = "disable" if key == "enable" else "enable"
            raise InvalidArgument(
                f"{key}: only true is meaningful (to flip it, send {other}: true)"
            )
    if changes.get("enable") and changes.get("disable"):
        raise InvalidArgument("enable and disable: send one of them, not both")
    edits: dict[str, Any] = {}
    if "enable" in changes or "disable" in changes:
        edits["enabled"] = bool(changes.get("enable"))
    if "unload_idle_after_secs" in changes:
        edits["unload_idle_after_secs"] = _seconds(changes["unload_idle_after_secs"])
    seconds = edits.get("unload_idle_after_secs", policy.unload_idle_after_secs)
    window = replace(policy, unload_idle_after_secs=seconds).idle_window_s
    for knob, grant, revoke in (
        ("allow_displace", "allow_displace", "disallow_displace"),
        ("unload_allow", "allow_unload", "disallow_unload"),
    ):
        if grant not in changes and revoke not in changes:
            continue
        current: tuple[str, ...] = getattr(policy, knob)
        added = _names(changes, grant) if grant in changes else []
        removed = _names(changes, revoke) if revoke in changes else []
        both = sorted(set(added) & set(removed))
        if both:
            raise InvalidArgument(f"{grant} and {revoke} both name {', '.join(both)}")
        _check_models(registry, grant, added)
        _check_removable(registry, revoke, removed, current)
        new = [m for m in added if m not in current]
        if new and not consent:
            raise ConsentRequired(_consent_text(grant, new, window))
        edits[knob] = [m for m in (*current, *added) if m not in removed]
        edits[knob] = list(dict.fromkeys(edits[knob]))
    if not edits:
        return policy
    document = {**policy.to_file_json(), **edits}
    updated, _findings = policy_from_document(document, "(edited policy)")
    return updated


# --------------------------------------------------------------------------- the file, live


_StatKey = tuple[int, int, int, int, int]


def _stat_key(path: Path) -> _StatKey | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class PolicyStore:
    """The policy file, re-read when it changes; implements the controller's
    ``AutoPolicyStore`` (``get``/``set``) and feeds :class:`AutoRunner` and the idle sweep.
    """

    def __init__(
        self,
        path: Path,
        registry: Callable[[], Registry],
        describe_runs: Callable[[], Mapping[str, Any]] | None = None,
    ) -> None:
        self.path = path
        self._registry = registry
        self.describe_runs = describe_runs
        """Set by the wiring to add the auto runner's state to the status."""
        self._cached: tuple[_StatKey | None, AutoPolicy, list[str]] | None = None
        self._write_lock = asyncio.Lock()

    def current(self) -> tuple[AutoPolicy, list[str]]:
        """The policy and its findings; blocking (a stat, and a read when it changed)."""
        key = _stat_key(self.path)
        cached = self._cached
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        policy, findings = load_policy(self.path)
        for finding in findings:
            log.warning("auto policy: %s", finding)
        self._cached = (key, policy, findings)
        return policy, findings

    async def refresh(self) -> AutoPolicy:
        """The policy in force now (the stat and any read run in a thread)."""
        policy, _findings = await asyncio.to_thread(self.current)
        return policy

    async def get(self) -> dict[str, Any]:
        policy, findings = await asyncio.to_thread(self.current)
        return self._status(policy, findings)

    async def set(self, changes: Mapping[str, Any], consent: bool) -> dict[str, Any]:
        """Apply the ``auto`` body and save; ``{}`` only reports the status."""
        async with self._write_lock:
            policy, findings = await asyncio.to_thread(self.current)
            if not changes:
                return self._status(policy, findings)
            updated = apply_changes(policy, changes, consent, self._registry())
            if updated != policy:
                try:
                    moved = await asyncio.to_thread(self._save, updated)
                except OSError as err:
                    raise Failed(
                        f"cannot write the auto policy {self.path}: {err.strerror or err}; "
                        "nothing was changed"
                    ) from None
                if moved is not None:
                    log.warning("auto policy: the unreadable file was moved aside to %s", moved)
                log.info("auto policy changed by %s: %s", _change_text(changes), updated.to_json())
            policy, findings = await asyncio.to_thread(self.current)
            return self._status(policy, findings)

    def _save(self, policy: AutoPolicy) -> Path | None:
        """Blocking. A file that did not parse is kept aside (never overwritten unseen)."""
        moved = _move_aside(self.path) if _unparsable(self.path) else None
        save_policy(self.path, policy)
        return moved

    def _status(self, policy: AutoPolicy, findings: list[str]) -> dict[str, Any]:
        registry = self._registry()
        notes = list(findings)
        for knob in ("allow_displace", "unload_allow"):
            notes.extend(
                f"{self.path}: {knob}: {name!r} is not a model in the registry (no effect)"
                for name in getattr(policy, knob)
                if name not in registry.models
            )
        out: dict[str, Any] = {"path": str(self.path), "exists": self.path.exists()}
        out.update(policy.to_json())
        out["findings"] = notes
        if self.describe_runs is not None:
            out["runs"] = dict(self.describe_runs())
        return out


def _change_text(changes: Mapping[str, Any]) -> str:
    return json.dumps(dict(changes), sort_keys=True)


def _unparsable(path: Path) -> bool:
    """The file exists but is not a JSON object: an edit must not silently replace it."""
    try:
        raw = jsonfile.read_capped_or_none(path)
        return raw is not None and not isinstance(jsonfile.parse_json(raw, path), dict)
    except ConfigFileError:
        return True


def _move_aside(path: Path) -> Path:
    return jsonfile.move_aside(path)


# --------------------------------------------------------------------------- the runner


class PendingBook(Protocol):
    """The pending entries (``uapplace.admission.Admission`` is one)."""

    @property
    def pending(self) -> Mapping[str, PendingEntry]: ...

    def get(self, placement_id: str) -> PendingEntry | None: ...

    def replace(self, entry: PendingEntry) -> None: ...


class AutoHost(Protocol):
    """What the runner needs of the controller (``Controller`` has all of it)."""

    @property
    def admission(self) -> PendingBook: ...

    @property
    def cooldowns(self) -> MutableMapping[str, float]:
        """Model → POSIX seconds until which automation leaves it alone (in the ledger)."""
        ...

    def mark_dirty(self, urgent: bool = True) -> None: ...

    def resolve(self, entry: PendingEntry, outcome: str, already_removed: bool = False) -> None: ...


class AutoEnforcer(Protocol):
    """``uapplace.enforce.Enforcer`` (its ``apply`` takes the entry or its id)."""

    async def apply(
        self, entry: PendingEntry, option: int, expected: Sequence[str], *, wait: bool = False
    ) -> Mapping[str, Any]: ...


class PolicySource(Protocol):
    async def refresh(self) -> AutoPolicy: ...


class EnvelopeTimeouts(Protocol):
    """The waits of one enforcement (``uapplace.timeouts.Timeouts`` has them)."""

    @property
    def drain_s(self) -> float: ...
    @property
    def stop_s(self) -> float: ...
    @property
    def verify_free_s(self) -> float: ...
    @property
    def start_s(self) -> float: ...
    @property
    def verify_up_s(self) -> float: ...


def enforcement_envelope_s(timeouts: EnvelopeTimeouts) -> float:
    """drain + stop + verify-free + start + verify-up: the longest a successful run takes."""
    return (
        timeouts.drain_s
        + timeouts.stop_s
        + timeouts.verify_free_s
        + timeouts.start_s
        + timeouts.verify_up_s
    )


def pick_option(options: Sequence[Option], policy: AutoPolicy, model: str) -> int | None:
    """The 1-based index of the first option, in the operator's ranking, auto may take.

    Non-displacing options whenever auto is enabled; a displacement only when the
    *requested* model is in ``allow_displace``.
    """
    if not policy.enabled:
        return None
    for index, option in enumerate(options, start=1):
        if option.kind in _NON_DISPLACING or policy.may_displace_for(model):
            return index
    return None


Replanner = Callable[[PendingEntry], Awaitable[Plan]]
"""Fresh options for an entry (planner on the residents, readings, in-flight now)."""


@dataclass
class _Run:
    model: str
    original: dict[str, ParkReason]
    """Placement id → the reason admission gave it; restored when the run does not happen."""
    started: bool = False
    applied: str | None = None
    """The entry whose option the run enforced."""


class AutoRunner:
    """Schedules unattended enforcement for new parks (spec §4.4.1).

    - :meth:`schedule` is called by the controller once a new park is stored and
      planned. It answers :attr:`ParkReason.AUTO_LOADING` (and sets it on the
      entry, with the expiry pushed past the enforcement envelope) only when a
      run will really execute for the entry's model; otherwise ``None`` and the
      entry keeps admission's reason.
    - One run per requested **model** (resolved to its model key): a second park
      for the model joins the run. At most :data:`MAX_SCHEDULED_RUNS` runs exist;
      they take turns on one lock, and each re-plans when its turn comes (a run
      queued behind another saw the machine before that one loaded).
    - A failed run (``ok`` false, or any exception) marks its entries
      ``auto_failed`` and puts the model in a :data:`COOLDOWN_S` cooldown in the
      ledger's ``cooldowns``; a success clears it and removes the entries.
    - Nothing here raises into the daemon: a run's every error is logged.
    """

    def __init__(
        self,
        host: AutoHost,
        enforcer: AutoEnforcer,
        policy: PolicySource,
        registry: Callable[[], Registry],
        replan: Replanner,
        *,
        envelope_s: float = DEFAULT_ENVELOPE_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.host = host
        self.enforcer = enforcer
        self.policy = policy
        self._registry = registry
        self._replan = replan
        self.envelope_s = envelope_s
        self._clock = clock
        self._runs: dict[str, _Run] = {}
        self._turn = asyncio.Lock()
        self._tasks: dict[asyncio.Task[None], _Run] = {}
        self._closing = False

    # ------------------------------------------------------------------ public

    async def schedule(self, entry: PendingEntry, plan: Plan) -> ParkReason | None:
        """Start (or join) the auto run for ``entry``'s model; the reason it now parks with."""
        if self._closing or entry.reason in NEVER_AUTO or entry.reason is ParkReason.AUTO_FAILED:
            return None
        if plan.reason is not PreviewReason.OK or not plan.options:
            return None
        resolved = self._registry().resolve(entry.requested_model)
        if resolved is None:
            return None
        model = resolved[0].key
        policy = await self.policy.refresh()
        current = self._live(entry.id)
        if current is None or current.reason in NEVER_AUTO:
            return None  # resolved, dismissed or expired while we looked
        if current.reason is ParkReason.AUTO_FAILED:
            return None  # one attempt per entry
        run = self._runs.get(model)
        if run is not None and current.id in run.original:
            return ParkReason.AUTO_LOADING
        stale = current.reason is ParkReason.AUTO_LOADING
        if stale:
            # Said by a run that no longer exists (a restart): back to the honest reason.
            current = replace(current, reason=ParkReason.NOT_RESIDENT)
        now = self._clock()
        if run is None:
            run = self._new_run(model, plan, policy, now)
            if run is None:
                if stale:
                    self.host.admission.replace(current)
                    self.host.mark_dirty()
                return None
        run.original[current.id] = current.reason
        ahead = 0 if run.started else list(self._runs).index(model)
        self._mark_loading(current, now + self.envelope_s * (ahead + 1) + ENVELOPE_MARGIN_S)
        return ParkReason.AUTO_LOADING

    def status(self) -> dict[str, Any]:
        """``{"running": model | None, "queued": [model…], "cooldowns": {model: until}}``."""
        running = next((m for m, r in self._runs.items() if r.started), None)
        return {
            "running": running,
            "queued": [m for m, r in self._runs.items() if not r.started],
            "cooldowns": dict(self.host.cooldowns),
        }

    async def wait_idle(self) -> None:
        """Return once every scheduled run has finished."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Daemon shutdown: schedule nothing more, cancel the runs still waiting for
        their turn (their entries get their own reasons back), and let the running
        one finish: an enforcement is never cut off mid-sequence (bound the wait
        with ``asyncio.wait_for``)."""
        self._closing = True
        for task, run in list(self._tasks.items()):
            if not run.started:
                task.cancel()
        await self.wait_idle()

    # ------------------------------------------------------------------ scheduling

    def _new_run(self, model: str, plan: Plan, policy: AutoPolicy, now: float) -> _Run | None:
        until = self.host.cooldowns.get(model)
        if until is not None and until > now:
            log.info(
                "auto: %s is in cooldown after a failed run until %s; not loading", model, until
            )
            return None
        if pick_option(plan.options, policy, model) is None:
            return None
        if len(self._runs) >= MAX_SCHEDULED_RUNS:
            log.warning(
                "auto: %d runs already scheduled (%s); %s waits for the operator",
                len(self._runs),
                ", ".join(self._runs),
                model,
            )
            return None
        run = _Run(model, {})
        self._runs[model] = run
        task = asyncio.get_running_loop().create_task(self._execute(run), name=f"auto-{model}")
        self._tasks[task] = run
        task.add_done_callback(self._task_done)
        return run

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.pop(task, None)

    def _mark_loading(self, entry: PendingEntry, expires_at: float) -> None:
        updated = replace(
            entry, reason=ParkReason.AUTO_LOADING, expires_at=max(entry.expires_at, expires_at)
        )
        self.host.admission.replace(updated)
        self.host.mark_dirty()

    # ------------------------------------------------------------------ the run

    async def _execute(self, run: _Run) -> None:
        ok: bool | None = None
        try:
            async with self._turn:
                run.started = True
                ok = await self._attempt(run)
        except asyncio.CancelledError:
            self._forget(run)
            self._settle_logged(run, None)
            raise
        except Exception:
            log.exception("auto: the run for %s failed with an error", run.model)
            ok = False
        self._forget(run)
        self._settle_logged(run, ok)

    def _settle_logged(self, run: _Run, ok: bool | None) -> None:
        try:
            self._settle(run, ok)
        except Exception:
            log.exception("auto: recording the outcome of the run for %s failed", run.model)

    def _forget(self, run: _Run) -> None:
        if self._runs.get(run.model) is run:
            del self._runs[run.model]

    async def _attempt(self, run: _Run) -> bool | None:
        """``True``/``False`` for a run that enforced; ``None`` when it did not happen."""
        entry = self._first_live(run)
        if self._closing:
            return None
        if entry is None:
            log.info("auto: nobody waits for %s any more; nothing to load", run.model)
            return None
        policy = await self.policy.refresh()
        fresh = await self._replan(entry)
        entry = self._live(entry.id)
        if entry is None:
            return None
        index = pick_option(fresh.options, policy, run.model)
        if index is None:
            log.info("auto: no option for %s that auto may take now; it waits", run.model)
            return None
        entry = replace(entry, options=fresh.options)
        self.host.admission.replace(entry)
        run.applied = entry.id
        self._extend(run, self._clock() + self.envelope_s + ENVELOPE_MARGIN_S)
        option = fresh.options[index - 1]
        log.warning(
            "auto: enforcing %s option %d for %s (%s %s/%s on %s%s)",
            entry.id,
            index,
            run.model,
            option.kind.value,
            option.model,
            option.config,
            option.device,
            f", displacing {', '.join(option.signature)} under allow_displace"
            if option.victims
            else "",
        )
        result = await self.enforcer.apply(entry, index, list(option.signature), wait=True)
        if result.get("ok") is True:
            return True
        log.warning("auto: loading %s failed: %s", run.model, result.get("error", "no detail"))
        return False

    def _first_live(self, run: _Run) -> PendingEntry | None:
        return next((e for e in map(self._live, run.original) if e is not None), None)

    def _live(self, placement_id: str) -> PendingEntry | None:
        """The entry unless it is gone or expired (the controller's tick drops and
        announces expired ones; this never drops anything)."""
        entry = self.host.admission.get(placement_id)
        return entry if entry is not None and not entry.expired(self._clock()) else None

    def _extend(self, run: _Run, expires_at: float) -> None:
        for placement_id in run.original:
            entry = self.host.admission.get(placement_id)
            if entry is not None and entry.expires_at < expires_at:
                self.host.admission.replace(replace(entry, expires_at=expires_at))
        self.host.mark_dirty()

    def _settle(self, run: _Run, ok: bool | None) -> None:
        if ok:
            if self.host.cooldowns.pop(run.model, None) is not None:
                log.info("auto: %s loaded; its cooldown is cleared", run.model)
        elif ok is False:
            until = self._clock() + COOLDOWN_S
            self.host.cooldowns[run.model] = until
            log.warning("auto: %s is in cooldown for %g s", run.model, COOLDOWN_S)
        for placement_id, original in run.original.items():
            entry = self.host.admission.get(placement_id)
            if entry is None:
                continue
            if ok and placement_id == run.applied:
                # The enforcer's resolve step removes it; this only makes sure.
                self.host.resolve(entry, "applied")
            elif ok is False:
                self.host.admission.replace(replace(entry, reason=ParkReason.AUTO_FAILED))
            elif entry.reason is ParkReason.AUTO_LOADING:
                # Joined a run that did not happen, or that loaded a config this
                # entry does not ask for (a config key pins one): back to the operator.
                self.host.admission.replace(replace(entry, reason=original))
        self.host.mark_dirty()
