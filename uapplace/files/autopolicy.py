"""Standing consent, part one: the auto-resolution policy file (docs/placement-rules.md §4.4.1).

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

:class:`PolicyStore` is the controller's ``AutoPolicyStore`` (``GetAutoPolicy``,
``SetAutoPolicy``) and the :class:`PolicySource` of the auto runner (``auto.py``)
and the idle sweep (``idle.py``); ``wiring.build`` makes the one instance.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Protocol

from pydantic import Field, StrictBool, StrictInt, StrictStr, TypeAdapter, ValidationError

from uapplace.core.errors import Failed, InvalidArgument
from uapplace.core.model import Registry
from uapplace.core.validation import first_error
from uapplace.files import jsonfile
from uapplace.files.jsonfile import ConfigFileError, UntrustedFile, atomic_write
from uapplace.files.registry_schema import MAX_KEY_CHARS

log = logging.getLogger(__name__)

MIN_IDLE_WINDOW_S = 60
"""Under a minute the idle sweep would oscillate (docs/placement-rules.md §4.4.2)."""
MAX_IDLE_WINDOW_S = 30 * 86_400
"""30 days: a longer idle window is no window (docs/placement-rules.md §4.7)."""
MAX_NAMES = 1024
"""Model keys one allowlist may name."""

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

_BOOL: TypeAdapter[bool] = TypeAdapter(StrictBool)
_NAMES: TypeAdapter[list[str]] = TypeAdapter(
    Annotated[
        list[Annotated[StrictStr, Field(max_length=MAX_KEY_CHARS)]], Field(max_length=MAX_NAMES)
    ]
)
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
    first = first_error(err)
    where = first.where(part="[{}]", sep="")
    given = json.dumps(first.input)
    shown = given if len(given) <= 80 else given[:80] + "…"
    return f"{where + ': ' if where else ''}{first.msg}, got {shown}"


def _over_window(seconds: int) -> str:
    shown = f"{seconds}" if seconds < 10**15 else f"a {len(str(seconds))}-digit number"
    return f"{shown} is over the {MAX_IDLE_WINDOW_S} s (30 days) limit"


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
    if seconds is not None and seconds > MAX_IDLE_WINDOW_S:
        invalid("unload_idle_after_secs", _over_window(seconds), "off")
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


def load_auto_policy(path: Path) -> tuple[AutoPolicy, list[str]]:
    """Read the policy file; never raises. Missing → off, no finding; unreadable → off."""
    try:
        raw = jsonfile.read_capped_or_none(path, trusted=True)
        if raw is None:
            return AutoPolicy(), []
        document = jsonfile.parse_json(raw, path)
    except UntrustedFile as err:
        # Standing consent only counts when the operator wrote it (docs/placement-rules.md §4.7).
        return AutoPolicy(), [f"{path}: {err.message}; auto is off (never honoured as consent)"]
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
        resolved = registry.lookup(name)
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
        shown = json.dumps(value) if not isinstance(value, int) else str(value)[:20]
        raise InvalidArgument(
            "unload_idle_after_secs: expected whole seconds ≥ 0 (0 or null turns the "
            f"idle sweep off), got {shown}"
        )
    if value is not None and value > MAX_IDLE_WINDOW_S:
        raise InvalidArgument(f"unload_idle_after_secs: {_over_window(value)}; nothing was changed")
    return value or None


def apply_changes(
    policy: AutoPolicy, changes: Mapping[str, Any], consent: bool, registry: Registry
) -> AutoPolicy:
    """The shim/bus ``auto`` body applied to ``policy`` (``{}`` returns it unchanged).

    Raises :class:`~uapplace.core.errors.InvalidArgument` naming the key for a bad body
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
        policy, findings = load_auto_policy(self.path)
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
        """Apply the ``auto`` body and save; ``{}`` only reports the status.

        A body that grants standing consent (``allow_displace``, ``allow_unload``) is
        refused whole without ``consent``, before the file is read."""
        granting = [k for k in ("allow_displace", "allow_unload") if changes.get(k)]
        if granting and not consent:
            raise ConsentRequired(
                f"{' and '.join(granting)} records standing consent to stop models unattended; "
                "it needs consent=true (`uapplace auto ... --yes`)"
            )
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
        moved = jsonfile.move_aside(self.path) if _unparsable(self.path) else None
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
        raw = jsonfile.read_capped_or_none(path, trusted=True)
        return raw is not None and not isinstance(jsonfile.parse_json(raw, path), dict)
    except ConfigFileError:  # an untrusted one too: it is kept aside, never edited
        return True


class PolicySource(Protocol):
    """The policy in force now (:class:`PolicyStore`; a fake in tests)."""

    async def refresh(self) -> AutoPolicy: ...
