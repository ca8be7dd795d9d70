"""``python -m flodl_trio.shard``: an entry point only; the daemon is :mod:`flodl_trio.daemon.shard`."""

import sys

from ..daemon.shard import main

sys.exit(main())
