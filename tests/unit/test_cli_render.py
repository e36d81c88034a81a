"""Names from any ``Admit`` caller print as written (uapplace.cli.render, uapplace.cli.session).

Client, model and session names reach the CLI's tables and lines unchecked. Rich reads
markup (``[bold]``, ``[/x]``) and emoji codes (``:fire:``) in text by default: a closing
tag that opens nothing would stop ``uapplace status`` with a ``MarkupError``, and the
others would change what the operator reads. Every table and line shows them verbatim.
"""

from __future__ import annotations

from typing import Any

import pytest

from uapplace.cli import render
from uapplace.cli.session import out

HOSTILE_NAMES = ("[/x]", "[blink]agent[/blink]", "a:fire:b", "[link=http://evil]x", "\\[esc]")


def state_with(client: str) -> dict[str, Any]:
    return {
        "devices": {"gpu0": {"kind": "gpu", "total_mib": 24576, "free_mib": 1000}},
        "residents": [
            {
                "model": f"m-{client}",
                "config": "c1",
                "device": "gpu0",
                "state": "hot",
                "gpu_mib": 8000,
                "endpoint": "http://127.0.0.1:8001",
                "holders": [{"client": client, "kind": "session", "detail": client}],
            }
        ],
        "targets": [],
        "holds": [],
        "pending": [],
    }


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_status_shows_a_hostile_client_name_verbatim(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    render.print_status(state_with(name))
    shown = capsys.readouterr().out
    assert f"{name} (session: {name})" in shown.replace("\n", "")
    assert f"m-{name}" in shown
    assert "🔥" not in shown


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_the_impact_table_shows_a_hostile_holder_verbatim(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = {
        "model": "beta",
        "config": "c1",
        "action": "stop",
        "device": "gpu0",
        "state": "hot",
        "holders": [{"client": name, "kind": "lease"}],
        "frees_mib": 8000,
        "consequence": "beta stops",
    }
    render.show_impact(out, "Applying p-1 option 1", [victim], 8000)
    shown = capsys.readouterr().out
    assert f"{name} (lease)" in shown
    assert "🔥" not in shown


def test_plain_lines_read_no_emoji_codes(capsys: pytest.CaptureFixture[str]) -> None:
    out.print("dismissed p-:fire:", markup=False)
    assert "dismissed p-:fire:" in capsys.readouterr().out
