"""Errors of the CommEngine's transfers reach Python with their type, in both of its ways of
moving a message: on link threads (`background=True`, what a GPU uses) and issued by the caller
(the CPU default).

A link's send and receive threads run the process-group transfers; what stops one is kept as
it was thrown (a `std::exception_ptr`) and rethrown on the caller's thread by `wait_recv`,
`send` or `flush`. So a transfer that times out in a link thread raises `_C.QueueTimeout` (a
`TimeoutError`), the very type a wait that times out on the caller's thread raises, instead
of a generic RuntimeError: callers and `launch` tell a dead or stuck peer by the type. Issued
by the caller, the same transfers fail with the same types and messages.

Two gloo ranks in this one process (two threads build the pair over a HashStore), no launch.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

from pipedream_fast import _C

TIMEOUT_S = 0.3
# Long enough for a link thread's transfer to have timed out and its error to be stored.
SETTLE_S = TIMEOUT_S + 1.5

_prefixes = itertools.count()


@pytest.fixture
def gloo_pair() -> Iterator[list[dist.ProcessGroup]]:
    """Process groups of ranks 0 and 1 of a two-rank gloo world, both in this process."""
    store = dist.PrefixStore(f"comm_errors_{next(_prefixes)}", dist.HashStore())
    groups: list[dist.ProcessGroup | None] = [None, None]
    errors: list[BaseException] = []

    def connect(rank: int) -> None:
        try:
            backend = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=30))
            group = dist.ProcessGroup(store, rank, 2)
            group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
            group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO,
                                    backend)
            groups[rank] = group
        except BaseException as err:  # reported below, on the test's thread
            errors.append(err)

    threads = [threading.Thread(target=connect, args=(rank,)) for rank in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert all(g is not None for g in groups), "gloo pair did not connect"
    yield [g for g in groups if g is not None]


BOTH = pytest.mark.parametrize("background", [True, False], ids=["link-threads", "direct"])


@BOTH
def test_a_receive_timing_out_in_the_link_thread_raises_queue_timeout(gloo_pair,
                                                                      background: bool) -> None:
    engine = _C.CommEngine(gloo_pair[1], timeout=TIMEOUT_S, background=background)
    try:
        if background:
            # A wait that times out on this thread (nothing posted, so the link thread waits
            # for requests and never times out itself): the reference type.
            with pytest.raises(_C.QueueTimeout, match="waited") as on_caller:
                engine.wait_recv(0, _C.Channel.GRADIENT, 0, 3)
            reference: type = type(on_caller.value)
        else:
            # Issued by the caller, a wait with nothing posted is a mistake, said at once.
            with pytest.raises(RuntimeError, match="no receive was posted for microbatch 3; "
                                                   "post_recv must come first"):
                engine.wait_recv(0, _C.Channel.GRADIENT, 0, 3)
            reference = _C.QueueTimeout
        # Rank 0 never sends: the receive thread's transfer times out, then wait_recv runs.
        engine.post_recv(0, _C.Channel.ACTIVATION, 1, 7)
        time.sleep(SETTLE_S)
        with pytest.raises(TimeoutError) as in_link:
            engine.wait_recv(0, _C.Channel.ACTIVATION, 1, 7)
        assert type(in_link.value) is reference is _C.QueueTimeout
        # The link thread's own message (this thread's says "waited"), naming the transfer.
        message = str(in_link.value)
        assert "timed out after 0.3 s receiving the activation of stage 1, microbatch 7 from " \
               "rank 0" in message, message
    finally:
        engine.shutdown()


@BOTH
def test_a_send_timing_out_in_the_link_thread_raises_queue_timeout(gloo_pair,
                                                                   background: bool) -> None:
    engine = _C.CommEngine(gloo_pair[0], timeout=TIMEOUT_S, background=background)
    try:
        # Rank 1 never receives: gloo's send waits for the receiver and times out.
        engine.send(1, _C.Channel.ACTIVATION, 1, 7, [torch.zeros(4)])
        time.sleep(SETTLE_S)
        with pytest.raises(_C.QueueTimeout, match="timed out after 0.3 s sending the activation "
                                                  "of stage 1, microbatch 7 to rank 1"):
            engine.flush()
        # The failed link refuses further sends with the same error, type included.
        with pytest.raises(_C.QueueTimeout, match="microbatch 7 to rank 1"):
            engine.send(1, _C.Channel.ACTIVATION, 1, 8, [torch.zeros(4)])
    finally:
        engine.shutdown()


@BOTH
def test_waiting_on_a_shut_down_engine_raises_queue_closed(gloo_pair, background: bool) -> None:
    # A short timeout: the receive thread, stuck in its transfer past the grace, ends soon.
    # Issued by the caller, the shutdown aborts the receive it waits for.
    engine = _C.CommEngine(gloo_pair[1], timeout=2.0, background=background)
    engine.post_recv(0, _C.Channel.ACTIVATION, 1, 0)
    waiter_error: list[BaseException] = []

    def wait() -> None:
        try:
            engine.wait_recv(0, _C.Channel.ACTIVATION, 1, 0)
        except BaseException as err:
            waiter_error.append(err)

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.2)  # the waiter is (most likely) blocked in wait_recv; either way it must fail
    engine.shutdown(grace=0.1)
    waiter.join(timeout=30)
    assert not waiter.is_alive()
    assert len(waiter_error) == 1 and isinstance(waiter_error[0], _C.QueueClosed), waiter_error
