"""Launch conventions: find a rank's identity and its relay from the variables
torchrun and SLURM already set, so ranks start with the tools users have.

A rank needs its global rank, the world size, and the controller's port: its
relay listens on loopback at ``controller port + 4`` (data) and ``+ 5``
(control), flodl's convention. The relay of a host needs the host's ranks.

| what | torchrun | SLURM | flodl_trio override |
|---|---|---|---|
| global rank | RANK | SLURM_PROCID | FLODL_RANK |
| world size | WORLD_SIZE | SLURM_NTASKS | FLODL_WORLD_SIZE |
| local rank | LOCAL_RANK | SLURM_LOCALID | - |
| ranks per host | LOCAL_WORLD_SIZE | SLURM_NTASKS_PER_NODE | - |
| host index | GROUP_RANK / NODE_RANK | SLURM_NODEID | - |
| controller | MASTER_ADDR, MASTER_PORT | MASTER_ADDR, MASTER_PORT | FLODL_CONTROLLER (host:port) |
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import attrs

from ..errors import ConfigError

DEFAULT_CONTROLLER_PORT = 1337
DATA_PORT_OFFSET = 4
CONTROL_PORT_OFFSET = 5
MAX_PORT = 65535


def _first(env: Mapping[str, str], *names: str) -> str | None:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return value
    return None


def _int(env: Mapping[str, str], what: str, *names: str) -> int | None:
    value = _first(env, *names)
    if value is None:
        return None
    try:
        return int(value.split("(")[0])  # SLURM_NTASKS_PER_NODE may read "4(x2)"
    except ValueError:
        raise ConfigError(f"{what}: {names[0]}={value!r} is not an integer") from None


def controller_address(env: Mapping[str, str] | None = None) -> tuple[str, int]:
    """FLODL_CONTROLLER=host:port, else MASTER_ADDR / MASTER_PORT (port 1337 if unset)."""
    env = os.environ if env is None else env
    explicit = env.get("FLODL_CONTROLLER")
    if explicit:
        host, sep, port = explicit.rpartition(":")
        if not sep or not port.isdigit():
            raise ConfigError(f"FLODL_CONTROLLER must be host:port, got {explicit!r}")
        return host.strip("[]"), check_port(int(port), f"FLODL_CONTROLLER={explicit!r}")
    master_port = _int(env, "controller port", "MASTER_PORT")
    if master_port is None:
        return env.get("MASTER_ADDR", "127.0.0.1"), DEFAULT_CONTROLLER_PORT
    return env.get("MASTER_ADDR", "127.0.0.1"), check_port(master_port, f"MASTER_PORT={master_port}")


def check_port(port: int, what: str) -> int:
    """A port read from text or computed: 0..65535 (a larger one would wrap at the socket)."""
    if not 0 <= port <= MAX_PORT:
        raise ConfigError(f"{what}: port {port} is out of range 0..{MAX_PORT}")
    return port


@attrs.frozen
class RankLaunch:
    """Where a rank stands in the cluster and where its relay listens."""

    rank: int
    world_size: int
    local_rank: int
    controller: tuple[str, int]

    @property
    def data_relay(self) -> tuple[str, int]:
        return ("127.0.0.1", self.controller[1] + DATA_PORT_OFFSET)

    @property
    def control_relay(self) -> tuple[str, int]:
        return ("127.0.0.1", self.controller[1] + CONTROL_PORT_OFFSET)


def rank_from_env(env: Mapping[str, str] | None = None) -> RankLaunch:
    """This rank's launch settings from torchrun / SLURM / FLODL_* variables."""
    env = os.environ if env is None else env
    rank = _int(env, "rank", "FLODL_RANK", "RANK", "SLURM_PROCID")
    world = _int(env, "world size", "FLODL_WORLD_SIZE", "WORLD_SIZE", "SLURM_NTASKS")
    if rank is None or world is None:
        raise ConfigError(
            "cannot tell this rank's identity: set RANK and WORLD_SIZE (torchrun does), "
            "run under srun (SLURM_PROCID, SLURM_NTASKS), or set FLODL_RANK and FLODL_WORLD_SIZE"
        )
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} must be < world size {world}")
    local = _int(env, "local rank", "LOCAL_RANK", "SLURM_LOCALID")
    return RankLaunch(rank, world, local if local is not None else 0, controller_address(env))


def host_ranks_from_env(env: Mapping[str, str] | None = None) -> list[int] | None:
    """A host's global ranks, for its relay: host index x ranks per host, + 0..k-1.

    None when the environment does not say (pass ``--ranks`` then).
    """
    env = os.environ if env is None else env
    per_host = _int(env, "ranks per host", "LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE")
    host_index = _int(env, "host index", "GROUP_RANK", "NODE_RANK", "SLURM_NODEID")
    if per_host is None or host_index is None:
        return None
    return list(range(host_index * per_host, (host_index + 1) * per_host))
