"""One small message's round trip between two rank processes, in alternating rounds: the
CommEngine on link threads (`background=True`, the GPU path), the CommEngine issuing transfers
on the caller's thread (the CPU default), and plain `dist.isend`/`dist.irecv` (the floor).
Rank 0 sends a 4x16 activation and its target in one message and waits for rank 1's echo; rank
1 posts its receive ahead, as the executor does. Microseconds per round trip, medians.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from pipedream_fast import _C
from pipedream_fast.launch import launch

from harness import Spread, alternate, paired_ratio, write_results  # noqa: E402 - a sibling

ACT, PLAIN = _C.Channel.ACTIVATION, "plain dist.isend/irecv"


def round_trips(rank: int, trips: int, post: Callable[[int], Any], wait: Callable[[int], Any],
                send: Callable[[int, Any], Any], flush: Callable[[], Any]) -> Callable[[], float]:
    """A round's driver: us per round trip over `trips` (message numbers go on across rounds);
    one more trip, not timed, takes the receive posted last."""
    count = [0]

    def run() -> float:
        first, end = count[0], count[0] + trips
        post(first)
        began = time.perf_counter()
        for i in range(first, end + 1):
            if i == end:
                elapsed = time.perf_counter() - began
            if rank == 0:
                send(i, None)
            got = wait(i)
            if i < end:
                post(i + 1)
            if rank == 1:
                send(i, got)
        flush()
        count[0] = end + 1
        dist.barrier()
        return elapsed / trips * 1e6
    return run


def engine(rank: int, trips: int, background: bool) -> tuple[Callable[[], float], Any]:
    """The CommEngine on a group of its own, as each of the runtime's links."""
    comm = _C.CommEngine(dist.new_group([0, 1]), timeout=60.0, background=background)
    message, peer = [torch.randn(4, 16), torch.randint(0, 4, (4,))], 1 - rank
    return round_trips(rank, trips, lambda i: comm.post_recv(peer, ACT, rank, i),
                       lambda i: comm.wait_recv(peer, ACT, rank, i),
                       lambda i, got: comm.send(peer, ACT, peer, i, message if got is None
                                                else got), comm.flush), comm


def plain(rank: int, trips: int) -> Callable[[], float]:
    """isend/irecv of one tensor of the same bytes; rank 1 sends a copy of what it got."""
    group, peer, pending = dist.new_group([0, 1]), 1 - rank, []
    message = torch.randn(4 * 16 + 4)
    buffer = torch.empty_like(message)

    def wait(i: int) -> torch.Tensor:
        pending.pop().wait()
        return buffer

    return round_trips(rank, trips,
                       lambda i: pending.append(dist.irecv(buffer, src=peer, group=group)),
                       wait, lambda i, got: dist.isend(message if got is None else got.clone(),
                                                       dst=peer, group=group).wait(), lambda: None)


def job(rank: int, world: int, trips: int, rounds: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    direct, a = engine(rank, trips, background=False)
    threaded, b = engine(rank, trips, background=True)
    try:
        return alternate({PLAIN: plain(rank, trips), "CommEngine, link threads": threaded,
                          "CommEngine, direct": direct}, rounds)
    finally:
        a.shutdown()
        b.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trips", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", help="write the markdown here (and .json beside it)")
    args = parser.parse_args()
    values = launch(job, 2, args.trips, args.rounds, timeout=1200)[0]
    rows = [(name, Spread.of(v).text(1), f"{paired_ratio(values, name, PLAIN).text(2)}x")
            for name, v in values.items()]
    for name, us, ratio in rows:
        print(f"{name:26s} {us} us per round trip ({ratio} plain)")
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
