"""The ``org.uap.Placement1`` D-Bus interface: thin, every method one controller call.

The interface is exactly ``dbus/org.uap.Placement1.xml`` (``tests/bus/
test_introspection.py`` compares the live introspection with the file). The
work lives in :class:`uapplace.controller.controller.Controller`; this module only

- turns bus arguments into Python values (JSON arguments are validated here,
  pydantic at the edge) and results into bus values (JSON text);
- maps the domain errors of :mod:`uapplace.core.errors` to
  ``org.uap.Placement1.Error.<Name>`` replies, and anything unexpected to
  ``Failed`` (logged with its traceback, never sent to the caller);
- asks the authorizer before every mutating method (reads and ``Admit`` are
  never gated: the contract lets loopback proxies admit);
- emits the signals and ``PropertiesChanged`` the controller reports.

**Who is calling.** dbus-fast hands a method only its arguments, not the message.
:func:`track_senders` adds a bus message handler that runs, synchronously, just
before dbus-fast dispatches each method call, and stores the message's sender
in a :class:`contextvars.ContextVar`. dbus-fast starts an ``async`` method as a
task from inside that same dispatch, and a task copies the context it was
created in, so ``_CALLER.get()`` inside a coroutine method is that call's
sender even after it awaits. The same handler answers a call to a known member
with the wrong signature with ``org.freedesktop.DBus.Error.InvalidArgs`` naming
the expected arguments (dbus-fast alone would say ``UnknownMethod``).
"""

import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

from dbus_fast import Message, MessageType
from dbus_fast.annotations import DBusBool, DBusSignature, DBusStr, DBusUInt32, DBusUInt64
from dbus_fast.constants import PropertyAccess
from dbus_fast.errors import DBusError
from dbus_fast.service import ServiceInterface, dbus_method, dbus_property
from dbus_fast.service import dbus_signal as _dbus_signal
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from uapplace import __version__
from uapplace.bus.connection import Bus
from uapplace.bus.peer import ADMIT_CALLS, AdmitAnswer, reply_to_admit
from uapplace.controller import views
from uapplace.controller.controller import Controller
from uapplace.controller.ports import Authorization, AutoPolicyStore, ResidentRow, UnitWriter
from uapplace.core.alerts import Alert
from uapplace.core.errors import ERROR_PREFIX, InvalidArgument, NotAuthorized, PlacementFailure
from uapplace.core.model import PendingEntry
from uapplace.core.validation import first_error_text
from uapplace.daemon.authz import Action, auto_policy_actions
from uapplace.files import jsonfile
from uapplace.files.autopolicy import MAX_IDLE_WINDOW_S
from uapplace.files.paths import INTERFACE, OBJECT_PATH
from uapplace.files.registry_schema import MAX_KEY_CHARS

log = logging.getLogger(__name__)

T = TypeVar("T")

DecisionOut = Annotated[tuple[str, str, str, str], DBusSignature("ssss")]
ResidentsOut = Annotated[list[tuple[str, str, str, str]], DBusSignature("a(ssss)")]
StringList = Annotated[list[str], DBusSignature("as")]
FourStrings = Annotated[tuple[str, str, str, str], DBusSignature("ssss")]
TwoStrings = Annotated[tuple[str, str], DBusSignature("ss")]
FiveStrings = Annotated[tuple[str, str, str, str, str], DBusSignature("sssss")]
StepOut = Annotated[tuple[str, str, bool, str], DBusSignature("ssbs")]

_CALLER: contextvars.ContextVar[str] = contextvars.ContextVar("uapplace_caller", default="")

# What dbus-fast cannot express from Python signatures: output argument names,
# signal argument names, property annotations. Kept next to the methods they name.
_OUT_NAMES: dict[str, tuple[str, ...]] = {
    "Admit": ("decision", "target_id", "placement_id", "reason"),
    "AdmitBy": ("decision", "target_id", "placement_id", "reason"),
    "GetState": ("state_json",),
    "ListPending": ("pending_json",),
    "Preview": ("preview_json",),
    "PreviewUnload": ("preview_json",),
    "Apply": ("result_json",),
    "Dismiss": ("dismissed",),
    "Load": ("result_json",),
    "Unload": ("result_json",),
    "WriteUnits": ("written",),
    "CheckUnits": ("stale",),
    "Measure": ("result_json",),
    "MeasureEnvelope": ("result_json",),
    "Validate": ("findings_json",),
    "GetAutoPolicy": ("policy_json",),
    "SetAutoPolicy": ("policy_json",),
    "Hold": ("cookie",),
    "AcknowledgeAlerts": ("acknowledged",),
}
_SIGNAL_ARG_NAMES: dict[str, tuple[str, ...]] = {
    "Parked": ("placement_id", "model", "client", "reason"),
    "Resolved": ("placement_id", "outcome"),
    "ResidentChanged": ("model", "config", "device", "state"),
    "EnforcementStep": ("run_id", "step", "ok", "detail"),
    "AlertRaised": ("alert_id", "kind", "severity", "subject", "message"),
}
_PROPERTY_ANNOTATIONS: dict[str, dict[str, str]] = {
    "Version": {"org.freedesktop.DBus.Property.EmitsChangedSignal": "const"},
}


# --------------------------------------------------------------------------- edges


MAX_ID_CHARS = 1024
"""A model id, placement id, config key or alert id argument (docs/bus-api.md, "Bounds")."""
MAX_REASON_CHARS = 1024
"""A ``Hold``'s reason and app id: shown to the operator next to the pin."""
MAX_LIST_ARGS = 256
"""Elements of an ``as`` argument (``expected``, ``alert_ids``)."""
MAX_POLICY_JSON_CHARS = 64 * 1024
"""``SetAutoPolicy``'s ``policy_json``: a change body is a few hundred bytes."""

_Names = Annotated[list[Annotated[str, Field(max_length=MAX_KEY_CHARS)]], Field(max_length=1024)]


class _AutoChangesJson(BaseModel):
    """The shim's ``auto`` body (docs/bus-api.md, "The auto policy"); unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    enable: bool | None = None
    disable: bool | None = None
    allow_displace: _Names | None = None
    disallow_displace: _Names | None = None
    allow_unload: _Names | None = None
    disallow_unload: _Names | None = None
    unload_idle_after_secs: int | None = Field(default=None, ge=0, le=MAX_IDLE_WINDOW_S)


def check_text(argument: str, value: str, limit: int = MAX_ID_CHARS) -> str:
    """A string argument within ``limit`` characters; ``InvalidArgument`` naming it."""
    if len(value) > limit:
        raise InvalidArgument(
            f"argument {argument}: {len(value):,} characters, over the {limit:,} limit"
        )
    return value


def check_list(argument: str, values: list[str], limit: int = MAX_LIST_ARGS) -> list[str]:
    """An ``as`` argument of at most ``limit`` elements, each within :data:`MAX_ID_CHARS`."""
    if len(values) > limit:
        raise InvalidArgument(
            f"argument {argument}: {len(values):,} elements, over the {limit:,} limit"
        )
    for index, value in enumerate(values):
        check_text(f"{argument}[{index}]", value)
    return values


def parse_signature(expected: list[str]) -> list[str]:
    """``expected`` (``as``): the approval signature, ``model/config`` per victim.

    Exactly the ``signature`` list ``ListPending``/``Preview``/``PreviewUnload``
    show. It is always checked: ``[]`` approves stopping nothing, so a run that
    would stop something is ``Drifted``. A malformed element is ``InvalidArgument``.
    """
    check_list("expected", expected)
    for index, item in enumerate(expected):
        model, sep, config = item.partition("/")
        if not sep or not model or not config:
            raise InvalidArgument(
                f"expected[{index}] is {item!r}: each element must be 'model/config' as the "
                "signature list of ListPending/Preview/PreviewUnload shows it"
            )
    if len(set(expected)) != len(expected):
        raise InvalidArgument(f"expected lists a victim twice: {sorted(expected)}")
    return sorted(expected)


def parse_auto_changes(text: str) -> dict[str, Any]:
    """``SetAutoPolicy``'s ``policy_json``: the change body, keys that were given only.

    Parsed under the files' rules (:func:`uapplace.files.jsonfile.loads_text`: at most
    64 levels deep, no 5,000-digit integer, no duplicate key) and a 64 KiB cap; each
    refusal an ``InvalidArgument`` naming ``policy_json`` and the JSON path."""
    try:
        raw = jsonfile.loads_text(text, max_chars=MAX_POLICY_JSON_CHARS) if text.strip() else {}
    except jsonfile.JsonTextError as err:
        raise InvalidArgument(f"policy_json is not acceptable JSON: {err}") from None
    try:
        parsed = _AutoChangesJson.model_validate(raw)
    except ValidationError as err:
        raise InvalidArgument(f"policy_json: {_short(first_error_text(err, '(value)'))}") from None
    return parsed.model_dump(exclude_none=True)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def to_json_text(value: Any) -> str:
    """Compact JSON; a non-finite number goes out as ``null``, never a bare ``NaN``."""
    return jsonfile.dumps(value, separators=(",", ":"))


def as_dbus_error(err: Exception) -> DBusError:
    """A domain error → its named reply; anything else → ``Failed`` (and a log line)."""
    if isinstance(err, PlacementFailure):
        return DBusError(err.bus_name, str(err))
    log.exception("unexpected error answering a bus call", exc_info=err)
    return DBusError(ERROR_PREFIX + "Failed", f"internal error: {type(err).__name__}: {err}")


# --------------------------------------------------------------------------- the interface


class PlacementInterface(ServiceInterface):
    """``org.uap.Placement1`` at ``/org/uap/Placement1``; reports controller events as signals."""

    def __init__(
        self,
        controller: Controller,
        authorizer: Authorization,
        auto_policy: AutoPolicyStore,
        unit_writer: UnitWriter,
    ) -> None:
        """Attach it to the controller's :class:`~uapplace.controller.ports.EventRelay` to have its
        events as signals (``wiring.build`` does)."""
        super().__init__(INTERFACE)
        self._controller = controller
        self._authorizer = authorizer
        self._auto_policy = auto_policy
        self._unit_writer = unit_writer

    # ------------------------------------------------------------- hot path

    @dbus_method()
    def Admit(
        self, model: DBusStr, client: DBusStr, session: DBusStr, cells: DBusUInt32
    ) -> DecisionOut:
        return self.admit_answer(model, client, session, cells)

    @dbus_method()
    def AdmitBy(
        self,
        model: DBusStr,
        client: DBusStr,
        session: DBusStr,
        cells: DBusUInt32,
        deadline_us: DBusUInt64,
    ) -> DecisionOut:
        return self.admit_answer(model, client, session, cells, deadline_us)

    def admit_answer(
        self, model: str, client: str, session: str, cells: int, deadline_us: int = 0
    ) -> tuple[str, str, str, str]:
        """``Admit``'s (and ``AdmitBy``'s) reply body; also what the peer socket answers
        (:mod:`uapplace.bus.peer`)."""
        try:
            decision = self._controller.admit(model, client, session, cells, deadline_us)
        except Exception as err:
            raise as_dbus_error(err) from None
        return (decision.decision, decision.target_id, decision.placement_id, decision.reason)

    # ------------------------------------------------------------- reads

    @dbus_method()
    async def GetState(self) -> DBusStr:
        return to_json_text(await self._guard(views.state_json(self._controller)))

    @dbus_method()
    async def ListPending(self) -> DBusStr:
        """Holders and in-flight work are read at call time (the proxy's list, bounded
        by its client timeout), so this awaits; it never blocks the loop."""
        return to_json_text(await self._guard(views.pending_live_json(self._controller)))

    @dbus_method()
    async def Preview(self, model: DBusStr, cells: DBusUInt32) -> DBusStr:
        async def run() -> Any:
            return await views.preview(self._controller, check_text("model", model), cells)

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def PreviewUnload(self, model: DBusStr) -> DBusStr:
        async def run() -> Any:
            return await views.preview_unload(self._controller, check_text("model", model))

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def Validate(self) -> DBusStr:
        return to_json_text(await self._guard(views.validate(self._controller)))

    @dbus_method()
    async def GetAutoPolicy(self) -> DBusStr:
        return to_json_text(await self._guard(self._auto_policy.get()))

    # ------------------------------------------------------------- writes

    @dbus_method()
    async def Apply(
        self, placement_id: DBusStr, option: DBusUInt32, expected: StringList
    ) -> DBusStr:
        async def run() -> Any:
            check_text("placement_id", placement_id)
            signature = parse_signature(expected)
            await self._authorize(Action.APPLY)
            return await self._controller.enforcement.apply(placement_id, option, signature)

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def Dismiss(self, placement_id: DBusStr) -> DBusBool:
        async def run() -> bool:
            check_text("placement_id", placement_id)
            await self._authorize(Action.DISMISS)
            return self._controller.dismiss(placement_id)

        return await self._guard(run())

    @dbus_method()
    async def Load(self, model: DBusStr, expected: StringList) -> DBusStr:
        async def run() -> Any:
            check_text("model", model)
            signature = parse_signature(expected)
            await self._authorize(Action.LOAD)
            return await self._controller.enforcement.load(model, signature)

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def Unload(self, model: DBusStr, expected: StringList) -> DBusStr:
        async def run() -> Any:
            check_text("model", model)
            signature = parse_signature(expected)
            await self._authorize(Action.UNLOAD)
            return await self._controller.enforcement.unload(model, signature)

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def WriteUnits(self) -> StringList:
        async def run() -> list[str]:
            await self._authorize(Action.WRITE_UNITS)
            # Drop-ins and a manager reload under the units a running switch stops and starts.
            self._controller.enforcement.refuse_while_running("WriteUnits")
            return await self._unit_writer.write_units()

        return await self._guard(run())

    @dbus_method()
    async def CheckUnits(self) -> StringList:
        """Read only (never gated): which drop-ins ``WriteUnits`` would write or remove."""
        return await self._guard(self._unit_writer.check_units())

    @dbus_method()
    async def Measure(self, model: DBusStr, config: DBusStr) -> DBusStr:
        async def run() -> Any:
            check_text("model", model)
            check_text("config", config)
            await self._authorize(Action.MEASURE)
            return await self._controller.enforcement.measure(model, config)

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def MeasureEnvelope(
        self, model: DBusStr, config: DBusStr, expected: StringList
    ) -> DBusStr:
        """Takes the backend down and up to time it: a switch (issue 21), so it takes
        ``Unload``'s polkit action and the ``PreviewUnload`` signature the operator saw."""

        async def run() -> Any:
            check_text("model", model)
            check_text("config", config)
            signature = parse_signature(expected)
            await self._authorize(Action.UNLOAD)
            return await self._controller.enforcement.measure(
                model, config, envelope=True, expected=signature
            )

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def SetAutoPolicy(self, policy_json: DBusStr, consent: DBusBool) -> DBusStr:
        async def run() -> Any:
            changes = parse_auto_changes(policy_json)
            for action in sorted(auto_policy_actions(changes)):
                await self._authorize(action)
            return await self._auto_policy.set(changes, consent)

        return to_json_text(await self._guard(run()))

    @dbus_method()
    async def Hold(self, model: DBusStr, reason: DBusStr, app_id: DBusStr) -> DBusUInt32:
        async def run() -> int:
            check_text("model", model)
            check_text("reason", reason, MAX_REASON_CHARS)
            check_text("app_id", app_id, MAX_REASON_CHARS)
            await self._authorize(Action.HOLD)
            return await self._controller.hold(model, reason, app_id, _CALLER.get())

        return await self._guard(run())

    @dbus_method()
    async def Release(self, cookie: DBusUInt32) -> None:
        async def run() -> None:
            caller = _CALLER.get()
            await self._authorize(Action.HOLD)
            others = False
            if self._controller.hold_owner(cookie) != caller:
                others = await self._may_release_others(caller)
            self._controller.release(cookie, caller, may_release_others=others)

        await self._guard(run())

    @dbus_method()
    async def AcknowledgeAlerts(self, alert_ids: StringList) -> StringList:
        async def run() -> list[str]:
            check_list("alert_ids", alert_ids, 1024)
            await self._authorize(Action.ACKNOWLEDGE)
            return self._controller.alerts.acknowledge(list(alert_ids))

        return await self._guard(run())

    # ------------------------------------------------------------- signals

    @_dbus_signal()
    def Parked(self, placement_id: str, model: str, client: str, reason: str) -> FourStrings:
        return (placement_id, model, client, reason)

    @_dbus_signal()
    def Resolved(self, placement_id: str, outcome: str) -> TwoStrings:
        return (placement_id, outcome)

    @_dbus_signal()
    def ResidentChanged(self, model: str, config: str, device: str, state: str) -> FourStrings:
        return (model, config, device, state)

    @_dbus_signal()
    def EnforcementStep(self, run_id: str, step: str, ok: bool, detail: str) -> StepOut:
        return (run_id, step, ok, detail)

    @_dbus_signal()
    def AlertRaised(
        self, alert_id: str, kind: str, severity: str, subject: str, message: str
    ) -> FiveStrings:
        return (alert_id, kind, severity, subject, message)

    # ------------------------------------------------------------- properties

    @dbus_property(access=PropertyAccess.READ)
    def Version(self) -> DBusStr:
        return __version__

    @dbus_property(access=PropertyAccess.READ)
    def PendingCount(self) -> DBusUInt32:
        return self._controller.pending_count

    @dbus_property(access=PropertyAccess.READ)
    def Residents(self) -> ResidentsOut:
        return list(self._controller.resident_rows())

    # ------------------------------------------------------------- controller events

    def on_parked(self, entry: PendingEntry) -> None:
        self.Parked(entry.id, entry.requested_model, entry.client, entry.reason.value)

    def on_resolved(self, placement_id: str, outcome: str) -> None:
        self.Resolved(placement_id, outcome)

    def on_resident_changed(self, row: ResidentRow) -> None:
        self.ResidentChanged(*row)

    def on_enforcement_step(self, run_id: str, step: str, ok: bool, detail: str) -> None:
        self.EnforcementStep(run_id, step, ok, detail)

    def on_alert(self, alert: Alert) -> None:
        self.AlertRaised(
            alert.id, alert.kind.value, alert.severity.value, alert.subject, alert.message
        )

    def on_pending_count(self, count: int) -> None:
        self.emit_properties_changed({"PendingCount": count})

    def on_residents(self, rows: list[ResidentRow]) -> None:
        self.emit_properties_changed({"Residents": [list(r) for r in rows]})

    # ------------------------------------------------------------- helpers

    async def _guard(self, work: Awaitable[T]) -> T:
        try:
            return await work
        except Exception as err:
            raise as_dbus_error(err) from None

    async def _authorize(self, action: Action) -> None:
        await self._authorizer.check(_CALLER.get(), action)

    async def _may_release_others(self, caller: str) -> bool:
        """polkit's yes for ``release-others`` (no same-uid fallback).

        A refusal comes back as the controller's ``NotAuthorized``, which names the
        holder, rather than polkit's bare answer (that is logged)."""
        try:
            await self._authorizer.check_polkit(caller, Action.RELEASE_OTHERS)
        except NotAuthorized as err:
            log.info("Release of another connection's hold refused for %s: %s", caller, err)
            return False
        return True


def _complete_introspection() -> None:
    """Name the output and signal arguments and annotate ``Version`` (see the table above)."""
    for member in vars(PlacementInterface).values():
        described = getattr(member, "__dict__", {})
        method = described.get("__DBUS_METHOD")
        if method is not None:
            for arg, name in zip(
                method.introspection.out_args, _OUT_NAMES.get(method.name, ()), strict=False
            ):
                arg.name = name
        signal = described.get("__DBUS_SIGNAL")
        if signal is not None:
            for arg, name in zip(
                signal.introspection.args, _SIGNAL_ARG_NAMES[signal.name], strict=True
            ):
                arg.name = name
    for name, annotations in _PROPERTY_ANNOTATIONS.items():
        prop = vars(PlacementInterface)[name]
        prop.introspection.annotations.update(annotations)


_complete_introspection()


# --------------------------------------------------------------------------- sender tracking


def _expected_signatures() -> dict[str, tuple[str, list[str]]]:
    """Member → (in signature, in argument names), from the interface itself."""
    out: dict[str, tuple[str, list[str]]] = {}
    for member in vars(PlacementInterface).values():
        method = getattr(member, "__dict__", {}).get("__DBUS_METHOD")
        if method is not None:
            names = [arg.name or "?" for arg in method.introspection.in_args]
            out[method.name] = (method.in_signature, names)
    return out


def track_senders(
    bus: Bus, admit: AdmitAnswer | None = None
) -> Callable[[Message], Message | bool | None]:
    """Install the handler that records each call's sender (see the module docstring).

    With ``admit`` (:meth:`PlacementInterface.admit_answer`), it also answers ``Admit``
    and ``AdmitBy`` on the object itself, as the peer socket does
    (:func:`uapplace.bus.peer.admit_only`), before dbus-fast looks the method up, unpacks
    it and runs the remaining handlers: the
    same answer, error replies and side effects through the same function, less work on
    the path every request of every client takes (issue 23; docs/performance.md, "Bus
    Admit answered by the first handler")."""
    expected = _expected_signatures()

    def on_message(message: Message) -> Message | bool | None:
        if message.message_type is not MessageType.METHOD_CALL:
            return None
        if (
            admit is not None
            and message.interface == INTERFACE
            and message.path == OBJECT_PATH
            and (message.member, message.signature) in ADMIT_CALLS
        ):
            return reply_to_admit(bus, message, admit)
        _CALLER.set(message.sender or "")
        if message.interface != INTERFACE:
            return None
        wanted = expected.get(message.member or "")
        if wanted is None or wanted[0] == message.signature:
            return None
        signature, names = wanted
        shown = ", ".join(f"{n} ({t})" for n, t in zip(names, signature, strict=False))
        return Message.new_error(
            message,
            "org.freedesktop.DBus.Error.InvalidArgs",
            f"{message.member} takes signature '{signature}' ({shown or 'no arguments'}), "
            f"got '{message.signature}'",
        )

    bus.add_message_handler(on_message)
    return on_message
