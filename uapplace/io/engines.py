"""HTTP probes of engines (llama.cpp-like servers) and of the proxy's internal routes.

``endpoint`` is the engine's base URL (``http://127.0.0.1:8080``); a trailing
``/`` or ``/v1`` is dropped, since ``/health``, ``/slots`` and ``/metrics`` live
at the root. Every probe has a short timeout (2 s unless given).

:func:`metrics` parses the Prometheus text format with ``prometheus_client``'s parser
(``text_string_to_metric_families``) into a flat dict:

- each sample under its series name: ``llamacpp:max_context`` → ``131072.0``,
  ``llamacpp:engine_info{kv="int8"}`` → ``1.0`` (labels as ``name="value"``,
  comma-separated, in the order served);
- a namespaced name also under its bare name, unless a sample already has it:
  ``max_context`` → ``131072.0``;
- every label of an ``*_info`` metric as a string: ``kv`` → ``"int8"``.

So ``metricsMustMatch`` (``{"kv": "int8", "max_context": 131072}``) is checked
with plain lookups. :mod:`uapplace.sim.engine` serves exactly these names.

llama.cpp's ``/metrics`` has counters and gauges only (no context size, no
settings); its settings are in ``GET /props``. :func:`props_facts` flattens
``/props`` the same way: every top-level string, number or boolean under its own
name (``total_slots`` → ``2.0``, ``build_info`` → ``"b1-0c1e570"``,
``is_sleeping`` → ``"false"``; a boolean as ``"true"``/``"false"``), plus
``n_ctx`` → ``default_generation_settings.n_ctx``, one slot's context. The
publication check reads ``/props`` only for a ``metricsMustMatch`` key
``/metrics`` lacks (:func:`uapplace.publish.verify.metrics_problem`).

Sleep, never undone by a probe: llama.cpp started with ``--sleep-idle-seconds``
frees its model when idle and says so in ``/props`` ``is_sleeping``; ``/health``,
``/props``, ``/v1/models`` and ``/metrics`` answer without waking it, but
**``GET /slots`` wakes it** (it is a task). :func:`sleep_state` asks ``/props``
first and vLLM's ``GET /is_sleeping`` only when ``/props`` has no answer, so one
call serves either engine kind; :func:`slots` asks ``/props`` first and never
calls ``/slots`` on a sleeping engine.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ValidationError

from uapplace.core.validation import first_error_text

PROBE_TIMEOUT_S = 2.0
PROXY_TIMEOUT_S = 2.0
INFLIGHT_PATH = "/internal/placement/inflight"
REFRESH_PATH = "/internal/placement/refresh"


class EngineError(Exception):
    """An engine did not answer a probe usably; the message names the URL and why."""


def engine_root(endpoint: str) -> str:
    """``http://h:8080/v1/`` → ``http://h:8080``: where ``/health`` and ``/metrics`` live."""
    url = endpoint.rstrip("/")
    return url.removesuffix("/v1")


async def _request(
    method: str, url: str, timeout_s: float, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    """One HTTP request in a session of its own: the status and the body as text."""
    client_timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=client_timeout) as session,
        session.request(method, url, headers=headers) as response,
    ):
        return response.status, await response.text()


async def _answer(method: str, url: str, timeout_s: float) -> tuple[int, str]:
    """:func:`_request`; no answer at all (refused, reset, timed out) is an :class:`EngineError`."""
    try:
        return await _request(method, url, timeout_s)
    except (aiohttp.ClientError, TimeoutError) as err:
        raise EngineError(f"{method} {url}: {_describe(err)}") from None


def _not_ok(method: str, url: str, status: int, text: str) -> EngineError:
    return EngineError(f"{method} {url}: HTTP {status}: {text[:200]}")


async def _get_ok(url: str, timeout_s: float) -> str:
    """The body of a ``GET`` that answered 200; :class:`EngineError` otherwise."""
    status, text = await _answer("GET", url, timeout_s)
    if status != 200:
        raise _not_ok("GET", url, status, text)
    return text


async def _get_json(url: str, timeout_s: float) -> Any:
    text = await _get_ok(url, timeout_s)
    try:
        return json.loads(text)
    except ValueError as err:
        raise EngineError(f"GET {url}: body is not JSON: {err}") from None


def _describe(err: BaseException) -> str:
    if isinstance(err, TimeoutError):
        return "timed out"
    return str(err) or type(err).__name__


# --------------------------------------------------------------------------- engine probes


async def health(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """``GET /health`` answered 200. Loading (503), errors and timeouts are ``False``."""
    try:
        status, _ = await _request("GET", f"{engine_root(endpoint)}/health", timeout_s)
    except (aiohttp.ClientError, TimeoutError):
        return False
    return status == 200


class _Model(BaseModel):
    id: str
    aliases: list[str] | None = None
    """llama.cpp's other names for the model: ``--alias b,a`` serves ONE entry whose ``id``
    is the alphabetically first alias (``a``) and whose ``aliases`` holds both."""


class _ModelList(BaseModel):
    data: list[_Model]


async def served_ids(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> list[str]:
    """The ids of ``GET /v1/models``, in the order served, each entry's ``aliases`` after
    its ``id`` (once each): a request naming any of them is served. Raises
    :class:`EngineError`."""
    url = f"{engine_root(endpoint)}/v1/models"
    body = await _get_json(url, timeout_s)
    try:
        listed = _ModelList.model_validate(body).data
    except ValidationError as err:
        raise EngineError(
            f"GET {url}: not an OpenAI model list: {first_error_text(err, '(body)')}"
        ) from None
    return list(
        dict.fromkeys(name for model in listed for name in (model.id, *(model.aliases or ())))
    )


async def get_reply(
    endpoint: str, route: str, timeout_s: float = PROBE_TIMEOUT_S
) -> tuple[int | None, str]:
    """``GET <root><route>`` as answered: ``(status, body)``, or ``(None, why)`` when nothing
    answered (refused, reset, timed out). Never raises: the drain asks several routes and
    reports what each said (:mod:`uapplace.io.busy`)."""
    url = f"{engine_root(endpoint)}{route}"
    try:
        return await _request("GET", url, timeout_s)
    except (aiohttp.ClientError, TimeoutError) as err:
        return None, _describe(err)


async def slots(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> list[dict[str, Any]] | None:
    """``GET /slots`` as served, or ``None`` when the engine cannot tell (no such
    route, loading, error, not a list of objects): unknown, never a guess.

    ``/props`` is asked first: when it says ``is_sleeping: true`` the answer is ``None``
    and ``/slots`` is never asked, since it would wake the engine (module doc)."""
    if await _props_says_asleep(endpoint, timeout_s):
        return None
    try:
        body = await _get_json(f"{engine_root(endpoint)}/slots", timeout_s)
    except EngineError:
        return None
    if not isinstance(body, list) or not all(isinstance(slot, dict) for slot in body):
        return None
    return body


async def metrics(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, float | str]:
    """``GET /metrics`` parsed (see the module doc). Raises :class:`EngineError`."""
    url = f"{engine_root(endpoint)}/metrics"
    text = await _get_ok(url, timeout_s)
    try:
        return parse_prometheus(text)
    except ValueError as err:
        raise EngineError(f"GET {url}: {err}") from None


# --------------------------------------------------------------------------- /props

PROPS_ROUTE = "/props"
N_CTX_SETTING = "default_generation_settings"
"""The ``/props`` object whose ``n_ctx`` is one slot's context (llama.cpp)."""


async def props(endpoint: str, timeout_s: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """``GET /props`` as served: a JSON object. Raises :class:`EngineError`. It never
    wakes a sleeping llama.cpp (module doc)."""
    url = f"{engine_root(endpoint)}{PROPS_ROUTE}"
    status, text = await _answer("GET", url, timeout_s)
    return props_body(url, status, text)


def props_body(url: str, status: int | None, text: str) -> dict[str, Any]:
    """The JSON object of a ``/props`` answer, else :class:`EngineError` naming ``url``
    (``status`` ``None``: nothing answered, and ``text`` says why)."""
    if status is None:
        raise EngineError(f"GET {url}: {text}")
    if status != 200:
        raise _not_ok("GET", url, status, text)
    try:
        body = json.loads(text)
    except ValueError as err:
        raise EngineError(f"GET {url}: body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise EngineError(f"GET {url}: not a JSON object: {text[:120]}")
    return body


def props_facts(body: Mapping[str, Any]) -> dict[str, float | str]:
    """``/props`` as facts ``metricsMustMatch`` can check (module doc): each top-level
    scalar under its name, and ``n_ctx`` from ``default_generation_settings``."""
    facts: dict[str, float | str] = {}
    for key, value in body.items():
        fact = _fact(value)
        if fact is not None:
            facts[key] = fact
    settings = body.get(N_CTX_SETTING)
    if "n_ctx" not in facts and isinstance(settings, dict):
        fact = _fact(settings.get("n_ctx"))
        if fact is not None:
            facts["n_ctx"] = fact
    return facts


def props_fact_source(key: str, body: Mapping[str, Any]) -> str:
    """Where :func:`props_facts` found ``key``, for a message: ``/props total_slots``."""
    if key == "n_ctx" and key not in body:
        return f"{PROPS_ROUTE} {N_CTX_SETTING}.n_ctx"
    return f"{PROPS_ROUTE} {key}"


def _fact(value: object) -> float | str | None:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float) and math.isfinite(value):
        return float(value)
    if isinstance(value, str):
        return value
    return None


def props_sleeping(body: Mapping[str, Any]) -> bool | None:
    """``/props`` ``is_sleeping`` when it is a boolean; ``None`` when ``/props`` has none
    (a router's own ``/props``, an older server)."""
    value = body.get("is_sleeping")
    return value if isinstance(value, bool) else None


async def _props_says_asleep(endpoint: str, timeout_s: float) -> bool:
    try:
        return props_sleeping(await props(endpoint, timeout_s)) is True
    except EngineError:
        return False


async def wait_healthy(
    endpoint: str, deadline: float, first_interval: float = 0.05, max_interval: float = 1.0
) -> bool:
    """Poll ``/health`` until 200 (``True``) or ``time.monotonic()`` passes ``deadline``
    (``False``). The first retry comes after ``first_interval``; the pause doubles
    up to ``max_interval``, never past the deadline."""
    interval = first_interval
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        if await health(endpoint, timeout_s=min(PROBE_TIMEOUT_S, remaining)):
            return True
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        await asyncio.sleep(min(interval, remaining))
        interval = min(interval * 2, max_interval)


# --------------------------------------------------------------------------- sleep mode

SLEEP_TIMEOUT_S = 60.0
"""Default bound of one sleep or wake call: level 1 copies the weights to host RAM and
waking copies them back, seconds for a large model (callers pass the envelope's bound)."""
SLEEP_LEVELS = (1, 2)
# The three calls below take ``timeout`` (not ``timeout_s`` like the probes above): the
# name agreed with the pause path that calls them (issue 12).


async def _post_ok(url: str, timeout_s: float) -> None:
    status, text = await _answer("POST", url, timeout_s)
    if status == 404:
        raise EngineError(
            f"POST {url}: HTTP 404: the engine has no sleep route (vLLM needs "
            "--enable-sleep-mode and VLLM_SERVER_DEV_MODE=1)"
        )
    if status != 200:
        raise _not_ok("POST", url, status, text)


async def sleep(
    endpoint: str,
    level: int,
    timeout: float = SLEEP_TIMEOUT_S,  # noqa: ASYNC109
) -> None:
    """vLLM's ``POST /sleep?level=N``: level 1 offloads the weights to host RAM and drops
    the KV cache, level 2 discards both. Returns once the engine answered 200 (vLLM
    answers after the memory is released). Raises :class:`EngineError` otherwise,
    ``ValueError`` for a level vLLM does not have."""
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    await _post_ok(f"{engine_root(endpoint)}/sleep?level={level}", timeout)


async def wake(
    endpoint: str,
    timeout: float = SLEEP_TIMEOUT_S,  # noqa: ASYNC109
) -> None:
    """vLLM's ``POST /wake_up``: reloads the weights (and re-allocates the KV cache).
    Returns once the engine answered 200. Raises :class:`EngineError` otherwise (the
    caller still verifies the engine serves before publishing it)."""
    await _post_ok(f"{engine_root(endpoint)}/wake_up", timeout)


class _SleepState(BaseModel):
    is_sleeping: bool


SleepSource = Literal["props", "is_sleeping"]


@dataclass(frozen=True)
class SleepState:
    """Whether an engine is asleep, and which route said so."""

    asleep: bool
    source: SleepSource
    """``props``: llama.cpp's ``/props`` ``is_sleeping`` (its idle sleep,
    ``--sleep-idle-seconds``); ``is_sleeping``: vLLM's ``GET /is_sleeping`` (its
    ``POST /sleep``)."""

    def why_asleep(self) -> str:
        """How the engine came to sleep, for a message (what wakes it differs)."""
        if self.source == "props":
            return "llama.cpp --sleep-idle-seconds, /props is_sleeping"
        return "vLLM POST /sleep, /is_sleeping"


async def sleep_state(
    endpoint: str,
    timeout: float = PROBE_TIMEOUT_S,  # noqa: ASYNC109
) -> SleepState | None:
    """Is the engine asleep? ``/props`` ``is_sleeping`` first (llama.cpp; it does not
    wake the engine), else vLLM's ``GET /is_sleeping`` → ``{"is_sleeping": bool}``.
    ``None`` when neither tells (no route, error, another body, nothing answered):
    unknown, never a guess."""
    url = f"{engine_root(endpoint)}{PROPS_ROUTE}"
    try:
        status, text = await _request("GET", url, timeout)
    except (aiohttp.ClientError, TimeoutError):
        return None  # nothing answered: asking a second route would only wait twice
    try:
        asleep = props_sleeping(props_body(url, status, text))
    except EngineError:
        asleep = None
    if asleep is not None:
        return SleepState(asleep, "props")
    try:
        body = await _get_json(f"{engine_root(endpoint)}/is_sleeping", timeout)
        return SleepState(_SleepState.model_validate(body).is_sleeping, "is_sleeping")
    except (EngineError, ValidationError):
        return None


async def is_sleeping(
    endpoint: str,
    timeout: float = PROBE_TIMEOUT_S,  # noqa: ASYNC109
) -> bool | None:
    """:func:`sleep_state` as a plain answer: llama.cpp or vLLM; ``None`` = unknown."""
    state = await sleep_state(endpoint, timeout)
    return None if state is None else state.asleep


# --------------------------------------------------------------------------- Prometheus text


def parse_prometheus(text: str) -> dict[str, float | str]:
    """The flat dict of the module doc, read with ``prometheus_client``'s own text parser.
    Raises ``ValueError`` naming the bad line (its number, the parser's why, the line)."""
    try:
        samples = [
            sample
            for family in text_string_to_metric_families(_untyped(text))
            for sample in family.samples
        ]
    except ValueError:
        raise _bad_line(text) from None
    flat: dict[str, float] = {}
    aliases: dict[str, float] = {}
    info: dict[str, str] = {}
    for sample in samples:
        value = float(sample.value)
        series = sample.name
        if sample.labels:
            series = f"{sample.name}{{{_format_labels(sample.labels)}}}"
        flat[series] = value
        if not sample.labels and ":" in sample.name:
            aliases.setdefault(sample.name.rsplit(":", 1)[1], value)
        if sample.name.endswith("_info"):
            for key, label_value in sample.labels.items():
                info.setdefault(key, label_value)
    result: dict[str, float | str] = dict(flat)
    for key, number_value in aliases.items():
        result.setdefault(key, number_value)
    for key, label_value in info.items():
        result.setdefault(key, label_value)
    return result


def _untyped(text: str) -> str:
    """``text`` without its ``# TYPE`` lines, so every sample keeps the name it was served
    under: typed, the parser renames a counter ``x`` to ``x_total`` (the OpenMetrics form),
    and llama.cpp serves counters without ``_total`` (``llamacpp:n_tokens_max``) that
    ``metricsMustMatch`` names as served. The flat dict has no use for the types."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("# TYPE"))


def _bad_line(text: str) -> ValueError:
    """The first line the parser refuses on its own, for the message (the whole text was
    refused; a line that only fails beside others, such as a repeated ``# TYPE``, is
    named as the text)."""
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        try:
            list(text_string_to_metric_families(line + "\n"))
        except ValueError as err:
            return ValueError(f"metrics line {number}: {err}: {line[:120]!r}")
    try:
        list(text_string_to_metric_families(_untyped(text)))
    except ValueError as err:
        return ValueError(f"metrics: {err}")
    return ValueError("metrics: not the Prometheus text format")


def _format_labels(labels: Mapping[str, str]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

    return ",".join(f'{key}="{escape(value)}"' for key, value in labels.items())


# --------------------------------------------------------------------------- the proxy


class _Inflight(BaseModel):
    targets: dict[str, list[dict[str, Any]]]


class ProxyTokenRejected(EngineError):
    """The proxy answered 401 on an internal route: our token is not the proxy's.

    Not "unknown, try again": no amount of waiting fixes a wrong token, so a
    drain stops at once on it (enforce.py) and an alert names it, where a plain
    unavailable list would keep the victim draining (parked) for the whole drain
    timeout.
    """


def token_mismatch_message(url: str, has_token: bool) -> str:
    """The one text every surface shows for a 401 from the proxy."""
    sent = "the token from PROXY_AUTH_TOKEN" if has_token else "no token (none is configured)"
    return (
        f"the proxy at {url} refused {sent} (HTTP 401): uapplaced and the proxy have "
        "different tokens; set the same PROXY_AUTH_TOKEN for both and restart uapplaced"
    )


class ProxyClient:
    """The proxy's internal placement routes (docs/http-contract.md §3)."""

    def __init__(
        self, base_url: str, token: str | None, timeout_s: float = PROXY_TIMEOUT_S
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.timeout_s = timeout_s

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"} if self.token else {}

    async def _request(self, method: str, path: str) -> tuple[int, str]:
        return await _request(method, f"{self.base_url}{path}", self.timeout_s, self._headers())

    async def inflight(self) -> dict[str, list[dict[str, Any]]] | None:
        """``{target_id: [request…]}``; ``None`` = unknown (non-200, error, bad body),
        which callers must treat as busy. A target absent from a good answer is idle.
        A 401 raises :class:`ProxyTokenRejected` (a wrong token is not "unknown")."""
        try:
            status, text = await self._request("GET", INFLIGHT_PATH)
        except (aiohttp.ClientError, TimeoutError):
            return None
        if status == 401:
            url = f"{self.base_url}{INFLIGHT_PATH}"
            raise ProxyTokenRejected(token_mismatch_message(url, bool(self.token)))
        if status != 200:
            return None
        try:
            return _Inflight.model_validate_json(text).targets
        except ValidationError:
            return None

    async def refresh(self) -> tuple[bool, str]:
        """``POST /internal/placement/refresh``: ``(ok, detail)`` for the ``refresh-proxy`` step."""
        url = f"{self.base_url}{REFRESH_PATH}"
        try:
            status, text = await self._request("POST", REFRESH_PATH)
        except (aiohttp.ClientError, TimeoutError) as err:
            return False, f"POST {url}: {_describe(err)}"
        if status == 401:
            return False, token_mismatch_message(url, bool(self.token))
        if status != 200:
            return False, f"POST {url}: HTTP {status}: {text[:200]}"
        try:
            body = json.loads(text)
        except ValueError:
            return False, f"POST {url}: body is not JSON"
        if not isinstance(body, dict) or body.get("ok") is not True:
            return False, f"POST {url}: proxy did not answer ok: {text[:200]}"
        cleared = body.get("cleared")
        if isinstance(cleared, list) and cleared:
            return True, "cleared " + ", ".join(str(item) for item in cleared)
        return True, "refreshed"

    async def check(self) -> str | None:
        """For ``validate``: the problem with reaching the in-flight route, or ``None``.

        A 401 is the token mismatch message; an unreachable proxy or a bad answer is
        named as such (the proxy may simply be down, which ``validate`` reports
        as a finding like any other)."""
        url = f"{self.base_url}{INFLIGHT_PATH}"
        try:
            targets = await self.inflight()
        except ProxyTokenRejected as err:
            return str(err)
        if targets is None:
            return (
                f"GET {url}: no usable answer (proxy down, or not speaking "
                "docs/http-contract.md §3)"
            )
        return None
