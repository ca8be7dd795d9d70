"""A hostile or broken relay on the resume and delta-round paths costs only itself
(docs/wire.md, "resuming after a lost controller" and "delta rounds"; docs/liveness.md,
"Who pays for an error"): real controller, relays and sockets, one trio run each.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import trio

from flodl_trio import average_window, connect_reduce_client
from flodl_trio.errors import FlodlError
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire import DTYPE_F32, Hello, MuxKind, RoundFrame, TensorPayload
from flodl_trio.wire.constants import CHANNEL_MAGIC_DATA, MUX_HEADER_LEN
from flodl_trio.wire.mux import (
    EXTENSIONS_MARK, NO_BROADCAST, DeclareDead, HelloAck, Resume, decode_control_msg, decode_mux_record, encode_control_record, encode_mux_record,
    parse_mux_header,
)
from flodl_trio.wire.round_frame import RoundKind, encode_round_frame
from flodl_trio.wire.quant import DTYPE_BASE_DIGEST, F32, DeltaCodec
from flodl_trio.wire.salt import SessionSalt

SALT = SessionSalt(b"hostile-resume-s")
SHAPES = [(3001,), (7, 5)]
DEADLINE_S = 60


def _model(rank: int) -> list[torch.Tensor]:
    rng = np.random.default_rng([11, rank])
    return [torch.from_numpy(rng.standard_normal(int(np.prod(s))).astype(F32)).view(s) for s in SHAPES]


def _step(params: list[torch.Tensor], rank: int, window: int) -> None:
    """What rank's inner steps add to its params in ``window``."""
    rng = np.random.default_rng([rank, window])
    with torch.no_grad():
        for p in params:
            p.view(-1).add_(torch.from_numpy((rng.standard_normal(p.numel()) * 1e-2).astype(F32)))


@pytest.mark.parametrize("hosts", [[[0], [1], [2]], [[0, 1], [2]]], ids=["at-the-controller", "at-the-relay"])
@pytest.mark.parametrize("lanes", [1, 3])
@pytest.mark.trio
async def test_a_rank_restarting_the_lineage_mid_run_costs_only_itself(caplog, lanes, hosts):
    """Rank 0 drops its base after window 0 and sends window 1's params as a lineage's
    first round (f32, the zero digest): a base that is not the cluster's. Folded first
    (deterministic mode: lowest rank first), it must cost rank 0 alone (its host, where
    it is alone), not the honest ranks whose coded deltas are against the base; in
    lanes, refused at its lane 0 (whose schema says so) before any of its lanes folds.
    Sharing a host, it is refused by its relay, as any rank against another base is."""
    codec = DeltaCodec.parse("int8")
    world, windows = 3, 4
    errors: dict[int, BaseException] = {}
    seen: dict[tuple[int, int], list[np.ndarray]] = {}

    async def rank_main(rank: int) -> None:
        params = _model(rank)
        try:
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
                client.delta_codec = codec
                for window in range(windows):
                    if rank == 0 and window == 1:
                        state = client.delta_state()
                        state.verify()
                        state.base = None  # as a lineage's first round: f32 params, the zero digest
                    _step(params, rank, window)
                    await average_window(client, params, [], 1 + rank, rank=rank, world_size=world, in_place=True)
                    seen[rank, window] = [p.detach().reshape(-1).numpy().copy() for p in params]
        except FlodlError as exc:
            errors[rank] = exc

    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=world, hosts=hosts, salt=SALT, deterministic=True, local_leg=False,
            lanes=lanes, lane_min_bytes=0,
        ) as cluster:
            async with trio.open_nursery() as nursery:
                for rank in range(world):
                    nursery.start_soon(rank_main, rank)
            dead = cluster.controller.dead_ranks.snapshot()
    assert set(errors) == {0}, errors
    assert dead == {0}
    for window in range(windows):
        for a, b in zip(seen[1, window], seen[2, window]):
            assert np.array_equal(a, b), window
    assert "is against base 00000000000000000000000000000000" in caplog.text, caplog.text[-3000:]
    assert "rank 0" in caplog.text or "ranks [0]" in caplog.text


# -- a relay played by hand -------------------------------------------------------------

LOOP = "127.0.0.1"


async def _receive_exactly(stream: trio.SocketStream, n: int) -> bytes | None:
    data = b""
    while len(data) < n:
        chunk = await stream.receive_some(n - len(data))
        if not chunk:
            return None
        data += chunk
    return data


async def _next_record(stream: trio.SocketStream) -> tuple[MuxKind, bytes] | None:
    """The next verified record the controller wrote; None once it closed the connection."""
    try:
        header = await _receive_exactly(stream, MUX_HEADER_LEN)
        if header is None:
            return None
        length = parse_mux_header(header).length
        payload = await _receive_exactly(stream, length) if length else b""
    except (trio.BrokenResourceError, OSError):
        return None
    if payload is None:
        return None
    record = decode_mux_record(header + payload, SALT)
    return record.kind, bytes(record.payload)


async def _evil_relay(port: int, ranks: list[int], mark: bool = False) -> trio.SocketStream:
    """A relay of ``ranks`` (it holds the salt) whose Hello was taken: HelloAck read."""
    stream = await trio.open_tcp_stream(LOOP, port)
    await stream.send_all(CHANNEL_MAGIC_DATA.to_bytes(4, "little") + encode_control_record(Hello("evil", ranks, [EXTENSIONS_MARK] if mark else []), SALT))
    while True:
        record = await _next_record(stream)
        assert record is not None, "the controller refused the relay's Hello"
        if record[0] is MuxKind.CONTROL and isinstance(decode_control_msg(record[1]), HelloAck):
            return stream


async def _send_host_frame(stream: trio.SocketStream, value: float, numel: int = 4) -> None:
    frame = RoundFrame([TensorPayload(DTYPE_F32, (numel,), np.full(numel, value, "<f4"))], RoundKind.MODEL, 1.0)
    await stream.send_all(encode_mux_record(MuxKind.HOST_FRAME, encode_round_frame(frame, SALT), SALT).tobytes())


async def _until_closed_or_broadcast(stream: trio.SocketStream) -> MuxKind | None:
    """Read what the controller writes: BROADCAST as soon as one comes, None once it closed."""
    while (record := await _next_record(stream)) is not None:
        if record[0] is MuxKind.BROADCAST:
            return MuxKind.BROADCAST
    return None


async def test_a_resume_mid_session_is_refused_and_costs_only_its_relay(tmp_path):
    """``Resume`` is said once, first, on a connection that replaces a lost one. One said
    after the relay's HostFrame of the open round was folded must not be answered (with
    the last Broadcast again, which let the relay send a second HostFrame into the same
    round: its contribution counted twice): the relay is dropped, the others' rounds go on."""
    got: list[float] = []
    world = 3
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=world, hosts=[[0, 1]], salt=SALT, lanes=1, resume_dir=tmp_path,
        ) as cluster:
            evil = await _evil_relay(cluster.controller.port, [2])
            round_one, evil_done = trio.Event(), trio.Event()

            async def honest(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
                    for round_ in range(3):
                        out = await client.all_reduce_tensors([torch.full((4,), float(rank))])
                        if rank == 0:
                            got.append(out[0][0].item())
                        if round_ == 0:
                            round_one.set()
                            await evil_done.wait()

            async with trio.open_nursery() as nursery:
                for rank in (0, 1):
                    nursery.start_soon(honest, rank)
                await _send_host_frame(evil, 2.0)
                assert await _until_closed_or_broadcast(evil) is MuxKind.BROADCAST  # round 1's consensus
                await round_one.wait()
                await _send_host_frame(evil, 5.0)  # round 2's, folded
                resume = Resume(NO_BROADCAST, awaiting=True, resends=False)  # "one behind": round 1's tag was the one before
                await evil.send_all(encode_control_record(resume, SALT))
                answer = await _until_closed_or_broadcast(evil)
                assert answer is None, "a Resume said mid-session was answered with a Broadcast"
                evil_done.set()
            assert cluster.controller.dead_ranks.snapshot() == {2}
    assert got == [1.0, 2.0, 0.5]


_CODE = DeltaCodec.parse("int8:256")
_CODED = TensorPayload(_CODE.tag, (300,), bytes(_CODE.payload_bytes(300)))
_NO_BASE = TensorPayload(DTYPE_BASE_DIGEST, (16,), bytes(16))
_F32 = TensorPayload(DTYPE_F32, (4,), np.ones(4, "<f4"))
MISSHAPEN = {  # delta tags where no delta round puts them
    "codes-without-a-digest": [_CODED, _F32],
    "the-digest-first": [_NO_BASE, _CODED],
    "two-digests": [_F32, _NO_BASE, _NO_BASE],
    "a-digest-alone": [_NO_BASE],
    "codes-against-no-base": [_CODED, _NO_BASE],  # a lineage's first round is f32
}


@pytest.mark.parametrize("shape", list(MISSHAPEN))
@pytest.mark.parametrize(
    ("mark", "lane_min_bytes"), [(False, 0), (True, 1 << 20)], ids=["flodl-relay-cut-here", "one-lane-whole"],
)
@pytest.mark.trio
async def test_a_frame_with_delta_tags_out_of_place_costs_only_its_relay(shape, mark, lane_min_bytes, caplog):
    """A first round (no schema agreed yet: the first frame folded decides, and deterministic
    mode folds the hostile relay's first) whose frame carries delta tags where no delta
    round has them. Folded, its sums made a consensus the controller's own lane
    assembler refused, and the controller stopped: every relay lost. It must be refused
    as it is folded, costing its relay alone; the honest rank's round completes."""
    world = 2
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(
            world_size=world, hosts=[[1]], salt=SALT, deterministic=True, lanes=2, lane_min_bytes=lane_min_bytes,
        ) as cluster:
            evil = await _evil_relay(cluster.controller.port, [0], mark)
            frame = RoundFrame(MISSHAPEN[shape], RoundKind.MODEL, 1.0)
            await evil.send_all(encode_mux_record(MuxKind.HOST_FRAME, encode_round_frame(frame, SALT), SALT).tobytes())
            got: list[float] = []

            async def honest() -> None:
                async with connect_reduce_client(cluster.relay_address(1), 1, world, SALT) as client:
                    got.append((await client.all_reduce_tensors([torch.full((4,), 3.0)]))[0][0].item())

            async with trio.open_nursery() as nursery:
                nursery.start_soon(honest)
                assert await _until_closed_or_broadcast(evil) is None
            assert cluster.controller.dead_ranks.snapshot() == {0}
    assert got == [3.0]
    assert "relay evil (ranks [0])" in caplog.text and "dropped for breaking the protocol" in caplog.text


def _resume_bytes(last: bytes, awaiting: int, resends: int, tail: bytes = b"") -> bytes:
    """A Resume's control message as raw bytes (variant 204), whatever its fields say."""
    return b"\xcc" + last + bytes([awaiting, resends]) + tail


RESUMES = {  # what a relay of another run, a broken one or a liar says first
    "a-broadcast-never-sent": (_resume_bytes(b"\x5a" * 8, 1, 1), "not one of this controller's last two"),
    "awaiting-what-never-came": (_resume_bytes(NO_BROADCAST, 1, 0), "never sent one after the last it has"),
    "resends-without-awaiting": (_resume_bytes(NO_BROADCAST, 0, 1), "resends a HostFrame it does not await"),
    "awaiting-2": (_resume_bytes(NO_BROADCAST, 2, 0), "Resume awaiting"),
    "a-byte-after-it": (_resume_bytes(NO_BROADCAST, 0, 0, b"\x00"), "Resume: 1 trailing bytes"),
    "cut-short": (b"\xcc" + bytes(5), "Resume last_broadcast"),
}


async def _until_closed_or_told_dead(stream: trio.SocketStream, rank: int) -> None:
    """Read until the controller closes or tells the relay that ``rank`` is dead; a
    Broadcast before either is a failure (it would have been answered as resumed)."""
    while (record := await _next_record(stream)) is not None:
        assert record[0] is not MuxKind.BROADCAST, "a refused Resume was sent a consensus"
        if record[0] is MuxKind.CONTROL and decode_control_msg(record[1]) == DeclareDead(rank):
            return


@pytest.mark.parametrize("case", list(RESUMES))
@pytest.mark.trio
async def test_a_resume_the_controller_cannot_take_costs_only_its_relay(tmp_path, case, caplog):
    """A Resume that names no consensus this controller sent, or that the wire refuses,
    as the relay's first record: its ranks are dead (each told, so a relay ends instead
    of dialing on), the log says why, and the other relay's rounds complete exactly."""
    raw, why = RESUMES[case]
    world, got = 3, []
    with trio.fail_after(DEADLINE_S):
        async with open_local_cluster(world_size=world, hosts=[[0, 1]], salt=SALT, lanes=1, resume_dir=tmp_path) as cluster:
            evil = await _evil_relay(cluster.controller.port, [2], True)
            await evil.send_all(encode_mux_record(MuxKind.CONTROL, raw, SALT).tobytes())

            async def honest(rank: int) -> None:
                async with connect_reduce_client(cluster.relay_address(rank), rank, world, SALT) as client:
                    for _ in range(2):
                        out = await client.all_reduce_tensors([torch.full((4,), float(rank))])
                        got.append(out[0][0].item())

            async with trio.open_nursery() as nursery:
                for rank in (0, 1):
                    nursery.start_soon(honest, rank)
                await _until_closed_or_told_dead(evil, 2)
            assert cluster.controller.dead_ranks.snapshot() == {2}
    assert got == [0.5] * 4
    assert why in caplog.text and "relay evil (ranks [2])" in caplog.text, caplog.text[-2000:]
