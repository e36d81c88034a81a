"""llama.cpp's router mode: the client of ``llama-server --models-dir DIR --models-max N``.

docs/placement-rules.md §4.2 ("What paused is"): a config whose ``pause_lever`` is
``llamacpp-router`` is one model of a router, a llama-server that loads each of its
models in a child process of its own. Every model of one router shares the router's
``unit`` and ``endpoint`` in the registry; what tells them apart is the **router model
id** (:func:`router_model_id`): the model's first advertised id, else its key. It is the
id the router lists in ``GET /models`` (a GGUF file's stem under ``--models-dir``, or a
``--models-preset`` section) and the id it serves.

The router's own routes (read from llama.cpp's ``tools/server``, checked against the
real binary):

- ``GET /models`` (= ``/v1/models``): every model it knows, **loaded or not**, each with
  ``status.value`` (``unloaded``, ``loading``, ``loaded``, ``sleeping``; ``downloading``
  for hub models) and, after a load that failed, ``failed: true`` and ``exit_code``. So a
  served id in ``/v1/models`` proves nothing for a router: only the status does.
- ``POST /models/load`` / ``POST /models/unload`` ``{"model": ID}`` answer at once
  (``{"success": true}``); the status then moves. Loading a running model answers 400
  ``model is already running``, unloading a stopped one 400 ``model is not running``:
  both are the state asked for, so :class:`HttpRouter` takes them as done.
- ``GET /slots``, ``/props`` and ``/metrics`` route by ``?model=ID`` and **load the model
  when it is not loaded** unless ``&autoload=false`` is added: every probe here adds it
  (:func:`model_query`), so no probe of uapplace ever loads a model (or evicts another
  under ``--models-max``).
- Each loaded model is a child process of the router (the same binary, ``--alias ID
  --port P`` among its arguments), in the router unit's cgroup. SIGTERM to a child is
  ignored (it waits for the router): a child leaves through ``/models/unload``.

The seam: enforcement and the publication check use a :class:`RouterProbe` (the real
one is :data:`HTTP_ROUTER`; the unit tier passes a fake). :func:`wait_for` follows a
model's status to the one wanted; :func:`child_pids` finds one model's child among the
unit's processes (measure and verify-free read that child, never the router or a
sibling).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import quote

import aiohttp
import psutil
from pydantic import BaseModel, ConfigDict, ValidationError

from uapplace.core.model import Config, Model
from uapplace.core.unitnames import unit_file_name
from uapplace.core.validation import first_error_text
from uapplace.io.engines import EngineError, engine_root, parse_prometheus

UNLOADED = "unloaded"
LOADING = "loading"
LOADED = "loaded"
SLEEPING = "sleeping"
SERVING = frozenset({LOADED, SLEEPING})
"""Statuses of a model that answers requests: a child idle-asleep
(``--sleep-idle-seconds``) wakes on the next one, so it serves."""
RUNNING = frozenset({LOADING, LOADED, SLEEPING})
"""Statuses of a model whose child process exists (the router's ``is_running``)."""

ROUTER_TIMEOUT_S = 2.0


class RouterError(EngineError):
    """A router did not do what was asked, or did not say; the message says which and why."""


# --------------------------------------------------------------------------- registry side


def is_router_config(config: Config | None) -> bool:
    """``config`` is one model of a llama.cpp router (``pause_lever: llamacpp-router``)."""
    return config is not None and config.is_router_model


def router_model_id(model: Model) -> str:
    """The id a router knows ``model`` by: its first advertised id, else its key
    (docs/placement-rules.md §4.2, "What paused is")."""
    return model.advertises[0] if model.advertises else model.key


@dataclass(frozen=True)
class RouterSlot:
    """One router model: its router's unit and endpoint, and its id on that router."""

    unit: str
    """The router's unit file name (``x.service``)."""
    endpoint: str
    model_id: str

    @property
    def label(self) -> str:
        """``the router uap-llama-router.service (http://127.0.0.1:8080)``."""
        return f"the router {self.unit} ({self.endpoint})"


def router_slot(model: Model, config: Config | None) -> RouterSlot | None:
    """Where ``model``'s ``config`` lives when it is a router model with a unit and an
    endpoint; ``None`` otherwise (not a router model, or the registry names no router)."""
    if config is None or not is_router_config(config):
        return None
    unit = model.unit_for(config)
    endpoint = model.endpoint_for(config)
    if not unit or not endpoint:
        return None
    return RouterSlot(unit_file_name(unit), endpoint, router_model_id(model))


def model_query(model_id: str) -> str:
    """``model=ID&autoload=false``: route to ``model_id``'s child, never load it."""
    return f"model={quote(model_id, safe='')}&autoload=false"


# --------------------------------------------------------------------------- what the router says


class _Status(BaseModel):
    model_config = ConfigDict(extra="ignore")
    value: str
    args: list[str] = []
    failed: bool = False
    exit_code: int | None = None


class _Entry(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    aliases: list[str] = []
    status: _Status


class _Listing(BaseModel):
    model_config = ConfigDict(extra="ignore")
    data: list[_Entry]


@dataclass(frozen=True)
class RouterModel:
    """One entry of a router's ``GET /models``."""

    id: str
    status: str
    aliases: tuple[str, ...] = ()
    args: tuple[str, ...] = ()
    """The child's command line (rendered even while unloaded)."""
    failed: bool = False
    exit_code: int | None = None

    @property
    def serving(self) -> bool:
        return self.status in SERVING

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    def text(self) -> str:
        """``tiny-a unloaded (failed, exit code 1)``."""
        failed = f" (failed, exit code {self.exit_code})" if self.failed else ""
        return f"{self.id} {self.status}{failed}"


def parse_models(body: Any, url: str) -> dict[str, RouterModel]:
    """A router's ``GET /models`` body → id → :class:`RouterModel`. Raises
    :class:`RouterError` naming the URL when it is not a router's listing (a single-model
    llama-server's entries carry no ``status``)."""
    try:
        listing = _Listing.model_validate(body)
    except ValidationError as err:
        raise RouterError(
            f"GET {url}: not a llama.cpp router's model list (is the server started with "
            f"--models-dir?): {first_error_text(err, '(body)')}"
        ) from None
    return {
        entry.id: RouterModel(
            entry.id,
            entry.status.value,
            tuple(entry.aliases),
            tuple(entry.status.args),
            entry.status.failed,
            entry.status.exit_code,
        )
        for entry in listing.data
    }


def find(models: Mapping[str, RouterModel], model_id: str) -> RouterModel | None:
    """The entry ``model_id`` names, by id or alias (the router resolves both)."""
    if model_id in models:
        return models[model_id]
    return next((m for m in models.values() if model_id in m.aliases), None)


# --------------------------------------------------------------------------- the seam


class RouterProbe(Protocol):
    """A router's routes as enforcement and the publication check use them. Failures
    raise :class:`RouterError` (an :class:`~uapplace.io.engines.EngineError`)."""

    async def models(self, endpoint: str, timeout_s: float) -> dict[str, RouterModel]: ...

    async def load(self, endpoint: str, model_id: str, timeout_s: float) -> None: ...

    async def unload(self, endpoint: str, model_id: str, timeout_s: float) -> None: ...

    async def children(self, pids: Sequence[int], model_id: str) -> list[int]:
        """Which of ``pids`` (the router unit's processes) run ``model_id``'s child."""
        ...

    async def metrics(
        self, endpoint: str, model_id: str, timeout_s: float
    ) -> dict[str, float | str]: ...


async def _request(
    method: str, url: str, timeout_s: float, body: dict[str, Any] | None = None
) -> tuple[int, str]:
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session,
            session.request(method, url, json=body) as response,
        ):
            return response.status, await response.text()
    except TimeoutError:
        raise RouterError(f"{method} {url}: timed out") from None
    except aiohttp.ClientError as err:
        raise RouterError(f"{method} {url}: {err or type(err).__name__}") from None


def _error_message(text: str) -> str:
    """llama.cpp's ``{"error": {"message": …}}``, else the body's start."""
    try:
        body = json.loads(text)
    except ValueError:
        return text[:200]
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:200]
    return text[:200]


class HttpRouter:
    """:class:`RouterProbe` over HTTP and ``/proc``. Stateless."""

    async def models(self, endpoint: str, timeout_s: float) -> dict[str, RouterModel]:
        url = f"{engine_root(endpoint)}/models"
        status, text = await _request("GET", url, timeout_s)
        if status != 200:
            raise RouterError(f"GET {url}: HTTP {status}: {_error_message(text)}")
        try:
            body = json.loads(text)
        except ValueError as err:
            raise RouterError(f"GET {url}: body is not JSON: {err}") from None
        return parse_models(body, url)

    async def load(self, endpoint: str, model_id: str, timeout_s: float) -> None:
        await self._post(endpoint, "load", model_id, "model is already running", timeout_s)

    async def unload(self, endpoint: str, model_id: str, timeout_s: float) -> None:
        await self._post(endpoint, "unload", model_id, "model is not running", timeout_s)

    async def _post(
        self, endpoint: str, verb: str, model_id: str, already: str, timeout_s: float
    ) -> None:
        url = f"{engine_root(endpoint)}/models/{verb}"
        status, text = await _request("POST", url, timeout_s, {"model": model_id})
        if status == 200:
            return
        message = _error_message(text)
        if status == 400 and already in message:
            return  # already in the state asked for: the status wait decides
        if status == 404:
            raise RouterError(
                f"POST {url} {{'model': {model_id!r}}}: HTTP 404 ({message}): the router has "
                "no such model, or is not a router (a single-model llama-server has no "
                "/models/load)"
            )
        raise RouterError(f"POST {url} {{'model': {model_id!r}}}: HTTP {status}: {message}")

    async def children(self, pids: Sequence[int], model_id: str) -> list[int]:
        return await asyncio.to_thread(child_pids, pids, model_id)

    async def metrics(
        self, endpoint: str, model_id: str, timeout_s: float
    ) -> dict[str, float | str]:
        url = f"{engine_root(endpoint)}/metrics?{model_query(model_id)}"
        status, text = await _request("GET", url, timeout_s)
        if status != 200:
            raise RouterError(f"GET {url}: HTTP {status}: {_error_message(text)}")
        try:
            return parse_prometheus(text)
        except ValueError as err:
            raise RouterError(f"GET {url}: {err}") from None


HTTP_ROUTER = HttpRouter()
"""The real routers; stateless, so one instance serves every caller."""


# --------------------------------------------------------------------------- waiting


async def status_of(
    probe: RouterProbe, endpoint: str, model_id: str, timeout_s: float
) -> RouterModel:
    """``model_id``'s entry now; :class:`RouterError` when the router does not list it."""
    models = await probe.models(endpoint, timeout_s)
    found = find(models, model_id)
    if found is None:
        known = ", ".join(sorted(models)) or "none"
        raise RouterError(
            f"the router at {endpoint} has no model {model_id!r} (it lists: {known}); "
            "the id is the model's first advertised id, else its registry key"
        )
    return found


@dataclass(frozen=True)
class Polling:
    """How a wait polls: the first pause, its growth cap, and each call's bound."""

    first_s: float = 0.05
    max_s: float = 0.5
    http_s: float = ROUTER_TIMEOUT_S


async def wait_for(
    probe: RouterProbe,
    endpoint: str,
    model_id: str,
    want: frozenset[str],
    limit_s: float,
    polling: Polling = Polling(),
) -> RouterModel:
    """Poll ``GET /models`` until ``model_id``'s status is one of ``want``; that entry.

    Raises :class:`RouterError` at ``limit_s`` (naming the last status seen), at once
    when a load is wanted and the model shows ``unloaded`` (its child exited: a failed
    load shows ``failed`` and the exit code), and when the router stops answering
    usably for the whole wait.
    """
    deadline = time.monotonic() + limit_s
    interval = polling.first_s
    last = "no answer yet"
    loading_wanted = bool(want & SERVING)
    while True:
        remaining = deadline - time.monotonic()
        try:
            seen = await status_of(
                probe, endpoint, model_id, max(0.05, min(polling.http_s, remaining))
            )
        except RouterError as err:
            last = str(err)
        else:
            if seen.status in want:
                return seen
            last = seen.text()
            if loading_wanted and seen.status == UNLOADED:
                raise RouterError(f"the router at {endpoint} says {last}: the load ended")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            wanted = " or ".join(sorted(want))
            raise RouterError(
                f"{model_id} not {wanted} on the router at {endpoint} after {limit_s:g}s "
                f"(last seen: {last})"
            )
        await asyncio.sleep(min(interval, remaining))
        interval = min(interval * 1.5, polling.max_s)


# --------------------------------------------------------------------------- the children


def alias_of(cmdline: Sequence[str]) -> str | None:
    """The ``--alias`` (``-a``) value of a llama-server command line, ``None`` without one.

    The router starts each child with ``--alias ID``: that is how one model's process is
    told apart from the router (which has none of its own that counts) and its siblings.
    """
    for index, arg in enumerate(cmdline):
        if arg in ("--alias", "-a") and index + 1 < len(cmdline):
            return cmdline[index + 1]
        if arg.startswith("--alias="):
            return arg.split("=", 1)[1]
    return None


def child_pids(pids: Iterable[int], model_id: str) -> list[int]:
    """The processes among ``pids`` whose command line carries ``--alias model_id``
    (sorted; a process that is gone or unreadable is not one)."""
    found: list[int] = []
    for pid in pids:
        try:
            cmdline = psutil.Process(pid).cmdline()
        except (psutil.Error, OSError):
            continue
        if alias_of(cmdline) == model_id:
            found.append(pid)
    return sorted(found)


__all__ = [
    "HTTP_ROUTER",
    "LOADED",
    "LOADING",
    "RUNNING",
    "SERVING",
    "SLEEPING",
    "UNLOADED",
    "HttpRouter",
    "Polling",
    "RouterError",
    "RouterModel",
    "RouterProbe",
    "RouterSlot",
    "alias_of",
    "child_pids",
    "find",
    "is_router_config",
    "model_query",
    "parse_models",
    "router_model_id",
    "router_slot",
    "status_of",
    "wait_for",
]
