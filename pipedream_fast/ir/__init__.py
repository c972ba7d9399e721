"""The schedule IR: per-rank action lists that the executor, the simulator and the validator
all walk, so all three agree on one schedule.

- `actions`: the vocabulary: `Action`, its kinds (`KIND_SPECS`), the weight-version contract
  and the text form of one action.
- `placement`: which ranks hold a stage, which stages a rank holds (`Placement`).
- `schedule`: the `Schedule` container: per-rank programs (streams or lists), bounds, and the
  JSON and text forms of a whole schedule.
- `validator`: the symbolic validator (`validate`) and the blocking rule it proves schedules
  against.
"""

from pipedream_fast.ir.actions import (KIND_SPECS, Action, ActionKind, K, KindSpec, ScheduleError,
                                       allreduce, backward, format_mb_list, forward,
                                       optimizer_step, parse_mb_list)
from pipedream_fast.ir.placement import Placement
from pipedream_fast.ir.schedule import SCHEDULE_FORMAT, ProgramStream, Schedule
from pipedream_fast.ir.validator import ValidationReport, validate

__all__ = ["KIND_SPECS", "SCHEDULE_FORMAT", "Action", "ActionKind", "K", "KindSpec", "Placement",
           "ProgramStream", "Schedule", "ScheduleError", "ValidationReport", "allreduce",
           "backward", "format_mb_list", "forward", "optimizer_step", "parse_mb_list",
           "validate"]
