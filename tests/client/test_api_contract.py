"""What docs/api.md promises a rank's trainer, checked against a real cluster:
``fetch_state`` is the join request itself, a second process for a live rank is
refused at connect (``FramingError``), ``ClusterState.split`` takes shapes, a bad
codec text is a ``ConfigError``, and ``DeadRanks``' methods."""

from __future__ import annotations

import pytest
import torch
import trio

from flodl_trio import (
    DTYPE_F32,
    ConfigError,
    DeadRanks,
    FlodlError,
    FramingError,
    JoinRefused,
    RoundFrame,
    RoundKind,
    SchemaError,
    SessionSalt,
    TensorPayload,
    average_window,
    connect_reduce_client,
    open_window_trainer,
)
from flodl_trio.client import ReduceClient
from flodl_trio.testing import open_local_cluster
from flodl_trio.wire.quant import DeltaCodec

SALT = SessionSalt(b"api-contract-slt")
WORLD = 2
PARAM_SHAPES = [(2, 3), (4,)]
BUFFER_SHAPES = [(2,)]


def model(value: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return [torch.full(s, value) for s in PARAM_SHAPES], [torch.full(s, value) for s in BUFFER_SHAPES]


@pytest.mark.parametrize("text", ["bogus", "int8:64", "fp4:128", "int8:0", "int8:abc", "int4:8192"])
def test_a_codec_text_that_is_not_a_codec_is_a_config_error(text):
    with pytest.raises(ConfigError, match="delta"):
        DeltaCodec.parse(text)


def test_codec_texts_parse_with_their_default_blocks():
    assert [str(DeltaCodec.parse(t)) for t in ("int8", "fp4", "int4", "int4:512")] == [
        "int8:1024", "fp4:256", "int4:256", "int4:512",
    ]


async def test_open_window_trainer_with_a_bogus_codec_is_a_config_error():
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=SALT) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, SALT) as client:
            params, buffers = model()
            with pytest.raises(ConfigError, match="unknown delta code 'bogus'"):
                async with open_window_trainer(client, params, buffers, rank=0, world_size=1, sync_every=1, codec="bogus"):
                    pass


async def test_dead_ranks_methods_and_subscribe_in_a_trio_loop():
    dead = DeadRanks(3)
    seen: list[int] = []
    heard = trio.Event()

    def on_death(rank: int) -> None:
        seen.append(rank)
        heard.set()

    unsubscribe = dead.subscribe(on_death)
    assert dead.declare_dead(1) is True and dead.declare_dead(1) is False
    await heard.wait()
    assert seen == [1]
    assert dead.dead_count() == 1 and dead.snapshot() == frozenset({1}) and dead.world_size == 3
    assert dead.is_dead(1) and not dead.is_dead(0)
    unsubscribe()


async def test_fetch_state_is_the_join_request():
    """fetch_state on a live rank is refused; a returning rank's fetch_state lets it in
    (its join is then refused: it is live), splits by shapes, and leaving normally
    afterwards says it finished (a later join is refused for that)."""
    log: dict[str, object] = {}
    with trio.fail_after(25):
        async with open_local_cluster(world_size=WORLD, hosts=[[0, 1]], salt=SALT, rejoin_timeout=30.0) as cluster:
            address = cluster.relay_address(0)
            stop = trio.Event()
            three_windows = trio.Event()

            async def survivor() -> None:
                params, buffers = model(1.0)
                async with connect_reduce_client(address, 0, WORLD, SALT) as client:
                    start = await client.join(params, buffers)
                    fresh = await client.fetch_state()  # no window finished yet: harmless
                    log["fresh"] = (start, fresh.window, fresh.frames)
                    window = start
                    while not stop.is_set():
                        await average_window(client, params, buffers, 1, rank=0, world_size=WORLD, in_place=True)
                        window += 1
                        if window == 3:
                            with pytest.raises(JoinRefused, match="rank 0 is live"):
                                await client.fetch_state()
                            three_windows.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(survivor)
                params, buffers = model(3.0)
                first = await connect_reduce_client(address, 1, WORLD, SALT)
                await first.join(params, buffers)
                await average_window(first, params, buffers, 1, rank=1, world_size=WORLD, in_place=True)

                # A second process for rank 1 while it is live: refused at connect.
                for leg in (None, False):
                    with pytest.raises(FramingError, match="rank already connected"):
                        await connect_reduce_client(address, 1, WORLD, SALT, local_leg=leg)

                await first.aclose()  # a crash: rank 1 may come back
                await three_windows.wait()
                async with connect_reduce_client(address, 1, WORLD, SALT) as again:
                    state = await again.fetch_state()
                    assert state.window >= 2 and state.entry > state.window
                    params_frames, buffers_frame = state.split(PARAM_SHAPES, BUFFER_SHAPES)
                    assert len(params_frames) == 1 and buffers_frame is not None
                    assert [tuple(t.shape) for t in params_frames[0].tensors] == PARAM_SHAPES
                    as_lists = state.split([list(s) for s in PARAM_SHAPES], [torch.Size(s) for s in BUFFER_SHAPES])
                    assert as_lists[0][0].tensors == params_frames[0].tensors  # any sequence of ints is a shape
                    with pytest.raises(SchemaError, match="parameter 0 of shape \\[2, 3\\]"):
                        state.split([(3, 2), (4,)], BUFFER_SHAPES)
                    with pytest.raises(JoinRefused, match="rank 1 is live"):
                        await again.join(*model())
                # Left normally after fetch_state: it said it finished.
                with pytest.raises(JoinRefused, match="finished its training"):
                    async with connect_reduce_client(address, 1, WORLD, SALT) as late:
                        await late.join(*model())
                stop.set()
    assert log["fresh"] == (0, -1, ())


@pytest.mark.parametrize(
    "bad_round",
    [
        lambda c: c.all_reduce_weighted([torch.ones(2)], RoundKind.MODEL, -1.0),
        lambda c: c.all_reduce_scaled([torch.ones(2)], 1.0, RoundKind.MODEL, float("nan")),
        lambda c: c.all_reduce(RoundFrame([TensorPayload(DTYPE_F32, (2**33,))], RoundKind.MODEL, 1.0)),
    ],
    ids=["negative-weight", "nan-weight", "dim-out-of-u32"],
)
async def test_a_frame_refused_before_it_is_sent_leaves_the_client_usable(bad_round):
    """Only a round that went out half-way ("a cancelled round") spoils the client: a
    frame its own checks refuse sends nothing, so the rank's next round is its first
    and its cluster never noticed."""
    async with open_local_cluster(world_size=WORLD, hosts=[[0], [1]], salt=SALT) as cluster:

        async def rank_main(rank: int, client: ReduceClient) -> None:
            if rank == 0:
                with pytest.raises(SchemaError):
                    await bad_round(client)
            mean = await client.all_reduce_tensors([torch.full((2,), float(rank))])
            assert mean[0].tolist() == [0.5, 0.5] and client.rounds == 1

        await cluster.run_ranks(rank_main)


@pytest.mark.parametrize(
    ("rank", "world_size", "match"),
    [(0, 2**32, "world_size must be at most 4294967295"), (0, 2.0, "world_size must be an int"),
     (1.0, 2, "rank_id must be an int")],
)
async def test_a_rank_or_world_size_the_handshake_cannot_carry_is_a_config_error_before_any_traffic(
    rank, world_size, match,
):
    """The handshake carries both as u32: anything else is an argument error, raised
    when ``connect_reduce_client`` / ``connect_control_client`` is called (it was a
    struct.error, after dialing)."""
    from flodl_trio import connect_control_client

    dialed: list[object] = []

    async def connect(host: str, port: int) -> trio.abc.Stream:
        dialed.append((host, port))
        raise OSError("no dialing in this test")

    with pytest.raises(ConfigError, match=match):
        connect_reduce_client(("127.0.0.1", 9), rank, world_size, SALT, connect=connect)
    with pytest.raises(ConfigError, match=match):
        async with connect_control_client(("127.0.0.1", 9), rank, world_size, SALT, b"\0" * 32, connect=connect):
            pass
    assert dialed == []


@pytest.mark.parametrize("call", ["join", "fetch_state"])
async def test_join_on_a_closed_client_is_refused_at_once(call):
    """After ``aclose()`` every call of the client is refused as unusable, ``join`` and
    ``fetch_state`` too (they dialed the relay for a state request as if it were open)."""
    async with open_local_cluster(world_size=WORLD, hosts=[[0, 1]], salt=SALT, rejoin_timeout=30.0) as cluster:
        client = await connect_reduce_client(cluster.relay_address(0), 0, WORLD, SALT)
        await client.aclose()
        with pytest.raises(FlodlError, match="rank 0: client unusable \\(client closed\\)"):
            if call == "join":
                await client.join(*model())
            else:
                await client.fetch_state()
        assert not client.joined


async def test_a_second_round_while_one_is_in_flight_is_client_busy_and_the_first_goes_on():
    """One round at a time per client: a second is a FlodlError (ClientBusy, also trio's
    BusyResourceError) naming the rank, and the round in flight completes unharmed."""
    from flodl_trio.client import ClientBusy

    async with open_local_cluster(world_size=2, hosts=[[0], [1]], salt=SALT) as cluster:
        async with connect_reduce_client(cluster.relay_address(0), 0, 2, SALT) as c0, \
                connect_reduce_client(cluster.relay_address(1), 1, 2, SALT) as c1:
            results: dict[str, object] = {}

            async def first_round() -> None:
                results["first"] = await c0.all_reduce_tensors([torch.ones(3)])

            async with trio.open_nursery() as nursery:
                nursery.start_soon(first_round)
                await trio.testing.wait_all_tasks_blocked()  # rank 0's round is out, waiting for rank 1
                with pytest.raises(ClientBusy, match="rank 0: another round is already in flight") as raised:
                    await c0.all_reduce_tensors([torch.ones(3)])
                assert isinstance(raised.value, FlodlError) and isinstance(raised.value, trio.BusyResourceError)
                await c1.all_reduce_tensors([torch.full((3,), 3.0)])
            assert results["first"][0].tolist() == [2.0, 2.0, 2.0]  # type: ignore[index]
