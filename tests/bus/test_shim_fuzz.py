"""Fuzzing the live shim from its own OpenAPI document (hypothesis), real daemon behind it.

Requests are drawn per operation of ``GET /openapi.json``: bodies and query
parameters generated from the schemas, then mutated (fields dropped, wrong
types, unknown fields, huge strings, NUL and lone surrogates, other unicode),
plus non-JSON bytes, wrong methods, unknown paths, missing or wrong tokens.

Every answer must be a well-formed response below 500 with a JSON body (an
``{"error": …}`` one from 400 up), the shim must not die, and the daemon must
still answer ``Admit`` afterwards. One exception, named and counted: on this
tier there is no systemd user manager, so a *valid* Apply/Load/Unload gets the
documented ``503`` "<Method> is not available: …" (the daemon is up, the
machinery is not here). No 500 is allowed at all.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from http.client import HTTPConnection
from typing import Any
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.bus import shim_fixtures
from tests.bus.conftest import SEEDED_ENDPOINT, DaemonProcess, UapEnv, call_json
from tests.bus.shim_fixtures import (
    Reply,
    ShimProcess,
    request,
)

pytestmark = pytest.mark.bus

EXAMPLES = 300
NO_MACHINERY = re.compile(
    r"^(Apply|Load|Unload) is not available: it needs the systemd user manager"
)
"""The daemon's answer to a valid enforcement without a systemd user manager (a 503)."""
KNOWN_MODELS = ("alpha", "alpha-chat", "alpha-q4", "beta", "gamma")

any_char = st.characters(exclude_categories=())
wild_text = st.text(alphabet=any_char, max_size=40)
plain_text = st.text(alphabet=string.ascii_letters + string.digits + "-_.:/", max_size=24)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | wild_text
)
junk_json = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(wild_text, children, max_size=4)
    ),
    max_leaves=8,
)


# --------------------------------------------------------------------------- fixtures


daemon = shim_fixtures.daemon
shim = shim_fixtures.shim


# --------------------------------------------------------------------------- schema → strategy


def resolve(schema: dict[str, Any], document: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        node: Any = document
        for part in schema["$ref"].removeprefix("#/").split("/"):
            node = node[part]
        schema = node
    return schema


def from_schema(schema: dict[str, Any], document: dict[str, Any]) -> st.SearchStrategy[Any]:
    """Values valid for the subset of JSON Schema the shim's document uses."""
    schema = resolve(schema, document)
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            return st.one_of([from_schema(s, document) for s in schema[combinator]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}, document) for k in kind])
    if kind == "string":
        low = schema.get("minLength", 0)
        return st.one_of(
            st.text(
                alphabet=string.ascii_letters + string.digits + "-_.", min_size=low, max_size=24
            ),
            st.sampled_from(KNOWN_MODELS),
        )
    if kind == "integer":
        return st.integers(schema.get("minimum", -(2**40)), schema.get("maximum", 2**40))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(from_schema(schema.get("items", {}), document), max_size=3)
    if kind == "object" or "properties" in schema:
        properties = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {
                name: from_schema(sub, document)
                for name, sub in properties.items()
                if name in required
            },
            optional={
                name: from_schema(sub, document)
                for name, sub in properties.items()
                if name not in required
            },
        )
    return junk_json


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> Any:
    """A valid object with one thing wrong (or, sometimes, nothing wrong)."""
    value = dict(valid)
    how = draw(st.sampled_from(["none", "drop", "retype", "extra", "huge", "unicode", "nested"]))
    keys = sorted(value)
    if how == "drop" and keys:
        value.pop(draw(st.sampled_from(keys)))
    elif how == "retype" and keys:
        value[draw(st.sampled_from(keys))] = draw(junk_json)
    elif how == "extra":
        value[draw(wild_text)] = draw(junk_json)
    elif how == "huge" and keys:
        value[draw(st.sampled_from(keys))] = "x" * draw(st.sampled_from([129, 1025, 9000, 20000]))
    elif how == "unicode" and keys:
        value[draw(st.sampled_from(keys))] = draw(
            st.sampled_from(["a\x00b", "\ud800", "\udfff-x", "é" * 40, "🦙" * 10, "\u202e"])
        )
    elif how == "nested":
        return [value]
    return value


@dataclass(frozen=True)
class FuzzRequest:
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]


def encode_query(params: dict[str, Any]) -> str:
    parts = []
    for name, value in params.items():
        text = value if isinstance(value, str) else json.dumps(value)
        parts.append(f"{name}={quote(text.encode('utf-8', 'surrogatepass'), safe='')}")
    return "?" + "&".join(parts) if parts else ""


def body_bytes(value: Any) -> bytes:
    return json.dumps(value).encode("ascii")


@st.composite
def fuzz_request(draw: st.DrawFn, document: dict[str, Any], token: str) -> FuzzRequest:
    path = draw(st.sampled_from(sorted(document["paths"])))
    item = document["paths"][path]
    method = draw(st.sampled_from(sorted(item)))
    operation = item[method]
    body: bytes | None = None
    query = ""
    if "parameters" in operation:
        params = {
            p["name"]: draw(st.one_of(from_schema(p["schema"], document), wild_text, junk_json))
            for p in operation["parameters"]
            if p.get("required") or draw(st.booleans())
        }
        query = encode_query(params)
    elif draw(st.integers(0, 9)) == 0:
        query = encode_query({draw(plain_text): draw(wild_text)})
    if "requestBody" in operation:
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        valid = draw(from_schema(schema, document))
        choice = draw(st.sampled_from(["valid", "mutated", "junk", "bytes", "empty", "huge"]))
        if choice == "valid":
            body = body_bytes(valid)
        elif choice == "mutated":
            body = body_bytes(draw(mutated(valid)))
        elif choice == "junk":
            body = body_bytes(draw(junk_json))
        elif choice == "bytes":
            body = draw(st.binary(max_size=64))
        elif choice == "empty":
            body = b""
        else:
            body = b'{"model_id": "' + b"x" * 12000 + b'"}'
    headers: dict[str, str] = {
        "Content-Type": draw(st.sampled_from(["application/json", "text/plain"]))
    }
    if operation.get("security"):
        headers_token = draw(st.sampled_from(["right", "right", "right", "wrong", "missing"]))
        if headers_token == "right":
            headers["x-uap-dashboard-token"] = token
        elif headers_token == "wrong":
            headers["x-uap-dashboard-token"] = draw(plain_text)
    twist = draw(st.integers(0, 19))
    if twist == 0:
        method = draw(st.sampled_from(["put", "delete", "patch", "get", "post"]))
    elif twist == 1:
        path = path + "/" + draw(plain_text)
    return FuzzRequest(method.upper(), path + query, body, headers)


def is_event_stream(fuzzed: FuzzRequest) -> bool:
    return fuzzed.method == "GET" and fuzzed.path.split("?", 1)[0] == "/api/placement/events"


def stream_head(base_url: str, fuzzed: FuzzRequest) -> Reply | None:
    """The SSE route: ``None`` for a well-formed stream (200, text/event-stream, checked
    here), else the whole (finite) error reply."""
    parts = urlsplit(base_url)
    connection = HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    try:
        connection.request("GET", fuzzed.path, body=fuzzed.body, headers=fuzzed.headers)
        response = connection.getresponse()
        headers = {k.lower(): v for k, v in response.getheaders()}
        if response.status == 200:
            assert headers["content-type"].startswith("text/event-stream"), fuzzed.path
            return None
        return Reply(response.status, headers, response.read())
    finally:
        connection.close()


# --------------------------------------------------------------------------- the test


def test_fuzzed_requests_never_get_a_5xx_and_the_daemon_survives(
    shim: ShimProcess, daemon: DaemonProcess, uap_env: UapEnv
) -> None:
    document = request(shim.base_url, "GET", "/openapi.json").json()
    statuses: dict[int, int] = {}
    no_machinery: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(fuzz_request(document, shim.token))
    def one(fuzzed: FuzzRequest) -> None:
        if is_event_stream(fuzzed):  # a 200 never ends: only its head is read
            streamed = stream_head(shim.base_url, fuzzed)
            if streamed is None:
                statuses[200] = statuses.get(200, 0) + 1
                return
            reply = streamed
        else:
            reply = request(
                shim.base_url, fuzzed.method, fuzzed.path, data=fuzzed.body, headers=fuzzed.headers
            )
        statuses[reply.status] = statuses.get(reply.status, 0) + 1
        shown_body = fuzzed.body[:200] if fuzzed.body else None
        what = f"{fuzzed.method} {fuzzed.path[:120]!r} body={shown_body!r}"
        if fuzzed.path.startswith("/metrics") and reply.status == 200:
            assert reply.headers["content-type"].startswith("text/plain"), what
            return
        assert reply.headers["content-type"] == "application/json; charset=utf-8", what
        payload = reply.json()
        if reply.status >= 400:
            assert isinstance(payload, dict), what
            assert isinstance(payload.get("error"), str), what
            assert payload["error"], what
        if reply.status == 503 and NO_MACHINERY.match(payload["error"]):
            no_machinery.append(payload["error"].split(":", 1)[0])
            return
        assert reply.status < 500, f"{what} → {reply.status} {reply.raw[:300]!r}"

    one()
    assert shim.alive(), shim.log()
    assert daemon.process.poll() is None, daemon.log()
    assert call_json(uap_env.bus_address, "Admit", "sssu", "alpha", "after-fuzz", "", "0") == [
        "forward",
        f"gpu0:{SEEDED_ENDPOINT}",
        "",
        "",
    ]
    after = request(shim.base_url, "POST", "/api/placement/admit", {"model_id": "alpha"})
    assert after.raw == f'{{"decision":"forward","target_id":"gpu0:{SEEDED_ENDPOINT}"}}'.encode()
    assert sum(statuses.values()) >= EXAMPLES
    assert 200 in statuses and 400 in statuses, statuses
    print(f"fuzz statuses: {dict(sorted(statuses.items()))}; 503s: {sorted(set(no_machinery))}")
