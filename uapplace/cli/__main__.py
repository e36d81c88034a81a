"""``python -m uapplace.cli``: the ``uapplace`` command."""

from uapplace.cli.app import main

main()
