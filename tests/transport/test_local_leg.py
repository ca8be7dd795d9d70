"""The Unix-socket local leg: unsigned frames between a rank and its relay, real sockets.

What it must keep: the consensus (TCP and local-leg ranks in one round, single-rank
hosts whose frames the relay signs on the way up), the boundary (another uid is
refused by the kernel's word, an unsigned frame on TCP is refused), blast radius
(a bad frame on the local leg costs only its rank) and housekeeping (the socket's
directory, stale files, the switch that turns it off).
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import trio

from flodl_trio import ConfigError, RankDeadError, connect_reduce_client
from flodl_trio.daemon.relay import build_parser, settings_from_args
from flodl_trio.errors import FramingError, MacError
from flodl_trio.relay import ChannelKind, open_relay
from flodl_trio.testing import open_local_cluster
from flodl_trio.transport import MessageStream
from flodl_trio.transport.local_leg import (
    NO_UNIX_ENV,
    UNIX_DIR_ENV,
    dial_local_leg,
    local_leg_path,
)
from flodl_trio.wire import encode_data_handshake
from flodl_trio.wire.handshake import (
    LOCAL_ACK_LEN,
    decode_local_ack,
    decode_local_handshake,
    encode_local_ack,
    encode_local_handshake,
)
from flodl_trio.wire.salt import SessionSalt

LOOP = "127.0.0.1"
NOBODY = 65534
root_only = pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")


@pytest.fixture(autouse=True)
def private_unix_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test's relays and ranks meet in a directory of its own."""
    directory = tmp_path / "legs"
    monkeypatch.setenv(UNIX_DIR_ENV, str(directory))
    monkeypatch.delenv(NO_UNIX_ENV, raising=False)
    return directory


def rank_tensors(rank: int, numel: int) -> list[torch.Tensor]:
    """Values of different magnitudes per rank, a tensor split oddly, for an exact check."""
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(numel, generator=gen) * 10.0 ** (rank - 1), torch.arange(7, dtype=torch.float32) * (rank + 1)]


def weighted_mean(per_rank: dict[int, list[torch.Tensor]], weights: dict[int, float]) -> list[np.ndarray]:
    total = sum(weights.values())
    count = len(next(iter(per_rank.values())))
    return [
        sum(weights[r] * per_rank[r][i].double().numpy() for r in per_rank) / total for i in range(count)
    ]


@pytest.mark.parametrize("numel", [1000, 3 << 20], ids=["small", "12MiB"])
async def test_tcp_and_local_leg_ranks_share_a_round_exactly(salt, numel):
    """Host 0: rank 0 on the local leg, rank 1 on TCP (a flodl-style rank, MACs);
    host 1: rank 2 alone on the local leg (the relay signs its frame on the way up).
    Every rank gets the same realized-work average, equal to numpy's."""
    weights = {0: 1.0, 1: 3.0, 2: 0.5}
    per_rank = {r: rank_tensors(r, numel) for r in weights}
    results: dict[int, tuple[bool, list[torch.Tensor], float]] = {}
    async with open_local_cluster(world_size=3, hosts=[[0, 1], [2]], salt=salt) as cluster:
        assert all(relay.unix_path is not None and relay.unix_path.is_socket() for relay in cluster.relays)

        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 3, salt, local_leg=rank != 1) as client:
                for _round in range(2):
                    tensors = [t.clone() for t in per_rank[rank]]
                    consensus, mass = await client.all_reduce_weighted(
                        [weights[rank] * t for t in tensors], kind=0, weight=weights[rank]
                    )
                results[rank] = (client.local_leg, consensus, mass)

        async with trio.open_nursery() as nursery:
            for rank in weights:
                nursery.start_soon(rank_main, rank)
        assert [relay.stats.local_connections for relay in cluster.relays] == [1, 1]
        assert [relay.stats.mac_failures for relay in cluster.relays] == [0, 0]
    assert {r: results[r][0] for r in results} == {0: True, 1: False, 2: True}
    expected = weighted_mean(per_rank, weights)
    for rank, (_local, consensus, mass) in results.items():
        assert mass == pytest.approx(sum(weights.values()))
        for got, want in zip(consensus, expected):
            np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-6)
        for got, other in zip(consensus, results[0][1]):
            assert torch.equal(got, other), f"rank {rank} got other bytes than rank 0"


async def test_bf16_rounds_over_the_local_leg(salt):
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        out: dict[int, list[torch.Tensor]] = {}

        async def rank_main(rank: int) -> None:
            async with connect_reduce_client(cluster.relay_address(rank), rank, 2, salt) as client:
                client.bf16_wire = True
                out[rank] = await client.all_reduce_tensors([torch.full((4096,), 2.0 + 2 * rank)])

        async with trio.open_nursery() as nursery:
            for rank in (0, 1):
                nursery.start_soon(rank_main, rank)
        assert cluster.relays[0].stats.local_connections == 2
    assert torch.equal(out[0][0], torch.full((4096,), 3.0)) and torch.equal(out[1][0], out[0][0])


async def test_tcp_rank_sending_an_unsigned_frame_is_refused_alone(salt):
    """The MAC may be left out only on the local leg: on TCP the relay refuses the
    frame (a MAC failure), drops that rank and its neighbour's round completes."""
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        async def cheater() -> None:
            async with connect_reduce_client(cluster.relay_address(1), 1, 2, salt, local_leg=False) as client:
                client._conn.signed_frames = False  # zeros where the MAC goes, on TCP
                with pytest.raises(RankDeadError):
                    await client.all_reduce_tensors([torch.ones(8)])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cheater)
            async with connect_reduce_client(cluster.relay_address(0), 0, 2, salt) as honest:
                assert honest.local_leg
                consensus = await honest.all_reduce_tensors([torch.full((8,), 5.0)])
        assert torch.equal(consensus[0], torch.full((8,), 5.0))
        assert cluster.relays[0].stats.mac_failures == 1


async def test_a_bad_frame_on_the_local_leg_costs_only_its_rank(salt, caplog):
    """Frames are not signed here, but they are still checked: garbage from rank 1
    drops rank 1 (naming it), and rank 0 completes its round alone."""
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        path = cluster.relays[0].unix_path
        assert path is not None
        raw = MessageStream(await trio.open_unix_socket(str(path)), "raw rank 1")
        handshake = encode_local_handshake(1, 2, salt)
        await raw.send_chunks([handshake])
        decode_local_ack(await raw.receive_exactly(LOCAL_ACK_LEN, "the local ack"), handshake, salt)
        await raw.send_len_framed([b"\x00" * 40], 40)  # no RoundFrame magic
        async with connect_reduce_client(cluster.relay_address(0), 0, 2, salt) as honest:
            consensus = await honest.all_reduce_tensors([torch.full((8,), 2.0)])
        assert torch.equal(consensus[0], torch.full((8,), 2.0))
        with trio.fail_after(5):
            assert await raw.stream.receive_some(64) == b""
        await raw.aclose()
    assert any("rank 1 dropped" in r.getMessage() and "bad magic" in r.getMessage() for r in caplog.records)


async def test_a_rank_of_another_run_is_refused_at_the_handshake(salt):
    """Frames on the local leg carry no MAC, so each end proves the salt once, at the
    handshake: a rank holding another salt never gets in, and says why."""
    async with open_local_cluster(world_size=2, hosts=[[0, 1]], salt=salt) as cluster:
        with pytest.raises(FramingError, match="another session salt \\(local leg\\)"):
            await connect_reduce_client(cluster.relay_address(1), 1, 2, SessionSalt(b"\x24" * 16), connect_attempts=1)
        assert any("local-leg handshake of rank 1: MAC mismatch" in r for r in cluster.relays[0].rejections)
        async with connect_reduce_client(cluster.relay_address(1), 1, 2, salt) as client:  # the rank may still come
            assert client.local_leg


def test_local_leg_handshake_proves_the_salt_both_ways(salt):
    other = SessionSalt(b"\x24" * 16)
    handshake = encode_local_handshake(3, 8, salt)
    assert handshake[:16] == encode_data_handshake(3, 8) and len(handshake) == 24
    assert decode_local_handshake(handshake, 8, salt).rank == 3
    with pytest.raises(MacError, match="local-leg handshake of rank 3"):
        decode_local_handshake(handshake, 8, other)
    ack = encode_local_ack(handshake, salt)
    decode_local_ack(ack, handshake, salt)
    with pytest.raises(MacError, match="handshake ack from the relay"):
        decode_local_ack(encode_local_ack(handshake, other), handshake, salt)
    with pytest.raises(MacError):  # an ack is bound to the handshake it answers
        decode_local_ack(encode_local_ack(encode_local_handshake(2, 8, salt), salt), handshake, salt)


# -- who may use it ------------------------------------------------------------------------------

PEER_AS_NOBODY = textwrap.dedent("""
    import ctypes, os, socket, sys
    path, fs_root = sys.argv[1], sys.argv[2] == "fs-root"
    os.setgroups([])
    os.setresgid({nobody}, {nobody}, {nobody})
    # With fs-root the file system still sees root (so the 0700 directory lets it
    # through), while its effective uid - what SO_PEERCRED reports - is nobody's.
    os.setresuid({nobody}, {nobody}, 0 if fs_root else {nobody})
    if fs_root:
        ctypes.CDLL(None, use_errno=True).setfsuid(0)
    assert os.geteuid() == {nobody}
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
    except PermissionError:
        print("permission denied"); sys.exit(0)
    s.settimeout(10)
    try:
        s.sendall(bytes.fromhex(sys.argv[3]))
        print("closed" if s.recv(64) == b"" else "answered")
    except (BrokenPipeError, ConnectionResetError):
        print("closed")
""").format(nobody=NOBODY)


async def run_as_nobody(path: Path, mode: str) -> str:
    handshake = encode_data_handshake(0, 1).hex()
    result = await trio.run_process(
        [sys.executable, "-c", PEER_AS_NOBODY, str(path), mode, handshake], capture_stdout=True, capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    return result.stdout.decode().strip()


@root_only
async def test_a_connection_from_another_uid_is_refused(salt):
    """Through the 0700 directory another user cannot even reach the socket; one that
    does reach it (file-system uid root, effective uid nobody) is refused on its
    SO_PEERCRED uid before the relay reads a byte, and the relay serves on."""
    async with open_relay(
        ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, 9), host_name="h", ranks=[0], world_size=1,
        salt=salt, connect_attempts=1000,
    ) as relay:
        assert relay.unix_path is not None
        assert await run_as_nobody(relay.unix_path, "plain") == "permission denied"
        assert await run_as_nobody(relay.unix_path, "fs-root") == "closed"
        assert len(relay.rejections) == 1
        assert f"from uid {NOBODY}" in relay.rejections[0] and "or root may use it" in relay.rejections[0]
        assert relay.stats.local_connections == 0


LISTEN_AS_NOBODY = textwrap.dedent("""
    import os, socket, sys, time
    os.setgroups([]); os.setresgid({nobody}, {nobody}, {nobody}); os.setresuid({nobody}, {nobody}, {nobody})
    s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(4)
    print("listening", flush=True)
    time.sleep(30)
""").format(nobody=NOBODY)


@root_only
async def test_a_rank_does_not_use_a_socket_another_user_serves(monkeypatch, caplog):
    """The rank checks the relay's uid too: a socket at the right path, served by
    someone else, is ignored (the rank would dial TCP)."""
    shared = Path(tempfile.mkdtemp(prefix="flodl-leg-", dir="/tmp"))  # reachable by nobody
    os.chmod(shared, 0o777)
    monkeypatch.setenv(UNIX_DIR_ENV, str(shared))
    path = local_leg_path(45678)
    proc = subprocess.Popen([sys.executable, "-c", LISTEN_AS_NOBODY, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "listening"
        with caplog.at_level(logging.WARNING):
            assert await dial_local_leg(LOOP, 45678, "rank 0") is None
        assert any(f"served by uid {NOBODY}" in r.getMessage() for r in caplog.records)
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(shared)


# -- housekeeping -----------------------------------------------------------------------------------

@root_only
@pytest.mark.parametrize("problem", ["mode 0755", "another user's"])
async def test_a_relay_refuses_a_directory_others_can_reach(salt, private_unix_dir, problem):
    private_unix_dir.mkdir()
    if problem == "mode 0755":
        os.chmod(private_unix_dir, 0o755)
        want = "has mode 0755; it must be 0700"
    else:
        os.chmod(private_unix_dir, 0o700)
        os.chown(private_unix_dir, NOBODY, NOBODY)
        want = f"belongs to uid {NOBODY}"
    with pytest.raises(ConfigError, match=want) as caught:
        async with open_relay(
            ChannelKind.DATA, listen=(LOOP, 0), upstream=(LOOP, 9), host_name="h", ranks=[0], world_size=1, salt=salt,
        ):
            pass
    assert str(private_unix_dir) in str(caught.value) and "--no-unix" in str(caught.value)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOP, 0))
        return int(s.getsockname()[1])


async def test_a_stale_socket_is_replaced_and_the_socket_removed_on_exit(salt, private_unix_dir):
    port = free_port()
    stale = local_leg_path(port)
    private_unix_dir.mkdir(mode=0o700)
    with socket.socket(socket.AF_UNIX) as dead:  # a relay that died without cleaning up
        dead.bind(str(stale))
    assert stale.is_socket()
    async with open_relay(
        ChannelKind.DATA, listen=(LOOP, port), upstream=(LOOP, 9), host_name="h", ranks=[0], world_size=1,
        salt=salt, connect_attempts=1000,
    ) as relay:
        assert relay.unix_path == stale
        async with connect_reduce_client((LOOP, port), 0, 1, salt) as client:
            assert client.local_leg  # handshaken over the new socket
        assert relay.stats.local_connections == 1
    assert not stale.exists()


async def test_a_socket_a_live_relay_serves_is_not_taken_over(salt, private_unix_dir, caplog):
    """Two data relays on one port number, bound to two addresses: the second serves
    TCP only, and the first one's ranks still reach the first one."""
    port = free_port()
    first = open_relay(ChannelKind.DATA, listen=(LOOP, port), upstream=(LOOP, 9), host_name="a", ranks=[0],
                       world_size=2, salt=salt, connect_attempts=1000)
    second = open_relay(ChannelKind.DATA, listen=("127.0.0.2", port), upstream=(LOOP, 9), host_name="b", ranks=[1],
                        world_size=2, salt=salt, connect_attempts=1000)
    async with first as a, second as b:
        assert a.unix_path == local_leg_path(port) and b.unix_path is None
        assert any("served by a live process" in r.getMessage() for r in caplog.records)
        async with connect_reduce_client((LOOP, port), 0, 2, salt) as client:
            assert client.local_leg
        assert a.stats.local_connections == 1 and b.stats.local_connections == 0


async def test_no_unix_turns_off_both_ends(salt, monkeypatch):
    monkeypatch.setenv(NO_UNIX_ENV, "1")
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt) as cluster:
        assert cluster.relays[0].unix_path is None
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, salt) as client:
            assert not client.local_leg
            await client.all_reduce_tensors([torch.ones(2)])
    monkeypatch.delenv(NO_UNIX_ENV)
    # A relay without the leg: the rank dials TCP without a word.
    async with open_local_cluster(world_size=1, hosts=[[0]], salt=salt, local_leg=False) as cluster:
        assert cluster.relays[0].unix_path is None
        async with connect_reduce_client(cluster.relay_address(0), 0, 1, salt) as client:
            assert not client.local_leg
            await client.all_reduce_tensors([torch.ones(2)])


def test_relay_daemon_flags(monkeypatch):
    base = ["--controller", "127.0.0.1:29500", "--ranks", "0,1", "--world-size", "2"]
    monkeypatch.setenv("FLODL_SALT_HEX", "42" * 16)
    on = settings_from_args(build_parser().parse_args(base))
    off = settings_from_args(build_parser().parse_args([*base, "--no-unix", "--unix-dir", "/run/x"]))
    assert (on.local_leg, on.unix_dir) == (True, os.environ[UNIX_DIR_ENV])
    assert (off.local_leg, off.unix_dir) == (False, "/run/x")
    monkeypatch.setenv(NO_UNIX_ENV, "1")
    assert not settings_from_args(build_parser().parse_args(base)).local_leg


def test_the_parents_a_private_directory_lacks_are_created_private_too(tmp_path, monkeypatch):
    """``--unix-dir a/b/c`` where ``a`` does not exist: under a permissive umask,
    mkdir(parents=True) made ``a`` and ``b`` world-writable, letting another user move
    the private ``c`` aside. Every directory created is 0700."""
    import os
    import stat

    from flodl_trio.transport.local_leg import ensure_private_dir

    old = os.umask(0)
    try:
        ensure_private_dir(tmp_path / "a" / "b" / "c")
    finally:
        os.umask(old)
    for made in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "c"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
