"""Real roles on loopback against the docs' own codec (``tests/wire/doc_codec.py``).

A recording TCP proxy sits between the data relays and the controller; what
crossed it is read back with the docs' decoder only. And a relay written from
the docs alone (raw sockets, the docs' encoder) feeds a real controller.
"""

from __future__ import annotations

import functools
import math
import struct

import numpy as np
import pytest
import trio

from flodl_trio import connect_reduce_client
from flodl_trio.controller import open_controller
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire import DTYPE_F32, RoundFrame, TensorPayload
from tests.wire import doc_codec as doc

RAW_SALT = b"\x42" * 16


class Recorder:
    """A TCP proxy in front of ``target`` that keeps every byte of every connection, each way."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.flows: list[tuple[bytearray, bytearray]] = []  # (up, down) per connection
        self.port = 0

    async def serve(self, nursery: trio.Nursery) -> None:
        listeners = await nursery.start(functools.partial(trio.serve_tcp, self._handle, 0, host="127.0.0.1"))
        self.port = listeners[0].socket.getsockname()[1]

    async def _handle(self, client: trio.SocketStream) -> None:
        up, down = bytearray(), bytearray()
        self.flows.append((up, down))
        try:
            server = await trio.open_tcp_stream(*self.target)
        except OSError:
            await client.aclose()
            return

        async def pump(src: trio.SocketStream, dst: trio.SocketStream, into: bytearray) -> None:
            try:
                while data := await src.receive_some(1 << 16):
                    into += data
                    await dst.send_all(data)
                await dst.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, up)
            nursery.start_soon(pump, server, client, down)


def f32_frame(values: np.ndarray, weight: float) -> RoundFrame:
    return RoundFrame([TensorPayload(DTYPE_F32, values.shape, values.astype("<f4"))], weight=weight)


def control_messages(records: list[doc.Record]) -> list[int]:
    return [doc.Reader(r.payload).varint() for r in records if r.kind == doc.MUX_CONTROL]


async def _rounds(cluster, values: dict[int, np.ndarray], rounds: int) -> dict[int, list[RoundFrame]]:
    out: dict[int, list[RoundFrame]] = {r: [] for r in values}

    async def rank(r: int) -> None:
        async with connect_reduce_client(cluster.relay_address(r), r, len(values), RAW_SALT, local_leg=False) as client:
            for _ in range(rounds):
                out[r].append(await client.all_reduce(f32_frame(values[r] * (r + 1), float(r + 1))))

    async with trio.open_nursery() as nursery:
        for r in values:
            nursery.start_soon(rank, r)
    return out


async def test_a_cluster_of_small_rounds_sends_flodls_records_upstream() -> None:
    """wire.md: frames under 2 x min_bytes go whole (flodl's HostFrame/Broadcast), lanes or not."""
    async with open_controller(world_size=4, salt=RAW_SALT) as controller, trio.open_nursery() as nursery:
        recorder = Recorder(("127.0.0.1", controller.port))
        await recorder.serve(nursery)
        async with open_local_cluster(
            world_size=4, hosts=[[0, 1], [2, 3]], salt=RAW_SALT, upstream=("127.0.0.1", recorder.port)
        ) as cluster:
            values = {r: np.arange(16, dtype=np.float32) + r for r in range(4)}
            out = await _rounds(cluster, values, 3)
        nursery.cancel_scope.cancel()
    mass = sum(r + 1 for r in range(4))
    want = (sum(values[r] * (r + 1) for r in range(4)).astype(np.float32) * np.float32(1 / mass)).astype("<f4")
    assert len(recorder.flows) == 2
    for up, down in recorder.flows:
        assert bytes(up[:4]) == struct.pack("<I", 0xF10D17E1)
        ups = doc.decode_records(bytes(up[4:]), RAW_SALT)
        downs = doc.decode_records(bytes(down), RAW_SALT)
        hello = doc.Reader(ups[0].payload)
        assert hello.varint() == 0
        host_frames = [r for r in ups if r.kind == doc.MUX_HOST_FRAME]
        broadcasts = [r for r in downs if r.kind == doc.MUX_BROADCAST]
        assert len(host_frames) == len(broadcasts) == 3
        for record in host_frames + broadcasts:
            frame = doc.decode_frame(record.payload)
            assert doc.frame_mac_ok(record.payload, RAW_SALT), "a whole frame carries its own MAC"
            assert [t.shape for t in frame.tensors] == [(16,)], "no lane tag on a whole frame"
        got = doc.decode_frame(broadcasts[-1].payload)
        assert got.weight == mass and np.frombuffer(got.tensors[0].data, "<f4").tobytes() == want.tobytes()
        # flodl's variants, and a Lanes (8 by default) before HelloAck to a marked relay
        assert control_messages(downs)[-1] == 1
        assert set(control_messages(downs)) <= {1, 203}
        assert set(control_messages(ups)) <= {0, 2, 201}
    assert out[0][-1].tensors[0].data.tobytes() == want.tobytes()


async def test_lanes_on_the_wire_are_the_docs_cut_and_a_docs_relay_is_served() -> None:
    """Capture a real relay's lane records; then replay the docs' own lanes as a relay."""
    n_lanes, size = 4, 1000
    async with open_controller(world_size=1, salt=RAW_SALT, lanes=n_lanes, lane_min_bytes=0) as controller:
        with trio.fail_after(20):
            stream = await trio.open_tcp_stream("127.0.0.1", controller.port)
            hello = doc.encode_msg("Hello", host="docs", ranks=[0], model_sigs=[doc.EXTENSIONS_MARK])
            await stream.send_all(struct.pack("<I", 0xF10D17E1) + doc.encode_record(doc.MUX_CONTROL, hello, RAW_SALT))
            got = bytearray()

            async def records_until(predicate) -> list[doc.Record]:
                while True:
                    try:
                        found = doc.decode_records(bytes(got), RAW_SALT)
                        if predicate(found):
                            return found
                    except (AssertionError, struct.error):
                        pass
                    chunk = await stream.receive_some(1 << 16)
                    assert chunk, f"controller closed after {bytes(got).hex()}"
                    got.extend(chunk)

            found = await records_until(lambda rs: any(control_messages([r]) == [1] for r in rs))
            assert control_messages(found)[:2] == [203, 1], "Lanes just before HelloAck"
            lanes_msg = doc.Reader(found[0].payload)
            assert lanes_msg.varint() == 203 and lanes_msg.varint() == n_lanes
            seen = len(found)
            rng = np.random.default_rng(1)
            for weight in (2.0, 5.0):
                values = rng.standard_normal(size).astype(np.float32)
                frame = doc.Frame([doc.Tensor(doc.F32, (size,), (values * np.float32(weight)).astype("<f4").tobytes())],
                                  doc.MODEL, weight)
                lanes = doc.cut_lanes(frame, n_lanes)
                await stream.send_all(b"".join(
                    doc.encode_record(doc.MUX_HOST_FRAME, doc.encode_frame(lane, None), RAW_SALT) for lane in lanes
                ))
                found = await records_until(lambda rs: len(rs) >= seen + n_lanes)
                down = found[seen : seen + n_lanes]
                seen += n_lanes
                mean = (values * np.float32(weight)) * np.float32(1 / weight)
                joined = b""
                for k, record in enumerate(down):
                    assert record.kind == doc.MUX_BROADCAST
                    lane = doc.decode_frame(record.payload)
                    assert lane.tensors[-1].shape == (0, 0, n_lanes, k, 1 if k == 0 else 0)
                    assert doc.frame_mac_ok(record.payload, RAW_SALT), "the controller's lanes keep the frame MAC"
                    assert lane.weight == weight
                    joined += lane.tensors[0].data
                assert joined == mean.astype("<f4").tobytes()
            await stream.aclose()


class Tap:
    """Every byte each TCP stream of this process writes (the roles all write through ``send_all``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: dict[trio.SocketStream, bytearray] = {}
        original = trio.SocketStream.send_all

        async def send_all(stream: trio.SocketStream, data) -> None:
            self.sent.setdefault(stream, bytearray()).extend(bytes(data))
            await original(stream, data)

        monkeypatch.setattr(trio.SocketStream, "send_all", send_all)

    def streams(self) -> list[tuple[int | None, list[doc.Record]]]:
        """Each relay/controller/shard connection's channel magic (None: an answering side) and records."""
        out = []
        for data in self.sent.values():
            magic, rest = doc.split_stream(bytes(data))
            if magic in (0xF10D17C0, 0xF10D17C1):  # a rank leg
                continue
            out.append((magic, doc.decode_records(rest, RAW_SALT)))
        return out

    def rank_frames(self, rank: int) -> list[doc.Frame]:
        """What rank ``rank`` sent its relay over TCP: its handshake, then length-framed RoundFrames."""
        for data in map(bytes, self.sent.values()):
            if data[:4] == struct.pack("<I", 0xF10D17C0) and struct.unpack_from("<I", data, 8)[0] == rank:
                frames, pos = [], 16
                while pos < len(data):
                    (n,) = struct.unpack_from("<I", data, pos)
                    frames.append(doc.decode_frame(data[pos + 4 : pos + 4 + n]))
                    pos += 4 + n
                return frames
        raise AssertionError(f"no rank leg of rank {rank}")


def _lane_sum(lanes: list[doc.Frame], divide: bool) -> list[np.ndarray]:
    """Pieces summed in f32 in the order given; divided by the summed mass with f32(1 / mass)."""
    mass = sum(lane.weight for lane in lanes)
    sums = [np.zeros(t.shape[0], np.float32) for t in lanes[0].tensors[:-1]]
    for lane in lanes:
        for acc, t in zip(sums, lane.tensors[:-1], strict=True):
            if t.data:
                acc += np.frombuffer(t.data, "<f4")
    return [s * np.float32(1 / mass) if divide else s for s in sums]


async def test_a_sharded_run_on_the_wire_is_what_the_docs_say(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every record of a run through 2 shards with SlowMo read back with the docs' codec."""
    import torch

    from flodl_trio import RoundKind
    from flodl_trio.fold.outer import SlowMo

    tap = Tap(monkeypatch)
    hosts, shards, lanes, sizes = [[0, 1], [2], [3]], 2, 5, (3000, 1001)
    async with open_local_cluster(world_size=4, hosts=hosts, salt=RAW_SALT, lanes=lanes, lane_min_bytes=0,
                                  deterministic=True, shards=shards,
                                  outer_optimizer=SlowMo(lr=0.7, momentum=0.9)) as cluster:

        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 4, RAW_SALT, local_leg=False) as client:
                for window in range(3):
                    await client.all_reduce_weighted([torch.tensor([float(window)])], RoundKind.CONTROL, 1.0)
                    params = [torch.arange(n, dtype=torch.float32) * (rank + window + 1) for n in sizes]
                    await client.all_reduce_weighted(params, RoundKind.MODEL, float(rank + 1))

        async with trio.open_nursery() as nursery:
            for r in range(4):
                nursery.start_soon(rank_main, r)

    per_shard = max(1, min(max(math.ceil((lanes - 1) / shards), 4), 63 // shards))
    n_lanes = 1 + shards * per_shard
    decides, host_lanes, mirrored = [], {}, {}
    for magic, records in tap.streams():
        names = [doc.decode_msg(r.payload)[0] if r.kind == doc.MUX_CONTROL else None for r in records]
        frames = [doc.decode_frame(r.payload) if r.kind != doc.MUX_CONTROL else None for r in records]
        for frame in filter(None, frames):
            assert frame.tensors[-1].shape[:3] == (0, 0, n_lanes), "every lane ends with its tag"
        if magic == 0xF10D17EE:  # controller -> shard: its setup in one write, then decisions
            assert names[:3] == ["ShardSetup", "ShardOuter", "Shards"]
            decides += [doc.decode_msg(r.payload)[1] for r in records if r.kind == doc.MUX_CONTROL
                        and doc.decode_msg(r.payload)[0] == "Decide"]
        elif magic == 0xF10D17E1 and "Pieces" in names:  # relay -> shard: Hello, then Pieces and lanes
            host = doc.decode_msg(records[0].payload)[1]["ranks"][0]
            round_no = 0
            for name, frame in zip(names, frames):
                if name == "Pieces":
                    round_no += 1
                elif frame is not None:
                    assert frame.mac == bytes(8), "a relay's lanes carry no frame MAC"
                    host_lanes[host, round_no, frame.tensors[-1].shape[3]] = frame
        elif magic == 0xF10D17EF:  # mirror: Mirror, then the divided lane
            for record, frame in zip(records[1:], frames[1:]):
                if frame is not None:
                    mirrored.setdefault(frame.tensors[-1].shape[3], []).append(frame)
        elif magic is None:
            for frame, record in zip(frames, records):
                if frame is not None and record.kind == doc.MUX_BROADCAST and frame.tensors[-1].shape[3] != 0:
                    assert frame.mac == bytes(8), "a shard's consensus lanes carry no frame MAC"
    rounds = 6
    assert len(decides) == shards * rounds
    schema = [(doc.F32, (1,))]
    for d in decides:
        assert d["lanes"] == n_lanes and d["hosts"] == [0, 2, 3]
        assert d["schema"] in ([(doc.F32, (n,)) for n in sizes], schema)
        assert d["step"] == ("whole" if d["schema"] != schema else None)
    # a one-rank host's lanes are the docs' cut of its rank's frame, lane 0 without payload
    for round_no, frame in enumerate(tap.rank_frames(2), start=1):
        cut = doc.cut_lanes(frame, n_lanes, lane0_empty=True)
        for k in range(1, n_lanes):
            assert doc.frame_body(host_lanes[2, round_no, k]) == doc.frame_body(cut[k]), (round_no, k)
    # the lanes mirrored are the round's mean before the step: the hosts' pieces summed in host order
    for k in range(1, n_lanes):
        for i, window in enumerate(mirrored[k]):
            round_no = 2 * (i + 1)
            want = _lane_sum([host_lanes[h, round_no, k] for h in (0, 2, 3)], divide=True)
            assert [t.data for t in window.tensors[:-1]] == [w.astype("<f4").tobytes() for w in want], (k, round_no)


async def _read_exactly(stream, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = await stream.receive_some(n - len(out))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


@pytest.mark.parametrize("mac_field", ["zeros", "garbage"])
async def test_a_docs_rank_on_the_local_leg_is_served(tmp_path, monkeypatch: pytest.MonkeyPatch, mac_field: str) -> None:
    """wire.md, the local leg: the path, the signed 24/16-byte handshake, frames whose MAC field is not read."""
    import os

    unix_dir = tmp_path / "unix"
    monkeypatch.setenv("FLODL_UNIX_DIR", str(unix_dir))
    monkeypatch.delenv("FLODL_NO_UNIX", raising=False)
    values = {r: (np.arange(8, dtype=np.float32) + r) for r in range(2)}
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=RAW_SALT, local_leg=True) as cluster:
        port = cluster.relay_address(0)[1]
        path = unix_dir / f"data-{os.stat('/proc/self/ns/net').st_ino}-{port}.sock"
        assert path.exists(), sorted(p.name for p in unix_dir.iterdir())
        stream = await trio.open_unix_socket(str(path))
        handshake = doc.local_handshake(0, 2, RAW_SALT)
        await stream.send_all(handshake)
        assert await _read_exactly(stream, 16) == doc.local_ack(handshake[:16], RAW_SALT)
        frame = doc.Frame([doc.Tensor(doc.F32, (8,), values[0].tobytes())], doc.MODEL, 1.0)
        body = doc.frame_body(frame) + (bytes(8) if mac_field == "zeros" else b"\xa5" * 8)
        out = {}

        async def project_rank() -> None:
            async with connect_reduce_client(cluster.relay_address(1), 1, 2, RAW_SALT, local_leg=False) as client:
                out[1] = await client.all_reduce(f32_frame(values[1], 1.0))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(project_rank)
            await stream.send_all(struct.pack("<I", len(body)) + body)
            (n,) = struct.unpack("<I", await _read_exactly(stream, 4))
            got = doc.decode_frame(await _read_exactly(stream, n))
        want = ((values[0] + values[1]) * np.float32(0.5)).astype("<f4").tobytes()
        assert got.weight == 2.0 and got.tensors[0].data == want
        await stream.aclose()


async def _docs_join(address: tuple[str, int], rank: int, world: int) -> tuple[int, int, str, list[int]]:
    """The join exchange from the docs' side up to the reply: (status, window, reason, frame lengths)."""
    import secrets

    nr = secrets.token_bytes(16)
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(doc.state_request(rank, world, nr, RAW_SALT))
        challenge = await _read_exactly(stream, 32)
        assert challenge[:8] == struct.pack("<II", 0xF10D17EA, 2)
        nc = challenge[8:24]
        assert challenge == doc.state_challenge(nc, nr, RAW_SALT), "challenge MAC: bytes 0..24 then Nr"
        await stream.send_all(doc.state_answer(rank, nr, nc, RAW_SALT))
        head = await _read_exactly(stream, 28)
        magic, version, status, n, window, reason_len = struct.unpack("<IIIIqI", head)
        assert (magic, version) == (0xF10D17E9, 2) and n <= 257 and reason_len <= 1024
        rest = await _read_exactly(stream, reason_len + 4 * n + 8)
        reason = rest[:reason_len].decode()
        lengths = list(struct.unpack_from(f"<{n}I", rest, reason_len))
        assert head + rest == doc.state_reply(status, window, reason, lengths, nr, nc, RAW_SALT), "reply MAC"
        return status, window, reason, lengths


async def test_the_join_exchange_is_the_docs_bytes() -> None:
    """A live rank's request before the first window: ok, window -1, no frames; after it: refused."""
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=RAW_SALT, rejoin_timeout=30.0) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 2, RAW_SALT, local_leg=False) as c0, \
                connect_reduce_client(cluster.relay_address(1), 1, 2, RAW_SALT, local_leg=False) as c1:
            assert await _docs_join(cluster.relay_address(0), 0, 2) == (0, -1, "", [])
            control = RoundFrame([TensorPayload(DTYPE_F32, (2,), np.ones(2, "<f4"))], kind=1, weight=0.0)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(c0.all_reduce, control)
                nursery.start_soon(c1.all_reduce, control)
            status, window, reason, lengths = await _docs_join(cluster.relay_address(1), 1, 2)
            assert (status, window, lengths) == (1, -1, []) and reason


@pytest.mark.deadline(90)
@pytest.mark.parametrize(("shards", "through"), [(8, True), (5, False)], ids=["through-8-shards", "lanes-beside-5-shards"])
async def test_delta_rounds_on_the_wire_are_the_docs_cut(monkeypatch: pytest.MonkeyPatch, shards: int, through: bool) -> None:
    """int8 deltas in 3 lanes: through 8 shards (8 x 8 >= 64) the digest rides in lane 0 and the
    shards send the controller f32 means; beside 5 the round goes in the controller's lanes,
    the digest in the last. A one-rank host's lanes are the docs' cut of its rank's frame."""
    from flodl_trio.wire.quant import DeltaCodec
    from tests.e2e.test_delta_rounds import model, train

    tap = Tap(monkeypatch)
    hosts, world, lanes = [[0, 1], [2], [3]], 4, 3
    seen: dict = {}
    async with open_local_cluster(world_size=world, hosts=hosts, salt=RAW_SALT, lanes=lanes, lane_min_bytes=0,
                                  shards=shards, deterministic=True) as cluster:

        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, world, RAW_SALT,
                                             local_leg=False) as client:
                client.delta_codec = DeltaCodec.parse("int8:256")
                await train(client, rank, world, model(rank), range(3), seen)

        async with trio.open_nursery() as nursery:
            for rank in range(world):
                nursery.start_soon(rank_main, rank)

    sent_by_host2: set[bytes] = set()
    means: list[doc.Frame] = []
    for magic, records in tap.streams():
        names = [doc.decode_msg(r.payload)[0] if r.kind == doc.MUX_CONTROL else None for r in records]
        if magic == 0xF10D17E1 and doc.decode_msg(records[0].payload)[1]["ranks"] == [2]:
            sent_by_host2 |= {doc.frame_body(doc.decode_frame(r.payload)) for r in records if r.kind == doc.MUX_HOST_FRAME}
        if magic is None and "Decided" in names and "ShardAck" not in names:  # shard -> controller
            means += [doc.decode_frame(r.payload) for r in records if r.kind == doc.MUX_BROADCAST]
    delta_rounds = 0
    for frame in tap.rank_frames(2):
        if frame.kind != doc.MODEL:
            continue
        coded = frame.tensors[0].dtype & 0x80
        delta_rounds += bool(coded)
        goes_through = through or not coded
        payload = sum(doc.payload_size(t) for t in (frame.tensors[:-1] if goes_through else frame.tensors))
        n = 1 + shards * doc.sharded_lanes_per_shard(lanes, shards, payload, 0) if goes_through else lanes
        want = doc.cut_delta_lanes(frame, n, through_shards=goes_through)
        if goes_through:
            assert want[0].tensors[0].dtype == doc.DIGEST
        else:
            assert want[-1].tensors[-2].dtype == doc.DIGEST
        missing = [k for k, lane in enumerate(want) if doc.frame_body(lane) not in sent_by_host2]
        assert not missing, f"lanes {missing} of {n} ({'coded' if coded else 'f32'}) are not the docs' cut"
    assert delta_rounds == 2
    assert means
    for mean in means:  # f32 pieces (an empty one may keep its code's tag), then the lane's tag
        for t in mean.tensors[:-1]:
            assert len(t.shape) == 1 and (t.dtype == doc.F32 or t.shape == (0,)), (t.dtype, t.shape)
            assert len(t.data) in (0, 4 * t.shape[0])
