"""The light app's click parameters and commands, shown and refused as the typer app did.

The light ``uapplace`` is plain click (docs/architecture.md, "The command line: light and
local"): typer 0.29 imports pydantic and builds a ``TypeAdapter`` for every parameter each
time a command runs, which cost every ``uapplace apply`` about a fifth of a second. The
help and error texts stay byte-identical to the typer app's: arguments listed under
``Arguments:`` as ``NAME <type>``, ``{NAME}``/``[NAME]`` in the usage line, ``<int range>``
and ``<str>`` metavars, ``[x>=1; required]`` extras, and pydantic's words for a bad integer
(:class:`Integer`). ``tests/unit/test_cli_forward.py`` diffs them against recorded texts.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import click

_INTEGER = re.compile(r"[+-]?[0-9]+(?:_[0-9]+)*(?:\.0+)?")
"""What pydantic's lax ``int`` takes from a string (after stripping white space)."""

F = TypeVar("F", bound=Callable[..., Any])

NOT_AN_INTEGER = "Input should be a valid integer, unable to parse string as an integer"


class Integer(click.ParamType[int, Any]):
    """An integer of at least ``minimum``, refused in pydantic's words as typer did."""

    name = "integer"

    def __init__(self, minimum: int) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            text = str(value).strip()
            if not _INTEGER.fullmatch(text):
                self.fail(NOT_AN_INTEGER, param, ctx)
            number = int(text.partition(".")[0])
        if number < self.minimum:
            self.fail(f"Input should be greater than or equal to {self.minimum}", param, ctx)
        return number

    def range_text(self) -> str:
        return f"x>={self.minimum}"


def _extras(*parts: str | None) -> str:
    shown = [part for part in parts if part]
    return f"  [{'; '.join(shown)}]" if shown else ""


def _range(kind: click.ParamType[Any, Any]) -> str | None:
    return kind.range_text() if isinstance(kind, Integer) else None


def _label(kind: click.ParamType[Any, Any], many: bool) -> str:
    if isinstance(kind, Integer):
        return "<int range>"
    return "<list[str]>" if many else "<str>"


class Arg(click.Argument):
    """A positional argument: ``{NAME}`` (required) or ``[NAME]`` in the usage line, and a
    line ``NAME <type>  help  [extras]`` under ``Arguments:``."""

    def __init__(self, param_decls: Sequence[str], help: str = "", **attrs: Any) -> None:
        super().__init__(param_decls, **attrs)
        self.help = help

    def _shown(self) -> str:
        return self.metavar or self.name or ""

    def get_usage_pieces(self, ctx: click.Context) -> list[str]:
        name = f"{{{self._shown()}}}" if self.required else f"[{self._shown()}]"
        return [name + ("..." if self.nargs != 1 else "")]

    def get_error_hint(self, ctx: click.Context | None) -> str:
        return f"'{self._shown()}'"

    def get_help_record(self, ctx: click.Context) -> tuple[str, str]:
        many = self.nargs != 1
        name = self._shown() + ("..." if many and self.metavar is None else "")
        extras = _extras(_range(self.type), "required" if self.required else None)
        return f"{name} {_label(self.type, many)}", ((self.help or "") + extras).lstrip()


class Opt(click.Option):
    """An option: ``--name <type>`` (or its metavar), its help, then ``[default: …; range;
    required]``; a flag shows no default."""

    def get_help_record(self, ctx: click.Context) -> tuple[str, str]:
        name = ", ".join(self.opts)
        if not self.is_flag:
            name += f" {self.metavar or _label(self.type, False)}"
        default = None
        if not self.is_flag and isinstance(self.default, int | str) and self.default != "":
            default = f"default: {self.default}"
        extras = _extras(default, _range(self.type), "required" if self.required else None)
        return name, ((self.help or "") + extras).lstrip()


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_EXTRA = re.compile(r"Got unexpected extra arguments? \((?P<args>.*)\)", re.DOTALL)


def _escaped(value: str) -> str:
    """An untrusted name in an error, control characters as ``\\xNN`` (as typer wrote it)."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match[0]):02x}", value)


def _typer_words(error: click.UsageError, ctx: click.Context) -> None:
    """Raise ``error`` in the words typer's click used (click 8.4 reworded these three;
    the close matches are the same ``difflib`` ones)."""
    if isinstance(error, click.NoSuchOption):
        message = f"No such option: {_escaped(error.option_name)}"
        if error.possibilities:
            message += f" (Possible options: {', '.join(sorted(error.possibilities))})"
        raise click.UsageError(message, ctx) from None
    if isinstance(error, click.NoSuchCommand):
        suggestions = ", ".join(map(repr, error.possibilities or ()))
        message = f"No such command {error.command_name!r}."
        raise click.UsageError(
            message + (f" Did you mean {suggestions}?" if suggestions else ""), ctx
        ) from None
    extra = _EXTRA.fullmatch(error.message)
    if extra:
        raise click.UsageError(
            f"Got unexpected extra argument(s) ({_escaped(extra['args'])})", ctx
        ) from None
    raise error


class _TyperWords(click.Command):
    """Usage errors worded as typer worded them (:func:`_typer_words`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as error:
            _typer_words(error, ctx)
            raise


class Command(_TyperWords):
    """Arguments and options in two sections, as typer listed them."""

    def format_arguments(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """Nothing: click 8.5's own "Positional arguments" section; :meth:`format_options`
        writes ours."""

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        arguments: list[tuple[str, str]] = []
        options: list[tuple[str, str]] = []
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                (arguments if isinstance(param, click.Argument) else options).append(record)
        for title, records in (("Arguments", arguments), ("Options", options)):
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


class Group(_TyperWords, click.Group):
    """The app: its commands in the order they were added, each a :class:`Command`."""

    command_class = Command

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.commands)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.UsageError as error:
            _typer_words(error, ctx)
            raise


def flag(name: str, dest: str, help: str) -> Callable[[F], F]:
    """A ``--name`` switch (``False`` unless given)."""
    return click.option(name, dest, cls=Opt, is_flag=True, default=False, help=help)


JSON_HELP = "Print JSON instead of text."

json_flag = flag("--json", "as_json", JSON_HELP)
