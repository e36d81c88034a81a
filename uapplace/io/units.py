"""systemd user units through pystemd: jobs, states, ``Conflicts=`` drop-ins.

No ``systemctl`` anywhere: :class:`UnitManager` talks to the user manager on
the bus with pystemd (sd-bus), on two connections:

- *calls*: synchronous method calls (``StartUnit``, ``GetAll`` …). sd-bus
  blocks, and pystemd holds the GIL while it does, so by default they run in a
  worker process that owns this connection (:mod:`uapplace.io.unitworker`;
  docs/architecture.md, "Decision: pystemd's calls in a worker process"), never
  on the event loop nor on a thread of it. ``in_process=True`` keeps them on one
  dedicated thread instead (an sd-bus connection must not be used by two threads
  at once): for short-lived tools with no loop to keep answering (the CLI).
- *signals*: ``Subscribe()`` plus matches for ``JobRemoved`` and
  ``PropertiesChanged``; its fd is watched with ``loop.add_reader`` and drained
  with ``bus.process()`` on the loop thread (non-blocking). A ``PropertiesChanged``
  is parsed only for a unit of a kind that can run an engine (:func:`followed_path`:
  not targets, slices, devices, mounts, automounts or swaps).

A job is awaited to its ``JobRemoved`` result. That signal may be processed
before the ``StartUnit`` reply reaches the awaiting coroutine, so recent
results are kept and looked up when the waiter registers.

Caveat of ``sd_bus_process`` as pystemd exposes it: a message consumed by one
of our match callbacks comes back as an *empty* message, exactly like "nothing
to do". Draining therefore continues while a pass returned a message or ran a
callback, else already-read signals could sit in sd-bus's buffer with the fd
quiet.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pystemd.dbuslib import DBusAddress, path_decode

from uapplace.bus.util import user_bus_address
from uapplace.core.model import Resident
from uapplace.core.unitnames import ENGINELESS_KINDS, unit_file_name, valid_unit_name
from uapplace.files.jsonfile import atomic_write
from uapplace.io.unitworker import Call, UnitWorker, WorkerCallError, WorkerGone, run_calls

log = logging.getLogger(__name__)

SYSTEMD = b"org.freedesktop.systemd1"
MANAGER_PATH = b"/org/freedesktop/systemd1"
MANAGER_IFACE = b"org.freedesktop.systemd1.Manager"
UNIT_IFACE = b"org.freedesktop.systemd1.Unit"
SERVICE_IFACE = b"org.freedesktop.systemd1.Service"
PROPERTIES_IFACE = b"org.freedesktop.DBus.Properties"
UNIT_PATH_PREFIX = b"/org/freedesktop/systemd1/unit"

DROPIN_NAME = "50-uapplace-conflicts.conf"
_DROPIN_HEADER = "# Written by uapplace: units that share a device. Rewritten on every change.\n"
_RECENT_JOBS = 1024

T = TypeVar("T")


class UnitError(Exception):
    """The user manager cannot be reached, or refused a call (the message says which).

    ``no_such_unit`` is set when systemd answered that the unit is not loaded / not found.
    """

    def __init__(self, message: str, no_such_unit: bool = False) -> None:
        super().__init__(message)
        self.no_such_unit = no_such_unit


@dataclass(frozen=True)
class JobOutcome:
    """How a start/stop job ended.

    ``result`` is systemd's ``JobRemoved`` result (``done``, ``failed``,
    ``canceled``, ``timeout``, ``dependency``, ``skipped``, …), ``timeout`` when
    our own deadline passed first (the job may still be queued in systemd), or
    ``error`` when systemd refused to queue the job (``detail`` has its message,
    ``job`` is ``None``).
    """

    unit: str
    result: str
    job: str | None = None
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.result == "done"


@dataclass(frozen=True)
class LogFacts:
    """Where a unit's output goes, and its latest run, as the user manager reports them:
    what :mod:`uapplace.io.unitlogs` needs to find the unit's last lines. Set by a read
    (:meth:`UnitManager.state`), never from a signal.

    ``invocation_id`` is the latest run's ``InvocationID`` (32 hex digits; "" when the unit
    has not run in this manager's life); ``started_usec`` when that run began
    (``InactiveExitTimestamp``, µs since the epoch; 0 unknown); ``stdout`` and ``stderr``
    the ``StandardOutput=``/``StandardError=`` kinds (``journal``, ``append``, ``file``,
    ``truncate``, ``inherit``, ``null`` …: the manager names the kind, never the file);
    ``fragment_path`` and ``dropin_paths`` the unit file and its drop-ins in the order
    systemd applied them, which do name it.
    """

    invocation_id: str = ""
    started_usec: int = 0
    stdout: str = ""
    stderr: str = ""
    fragment_path: str = ""
    dropin_paths: tuple[str, ...] = ()

    @property
    def known(self) -> bool:
        """Whether anything was read (a unit-tier fake's state carries none)."""
        return self != LogFacts()


@dataclass(frozen=True)
class UnitState:
    """A unit as systemd reports it. ``main_pid`` 0: none; ``exec_start`` "" for non-services.

    ``exec_start`` is every ``ExecStart=`` command line, argv joined by spaces,
    commands joined by ``"; "``. ``result`` is the service's ``Result``
    (``success``, ``exit-code``, ``signal``, ``timeout``, …). ``exec_paths`` is the binary
    of each ``ExecStart=`` command as systemd resolved it (the path, not
    ``argv[0]``); ``load_error`` is systemd's ``LoadError`` message when the unit
    did not load (``"Unit x.service not found."``), else "". ``exec_main_code`` and
    ``exec_main_status`` are how the last main process ended (``ExecMainCode``: a
    ``CLD_*`` code, :data:`CLD_KILLED` for a signal; ``ExecMainStatus``: the exit
    status or the signal number), 0 while it runs or for non-services.
    ``timeout_stop_s`` is the service's ``TimeoutStopSec=`` (``TimeoutStopUSec``), after
    which systemd ``SIGKILL``s what is left; ``None`` when infinite or not read.
    ``log_facts``: where its output goes and its latest run (:class:`LogFacts`).
    """

    active_state: str
    sub_state: str
    load_state: str
    main_pid: int
    exec_start: str
    result: str = ""
    exec_paths: tuple[str, ...] = ()
    load_error: str = ""
    exec_main_code: int = 0
    exec_main_status: int = 0
    timeout_stop_s: float | None = None
    log_facts: LogFacts = LogFacts()


# What an ``ActiveState`` means to us: the one definition of each set of unit states.
DOWN_STATES = frozenset({"inactive", "failed"})
"""Nothing runs: the unit's memory is (or is being) given back; ends any wait for it to turn
healthy."""
STARTING_STATES = frozenset({"activating"})
"""Being started: not serving yet."""
RUNNING_STATES = frozenset({"active", "reloading"})
"""Running (a reload does not stop it): unit sync keeps, or publishes, its resident."""
RUNNING_OR_STARTING_STATES = RUNNING_STATES | STARTING_STATES
"""Holding, or taking, its memory: what crash recovery calls up."""


def state_text(state: UnitState) -> str:
    """``active/sub`` plus a non-success result: how steps and alerts name a unit's state."""
    text = f"{state.active_state}/{state.sub_state}"
    if state.result and state.result != "success":
        text += f" (result {state.result})"
    return text


CLD_EXITED = 1
"""``ExecMainCode`` of a main process that exited (``ExecMainStatus``: its exit status)."""
CLD_KILLED = 2
"""``ExecMainCode`` of a main process ended by a signal (``siginfo_t.si_code``)."""
CLD_DUMPED = 3
"""``ExecMainCode`` of a main process ended by a signal that dumped core."""
USEC_INFINITY = 2**64 - 1
"""systemd's ``USEC_INFINITY``: a ``…USec`` property that never expires."""
STOP_TIMEOUT_RESULT = "timeout"
"""The service ``Result`` of a stop that outlived ``TimeoutStopSec=``: systemd then sent
``SIGKILL`` (``FinalKillSignal=``) to what was left of the unit."""


STOP_MARGIN_S = 5.0
"""How much longer than the unit's ``TimeoutStopSec=`` a stop job is awaited: systemd's
own ``SIGKILL`` then ends it, and the forced stop is seen as such."""


def stop_wait_s(state: UnitState | None, stop_s: float) -> float:
    """How long to await ``state``'s stop job: ``stop_s``, or longer when the unit's own
    ``TimeoutStopSec=`` (plus :data:`STOP_MARGIN_S`) is longer, so that a stop systemd
    forces ends in its ``SIGKILL`` rather than in our deadline (a stop job ``timeout`` and
    a rollback of a unit still going down)."""
    if state is None or state.timeout_stop_s is None:
        return stop_s
    return max(stop_s, state.timeout_stop_s + STOP_MARGIN_S)


def forced_stop_text(state: UnitState) -> str | None:
    """How a stop ended by force, read after its job said ``done``; ``None`` for a clean one.

    A stop job is ``done`` once the unit is down, however it got there: a process that
    ignored ``SIGTERM`` (llama-server mid-generation) is ``SIGKILL``ed after
    ``TimeoutStopSec=`` and the unit ends ``failed`` with ``Result=timeout``,
    ``ExecMainCode=CLD_KILLED``, ``ExecMainStatus=9``. Either sign is a forced stop:
    ``Result=timeout`` (something in the cgroup outlived the stop timeout) or a main
    process killed by ``SIGKILL``.
    """
    killed = (
        state.exec_main_code in (CLD_KILLED, CLD_DUMPED)
        and state.exec_main_status == signal.SIGKILL
    )
    timed_out = state.result == STOP_TIMEOUT_RESULT
    if not killed and not timed_out:
        return None
    how = "by SIGKILL" if killed else "by force (SIGKILL to what was left)"
    when = " after the stop timeout" if timed_out else ""
    return (
        f"stopped {how}{when} (unit result {state.result or 'unknown'}): "
        "in-flight work may have been cut"
    )


def outcome_text(outcome: JobOutcome) -> str:
    """A job's result, with systemd's detail when it gave one."""
    return f"{outcome.result}: {outcome.detail}" if outcome.detail else outcome.result


def unit_name(name: str) -> str:
    """A checked unit name with ``.service`` appended when it has no unit suffix.

    Raises ``ValueError`` naming the bad name (``..``, ``/``, spaces, newlines …).
    """
    if not valid_unit_name(name):
        raise ValueError(
            f"invalid unit name {name!r}: allowed are letters, digits and _ . @ -, "
            "not starting with . @ -, without '..' or '/'"
        )
    return unit_file_name(name)


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _exec_start_text(entries: Any) -> str:
    # ExecStart is a(sasbttttuii): (path, argv, ignore-failure, timestamps…, pid, code, status)
    return "; ".join(" ".join(_text(arg) for arg in entry[1]) for entry in entries or [])


def _exec_paths(entries: Any) -> tuple[str, ...]:
    return tuple(_text(entry[0]) for entry in entries or [])


def _load_error(value: Any) -> str:
    # LoadError is (ss): (D-Bus error name, message); both "" when the unit loaded.
    if not value:
        return ""
    name, message = _text(value[0]), _text(value[1])
    return message or name


def _timeout_s(value: Any) -> float | None:
    usec = int(value)
    return None if usec >= USEC_INFINITY else usec / 1e6


# Each unit property a signal or a read may carry: the UnitState fields it sets, and how.
_PROPERTY_FIELDS: dict[bytes, tuple[tuple[str, Callable[[Any], Any]], ...]] = {
    b"ActiveState": (("active_state", _text),),
    b"SubState": (("sub_state", _text),),
    b"LoadState": (("load_state", _text),),
    b"MainPID": (("main_pid", int),),
    b"ExecStart": (("exec_start", _exec_start_text), ("exec_paths", _exec_paths)),
    b"LoadError": (("load_error", _load_error),),
    b"Result": (("result", _text),),
    b"ExecMainCode": (("exec_main_code", int),),
    b"ExecMainStatus": (("exec_main_status", int),),
    b"TimeoutStopUSec": (("timeout_stop_s", _timeout_s),),
}


_UNFOLLOWED_KINDS = tuple(b"_2e" + kind.encode() for kind in ENGINELESS_KINDS)
"""Object-path endings of unit kinds that run no engine (``_2e`` is an escaped ``.``)."""


def followed_path(path: Any) -> bool:
    """Whether a ``PropertiesChanged`` from ``path`` is parsed and followed: a unit's, and
    not of a kind that runs no engine. Read from the header before pystemd parses the body
    (every property into Python objects, 0.17 ms each here, on the loop that answers
    ``Admit``): a contained manager sent 1,026 such signals for ``app.slice``,
    ``basic.target`` and ``shutdown.target`` against 92 for the two engines during two
    swaps (issue 23; docs/performance.md, "Signals nobody follows")."""
    return (
        isinstance(path, bytes)
        and path.startswith(UNIT_PATH_PREFIX + b"/")
        and not path.endswith(_UNFOLLOWED_KINDS)
    )


def _merge(state: UnitState, props: Mapping[bytes, Any]) -> UnitState:
    changes = {
        field: convert(props[name])
        for name, fields in _PROPERTY_FIELDS.items()
        if name in props
        for field, convert in fields
    }
    return replace(state, **changes)


def _log_facts(unit_props: Mapping[bytes, Any], service_props: Mapping[bytes, Any]) -> LogFacts:
    invocation = bytes(unit_props.get(b"InvocationID") or b"")
    return LogFacts(
        invocation_id=invocation.hex() if any(invocation) else "",
        started_usec=int(unit_props.get(b"InactiveExitTimestamp") or 0),
        stdout=_text(service_props.get(b"StandardOutput") or ""),
        stderr=_text(service_props.get(b"StandardError") or ""),
        fragment_path=_text(unit_props.get(b"FragmentPath") or ""),
        dropin_paths=tuple(_text(p) for p in unit_props.get(b"DropInPaths") or ()),
    )


SERVICE_PROPERTIES: tuple[bytes, ...] = (
    b"MainPID",
    b"ExecStart",
    b"Result",
    b"ExecMainCode",
    b"ExecMainStatus",
    b"TimeoutStopUSec",
    b"StandardOutput",
    b"StandardError",
)
"""The ``Service`` properties a read uses, each asked with ``Get`` for a unit last seen
running: a ``GetAll`` there makes systemd compute all ~300 (cgroup memory, CPU, IO and IP
accounting among them) and costs about twice as much. A unit not running is read with one
``GetAll``: each call on an unloaded unit loads it again, so eight ``Get``s cost more
(issue 23; docs/performance.md, "Swap at the shell's pace")."""


def _has_processes(state: UnitState) -> bool:
    """Whether ``state`` is one with a running cgroup (starting, running or stopping)."""
    return state.active_state in RUNNING_OR_STARTING_STATES or state.active_state == "deactivating"


_UNKNOWN = UnitState(active_state="", sub_state="", load_state="", main_pid=0, exec_start="")


def signalled_with_read(signalled: UnitState, read: UnitState) -> UnitState:
    """What the manager's signals said last, with the facts only a read gives.

    A read is several calls answered over a second connection: a unit that changes
    while it is in flight (a process that exits between the ``Unit`` and the
    ``Service`` properties) gives a reply older than a signal already handled, and no
    later signal corrects it. So the signalled fields (``ActiveState``, ``SubState``,
    ``MainPID``, ``Result``, ``ExecMain*``) win; the read adds what signals never carry.
    """
    return replace(
        signalled,
        load_state=read.load_state,
        exec_start=read.exec_start,
        exec_paths=read.exec_paths,
        load_error=read.load_error,
        timeout_stop_s=read.timeout_stop_s,
        log_facts=read.log_facts,
    )


class UnitManager:
    """Async facade over the systemd user manager. ``await connect()`` first, ``close()`` last.

    ``bus_address`` defaults to the user bus of the environment
    (``DBUS_SESSION_BUS_ADDRESS``, else ``$XDG_RUNTIME_DIR/bus``). Method calls run in
    a worker process (:class:`~uapplace.io.unitworker.UnitWorker`, replaced as soon as
    it died), or with ``in_process=True`` on a thread of this process.
    """

    def __init__(self, bus_address: str | None = None, *, in_process: bool = False) -> None:
        self.bus_address = bus_address or user_bus_address()
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uapplace-units")
        self.unit_worker = None if in_process else UnitWorker(self.bus_address)
        """The worker process's supervisor; ``None`` in process."""
        self._calls: Any = None
        self._signals: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._signal_callbacks: list[Callable[..., None]] = []
        self._dispatched = 0
        self._job_waiters: dict[str, asyncio.Future[str]] = {}
        self._recent_jobs: OrderedDict[str, str] = OrderedDict()
        self._states: dict[str, UnitState] = {}
        self._listeners: list[Callable[[str, UnitState], None]] = []
        self._closed = False

    # ----------------------------------------------------------------- lifecycle

    async def connect(self) -> None:
        if self._closed:
            raise UnitError("UnitManager is closed; make a new one")
        if self._loop is not None:
            return
        loop = asyncio.get_running_loop()
        try:
            await self._open_calls()
            self._signals = await self._in_worker(self._open_signal_bus)
        except Exception:
            await self._in_worker(self._close_buses)
            if self.unit_worker is not None:
                self.unit_worker.stop()
            raise
        self._loop = loop
        loop.add_reader(self._signals.get_fd(), self._drain_signals)
        self._drain_signals()

    def close(self) -> None:
        """Stop listening and close both connections (idempotent; pending job waits raise)."""
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and self._signals is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._signals.get_fd())
        self._loop = None
        for waiter in self._job_waiters.values():
            if not waiter.done():
                waiter.set_exception(UnitError("unit manager connection closed"))
        self._job_waiters.clear()
        if self.unit_worker is not None:
            self.unit_worker.close()
        # The worker may still be inside a call on _calls; close after it finishes.
        self._worker.submit(self._close_buses)
        self._worker.shutdown(wait=False)

    async def __aenter__(self) -> UnitManager:
        await self.connect()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    # --------------------------------------------------------------------- jobs

    # The deadline is a parameter, not the caller's asyncio.timeout: passing it
    # turns into a JobOutcome("timeout") instead of a cancelled await.
    async def start_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        """``StartUnit(name, "replace")``, awaited to its ``JobRemoved`` result."""
        return await self._job(b"StartUnit", unit_name(name), timeout)

    async def stop_unit(self, name: str, timeout: float) -> JobOutcome:  # noqa: ASYNC109
        """``StopUnit(name, "replace")``, awaited to its ``JobRemoved`` result."""
        return await self._job(b"StopUnit", unit_name(name), timeout)

    async def state(self, name: str) -> UnitState:
        """The unit's current state (loads it if needed: a missing one is ``not-found``)."""
        unit = unit_name(name)
        self._require_connected()
        known = self._states.get(unit)
        state = await self._read_state(unit, known is not None and _has_processes(known))
        # Signals may have moved on while we read: keep their fields, add ours.
        cached = self._states.get(unit)
        self._states[unit] = state if cached is None else signalled_with_read(cached, state)
        return state

    async def pids(self, name: str) -> list[int]:
        """Every process in the unit's cgroup (``GetUnitProcesses``); [] when not running."""
        unit = unit_name(name)
        self._require_connected()
        return await self._read_pids(unit)

    async def reload(self) -> None:
        """``Reload()``: systemd answers once unit files and drop-ins are re-read."""
        self._require_connected()
        await self._call_manager(b"Reload", b"", [])

    def on_change(self, callback: Callable[[str, UnitState], None]) -> None:
        """Call ``callback(unit, state)`` on the loop whenever a unit's state changes.

        Every unit, whoever started it. ``active_state``, ``sub_state``,
        ``main_pid`` and ``result`` come from the signal; ``load_state`` and
        ``exec_start`` are as last read by :meth:`state` (systemd does not put
        them in the signal), "" for a unit never read. Callbacks run inside
        the bus dispatch: keep them quick (schedule real work as a task).
        """
        self._listeners.append(callback)

    # ---------------------------------------------------------------- internals

    async def _job(self, method: bytes, unit: str, limit: float) -> JobOutcome:
        self._require_connected()
        try:
            async with asyncio.timeout(limit):
                try:
                    reply = await self._call_manager(method, b"ss", [unit.encode(), b"replace"])
                except UnitError as err:
                    return JobOutcome(unit, "error", None, str(err))
                job = _text(reply)
                try:
                    result = await self._job_result(job)
                except UnitError as err:
                    return JobOutcome(unit, "error", job, str(err))
                return JobOutcome(unit, result, job)
        except TimeoutError:
            return JobOutcome(unit, "timeout", None, f"no job result within {limit:g}s")

    async def _job_result(self, job: str) -> str:
        done = self._recent_jobs.pop(job, None)
        if done is not None:
            return done
        assert self._loop is not None
        waiter: asyncio.Future[str] = self._loop.create_future()
        self._job_waiters[job] = waiter
        try:
            return await waiter
        finally:
            self._job_waiters.pop(job, None)

    def _require_connected(self) -> None:
        if self._loop is None:
            raise UnitError("UnitManager is not connected: await connect() first")

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._worker, fn, *args)

    async def _open_calls(self) -> None:
        if self.unit_worker is None:
            self._calls = await self._in_worker(self._open_bus)
            return
        try:
            await self.unit_worker.start()
        except (WorkerCallError, WorkerGone) as err:
            raise UnitError(f"cannot connect to the user bus {self.bus_address}: {err}") from err

    async def _run(self, calls: list[Call]) -> list[Any]:
        """``calls`` in order, in the worker process or on the thread: their bodies."""
        if self.unit_worker is None:
            return await self._in_worker(self._run_here, calls)
        try:
            return await self.unit_worker.calls(calls)
        except WorkerCallError as err:
            raise UnitError(
                f"{err.method}: {err}", no_such_unit=err.kind == "DBusNoSuchUnitError"
            ) from err
        except WorkerGone as err:
            raise UnitError(f"{calls[0][3].decode()}: {err}") from err

    async def _call_manager(self, method: bytes, signature: bytes, args: list[Any]) -> Any:
        (body,) = await self._run([(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, method, signature, args)])
        return body

    async def _read_state(self, unit: str, running: bool) -> UnitState:
        # One round trip: LoadUnit, then GetAll (and Get) on the path it answered (None
        # below). ``running`` (as last signalled): the Service properties one by one
        # (SERVICE_PROPERTIES says why); else one GetAll, cheaper for a unit not running.
        calls: list[Call] = [
            (SYSTEMD, MANAGER_PATH, MANAGER_IFACE, b"LoadUnit", b"s", [unit.encode()]),
            (SYSTEMD, None, PROPERTIES_IFACE, b"GetAll", b"s", [UNIT_IFACE]),
        ]
        by_name = running and unit.endswith(".service")
        if by_name:
            calls += [
                (SYSTEMD, None, PROPERTIES_IFACE, b"Get", b"ss", [SERVICE_IFACE, name])
                for name in SERVICE_PROPERTIES
            ]
        elif unit.endswith(".service"):
            calls.append((SYSTEMD, None, PROPERTIES_IFACE, b"GetAll", b"s", [SERVICE_IFACE]))
        _path, props, *rest = await self._run(calls)
        service: Mapping[bytes, Any] = {}
        if by_name:
            service = dict(zip(SERVICE_PROPERTIES, rest, strict=True))
        elif rest:
            service = rest[0]
        state = _merge(_merge(_UNKNOWN, props), service)
        return replace(state, log_facts=_log_facts(props, service))

    async def _read_pids(self, unit: str) -> list[int]:
        try:
            processes = await self._call_manager(b"GetUnitProcesses", b"s", [unit.encode()])
        except UnitError as err:
            if err.no_such_unit:
                return []
            raise
        return [int(pid) for _cgroup, pid, _cmd in processes]

    # Worker-thread side: the only code that touches self._calls.

    def _open_bus(self) -> Any:
        bus = DBusAddress(self.bus_address.encode(), False)
        try:
            bus.open()
        except Exception as err:
            raise UnitError(f"cannot connect to the user bus {self.bus_address}: {err}") from err
        return bus

    def _open_signal_bus(self) -> Any:
        bus = self._open_bus()

        def on_job_removed(msg: Any, error: Any = None, userdata: Any = None) -> None:
            self._dispatched += 1
            self._guard(self._on_job_removed, msg)

        def on_properties(msg: Any, error: Any = None, userdata: Any = None) -> None:
            self._dispatched += 1
            if followed_path(msg.get_path()):
                self._guard(self._on_properties_changed, msg)

        # pystemd keeps no reference to the callbacks: we must.
        self._signal_callbacks = [on_job_removed, on_properties]
        bus.match_signal(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, b"JobRemoved", on_job_removed)
        bus.match_signal(SYSTEMD, None, PROPERTIES_IFACE, b"PropertiesChanged", on_properties)
        bus.call_method(SYSTEMD, MANAGER_PATH, MANAGER_IFACE, b"Subscribe", [])
        return bus

    def _close_buses(self) -> None:
        for bus in (self._calls, self._signals):
            if bus is not None:
                with contextlib.suppress(Exception):
                    bus.close()
        self._calls = None
        self._signals = None

    def _run_here(self, calls: list[Call]) -> list[Any]:
        if self._calls is None:
            raise UnitError("UnitManager is closed")
        try:
            return run_calls(self._calls, calls)
        except Exception as err:
            method = _text(getattr(err, "uapplace_method", b""))
            raise UnitError(
                f"{method}: {_bus_error_text(err)}",
                no_such_unit=type(err).__name__ == "DBusNoSuchUnitError",
            ) from err

    # Loop side: the only code that touches self._signals.

    def _drain_signals(self) -> None:
        bus = self._signals
        if bus is None:
            return
        while True:
            before = self._dispatched
            try:
                msg = bus.process()
            except Exception as err:
                log.error("user manager bus failed: %s", _bus_error_text(err))
                self._on_disconnect()
                return
            if msg.is_empty() and self._dispatched == before:
                return

    def _on_disconnect(self) -> None:
        if self._loop is not None and self._signals is not None:
            with contextlib.suppress(Exception):
                self._loop.remove_reader(self._signals.get_fd())
        for waiter in self._job_waiters.values():
            if not waiter.done():
                waiter.set_exception(UnitError("lost the connection to the user manager"))

    def _guard(self, handler: Callable[[Any], None], msg: Any) -> None:
        # An exception escaping a pystemd callback would surface as a bus error.
        try:
            msg.process_reply(True)
            handler(msg)
        except Exception:
            log.exception("error handling a systemd signal")

    def _on_job_removed(self, msg: Any) -> None:
        _job_id, job_path, _unit, result = msg.body
        job, outcome = _text(job_path), _text(result)
        waiter = self._job_waiters.get(job)
        if waiter is not None:
            if not waiter.done():
                waiter.set_result(outcome)
            return
        self._recent_jobs[job] = outcome
        while len(self._recent_jobs) > _RECENT_JOBS:
            self._recent_jobs.popitem(last=False)

    def _on_properties_changed(self, msg: Any) -> None:
        path = msg.headers.get("Path")
        if not isinstance(path, bytes) or not path.startswith(UNIT_PATH_PREFIX + b"/"):
            return
        interface, changed, _invalidated = msg.body
        if interface not in (UNIT_IFACE, SERVICE_IFACE):
            return
        unit = _text(path_decode(path, UNIT_PATH_PREFIX))
        previous = self._states.get(unit, _UNKNOWN)
        current = _merge(previous, changed)
        if current == previous:
            return
        self._states[unit] = current
        for listener in list(self._listeners):
            try:
                listener(unit, current)
            except Exception:
                log.exception("on_change listener failed for %s", unit)


def _bus_error_text(err: BaseException) -> str:
    """``DBusNoSuchUnitError: Unit x.service not found.`` from a pystemd error."""
    message = getattr(err, "err_message", None)
    if message is None:
        return str(err)
    name = _text(getattr(err, "err_name", "") or "") or type(err).__name__
    return f"{name}: {_text(message)}"


# --------------------------------------------------------------------------- drop-ins


def write_conflict_dropins(
    unit_dir: Path, groups: Mapping[str, Sequence[str]], *, dry_run: bool = False
) -> list[Path]:
    """Make units that share a device conflict, through systemd itself.

    ``groups`` maps a device to the units placed on it. For every unit that
    shares a device, ``<unit_dir>/<unit>.service.d/50-uapplace-conflicts.conf``
    gets ``Conflicts=`` every other unit of its groups, plus ``After=`` those
    that sort before it: one consistent order (no cycle) makes systemd finish
    the stop of the old unit before the start of the new one. Stale drop-ins of
    ours, for units no longer sharing a device, are removed. Returns the paths
    written or removed (unchanged files are not touched); the caller then
    ``reload()``s. Nothing is ever written outside ``unit_dir``; a bad unit name
    raises ``ValueError`` before anything is written. ``dry_run`` touches nothing
    and returns the paths that would change (``uapplace units --check``).
    """
    root = unit_dir.resolve()
    wanted = _conflicts_by_unit(groups)
    changed: list[Path] = []
    for unit, others in sorted(wanted.items()):
        path = _dropin_path(root, unit)
        text = _dropin_text(unit, others)
        if _read_or_none(path) != text:
            if not dry_run:
                _write_inside(root, path, text)
            changed.append(path)
    for stale in sorted(root.glob(f"*.d/{DROPIN_NAME}")):
        if stale.parent.name.removesuffix(".d") not in wanted:
            _check_inside(root, stale)
            if not dry_run:
                stale.unlink()
                with contextlib.suppress(OSError):
                    stale.parent.rmdir()  # only when empty: other drop-ins stay
            changed.append(stale)
    return changed


def has_conflict_dropins(unit_dir: Path) -> bool:
    """Whether any drop-in of ours is in ``unit_dir`` (``uapplace units`` ran here)."""
    return any(unit_dir.glob(f"*.d/{DROPIN_NAME}"))


def _conflicts_by_unit(groups: Mapping[str, Sequence[str]]) -> dict[str, set[str]]:
    members_by_group: dict[str, list[str]] = {}
    for device, units in groups.items():
        checked: list[str] = []
        for index, name in enumerate(units):
            if not isinstance(name, str):
                raise ValueError(f"groups[{device!r}][{index}]: unit name must be a string")
            try:
                checked.append(unit_name(name))
            except ValueError as err:
                raise ValueError(f"groups[{device!r}][{index}]: {err}") from None
        members_by_group[device] = checked
    others: dict[str, set[str]] = {}
    for members in members_by_group.values():
        for unit in members:
            mates = {m for m in members if m != unit}
            if mates:
                others.setdefault(unit, set()).update(mates)
    return others


def _dropin_text(unit: str, others: Iterable[str]) -> str:
    ordered = sorted(others)
    lines = [_DROPIN_HEADER, "[Unit]\n", f"Conflicts={' '.join(ordered)}\n"]
    before = [o for o in ordered if o < unit]
    if before:
        lines.append(f"After={' '.join(before)}\n")
    return "".join(lines)


def _dropin_path(root: Path, unit: str) -> Path:
    return root / f"{unit}.d" / DROPIN_NAME


def _check_inside(root: Path, path: Path) -> None:
    resolved = path.resolve()
    if not resolved.is_relative_to(root) or resolved == root:
        raise ValueError(f"refusing to write {path}: it resolves to {resolved}, outside {root}")


def _read_or_none(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, NotADirectoryError):
        return None


def _write_inside(root: Path, path: Path, text: str) -> None:
    _check_inside(root, path.parent)
    path.parent.mkdir(parents=True, exist_ok=True)
    _check_inside(root, path)
    atomic_write(path, text, mode=0o644, sync=False)


def unit_of(resident: Resident) -> str | None:
    """The ``.service`` unit a resident runs under, or None for one without a unit."""
    return unit_file_name(resident.unit) if resident.unit else None


def units_of(residents: Iterable[Resident]) -> list[str]:
    """The distinct units of ``residents``, in order."""
    return list(dict.fromkeys(u for u in (unit_of(r) for r in residents) if u))
