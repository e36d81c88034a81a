"""The typer app of the local commands (:mod:`uapplace.cli.local`, :mod:`uapplace.cli.unit`).

The light app is plain click (:mod:`uapplace.cli.params`); what only the local app needs
from typer is here, so that the light one never imports it (docs/architecture.md, "The
command line: light and local").
"""

from __future__ import annotations

from typing import Annotated

import typer

from uapplace.cli.params import JSON_HELP
from uapplace.cli.session import APP_HELP, EXIT_CODES_HELP

JsonFlag = Annotated[bool, typer.Option("--json", help=JSON_HELP)]


def placement_app() -> typer.Typer:
    """The local ``uapplace`` app: the same help and exit-code epilog as the light one."""
    return typer.Typer(
        help=APP_HELP,
        epilog=EXIT_CODES_HELP,
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        rich_markup_mode=None,
    )
