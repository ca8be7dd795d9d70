"""Fault injection with the testing toolkit: kill a rank, flip a bit, check the consensus.

Two hosts, four ranks, every one of them a real OS process (the controller
and relays too). Rank r contributes ``(r + 1) * (k + 1)`` in round k. Then:

- a FaultProxy on rank 1's data connection flips one bit of its round-1
  frame: the relay's MAC check drops rank 1, which raises;
- rank 3 holds before round 2 and is SIGKILLed while it waits.

The survivors must receive the mean over exactly the ranks still contributing:
all four in round 0, ranks 0, 2, 3 in round 1, ranks 0 and 2 after that.

Run: python examples/fault_test_example.py   (about 3 seconds)
"""

from __future__ import annotations

import math

import trio

from flodl_trio import SessionSalt
from flodl_trio.testing import FlipBit, open_process_cluster
from flodl_trio.testing.matrix.offsets import FRAME_PAYLOAD, rank_frame_start

WORLD = 4
HOSTS = [[0, 1], [2, 3]]
ROUNDS = 4
NUMEL = 4
# Rank 1's data connection: a 16-byte handshake, then per round a u32 length prefix
# and a RoundFrame (17-byte header, 14 bytes of tensor header, the f32 payload, 8-byte MAC);
# the offsets module computes where things are from the wire package's own encoders.
ROUND1_PAYLOAD = rank_frame_start(1, NUMEL) + FRAME_PAYLOAD


def expected_mean(ranks: list[int], k: int) -> float:
    return math.fsum((r + 1) * (k + 1) for r in ranks) / len(ranks)


def contributors(k: int) -> list[int]:
    return [0, 1, 2, 3] if k == 0 else [0, 2, 3] if k == 1 else [0, 2]


async def main() -> None:
    salt = SessionSalt.generate()
    async with open_process_cluster(
        world_size=WORLD, hosts=HOSTS, salt=salt, rounds=ROUNDS, daemons=True, backend="numpy",
        heartbeat_timeout=2.0, numel=NUMEL,
        proxy_faults={1: [FlipBit(ROUND1_PAYLOAD, bit=4)]},   # one bit of rank 1's round-1 payload
        worker_args={3: ["--pause-before", "2:60"]},          # rank 3 waits before round 2 ...
    ) as cluster:
        with trio.fail_after(30):  # a fault test must never hang
            await cluster.wait_event(3, "paused", round=2)
            cluster.kill(3)                                   # ... and dies there
            print("rank 3: SIGKILLed while holding before round 2")

            flip = cluster.proxies[1].fired(FlipBit)[0]
            print(f"rank 1: proxy flipped a bit at byte {flip.offset} of its data connection ({flip.detail})")
            for rank in (1, 0, 2):
                outcome = await cluster.wait_outcome(rank)
                if outcome["event"] == "error":
                    print(f"rank {rank}: raised {outcome['type']}: {outcome['message']}")
                else:
                    print(f"rank {rank}: {outcome['event']}")
            for event in cluster.ranks[0].rounds:
                k = event["round"]
                want = expected_mean(contributors(k), k)
                ok = math.isclose(event["value"], want, rel_tol=1e-6) and event["mass"] == len(contributors(k))
                print(
                    f"round {k}: consensus {event['value']:.4f} mass {event['mass']:.0f}  "
                    f"(mean over ranks {contributors(k)} = {want:.4f}) {'ok' if ok else 'WRONG'}"
                )
            relay = cluster.relay_processes(0)[0]
            await relay.wait_log("rank 1 dropped")
            seen = set()
            for line in relay.text.splitlines():
                message = line.split('msg="', 1)[-1].rstrip('"')
                if "rank 1 dropped" in message and message not in seen:
                    seen.add(message)
                    print("relay host0 log:", message)
    print("every process reaped:", all(p.returncode is not None for p in cluster.processes()))


if __name__ == "__main__":
    trio.run(main)
