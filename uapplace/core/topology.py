"""Proxy topology: per-target routing, or one upstream for everything.

The stock UAP proxy sends every request to its one ``LLAMA_CPP_BASE``
(docs/placement-rules.md §6 "Phase 1.5"): it reads a forward's ``target_id`` only
for its concurrency slot and in-flight list. Behind such a proxy a model is reachable only when its
engine listens on that one address, so after a switch the new engine must take
over the same port. The registry says which topology the proxy has:

    "proxy": {"single_upstream": "http://127.0.0.1:8080"}

With it set:

- every model (and config) whose endpoint differs from the upstream is an
  **error**: "unreachable after a switch through a single-upstream proxy"
  (:func:`single_upstream_problems`; ``validate`` and the daemon at start);
  a model with no endpoint at all is one too (nothing says it listens there);
- the planner never offers ``load_alongside``: only one engine can own the port,
  so a second model always displaces the first;
- verify-up checks the new engine on the upstream address itself
  (:func:`verify_endpoint`), the address the proxy will actually use.

Without it, the proxy routes by ``target_id`` (``sim/gateproxy.py``'s default
mode, and the stock proxy after its Phase 1.5) and nothing here applies.

Addresses are compared normalized (:func:`normalize_endpoint`): scheme and
host lower-cased, the scheme's default port made explicit, ``localhost`` read
as ``127.0.0.1``, a trailing ``/`` or ``/v1`` dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from uapplace.core.model import Model, Registry

UNREACHABLE = "unreachable after a switch through a single-upstream proxy"
_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_endpoint(url: str) -> str:
    """``HTTP://LocalHost:8080/v1/`` → ``http://127.0.0.1:8080``; see the module doc."""
    parts = urlsplit(url.strip())
    scheme = parts.scheme.lower()
    host = (parts.hostname or "").lower()
    if host == "localhost":
        host = "127.0.0.1"
    try:
        port = parts.port
    except ValueError:
        port = None
    port = port if port is not None else _DEFAULT_PORTS.get(scheme)
    if ":" in host:
        host = f"[{host}]"
    path = parts.path.rstrip("/").removesuffix("/v1").rstrip("/")
    return f"{scheme}://{host}:{port}{path}"


def same_endpoint(a: str, b: str) -> bool:
    return normalize_endpoint(a) == normalize_endpoint(b)


@dataclass(frozen=True)
class TopologyProblem:
    """One model (or config) the proxy cannot reach after a switch."""

    model: str
    config: str | None
    """``None``: every config of the model (they share its endpoint)."""
    endpoint: str | None
    message: str


def _problem(model: Model, config: str | None, endpoint: str | None, upstream: str) -> str:
    what = f"model {model.key!r}" + (f" config {config!r}" if config else "")
    if endpoint is None:
        return (
            f"{what} declares no endpoint, so nothing says its engine listens on the proxy's "
            f"single upstream {upstream}: {UNREACHABLE}"
        )
    return (
        f"{what} listens on {endpoint}, not on the proxy's single upstream {upstream}: "
        f"{UNREACHABLE}; give it endpoint {upstream} (one engine at a time owns that port)"
    )


def single_upstream_problems(registry: Registry, upstream: str) -> list[TopologyProblem]:
    """Every model or config whose endpoint is not ``upstream``, by model key order.

    A config that inherits the model's endpoint is reported once, for the model;
    a config with its own differing endpoint is reported on its own.
    """
    problems: list[TopologyProblem] = []
    for key in sorted(registry.models):
        model = registry.models[key]
        model_ok = model.endpoint is not None and same_endpoint(model.endpoint, upstream)
        inherits = [c for c in model.configs.values() if c.endpoint is None]
        if inherits and not model_ok:
            message = _problem(model, None, model.endpoint, upstream)
            problems.append(TopologyProblem(key, None, model.endpoint, message))
        for config in model.configs.values():
            if config.endpoint is not None and not same_endpoint(config.endpoint, upstream):
                message = _problem(model, config.key, config.endpoint, upstream)
                problems.append(TopologyProblem(key, config.key, config.endpoint, message))
    return problems


def verify_endpoint(endpoint: str | None, single_upstream: str | None) -> str | None:
    """Where verify-up asks a freshly started engine: the single upstream when there
    is one (the address the proxy uses), else the model's endpoint."""
    return single_upstream if single_upstream is not None else endpoint
