"""The controller: one port, one connection per host relay, one consensus per round.

- :mod:`.core`: :func:`open_controller` and the tasks that move a round's bytes;
- :mod:`.config`: :class:`ControllerConfig`, the arguments checked;
- :mod:`.joins`: :class:`Returns`, ranks coming back (the join exchange);
- :mod:`.membership`: a rank's life and the rejoin and formation policy, no I/O;
- :mod:`.status`: the JSON status page;
- :mod:`.seats`: :class:`~.seats.Seats`, the accepted relays and their ranks (one for every lane);
- :mod:`.round`: :class:`ControllerRound`, one round, with no I/O;
- :mod:`.windows`, :mod:`.lane_windows`: the rounds and the windows they make (outer step, checkpoints);
- :mod:`.links`: a relay connection as the controller sees it (sole writer, outbox);
- :mod:`.coordinator`: heartbeats, beacons and model signatures (the control channel);
- :mod:`.dead_ranks`: :class:`DeadRanks`, the cluster's record of dead ranks;
- :mod:`.checkpointer`: :class:`ConsensusCheckpointer`, each window's consensus to disk;
- :mod:`.stats`: the counters; :mod:`.cli`: the daemon (``python -m flodl_trio.controller``).
"""

from .checkpointer import ConsensusCheckpointer
from .core import ControllerHandle, open_controller
from .dead_ranks import DeadRanks
from .round import CheckpointSink, ControllerRound, OuterOptimizer
from .stats import ControllerStats, LatencyHistogram

__all__ = [
    "CheckpointSink",
    "ConsensusCheckpointer",
    "ControllerHandle",
    "ControllerRound",
    "ControllerStats",
    "DeadRanks",
    "LatencyHistogram",
    "OuterOptimizer",
    "open_controller",
]
