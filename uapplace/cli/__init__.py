"""``uapplace``: the command line.

``app`` holds the commands, ``session`` one bus conversation per command and the
exit codes, ``render`` the daemon's JSON as text, ``enforce`` apply/load/unload with
their impact and consent, ``files`` what the CLI reads itself when the daemon is not
there, ``install`` the activation file and user units, ``logs`` a model's unit's own
last lines (``uapplace logs``).

May import: ``core``, ``files``, ``bus``, ``io``, ``demo``. Never the controller,
enforcement, recovery, publication or the daemon: the CLI talks to the daemon over
the bus only.
"""
