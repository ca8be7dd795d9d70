"""Round arithmetic shared by the relay and the controller, free of I/O: the
realized-work fold (sum in f32, divide once) and the speculative frame that a
round's last contribution completes while it is still arriving.
"""

from .accumulator import (
    FoldAccumulator,
    ImageCache,
    finish_consensus,
    shares_sums,
    sum_frames,
)
from .speculative import SpeculativeFrame

__all__ = ["FoldAccumulator", "ImageCache", "SpeculativeFrame", "finish_consensus", "shares_sums", "sum_frames"]
