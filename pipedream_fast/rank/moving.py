"""Moving stages between ranks in a running pipeline: `Pipeline.move(plan)`, and `adapt`,
which re-plans from the ranks' measured speed and moves when it pays off.

The move protocol (every rank runs it, between two runs of the schedule, where the pipeline
is drained: no microbatch in flight, no stashed weight version needed, every update applied):

1. **Who decides.** `move(plan)`: the caller, on every rank. `adapt`: every `adapt_every`
   steps rank 0 gathers the ranks' calibration snapshots (`runtime/calibration.py`),
   re-plans with the measured speeds (`planner/replan.py`: the heterogeneous DP, a move only
   when the predicted gain is over `adapt_threshold` and pays back the last move's time
   within `adapt_payback` steps) and broadcasts its decision; the others follow it.
2. **What is drained.** Nothing more than at any run boundary: a synchronous schedule's run
   ends at a flush, an asynchronous one's finishes its in-flight microbatches (the same
   drain as a `break` between two `train` calls), so the weights on each stage are the
   weights every later microbatch will read.
3. **What travels.** Each stage's first rank gathers its stage's state by the whole model's
   keys: weights and buffers, each parameter's optimizer state, the hyperparameters of its
   optimizer's groups, its scheduler's state, its staleness correction's velocity. The ranks
   exchange those over the control group (one `all_gather_object`); each rank keeps what its
   stages under the new plan hold.
4. **Rebuild.** Each rank drops its stage runtimes, optimizers, schedulers and links, cuts
   its new stages out of the model (`Stages.setup`: collective, new links and tied-weight
   groups), and copies the gathered state in: a parameter's optimizer state follows the
   parameter, a new stage takes its groups' hyperparameters, scheduler and step count from
   the old stage that held its first block. Blocks a rank no longer holds go back to the meta
   device where the model was built there (a model factory), freeing their memory.
5. The calibration starts over (its figures were per stage), and training goes on.

Failure: every exchange is a collective with the Pipeline's timeout, so a rank that dies or
hangs mid-move fails every other rank with an error naming the move; no checkpoint file is
touched by a move, so the last one saved stays intact. A rank that failed mid-move holds a
half-built pipeline, so the Pipeline refuses to train again (`load` the last checkpoint).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import torch

from pipedream_fast.formats import FormatError, Plan, Profile
from pipedream_fast.options import ADAPTABLE
from pipedream_fast.rank.checkpoints import Checkpoints, layout
from pipedream_fast.rank.cutting import Stages, tensors_of
from pipedream_fast.rank.keyed_state import put_state, stage_state
from pipedream_fast.rank.data import Progress
from pipedream_fast.rank.run_loop import RunLoop
from pipedream_fast.rank.state import RankContext

# A move's time, before one was measured: what the payback test charges the first move
# (a model of megabytes moves in well under this on one machine).
FIRST_MOVE_SECONDS = 1.0


class Moving:
    """Moving this rank's stages to a new plan (see the module's docstring).

    Owns: `moves` (every move made, its record), `adapt_checks` (every re-planning check),
    `broken` (why this rank cannot go on, should a move fail half-way), and rank 0's
    decision state: the plan before the last adaptive move and the step time then
    (`_tried`, checked at the next check), the plans that made steps slower (`_refused`),
    the profile scaled to the first check's measurements (`_baseline`), and the chunks and
    microbatch size of the adaptive run (`_adapt_chunks`, `_microbatch_samples`).
    """

    def __init__(self, ctx: RankContext, stages: Stages, progress: Progress,
                 checkpoints: Checkpoints, run_loop: RunLoop) -> None:
        self.ctx = ctx
        self.stages = stages
        self.progress = progress
        self.checkpoints = checkpoints
        self.run_loop = run_loop
        self.moves: list[dict[str, Any]] = []
        self.adapt_checks: list[dict[str, Any]] = []
        self.broken: str | None = None
        self._tried: tuple[Plan, float] | None = None
        self._refused: set[str] = set()
        self._baseline: Profile | None = None
        self._adapt_chunks = 1
        self._microbatch_samples = 1

    # --- the move ------------------------------------------------------------------------------
    def move(self, plan: Plan, reason: str) -> dict[str, Any]:
        """Moves this rank's stages to `plan` (see the module's docstring). Collective."""
        self.stages.require_setup("move()")
        assert self.stages.plan is not None
        self._check_movable(plan)
        old = self.stages.plan
        began = time.perf_counter()
        mine = [stage_state(self.stages, self.checkpoints, index)
                for index in self.stages.stage_indices
                if old.stages[index].ranks[0] == self.ctx.rank]
        self.broken = (f"a move of the stages from {layout(old)} to {layout(plan)} "
                        f"failed half-way on rank {self.ctx.rank}")  # until the move is done
        gathered: list[Any] = []
        self.ctx.agree(lambda: gathered.extend(self.ctx.control.all_gather_object(mine)),
                    "moving the stages to the new plan")
        states = [state for part in gathered for state in part]
        moved_bytes = self._moved_bytes(states, old, plan)
        self.stages.release(plan)
        self.stages.setup(plan)  # collective: new stages, optimizers, links and tied-weight groups
        put_state(self.stages, self.checkpoints, states, "the stages moved here")
        self.run_loop.calibration.reset()
        self.broken = None
        ended = time.perf_counter()
        record = {"step": self.progress.step, "seconds": ended - began, "started": began,
                  "ended": ended, "from": layout(old), "to": layout(plan),
                  "reason": reason, "bytes": moved_bytes}
        self.moves.append(record)
        return record

    def _moved_bytes(self, states: list[dict[str, Any]], old: Plan, new: Plan) -> int:
        """The bytes of weights and optimizer state a rank gains: each block's, once for every
        rank that holds it under `new` and not under `old` (every rank receives all of the
        gathered state; this is what a point-to-point move would send)."""
        assert self.stages.chain is not None
        block_of = {key: b for b, block in enumerate(self.stages.chain.blocks)
                    for t in tensors_of(block.module) for key in self.stages.names.get(id(t), ())}
        size = [0] * len(self.stages.chain.blocks)
        for state in states:
            tensors = [*state["weights"].items(),
                       *((k, v) for k, s in state["optimizer"].items() for v in s.values())]
            seen: set[int] = set()
            for key, t in tensors:
                if isinstance(t, torch.Tensor) and key in block_of and id(t) not in seen:
                    seen.add(id(t))  # tied keys name one tensor
                    size[block_of[key]] += t.numel() * t.element_size()

        def holders(plan: Plan, block: int) -> set[int]:
            return {r for s in plan.stages if s.start <= block < s.stop for r in s.ranks}

        return sum(size[b] * len(holders(new, b) - holders(old, b)) for b in range(len(size)))

    def _check_movable(self, plan: Plan) -> None:
        assert self.stages.plan is not None
        if not isinstance(plan, Plan):
            raise TypeError(f"move() takes a Plan, got {type(plan).__name__}")
        if self.ctx.schedule_name not in ADAPTABLE:
            raise ValueError(f"moving stages needs a pipeline of {', '.join(ADAPTABLE)}; "
                             f"{self.ctx.schedule_name!r} cannot be re-planned")
        if plan.workers != self.ctx.world_size:
            raise FormatError(f"the new plan is for {plan.workers} workers but this job has "
                              f"{self.ctx.world_size} ranks")
        if plan.stages[0].ranks != self.stages.plan.stages[0].ranks:
            raise ValueError(f"the new plan puts the first stage on ranks "
                             f"{list(plan.stages[0].ranks)}, but ranks "
                             f"{list(self.stages.plan.stages[0].ranks)} read the loader: a move keeps "
                             f"the first stage's ranks")

    # --- adapt ---------------------------------------------------------------------------------
    def after_run(self, steps: int, seconds: float, chunks: int) -> None:
        """After a run of `steps` minibatches whose steps after the first took `seconds`
        (the caller's loop included): with `adapt`, every `adapt_every` steps, the
        re-planning check (a run of one step has no steady step to time: no check)."""
        every = self.ctx.options.adapt_every
        if not self.ctx.options.adapt or steps < 2 or self.progress.step % every:
            return
        if self.ctx.schedule_name not in ADAPTABLE:  # schedule='auto' chose one that cannot move
            if not self.adapt_checks:
                self.adapt_checks.append({"step": self.progress.step, "moved": False, "speeds": None,
                                          "reason": f"{self.ctx.schedule_name!r} cannot be "
                                                    f"re-planned", "step_seconds": None})
            return
        self._adapt_chunks = chunks
        # The microbatches' mean size, to the nearest sample (a batch of 10 in 4 splits
        # 3, 3, 2, 2: the calibration's per-microbatch times are means over those).
        self._microbatch_samples = max(1, round(self.progress.agreed_batch / chunks))
        self._adapt_check(seconds / (steps - 1))

    def _adapt_check(self, step_seconds: float) -> None:
        """Every rank, every `adapt_every` steps of an adaptive run: rank 0 decides from the
        ranks' measured speed whether to move (see the module's docstring); all follow."""
        assert self.stages.plan is not None
        snapshot = self.run_loop.calibration.snapshot()
        gathered: list[Any] = [None]
        self.ctx.agree(lambda: gathered.__setitem__(0, self.ctx.control.gather_object(snapshot,
                                                                                dst=0)),
                    "gathering the measured speeds")
        payload: dict[str, Any] = {}
        if self.ctx.rank == 0:
            payload = self._decide({s.rank: s for s in gathered[0]}, step_seconds)
        decided: list[Any] = [payload]
        self.ctx.agree(lambda: decided.__setitem__(0, self.ctx.control.broadcast_object(decided[0],
                                                                                  src=0)),
                    "agreeing on the re-plan")
        payload = decided[0]
        new = payload.get("plan")
        self.adapt_checks.append({"step": self.progress.step, "reason": payload["reason"],
                                  "speeds": payload.get("speeds"), "moved": new is not None,
                                  "step_seconds": step_seconds})
        self.run_loop.calibration.reset()  # the next check measures the next adapt_every steps only
        if new is None:
            return
        record = self.move(Plan.from_dict(new), payload["reason"])
        if self.ctx.rank == 0:
            print(f"pipedream_fast: step {self.progress.step}: moved the stages from {record['from']} "
                  f"to {record['to']} in {record['seconds']:.2f} s ({payload['reason']})",
                  flush=True)


    def _decide(self, snapshots: Mapping[int, Any], step_seconds: float) -> dict[str, Any]:
        """Rank 0's decision at an adapt check, as the payload every rank follows.

        The first check with measurements of every stage takes them as the baseline: the
        profile's per-block costs scaled, stage by stage, to what they measured
        (`calibrated_profile`), so every rank runs at 1.0x against it. The profile alone
        leaves out what an action costs whatever its blocks (autograd, the executor: most of a
        small model's time) and may be of another batch size, which would read as speed. Later
        checks measure each rank's speed against the baseline: `adapt` follows the machine's
        changes during the run (a rank slow from the start is the planner's `@speeds=`).

        A move the measurements called for may still not pay. So the check after a move
        compares the step time with the one before it; a move that made steps slower by more
        than `adapt_threshold` is undone, and its plan is not tried again."""
        from pipedream_fast.planner.replan import calibrated_profile, replan

        assert self.stages.plan is not None
        threshold = self.ctx.options.adapt_threshold
        tried, self._tried = self._tried, None
        if tried is not None:
            previous, before = tried
            if step_seconds > before * (1 + threshold):
                self._refused.add(str(layout(self.stages.plan)))
                return {"plan": previous.to_dict(), "speeds": None,
                        "reason": f"the move to {layout(self.stages.plan)} made steps "
                                  f"{step_seconds / before - 1:.0%} slower ({before * 1e3:.1f} "
                                  f"-> {step_seconds * 1e3:.1f} ms): moving back, and not "
                                  f"trying that plan again"}
        if self.stages.profile is None:
            return {"reason": "no profile to re-plan from", "speeds": None}
        if self._baseline is None:
            found = calibrated_profile(self.stages.profile, self.stages.plan, snapshots,
                                       self._microbatch_samples)
            if isinstance(found, str):
                return {"reason": f"staying: {found}", "speeds": None}
            self._baseline = found
            return {"reason": "staying: this check's measurements are the baseline (each "
                              "block's cost as it runs here; every rank at 1.0x)",
                    "speeds": [1.0] * self.ctx.world_size}
        try:
            decision = replan(self._baseline, self.stages.plan, snapshots,
                              microbatch_size=self._microbatch_samples,
                              chunks=self._adapt_chunks, step_seconds=step_seconds,
                              move_seconds=self.moves[-1]["seconds"] if self.moves
                              else FIRST_MOVE_SECONDS,
                              threshold=threshold, payback_steps=self.ctx.options.adapt_payback)
        except Exception as err:  # noqa: BLE001 - every rank must hear of it
            return {"reason": f"re-planning failed: {type(err).__name__}: {err}",
                    "speeds": None}
        payload = decision.to_dict()
        if decision.plan is not None:
            if str(layout(decision.plan)) in self._refused:
                payload["plan"] = None
                payload["reason"] = (f"staying: the best plan at the measured speeds, "
                                     f"{layout(decision.plan)}, made steps slower when "
                                     f"tried")
            else:
                self._tried = (self.stages.plan, step_seconds)
        return payload
