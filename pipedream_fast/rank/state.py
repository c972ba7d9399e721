"""What every part of one rank of a Pipeline shares: its state (declared here, set by
`Pipeline.__init__`) and the small helpers they all use.

A rank of a Pipeline is one class built from parts, one module each (`RankState` <-
`Checkpointing` <- `Cutting` <- `DataAgreement` <- `RunLoop` <- `Pipeline`): each part may
use the ones before it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from collections.abc import Callable

import torch
from torch import nn


from pipedream_fast.formats import Plan, Profile
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.stage import (OptimizerFactory, SchedulerFactory, StageRuntime)
from pipedream_fast.runtime.transport import Transport
from pipedream_fast.runtime.update_sync import GlobalUpdateSync, LossScaler
from pipedream_fast.stopping import DeferredStop
from pipedream_fast.tracing import LayerChain
from pipedream_fast.training import (EpochBatches)
from pipedream_fast.tuning import Tuning
from pipedream_fast.options import PipelineOptions
from pipedream_fast.world import Group, World


class _StopAgreed(Exception):
    """Every rank read the same stop vote after the same step: leave the run there."""


class NonFiniteLoss(RuntimeError):
    """A microbatch's loss was NaN or infinite (on_nan='stop'); names step, microbatch, stage."""


class RankState:
    """The state of one rank of a Pipeline, and helpers every part uses."""

    # Set by `Pipeline.__init__` on a rank (see there); shared by every part of a rank.
    options: PipelineOptions
    rank: int
    world_size: int
    device: torch.device
    tuning: Tuning
    schedule_name: str
    microbatch_size: int | None
    chunks: int | None
    loss_fn: Callable[[Any, Any], torch.Tensor]
    timeout: float
    seed: int
    precision: str
    clip_grad_norm: float | None
    on_nan: str
    checkpoint_dir: str | None
    checkpoint_every: int | None
    checkpoint_keep: int
    plan: Plan | None
    stage_indices: tuple[int, ...]
    last_stats: dict[str, Any]
    last_events: list[Any]
    _world: World
    _trace: bool
    _run_id: str
    _inputs_only: bool
    _optimizer_factory: OptimizerFactory
    _scheduler_factory: SchedulerFactory | None
    _stages_wanted: int | None
    _model: nn.Module | None
    _factory_built: bool
    _shares_model: bool
    _copied: dict[int, Any]
    _names: dict[int, tuple[str, ...]]
    _leaf_modules: tuple[Any, ...]
    _chain: LayerChain | None
    _split: tuple[Plan | None, tuple[int, ...] | None, tuple[str, ...] | None]
    _modules: dict[int, nn.Module]
    _optimizers: dict[int, torch.optim.Optimizer]
    _schedulers: dict[int, Any]
    _runtimes: dict[int, StageRuntime]
    _saved_copies: dict[int, list[dict[str, Any]]]
    _saved_staleness: dict[int, dict[str, Any] | None]
    _transport: Transport | None
    _control: Group
    _stop_request: DeferredStop | None
    _executor: Executor | None
    _inference_transports: dict[tuple[Any, ...], Transport]
    _sync: GlobalUpdateSync | None
    _scaler: LossScaler | None
    _step: int
    _pending_restore: tuple[Path, dict[str, Any]] | None
    _peeked: tuple[EpochBatches, Any] | None
    _source: EpochBatches | None
    _epoch: int
    _epoch_batches: int
    _last_loader: Any
    _live: EpochBatches | None
    _reading: tuple[EpochBatches, int] | None
    _agreed_batch: int
    _profile: Profile | None  # rank 0's per-block profile (adapt re-plans from it)
    _broken: str | None  # why this rank cannot train any more (a move failed half-way)

    def _require_setup(self, what: str) -> None:
        if self.plan is None:
            raise RuntimeError(f"{what} exist once the model is cut into stages: this Pipeline "
                               f"plans on its first minibatch (pass plan=, balance=, "
                               f"split_points= or example_inputs= to cut it at construction)")

    def _flatten(self, inputs: Any) -> tuple[Any, ...]:
        """A minibatch's (or microbatch's) inputs as the first stage's arguments."""
        assert self._chain is not None
        return self._chain.flatten_inputs(inputs)

    def _chunks_for(self, batch_inputs: Any) -> int:
        if self.chunks is not None:
            return self.chunks
        if self.microbatch_size is None:
            return 1
        first = batch_inputs
        while not isinstance(first, torch.Tensor):
            first = next(iter(first.values())) if isinstance(first, dict) else first[0]
        if first.shape[0] % self.microbatch_size:
            raise ValueError(f"batch size {first.shape[0]} is not a multiple of microbatch_size "
                             f"{self.microbatch_size}")
        return first.shape[0] // self.microbatch_size

    def _agree(self, collective: Callable[[], Any], what: str) -> None:
        """Runs a collective of every rank, naming the ranks when one does not take part."""
        try:
            collective()
        except Exception as err:
            others = [str(r) for r in range(self.world_size) if r != self.rank]
            peers = f"rank {others[0]}" if len(others) == 1 else f"ranks {', '.join(others)}"
            raise RuntimeError(f"rank {self.rank}: {what} needs every rank, and {peers} did not "
                               f"take part within {self.timeout:.0f} s (died, stuck or called "
                               f"something else): {err}") from err

    def _aliases(self) -> list[tuple[str, ...]]:
        """The groups of keys that name one tensor of the model (tied weights)."""
        return [keys for keys in self._names.values() if len(keys) > 1]
