"""What one running shim is configured with: :class:`ShimSettings`, and the defaults of each knob.

Built once by :func:`uapplace.shim.server.main` from the command line (tests build
their own) and read by the app, the handlers and the server. The deadlines bound
each bus call (the daemon unreachable or slower than that is a ``503``); the
timeouts and the connection cap are the issue-11 limits on what one client may
hold.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from uapplace.shim.metrics import ShimMetrics

ADMIT_DEADLINE_S = 1.5
"""Well inside the proxy's 2 s, so the proxy gets our 503 and falls back instead of hanging."""
READ_DEADLINE_S = 10.0
ENFORCEMENT_DEADLINE_S = 900.0
HEADER_TIMEOUT_S = 10.0
"""A connection must deliver a request's complete headers within this long of connecting
(or of its previous response); it is also how long an idle keep-alive connection lives."""
BODY_TIMEOUT_S = 10.0
"""The most reading one request body may take (a 10 KiB body is milliseconds on loopback)."""
MAX_CONNECTIONS = 512
"""Open HTTP connections served at once; more are answered 503 and closed at once."""
SSE_QUEUE_EVENTS = 512
"""Events one SSE subscriber may have waiting; past that it is a slow reader and is
dropped, with a final event saying why (docs/http-contract.md §5, "Events")."""
SSE_WRITE_TIMEOUT_S = 10.0
"""The most one SSE write may wait for the client to read; past that it is dropped."""


@dataclass
class ShimSettings:
    token: str
    bus_address: str
    peer_socket: Path | None = None
    """uapplaced's Admit-only peer socket; ``None``: admit over the bus only."""
    admit_deadline: float = ADMIT_DEADLINE_S
    read_deadline: float = READ_DEADLINE_S
    enforcement_deadline: float = ENFORCEMENT_DEADLINE_S
    metrics: ShimMetrics = field(default_factory=ShimMetrics)
    header_timeout: float = HEADER_TIMEOUT_S
    body_timeout: float = BODY_TIMEOUT_S
    max_connections: int = MAX_CONNECTIONS
    allowed_uids: frozenset[int] = field(default_factory=lambda: frozenset({os.geteuid()}))
    """Who may connect (docs/http-contract.md §5): the shim's own user, and ``--allow-uid``."""
    sse_queue: int = SSE_QUEUE_EVENTS
    sse_write_timeout: float = SSE_WRITE_TIMEOUT_S
