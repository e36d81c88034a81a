"""The light ``uapplace`` and the local app it execs (docs/architecture.md, "The command
line: light and local"; issue 23).

The light app is plain click since it stopped being typer (``uapplace/cli/params.py``):
``cli_texts.json`` holds what the typer app printed (help of every command, usage errors,
exit codes, at 80 columns), recorded from it, and the click app must print the same bytes.

The commands around a switch import no aiohttp, pystemd, pydantic, Textual or demo (a
fresh interpreter's ``sys.modules`` says so); the local commands and the file fallbacks
are exec'd with their arguments as given (``os.execv`` is replaced by a recorder here;
the real exec runs in the subprocess cases and in ``tests/bus/test_cli.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, NoReturn

import click
import pytest
from click.testing import CliRunner

from uapplace.cli import app as cli
from uapplace.cli import enforce, forward
from uapplace.cli.forward import INSTALL_HELP, LOCAL_COMMANDS, LOCAL_MODULE
from uapplace.cli.session import EXIT_UNREACHABLE, exit_status

HEAVY = (
    "aiohttp",
    "pystemd",
    "pydantic",
    "textual",
    "typer",
    "uapplace.demo",
    "uapplace.cli.local",
)
TEXTS = json.loads((Path(__file__).parent / "cli_texts.json").read_text(encoding="utf-8"))


class Execd(Exception):
    """What the recorder raises instead of replacing the process."""

    def __init__(self, argv: list[str]) -> None:
        super().__init__(argv)
        self.argv = argv


@pytest.fixture
def execs(monkeypatch: pytest.MonkeyPatch) -> None:
    def execv(path: str, argv: list[str]) -> NoReturn:
        assert path == sys.executable
        raise Execd(argv)

    monkeypatch.setattr(os, "execv", execv)


@pytest.fixture
def no_bus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A user bus address nobody listens on, and XDG/HOME directories of this test."""
    monkeypatch.setenv("DBUS_SESSION_BUS_ADDRESS", f"unix:path={tmp_path / 'no-bus'}")
    for name in ("HOME", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "XDG_RUNTIME_DIR"):
        (tmp_path / name).mkdir()
        monkeypatch.setenv(name, str(tmp_path / name))
    return tmp_path


def local_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", LOCAL_MODULE, *args]


def test_the_light_app_imports_nothing_heavy() -> None:
    probe = (
        "import json, sys, uapplace.cli.app\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(done.stdout) == []


@pytest.mark.parametrize("case", TEXTS, ids=[" ".join(case["args"]) or "-" for case in TEXTS])
def test_help_usage_errors_and_exit_codes_read_as_the_typer_app_wrote_them(
    case: dict[str, Any],
    no_bus: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # In this process, not click's CliRunner: it forces help to 80 columns, where an
    # 80-column terminal gets 78.
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as ended:
        cli.app.main(case["args"], prog_name="python -m uapplace.cli")
    printed = capsys.readouterr()
    assert (exit_status(ended.value), printed.out, printed.err) == (
        case["exit_code"],
        case["stdout"],
        case["stderr"],
    )


def test_a_command_line_parses_into_the_values_the_typer_app_gave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[Any, ...]] = []
    monkeypatch.setattr(cli, "enforce", lambda *args: seen.append(args[:4]))
    for args in (["apply", "plc-1", " +2 ", "--yes"], ["apply", "plc-1", "1_0", "--json"]):
        assert CliRunner().invoke(cli.app, args, catch_exceptions=False).exit_code == 0
    assert seen == [
        ("apply plc-1 option 2", "not applied", True, False),
        ("apply plc-1 option 10", "not applied", False, True),
    ]


def test_main_execs_a_local_command_with_its_arguments_as_given(execs: None) -> None:
    argv = ["uapplace", "unit", "add", "x", "--engine", "fake", "--", "--ctx-size", "512"]
    with pytest.raises(Execd) as execd:
        forward.forward_argv(argv)
    assert execd.value.argv == local_argv(*argv[1:])


def test_main_leaves_a_light_command_to_the_light_app(execs: None) -> None:
    for argv in (["uapplace", "apply", "plc-1", "1"], ["uapplace"], ["uapplace", "--help"]):
        forward.forward_argv(argv)  # returns (the recorder raises on an exec)


def test_a_forwarding_command_passes_help_and_options_on(execs: None) -> None:
    with pytest.raises(Execd) as execd:
        CliRunner().invoke(cli.app, ["logs", "-n", "5", "alpha", "--help"], catch_exceptions=False)
    assert execd.value.argv == local_argv("logs", "-n", "5", "alpha", "--help")


def test_without_a_daemon_status_and_pending_exec_their_file_fallback(
    execs: None, no_bus: Path
) -> None:
    for args, offline in (
        (["status", "--json"], ["offline-status", "--json"]),
        (["pending"], ["offline-pending"]),
        (["validate"], ["offline-validate"]),
    ):
        with pytest.raises(Execd) as execd:
            CliRunner().invoke(cli.app, args, catch_exceptions=False)
        assert execd.value.argv == local_argv(*offline), args


def test_without_a_daemon_a_write_refuses_and_execs_nothing(execs: None, no_bus: Path) -> None:
    done = CliRunner().invoke(cli.app, ["apply", "plc-000001", "1", "--yes"])
    assert done.exit_code == EXIT_UNREACHABLE
    assert "cannot reach the user bus" in done.output


def test_measure_envelope_execs_the_local_app_with_every_flag(execs: None) -> None:
    with pytest.raises(Execd) as execd:
        CliRunner().invoke(
            cli.app, ["measure", "alpha", "--envelope", "--yes", "--json"], catch_exceptions=False
        )
    assert execd.value.argv == local_argv("measure-envelope", "alpha", "", "--yes", "--json")


def cli_help(*args: str) -> str:
    """``python -m uapplace.cli <args> --help``'s output, 200 columns wide."""
    return subprocess.run(
        [sys.executable, "-m", "uapplace.cli", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "200"},
        check=True,
    ).stdout


def test_help_lists_the_local_commands_and_their_help_reads_the_same(no_bus: Path) -> None:
    listing = cli_help()
    for name, text in LOCAL_COMMANDS.items():
        assert f"  {name} " in listing, name
        assert " ".join(text.split()[:4]) in listing, name
    own = cli_help("install")
    assert own.startswith("Usage: uapplace install [OPTIONS]")
    # click folds lines at hyphens too: compare the last sentence, which has none.
    assert INSTALL_HELP.split(". ")[-1] in " ".join(own.split())


def test_pending_without_a_daemon_reads_the_ledger_through_the_exec(no_bus: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "uapplace.cli", "pending", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["daemon"] is False
    assert "uapplaced is not running; read from" in done.stderr


def test_an_aborted_prompt_ends_as_click_ends_it_in_the_light_and_the_local_app(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted(question: str, default: bool) -> bool:
        assert (question, default) == ("Stop alpha?", False)
        raise click.Abort()

    monkeypatch.setattr(sys.stdin, "isatty", lambda: True)
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(click, "confirm", interrupted)
    with pytest.raises(SystemExit) as ended:
        enforce._consented(True, False, False, "Stop alpha?")
    assert ended.value.code == 1
    assert capsys.readouterr().err == "Aborted!\n"
    monkeypatch.setattr(click, "confirm", lambda question, default: True)
    assert enforce._consented(True, False, False, "Stop alpha?") is True
