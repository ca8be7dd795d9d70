"""Turns (flodl_trio.transport.tasks): writes on a shared link in ticket order, a turn
ending when its write does, when its ticket is given up, or after ``patience``."""

from __future__ import annotations

import trio
import trio.testing

from flodl_trio.transport.tasks import Turns


async def take(turns: Turns, ticket: int, log: list[tuple[str, int, float]], hold: float = 0.0) -> None:
    async with turns.turn(ticket):
        log.append(("in", ticket, trio.current_time()))
        await trio.sleep(hold)
    log.append(("out", ticket, trio.current_time()))


async def test_turns_are_taken_in_ticket_order_whatever_order_the_writers_arrive_in(autojump_clock):
    turns, log = Turns(range(5), patience=5.0), []
    async with trio.open_nursery() as nursery:
        for ticket in (3, 1, 4, 0, 2):
            nursery.start_soon(take, turns, ticket, log, 0.1)
            await trio.testing.wait_all_tasks_blocked()  # each is waiting before the next arrives
    entered = [ticket for what, ticket, _ in log if what == "in"]
    assert entered == [0, 1, 2, 3, 4]
    # one at a time: each began once the one before it had left
    times = {(what, ticket): at for what, ticket, at in log}
    assert all(times["in", t + 1] >= times["out", t] for t in range(4))


async def test_a_write_that_outlasts_its_patience_no_longer_holds_the_next_back(autojump_clock):
    turns, log = Turns(range(3), patience=1.0), []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, turns, 0, log, 20.0)  # a peer that stopped reading
        nursery.start_soon(take, turns, 1, log, 0.1)
        nursery.start_soon(take, turns, 2, log, 0.1)
    times = {(what, ticket): at for what, ticket, at in log}
    assert 1.0 <= times["in", 1] < 1.05  # after ticket 0's patience, not its 20 s
    assert times["in", 2] < times["in", 1] + 1.05  # 1's own write ended first: no wait for patience
    assert times["in", 2] >= times["out", 1]
    assert times["out", 0] >= 20.0  # the slow write went on, beside the others


async def test_a_ticket_given_up_or_cancelled_passes_the_turn_at_once(autojump_clock):
    turns, log = Turns(range(3), patience=10.0), []
    turns.give_up(0)  # its peer is gone: it never writes
    waiting = trio.CancelScope()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, turns, 2, log)
        nursery.start_soon(_cancelled_waiter, turns, 1, waiting)
        await trio.testing.wait_all_tasks_blocked()
        waiting.cancel()  # ticket 1's writer is cancelled while it waits
    assert [(what, ticket) for what, ticket, _ in log] == [("in", 2), ("out", 2)]
    assert log[0][2] < 1.0  # neither 0 nor 1 held it for their patience


async def _cancelled_waiter(turns: Turns, ticket: int, scope: trio.CancelScope) -> None:
    with scope:
        async with turns.turn(ticket):
            await trio.sleep_forever()


async def test_a_writer_that_stalled_is_passed_over_until_its_write_ends(autojump_clock):
    """Writers a and b alternate; a's first write stalls for 20 s. b's writes wait for
    a's patience once, not once per ticket of a's."""
    schedule = ["a", "b", "a", "b", "a", "b"]
    turns, log = Turns(schedule, patience=1.0), []

    async def writer(name: str, hold: float) -> None:
        for ticket in [t for t, who in enumerate(schedule) if who == name]:
            await take(turns, ticket, log, hold if ticket == 0 else 0.1)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer, "a", 20.0)
        nursery.start_soon(writer, "b", 0.1)
    times = {(what, ticket): at for what, ticket, at in log}
    assert times["out", 5] < 1.5  # b's three writes after one patience, not three
    assert times["in", 2] >= 20.0 and times["in", 4] >= times["out", 2]  # a went on, in its own order
