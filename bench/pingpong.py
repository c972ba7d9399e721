"""One message's round trip between two rank processes: the CommEngine on link threads
(`background=True`, the GPU path), the CommEngine issuing transfers on the caller's thread
(the CPU default), and plain `dist.isend`/`dist.irecv` (the floor), in alternating rounds.

Each round trip: rank 0 sends a small activation (a 4x16 float tensor and its target, packed in
one message) and waits for rank 1's reply of the same size; rank 1 posts its receive ahead of
time, as the executor does. Microseconds per round trip, medians over rounds.

    python bench/pingpong.py [--trips 2000] [--rounds 5] [--out bench/results/pingpong.md]
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from pipedream_fast import _C
from pipedream_fast.launch import launch

from harness import Spread, alternate, paired_ratio, write_results  # noqa: E402 - a sibling

ACT = _C.Channel.ACTIVATION


def engine_driver(rank: int, trips: int, background: bool) -> Any:
    group = dist.new_group([0, 1])  # each driver on a group of its own, as the runtime's links
    engine = _C.CommEngine(group, timeout=60.0, background=background)
    message = [torch.randn(4, 16), torch.randint(0, 4, (4,))]
    peer, stage_in, stage_out = 1 - rank, rank, 1 - rank
    mb = [0]

    def run() -> float:
        first = mb[0]
        engine.post_recv(peer, ACT, stage_in, first)
        began = time.perf_counter()
        for i in range(first, first + trips):
            if rank == 0:
                engine.send(peer, ACT, stage_out, i, message)
                got = engine.wait_recv(peer, ACT, stage_in, i)
                engine.post_recv(peer, ACT, stage_in, i + 1)
            else:
                got = engine.wait_recv(peer, ACT, stage_in, i)
                engine.post_recv(peer, ACT, stage_in, i + 1)
                engine.send(peer, ACT, stage_out, i, got)
        elapsed = time.perf_counter() - began
        engine.wait_recv(peer, ACT, stage_in, first + trips) if rank == 1 else None
        if rank == 0:
            engine.send(peer, ACT, stage_out, first + trips, message)
            engine.wait_recv(peer, ACT, stage_in, first + trips)
        else:
            engine.send(peer, ACT, stage_out, first + trips, message)
        engine.flush()
        mb[0] = first + trips + 1
        dist.barrier()
        return elapsed / trips * 1e6

    return run, engine


def plain_driver(rank: int, trips: int) -> Any:
    message = torch.randn(4 * 16 + 4)  # the same bytes, one tensor
    buffer = torch.empty_like(message)
    peer = 1 - rank
    group = dist.new_group([0, 1])

    def run() -> float:
        began = time.perf_counter()
        pending = dist.irecv(buffer, src=peer, group=group)
        for _ in range(trips):
            if rank == 0:
                dist.isend(message, dst=peer, group=group).wait()
                pending.wait()
                pending = dist.irecv(buffer, src=peer, group=group)
            else:
                pending.wait()
                pending = dist.irecv(buffer, src=peer, group=group)
                dist.isend(buffer.clone(), dst=peer, group=group).wait()
        elapsed = time.perf_counter() - began
        if rank == 0:
            dist.isend(message, dst=peer, group=group).wait()
        pending.wait()
        if rank == 1:
            dist.isend(message, dst=peer, group=group).wait()
        dist.barrier()
        return elapsed / trips * 1e6

    return run


def job(rank: int, world: int, trips: int, rounds: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    direct, a = engine_driver(rank, trips, background=False)
    threaded, b = engine_driver(rank, trips, background=True)
    try:
        return alternate({"plain dist.isend/irecv": plain_driver(rank, trips),
                          "CommEngine, link threads": threaded,
                          "CommEngine, direct": direct}, rounds)
    finally:
        a.shutdown()
        b.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()
    values = launch(job, 2, args.trips, args.rounds, timeout=1200)[0]
    rows = []
    for name, v in values.items():
        ratio = paired_ratio(values, name, "plain dist.isend/irecv")
        rows.append((name, Spread.of(v).text(1), f"{ratio.text(2)}x"))
        print(f"{name:26s} {Spread.of(v).text(1)} us per round trip ({ratio.text(2)}x plain)")
    if args.out:
        write_results(args.out, "Round trip of one small message between two rank processes",
                      [f"gloo on 127.0.0.1, 1 thread per rank; {args.trips} round trips per "
                       f"round, {args.rounds} alternating rounds after a warm-up; medians "
                       f"(range); ratios round by round."],
                      ["transport", "us per round trip", "vs plain"], rows, (),
                      {"trips": args.trips, "rounds": args.rounds, "values": values})
    return 0


if __name__ == "__main__":
    sys.exit(main())
