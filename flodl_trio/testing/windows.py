"""Checking Local SGD runs of ``rank_worker --windows`` processes, window by window.

A worker's window ``w`` adds :func:`~flodl_trio.testing.rank_worker.window_delta`
to its params and reports :func:`~flodl_trio.testing.rank_worker.window_steps`
steps (2**rank: the params round's mass names who made it in), so every
window's consensus can be recomputed from scratch in float64 over the ranks
its gathered counts name. Deaths, restarts, rejoins and relays coming back
change who is in a window, never what a window over those ranks must hold.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import combinations
from typing import Any

import numpy as np

from .processes import ProcessCluster
from .rank_worker import window_delta, window_steps

Event = dict[str, Any]
HEAD = 8  # a window event carries the first HEAD params values


class WindowMismatch(AssertionError):
    """A window's consensus is not the mean over any set of ranks that may have been in it."""


def catching_up(cluster: ProcessCluster, rank: int) -> set[int]:
    """The windows ``rank`` ran with no work, one per life that entered behind: the
    first window after a join whose state was older than the window before it."""
    out = set()
    for proc in [*cluster.past_lives.get(rank, []), cluster.ranks[rank]]:
        for event in proc.events:
            if event.get("event") == "joined" and event["start"] > 0 and event.get("state_window", event["start"] - 1) < event["start"] - 1:
                out.add(event["start"])
    return out


def first_counted(cluster: ProcessCluster, rank: int) -> int:
    """The first window the current life of ``rank`` contributes to: the window it
    entered, or the one after when it entered behind."""
    start = joined_event(cluster, rank)["start"]
    return start + 1 if start in catching_up(cluster, rank) else start


def windows_of(cluster: ProcessCluster, rank: int) -> dict[int, Event]:
    """Every ``window`` event of every life of ``rank``, by window."""
    out: dict[int, Event] = {}
    for proc in [*cluster.past_lives.get(rank, []), cluster.ranks[rank]]:
        for event in proc.events:
            if event.get("event") == "window":
                out[event["window"]] = event
    return out


def joined_event(cluster: ProcessCluster, rank: int) -> Event:
    """The ``joined`` event of the rank's current life."""
    return next(e for e in cluster.ranks[rank].events if e.get("event") == "joined")


def check_windows(
    cluster: ProcessCluster, windows: int, numel: int, maybe_in: Mapping[int, set[int]] | None = None
) -> dict[int, set[int]]:
    """Every window's consensus against the float64 reference over its contributors;
    returns the contributors of each window.

    A rank killed mid-window was counted by the Control round and may or may not
    have made it into the params round: for window ``w`` any subset of
    ``maybe_in[w]`` may be missing from the counted set; the one that matches is
    the one the reference follows from then on.
    """
    world = cluster.world_size
    events = {rank: windows_of(cluster, rank) for rank in range(world)}
    behind = {rank: catching_up(cluster, rank) for rank in range(world)}
    consensus = np.zeros(numel)  # the params every contributor holds before window 0
    contributors_by_window: dict[int, set[int]] = {}
    for window in range(windows):
        seen = {rank: e[window] for rank, e in events.items() if window in e}
        if not seen:
            raise WindowMismatch(f"window {window}: nobody finished it")
        first = next(iter(seen.values()))
        counts = first["counts"]
        for rank, event in seen.items():
            if event["counts"] != counts or event["digest"] != first["digest"]:
                raise WindowMismatch(f"window {window}: rank {rank} gathered other counts or holds other bytes")
        counted = {rank for rank in range(world) if counts[rank] > 0}
        idle = {rank for rank in seen if window in behind[rank]}  # entered behind: no work this window
        if not counted >= set(seen) - idle or counted & idle or counts != [
            float(window_steps(r)) if r in counted else 0.0 for r in range(world)
        ]:
            raise WindowMismatch(f"window {window}: counts {counts} do not fit the ranks that finished it {set(seen)}")
        doubtful = sorted((maybe_in or {}).get(window, set()) & counted)
        candidates = [counted - set(gone) for n in range(len(doubtful) + 1) for gone in combinations(doubtful, n)]
        got = np.asarray(first["head"])
        for contributors in candidates:
            if not contributors:
                continue
            mass = {r: float(window_steps(r)) for r in contributors}
            step = sum(mass[r] * window_delta(r, window, numel).astype(np.float64) for r in contributors)
            want = consensus + step / sum(mass.values())
            if np.allclose(got, want[:HEAD], rtol=1e-5, atol=1e-5):
                break
        else:
            raise WindowMismatch(f"window {window}: consensus {got} matches no contributor set of {candidates}")
        consensus = want  # the f64 reference follows the ranks' f32 state closely enough for the check
        contributors_by_window[window] = contributors
    return contributors_by_window


def check_final_and_joins(cluster: ProcessCluster, windows: int, contributors: Mapping[int, set[int]]) -> None:
    """Every rank ends with the same bytes; a rank that came back loaded exactly the
    consensus of a finished window, and counts from the window it entered - or, when
    windows finished while its state travelled (it entered behind), from the one after:
    its first window carries no work, and ends with everyone's consensus."""
    finals = {windows_of(cluster, rank)[windows - 1]["digest"] for rank in range(cluster.world_size)}
    if len(finals) != 1:
        raise WindowMismatch("the ranks do not end with bit-identical params and buffers")
    for rank in cluster.past_lives:
        joined = joined_event(cluster, rank)
        start, loaded = joined["start"], joined.get("state_window", joined["start"] - 1)
        if start == 0:
            continue  # back before any window finished: nothing to load, it starts like everyone
        if loaded >= start:
            raise WindowMismatch(f"rank {rank} loaded window {loaded} and entered window {start}")
        others = [e[loaded]["digest"] for r in range(cluster.world_size) if loaded in (e := windows_of(cluster, r))]
        if joined["digest"] not in others[:1]:
            raise WindowMismatch(f"rank {rank} did not load the consensus of window {loaded}")
        counts_from = start if loaded == start - 1 else start + 1
        if start < windows and counts_from > start and rank in contributors[start]:
            raise WindowMismatch(f"rank {rank} entered window {start} behind but its older params were counted")
        if not all(rank in contributors[w] for w in range(counts_from, windows)):
            raise WindowMismatch(f"rank {rank} entered window {start} but is missing from a later window")


__all__ = [
    "HEAD",
    "WindowMismatch",
    "catching_up",
    "check_final_and_joins",
    "check_windows",
    "first_counted",
    "joined_event",
    "windows_of",
]
