"""``python -m uapplace.daemon``: the ``uapplaced`` command."""

import sys

from uapplace.daemon.main import main

sys.exit(main())
