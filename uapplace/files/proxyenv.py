"""What the stock UAP proxy says about its upstream, and the registry's ports checked
against it (issue 20: behind the stock proxy with one port per model, clients got 529
after every swap and nobody was told unless ``proxy.single_upstream`` was already set).

The stock proxy sends every request to its one ``LLAMA_CPP_BASE``
(docs/placement-rules.md §6 "Phase 1.5"; :mod:`uapplace.core.topology`). Its internal
routes (docs/http-contract.md §3) do not say so, but its environment file does: the file
uapplaced already reads ``PROXY_AUTH_TOKEN`` from (``Paths.proxy_env_file``). The last
``LLAMA_CPP_BASE=`` line there is the proxy's one upstream (:func:`read_proxy_upstream`).

:func:`several_ports_problems` then judges the registry (docs/placement-rules.md §6,
"Phase 1.5"):

- ``proxy.single_upstream`` set: the existing rule (every endpoint must be it) applies;
  an upstream in the proxy's file that is another address is an **error** on
  ``$.proxy.single_upstream``.
- ``proxy.single_upstream`` written as ``null`` (in either file): the operator says the
  proxy routes by ``target_id``; nothing to say.
- not written, and the proxy's file names an upstream: every model or config listening
  elsewhere is an **error** (the stock proxy cannot reach it once a swap makes it the
  resident; clients get 529), and uapplaced raises a ``config_error`` alert for them.
- not written, no upstream known, and the models listen on two or more addresses: one
  **warning** on ``$.proxy`` (in ``validate`` only: a proxy that routes by ``target_id``
  is fine there, and only the operator knows which one runs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from uapplace.core.model import Registry
from uapplace.core.topology import normalize_endpoint, same_endpoint
from uapplace.files import jsonfile

log = logging.getLogger(__name__)

UPSTREAM_VARIABLE = "LLAMA_CPP_BASE"
_ENV_MAX_BYTES = 64 * 1024
"""An env file is a few lines; a bigger one is not the proxy's."""
_SHOWN = 4


@dataclass(frozen=True)
class ProxyUpstream:
    """The stock proxy's one upstream, as its environment file names it."""

    url: str
    file: Path


@dataclass(frozen=True)
class PortProblem:
    severity: Literal["error", "warning"]
    where: tuple[str, ...]
    """The registry's JSON path, as parts (``("models", "beta", "endpoint")``)."""
    message: str


def read_proxy_upstream(env_file: Path) -> ProxyUpstream | None:
    """The last ``LLAMA_CPP_BASE=`` of ``env_file`` (``export`` and quotes allowed);
    ``None`` when the file is absent, unreadable, over 64 KiB or does not name one."""
    try:
        raw = jsonfile.read_capped_or_none(env_file, _ENV_MAX_BYTES)
    except (OSError, jsonfile.ConfigFileError) as err:
        log.info("the proxy's environment file is not read: %s", err)
        return None
    if raw is None:
        return None
    url: str | None = None
    for line in raw.decode("utf-8", "replace").splitlines():
        name, sep, value = line.strip().removeprefix("export ").partition("=")
        if sep and name.strip() == UPSTREAM_VARIABLE:
            url = value.strip().strip('"').strip("'") or None
    return ProxyUpstream(url, env_file) if url else None


def several_ports_problems(
    registry: Registry, stated: bool, upstream: ProxyUpstream | None
) -> list[PortProblem]:
    """The registry's endpoints against the proxy's topology (see the module doc);
    ``stated``: ``proxy.single_upstream`` is written in one of the files (a URL or null)."""
    single = registry.single_upstream
    if single is not None:
        if upstream is None or same_endpoint(upstream.url, single):
            return []
        return [
            PortProblem(
                "error",
                ("proxy", "single_upstream"),
                f"proxy.single_upstream is {single}, but the stock proxy's "
                f"{UPSTREAM_VARIABLE} in {upstream.file} is {upstream.url}: it sends every "
                "request there, so no model is reachable after a switch; make them the same",
            )
        ]
    if stated:
        return []
    if upstream is not None:
        return [
            _elsewhere(where, endpoint, upstream)
            for where, endpoint in _endpoints(registry)
            if not same_endpoint(endpoint, upstream.url)
        ]
    addresses = sorted({normalize_endpoint(e) for _, e in _endpoints(registry)})
    if len(addresses) < 2:
        return []
    shown = ", ".join(addresses[:_SHOWN]) + (" …" if len(addresses) > _SHOWN else "")
    return [
        PortProblem(
            "warning",
            ("proxy",),
            f"the models listen on {len(addresses)} addresses ({shown}) and the registry "
            "does not say how the proxy reaches them: the stock UAP proxy sends every request "
            f"to its one {UPSTREAM_VARIABLE}, so after a swap its clients get 529. Behind it, "
            'give every model that port and set "proxy": {"single_upstream": "<that URL>"}; '
            'behind a proxy that routes by target_id, say so with "single_upstream": null',
        )
    ]


def _elsewhere(where: tuple[str, ...], endpoint: str, upstream: ProxyUpstream) -> PortProblem:
    return PortProblem(
        "error",
        where,
        f"listens on {endpoint}, but the stock proxy sends every request to its one "
        f"{UPSTREAM_VARIABLE} {upstream.url} ({upstream.file}) and proxy.single_upstream is "
        "not set: once a swap makes this model the resident, the proxy's clients get 529. "
        f'Give every model that port and set "proxy": {{"single_upstream": "{upstream.url}"}}; '
        'or, behind a proxy that routes by target_id, set "single_upstream": null',
    )


def _endpoints(registry: Registry) -> list[tuple[tuple[str, ...], str]]:
    """Each declared endpoint with its JSON path: the model's (for the configs that inherit
    it) and each config's own; models with none are not judged (nothing says where)."""
    found: list[tuple[tuple[str, ...], str]] = []
    for key in sorted(registry.models):
        model = registry.models[key]
        inherits = any(c.endpoint is None for c in model.configs.values()) or not model.configs
        if model.endpoint is not None and inherits:
            found.append((("models", key, "endpoint"), model.endpoint))
        for config in model.configs.values():
            if config.endpoint is not None:
                found.append((("models", key, "configs", config.key, "endpoint"), config.endpoint))
    return found
