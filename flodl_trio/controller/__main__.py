"""``python -m flodl_trio.controller``: an entry point only; the daemon is :mod:`flodl_trio.daemon.controller`."""

import sys

from ..daemon.controller import main

sys.exit(main())
