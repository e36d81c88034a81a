"""``uapplace``: the command line.

``app`` holds the commands (the *light* app: the console entry, plain click, its
parameters shown as typer showed them by ``params``), ``session`` one bus conversation
per command and the exit codes, ``render`` the daemon's JSON as text, ``enforce``
apply/load/unload with their impact and consent, ``forward`` the exec of ``local``: the
commands that work on this machine (``install``, ``uninstall``, ``demo``, ``logs``,
``unit``, ``measure --envelope``) and the file fallbacks (a typer app: ``typer_app``),
which only it imports: ``files`` what the CLI reads itself when the daemon is not there,
``install`` the activation file and user units, ``logs`` a model's unit's own last lines
(``uapplace logs``), ``unit`` backend units from the tracked templates (``uapplace
unit``). ``top`` is the live terminal view, its own process too (Textual; its pure view
in ``top_view``). Why: docs/architecture.md ("The command line: light and local");
``make layering`` keeps ``app``, ``params``, ``session``, ``render``, ``enforce`` and
``forward`` free of aiohttp, pystemd, pydantic, typer, Textual and the demo.

May import: ``core``, ``files``, ``bus``, ``io``, ``demo``. Never the controller,
enforcement, recovery, publication or the daemon: the CLI talks to the daemon over
the bus only.

Why 14 modules: the command line is two processes' worth of commands (the light app and
the local one it execs), each command family one module; splitting them into two
sub-packages would hide that ``local`` is only ever reached through ``forward``.
"""
