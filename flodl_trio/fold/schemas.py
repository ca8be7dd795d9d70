"""Which schema a round's frames should have, when they disagree.

A round's frames must agree on their kind and on every tensor's dtype and
shape. When two disagree, the fold has to decide which sender is wrong. The
first frame folded used to decide it, so a rank (or host) with the wrong
schema whose frame arrived first had its neighbours dropped. The schemas of
rounds the whole cluster completed - the consensus came back - are the
evidence: a frame with such a schema beats frames whose schema no completed
round had, whatever the order they arrived in. Between two schemas the
cluster never completed a round with (the run's first rounds, say) the first
frame still decides.

Free of I/O; the relay's :class:`~flodl_trio.relay.HostFold` and the
controller's :class:`~flodl_trio.controller.ControllerRound` each keep one.
"""

from __future__ import annotations

from collections import OrderedDict

from ..wire.round_frame import RoundFrame, RoundKind, describe_dtype

# A round's kind and each tensor's (dtype tag, shape), in order.
Schema = tuple[RoundKind, tuple[tuple[int, tuple[int, ...]], ...]]


def schema_of(frame: RoundFrame) -> Schema:
    """``frame``'s schema: what every frame of its round must share."""
    return frame.kind, tuple((t.dtype, tuple(t.shape)) for t in frame.tensors)


def describe_difference(ours: Schema, theirs: Schema) -> str:
    """The first way ``ours`` differs from ``theirs``, as an error names it."""
    if ours[0] != theirs[0]:
        return f"a {ours[0].name} frame, not {theirs[0].name}"
    if len(ours[1]) != len(theirs[1]):
        return f"{len(ours[1])} tensors, not {len(theirs[1])}"
    for index, ((dtype, shape), (their_dtype, their_shape)) in enumerate(zip(ours[1], theirs[1], strict=True)):
        if dtype != their_dtype:
            return f"tensor {index} in {describe_dtype(dtype)}, not {describe_dtype(their_dtype)}"
        if shape != their_shape:
            return f"tensor {index} of shape {list(shape)}, not {list(their_shape)}"
    return "the same schema"


def why_taken_out(folded: Schema, arriving: Schema, arrived_from: str) -> str:
    """Why frames with schema ``folded`` were taken out of a round for one with ``arriving``
    (a completed round's) from ``arrived_from``; the caller names whose frame it was."""
    return (
        f"has {describe_difference(folded, arriving)}, the schema earlier rounds completed with "
        f"({arrived_from} sent it); its contribution was taken out of the round"
    )


class AgreedSchemas:
    """The schemas of the rounds the cluster completed, the most recent ``limit``.

    A run has a handful (a window's counts, params and buffers rounds; each
    fragment's) and repeats them, so the bound is never reached in practice;
    it only keeps a run that changes its tensors every round from growing it.
    """

    def __init__(self, limit: int = 1024) -> None:
        self.limit = limit
        self._seen: OrderedDict[Schema, None] = OrderedDict()

    def __contains__(self, schema: object) -> bool:
        return schema in self._seen

    def __len__(self) -> int:
        return len(self._seen)

    def agree(self, schema: Schema) -> None:
        """A round with ``schema`` completed (its consensus came back)."""
        self._seen[schema] = None
        self._seen.move_to_end(schema)
        while len(self._seen) > self.limit:
            self._seen.popitem(last=False)

    def folded_frames_at_fault(self, folded: Schema | None, arriving: Schema) -> bool:
        """Whether a frame ``arriving`` with its schema, against a round whose
        folded frames have ``folded``, proves those frames wrong: the cluster
        completed rounds with the arriving schema and never with theirs."""
        return folded is not None and folded != arriving and arriving in self and folded not in self


__all__ = ["AgreedSchemas", "Schema", "describe_difference", "schema_of", "why_taken_out"]
