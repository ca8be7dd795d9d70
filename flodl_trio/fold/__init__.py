"""Round arithmetic shared by the relay and the controller: the realized-work
fold (sum in f32, divide once; pure numpy) and the speculative frame that a
round's last contribution completes while it is still arriving (a sans-IO
core, plus the one async driver that runs it beside a receive).

The round *state* - who must deliver, who did - is each role's own I/O-free
object: :class:`flodl_trio.relay.HostFold` and
:class:`flodl_trio.controller.ControllerRound`.
"""

from .accumulator import (
    FoldAccumulator,
    ImageCache,
    finish_consensus,
    shares_sums,
    sum_frames,
)
from .speculative import Speculation, SpeculativeFrame, receive_speculating

__all__ = [
    "FoldAccumulator",
    "ImageCache",
    "Speculation",
    "SpeculativeFrame",
    "finish_consensus",
    "receive_speculating",
    "shares_sums",
    "sum_frames",
]
