"""Every error costs only the peer that caused it (real sockets throughout).

Each test plays a broken or hostile peer against real roles and checks two
things: the peer that sent the bad bytes is the one dropped (or its bytes are
ignored, where the protocol says so), and its neighbours - the other ranks of
its host, the other hosts - carry on with exact results.
"""

from __future__ import annotations

import logging
import re
import struct

import numpy as np
import pytest
import torch
import trio

from flodl_trio import (
    DTYPE_F32,
    FlodlError,
    RoundFrame,
    SessionSalt,
    TensorPayload,
    connect_reduce_client,
)
from flodl_trio.client import connect_control_client
from flodl_trio.controller import open_controller
from flodl_trio.errors import DesyncError
from flodl_trio.relay import ChannelKind, open_relay
from flodl_trio.testing import open_local_cluster
from flodl_trio.transport import MessageStream, ReceiveBuffer
from flodl_trio.wire import (
    MuxKind,
    encode_data_handshake,
    encode_mux_record,
    encode_round_frame,
)
from flodl_trio.wire.constants import CHANNEL_MAGIC_CONTROL
from flodl_trio.wire.control_frame import (
    ControlFrame,
    ControlKind,
    encode_control_frame,
)
from flodl_trio.wire.handshake import (
    CONTROL_ACK_LEN,
    DATA_ACK_LEN,
    encode_control_handshake,
)
from flodl_trio.wire.liveness import HEARTBEAT_TAG, heartbeat_frame
from flodl_trio.wire.mux import (
    Hello,
    HelloAck,
    decode_control_msg,
    encode_control_record,
)

LOOP = "127.0.0.1"
SIG = b"\x11" * 32


def one_tensor(value: float, numel: int = 4) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, (numel,), np.full(numel, value, "<f4"))])


def signed_frame_with(salt: SessionSalt, edit) -> bytes:
    """A correctly signed RoundFrame whose body ``edit`` changed first (a peer with the
    salt saying something impossible)."""
    body = bytearray(encode_round_frame(one_tensor(1.0), salt)[:-8])
    edit(body)
    return bytes(body) + salt.mac8(bytes(body))


async def raw_rank(address: tuple[str, int], rank: int, world: int) -> MessageStream:
    conn = MessageStream(await trio.open_tcp_stream(*address), f"raw rank {rank}")
    await conn.send_chunks([encode_data_handshake(rank, world)])
    await conn.receive_exactly(DATA_ACK_LEN, "the data ack")
    return conn


async def closed_by_peer(conn: MessageStream) -> bool:
    with trio.fail_after(10):
        try:
            return await conn.stream.receive_some(64) == b""
        except trio.BrokenResourceError:
            return True


# -- a rank's authenticated frame with impossible contents -------------------------------------

BAD_SCHEMAS = {
    "unknown dtype tag": lambda body: body.__setitem__(17, 9),
    "payload bytes": lambda body: body.__setitem__(slice(19, 23), struct.pack("<I", 3)),  # 16 bytes for f32[3]
}


@pytest.mark.parametrize("what", sorted(BAD_SCHEMAS))
@pytest.mark.parametrize("hosts", [[[0, 1], [2]], [[0], [1, 2]]], ids=["two-rank-host", "single-rank-host"])
async def test_an_authenticated_frame_with_impossible_contents_drops_only_its_rank(salt, caplog, what, hosts):
    """Rank 0 sends a MAC-valid frame with an unknown dtype, or a byte count its shape
    does not have. Its relay drops it (naming it); with two ranks on the host the
    neighbour's round is exact, and a single-rank host forwards nothing unchecked,
    so the controller and the other host never see it."""
    caplog.set_level(logging.WARNING)
    bad = signed_frame_with(salt, BAD_SCHEMAS[what])
    results: dict[int, float] = {}
    async with open_local_cluster(world_size=3, hosts=hosts, salt=salt) as cluster:
        attacker = await raw_rank(cluster.relay_address(0), 0, 3)

        async def honest(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                for _ in range(2):
                    results[rank] = (await client.all_reduce_tensors([torch.full((4,), float(rank))]))[0][0].item()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(honest, 1)
            nursery.start_soon(honest, 2)
            await attacker.send_len_framed([bad], len(bad))
            assert await closed_by_peer(attacker)
        assert cluster.controller.dead_ranks.snapshot() == {0}
        assert cluster.controller.stats.relays_dropped == 0
    assert results == {1: 1.5, 2: 1.5}
    dropped = [r.getMessage() for r in caplog.records if "rank 0 dropped" in r.getMessage()]
    assert len(dropped) == 1 and what in dropped[0] and "tensor 0" in dropped[0], dropped


async def test_a_rank_whose_weight_would_overflow_the_mass_is_dropped_alone(salt, caplog):
    """Two ranks each send weight 1e308 (finite alone): whichever lands second would make
    the host's mass infinite and is dropped, naming it; the honest rank's round completes."""
    caplog.set_level(logging.WARNING, logger="flodl_trio.relay")
    huge = encode_round_frame(RoundFrame(one_tensor(0.0).tensors, weight=1e308), salt)
    async with open_local_cluster(world_size=3, hosts=[[0, 1, 2]], salt=salt) as cluster:
        big = [await raw_rank(cluster.relay_address(r), r, 3) for r in (0, 1)]
        for conn in big:
            await conn.send_len_framed([huge], len(huge))
        async with connect_reduce_client(cluster.relay_address(2), 2, 3, salt) as honest:
            [mean] = await honest.all_reduce_tensors([torch.full((4,), 2.0)])
        dead = cluster.controller.dead_ranks.snapshot()
    assert len(dead & {0, 1}) == 1 and 2 not in dead
    assert torch.all(torch.isfinite(mean))
    (loser,) = dead
    messages = [r.getMessage() for r in caplog.records]
    assert any(f"rank {loser} dropped" in m and "accepted mass inf" in m for m in messages), messages


# -- the handshake ---------------------------------------------------------------------------


async def test_two_simultaneous_handshakes_for_one_rank_ack_one_and_refuse_the_other(salt):
    async with open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, 9), host_name="h0", ranks=[0, 1],
                          world_size=2, salt=salt, connect_attempts=1000) as relay:
        streams = [await trio.open_tcp_stream(LOOP, relay.port) for _ in range(2)]
        for stream in streams:  # both handshakes are in before either is answered
            await stream.send_all(encode_data_handshake(0, 2))
        answers = []
        with trio.fail_after(10):
            for stream in streams:
                got = b""
                while len(got) < DATA_ACK_LEN and (chunk := await stream.receive_some(DATA_ACK_LEN - len(got))):
                    got += chunk
                answers.append(len(got))
        assert sorted(answers) == [0, DATA_ACK_LEN]  # one acked, one closed without an ack
        assert len(relay.rejections) == 1 and "duplicate rank 0: already connected" in relay.rejections[0]
        for stream in streams:
            await stream.aclose()


# -- the control channel -------------------------------------------------------------------------


async def control_rank(address: tuple[str, int], rank: int, world: int, salt: SessionSalt) -> MessageStream:
    conn = MessageStream(await trio.open_tcp_stream(*address), f"raw control rank {rank}")
    await conn.send_chunks([encode_control_handshake(rank, world, SIG, salt)])
    await conn.receive_exactly(CONTROL_ACK_LEN, "the control ack")
    return conn


async def test_control_channel_garbage_costs_nobody_and_is_counted(salt):
    """Rank 1 sends, on its control connection: bytes that are no ControlFrame, a
    correctly tagged heartbeat of the wrong size, a 100 KiB Metrics frame (legal:
    the protocol allows 16 MiB), and a heartbeat carrying another rank - beside its
    real heartbeats. Nobody is declared dead, rank 0 keeps its coordinator, and
    the coordinator counts what it ignored."""
    timeout = 1.0
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt, control=True,
                                  heartbeat_timeout=timeout) as cluster:
        noisy = await control_rank(cluster.control_address(1), 1, 2, salt)
        garbage = [
            b"\x00\x01 this is not a control frame",
            encode_control_frame(ControlFrame(ControlKind.HEARTBEAT, HEARTBEAT_TAG + b"\x01\x00\x00"), salt),
            encode_control_frame(ControlFrame(ControlKind.METRICS, bytes(100 << 10)), salt),
            encode_control_frame(heartbeat_frame(0, 10**6), salt),
        ]
        async with connect_control_client(cluster.control_address(0), 0, 2, salt, SIG) as client:
            for seq in range(1, 16):
                blob = encode_control_frame(heartbeat_frame(1, seq), salt)
                await noisy.send_len_framed([blob], len(blob))
                junk = garbage[seq % len(garbage)]
                await noisy.send_len_framed([junk], len(junk))
                await trio.sleep(timeout / 5)  # three heartbeat timeouts in all
            assert client.last_beacon is not None
        assert cluster.controller.dead_ranks.snapshot() == set()
        ignored = cluster.controller.coordinator.ignored
        assert ignored.get("malformed or unauthenticated", 0) >= 3  # garbage and the short heartbeat
        assert ignored.get("not a heartbeat", 0) >= 3 and ignored.get("heartbeat for another rank", 0) >= 3
        await noisy.aclose()


async def test_a_replayed_heartbeat_keeps_nobody_alive(salt):
    """A control relay for rank 0 sends one valid heartbeat record, then byte-identical
    copies of it; the rank behind it is frozen. The copies are ignored (their
    sequence number does not increase) and the rank is declared dead on time."""
    timeout = 0.6
    async with open_controller(LOOP, 0, world_size=1, salt=salt, heartbeat_timeout=timeout) as ctl:
        relay = MessageStream(await trio.open_tcp_stream(LOOP, ctl.port), "replaying control relay")
        await relay.send_chunks([CHANNEL_MAGIC_CONTROL.to_bytes(4, "little"), encode_control_record(Hello("h0", (0,), (SIG,)), salt)])
        header = await relay.receive_mux_header()
        assert header is not None
        _kind, payload = await relay.receive_mux_payload(header, ReceiveBuffer(), salt)
        assert isinstance(decode_control_msg(payload), HelloAck)
        record = encode_mux_record(MuxKind.DATA, encode_control_frame(heartbeat_frame(0, 1), salt), salt, rank=0).tobytes()
        start = trio.current_time()
        with trio.move_on_after(timeout * 5):
            while not ctl.dead_ranks.is_dead(0):
                await relay.send_chunks([record])
                await trio.sleep(timeout / 6)
        assert ctl.dead_ranks.is_dead(0), "replayed heartbeats kept a frozen rank alive"
        assert trio.current_time() - start < timeout * 3
        assert "no heartbeat" in ctl.coordinator.death_reasons[0]
        assert ctl.coordinator.ignored["replayed heartbeat"] >= 2
        await relay.aclose()


# -- errors that leave a public API ------------------------------------------------------------


async def _answer_hello(stream: trio.SocketStream, salt: SessionSalt) -> MessageStream:
    """A controller's side of a relay's handshake: read its magic and Hello, ack it."""
    conn = MessageStream(stream, "relay")
    await conn.receive_exactly(4, "magic")
    header = await conn.receive_mux_header()
    assert header is not None
    await conn.receive_mux_payload(header, ReceiveBuffer(), salt)
    await conn.send_chunks([encode_control_record(HelloAck(), salt)])
    return conn


async def test_a_relay_stopped_by_its_controller_raises_one_flodl_error_naming_it(salt):
    """A controller that answers the Hello and then sends a Broadcast nobody asked for:
    the relay stops, and wait_finished raises a DesyncError naming the relay - one
    error, not an exception group."""

    async def rogue_controller(stream: trio.SocketStream) -> None:
        conn = await _answer_hello(stream, salt)
        frame = encode_round_frame(one_tensor(1.0), salt)
        await conn.send_chunks(encode_mux_record(MuxKind.BROADCAST, frame, salt).chunks)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, rogue_controller, 0)
        port = listeners[0].socket.getsockname()[1]
        with pytest.raises(FlodlError) as info:
            async with open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, port), host_name="h-victim",
                                  ranks=[0], world_size=1, salt=salt) as relay:
                await relay.wait_finished()
        nursery.cancel_scope.cancel()
    assert isinstance(info.value, DesyncError), repr(info.value)
    assert "relay h-victim" in str(info.value) and "did not ask for" in str(info.value)


async def test_a_goodbye_the_controller_no_longer_takes_ends_the_relay_cleanly(salt, monkeypatch, caplog):
    """At the end of a run the controller closes its relay connections once every rank
    finished; a relay channel may still be writing one of its ranks' exit notices then.
    That write fails (EPIPE) where the reader would have seen EOF: the relay shuts down
    as for EOF, it does not fail. (A HostFrame that cannot be written still fails it:
    tests/e2e/test_lanes.py, tests/relay/test_cut_through.py.)"""
    from flodl_trio.relay.channels import Channel
    from flodl_trio.wire.mux import RankExit, RankFinished

    caplog.set_level(logging.INFO, logger="flodl_trio.relay")
    write_notice = Channel.write_notice
    lost: list[object] = []

    async def controller_gone_for_goodbyes(self, item):  # type: ignore[no-untyped-def]
        if isinstance(item, RankExit | RankFinished):
            lost.append(item)
            raise trio.BrokenResourceError("[Errno 32] Broken pipe")
        await write_notice(self, item)

    monkeypatch.setattr(Channel, "write_notice", controller_gone_for_goodbyes)

    async def quiet_controller(stream: trio.SocketStream) -> None:
        await _answer_hello(stream, salt)
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(trio.serve_tcp, quiet_controller, 0)
        port = listeners[0].socket.getsockname()[1]
        async with open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, port), host_name="h-end",
                              ranks=[0], world_size=1, salt=salt) as relay:
            rank = await raw_rank((LOOP, relay.port), 0, 1)
            await rank.aclose()
            await relay.wait_finished()  # no error
        nursery.cancel_scope.cancel()
    assert len(lost) == 1
    # Which it says first is a race (the rank's leaving, or the write of its goodbye
    # meeting the closed connection); either way it shuts down, with no error.
    reasons = [r.getMessage() for r in caplog.records if "shutting down:" in r.getMessage()]
    assert reasons and any(why in reasons[0] for why in ("the controller closed the upstream connection",
                                                         "every local rank has left")), reasons
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- a rank that never connects ----------------------------------------------------------------


async def test_declaring_a_never_connected_rank_dead_lets_its_host_go_on(salt):
    """Rank 1 never starts. Its host's data relay is connected from the start, so the
    controller knows who carries rank 1; once it is declared dead, rank 0's rounds
    complete, and its control relay (which heard of the death through the data
    channel) joins the coordinator with rank 0 alone, so rank 0 keeps its beacons."""
    timeout = 1.0
    async with open_local_cluster(world_size=3, hosts=[[0, 1], [2]], salt=salt, control=True,
                                  heartbeat_timeout=timeout) as cluster:
        results: dict[int, list[float]] = {0: [], 2: []}

        async def rank_main(rank: int) -> None:
            async with connect_control_client(cluster.control_address(rank), rank, 3, salt, SIG):
                async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                    for _ in range(3):
                        results[rank].append((await client.all_reduce_tensors([torch.full((4,), float(rank))]))[0][0].item())
                        await trio.sleep(timeout)  # the ranks stay a few beacon timeouts

        async with trio.open_nursery() as nursery:
            nursery.start_soon(rank_main, 0)
            nursery.start_soon(rank_main, 2)
            await trio.sleep(timeout / 2)
            assert results == {0: [], 2: []}  # the round waits for rank 1
            cluster.controller.dead_ranks.declare_dead(1)
    assert results == {0: [1.0] * 3, 2: [1.0] * 3}


# -- a wrong schema that arrives first ---------------------------------------------------------


async def _rounds(cluster, rank: int, world: int, salt: SessionSalt, numels: list[int], out: dict,
                  leave: trio.Event) -> None:
    """Rank ``rank`` runs one round per entry of ``numels`` (a tensor of that many elements,
    all equal to the rank); ``out[rank]`` is then the last mean, or the error that ended
    it. A rank that got through stays connected until ``leave``: a clean exit is a death
    in the controller's ledger too, so the test reads the ledger before anyone leaves."""
    try:
        async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
            for numel in numels:
                [mean] = await client.all_reduce_tensors([torch.full((numel,), float(rank))])
            out[rank] = mean.tolist()
            await leave.wait()
    except FlodlError as exc:
        out[rank] = exc


async def _run_ranks(cluster, world: int, salt: SessionSalt, numels_of, out: dict) -> frozenset[int]:
    """Every rank's rounds (``numels_of(rank)``); the controller's dead ranks once every
    rank finished or failed, before any of them left."""
    leave = trio.Event()
    async with trio.open_nursery() as nursery:
        for rank in range(world):
            nursery.start_soon(_rounds, cluster, rank, world, salt, numels_of(rank), out, leave)
        while len(out) < world:
            await trio.sleep(0.01)
        dead = cluster.controller.dead_ranks.snapshot()
        leave.set()
    return dead


@pytest.mark.parametrize("hosts", [[[0, 1, 2], [3]], [[0, 1], [2, 3]]], ids=["3+1", "2+2"])
@pytest.mark.parametrize("numel", [4, 200_000], ids=["small", "finish-ahead-sized"])
@pytest.mark.parametrize("lanes", [1, 3])
async def test_a_rank_whose_wrong_schema_is_folded_first_costs_itself_not_its_neighbours(
    salt, caplog, lanes, numel, hosts
):
    """Rank 0's second frame has 5 elements where every rank sent 4 in the first round.
    In deterministic mode its relay folds it first (rank order), so the round's first
    frame is the wrong one; the relay takes it out when rank 1's frame - with the
    schema the cluster completed a round with - arrives, and drops rank 0 alone."""
    caplog.set_level(logging.WARNING)
    out: dict[int, object] = {}
    async with open_local_cluster(world_size=4, hosts=hosts, salt=salt, deterministic=True,
                                  lanes=lanes, lane_min_bytes=4) as cluster:
        dead = await _run_ranks(cluster, 4, salt, lambda rank: [numel, numel + 1 if rank == 0 else numel, numel], out)
        assert dead == {0}
        assert cluster.controller.stats.relays_dropped == 0
    assert isinstance(out[0], FlodlError)
    assert out[1] == out[2] == out[3] == [2.0] * numel  # the survivors' rounds: (1 + 2 + 3) / 3, exact
    dropped = [r.getMessage() for r in caplog.records if "rank 0 dropped" in r.getMessage()]
    assert len(dropped) == 1 and f"tensor 0 of shape [{numel + 1}], not [{numel}]" in dropped[0], dropped


@pytest.mark.parametrize("lanes", [1, 3])
async def test_a_host_whose_wrong_schema_is_folded_first_costs_itself_not_the_other_hosts(salt, caplog, lanes):
    """Both ranks of host h0 send 5-element frames in round 2; h0's
    relay folds them (they agree) and the controller folds h0's HostFrame first (host
    order); h1's, with the schema of the completed round, takes it out and h0's relay
    is dropped alone: h1's ranks get their exact mean, every round after too."""
    caplog.set_level(logging.WARNING)
    out: dict[int, object] = {}
    async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt, deterministic=True,
                                  lanes=lanes, lane_min_bytes=4) as cluster:
        dead = await _run_ranks(cluster, 4, salt, lambda rank: [4, 5 if rank < 2 else 4, 4], out)
        assert dead == {0, 1}
        assert cluster.controller.stats.relays_dropped == 1
        try:
            await cluster.relays[0].wait_finished()
        except FlodlError as exc:  # cut off while it still wrote lanes: its connection reset rather than closed
            assert "relay host0: connection to the controller failed" in str(exc)
    assert isinstance(out[0], FlodlError) and isinstance(out[1], FlodlError)
    assert out[2] == out[3] == [2.5] * 4
    dropped = [r.getMessage() for r in caplog.records if "relay host0" in r.getMessage() and "dropped" in r.getMessage()]
    # With lanes the first difference is in lane 0's schema tensors (an empty [0, *shape] each).
    assert any(re.search(r"tensor \d of shape \[(0, )?5\], not \[(0, )?4\]", m) for m in dropped), dropped
