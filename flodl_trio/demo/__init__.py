"""``python -m flodl_trio.demo``: a whole local cluster training a small model (see :mod:`.main`)."""
