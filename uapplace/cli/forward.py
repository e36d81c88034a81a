"""The light ``uapplace`` hands the commands that work on this machine to another process.

docs/architecture.md ("The command line: light and local"). The commands a person runs
around a switch (``apply``, ``pending``, ``status`` …) only talk to the bus, and every
one of them used to pay 0.6 s of imports at start (aiohttp, pystemd, pydantic, the demo)
that only ``install``, ``demo``, ``logs``, ``unit`` and the file fallbacks need. Those
live in :mod:`uapplace.cli.local`, which :func:`run_local` execs, the same interpreter in
the same process (``os.execv``: same PID, same standard streams, its exit code is the
command's). Their help texts are here so that ``uapplace --help`` (the light app)
and ``uapplace COMMAND --help`` (the local one) say the same. This module imports no
other part of uapplace.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

LOCAL_MODULE = "uapplace.cli.local"

INSTALL_HELP = (
    "Install the D-Bus activation file and the uapplaced user unit (with --with-shim, the "
    "shim's unit and token too), then reload. `uapplace uninstall` removes exactly these."
)
UNINSTALL_HELP = (
    "Stop the shim unit it installed, remove exactly what `uapplace install` wrote "
    "(its manifest lists it), then reload."
)
DEMO_HELP = (
    "Run the embedded demo (contained systemd; a simulated GPU and fake engines, or real "
    "llama-server units on the CPU with --engine llama.cpp)."
)
LOGS_HELP = (
    "The last lines MODEL's unit wrote: its stderr's log file (StandardError=append:|file:), "
    "else the user journal (its latest run only), else its stdout's file. Exit 7 for an "
    "unknown model or one without a unit, 1 when it has no log."
)
UNIT_HELP = (
    "Backend units from the tracked templates (systemd/templates/): add, list, show, "
    "remove. A generated unit is registered unmeasured until `uapplace measure NAME`."
)

LOCAL_COMMANDS: dict[str, str] = {
    "logs": LOGS_HELP,
    "install": INSTALL_HELP,
    "uninstall": UNINSTALL_HELP,
    "demo": DEMO_HELP,
    "unit": UNIT_HELP,
}
"""The public commands :mod:`uapplace.cli.local` runs, with their help, in ``--help`` order."""

OFFLINE_STATUS = "offline-status"
OFFLINE_PENDING = "offline-pending"
OFFLINE_VALIDATE = "offline-validate"
MEASURE_ENVELOPE = "measure-envelope"
"""Hidden commands of the local app: what a light command does when it needs the files."""

PASS_THROUGH: dict[str, Any] = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "help_option_names": [],
}
"""A forwarding command's click settings: every argument (``--help`` too) goes on as it is."""


def run_local(args: Sequence[str]) -> NoReturn:
    """Exec ``python -m uapplace.cli.local ARGS`` in this process (never returns)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", LOCAL_MODULE, *args])


def forward_argv(argv: Sequence[str]) -> None:
    """When ``argv`` (``sys.argv``) names a local command, exec it with its arguments as
    given (``--`` included, which click would drop); otherwise return."""
    if len(argv) > 1 and argv[1] in LOCAL_COMMANDS:
        run_local(argv[1:])
