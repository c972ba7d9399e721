"""The transports on their own, without the executor: links per (peer, channel, stage).

A rank that holds several pipeline stages (rank 0 with stages 0 and 2, rank 1 with 1 and 3)
shares one rank pair between several stage boundaries. Each boundary is its own link, keyed by
the stage that receives the message, so two boundaries may run the same microbatch numbers in
opposite orders and with different shapes without ever handing one stage the other's tensors.
"""

from __future__ import annotations

import pytest
import torch

from pipedream_fast import _C
from pipedream_fast.launch import launch
from pipedream_fast.runtime.transport import (ACTIVATION, GRADIENT, ProcessTransport, ThreadHub,
                                              ThreadTransport)

MICROBATCHES = 6


def payload(channel: _C.Channel, stage: int, mb: int) -> torch.Tensor:
    """What stage `stage` must receive for `mb`: a shape per link, values naming the message."""
    shape = (2, 3) if stage < 2 else (5,)
    return torch.full(shape, float(1000 * int(channel) + 100 * stage + mb))


def send_both_boundaries(transport, peer: int, channel: _C.Channel,
                         stages: tuple[int, int]) -> None:
    """Sends to the first stage in microbatch order and to the second in reverse, interleaved."""
    for i in range(MICROBATCHES):
        for stage, mb in ((stages[0], i), (stages[1], MICROBATCHES - 1 - i)):
            transport.send(peer, channel, stage, mb, [payload(channel, stage, mb)])


def receive_both_boundaries(transport, peer: int, channel: _C.Channel,
                            stages: tuple[int, int]) -> list[str]:
    """Posts and collects both links' messages (second stage first); returns the mismatches."""
    orders = {stages[0]: list(range(MICROBATCHES)),
              stages[1]: list(reversed(range(MICROBATCHES)))}
    for stage, order in orders.items():
        for mb in order:
            transport.post_recv(peer, channel, stage, mb)
    wrong = []
    for stage in reversed(stages):
        for mb in orders[stage]:
            got = transport.wait_recv(peer, channel, stage, mb)
            want = payload(channel, stage, mb)
            if len(got) != 1 or got[0].shape != want.shape or not torch.equal(got[0], want):
                wrong.append(f"{channel.name} stage {stage} mb {mb}: {got}")
    return wrong


def test_thread_transport_keeps_stage_boundaries_of_one_rank_pair_apart():
    hub = ThreadHub(2, timeout_s=10.0)
    rank0, rank1 = ThreadTransport(hub, 0), ThreadTransport(hub, 1)
    send_both_boundaries(rank0, 1, ACTIVATION, (1, 3))
    send_both_boundaries(rank1, 0, GRADIENT, (0, 2))
    assert receive_both_boundaries(rank1, 0, ACTIVATION, (1, 3)) == []
    assert receive_both_boundaries(rank0, 1, GRADIENT, (0, 2)) == []
    assert "for stage 3" in hub.queue(0, 1, ACTIVATION, 3).name
    hub.close()


def test_thread_transport_errors_name_the_stage():
    hub = ThreadHub(2, timeout_s=0.1)
    rank0, rank1 = ThreadTransport(hub, 0), ThreadTransport(hub, 1)
    with pytest.raises(_C.QueueTimeout, match="activation of stage 3, microbatch 5 from rank 0"):
        rank1.wait_recv(0, ACTIVATION, 3, 5)
    rank1.send(0, GRADIENT, 2, 4, [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="gradient of stage 2, microbatch 5 from rank 1, got "
                                           "microbatch 4"):
        rank0.wait_recv(1, GRADIENT, 2, 5)
    hub.close()


def _process_boundaries_job(rank: int, world: int, split: bool) -> dict[str, list[str]]:
    """Rank 0 holds stages 0 and 2, rank 1 holds 1 and 3: activations to stages 1 and 3 go
    0 -> 1, gradients to stages 0 and 2 go 1 -> 0, all on the one rank pair (`split`: the
    gradients on a process group of their own)."""
    import torch.distributed as dist

    gradients = dist.new_group([0, 1]) if split else None
    transport = ProcessTransport([[0], [1], [0], [1]], timeout_s=30.0, gradient_group=gradients)
    try:
        if rank == 0:
            send_both_boundaries(transport, 1, ACTIVATION, (1, 3))
            wrong = receive_both_boundaries(transport, 1, GRADIENT, (0, 2))
        else:
            send_both_boundaries(transport, 0, GRADIENT, (0, 2))
            wrong = receive_both_boundaries(transport, 0, ACTIVATION, (1, 3))
        transport.flush()
        try:
            transport.send(1 - rank, ACTIVATION, 512, 0, [torch.zeros(1)])
            rejected = "no error"
        except ValueError as err:
            rejected = str(err)
        return {"wrong": wrong, "rejected": [rejected]}
    finally:
        transport.close()


@pytest.mark.slow
@pytest.mark.parametrize("split", [False, True], ids=["one group", "split channels"])
def test_process_transport_keeps_stage_boundaries_of_one_rank_pair_apart(split):
    for result in launch(_process_boundaries_job, 2, split, timeout=60):
        assert result["wrong"] == []
        assert "stage 512" in result["rejected"][0], result["rejected"]


def _split_routing_job(rank: int, world: int) -> dict[str, str]:
    """Rank 0 puts gradients on a group of their own, rank 1 does not: activations still
    meet, gradients do not (rank 1 sends them on the main group, where rank 0 does not
    listen for them). Also: a gradient group of other ranks is refused."""
    import torch.distributed as dist

    main, gradients = dist.new_group([0, 1]), dist.new_group([0, 1])
    lone = dist.new_group([0])  # collective: every rank makes it
    out: dict[str, str] = {}
    if rank == 0:
        try:
            _C.CommEngine(dist.distributed_c10d._get_default_group(), timeout=5.0,
                          gradient_group=lone)
            out["refused"] = "no error"
        except ValueError as err:
            out["refused"] = str(err)
    mismatched = ProcessTransport([[0], [1]], timeout_s=1.0, group=main,
                                  gradient_group=gradients if rank == 0 else None)
    try:
        if rank == 0:
            mismatched.send(1, ACTIVATION, 1, 0, [payload(ACTIVATION, 1, 0)])
            mismatched.post_recv(1, GRADIENT, 0, 0)
            try:
                mismatched.wait_recv(1, GRADIENT, 0, 0)
                out["gradient"] = "arrived"
            except _C.QueueTimeout:
                out["gradient"] = "timed out"
        else:
            mismatched.post_recv(0, ACTIVATION, 1, 0)
            got = mismatched.wait_recv(0, ACTIVATION, 1, 0)
            out["activation"] = "ok" if torch.equal(got[0], payload(ACTIVATION, 1, 0)) else str(got)
            mismatched.send(0, GRADIENT, 0, 0, [payload(GRADIENT, 0, 0)])  # never taken
        dist.barrier()  # rank 1 stays until rank 0 has waited in vain
    finally:
        mismatched.close()
    return out


@pytest.mark.slow
def test_split_channels_put_the_gradients_on_their_own_group():
    sender, receiver = launch(_split_routing_job, 2, timeout=60)
    assert receiver["activation"] == "ok"
    assert sender["gradient"] == "timed out"  # sent on the default group, awaited on its own
    assert "same order" in sender["refused"] and "0 of 1" in sender["refused"], sender


def _transfer_loop_job(rank: int, world: int) -> dict:
    """Rank 0 sends two activations of stage 0 and posts a gradient's receive in one run;
    rank 1 posts both receives and sends the gradient in one run. Then a run whose second
    action is refused (a stage past the tags' range)."""
    transport = ProcessTransport([[0], [1]], timeout_s=30.0)
    loop = transport.transfer_loop()
    try:
        if rank == 0:
            stamps = loop.run([(0, 0, mb, 1, [payload(ACTIVATION, 1, mb), torch.tensor([mb])])
                               for mb in (0, 1)] + [(3, 0, 0, 1, None)])
            got = transport.wait_recv(1, GRADIENT, 0, 0)
        else:
            stamps = loop.run([(2, 1, 0, 0, None), (2, 1, 1, 0, None),
                               (1, 1, 0, 0, [payload(GRADIENT, 0, 0)])])
            got = transport.wait_recv(0, ACTIVATION, 1, 0) + transport.wait_recv(0, ACTIVATION,
                                                                                 1, 1)
        transport.flush()
        try:
            loop.run([(2, 1 - rank, 5, 1 - rank, None), (0, 511, 0, 1 - rank, [torch.zeros(1)])])
            refused = "no error"
        except ValueError as err:
            refused = str(err)
        return {"stamps": stamps, "got": got, "refused": refused, "position": loop.position}
    finally:
        transport.close()


@pytest.mark.slow
def test_transfer_loop_performs_a_run_in_order_and_stamps_each_action():
    sender, receiver = launch(_transfer_loop_job, 2, timeout=60)
    assert len(sender["stamps"]) == 6 and len(receiver["stamps"]) == 6
    for result in (sender, receiver):  # start <= end, each after the one before
        assert result["stamps"] == sorted(result["stamps"])
    torch.testing.assert_close(sender["got"][0], payload(GRADIENT, 0, 0), rtol=0, atol=0)
    for mb in (0, 1):
        torch.testing.assert_close(receiver["got"][2 * mb], payload(ACTIVATION, 1, mb),
                                   rtol=0, atol=0)
        assert receiver["got"][2 * mb + 1].tolist() == [mb]
    for result in (sender, receiver):  # the second action failed, and says so
        assert "stage 512" in result["refused"], result["refused"]
        assert result["position"] == 1
