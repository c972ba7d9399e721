"""A rank's run loop: the executor over this rank's actions of a schedule, each step's loss
as the rank finishes it (agreed across replicas), a NaN or an agreed stop ending the run
at the same step on every rank, and leaving a run early (`_abandon`). Forward-only runs
(evaluate, predict) use the same executor.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from pathlib import Path
from typing import Any
from collections.abc import Callable, Generator, Iterable, Iterator

import torch

from torch.utils import _pytree as pytree

from pipedream_fast.launch import Stopped, signal_name
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.calibration import Calibration
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.stage import (StageRuntime)
from pipedream_fast.runtime.transport import Transport
from pipedream_fast.stopping import DeferredStop, StopVote
from pipedream_fast.training import (MicrobatchFeed, StepTracker, build_schedule, check_backend,
                                     data_source, feed_uses)
from pipedream_fast.rank.data import DataAgreement
from pipedream_fast.rank.state import NonFiniteLoss, _StopAgreed


class RunLoop(DataAgreement):
    """Runs of the schedule on this rank (see the module's docstring)."""

    calibration: Calibration  # made by Pipeline: the rank's running estimate of its costs
    _first_run: bool = True  # the next run is the first of its train() call
    _first_step_done: float = 0.0  # when the run's first step was yielded (perf_counter)

    def _train_rank(self, loader: Iterable[Any] | None, steps: int | None,
                    epochs: int | None) -> Iterator[torch.Tensor | None]:
        """`Pipeline.train` on this rank (see there)."""
        if self._broken is not None:
            raise RuntimeError(f"this Pipeline cannot train any more: {self._broken}; load the "
                               f"last checkpoint (Pipeline.load) to go on")
        self._first_run = True  # its trace is the call's `last_events`
        self.calibration.begin_train()  # what the call costs outside its runs, from here
        steps, chunks, spec, batches = self._open_data(loader, steps, epochs)
        assert self.plan is not None
        done = 0
        try:
            with (DeferredStop() if self._stop_request is None
                  else contextlib.nullcontext(self._stop_request)) as request:
                while done < steps:
                    run = steps - done
                    if self.checkpoint_every:
                        run = min(run, self.checkpoint_every - self._step % self.checkpoint_every)
                    if self.options.adapt:  # runs end where the re-planning checks are
                        every = self.options.adapt_every
                        run = min(run, every - self._step % every)
                    vote = StopVote(self._control, self.world_size, len(self.plan.stages) + 1,
                                    self._agree)
                    trained = yield from self._run(run, chunks, spec, batches, request, vote)
                    done += trained
                    if vote.signum:
                        self._stop(vote.signum)
                    if self.checkpoint_every and self._step % self.checkpoint_every == 0:
                        self._save_periodic()
                    # the steady steps: after the first, which pays the run's start
                    self._after_run(trained, time.perf_counter() - self._first_step_done,
                                    chunks)
            self.calibration.end_train()
        finally:
            if self._reading is not None:  # where the next run (or a checkpoint) goes on
                (source, began), self._reading = self._reading, None
                consumed = self._step - began  # the steps trained, not the batches read ahead
                self._epoch, self._epoch_batches = source.position(consumed)
                self._last_loader = loader
                self._live = source if source.read == consumed and self._epoch_batches else None

    def _after_run(self, steps: int, seconds: float, chunks: int) -> None:
        """Called between the runs of a `train` call, every rank at the same step, with the
        pipeline drained (`Moving` re-plans there); `seconds`: from the end of the run's first
        step (the caller's loop included) to the end of its last."""

    def _stop(self, signum: int) -> None:
        """Every rank agreed to stop here on `signum`: save if configured, raise `Stopped`."""
        detail = f" after step {self._step}"
        if self.checkpoint_dir is not None:
            self._save_periodic()
            detail += f"; checkpoint saved to {Path(self.checkpoint_dir) / f'step-{self._step}'}"
        if self.rank == 0:
            print(f"pipedream_fast: {signal_name(signum)}: every rank stopped{detail}",
                  flush=True)
        raise Stopped(signum, detail, step=self._step)

    def _run(self, steps: int, chunks: int, spec: pytree.TreeSpec,
             batches: Iterator[Any] | None, request: DeferredStop | None = None,
             vote: StopVote | None = None) -> Generator[torch.Tensor | None, None, int]:
        """One executor run of `steps` minibatches (a drained pipeline at both ends). Returns
        the steps trained: fewer when the ranks agreed to stop (`vote.signum` then set)."""
        assert self.plan is not None
        if self._transport is None:  # the last run was abandoned: new links (collective)
            self._transport = self._new_transport()
        schedule = build_schedule(self.plan, self.schedule_name, steps, chunks,
                                  self.options.schedule_options)
        check_backend(schedule, self._world.backend)
        runtimes = self._runtimes_for(schedule)
        inputs = None
        if batches is not None:
            feed = MicrobatchFeed(batches, chunks, feed_uses(schedule, [self.rank]))
            inputs = data_source(feed, schedule, self.rank, self._flatten, self.device)
            if inputs is not None:  # its time is the feed's, not the first forward's
                inputs = self.calibration.timed_feed(inputs)
        executor = Executor(schedule, self.rank, runtimes, self._transport, inputs,
                            target_spec=spec, trace=self._trace, update_sync=self._sync,
                            calibration=self.calibration)
        self._executor = executor
        tracker = StepTracker(schedule, self.rank, chunks)
        for runtime in runtimes.values():
            runtime.begin_run()
            if self._scaler is not None:  # a microbatch's loss / chunks, scaled, as GradScaler
                runtime.loss_scale = self._scaler.scale / chunks
        yielded = 0
        try:
            for item in self._losses(executor, tracker, steps, chunks, request, vote):
                yielded += 1  # before the yield: a caller leaving there has had this step
                if yielded == 1:
                    self._first_step_done = time.perf_counter()
                yield item
        except _StopAgreed:  # every rank leaves after the same step, as on a break
            self._abandon(executor, yielded, chunks, GeneratorExit, vote)
            return yielded
        except BaseException as err:  # left early (GeneratorExit) or failed: clean up
            self._abandon(executor, yielded, chunks, type(err), vote)
            raise
        return steps

    def _losses(self, executor: Executor, tracker: StepTracker, steps: int, chunks: int,
                request: DeferredStop | None = None, vote: StopVote | None = None
                ) -> Iterator[torch.Tensor | None]:
        """Each step's mean loss as the rank finishes the step. A non-finite loss (on_nan
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
        assert self.plan is not None
        shared = any(len(s.ranks) > 1 for s in self.plan.stages)
        last = len(self.plan.stages) - 1
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
            """The step's mean loss over every rank's share (the sum, and how many)."""
            got = losses.pop(step, {})
            total = torch.tensor([sum(float(x) for x in got.values()), len(got)],
                                 dtype=torch.float64)
            self._agree(lambda: self._control.all_reduce(total),
                        f"agreeing on the loss of step {self._step + step + 1}")
            mean = (total[0] / total[1]).float() if total[1] else None
            if self.on_nan == "stop" and mean is not None and not mean.isfinite():
                bad.setdefault(step, f"the loss of step {self._step + step + 1} is "
                                     f"{float(mean)} (seen on another replica)")
            return mean

        def finish(step: int, mean: torch.Tensor | None) -> Iterator[torch.Tensor | None]:
            """Yields the step's loss, or ends the run there (non-finite loss, agreed stop)."""
            if step in bad:
                for runtime in executor.stages.values():  # replicas all stop here: let the
                    if runtime.buckets is not None:  # reductions begun in the backward land
                        runtime.buckets.wait()  # before the run's gradients are cleared
                raise NonFiniteLoss(f"{bad[step]}; training stopped after step "
                                    f"{self._step + step} (on_nan='stop'). Lower the "
                                    f"learning rate, or pass on_nan='skip'")
            if vote is not None:
                vote.cast(step, request.signum if request is not None else None)
            yield mean
            if vote is not None and step + 1 < steps and vote.outcome(step):
                raise _StopAgreed

        for _, action, loss in executor.run():
            if loss is not None:
                assert action.microbatch is not None
                step = action.microbatch // chunks
                if self.on_nan == "stop" and not torch.isfinite(loss) and step not in bad:
                    bad[step] = (f"the loss of microbatch {action.microbatch % chunks} of step "
                                 f"{self._step + step + 1} is {float(loss)} (seen on rank "
                                 f"{self.rank} at {action.to_text()})")
                if not shared or action.stage == last:  # shared: each loss counted once
                    losses[step][action.microbatch] = loss
            for step in tracker.done(action, steps):
                if shared:
                    finished.append(step)
                else:
                    got = losses.pop(step, {})
                    yield from finish(step, torch.stack(list(got.values())).mean()
                                      if got else None)
            while finished and due(finished[0]):
                step = finished.pop(0)
                yield from finish(step, agreed(step))
        if vote is not None:
            vote.settle()  # a stop agreed on in the last steps ends the run here, drained
        self._step += steps
        self.last_stats = executor.stats.to_dict()
        if self._first_run:  # a call's later runs (after a checkpoint, an adapt check)
            self.last_events = executor.events or []  # number their microbatches from 0 again
            self._first_run = False

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
        self._step += yielded
        for runtime in self._runtimes.values():
            runtime.abandon_run()
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        self.last_stats = executor.stats.to_dict()

    def _inference_transport(self, key: tuple[Any, ...]) -> Transport:
        """The transport of forward-only runs of one shape (made collectively on first use:
        every rank knows the key from the same agreed values)."""
        if key not in self._inference_transports:
            assert self.plan is not None
            self._inference_transports[key] = self._new_transport(stage_groups=False)
        return self._inference_transports[key]

    def _forward_only(self, schedule: Schedule, inputs: Any, spec: pytree.TreeSpec,
                      sink: Callable[[int, Any, Any], None], key: tuple[Any, ...]) -> None:
        assert self.plan is not None
        runtimes = {i: StageRuntime.for_inference(i, m, i == 0, i == len(self.plan.stages) - 1,
                                                  self.precision)
                    for i, m in self._modules.items()}
        executor = Executor(schedule, self.rank, runtimes, self._inference_transport(key),
                            inputs, target_spec=spec, outputs=sink)
        self._executor = executor
        for _ in executor.run():
            pass
