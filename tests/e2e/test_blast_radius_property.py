"""Property: whatever authenticated frame a rank sends, only that rank can pay for it.

Hypothesis builds frames a rank with the right salt could send - random kind
byte, weight, tensor count, dtype tags, shapes and byte counts, sometimes with
stray bytes after them - and each one goes through a real relay (real TCP)
after two honest ranks of the same host deposited theirs. Either the frame is
a contribution the round can take (then every honest rank receives the exact
realized-work average including it), or it is not (then its sender is
dropped, the honest ranks receive the average of their own two frames, and
nobody else is declared dead). Either way the honest ranks' round is exact.
"""

from __future__ import annotations

import math
import struct

import attrs
import numpy as np
import torch
import trio
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from flodl_trio import SessionSalt, connect_reduce_client
from flodl_trio.testing import open_local_cluster
from flodl_trio.transport import MessageStream
from flodl_trio.wire import encode_data_handshake
from flodl_trio.wire.constants import ROUND_FRAME_MAGIC
from flodl_trio.wire.handshake import DATA_ACK_LEN

SALT = SessionSalt(b"\x42" * 16)
HONEST = {1: 1.0, 2: 3.0}  # rank -> the value of each of its 4 elements
ITEMSIZE = {0: 4, 1: 2}


@attrs.frozen
class Tensor:
    dtype: int
    shape: tuple[int, ...]
    nbytes: int
    payload: bytes


@attrs.frozen
class Frame:
    kind: int
    weight: float
    tensors: tuple[Tensor, ...]
    tail: bytes  # stray bytes after the tensors, before the MAC

    def body(self) -> bytes:
        out = struct.pack("<IIBd", ROUND_FRAME_MAGIC, len(self.tensors), self.kind, self.weight)
        for t in self.tensors:
            out += struct.pack(f"<BB{len(t.shape)}IQ", t.dtype, len(t.shape), *t.shape, t.nbytes) + t.payload
        return out + self.tail

    def signed(self) -> bytes:
        body = self.body()
        return body + SALT.mac8(body)

    def foldable(self) -> bool:
        """Whether the round can take it beside the honest f32[4] Model frames of weight 1."""
        if self.tail or self.kind != 0 or not (math.isfinite(self.weight) and self.weight >= 0):
            return False
        if not math.isfinite(self.weight + 2.0) or len(self.tensors) != 1:
            return False
        (t,) = self.tensors
        return t.dtype == 0 and t.shape == (4,) and t.nbytes in (0, 16)

    def consensus(self) -> np.ndarray:
        """The honest ranks' answer: the exact fold (honest sum, then this frame) over the mass."""
        honest = np.full(4, sum(HONEST.values()), dtype=np.float32)
        if not self.foldable():
            return honest * np.float32(1.0 / len(HONEST))
        (t,) = self.tensors
        mine = np.frombuffer(t.payload, dtype="<f4") if t.nbytes else np.zeros(4, np.float32)
        with np.errstate(over="ignore", invalid="ignore"):
            return (honest + mine) * np.float32(1.0 / (len(HONEST) + self.weight))


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    dtype = draw(st.integers(0, 2))
    shape = tuple(draw(st.lists(st.integers(0, 5), max_size=2)))
    if draw(st.booleans()):  # often consistent with the shape, sometimes elided
        numel = math.prod(shape)
        nbytes = draw(st.sampled_from([0, numel * ITEMSIZE.get(dtype, 4)]))
    else:
        nbytes = draw(st.integers(0, 40))
    return Tensor(dtype, shape, nbytes, draw(st.binary(min_size=nbytes, max_size=nbytes)))


frames = st.builds(
    Frame,
    kind=st.integers(0, 2),
    weight=st.sampled_from([0.0, 1.0, 2.5, -1.0, math.nan, math.inf, 1e308]),
    tensors=st.lists(tensors(), max_size=3).map(tuple),
    tail=st.sampled_from([b"", b"\x00", b"\x01\x02\x03"]),
)
# Frames that look like the honest ones but for one detail, so the "it folds" side is exercised too.
near_honest = st.builds(
    Frame,
    kind=st.sampled_from([0, 0, 0, 1]),
    weight=st.sampled_from([0.0, 1.0, 2.5, 1e308]),
    tensors=st.tuples(
        st.builds(Tensor, dtype=st.sampled_from([0, 0, 0, 1, 7]), shape=st.sampled_from([(4,), (4,), (4,), (3,), (2, 2)]),
                  nbytes=st.sampled_from([16, 16, 16, 0, 12]), payload=st.just(b""))
        .map(lambda t: attrs.evolve(t, payload=np.linspace(-8, 8, t.nbytes // 4, dtype="<f4").tobytes()[: t.nbytes]))
    ),
    tail=st.sampled_from([b"", b"", b"", b"\x00"]),
)


async def run_round(frame: Frame) -> tuple[dict[int, np.ndarray], bool]:
    """The honest ranks' answers (a dropped honest rank would raise instead), and
    whether the sender was cut off."""
    got: dict[int, np.ndarray] = {}
    with trio.fail_after(20):
        async with open_local_cluster(world_size=3, hosts=[[0, 1, 2]], salt=SALT) as cluster:
            relay = cluster.relays[0]
            attacker = MessageStream(await trio.open_tcp_stream(*cluster.relay_address(0)), "rank 0")
            await attacker.send_chunks([encode_data_handshake(0, 3)])
            await attacker.receive_exactly(DATA_ACK_LEN, "ack")

            async def honest(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, SALT) as client:
                    [mean] = await client.all_reduce_tensors([torch.full((4,), HONEST[rank])])
                    got[rank] = mean.numpy()

            async with trio.open_nursery() as nursery:
                for rank in HONEST:
                    nursery.start_soon(honest, rank)
                while relay.stats.bytes_local < 2 * (4 + 17 + 14 + 16 + 8):  # both honest frames folded first
                    await trio.sleep(0.001)
                signed = frame.signed()
                await attacker.send_len_framed([signed], len(signed))
            cut_off = await closed_within(attacker, 0.2)
    return got, cut_off


async def closed_within(conn: MessageStream, seconds: float) -> bool:
    with trio.move_on_after(seconds):
        try:
            return await conn.stream.receive_some(4) == b""
        except trio.BrokenResourceError:
            return True
    return False


VALID_VALUES = np.array([0.5, -2.0, 8.0, 1e-3], dtype="<f4").tobytes()


@settings(max_examples=60, deadline=None)
@given(frame=st.one_of(frames, near_honest, near_honest))
@example(frame=Frame(0, 2.5, (Tensor(0, (4,), 16, VALID_VALUES),), b""))  # folds, with a mass of its own
@example(frame=Frame(0, 0.0, (Tensor(0, (4,), 0, b""),), b""))  # folds: elided, weight 0
@example(frame=Frame(0, 1e308, (Tensor(0, (4,), 16, VALID_VALUES),), b""))  # folds: 1e308 + 2 is finite
@example(frame=Frame(1, 1.0, (Tensor(0, (4,), 16, VALID_VALUES),), b""))  # a Control frame in a Model round
@example(frame=Frame(0, 1.0, (Tensor(7, (4,), 16, VALID_VALUES),), b""))  # unknown dtype
@example(frame=Frame(0, 1.0, (Tensor(0, (3,), 16, VALID_VALUES),), b""))  # 16 bytes for f32[3]
def test_only_the_sender_of_an_authenticated_bad_frame_pays(frame: Frame) -> None:
    event(f"foldable: {frame.foldable()}")
    got, cut_off = trio.run(run_round, frame)
    want = frame.consensus()
    for rank in HONEST:
        np.testing.assert_array_equal(got[rank], want, err_msg=f"rank {rank}, frame {frame}")
    assert cut_off is not frame.foldable(), f"sender cut off: {cut_off}; frame {frame}"
