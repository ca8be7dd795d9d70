"""The daemons: the relay and controller processes around their roles.

- :mod:`.common`: flags and environment defaults, structured logging, signals;
- :mod:`.launch`: torchrun / SLURM conventions (a rank's identity, its relay's ports);
- :mod:`.metrics`: serving a role's Prometheus collector;
- :mod:`.relay`, :mod:`.controller`: ``python -m flodl_trio.relay`` / ``python -m flodl_trio.controller``.

The daemons never import torch.
"""
