"""A rank's run loop (`RunLoop`): the executor over this rank's actions of a schedule, each
step's loss as the rank finishes it (agreed across replicas), a NaN or an agreed stop ending
the run at the same step on every rank, and leaving a run early (`_abandon`). Forward-only
runs (evaluate, predict) use the same executor.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any
from collections.abc import Callable, Generator, Iterable, Iterator

import torch

from torch.utils import _pytree as pytree

from pipedream_fast import user_errors
from pipedream_fast.checkpoint import progress as stop_progress
from pipedream_fast.data_feed import KeptInputs
from pipedream_fast.launch import Stopped, signal_name
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.calibration import Calibration
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.hang_watch import HangWatch
from pipedream_fast.runtime.stage import (StageRuntime)
from pipedream_fast.stopping import DeferredStop, StopVote
from pipedream_fast.trace import MemorySample
from pipedream_fast.training import (MicrobatchFeed, StepTracker, build_schedule, check_backend,
                                     data_source, feed_uses)
from pipedream_fast.rank.checkpoints import Checkpoints
from pipedream_fast.rank.cutting import Stages
from pipedream_fast.rank.data import Progress
from pipedream_fast.rank.state import RankContext
from pipedream_fast.rank.state import NonFiniteLoss, _StopAgreed


def step_mean(losses: dict[int, torch.Tensor]) -> torch.Tensor:
    """A step's loss from its microbatches' (each weighed already): their mean. On the CPU
    from their values, summed in double: a stack and a mean are two operator calls, tens of
    microseconds at the end of every step, where the first stage's next forward waits for
    them (`bench/results/hot_path.md`, section 9). Elsewhere on their device, where reading
    a value would wait for the device."""
    first = next(iter(losses.values()))
    if first.device.type == "cpu":
        return first.new_tensor(math.fsum(map(float, losses.values())) / len(losses))
    return torch.stack(list(losses.values())).mean()


class RunLoop:
    """Runs of the schedule on this rank (see the module's docstring).

    Owns: `calibration` (the rank's running estimate of its costs, fed by every training
    run's executor), `hang_watch` (reports the rank's action in progress when it makes no
    progress for `hang_report` seconds), `trace` (whether runs record their actions),
    `executor` (the last run's until `close`: what a stuck rank was doing), `last_stats`
    and `last_events` (the last run's statistics and, with `trace`, the first run of the
    last train() call's events), `last_input_bytes` (with `trace`, that run's microbatches'
    input bytes, on a rank that feeds them), and `stop_request` (the driving thread's
    signal, under rank threads). Between the runs of a train() call it saves periodic
    checkpoints and calls `after_run` (the Pipeline hands `Moving.after_run` in: adapt's
    checks).
    """

    def __init__(self, ctx: RankContext, stages: Stages, progress: Progress,
                 checkpoints: Checkpoints, trace: bool) -> None:
        self.ctx = ctx
        self.stages = stages
        self.progress = progress
        self.checkpoints = checkpoints
        self.trace = trace
        self.calibration = Calibration(ctx.rank)
        self.executor: Executor | None = None
        self.last_stats: dict[str, Any] = {}
        self.last_events: list[Any] = []
        self.last_memory: list[MemorySample] = []  # measure_memory: the same run's samples
        self.last_input_bytes: dict[int, int] = {}
        self._feed: MicrobatchFeed | None = None  # the run's, on a rank that reads data
        self.stop_request: DeferredStop | None = None
        self.after_run: Callable[[int, float, int], None] = _no_check
        self._first_run = True  # the next run is the first of its train() call
        self._first_step_done = 0.0  # when the run's first step was yielded (perf_counter)
        self.hang_watch: HangWatch | None = None
        if ctx.options.hang_report_s > 0:
            # The watch sees the loop through a weak reference, and stops when it goes.
            this = weakref.ref(self)
            self.hang_watch = HangWatch(ctx.rank, ctx.options.hang_report_s,
                                        lambda: getattr(this(), "executor", None))
            weakref.finalize(self, self.hang_watch.stop)

    def train(self, loader: Iterable[Any] | None, steps: int | None,
              epochs: int | None) -> Iterator[torch.Tensor | None]:
        """`Pipeline.train` on this rank (see there)."""
        self._first_run = True  # its trace is the call's `last_events`
        self.calibration.begin_train()  # what the call costs outside its runs, from here
        steps, chunks, spec, batches = self.progress.open(loader, steps, epochs)
        assert self.stages.plan is not None
        done = 0
        try:
            with (DeferredStop() if self.stop_request is None
                  else contextlib.nullcontext(self.stop_request)) as request:
                every_save = self.ctx.options.checkpoint_every
                while done < steps:
                    run = steps - done
                    if every_save:
                        run = min(run, every_save - self.progress.step % every_save)
                    if self.ctx.options.adapt:  # runs end where the re-planning checks are
                        every = self.ctx.options.adapt_every
                        run = min(run, every - self.progress.step % every)
                    vote = StopVote(self.ctx.control, self.ctx.world_size, len(self.stages.plan.stages) + 1,
                                    self.ctx.agree)
                    trained = yield from self._run(run, chunks, spec, batches, request, vote)
                    done += trained
                    if vote.signum:
                        self._stop(vote.signum)
                    if every_save and self.progress.step % every_save == 0:
                        self.checkpoints.save_periodic()
                    # the steady steps: after the first, which pays the run's start
                    self.after_run(trained, time.perf_counter() - self._first_step_done,
                                    chunks)
            self.calibration.end_train()
        finally:
            self.progress.end_reading(loader)  # where the next run (or a checkpoint) goes on

    def _stop(self, signum: int) -> None:
        """Every rank agreed to stop here on `signum`: save if configured, raise `Stopped`."""
        detail = f" after step {self.progress.step}"
        folder = self.ctx.options.checkpoint_dir
        if folder is not None:
            self.checkpoints.save_periodic()
            detail += f"; checkpoint saved to {Path(folder) / f'step-{self.progress.step}'}"
        if self.ctx.rank == 0:
            print(f"pipedream_fast: {signal_name(signum)}: every rank stopped{detail}",
                  flush=True)
        raise Stopped(signum, detail, step=self.progress.step)

    def _run(self, steps: int, chunks: int, spec: pytree.TreeSpec,
             batches: Iterator[Any] | None, request: DeferredStop | None = None,
             vote: StopVote | None = None) -> Generator[torch.Tensor | None, None, int]:
        """One executor run of `steps` minibatches (a drained pipeline at both ends). Returns
        the steps trained: fewer when the ranks agreed to stop (`vote.signum` then set)."""
        assert self.stages.plan is not None
        transport = self.stages.training_transport()  # new links after an abandoned run
        schedule = build_schedule(self.stages.plan, self.ctx.schedule_name, steps, chunks,
                                  self.ctx.options.schedule_options)
        check_backend(schedule, self.ctx.world.backend)
        runtimes = self.stages.runtimes_for(schedule)
        inputs, kept, self._feed = None, None, None
        if batches is not None:
            self._feed = feed = MicrobatchFeed(batches, chunks, feed_uses(schedule, [self.ctx.rank]),
                                               counts=True,  # each microbatch's loss weighs by its samples
                                               record_sizes=self.trace and self._first_run)
            inputs = data_source(feed, schedule, self.ctx.rank, self.stages.flatten, self.ctx.device)
            if inputs is not None and self.ctx.options.on_nan == "stop":
                kept = KeptInputs(chunks)  # to tell a NaN in the data from a diverging run
                inputs = kept.wrap(inputs)
            if inputs is not None:  # its time is the feed's, not the first forward's
                inputs = self.calibration.timed_feed(inputs)
        if self.trace and self._first_run and self.stages.meter is not None:
            self.stages.meter.start_samples()  # the memory held over the traced run
        # A replicated stage's loss agreement is timed action by action (`_losses`): its
        # plans keep every action in Python.
        transfer_runs = (self.ctx.tuning.transfer_runs
                         and all(len(s.ranks) == 1 for s in self.stages.plan.stages))
        executor = Executor(schedule, self.ctx.rank, runtimes, transport, inputs,
                            target_spec=spec, trace=self.trace, update_sync=self.stages.sync,
                            calibration=self.calibration, sample_counts=True,
                            transfer_runs=transfer_runs)
        self.executor = executor
        if self.hang_watch is not None:
            self.hang_watch.start()
        tracker = StepTracker(schedule, self.ctx.rank, chunks)
        # Every backward starts from its loss / chunks (under fp16 times the scale, as
        # GradScaler): the update's average over its microbatches is then one scalar at each
        # root instead of a pass over every gradient (`StageRuntime.prepare_update`).
        scale = self.stages.scaler.scale if self.stages.scaler is not None else 1.0
        for runtime in runtimes.values():
            runtime.begin_run()
            runtime.loss_scale = scale / chunks
        yielded = 0
        try:
            for item in self._losses(executor, tracker, steps, chunks, request, vote, kept):
                yielded += 1  # before the yield: a caller leaving there has had this step
                if yielded == 1:
                    self._first_step_done = time.perf_counter()
                yield item
        except _StopAgreed:  # every rank leaves after the same step, as on a break
            self._abandon(executor, yielded, chunks, GeneratorExit, vote)
            return yielded
        except BaseException as err:  # left early (GeneratorExit) or failed: clean up
            if isinstance(err, Exception) and executor.current is not None:
                mb = executor.current[1].microbatch  # the step the failed action was in
                if mb is not None and mb >= 0:
                    user_errors.note_step(err, self.progress.step + mb // chunks + 1)
            self._abandon(executor, yielded, chunks, type(err), vote)
            if isinstance(err, NonFiniteLoss):
                self._blame_data(err, kept)
            raise
        return steps

    def _losses(self, executor: Executor, tracker: StepTracker, steps: int, chunks: int,
                request: DeferredStop | None = None, vote: StopVote | None = None,
                kept: KeptInputs | None = None) -> Iterator[torch.Tensor | None]:
        """Each step's loss as the rank finishes the step: the mean of its microbatches'
        losses, each already weighed by its share of the step's samples (`sample_weight`), so
        the mean over the step's samples, as the plain loop's on the whole batch; microbatches
        of equal size weigh 1 and the mean is the plain one. A non-finite loss (on_nan
        'stop') ends the run at the end of its step, where every rank learns of it (the loss
        travels back with the gradients), so all stop at the same step; its update is not
        applied (see `_abandon`). After each step the rank votes on stopping (`vote`), and
        leaves the run once the votes of an earlier step say so (`_StopAgreed`).

        With a replicated stage a rank sees only its share of a step's losses: the ranks sum
        those their last stage computed in one small all-reduce on the control group. A rank
        joins it once it has done all of the step, before its next compute of a later step or
        update with the step's gradients (any earlier could hold back a message or update a
        peer needs to finish the step; any later, and it would leave the run having started
        the next step), so every rank stops at the same step, before its update."""
        assert self.stages.plan is not None
        shared = any(len(s.ranks) > 1 for s in self.stages.plan.stages)
        last = len(self.stages.plan.stages) - 1
        losses: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)  # step -> mb -> loss
        bad: dict[int, str] = {}  # step -> what was non-finite
        finished: list[int] = []  # shared: steps done on this rank, their loss not yet agreed

        def due(step: int) -> bool:
            """Whether the rank's next action must wait for `step`'s loss (see above)."""
            upcoming = next(executor._program.ahead(), None)  # the next action, not taken
            if upcoming is None:
                return True
            if upcoming.kind.is_compute:
                assert upcoming.microbatch is not None
                return upcoming.microbatch // chunks > step
            return any(mb // chunks >= step for mb in upcoming.microbatches)

        def agreed(step: int) -> torch.Tensor | None:
            """The step's loss over every rank's share (the sum of its microbatches' weighed
            losses, and how many)."""
            got = losses.pop(step, {})
            total = torch.tensor([sum(float(x) for x in got.values()), len(got)],
                                 dtype=torch.float64)
            self.ctx.agree(lambda: self.ctx.control.all_reduce(total),
                        f"agreeing on the loss of step {self.progress.step + step + 1}")
            mean = (total[0] / total[1]).float() if total[1] else None
            if self.ctx.options.on_nan == "stop" and mean is not None and not mean.isfinite():
                bad.setdefault(step, f"the loss of step {self.progress.step + step + 1} is "
                                     f"{float(mean)} (seen on another replica)")
            return mean

        def finish(step: int, mean: torch.Tensor | None) -> Iterator[torch.Tensor | None]:
            """Yields the step's loss, or ends the run there (non-finite loss, agreed stop)."""
            if step in bad:
                for runtime in executor.stages.values():  # replicas all stop here: let the
                    if runtime.buckets is not None:  # reductions begun in the backward land
                        runtime.buckets.wait()  # before the run's gradients are cleared
                raise NonFiniteLoss(f"{bad[step]}; training stopped after step "
                                    f"{self.progress.step + step} (on_nan='stop'). Lower the "
                                    f"learning rate, or pass on_nan='skip'", step)
            if vote is not None:
                vote.cast(step, request.signum if request is not None else None)
            if request is not None and request.signum is not None:
                stop_progress.note_stopping(self.progress.step + step + 1)  # launcher waits
            yield mean
            if kept is not None:
                kept.forget_through(step)
            if vote is not None and step + 1 < steps and vote.outcome(step):
                raise _StopAgreed

        for _, action, loss in executor.run():
            if loss is not None:
                assert action.microbatch is not None
                step = action.microbatch // chunks
                # a float: torch.isfinite makes a tensor per loss (a few us each)
                if (self.ctx.options.on_nan == "stop" and not math.isfinite(float(loss))
                        and step not in bad):
                    bad[step] = (f"the loss of step {self.progress.step + step + 1} is "
                                 f"{float(loss)} (microbatch {action.microbatch}, seen on rank "
                                 f"{self.ctx.rank} at {action.to_text()})")
                if not shared or action.stage == last:  # shared: each loss counted once
                    losses[step][action.microbatch] = loss
            done = tracker.done(action, steps)
            if done:  # its last sends go out before the step's bookkeeping and the caller's
                executor.send_ahead((done[-1] + 1) * chunks)
            for step in done:
                if shared:
                    finished.append(step)
                else:
                    got = losses.pop(step, {})
                    yield from finish(step, step_mean(got) if got else None)
            while finished and due(finished[0]):
                step = finished.pop(0)
                yield from finish(step, agreed(step))
        if vote is not None:
            vote.settle()  # a stop agreed on in the last steps ends the run here, drained
        self.progress.advance(steps)
        self.last_stats = executor.stats.to_dict()
        if self._first_run:  # a call's later runs (after a checkpoint, an adapt check)
            self.last_events = executor.events or []  # number their microbatches from 0 again
            self.last_input_bytes = dict(self._feed.input_bytes or {}) if self._feed else {}
            meter = self.stages.meter
            if meter is not None and meter.samples is not None:
                self.last_memory = [MemorySample(self.ctx.rank, t, held)
                                    for t, held in meter.take_samples()]
            self._first_run = False

    def _blame_data(self, err: NonFiniteLoss, kept: KeptInputs | None) -> None:
        """Says in `err` whether the data of its step held NaN or infinite values: then the
        data made the loss, not the learning rate. Every rank stopped at that step and
        drained its run (so no peer waits for a message); the counts the first stage's
        readers fed are summed over the ranks (collective), so that every rank says the same,
        and rank 0 says it under the launchers."""
        number = self.progress.step  # the run advanced to the step before the bad one
        counts = torch.tensor(kept.nonfinite(err.run_step) if kept is not None else [0] * 4,
                              dtype=torch.float64)
        with contextlib.suppress(Exception):  # a peer is gone: its error says more
            self.ctx.agree(lambda: self.ctx.control.all_reduce(counts),
                           f"checking the data of step {number + 1}")
        bad_inputs, all_inputs, bad_targets, all_targets = (int(c) for c in counts)
        if bad_inputs or bad_targets:
            held = " and ".join(f"{bad} of the {part}' {every} values" for bad, part, every in (
                (bad_inputs, "inputs", all_inputs), (bad_targets, "targets", all_targets)) if bad)
            what = str(err).split("; training stopped")[0]
            err.args = (f"{what}: the batch of step {number + 1} holds NaN or infinite values "
                        f"({held}), so the data made it, not the learning rate; training "
                        f"stopped after step {number} (on_nan='stop'). Clean the data "
                        f"(torch.nan_to_num, or drop such samples), or pass on_nan='skip' to "
                        f"skip such steps",)
        user_errors.note_step(err, number + 1)
        user_errors.note_said_by(err, 0)

    def _abandon(self, executor: Executor, yielded: int, chunks: int,
                 error: type[BaseException], vote: StopVote | None = None) -> None:
        """The caller left `train()` early (break, exception, close) or the run failed.
        A run left by the caller first finishes what follows the steps already yielded
        (their sends and updates, which peers finishing those steps wait for) and starts
        nothing more. Then the microbatches in flight are discarded, and the transport, whose
        links may hold messages that will never be received, is replaced at the next run
        (collectively): every rank must leave at the same step, as an SPMD script does. A
        synchronous schedule continues exactly; an asynchronous one keeps the updates made,
        and forgets the gradients of microbatches in flight."""
        if error in (GeneratorExit, NonFiniteLoss):
            # A non-finite loss stops the run at the end of its step (not yielded): that step
            # is finished for the peers, but not applied.
            finished = yielded + (error is NonFiniteLoss)
            try:
                executor.drain(finished * chunks, apply_below=yielded * chunks)
                if vote is not None:  # every rank cast the same votes: read them all
                    vote.settle()
            except Exception:  # noqa: BLE001 - a peer is gone: nothing more to finish
                pass
        self.progress.advance(yielded)
        self.stages.abandon_run()
        self.last_stats = executor.stats.to_dict()

    def forward_only(self, schedule: Schedule, inputs: Any, spec: pytree.TreeSpec,
                      sink: Callable[[int, Any, Any], None], key: tuple[Any, ...]) -> None:
        assert self.stages.plan is not None
        runtimes = {i: StageRuntime.for_inference(i, m, i == 0, i == len(self.stages.plan.stages) - 1,
                                                  self.ctx.precision)
                    for i, m in self.stages.modules.items()}
        executor = Executor(schedule, self.ctx.rank, runtimes, self.stages.inference_transport(key),
                            inputs, target_spec=spec, outputs=sink,
                            transfer_runs=self.ctx.tuning.transfer_runs)
        self.executor = executor
        if self.hang_watch is not None:
            self.hang_watch.start()
        for _ in executor.run():
            pass

    def close(self) -> None:
        """Stops the hang watch and lets go of the last executor (with it, its transport) and
        of `after_run` (the Pipeline is closing). `after_run` is bound to the Pipeline's
        `Moving`, which holds this loop: kept, that cycle held the executor's transport, and
        its process groups' sockets, until the garbage collector ran."""
        if self.hang_watch is not None:
            self.hang_watch.stop()
        self.executor = None
        self.after_run = _no_check


def _no_check(steps: int, seconds: float, chunks: int) -> None:
    """`RunLoop.after_run` when no Pipeline hands one in."""
