"""The Admit-only peer socket for a test: a short private path and a listener on it.

Used by tests/unit/test_peer.py (the listener, dbus-fast clients) and
tests/unit/test_peer_link.py (the shim's own link), which differ only in what the
listener answers.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

from uapplace.bus.peer import AdmitAnswer, PeerListener


@contextmanager
def short_socket_path(tmp_path: Path, prefix: str) -> Iterator[Path]:
    """``<runtime>/uapplace/bus`` in a fresh ``0700`` directory under ``/tmp`` (an
    ``AF_UNIX`` path must stay under 107 bytes), removed with all it holds afterwards."""
    runtime = Path(f"/tmp/{prefix}-{os.getpid()}-{tmp_path.name[-12:]}")
    runtime.mkdir(mode=0o700)
    try:
        yield runtime / "uapplace" / "bus"
    finally:
        for path in sorted(runtime.rglob("*"), reverse=True):
            path.rmdir() if path.is_dir() else path.unlink()
        runtime.rmdir()


@asynccontextmanager
async def listening(socket_path: Path, answer: AdmitAnswer) -> AsyncIterator[PeerListener]:
    """A started :class:`PeerListener` on ``socket_path`` answering with ``answer``."""
    served = PeerListener(socket_path, answer)
    await served.start()
    try:
        yield served
    finally:
        await served.close()
