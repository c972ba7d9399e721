"""What every part of one rank of a Pipeline reads: the rank's settings and its world
(`RankContext`), and the errors the parts raise.

A rank is composed of parts, each an object owning its own state (see ARCHITECTURE.md):

    Pipeline ─┬─ RankContext   settings, the world, the control group       (this module)
              ├─ Stages        the model, the plan, this rank's stages       (cutting.py)
              ├─ Progress      steps trained, where the loader stands        (data.py)
              ├─ Checkpoints   saving, and restoring into the stages         (checkpoints.py)
              ├─ RunLoop       executor runs: training and forward-only      (run_loop.py)
              └─ Moving        moves between plans, and adapt                (moving.py)

Each part is given the parts it calls when it is made; none reads another's private state.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import torch

from pipedream_fast.options import PipelineOptions
from pipedream_fast.runtime.stage import OptimizerFactory, SchedulerFactory
from pipedream_fast.tuning import Tuning
from pipedream_fast.world import Group, World


class _StopAgreed(Exception):
    """Every rank read the same stop vote after the same step: leave the run there."""


class NonFiniteLoss(RuntimeError):
    """A microbatch's loss was NaN or infinite (on_nan='stop'); names step, microbatch, stage,
    and whether the step's data held NaN or infinite values. `run_step`: the step of the
    run, from 0 (-1 when unknown)."""

    def __init__(self, message: str, run_step: int = -1) -> None:
        super().__init__(message)
        self.run_step = run_step


class RankContext:
    """One rank's settings and its world, read by every part.

    Owns: `options` (checked once by the Pipeline; its `schedule` is resolved when a plan is
    set up, for schedule='auto'), `rank`, `world_size`, `world`, `control` (the group every
    agreement between runs goes through, on CPU, with the Pipeline's timeout), `device`,
    `tuning`, `loss_fn`, `run_id` (the checkpoint folder's run), `inputs_only` (loader items
    are the model's inputs alone) and the optimizer and scheduler factories.
    """

    def __init__(self, options: PipelineOptions, world: World, device: torch.device,
                 tuning: Tuning, loss_fn: Callable[[Any, Any], torch.Tensor],
                 inputs_only: bool, optimizer_factory: OptimizerFactory,
                 scheduler_factory: SchedulerFactory | None, run_id: str) -> None:
        self.options = options
        self.world = world
        self.rank = world.rank
        self.world_size = world.size
        self.device = device
        self.tuning = tuning
        self.loss_fn = loss_fn
        self.inputs_only = inputs_only
        self.optimizer_factory = optimizer_factory
        self.scheduler_factory = scheduler_factory
        self.run_id = run_id
        control = world.new_group(list(range(world.size)), backend="gloo")
        assert control is not None
        self.control: Group = control

    # The settings the parts read most, by name.
    @property
    def schedule_name(self) -> str:
        return self.options.schedule

    def resolve_schedule(self, name: str) -> None:
        """The schedule a plan settles (schedule='auto' learns its choice here)."""
        self.options = self.options.replace(schedule=name)

    @property
    def timeout(self) -> float:
        return self.options.timeout

    @property
    def seed(self) -> int:
        return self.options.seed

    @property
    def precision(self) -> str:
        return self.options.precision

    def chunks_for(self, batch_inputs: Any) -> int:
        """The microbatches a minibatch of `batch_inputs` splits into."""
        if self.options.chunks is not None:
            return self.options.chunks
        size = self.options.microbatch_size
        if size is None:
            return 1
        first = batch_inputs
        while not isinstance(first, torch.Tensor):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        return -(-first.shape[0] // size)  # a batch that is not a multiple splits unevenly

    def agree(self, collective: Callable[[], Any], what: str) -> None:
        """Runs a collective of every rank, naming the ranks when one does not take part."""
        try:
            collective()
        except Exception as err:
            others = [str(r) for r in range(self.world_size) if r != self.rank]
            peers = f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(others)}"
            raise RuntimeError(f"rank {self.rank}: {what} needs every rank, and {peers} did not "
                               f"take part within {self.timeout:.0f} s (died, stuck or called "
                               f"something else): {err}") from err
