"""A seeded chaos run of a whole cluster on a memory network, in virtual time.

A plan (:func:`make_plan`) is drawn from a seed: the cluster's shape (3 to 8
hosts of 1 to 3 ranks), its lanes and shards, deterministic mode or not, every
rank's mass and values in every window, and a schedule of faults at window
boundaries: ranks that exit (``finish``), ranks that crash (``aclose`` after
``join``) and come back with ``join()`` on a new client, a host's relays
closed, reduction shards lost mid-round. :func:`run_plan` runs it on
``open_local_cluster(network=MemoryNetwork())`` and :func:`check_run` holds
every window to the docs (wire.md, "The fold, and dividing exactly once",
"Lanes", "Shards"; liveness.md):

- each window's contributors are exactly the ranks live at its boundary
  (every planned fault lands between windows, so the set is known);
- every rank that finished the window holds the same bytes, the same step
  counts and the same accepted mass;
- the consensus is the mass-weighted mean over the contributors: bit for bit
  the canonical fold (ranks in rank order within a host, hosts by lowest
  rank, one multiplication by the f32 reciprocal) in deterministic mode, to
  f32 rounding otherwise;
- a returning rank loads the consensus of the window its state names, bit
  for bit;
- a rank whose relay closed gets a ``FlodlError``, and nothing else does.

Windows are one step-count gather (a Control round) and one params round (a
Model round), as ``average_window`` sends them, with the tensors pre-scaled
so the test knows every byte that went up.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Literal

import attrs
import numpy as np
import torch
import trio

from flodl_trio import FlodlError, RoundKind, connect_reduce_client
from flodl_trio.testing import MemoryNetwork, open_local_cluster
from flodl_trio.testing.local import LocalCluster
from flodl_trio.transport.settings import NetBounds

SALT = b"chaos-of-shards!"
DEFAULTS = NetBounds()
# Knobs for exploring more seeds by hand. ALL_SHARDS: may every shard be lost? On a memory
# network the controller cannot serve one itself, so it then stops, naming the shard, as
# wire.md says ("A lost shard"). KEEPER: one rank is never faulted, so some rank is live
# in every window (a run whose every rank dies is not what this oracle knows).
ALL_SHARDS = False
KEEPER = True
SHARD_P = 0.4  # how likely each shard is lost (all but one at most)
MID_P = 0.25  # how likely each rank crashes inside a window (a host's relays closing: half that)


@attrs.frozen
class Plan:
    """Everything a seed decides."""

    seed: int
    hosts: list[list[int]]
    windows: int
    shapes: list[tuple[int, ...]]
    lanes: int | None
    lane_min_bytes: int | None
    shards: int | Literal["auto"]
    deterministic: bool
    masses: dict[tuple[int, int], float]  # (rank, window) -> mass (steps)
    exits: dict[int, int]  # rank -> the boundary (window) before which it finishes
    crashes: dict[int, tuple[int, int]]  # rank -> (boundary it crashes at, boundary its new client starts at)
    relay_closes: dict[int, int]  # host -> boundary its relays close at
    shard_losses: dict[int, tuple[int, int]]  # shard -> (window it is lost in, scheduler checkpoints into it)
    # Faults inside a window (after this many scheduler checkpoints): whether the rank's
    # frame of that window is in is a race (realized work, or not), so either is right.
    mid_crashes: dict[int, tuple[int, int, int]] = attrs.field(factory=dict)  # rank -> (window, boundary back, checkpoints)
    mid_relay_closes: dict[int, tuple[int, int]] = attrs.field(factory=dict)  # host -> (window, checkpoints)

    @property
    def world(self) -> int:
        return sum(len(h) for h in self.hosts)

    def host_of(self, rank: int) -> int:
        return next(i for i, ranks in enumerate(self.hosts) if rank in ranks)

    def values(self, rank: int, window: int) -> list[np.ndarray]:
        """What rank ``rank`` trained to by window ``window`` (unscaled)."""
        rng = np.random.default_rng([self.seed, rank, window])
        return [rng.standard_normal(int(np.prod(s))).astype(np.float32).reshape(s) for s in self.shapes]

    def describe(self) -> str:
        return (f"seed={self.seed} hosts={self.hosts} windows={self.windows} shapes={self.shapes} lanes={self.lanes} "
                f"lane_min_bytes={self.lane_min_bytes} shards={self.shards} deterministic={self.deterministic} "
                f"exits={self.exits} crashes={self.crashes} relay_closes={self.relay_closes} "
                f"shard_losses={self.shard_losses} mid_crashes={self.mid_crashes} "
                f"mid_relay_closes={self.mid_relay_closes}")


def make_plan(seed: int, *, keeper: bool = KEEPER) -> Plan:
    """The seed's cluster and faults; ``keeper`` False: every rank may die (some windows
    then have no live rank, and returning ranks start the run again from the state)."""
    rng = random.Random(seed)
    sizes = [rng.randint(1, 3) for _ in range(rng.randint(3, 8))]
    hosts, next_rank = [], 0
    for size in sizes:
        hosts.append(list(range(next_rank, next_rank + size)))
        next_rank += size
    world = next_rank
    windows = rng.randint(5, 8)
    shapes = [tuple(rng.choice([(rng.randint(1, 900),), (rng.randint(1, 40), rng.randint(1, 30))]))
              for _ in range(rng.randint(1, 3))]
    lanes = rng.choice([None, None, rng.randint(2, 12)])
    lane_min_bytes = rng.choice([0, 0, 512, None])
    shards: int | Literal["auto"] = rng.choice([0, "auto", "auto", 1, 2, 3])
    deterministic = rng.random() < 0.5
    masses = {}
    for rank in range(world):
        for window in range(windows):
            roll = rng.random()
            masses[rank, window] = 0.0 if roll < 0.05 else (rng.randint(1, 16) / 4 if roll < 0.25 else rng.randint(1, 9))
    # Rank faults: each rank at most one; one rank (the keeper) never faulted, so the run goes on.
    kept = rng.randrange(world)
    relay_closes: dict[int, int] = {}
    faulted: set[int] = {kept} if keeper else set()
    for host, ranks in enumerate(hosts):
        if kept not in faulted & set(ranks) and rng.random() < 0.2:
            relay_closes[host] = rng.randint(1, windows - 1)
            faulted |= set(ranks)
    exits: dict[int, int] = {}
    crashes: dict[int, tuple[int, int]] = {}
    for rank in range(world):
        if rank in faulted:
            continue
        roll = rng.random()
        if roll < 0.2:
            exits[rank] = rng.randint(0, windows - 1)
        elif roll < 0.5:
            at = rng.randint(1, windows - 2)
            crashes[rank] = (at, rng.randint(at, windows - 1))
    shard_count = len(hosts) if shards == "auto" else shards
    shard_losses: dict[int, tuple[int, int]] = {}
    for shard in range(shard_count):
        if (len(shard_losses) < shard_count - 1 or ALL_SHARDS) and rng.random() < SHARD_P:
            shard_losses[shard] = (rng.randint(0, windows - 1), rng.randint(0, 400))
    # Faults inside windows, drawn apart so that the plans above stay what they were.
    mid = random.Random(f"{seed}-mid")
    mid_relay_closes: dict[int, tuple[int, int]] = {}
    for host, ranks in enumerate(hosts):
        if not faulted & set(ranks) and not set(exits) & set(ranks) and not set(crashes) & set(ranks) \
                and mid.random() < MID_P / 2:
            mid_relay_closes[host] = (mid.randint(0, windows - 1), mid.randint(0, 300))
            faulted |= set(ranks)
    mid_crashes: dict[int, tuple[int, int, int]] = {}
    for rank in range(world):
        if rank not in faulted and rank not in exits and rank not in crashes and mid.random() < MID_P:
            at = mid.randint(0, windows - 2)
            mid_crashes[rank] = (at, mid.randint(at + 1, windows - 1), mid.randint(0, 40))
    return Plan(seed, hosts, windows, shapes, lanes, lane_min_bytes, shards, deterministic, masses, exits, crashes,
                relay_closes, shard_losses, mid_crashes, mid_relay_closes)


@attrs.define
class Sent:
    """One rank's window as the test saw it."""

    mass: float  # what it said (0 for a rank catching up)
    counts: list[float]
    consensus: list[np.ndarray]
    accepted: float


@attrs.define
class Run:
    plan: Plan
    sent: dict[tuple[int, int], Sent] = attrs.field(factory=dict)  # (rank, window)
    errors: dict[int, BaseException] = attrs.field(factory=dict)  # rank -> the error that ended its last life
    entries: dict[int, int] = attrs.field(factory=dict)  # returning rank -> the window it entered at
    loaded: dict[int, tuple[int, list[np.ndarray]]] = attrs.field(factory=dict)  # returner -> (state window, params)
    reached: dict[int, int] = attrs.field(factory=dict)  # rank -> the boundary it is at (or past)
    stats: dict[str, int] = attrs.field(factory=dict)  # the controller's counters at the end
    gone: set[int] = attrs.field(factory=set)  # ranks whose life ended (not to be waited for)
    gates: list[trio.Event] = attrs.field(factory=list)
    mid_masses: dict[tuple[int, int], float] = attrs.field(factory=dict)  # (rank, window) -> the mass of a cut round
    moved: trio.Event = attrs.field(factory=trio.Event)

    def note(self) -> None:
        """Something the driver waits on changed."""
        self.moved.set()
        self.moved = trio.Event()


async def rank_life(cluster: LocalCluster, run: Run, rank: int, returning: bool) -> None:
    """One process's life of rank ``rank``: join, windows until its planned fault or the end."""
    plan = run.plan
    try:
        async with connect_reduce_client(cluster.relay_address(rank), rank, plan.world, cluster.salt,
                                         connect=cluster.connect) as client:
            params = [torch.full(s, float("nan")) for s in plan.shapes]  # join must overwrite all of it
            start = await client.join(params, [])
            if returning:
                run.entries[rank] = start
                state = client.last_state
                assert state is not None
                run.loaded[rank] = (state.window, [p.numpy().copy() for p in params])
            run.reached[rank] = start
            run.note()
            for window in range(start, plan.windows):
                if plan.exits.get(rank) == window:
                    await client.finish()
                    return
                if not returning and rank in plan.crashes and plan.crashes[rank][0] == window:
                    await client.aclose()
                    return
                crash = plan.mid_crashes.get(rank) if not returning else None
                await run.gates[window].wait()
                mass = plan.masses[rank, window]
                if 0 in client.catching_up:  # its first window after loading a state it is behind
                    client.catching_up.discard(0)
                    mass = 0.0
                scaled = [torch.from_numpy(v * np.float32(mass)) for v in plan.values(rank, window)]
                counts = [0.0] * plan.world
                counts[rank] = mass
                gathered = await client.all_reduce_per_rank_f64(counts)
                if crash is not None and crash[0] == window:
                    run.mid_masses[rank, window] = mass
                    if crash[2] >= 3:  # else it crashes between the step-count gather and the params round
                        async with trio.open_nursery() as nursery:  # the params round, cut short: a crash
                            nursery.start_soon(client.all_reduce_weighted, scaled, RoundKind.MODEL, mass)
                            for _ in range(crash[2]):
                                await trio.lowlevel.checkpoint()
                            nursery.cancel_scope.cancel()
                    await client.aclose()
                    return
                consensus, accepted = await client.all_reduce_weighted(scaled, RoundKind.MODEL, mass)
                run.sent[rank, window] = Sent(mass, list(gathered), [t.numpy().copy() for t in consensus], accepted)
                run.reached[rank] = window + 1
                run.note()
    except FlodlError as exc:
        run.errors[rank] = exc
    finally:
        run.gone.add(rank)
        run.note()


async def wait_for(run: Run, condition: Callable[[], bool]) -> None:
    while not condition():
        await run.moved.wait()


async def run_plan(plan: Plan) -> Run:
    run = Run(plan)
    run.gates = [trio.Event() for _ in range(plan.windows)]
    options: dict[str, object] = {"rejoin_timeout": 600.0}
    if plan.lane_min_bytes is not None:
        options["lane_min_bytes"] = plan.lane_min_bytes
    async with open_local_cluster(world_size=plan.world, hosts=plan.hosts, salt=SALT, network=MemoryNetwork(),
                                  bounds=DEFAULTS, deterministic=plan.deterministic, lanes=plan.lanes,
                                  shards=plan.shards, **options) as cluster:  # type: ignore[arg-type]
        async with trio.open_nursery() as nursery:
            for rank in range(plan.world):
                run.reached[rank] = -1
                nursery.start_soon(rank_life, cluster, run, rank, False)
            for window in range(plan.windows):
                # Every rank in its windows is at this boundary (or gone) before any fault lands;
                # a returning rank's join waits for a boundary, so it is not waited for until it returns.
                await wait_for(run, lambda: all(run.reached[r] >= window for r in run.reached if r not in run.gone))
                for host, at in plan.relay_closes.items():
                    if at == window:
                        cluster.close_relay(host)
                backs = [(rank, back) for rank, (_, back) in plan.crashes.items()]
                backs += [(rank, back) for rank, (_, back, _) in plan.mid_crashes.items()]
                for rank, back in backs:
                    if back == window:
                        await wait_for(run, lambda: rank in run.gone)  # its first life ended
                        run.gone.discard(rank)
                        run.reached.pop(rank, None)
                        nursery.start_soon(rank_life, cluster, run, rank, True)
                run.gates[window].set()
                inside = [(checkpoints, cluster.close_shard, shard)
                          for shard, (at, checkpoints) in plan.shard_losses.items() if at == window]
                inside += [(checkpoints, cluster.close_relay, host)
                           for host, (at, checkpoints) in plan.mid_relay_closes.items() if at == window]
                done = 0
                for checkpoints, close, index in sorted(inside):
                    for _ in range(checkpoints - done):
                        await trio.lowlevel.checkpoint()
                    done = checkpoints
                    close(index)
        await cluster.controller.wait_finished()
        run.stats = attrs.asdict(cluster.controller.stats)
    return run


def canonical(plan: Plan, window: int, masses: dict[int, float]) -> tuple[list[np.ndarray], float]:
    """The deterministic fold of the frames of ``window`` of the ranks ``masses`` names,
    each scaled by its mass: each host's ranks added in rank order, the hosts by lowest
    rank, then one multiplication by f32(1 / mass) (none for a mass of 0)."""
    host_sums: list[tuple[list[np.ndarray], float]] = []
    for ranks in plan.hosts:
        acc: list[np.ndarray] | None = None
        mass = 0.0
        for rank in ranks:
            if rank not in masses:
                continue
            scaled = [v * np.float32(masses[rank]) for v in plan.values(rank, window)]
            acc = [s.copy() for s in scaled] if acc is None else [a + s for a, s in zip(acc, scaled)]
            mass += masses[rank]
        if acc is not None:
            host_sums.append((acc, mass))
    total: list[np.ndarray] = [h.copy() for h in host_sums[0][0]]
    mass = host_sums[0][1]
    for sums, m in host_sums[1:]:
        total = [a + s for a, s in zip(total, sums)]
        mass += m
    if mass > 0:
        total = [t * np.float32(1 / mass) for t in total]
    return total, mass


MAYBE = None  # a rank whose frame of a window may be in it or not (a fault inside that window)


def planned(plan: Plan, run: Run, rank: int, window: int) -> bool | None:
    """Whether the plan has ``rank`` in ``window``: True, False or MAYBE."""
    host = plan.host_of(rank)
    if rank in plan.exits and window >= plan.exits[rank]:
        return False
    if host in plan.relay_closes and window >= plan.relay_closes[host]:
        return False
    if host in plan.mid_relay_closes:
        at = plan.mid_relay_closes[host][0]
        if window >= at:
            return MAYBE if window == at else False
    fault = plan.crashes.get(rank, plan.mid_crashes.get(rank))
    if fault is not None and window >= fault[0]:
        if rank in plan.mid_crashes and window == fault[0]:
            return MAYBE
        return rank in run.entries and window >= run.entries[rank]
    return True


def check_run(run: Run) -> None:
    plan = run.plan
    closed = {r for h in [*plan.relay_closes, *plan.mid_relay_closes] for r in plan.hosts[h]}
    for rank, exc in run.errors.items():
        assert rank in closed, f"rank {rank} raised {exc!r}"
        assert f"rank {rank}" in str(exc), f"rank {rank}'s error does not name it: {exc!r}"
    for rank in closed:
        if rank not in run.errors:  # (a relay closed after its ranks' last window costs them nothing)
            assert (rank, plan.windows - 1) in run.sent, f"rank {rank} on a closed relay neither raised nor finished"
    for window in range(plan.windows):
        finished = sorted(r for r in range(plan.world) if (r, window) in run.sent)
        verdicts = {r: planned(plan, run, r, window) for r in range(plan.world)}
        want = [r for r in range(plan.world) if verdicts[r] is True]
        maybe = [r for r in range(plan.world) if verdicts[r] is MAYBE and r not in finished]
        assert [r for r in finished if verdicts[r] is not MAYBE] == want, (
            f"window {window}: finished by {finished}, the plan has {want} (and maybe {maybe})")
        if not finished:
            continue
        masses = {r: run.sent[r, window].mass for r in finished}
        maybe_mass = {r: run.mid_masses.get((r, window), plan.masses[r, window]) for r in maybe}
        candidates = [canonical(plan, window, {**masses, **{r: maybe_mass[r] for r in subset}})
                      for subset in subsets(maybe)]
        first = run.sent[finished[0], window]
        for rank in finished:
            got = run.sent[rank, window]
            for r in range(plan.world):
                allowed = {masses[r]} if r in masses else {0.0, maybe_mass[r]} if r in maybe_mass else {0.0}
                assert got.counts[r] in allowed, f"window {window}: rank {rank} gathered {got.counts[r]} for rank {r}, want one of {allowed}"
            assert got.accepted in {mass for _, mass in candidates}, (
                f"window {window}: rank {rank} accepted mass {got.accepted}, want one of {[m for _, m in candidates]}")
            for i, (a, b) in enumerate(zip(got.consensus, first.consensus)):
                assert a.tobytes() == b.tobytes(), f"window {window}: rank {rank} and {finished[0]} differ (tensor {i})"
        for i, got_tensor in enumerate(first.consensus):
            fits = np.zeros(got_tensor.shape, dtype=bool)
            for values, _ in candidates:
                if plan.deterministic:  # bit for bit (an element of each lane is one candidate's)
                    fits |= got_tensor.view(np.uint32) == values[i].view(np.uint32)
                else:
                    fits |= np.isclose(got_tensor, values[i], rtol=1e-5, atol=1e-5)
            assert fits.all(), (f"window {window} tensor {i}: {int((~fits).sum())} of {fits.size} elements are no "
                                f"candidate's (contributors {finished}, maybe {maybe})")
    for rank, (state_window, params) in run.loaded.items():
        if state_window < 0:
            continue
        holder = next((r for r in range(plan.world) if (r, state_window) in run.sent), None)
        if holder is None:  # every rank died before it took that window's consensus: nothing to compare
            continue
        for i, (a, b) in enumerate(zip(params, run.sent[holder, state_window].consensus)):
            assert a.tobytes() == b.tobytes(), f"rank {rank} loaded window {state_window}'s tensor {i} wrong"


def subsets(items: list[int]) -> list[tuple[int, ...]]:
    return [tuple(x for j, x in enumerate(items) if mask >> j & 1) for mask in range(1 << len(items))]
