"""``uapplace demo --single-upstream --proxy-url U --proxy-token T`` for real (issue 13).

Both fake engines listen on one port, one at a time (the stock UAP proxy's
topology), and the daemon drains and refreshes an *outside* proxy: the
``uapplace.sim.gateproxy`` program, started here with its own token, whose
internal routes refuse any other. The demo prints the token it uses.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tests.systemd.conftest import APPLY_STEPS
from tests.systemd.test_demo import (
    DemoRun,
    assert_nothing_left,
    contained,  # noqa: F401 (a fixture)
    demo_env,
    ended_demo,  # noqa: F401 (a fixture)
)
from tests.worlds.gate_proxy import gate_proxy_process

pytestmark = pytest.mark.systemd

TOKEN = "outside-proxy-token"


@pytest.fixture
def outside_proxy() -> Iterator[str]:
    """The gate proxy as its own process, with its own token; its base URL."""
    with gate_proxy_process({**demo_env(), "PROXY_AUTH_TOKEN": TOKEN}) as url:
        yield url


def test_the_demo_behind_one_upstream_drives_an_outside_proxy(
    contained: None,  # noqa: F811
    ended_demo: list[DemoRun],  # noqa: F811
    outside_proxy: str,
) -> None:
    run = DemoRun.start("--single-upstream", "--proxy-url", outside_proxy, "--proxy-token", TOKEN)
    ended_demo.append(run)
    code = run.finish()
    out = run.output
    assert code == 0, out
    assert f"proxy: {outside_proxy} (token {TOKEN})" in out
    upstream = re.search(r"one upstream for every engine: (http://127\.0\.0\.1:\d+)", out)
    assert upstream, out
    forwards = re.findall(r"(?:coder-7b|writer-13b): forward → gpu0:(http://127\.0\.0\.1:\d+)", out)
    assert forwards == [upstream.group(1)] * 2, out
    shown = [m.group(1) for m in re.finditer(r"^\s+✓ ([a-z-]+)  ", out, re.MULTILINE)]
    assert shown == APPLY_STEPS, out  # drain and refresh-proxy went to the outside proxy, with T
    assert "Hello from writer-13b." in out
    # The refresh answer of the gate proxy (the built-in fake's differs): it was asked.
    assert "cleared upstream_model_ids, park_bursts" in out
    assert_nothing_left(run, run.sandbox())
