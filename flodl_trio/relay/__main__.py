"""``python -m flodl_trio.relay``: an entry point only; the daemon is :mod:`flodl_trio.daemon.relay`."""

import sys

from ..daemon.relay import main

sys.exit(main())
