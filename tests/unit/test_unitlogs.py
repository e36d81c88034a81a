"""A unit's own last lines (:mod:`uapplace.io.unitlogs`), and where a failed start shows them.

docs/placement-rules.md §4.6 ("Failed start"). No user manager here: the
:class:`~uapplace.io.units.LogFacts` a read would give are written by hand, pointing at
unit files and logs in ``tmp_path``; the journal is a stand-in ``journalctl`` (a Python
script that records its argument list and prints what the test put in its table). Then
the enforcement over the unit-tier fakes (:mod:`enforce_fakes`), with a unit whose state
names such a log: the failed step's detail, the run's error and the unattended-run alert
carry its lines.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from enforce_fakes import Scene, detail, resident, swap_registry

from uapplace.core.alerts import AlertKind
from uapplace.io import unitlogs
from uapplace.io.unitlogs import (
    BLOCK_INDENT,
    MAX_LINE_CHARS,
    LogTail,
    block_lines,
    last_lines,
    log_places,
    split_last_lines,
    with_last_lines,
)
from uapplace.io.units import LogFacts, UnitState

UNIT = "beta.service"
INVOCATION = "0123456789abcdef0123456789abcdef"
STARTED_USEC = 1_790_000_000_500_000

FAKE_JOURNALCTL = """\
import json, os, sys, time
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "calls.jsonl"), "a") as calls:
    calls.write(json.dumps(sys.argv[1:]) + "\\n")
with open(os.path.join(here, "pid"), "w") as pid:
    pid.write(str(os.getpid()))
table = json.load(open(os.path.join(here, "table.json")))
time.sleep(table.get("sleep", 0))
args = sys.argv[1:]
if any(a.startswith("_SYSTEMD_INVOCATION_ID=") for a in args):
    lines = table.get("invocation", [])
elif "--since" in args:
    lines = table.get("since", [])
else:
    lines = table.get("every", [])
sys.stdout.write("".join(line + "\\n" for line in lines))
sys.stdout.flush()
time.sleep(table.get("then_sleep", 0))
sys.exit(table.get("exit", 0))
"""


class Journal:
    """The stand-in ``journalctl``: what it answers, and every argument list it got."""

    def __init__(self, folder: Path) -> None:
        folder.mkdir()
        self.folder = folder
        self.path = folder / "journalctl"
        self.path.write_text(f"#!{sys.executable}\n{FAKE_JOURNALCTL}", encoding="utf-8")
        self.path.chmod(0o755)
        self.answer()

    def answer(self, **table: Any) -> None:
        (self.folder / "table.json").write_text(json.dumps(table), encoding="utf-8")

    def calls(self) -> list[list[str]]:
        log = self.folder / "calls.jsonl"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]

    def pid(self) -> int:
        return int((self.folder / "pid").read_text(encoding="ascii"))


@pytest.fixture
def journal(tmp_path: Path) -> Journal:
    return Journal(tmp_path / "journal")


def unit_file(folder: Path, service: str, name: str = UNIT) -> Path:
    path = folder / name
    path.write_text(f"[Unit]\nDescription=test\n\n[Service]\nType=exec\n{service}\n")
    return path


def facts(fragment: Path | None, *dropins: Path, **kinds: Any) -> LogFacts:
    values: dict[str, Any] = {
        "invocation_id": INVOCATION,
        "started_usec": STARTED_USEC,
        "stdout": "journal",
        "stderr": "inherit",
        "fragment_path": str(fragment) if fragment is not None else "",
        "dropin_paths": tuple(str(d) for d in dropins),
    }
    values.update(kinds)
    return LogFacts(**values)


# --------------------------------------------------------------------------- the log file


async def test_the_file_stderr_is_appended_to_gives_the_last_lines(
    tmp_path: Path, journal: Journal
) -> None:
    log = tmp_path / "beta.log"
    log.write_text("".join(f"line {n}\n" for n in range(1, 31)), encoding="utf-8")
    fragment = unit_file(tmp_path, f"StandardOutput=append:{log}\nStandardError=append:{log}")

    tail = await last_lines(
        UNIT, facts(fragment, stdout="append", stderr="append"), 10, journalctl=str(journal.path)
    )

    assert tail == LogTail(UNIT, tuple(f"line {n}" for n in range(21, 31)), str(log))
    assert tail.header() == f"last 10 lines of {UNIT} (from {log})"
    assert journal.calls() == []  # the file came first: the journal was never asked


def test_drop_ins_win_in_order_and_inherit_follows_stdout(tmp_path: Path) -> None:
    fragment = unit_file(tmp_path, "StandardError=append:/var/log/old.log\nStandardOutput=null")
    first = tmp_path / "10-out.conf"
    first.write_text("[Service]\nStandardOutput=file:/srv/logs/%N-out.log\n")
    second = tmp_path / "20-err.conf"
    second.write_text("[Unit]\nStandardError=append:/not/a/service/setting\n[Service]\n")
    third = tmp_path / "30-err.conf"
    third.write_text("# a comment\n[Service]\nStandardError=\\\n  truncate:%h/beta.err\n")

    both = log_places(UNIT, facts(fragment, first, second, third, stdout="file", stderr="truncate"))
    assert both.stderr_file == Path.home() / "beta.err"
    assert both.stdout_file == Path("/srv/logs/beta-out.log")
    assert not both.journal and both.problems == ()

    inherited = log_places(UNIT, facts(fragment, first, stdout="file", stderr="inherit"))
    assert inherited.stderr_file == Path("/srv/logs/beta-out.log")

    unknown = log_places(
        UNIT, facts(unit_file(tmp_path, "StandardError=file:%S/x.log"), stderr="file")
    )
    assert unknown.stderr_file is None
    assert unknown.problems == (
        "StandardError=file:%S/x.log: the specifier %S is not one uapplace expands",
    )


async def test_lines_are_few_short_and_stripped(tmp_path: Path) -> None:
    log = tmp_path / "noisy.log"
    noise = [
        "\x1b[31mE srv load_model: failed to load model\x1b[0m",
        "title \x1b]0;pwned\x07 change, a bell \x07 and a tab\there",
        "carriage return\r",
        "",
        "   ",
        "x" * 5000,
        "\u202eevil bidi override",
    ]
    filler = [f"old line {n}" for n in range(200_000)]
    log.write_text("\n".join([*filler, *noise]) + "\n", encoding="utf-8")
    fragment = unit_file(tmp_path, f"StandardError=append:{log}")

    tail = await last_lines(UNIT, facts(fragment, stderr="append"), 5)

    assert tail.lines == (
        "E srv load_model: failed to load model",
        "title  change, a bell  and a tab here",
        "carriage return",
        "x" * (MAX_LINE_CHARS - 1) + "…",
        "evil bidi override",
    )
    assert all(line.isprintable() and len(line) <= MAX_LINE_CHARS for line in tail.lines)
    many = await last_lines(UNIT, facts(fragment, stderr="append"), 10**6)
    assert len(many.lines) == unitlogs.MAX_LINES


async def test_no_journal_and_no_file_says_so(tmp_path: Path, journal: Journal) -> None:
    fragment = unit_file(tmp_path, "")  # the defaults: stdout to the journal, stderr inherits

    tail = await last_lines(UNIT, facts(fragment), journalctl=str(journal.path))

    assert tail.lines == ()
    assert tail.missing == "no log available (no journal, no log file)"
    assert tail.appended_to("start failed") == (
        "start failed; no log available (no journal, no log file)"
    )


async def test_a_missing_file_a_fifo_and_an_unreadable_unit_file_are_named(
    tmp_path: Path, journal: Journal
) -> None:
    fifo = tmp_path / "a.fifo"
    os.mkfifo(fifo)
    for path, why in [
        (tmp_path / "gone.log", f"{tmp_path / 'gone.log'} does not exist"),
        (fifo, f"{fifo} cannot be read: {fifo} is not a regular file"),
    ]:
        fragment = unit_file(tmp_path, f"StandardError=append:{path}")
        tail = await asyncio.wait_for(
            last_lines(UNIT, facts(fragment, stderr="append"), journalctl=str(journal.path)), 5
        )
        assert tail.missing == f"no log available ({why}, no journal)"

    gone = facts(tmp_path / "no-such.service", stderr="append")
    tail = await last_lines(UNIT, gone, journalctl=str(journal.path))
    assert tail.missing == (
        f"no log available (no journal, no log file, {tmp_path / 'no-such.service'} cannot be "
        "read: No such file or directory, StandardError= names no file in the unit files "
        "(systemd says it writes one))"
    )


# --------------------------------------------------------------------------- the journal


async def test_the_journal_is_asked_for_this_run_only_as_an_argument_list(
    tmp_path: Path, journal: Journal
) -> None:
    journal.answer(invocation=["E srv llama_server: exiting due to model loading error"])

    tail = await last_lines(UNIT, facts(unit_file(tmp_path, "")), 7, journalctl=str(journal.path))

    assert tail.lines == ("E srv llama_server: exiting due to model loading error",)
    assert tail.source == f"the journal (this run, invocation {INVOCATION[:8]})"
    assert journal.calls() == [
        [
            "--user",
            "-u",
            UNIT,
            "-n",
            "7",
            "-o",
            "cat",
            "--no-pager",
            "-q",
            f"_SYSTEMD_INVOCATION_ID={INVOCATION}",
        ]
    ]


async def test_a_journal_without_invocation_ids_is_asked_since_the_run_began(
    tmp_path: Path, journal: Journal
) -> None:
    journal.answer(since=["the run's own line"], every=["an older run's line"])

    tail = await last_lines(UNIT, facts(unit_file(tmp_path, "")), journalctl=str(journal.path))

    assert (tail.lines, tail.source) == (
        ("the run's own line",),
        "the journal (since this run started)",
    )
    assert [call[-2:] for call in journal.calls()] == [
        ["-q", f"_SYSTEMD_INVOCATION_ID={INVOCATION}"],
        ["--since", "@1790000000.500000"],
    ]
    never_ran = replace(facts(unit_file(tmp_path, "")), invocation_id="", started_usec=0)
    tail = await last_lines(UNIT, never_ran, journalctl=str(journal.path))
    assert (tail.lines, tail.source) == (("an older run's line",), "the journal (every run)")


async def test_a_journalctl_that_hangs_is_killed_and_one_that_fails_is_named(
    tmp_path: Path, journal: Journal, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(unitlogs, "JOURNAL_TIMEOUT_S", 0.5)
    journal.answer(sleep=30, invocation=["never"])
    started = time.monotonic()

    tail = await last_lines(UNIT, facts(unit_file(tmp_path, "")), journalctl=str(journal.path))

    assert time.monotonic() - started < 5
    assert tail.missing == "no log available (no journal (journalctl took over 0.5s), no log file)"
    with pytest.raises(ProcessLookupError):
        os.kill(journal.pid(), 0)  # killed and reaped, not left behind

    journal.answer(exit=1)
    tail = await last_lines(UNIT, facts(unit_file(tmp_path, "")), journalctl=str(journal.path))
    assert tail.missing == "no log available (no journal (journalctl: exit status 1), no log file)"


# --------------------------------------------------------------------------- following


async def test_follow_gives_the_tail_then_each_new_line_across_a_truncation(
    tmp_path: Path,
) -> None:
    log = tmp_path / "beta.log"
    log.write_text("one\ntwo\nthree\n", encoding="utf-8")
    fragment = unit_file(tmp_path, f"StandardError=append:{log}")

    followed = await unitlogs.follow(UNIT, facts(fragment, stderr="append"), 2, poll_s=0.01)
    assert followed.source == str(log)
    seen: list[str] = []

    async def take(count: int) -> None:
        while len(seen) < count:
            seen.append(await anext(followed.lines))

    await asyncio.wait_for(take(2), 5)
    with log.open("a", encoding="utf-8") as out:
        out.write("four\nfi")
    await asyncio.wait_for(take(3), 5)
    with log.open("a", encoding="utf-8") as out:
        out.write("ve \x1b[1mbold\x1b[0m\n")
    await asyncio.wait_for(take(4), 5)
    log.write_text("after truncation\n", encoding="utf-8")  # rewritten shorter: from its start
    await asyncio.wait_for(take(5), 5)
    await followed.lines.aclose()

    assert seen == ["two", "three", "four", "five bold", "after truncation"]


async def test_follow_asks_journalctl_to_follow_and_ends_it_when_closed(
    tmp_path: Path, journal: Journal
) -> None:
    journal.answer(every=["old", "\x1b[2Jnew"], then_sleep=60)

    followed = await unitlogs.follow(
        UNIT, facts(unit_file(tmp_path, "")), 4, journalctl=str(journal.path)
    )
    assert followed.source == "the journal (every run)"
    seen = [await asyncio.wait_for(anext(followed.lines), 10) for _ in range(2)]
    await followed.lines.aclose()

    assert seen == ["old", "new"]
    assert journal.calls() == [
        ["--user", "-u", UNIT, "-f", "-n", "4", "-o", "cat", "--no-pager", "-q"]
    ]
    with pytest.raises(ProcessLookupError):
        os.kill(journal.pid(), 0)  # closing the follow ended journalctl (ours, by its PID)


async def test_follow_with_nowhere_to_read_says_so(tmp_path: Path) -> None:
    fragment = unit_file(tmp_path, "StandardOutput=null")
    with pytest.raises(unitlogs.NoLog, match=r"^no log available \(no journal, no log file\)$"):
        await unitlogs.follow(UNIT, facts(fragment, stdout="null", stderr="null"))


# --------------------------------------------------------------------------- in a failed step


async def test_the_lines_go_below_the_text_and_come_apart_again(tmp_path: Path) -> None:
    log = tmp_path / "beta.log"
    log.write_text("E first\nE second\n", encoding="utf-8")
    running = UnitState("failed", "failed", "loaded", 0, "llama-server")
    known = replace(
        running,
        log_facts=facts(unit_file(tmp_path, f"StandardError=append:{log}"), stderr="append"),
    )

    assert await with_last_lines("start failed", UNIT, None) == "start failed"
    assert await with_last_lines("start failed", UNIT, running) == "start failed"  # a fake's
    text = await with_last_lines("start failed", UNIT, known)

    assert text == (
        f"start failed; last 2 lines of {UNIT} (from {log}):\n"
        f"{BLOCK_INDENT}E first\n{BLOCK_INDENT}E second"
    )
    head, block = split_last_lines(text)
    assert head == f"start failed; last 2 lines of {UNIT} (from {log})"
    assert block_lines(block) == ["E first", "E second"]
    assert split_last_lines("one line") == ("one line", "")


def logging_units(scene: Scene, unit: str, log: Path, fragment: Path) -> None:
    """``unit``'s state, as the fakes give it, also says where it writes: ``log``."""
    plain = scene.units.state_now
    named = facts(fragment, stdout="append", stderr="append")

    def with_facts(name: str) -> UnitState:
        state = plain(name)
        return replace(state, log_facts=named) if name == unit else state

    scene.units.state_now = with_facts  # type: ignore[method-assign]


@pytest.fixture
def swap(tmp_path: Path) -> Scene:
    """alpha runs on gpu0; beta only fits once alpha stops (``enforce_fakes``)."""
    return Scene(tmp_path, swap_registry(), [resident("alpha", "a1")])


async def test_a_failed_start_carries_the_units_last_lines_to_the_error_and_the_alert(
    swap: Scene, tmp_path: Path
) -> None:
    log = tmp_path / "beta.log"
    log.write_text(
        "I srv load_model: loading model '/models/beta.gguf'\n"
        "E llama_model_load_from_file_impl: failed to load model\n"
        "E srv llama_server: exiting due to model loading error\n",
        encoding="utf-8",
    )
    logging_units(swap, UNIT, log, unit_file(tmp_path, f"StandardError=append:{log}"))
    swap.units.after_start[UNIT] = "failed"
    entry = swap.park("beta")

    result = await swap.enforcer.apply(entry, 1, ["alpha/a1"], wait=True)  # as auto-load does

    header = f"last 3 lines of {UNIT} (from {log})"
    block = (
        f"\n{BLOCK_INDENT}I srv load_model: loading model '/models/beta.gguf'"
        f"\n{BLOCK_INDENT}E llama_model_load_from_file_impl: failed to load model"
        f"\n{BLOCK_INDENT}E srv llama_server: exiting due to model loading error"
    )
    step = detail(result, "verify-up")
    assert step.startswith(f"{UNIT} went failed/failed while loading; ")
    assert step.endswith(f"; {header}:{block}")
    assert split_last_lines(step)[0].endswith(header)
    assert result["error"] == f"verify-up: {split_last_lines(step)[0]}; rolled back{block}"
    [(kind, _severity, subject, message)] = swap.host.alerts
    assert (kind, subject) == (AlertKind.ENFORCEMENT_FAILED, "beta")
    head, lines = split_last_lines(message)
    assert head.startswith("auto-load: apply plc-000001 option 1 ") and header in head
    assert head.endswith(". Running now: alpha/a1 on gpu0, alpha.service active/running.")
    assert lines == block
    # The victim came back; its own step details gained nothing (it did not fail).
    assert detail(result, "rollback-verify").startswith("alpha/a1 healthy again")


async def test_a_failed_start_job_carries_them_too(swap: Scene, tmp_path: Path) -> None:
    log = tmp_path / "beta.log"
    log.write_text("E srv couldn't bind HTTP server socket\n", encoding="utf-8")
    logging_units(swap, UNIT, log, unit_file(tmp_path, f"StandardError=append:{log}"))
    swap.units.start_result[UNIT] = "failed"

    result = await swap.enforcer.apply(swap.park("beta"), 1, ["alpha/a1"])

    assert detail(result, "start") == (
        f"{UNIT}: start job failed; unit failed/failed; last 1 line of {UNIT} (from {log}):"
        f"\n{BLOCK_INDENT}E srv couldn't bind HTTP server socket"
    )
    assert result["error"].splitlines()[0].endswith("; rolled back")
    assert swap.host.alerts == []  # attended: the operator reads the result
