"""The real interpreter of the schedule IR: one `Executor` per rank walks its action list.

    Schedule IR (rank r's actions) ──▶ Executor ──▶ StageRuntime (module, weight ring, optimizer)
                                          │
                                          └──▶ Transport (C++ CommEngine across processes,
                                                           activation queues across threads)

Nothing but the action list decides the order: adding a schedule never touches this package.
"""

from pipedream_fast.runtime.executor import Executor, ExecutorStats, RuntimeFailure
from pipedream_fast.runtime.stage import StageRuntime
from pipedream_fast.runtime.transport import ProcessTransport, ThreadTransport, Transport

__all__ = ["Executor", "ExecutorStats", "ProcessTransport", "RuntimeFailure", "StageRuntime",
           "ThreadTransport", "Transport"]
