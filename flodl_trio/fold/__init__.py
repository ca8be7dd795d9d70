"""Round arithmetic shared by the relay and the controller: the realized-work
fold (sum in f32, divide once; pure numpy), the speculative frame that a
round's last contribution completes while it is still arriving (a sans-IO
core, plus the one async driver that runs it beside a receive), and the
schemas of completed rounds that settle which frames of a round are wrong.

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
from .schemas import AgreedSchemas, describe_difference, schema_of
from .speculative import Speculation, SpeculativeFrame, receive_speculating

__all__ = [
    "AgreedSchemas",
    "FoldAccumulator",
    "ImageCache",
    "Speculation",
    "SpeculativeFrame",
    "describe_difference",
    "finish_consensus",
    "receive_speculating",
    "schema_of",
    "shares_sums",
    "sum_frames",
]
