"""A rank's side of the delta rounds (docs/wire.md, "Delta rounds"), free of I/O and torch.

In a delta round a rank sends what its window changed - its params minus the
*base*, the consensus it started the window from - in a blockwise code, and
receives the new consensus as a delta against that same base. The rank keeps:

- the base (one f32 copy of the params), bit for bit what the controller
  holds for it, checked by digest after every consensus;
- the uplink's error feedback (what its code dropped, and a scratch): two more
  f32 copies.

A lineage starts with one f32 round: the rank has no base yet (a fresh run), so
it sends its params in f32 with the all-zero digest, and the consensus that
comes back, in f32 with its digest, becomes the base. A rank that joined a
running cluster starts from the state it was given, which is that base.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..errors import FlodlError, SchemaError
from ..fold.delta import NO_BASE, DeltaUplink, apply_delta, codec_of, delta_frame, digest_of
from ..wire.constants import DTYPE_F32
from ..wire.quant import DIGEST_LEN, DTYPE_BASE_DIGEST, F32, DeltaCodec, F32Array, base_digest
from ..wire.round_frame import RoundFrame, RoundKind, TensorPayload


# Hashes each new base while the rank trains on (BLAKE2b releases the GIL): the check
# is off the round's critical path, and done before the base is used to send again.
_BASE_HASHER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flodl-base-digest")


class RankDelta:
    """One rank's delta-round state for one params set (see the module docstring)."""

    def __init__(self, codec: DeltaCodec, *, error_feedback: bool = True, owner: str = "this rank") -> None:
        self.codec = codec
        self.owner = owner  # who it is, for errors: "rank 3", "rank 3, fragment 1 of 4"
        self.error_feedback = error_feedback
        self.base: list[F32Array] | None = None
        self.digest = NO_BASE
        self._uplink: DeltaUplink | None = None
        self._snapshot: list[F32Array] = []
        self._check: tuple[Future[bytes], bytes, int] | None = None  # the last consensus's digest check

    def snapshot_buffers(self, sizes: Sequence[int]) -> list[F32Array]:
        """Arrays to copy the params into each window (kept from window to window)."""
        if [a.size for a in self._snapshot] != list(sizes):
            self._snapshot = [np.empty(n, dtype=F32) for n in sizes]
        return self._snapshot

    def start_from(self, params: Sequence[F32Array]) -> None:
        """The base is ``params`` (a joiner's state: the controller's base in f32)."""
        self.base = [np.array(p, dtype=F32, copy=True).reshape(-1) for p in params]
        self.digest = base_digest(self.base)

    def frame(self, params: Sequence[F32Array], shapes: Sequence[tuple[int, ...]], weight: float) -> RoundFrame:
        """This window's contribution: ``weight x (params - base)`` coded (plus the residual,
        when ``weight`` > 0), or - with no base yet - ``weight x params`` in f32 (the
        lineage's first round); the digest last.
        The last consensus's digest check ends first: no delta goes out against a
        base that differs."""
        self.verify()
        w = np.float32(weight)
        if self.base is None:
            tensors = [TensorPayload(DTYPE_F32, shape, np.multiply(p, w, dtype=F32)) for p, shape in zip(params, shapes)]
            tensors.append(TensorPayload(DTYPE_BASE_DIGEST, (DIGEST_LEN,), NO_BASE))
            return RoundFrame(tensors, RoundKind.MODEL, weight)
        sizes = [b.size for b in self.base]
        if [p.size for p in params] != sizes:
            raise SchemaError(
                f"{self.owner}: a delta round's params have sizes {[p.size for p in params]}, its base (from join() "
                f"or the last consensus) has {sizes}: the params set differs from the cluster's (another model, or "
                "another fragment count)"
            )
        if self._uplink is None or self._uplink.sizes != tuple(sizes):
            self._uplink = DeltaUplink(self.codec.code, self.codec.block, sizes, error_feedback=self.error_feedback)
        uplink = self._uplink
        if not w > 0:  # no work: a zero delta, and the residual waits for a window with work
            zeros = [np.zeros(size, dtype=F32) for size in sizes]
            return delta_frame(zeros, shapes, self.codec, self.digest, weight,
                               lambda index, delta, out: uplink.hold_piece(index, 0, delta, out))
        staged = [uplink.stage(i, p, b, w) for i, (p, b) in enumerate(zip(params, self.base))]
        return delta_frame(staged, shapes, self.codec, self.digest, weight, uplink.encode_staged)

    def take(self, reply: RoundFrame, rank: int) -> list[F32Array] | None:
        """The consensus in: the base advanced (or set, after a lineage's first round);
        the new params. The base is checked against the digest the controller computed
        in a thread meanwhile; :meth:`verify` (which :meth:`frame` and the next take
        call first) waits for the check and raises if the two differ. None: a first
        round with zero accepted mass, which started no lineage (its sums are no one's
        params): the rank keeps its own params and has no base yet."""
        self.verify()
        digest = digest_of(reply)
        if digest is None:
            raise SchemaError(f"rank {rank}: a delta round's consensus carries no base digest")
        codec = codec_of(reply)
        if codec is None and digest == NO_BASE:
            self.base, self.digest = None, NO_BASE
            return None
        if codec is None:
            self.base = [np.array(np.frombuffer(t.data, dtype=F32), copy=True) if t.nbytes else np.zeros(t.numel, F32)
                         for t in reply.tensors[:-1]]
        elif self.base is None:
            raise SchemaError(f"rank {rank}: a delta consensus came back for a round this rank sent in f32")
        else:
            apply_delta(self.base, [t.data for t in reply.tensors[:-1]], codec.code, codec.block)
        self.digest = digest
        self._check = (_BASE_HASHER.submit(base_digest, self.base), digest, rank)
        return self.base

    def verify(self) -> None:
        """The last consensus's digest check, waited for: FlodlError if this rank's base
        is not the controller's (nothing to wait for when none is pending)."""
        if self._check is None:
            return
        future, digest, rank = self._check
        self._check = None
        mine = future.result()
        if mine != digest:
            raise FlodlError(
                f"rank {rank}: after the consensus this rank's base is {mine.hex()}, the controller's is "
                f"{digest.hex()}: the two diverged (a bug, or a consensus this rank did not apply)"
            )


__all__ = ["RankDelta"]
