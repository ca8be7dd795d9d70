"""Data-plane behaviour beyond the seed: several hosts, deaths, refusals, fatal errors.

Every expected value is computed independently with numpy in the test.
"""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest
import torch
import trio

from flodl_trio import (
    DTYPE_F32,
    ChannelKind,
    DeadRanks,
    FlodlError,
    RoundFrame,
    RoundKind,
    SessionSalt,
    TensorPayload,
    connect_reduce_client,
    open_controller,
    open_relay,
)
from flodl_trio.client import ReduceClient
from flodl_trio.controller import ControllerStats
from flodl_trio.testing import open_local_cluster
from flodl_trio.transport.buffers import ReceiveBuffer
from flodl_trio.transport.stream import MessageStream
from flodl_trio.wire import (
    decode_round_frame,
    encode_data_handshake,
    encode_round_frame,
)
from flodl_trio.wire.lanes import DEFAULT_LANE_MIN_BYTES
from flodl_trio.wire.round_frame import schema_frame_len
from flodl_trio.wire.constants import CHANNEL_MAGIC_DATA, DTYPE_BF16, MUX_HEADER_LEN
from flodl_trio.wire.mux import (
    EXTENSIONS_MARK,
    DeclareDead,
    Hello,
    HelloAck,
    Lanes,
    MuxKind,
    Outage,
    decode_control_msg,
    encode_control_record,
    encode_mux_record,
)

LOOP = "127.0.0.1"


def expected_mean(values: dict[int, np.ndarray], masses: dict[int, float]) -> np.ndarray:
    """Independent reference: f32 sum of w*T, times f32(1/sum w)."""
    total = sum((np.float32(masses[r]) * values[r]).astype(np.float32) for r in values)
    return (total * np.float32(1.0 / sum(masses.values()))).astype(np.float32)


@pytest.mark.parametrize("hosts", [[[0, 1], [2]], [[0], [1, 2, 3], [4, 5]]], ids=["2hosts-uneven", "3hosts-uneven"])
async def test_uneven_hosts_weighted_rounds(salt, hosts):
    world = sum(len(h) for h in hosts)
    rng = np.random.default_rng(7)
    rounds = 5
    values = {(k, r): rng.standard_normal(33).astype(np.float32) for k in range(rounds) for r in range(world)}
    masses = {(k, r): float(rng.integers(1, 9)) for k in range(rounds) for r in range(world)}
    results: dict[tuple[int, int], np.ndarray] = {}
    got_mass: dict[tuple[int, int], float] = {}

    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
                for k in range(rounds):
                    t = torch.from_numpy(values[k, rank].copy())
                    out, mass = await client.all_reduce_scaled([t], masses[k, rank], RoundKind.MODEL, masses[k, rank])
                    results[k, rank] = out[0].numpy()
                    got_mass[k, rank] = mass

        async with trio.open_nursery() as nursery:
            for rank in range(world):
                nursery.start_soon(rank_main, rank)
        await cluster.controller.wait_finished()
        assert cluster.controller.stats.rounds == rounds

    for k in range(rounds):
        want = expected_mean({r: values[k, r] for r in range(world)}, {r: masses[k, r] for r in range(world)})
        for rank in range(world):
            np.testing.assert_allclose(results[k, rank], want, rtol=2e-6, atol=1e-6, err_msg=f"round {k} rank {rank}")
            assert got_mass[k, rank] == sum(masses[k, r] for r in range(world))


@pytest.mark.parametrize("in_place", [False, True], ids=["returned", "in-place"])
async def test_fifty_rounds_random_masses_against_numpy(salt, in_place):
    """50 rounds, 2 hosts x 2 ranks, random masses (some zero), vs an independent numpy
    reduce; in place, the mean lands in the rank's own tensor (mass 0: left as it was)."""
    world, hosts, rounds = 4, [[0, 1], [2, 3]], 50
    rng = np.random.default_rng(2026)
    values = rng.standard_normal((rounds, world, 64)).astype(np.float32)
    masses = rng.choice([0.0, 0.5, 1.0, 2.0, 3.25], size=(rounds, world))
    masses[10] = 0.0  # one round where nobody realized work: everyone keeps local values
    results = np.zeros((rounds, world, 64), np.float32)

    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, salt) as client:
                from flodl_trio import DECODE_SLOT_PARAMS, sumcount_reduce

                for k in range(rounds):
                    t = torch.from_numpy(values[k, rank].copy())
                    out = await sumcount_reduce(
                        client, [t], float(masses[k, rank]), DECODE_SLOT_PARAMS, in_place=in_place
                    )
                    assert (out[0] is t) == in_place or masses[k].sum() == 0
                    results[k, rank] = (t if in_place else out[0]).numpy()

        async with trio.open_nursery() as nursery:
            for rank in range(world):
                nursery.start_soon(rank_main, rank)

    for k in range(rounds):
        total = masses[k].sum()
        for rank in range(world):
            if total == 0:
                want = values[k, rank]
            else:
                # Reference computed in f64 then compared with an f32 tolerance.
                want = (masses[k][:, None] * values[k].astype(np.float64)).sum(0) / total
            np.testing.assert_allclose(results[k, rank], want, rtol=1e-5, atol=1e-5, err_msg=f"round {k} rank {rank}")


async def test_bf16_wire_across_hosts(salt):
    """bf16-exact values: (1*[2,8] + 1*[4,16] + 2*[1,2]) / 4 = [2, 7] on the bf16 wire."""
    inputs = {0: ([2.0, 8.0], 1.0), 1: ([4.0, 16.0], 1.0), 2: ([1.0, 2.0], 2.0)}
    out = {}
    async with open_local_cluster(world_size=3, hosts=[[0, 1], [2]], salt=salt) as cluster:
        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt) as client:
                client.bf16_wire = True
                vals, w = inputs[rank]
                out[rank] = await client.all_reduce_scaled([torch.tensor(vals)], w, RoundKind.MODEL, w)

        async with trio.open_nursery() as nursery:
            for rank in inputs:
                nursery.start_soon(rank_main, rank)
        # The uplink frames really were bf16: half the f32 payload bytes.
        assert cluster.relays[1].stats.bytes_up == MUX_HEADER_LEN + schema_frame_len([(DTYPE_BF16, (2,))])
    for rank, (tensors, mass) in out.items():
        assert tensors[0].tolist() == [2.0, 7.0] and tensors[0].dtype == torch.float32
        assert mass == 4.0


async def test_death_declared_mid_window(salt):
    """Rank 3 (host 1) stops answering after round 1; it is declared dead while the
    others wait in round 2, which then completes without it."""
    dead = DeadRanks(4)
    values = {r: float(r + 1) for r in range(4)}
    round2 = {}
    waiting, evicted = trio.Event(), trio.Event()
    async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt, dead_ranks=dead) as cluster:
        async def live(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 4, salt) as client:
                await client.all_reduce_tensors([torch.tensor([values[rank]])])
                round2[rank] = (await client.all_reduce_tensors([torch.tensor([values[rank] * 10])]))[0].item()

        async def wedged(rank: int) -> None:
            client = await connect_reduce_client(cluster.relay_address(rank), rank, 4, salt)
            await client.all_reduce_tensors([torch.tensor([values[rank]])])
            waiting.set()
            # Frozen from here on: it sends nothing. Once the controller declares it
            # dead, its relay closes the connection (the rank would read EOF).
            assert await client._conn.receive_length_prefix() is None
            evicted.set()

        async with trio.open_nursery() as nursery:
            for rank in (0, 1, 2):
                nursery.start_soon(live, rank)
            nursery.start_soon(wedged, 3)
            await waiting.wait()
            await trio.sleep(0.2)  # the live ranks are now parked in round 2
            assert not round2
            dead.declare_dead(3)
    assert evicted.is_set()
    assert round2 == {r: pytest.approx((10 + 20 + 30) / 3) for r in (0, 1, 2)}


async def test_whole_host_dies_other_host_continues(salt):
    results: dict[int, list[float]] = {0: [], 1: []}
    async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt) as cluster:
        async def survivor(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 4, salt) as client:
                for k in range(4):
                    out = await client.all_reduce_tensors([torch.tensor([float(rank + 10 * k)])])
                    results[rank].append(out[0].item())

        async def short_lived(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 4, salt) as client:
                await client.all_reduce_tensors([torch.tensor([float(rank)])])

        async with trio.open_nursery() as nursery:
            for rank in (0, 1):
                nursery.start_soon(survivor, rank)
            for rank in (2, 3):
                nursery.start_soon(short_lived, rank)
        await cluster.relays[1].wait_finished()  # host 1 shut itself down cleanly
        await cluster.controller.wait_finished()
    want = [1.5, 10.5, 20.5, 30.5]
    want[0] = (0 + 1 + 2 + 3) / 4
    assert results[0] == results[1] == want


async def test_relay_refuses_bad_ranks_with_distinct_reasons(salt):
    async with open_local_cluster(world_size=4, hosts=[[0, 1], [2, 3]], salt=salt) as cluster:
        relay = cluster.relays[0]
        addr = cluster.relay_address(0)
        with pytest.raises(FlodlError, match="handshake ack"):
            await connect_reduce_client(addr, 2, 4, salt)  # rank of the other host
        with pytest.raises(FlodlError, match="handshake ack"):
            await connect_reduce_client(addr, 0, 5, salt)  # wrong world size
        async with connect_reduce_client(addr, 0, 4, salt):
            with pytest.raises(FlodlError, match="handshake ack"):
                await connect_reduce_client(addr, 0, 4, salt)  # duplicate
        reasons = relay.rejections
        assert any("not in host host0's rank set [0, 1]" in r for r in reasons), reasons
        assert any("world_size 5" in r for r in reasons), reasons
        assert any("duplicate rank 0" in r for r in reasons), reasons


async def _fake_relay(
    port: int, salt: SessionSalt, host: str, ranks: list[int], *, magic: int = CHANNEL_MAGIC_DATA,
    extensions: bool = False,
) -> MessageStream:
    """A raw relay connection: flodl's Hello, or with ``extensions`` a flodl_trio relay's (the mark)."""
    stream = await trio.open_tcp_stream(LOOP, port)
    conn = MessageStream(stream, "controller")
    hello = Hello(host, ranks, [EXTENSIONS_MARK] if extensions else [])
    await conn.send_chunks([magic.to_bytes(4, "little"), encode_control_record(hello, salt)])
    return conn


async def _expect_ack(conn: MessageStream, salt: SessionSalt) -> None:
    header = await conn.receive_mux_header()
    assert header is not None
    kind, payload = await conn.receive_mux_payload(header, ReceiveBuffer(), salt)
    assert kind is MuxKind.CONTROL


async def _expect_closed(conn: MessageStream) -> None:
    """The peer hung up: EOF, or a reset when it closed with our bytes unread."""
    with trio.fail_after(5):
        try:
            assert await conn.stream.receive_some(64) == b""
        except trio.BrokenResourceError:
            pass


async def test_controller_refuses_bad_connections_and_keeps_serving(salt):
    other = SessionSalt(b"\x07" * 16)
    async with open_controller(LOOP, 0, world_size=2, salt=salt) as ctl:
        # garbage magic / a port scanner
        scanner = await trio.open_tcp_stream(LOOP, ctl.port)
        await scanner.send_all(b"\x00\x01\x02\x03junk")
        await _expect_closed(MessageStream(scanner))
        # wrong salt on the Hello
        await _expect_closed(await _fake_relay(ctl.port, other, "evil", [0]))
        # rank >= world size
        await _expect_closed(await _fake_relay(ctl.port, salt, "big", [5]))
        # first record not a Hello
        conn = MessageStream(await trio.open_tcp_stream(LOOP, ctl.port))
        rf = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (1,), np.ones(1, "<f4"))]), salt)
        await conn.send_chunks([CHANNEL_MAGIC_DATA.to_bytes(4, "little"), *encode_mux_record(MuxKind.HOST_FRAME, rf, salt).chunks])
        await _expect_closed(conn)
        # a good relay gets in; a second relay announcing its rank is refused
        good = await _fake_relay(ctl.port, salt, "good", [0])
        await _expect_ack(good, salt)
        await _expect_closed(await _fake_relay(ctl.port, salt, "dup", [0, 1]))
        reasons = "\n".join(ctl.rejections)
        for needle in ("unknown channel magic", "MAC mismatch", "rank 5 >= world_size 2", "Control(Hello)", "already carried by relay good"):
            assert needle in reasons, f"{needle!r} not in:\n{reasons}"
        assert ctl.stats.mac_failures == 1
        # the status page answers plain HTTP on the same port
        http = await trio.open_tcp_stream(LOOP, ctl.port)
        await http.send_all(b"GET / HTTP/1.0\r\n\r\n")
        reply = b""
        with trio.fail_after(5):
            while chunk := await http.receive_some(4096):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 200") and b'"world_size": 2' in reply
        await good.aclose()


def _one_tensor_frame(value: float, salt: SessionSalt, weight: float = 1.0) -> bytes:
    return encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (1,), np.full(1, value, "<f4"))], weight=weight), salt)


async def _bad_relay_costs_only_itself(salt: SessionSalt, bad_record: bytes, error_fragment: str, caplog) -> ControllerStats:
    """A good relay (rank 0) and a bad one (rank 1) in a world of 2; the bad one sends
    ``bad_record`` as its HostFrame. It is dropped (named, logged, counted), rank 1
    is dead, and the good relay's round completes with its own frame alone."""
    caplog.set_level(logging.WARNING, logger="flodl_trio.controller")
    async with open_controller(LOOP, 0, world_size=2, salt=salt) as ctl:
        good = await _fake_relay(ctl.port, salt, "h-good", [0])
        await _expect_ack(good, salt)
        bad = await _fake_relay(ctl.port, salt, "h-bad", [1])
        await _expect_ack(bad, salt)
        await good.send_chunks(encode_mux_record(MuxKind.HOST_FRAME, _one_tensor_frame(6.0, salt), salt).chunks)
        await bad.send_chunks([bad_record])
        await _expect_closed(bad)
        header = await good.receive_mux_header()
        assert header is not None
        kind, payload = await good.receive_mux_payload(header, ReceiveBuffer(), salt)
        assert kind is MuxKind.BROADCAST
        consensus = decode_round_frame(payload, salt)
        assert np.frombuffer(consensus.tensors[0].data, "<f4").tolist() == [6.0] and consensus.weight == 1.0
        assert ctl.dead_ranks.snapshot() == {1}
        await good.aclose()
        await ctl.wait_finished()  # every rank dead: a clean end, no error
        stats = ctl.stats
    assert stats.relays_dropped == 1
    dropped = [r.getMessage() for r in caplog.records if "dropped for breaking the protocol" in r.getMessage()]
    assert len(dropped) == 1 and "relay h-bad (ranks [1])" in dropped[0] and error_fragment in dropped[0], dropped
    return stats


async def test_wrongly_salted_frame_from_a_live_relay_costs_only_that_relay(salt, caplog):
    other = SessionSalt(b"\x07" * 16)
    record = encode_mux_record(MuxKind.HOST_FRAME, _one_tensor_frame(1.0, other), other).tobytes()  # another salt
    stats = await _bad_relay_costs_only_itself(salt, record, "MAC mismatch", caplog)
    assert stats.mac_failures == 1


async def test_malformed_frame_from_a_live_relay_costs_only_that_relay(salt, caplog):
    rf = bytearray(_one_tensor_frame(1.0, salt))
    rf[0] ^= 0xFF  # a relay bug: correctly signed record, broken frame inside
    await _bad_relay_costs_only_itself(salt, encode_mux_record(MuxKind.HOST_FRAME, bytes(rf), salt).tobytes(), "bad magic", caplog)


async def test_authenticated_frame_with_an_unknown_dtype_costs_only_its_relay(salt, caplog):
    frame = bytearray(_one_tensor_frame(1.0, salt))
    frame[17] = 9  # tensor 0's dtype tag: no such dtype
    body = bytes(frame[:-8])
    signed = body + salt.mac8(body)
    await _bad_relay_costs_only_itself(salt, encode_mux_record(MuxKind.HOST_FRAME, signed, salt).tobytes(),
                                       "unknown dtype tag 9", caplog)


async def test_a_mass_that_would_overflow_is_refused_naming_the_relay(salt, caplog):
    """Each weight is finite; their sum would not be: the second relay's frame is refused
    (it would make the accepted mass infinite), the first relay's round completes."""
    record = encode_mux_record(MuxKind.HOST_FRAME, _one_tensor_frame(1.0, salt, weight=1e308), salt).tobytes()
    caplog.set_level(logging.WARNING, logger="flodl_trio.controller")
    async with open_controller(LOOP, 0, world_size=2, salt=salt) as ctl:
        first = await _fake_relay(ctl.port, salt, "h-big-a", [0])
        await _expect_ack(first, salt)
        second = await _fake_relay(ctl.port, salt, "h-big-b", [1])
        await _expect_ack(second, salt)
        await first.send_chunks([record])
        await second.send_chunks([record])
        await _expect_closed(second)
        header = await first.receive_mux_header()
        assert header is not None
        _kind, payload = await first.receive_mux_payload(header, ReceiveBuffer(), salt)
        assert decode_round_frame(payload, salt).weight == 1e308
        await first.aclose()
        await ctl.wait_finished()
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "relay h-big-b (ranks [1])" in messages and "accepted mass inf" in messages, messages


@pytest.mark.parametrize("numel", [3, 300_000], ids=["small", "large-signed-while-arriving"])
async def test_single_rank_host_forwards_frame_byte_identical(salt, numel):
    """A fake controller receives the relay's HostFrame: it is the rank's frame, byte
    for byte, in a record whose MAC verifies. A large one's record MAC is computed
    while the frame arrives (counted as finished ahead)."""
    seen: dict[str, bytes] = {}
    listeners = await trio.open_tcp_listeners(0, host=LOOP)
    port = listeners[0].socket.getsockname()[1]
    values = np.linspace(-2.0, 3.25, numel, dtype="<f4")
    frame = RoundFrame([TensorPayload(DTYPE_F32, (numel,), values), TensorPayload(DTYPE_F32, (8, 8))], RoundKind.MODEL, 2.5)
    rank_bytes = encode_round_frame(frame, salt)

    async def fake_controller() -> None:
        stream = await listeners[0].accept()
        conn = MessageStream(stream, "relay")
        await conn.receive_exactly(4, "magic")
        header = await conn.receive_mux_header()
        await conn.receive_mux_payload(header, ReceiveBuffer(), salt)
        await conn.send_chunks([encode_control_record(HelloAck(), salt)])
        header = await conn.receive_mux_header()
        kind, payload = await conn.receive_mux_payload(header, ReceiveBuffer(), salt)
        seen["kind"], seen["payload"] = kind, bytes(payload)
        await conn.send_chunks(encode_mux_record(MuxKind.BROADCAST, payload, salt).chunks)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(fake_controller)
        async with open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, port), host_name="solo",
                              ranks=[0], world_size=1, salt=salt) as relay:
            async with connect_reduce_client((LOOP, relay.port), 0, 1, salt) as client:
                reply = await client.all_reduce(frame)
            assert relay.stats.rounds_finished_ahead == (1 if numel > 1000 else 0)
    assert seen["kind"] is MuxKind.HOST_FRAME
    assert seen["payload"] == rank_bytes
    assert reply == frame


async def test_double_deposit_drops_only_that_rank(salt, caplog):
    """A rank that sends a second frame before its consensus broke the ping-pong: it
    is dropped (DesyncError, logged) and its host's honest rank carries on alone."""
    caplog.set_level(logging.WARNING, logger="flodl_trio.relay")
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        addr = cluster.relay_address(0)
        raw = MessageStream(await trio.open_tcp_stream(*addr), "relay")
        await raw.send_chunks([encode_data_handshake(0, 2)])
        await raw.receive_exactly(8, "ack")
        body = encode_round_frame(RoundFrame([TensorPayload(DTYPE_F32, (1,), np.ones(1, "<f4"))]), salt)
        await raw.send_len_framed([body], len(body))
        await raw.send_len_framed([body], len(body))  # second frame, same round: desync
        assert await raw.stream.receive_some(64) == b""  # rank 0's connection is closed
        async with connect_reduce_client(addr, 1, 2, salt) as honest:
            # rank 0's first frame was folded before it broke the ping-pong: realized work stays
            assert (await honest.all_reduce_tensors([torch.full((1,), 3.0)]))[0].item() == 2.0
            assert (await honest.all_reduce_tensors([torch.full((1,), 3.0)]))[0].item() == 3.0
        await cluster.relays[0].wait_finished()  # a clean end: the last rank left
    assert cluster.controller.dead_ranks.is_dead(0)
    messages = [r.getMessage() for r in caplog.records]
    assert any("rank 0 dropped" in m and "deposited twice" in m for m in messages), messages


async def test_relay_logs_one_summary_line(salt, caplog):
    caplog.set_level(logging.INFO, logger="flodl_trio.relay")
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        async def rank_main(_rank: int, client: ReduceClient) -> None:
            for _ in range(3):
                await client.all_reduce_tensors([torch.ones(1000)])

        await cluster.run_ranks(rank_main)
        await cluster.relays[0].wait_finished()
    lines = [r.getMessage() for r in caplog.records if "summary" in r.getMessage()]
    assert len(lines) == 1
    assert "ranks=2 rounds=3" in lines[0], lines[0]
    ratio = float(re.search(r"fold-ratio=([0-9.]+)x", lines[0]).group(1))
    assert 1.95 <= ratio <= 2.0, lines[0]  # two ranks in, one frame (plus a mux header) up


@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("hosts", [[[0, 1, 2]], [[0, 1], [2, 3]]], ids=["one-host", "two-hosts"])
async def test_steady_rounds_reuse_fold_memory(salt, hosts, bf16):
    """After the first round, relay and controller fold into the f32 images of an
    earlier round instead of allocating new ones, and every consensus is still
    exact (values change each round, so a stale image would show). Host 1's
    ranks lag, so the controller's round always ends on host 1's frame."""
    world = sum(len(h) for h in hosts)
    rounds = 4
    numel = 100_000

    async def rank_main(rank: int, client: ReduceClient) -> None:
        client.bf16_wire = bf16
        for k in range(rounds):
            if rank in hosts[-1] and len(hosts) > 1:
                await trio.sleep(0.05)
            [mean] = await client.all_reduce_tensors([torch.full((numel,), float(rank + 10 * k))])
            want = (world - 1) / 2 + 10 * k
            assert torch.equal(mean, torch.full((numel,), want)), (rank, k, mean[:4])

    async with open_local_cluster(world_size=world, hosts=hosts, salt=salt) as cluster:
        await cluster.run_ranks(rank_main)
        assert cluster.controller.stats.fold_images_reused == rounds - 1
        for relay in cluster.relays:
            assert relay.stats.fold_images_reused == rounds - 1


async def _records_until_broadcast(conn: MessageStream, salt: SessionSalt, *, payload_bytes: bool = False) -> list[object]:
    """What the controller sends a relay up to and including its first Broadcast: control
    messages decoded, the Broadcast as its kind (or, with ``payload_bytes``, its payload)."""
    seen: list[object] = []
    while True:
        header = await conn.receive_mux_header()
        assert header is not None
        kind, payload = await conn.receive_mux_payload(header, ReceiveBuffer(), salt)
        if kind is MuxKind.BROADCAST:
            return [*seen, bytes(payload) if payload_bytes else kind]
        seen.append(decode_control_msg(payload))


async def test_a_flodl_relay_gets_flodls_bytes_from_a_controller_that_keeps_a_record(salt, tmp_path):
    """A relay whose data Hello carries no extensions mark (flodl's, which closes on a
    control message it does not know) is sent HelloAck then the Broadcast, nothing more,
    even by a controller that tells flodl_trio relays to hold for it (Outage); a
    flodl_trio relay's Hello (the mark) gets the Outage. A rank dead at its Hello is a
    plain DeclareDead for the flodl relay, never the RankAway of a rank that may return."""
    with trio.fail_after(20):
        async with open_controller(LOOP, 0, world_size=3, salt=salt, resume_dir=tmp_path, rejoin_timeout=60.0) as ctl:
            ctl.dead_ranks.declare_dead(2)
            flodl = await _fake_relay(ctl.port, salt, "h-flodl", [0, 2])
            trio_conn = await _fake_relay(ctl.port, salt, "h-trio", [1], extensions=True)
            for conn, rank in ((flodl, 0), (trio_conn, 1)):
                frame = _one_tensor_frame(2.0 + rank, salt)
                await conn.send_chunks(encode_mux_record(MuxKind.HOST_FRAME, frame, salt).chunks)
            to_flodl = await _records_until_broadcast(flodl, salt)
            to_trio = await _records_until_broadcast(trio_conn, salt)
            await flodl.aclose()
            await trio_conn.aclose()
    assert to_flodl == [HelloAck(), DeclareDead(2), MuxKind.BROADCAST]
    # The flodl_trio relay is told the controller's lanes first, then HelloAck.
    assert to_trio[:2] == [Lanes(8, DEFAULT_LANE_MIN_BYTES), HelloAck()], to_trio
    assert any(isinstance(m, Outage) for m in to_trio), to_trio


_MIXED_SHAPES = [(50_000,), (7, 3), (1_000,)]


def _mixed_values(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(100 + rank)
    return [rng.standard_normal(shape).astype(np.float32) for shape in _MIXED_SHAPES]


async def _flodl_relay_beside_trio_relays(salt: SessionSalt, lanes: int, deterministic: bool) -> tuple[list[object], bytes, dict]:
    """World 3: ranks 0 and 1 behind a flodl_trio relay, rank 2 behind a raw flodl relay
    (no extensions mark: whole frames). Returns what the raw relay was sent (control
    messages, then the Broadcast's payload bytes) and the ranks' (tensors, mass)."""
    weights = [1.0, 3.0, 2.0]
    got: dict[int, object] = {}
    with trio.fail_after(30):
        async with open_controller(LOOP, 0, world_size=3, salt=salt, lanes=lanes, lane_min_bytes=0,
                                   deterministic=deterministic) as ctl:
            async with open_relay(ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, ctl.port), host_name="h-trio",
                                  ranks=[0, 1], world_size=3, salt=salt, deterministic=deterministic) as relay:
                flodl = await _fake_relay(ctl.port, salt, "h-flodl", [2])
                assert await _next_control(flodl, salt) == HelloAck()
                frame = RoundFrame([TensorPayload(DTYPE_F32, v.shape, (v * weights[2]).reshape(-1))
                                    for v in _mixed_values(2)], weight=weights[2])
                record = encode_mux_record(MuxKind.HOST_FRAME, encode_round_frame(frame, salt), salt)

                async def rank_main(rank: int) -> None:
                    async with connect_reduce_client((LOOP, relay.port), rank, 3, salt) as client:
                        tensors = [torch.from_numpy(v * weights[rank]) for v in _mixed_values(rank)]
                        got[rank] = await client.all_reduce_weighted(tensors, RoundKind.MODEL, weights[rank])

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(flodl.send_chunks, record.chunks)  # it may wait for its turn
                    for rank in (0, 1):
                        nursery.start_soon(rank_main, rank)
                sent = await _records_until_broadcast(flodl, salt, payload_bytes=True)
                await flodl.aclose()
    return sent, got, weights


async def _next_control(conn: MessageStream, salt: SessionSalt) -> object:
    header = await conn.receive_mux_header()
    assert header is not None
    kind, payload = await conn.receive_mux_payload(header, ReceiveBuffer(), salt)
    assert kind is MuxKind.CONTROL
    return decode_control_msg(payload)


@pytest.mark.parametrize("deterministic", [False, True], ids=["arrival-order", "deterministic"])
async def test_a_flodl_relay_in_a_cluster_reducing_in_lanes_sends_and_gets_whole_frames(salt, deterministic):
    """The controller reduces in 4 lanes; a relay without the extensions mark (flodl's) is
    seated all the same: it is sent no extension message, its whole HostFrame is cut into
    lanes at the controller (in deterministic mode each lane waits for the relays before
    it) and it gets one whole Broadcast, the consensus every rank gets. In deterministic
    mode its bytes are exactly what a controller without lanes sends it."""
    sent, got, weights = await _flodl_relay_beside_trio_relays(salt, 4, deterministic)
    assert sent[:-1] == [], sent  # HelloAck was read before; nothing else came before the Broadcast
    broadcast = decode_round_frame(sent[-1], salt)
    mass = sum(weights)
    want = [sum(weights[r] * _mixed_values(r)[i] for r in range(3)) / mass for i in range(len(_MIXED_SHAPES))]
    assert broadcast.weight == mass
    for i, tensor in enumerate(broadcast.tensors):
        assert tuple(tensor.shape) == _MIXED_SHAPES[i]
        values = np.frombuffer(memoryview(tensor.data).cast("B"), "<f4").reshape(_MIXED_SHAPES[i])
        np.testing.assert_allclose(values, want[i], rtol=1e-5, atol=1e-6)
        for rank in (0, 1):
            tensors, got_mass = got[rank]
            assert got_mass == mass
            assert np.array_equal(tensors[i].numpy(), values)
    if deterministic:
        whole_sent, whole_got, _ = await _flodl_relay_beside_trio_relays(salt, 1, deterministic)
        assert whole_sent[-1] == sent[-1]


