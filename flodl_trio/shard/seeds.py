"""The outer state a controller seeds its shards' lanes with.

A controller whose optimizer holds state the shards lack (a run resumed from a
checkpoint, or shards fixed after some windows stepped on the controller) sends
each shard, before the ``Decide`` of a params round it steps, ``Seed{decision,
lanes}`` and that many lane states. A lane no live shard holds the state of
then steps on from the controller's state instead of starting afresh
(docs/wire.md, "Seeding the shards' outer state"); a lane a shard already holds
(its own, handed back, or mirrored) ignores its seed, since the shards' state is
always the newer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..errors import ProtocolError, SchemaError
from ..fold.outer import read_lane_state
from ..wire.lanes import MAX_LANES, read_lane_tag
from ..wire.mux import Decide, Seed
from ..wire.round_frame import RoundFrame, RoundKind
from .mirror import LaneState, decision_layout

log = logging.getLogger("flodl_trio.shard")


def check_seed(msg: Seed) -> None:
    """ProtocolError for a ``Seed`` that promises more lane states than a round has lanes
    (before any of them is read)."""
    if msg.lanes > MAX_LANES:
        raise ProtocolError(f"the controller's Seed for decision {msg.decision} promises {msg.lanes} lane states "
                            f"(a round has at most {MAX_LANES} lanes)")


def seeded_states(
    seed: Seed, frames: list[RoundFrame], msg: Decide, owns: Callable[[int], bool], shard: int | None,
) -> dict[int, LaneState]:
    """The lane states ``seed`` brought, checked against the ``Decide`` that follows it:
    each a state of a lane of that decision's layout, at most once. A seed before a
    decision of another number, or one that steps nothing, or a state that is not its
    lane's shapes, is a protocol error (the controller's); a lane this shard does not
    own as it knows the lost shards (views differ only until the controller's word) is
    not taken."""
    if seed.decision != msg.decision or not msg.step:
        raise ProtocolError(f"the controller sent Seed for decision {seed.decision} before Decide {msg.decision}"
                            + ("" if msg.step else ", which steps nothing"))
    layout = decision_layout(msg)
    states: dict[int, LaneState] = {}
    for frame in frames:
        tag = read_lane_tag(frame)
        if tag is None or not 1 <= tag.index < msg.lanes or tag.count != msg.lanes or tag.index in states:
            raise ProtocolError(f"the controller seeded lane tag {tag} in decision {msg.decision} of {msg.lanes} "
                                "lanes (not a lane 1.. of it, or seeded twice)")
        if frame.kind != RoundKind.MODEL:
            raise ProtocolError(f"the controller's seed of lane {tag.index} in decision {msg.decision} is a "
                                f"{frame.kind.name} frame; a lane's state is a Model frame")
        try:
            states[tag.index] = read_lane_state(frame, layout, tag.index)
        except SchemaError as exc:
            raise ProtocolError(f"the controller's seed of decision {msg.decision}: {exc}") from None
    for lane in [lane for lane in states if not owns(lane)]:
        log.info("shard %s: seeded lane %d, not its own as it knows the lost shards; not taken", shard, lane)
        del states[lane]
    return states


__all__ = ["check_seed", "seeded_states"]
