"""`Pipeline`: the drop-in training API.

    pipe = Pipeline(model, loss_fn=..., optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                    schedule="1f1b", chunks=4)          # planned on the first minibatch
    for loss in pipe.train(loader, epochs=3): ...      # each step's loss, on every rank
    pipe.evaluate(test_loader, metrics={"accuracy": accuracy})   # same dict on every rank
    loss = pipe.step(inputs, targets)                  # synchronous schedules: one minibatch

Where the ranks live (`ranks=`) is a choice, not another class. "processes" (the default):
one process per rank (under torchrun, `pipedream-fast run`, or `pipedream_fast.launch`); the
Pipeline joins the default process group (gloo on CPU, NCCL on GPU; initialised from the
environment if needed). "threads" with `workers=N`: every rank is a thread of this process,
driven by the caller's one loop (`rank_threads`); collectives meet in memory and tensors are
handed over, not copied. Either way each rank runs the code below in its `world` (`world.py`):
it cuts the model with the plan, keeps only its own stage(s), builds the schedule and hands
its rank's actions to an `Executor`. A loader minibatch is split into
`chunks` microbatches, as evenly as its samples allow; microbatch ids run on across steps
(step k holds k*chunks ...).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
import weakref
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from torch.utils import _pytree as pytree

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.formats import Plan, Profile
from pipedream_fast.runtime.cpu_cache import CpuCacheHold
from pipedream_fast.runtime.memory import rank_memory
from pipedream_fast.runtime.stage import (OptimizerFactory, SchedulerFactory)
from pipedream_fast.schedules import SYNCHRONOUS
from pipedream_fast.schedules.forward_only import forward_only
from pipedream_fast.stopping import DeferredStop
from pipedream_fast.training import (MicrobatchFeed, data_source,
                                     feed_uses, named_state,
                                     model_loss,
                                     batch_size, microbatch_sizes, split_microbatches,
                                     to_device)
from pipedream_fast.tuning import Tuning
from pipedream_fast.options import OptionError, PipelineOptions
from pipedream_fast.rank.checkpoints import Checkpoints, layout
from pipedream_fast.rank.cutting import Stages
from pipedream_fast.rank.data import Progress
from pipedream_fast.rank.moving import Moving
from pipedream_fast.rank.run_loop import RunLoop
from pipedream_fast.rank.state import NonFiniteLoss, RankContext
from pipedream_fast.rank_threads import RankThreads
from pipedream_fast.world import ProcessWorld, World


def _same_cut(saved: Plan, kwargs: dict[str, Any]) -> bool:
    """Whether the job continuing a checkpoint asks for the cut that wrote it: no plan, and
    `stages=`, `balance=`, `split_points=` (as the run was built) that agree with it, on as
    many ranks."""
    sizes = [s.stop - s.start for s in saved.stages]
    stages, balance = kwargs.get("stages"), kwargs.get("balance")
    split_points = kwargs.get("split_points")
    return (kwargs.get("plan") is None and _world_size(kwargs, saved.workers) == saved.workers
            and (stages is None or stages == len(sizes))
            and (balance is None or list(balance) == sizes)
            and (split_points is None or len(split_points) + 1 == len(sizes)))


def _world_size(kwargs: dict[str, Any], default: int) -> int:
    """The ranks the Pipeline about to be built will have (rank threads: `workers`)."""
    options = kwargs.get("options")
    ranks = kwargs.get("ranks", options.ranks if options is not None else "processes")
    if ranks == "threads":
        workers = kwargs.get("workers", options.workers if options is not None else None)
        return int(workers) if workers is not None else default
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", default))


def _continuing(path: str | os.PathLike[str], kwargs: dict[str, Any]
                ) -> tuple[Path, dict[str, Any], list[str], Plan | None]:
    """What continuing the run at `path` (a checkpoint, or a checkpoint_dir's newest) takes:
    its folder, manifest, the notes on what was skipped, and the plan to build with: the
    checkpoint's own when the job asks for its cut (`kwargs`, the options the job was built
    with, then lose the split the plan replaces), else the plan given or None (the planner
    cuts; the state is read by key). `kwargs` take the run's seed."""
    folder, notes = ckpt.resolve(Path(path))
    manifest = ckpt.read_manifest(folder)
    saved = Plan.from_dict(manifest["plan"])
    if _same_cut(saved, kwargs):  # the files load as they are
        for name in ("plan", "stages", "balance", "split_points"):
            kwargs.pop(name, None)
        plan: Plan | None = saved
    else:  # another cut (the plan or split given, or the planner's): read by the model's keys
        given = kwargs.pop("plan", None)
        plan = Plan.load(given) if isinstance(given, (str, os.PathLike)) else given
        notes.append(f"{folder} was saved on {saved.workers} ranks as "
                     f"{layout(saved)}; this job "
                     f"cuts the model its own way, and every stage takes its weights, "
                     f"optimizer and scheduler state from the files by the model's keys")
    index = manifest.get("epoch_batches", 0)
    if manifest.get("seed") is not None:  # it draws the order of the epoch in progress
        seed = kwargs.setdefault("seed", manifest["seed"])
        if seed != manifest["seed"] and index:
            raise ValueError(f"seed={seed!r} disagrees with the checkpoint's "
                             f"({manifest['seed']}), saved after {index} batches of epoch "
                             f"{manifest['epoch']}, whose order that seed drew; leave seed "
                             f"out to continue the run")
    return folder, manifest, notes, plan


def _join_microbatches(sizes: Sequence[int], *parts: Any) -> Any:
    """One output leaf of a whole minibatch from its microbatches' parts (of `sizes`
    samples): a batch-major tensor concatenated, a 0-d tensor (a microbatch's mean loss)
    averaged, weighed by the samples when the microbatches differ in size."""
    if not isinstance(parts[0], torch.Tensor):
        return parts[0]
    if parts[0].dim() == 0:
        stacked = torch.stack(parts).float()
        if len(set(sizes)) == 1:
            return stacked.mean().to(parts[0].dtype)
        weights = torch.tensor(sizes, dtype=stacked.dtype, device=stacked.device)
        return ((stacked * weights).sum() / sum(sizes)).to(parts[0].dtype)
    return torch.cat(parts)

__all__ = ["NonFiniteLoss", "Pipeline"]


def _on_every_rank(pick: Callable[[list[Any]], Any]) -> Callable[[Any], Any]:
    """A collective method: with ranks='threads' it runs on every rank thread at once, and
    `pick` chooses what the caller gets from the ranks' results."""
    def wrap(method: Any) -> Any:
        @functools.wraps(method)
        def run(self: Pipeline, *args: Any, **kwargs: Any) -> Any:
            if self._threads is None:
                return method(self, *args, **kwargs)
            return pick(self._threads.call(lambda r: method(self._ranks[r], *args, **kwargs)))
        return run
    return wrap


def _rank_0(results: list[Any]) -> Any:
    return results[0]


def _first_given(results: list[Any]) -> Any:
    """The first rank's result that is not None (the last stage's outputs)."""
    return next((r for r in results if r is not None), None)


class Pipeline:
    """Pipeline-parallel training of `model` on the ranks of the default process group.

    Steps and updates: a *step* is one minibatch of the loader, split into `chunks`
    microbatches as evenly as it goes (a batch of 10 in 4: 3, 3, 2, 2); any batch size and a
    short last batch train (one of fewer samples than chunks fills the rest with a repeated
    sample that counts 0; a DataLoader whose batch_size is below chunks is refused). Each
    microbatch's loss weighs by its share of the step's samples, so for a loss that is a mean
    over the batch, the step's gradient and loss are the plain loop's on the whole batch.
    The synchronous schedules (gpipe, 1f1b, interleaved-1f1b, zb-h1, data-parallel) update
    every stage once per step with the gradients averaged over its microbatches: exactly
    minibatch SGD. 2bw also updates once per step, with gradients one
    version stale. pipedream and pipedream-vsync update after every round of microbatches
    (one per replica of a stage): with `chunks=4` a step is four updates on a quarter of the
    minibatch each, so keep `chunks=1` (the default) to update once per minibatch.

    Where the plan comes from: `plan` (a Plan or a path), a manual split (`balance`: blocks
    per stage; `split_points`: names of the blocks that start stages 1, 2, ...), or the
    planner, which profiles the model on rank 0 with the first minibatch (or
    `example_inputs`) and picks stages and replicas (`stages=N`: a straight N-stage pipeline
    balanced by time). Error messages about blocks list the model's block names.

    Data: only the ranks of the first stage read the loader, under torch's random state
    seeded by (`seed`, epoch, batch), so replicas shuffle alike and no two ranks must agree on
    any other random state; targets travel with the activations to the last stage, and each
    microbatch's loss travels back with its gradients, so `train` yields the loss on every
    rank. Precision "bf16"/"fp16" runs each stage's forward under autocast (fp16 with loss
    scaling); `clip_grad_norm` clips by the norm of all stages' gradients; weights used by two
    stages (tied embeddings) have their gradients summed across those stages before each
    update. These three agree across stages before updates, which needs a synchronous schedule.

    `tuning`: the core's speed knobs (queue depth, spinning, bucket size, weight slots,
    receive pool, offloaded stash; see `Tuning` and TUNING.md); they never change results.

    LocalSGD (`schedule="localsgd"`, `local_steps=H`, `model_replicas=R`, defaults 1 and the
    number of stages): R model replicas share one straight pipeline; each loader minibatch is
    one microbatch (`chunks` 1 or unset, no `microbatch_size`), minibatch m trains replica
    m mod R, and every R*H minibatches the stages average their replicas' weights. Each stage
    keeps R weight copies, each with its own optimizer and scheduler (stepped at that
    replica's updates); optimizer state is per replica and never averaged. Rounds count from
    the start of each `train` call (each run drains the pipeline), and a run's trailing
    partial round is not averaged. `optimizers`, `schedulers`, `evaluate`, `predict` and
    `state_dict` use copy 0, the averaged model after every complete round; `save` writes
    every copy (weights, optimizer and scheduler state), so `load` with the same R continues
    exactly (and export, like `state_dict`, gives copy 0).

    Staleness corrections (`staleness="predict" | "nesterov" | "lr-scale"`, pipedream,
    pipedream-vsync and 2bw): each stage knows, from the schedule, how many of its own updates
    a microbatch's gradient will miss (its delay d). predict: the forward reads the weights
    moved d steps along the stage's velocity (a moving average of its updates); nesterov: moved
    by 0.9 + ... + 0.9^d velocities, where momentum alone would take them; lr-scale: each
    update's learning rate is divided by 1 + the mean delay of its microbatches. The backward
    uses the weights its forward read; the velocity is saved in checkpoints. See
    `pipedream_fast.runtime.staleness_correction`.

    Plans that follow the machine (`adapt=True`, `move(plan)`): every `adapt_every` steps rank
    0 re-plans from the speed each rank measured and, when the gain pays for it, every rank
    moves its blocks to the new plan at that step boundary, with their optimizer, scheduler
    and staleness state; see `pipedream_fast.rank.moving`. A given `plan=` needs the
    `profile=` it was made from.

    Models from libraries (nanoGPT, Hugging Face, torchvision, timm) are split unedited: a
    model torch.fx cannot trace is captured with torch.export from the first minibatch (or
    `example_inputs`), and is then cut at that point. Inputs may be a tensor, a tuple of
    positional arguments or a dict of keyword arguments (`input_ids`, `attention_mask`,
    `labels`). `loss_fn=None` means the model computes its loss: each loader item is then the
    model's inputs alone, targets included (`(idx, targets)` for nanoGPT, `{"input_ids": ...,
    "labels": ...}` for Hugging Face), and the loss is taken from the output (see
    `training.model_loss`).
    """

    def __init__(self, model: nn.Module | Callable[[], nn.Module],
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 optimizer: OptimizerFactory, plan: None | str | os.PathLike[str] | Plan = None,
                 schedule: str | None = None, microbatch_size: int | None = None,
                 chunks: int | None = None, *, scheduler: SchedulerFactory | None = None,
                 example_inputs: Any = None, leaf_modules: Sequence[Any] = (),
                 tuning: Tuning | None = None, options: PipelineOptions | None = None,
                 profile: None | str | os.PathLike[str] | Profile = None,
                 _world: World | None = None, **values: Any) -> None:
        """`values`: the options of `PipelineOptions` by name (`clip_grad_norm=1.0`,
        `ranks="threads"`, `workers=2`...) and those the schedule declares
        (`local_steps=4`), on top of `options` if given; checked once, here."""
        for name, value in (("schedule", schedule), ("microbatch_size", microbatch_size),
                            ("chunks", chunks)):
            if value is not None:
                values[name] = value
        if options is not None:
            values = {**{f.name: getattr(options, f.name) for f in dataclasses.fields(options)},
                      **values}
        opts = PipelineOptions.of(**values)
        if opts.resume and _world is None:  # rank threads are resumed by their driver
            assert opts.checkpoint_dir is not None
            if ckpt.holds_checkpoint(Path(opts.checkpoint_dir)):  # a restarted job
                values.pop("resume")
                if plan is not None:  # a cut of its own: the state is read by key
                    values["plan"] = plan
                folder, manifest, notes, saved_plan = _continuing(opts.checkpoint_dir, values)
                with ckpt.resuming(manifest):
                    self.__init__(model, loss_fn, optimizer, plan=saved_plan,  # type: ignore[misc]
                                  scheduler=scheduler, example_inputs=example_inputs,
                                  leaf_modules=leaf_modules, tuning=tuning, profile=profile,
                                  **values)
                self._announce_resume(folder, manifest, notes)
                return
        self._options = opts
        self._threads: RankThreads | None = None
        self._run_id = ckpt.claim_run(opts.checkpoint_dir)  # refuses another run's folder
        if plan is not None and opts.stages is not None:
            raise ValueError("give one of plan, stages, balance and split_points, got plan "
                             "and stages")
        if plan is not None and (opts.balance is not None or opts.split_points is not None):
            raise ValueError(f"give one of plan, stages, balance and split_points, got plan "
                             f"and {'balance' if opts.balance is not None else 'split_points'}")
        if opts.adapt and profile is None and (plan is not None or opts.balance is not None
                                               or opts.split_points is not None):
            raise OptionError("adapt", "adapt=True re-plans from the model's per-block profile: "
                                       "pass profile= (the profile the plan was made from), or "
                                       "let the Pipeline plan (leave out plan, balance and "
                                       "split_points, or give stages=N)")
        if opts.ranks == "threads" and _world is None:
            self._start_threads(model, plan, dict(scheduler=scheduler,
                                                  example_inputs=example_inputs,
                                                  leaf_modules=leaf_modules, tuning=tuning,
                                                  loss_fn=loss_fn, optimizer=optimizer,
                                                  profile=profile))
            return
        world: World = _world if _world is not None else ProcessWorld(opts.timeout)
        # A factory: every rank builds the model on the meta device and materialises only its
        # own stages (`Stages.setup`). Where the planner cuts it, rank 0 profiles it, which
        # needs real weights: rank 0 builds it for real, and puts it back on meta once it is cut.
        factory_built = built_on_meta = False
        if not isinstance(model, nn.Module) and callable(model):
            built_on_meta = True
            factory_built = (world.rank == 0 and world.size > 1 and plan is None
                             and opts.balance is None and opts.split_points is None)
            if factory_built:
                model = model()
            else:
                with torch.device("meta"):
                    model = model()
        assert isinstance(model, nn.Module)
        device = (torch.device(opts.device) if opts.device is not None
                  else world.default_device(model))
        tuning = tuning or Tuning()
        tuning.check_device(device)
        self._world = world
        weakref.finalize(self, world.release)
        # Freed CPU tensor memory kept for reuse while the Pipeline is open (Tuning.cpu_cache_mb)
        self._cpu_cache = CpuCacheHold(device, tuning.cpu_cache_bytes)
        weakref.finalize(self, self._cpu_cache.release)
        ctx = RankContext(opts, world, device, tuning, loss_fn or model_loss,
                          inputs_only=loss_fn is None, optimizer_factory=optimizer,
                          scheduler_factory=scheduler, run_id=self._run_id)
        if isinstance(profile, (str, os.PathLike)):
            profile = Profile.load(profile)
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be None, a path or a Plan, got {type(plan).__name__}")
        # The rank's parts (rank/state.py draws them): each owns its state.
        self._ctx = ctx
        self._stages = Stages(ctx, model, leaf_modules=tuple(leaf_modules),
                              split=(plan, opts.balance, opts.split_points),
                              factory_built=factory_built, built_on_meta=built_on_meta,
                              profile=profile)
        self._progress = Progress(ctx, self._stages)
        self._checkpoints = Checkpoints(ctx, self._stages, self._progress)
        self._run_loop = RunLoop(ctx, self._stages, self._progress, self._checkpoints,
                                 trace=opts.trace)
        self._moving = Moving(ctx, self._stages, self._progress, self._checkpoints,
                              self._run_loop)
        self._run_loop.after_run = self._moving.after_run
        stages = self._stages
        stages.try_capture(example_inputs)
        if stages.chain is not None:  # cut now where the plan is known or can be made
            stages.check_ties_allowed(stages.chain)
            plan = stages.fixed_plan()
            if plan is None and example_inputs is not None:
                plan = stages.plan_from(example_inputs if ctx.rank == 0 else None)
            if plan is not None:
                stages.setup(plan)

    def _start_threads(self, model: nn.Module | Callable[[], nn.Module], plan: Any,
                       objects: dict[str, Any]) -> None:
        """ranks='threads': `workers` rank threads, each a Pipeline rank of its own in a
        `ThreadWorld`; this object drives them (`rank_threads`). The ranks share
        the caller's model: each stage's first rank trains the user's own modules, a replica
        (or a weight tied across stages) gets a copy; a factory is called by every rank."""
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        workers = self._options.workers
        if workers is None:
            if plan is None:
                raise OptionError("workers", "ranks='threads' needs workers=N, the number of "
                                             "rank threads (or a plan=, whose worker count is "
                                             "taken)")
            workers = plan.workers
        threads = RankThreads(workers, self._options.timeout, on_reset=self._after_abort,
                              describe=self._describe_rank)
        self._threads = threads
        self._ranks: list[Pipeline] = threads.call(
            lambda r: Pipeline(model, plan=plan, options=self._options, _world=threads.worlds[r],
                               **objects))

    def _describe_rank(self, rank: int) -> str:
        """What rank thread `rank` is doing, for a report that it is stuck."""
        ranks = self.__dict__.get("_ranks")
        executor = ranks[rank]._run_loop.executor if ranks else None
        current = executor.current if executor is not None else None
        if current is None:
            return f"rank {rank} is outside the schedule's actions (reading data, agreeing)"
        index, action, since = current
        return (f"rank {rank} is in action {index} ({action.to_text()}) since "
                f"{time.perf_counter() - since:.1f} s")

    def _after_abort(self) -> None:
        """ranks='threads', after a failure aborted every rank's waits: the transports it
        closed are dropped (the ranks make new ones), what was in flight is discarded."""
        for pipe in self._ranks:
            pipe._stages.forget_links()

    def _each_rank(self, fn: Callable[[Pipeline], Any]) -> None:
        """`fn` on this rank, or (ranks='threads') on every rank thread at once."""
        if self._threads is None:
            fn(self)
        else:
            self._threads.call(lambda r: fn(self._ranks[r]))

    def _first(self) -> Pipeline:
        """This rank; with ranks='threads', rank 0's thread (what is the same on every rank)."""
        return self._ranks[0] if self._threads is not None else self

    # --- what a rank is ----------------------------------------------------------------------
    @property
    def options(self) -> PipelineOptions:
        """The options, checked (a rank's has schedule='auto' resolved once it is cut)."""
        return self._ctx.options if self._threads is None else self._options

    @property
    def rank(self) -> int:
        """This rank (0 for the caller of ranks='threads')."""
        return 0 if self._threads is not None else self._ctx.rank

    @property
    def world_size(self) -> int:
        return self._threads.size if self._threads is not None else self._ctx.world_size

    @property
    def device(self) -> torch.device:
        return self._first()._ctx.device

    @property
    def tuning(self) -> Tuning:
        return self._first()._ctx.tuning

    @property
    def schedule_name(self) -> str:
        """The schedule (schedule='auto': the one chosen, once the model is cut)."""
        return self._first()._ctx.schedule_name

    @property
    def seed(self) -> int:
        return self._first()._ctx.seed

    @property
    def steps_done(self) -> int:
        """Steps trained in this run, those of the checkpoint it continues included: a
        restarted job (`resume=True`) trains `total - steps_done` more."""
        return self._first()._progress.step

    @property
    def plan(self) -> Plan | None:
        """The plan the model is cut with (None until the first minibatch, where it is
        planned then)."""
        return self._first()._stages.plan

    @property
    def stage_indices(self) -> tuple[int, ...]:
        """The stages this rank holds (rank 0's under ranks='threads')."""
        return self._first()._stages.stage_indices

    @property
    def moves(self) -> list[dict[str, Any]]:
        """Every move of the stages made (`move`, `adapt`), its record."""
        return self._first()._moving.moves

    @property
    def adapt_checks(self) -> list[dict[str, Any]]:
        """Every re-planning check of `adapt`."""
        return self._first()._moving.adapt_checks

    @property
    def last_stats(self) -> Any:
        """The last run's statistics (by rank under ranks='threads')."""
        if self._threads is not None:
            return {r: p.last_stats for r, p in enumerate(self._ranks)}
        return self._run_loop.last_stats

    @property
    def last_events(self) -> list[Any]:
        """With `trace`, the actions of the first run of the last train() call (every rank's
        under ranks='threads')."""
        if self._threads is not None:
            return [e for p in self._ranks for e in p.last_events]
        return self._run_loop.last_events

    @property
    def last_input_bytes(self) -> dict[int, int]:
        """With `trace`, the bytes of each microbatch's inputs over the same run as `last_events` (by
        microbatch, from the ranks that feed the first stage): the run's real sizes, for the
        simulator to replay (`sim.SizedCosts`) when shapes vary."""
        if self._threads is not None:
            return {mb: n for p in self._ranks for mb, n in p.last_input_bytes.items()}
        return self._run_loop.last_input_bytes

    @property
    def last_memory(self) -> list[Any]:
        """With `trace` and measure_memory, the activation bytes held over the same run as
        `last_events` (`trace.MemorySample`s; every rank's under ranks='threads')."""
        if self._threads is not None:
            return [m for p in self._ranks for m in p.last_memory]
        return self._run_loop.last_memory

    @property
    def calibration(self) -> Any:
        """This rank's running estimate of its costs (`runtime/calibration.py`; by rank under
        ranks='threads'), which `sim.MeasuredCosts.from_calibration` reads."""
        if self._threads is not None:
            return {r: p.calibration for r, p in enumerate(self._ranks)}
        return self._run_loop.calibration

    @property
    def memory(self) -> dict[Any, Any]:
        """What this rank's stages hold, measured at their tensors (`runtime/memory.py`):
        {"stages": {stage: bytes by kind}, "rank": the rank's peak, "measured": whether the
        activations were measured (measure_memory=True)}; by rank under ranks='threads'."""
        if self._threads is not None:
            return {r: p.memory for r, p in enumerate(self._ranks)}
        return rank_memory(self._stages.runtimes, self._stages.meter, self._ctx.device)

    # --- set-up ------------------------------------------------------------------------------
    @property
    def trace(self) -> bool:
        """Whether the next runs record a trace of their actions (`last_events`); may be
        switched between runs."""
        return self._first()._run_loop.trace

    @trace.setter
    def trace(self, value: bool) -> None:
        for pipe in (self._ranks if self._threads is not None else [self]):
            pipe._run_loop.trace = value

    @property
    def stage_modules(self) -> dict[int, nn.Module]:
        """The stages this rank holds (several in interleaved plans), by stage index; with
        ranks='threads', every stage (its first replica's)."""
        if self._threads is not None:
            return {i: m for p in reversed(self._ranks) for i, m in p.stage_modules.items()}
        return dict(self._stages.modules)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of this rank's stages, in stage order (one per stage with weights);
        with ranks='threads', every stage's (its first replica's)."""
        if self._threads is not None:
            found = {i: o for p in reversed(self._ranks)
                     for i, o in p._stages.optimizers.items()}
            self._ranks[0]._stages.require_setup("optimizers")
            return [found[i] for i in sorted(found)]
        self._stages.require_setup("optimizers")
        return [self._stages.optimizers[i] for i in sorted(self._stages.optimizers)]

    @property
    def schedulers(self) -> list[Any]:
        """The learning-rate schedulers of this rank's stages, in stage order (with
        ranks='threads', every stage's)."""
        if self._threads is not None:
            found = {i: s for p in reversed(self._ranks)
                     for i, s in p._stages.schedulers.items()}
            self._ranks[0]._stages.require_setup("schedulers")
            return [found[i] for i in sorted(found)]
        self._stages.require_setup("schedulers")
        return [self._stages.schedulers[i] for i in sorted(self._stages.schedulers)]

    # --- data ----------------------------------------------------------------------------------
    # --- training -----------------------------------------------------------------------------
    def train(self, loader: Iterable[Any] | None, steps: int | None = None, *,
              epochs: int | None = None) -> Iterator[torch.Tensor | None]:
        """Trains `steps` minibatches, or `epochs` passes over the loader (default: one pass),
        from `loader` (pairs of inputs, targets; a re-iterable loader is read again for each
        epoch and left usable). Only first-stage ranks read it (others may pass None). A run
        goes on where the last one (or the checkpoint `load` read) stopped: the same loader,
        or the first one after `load`, at the next batch of the epoch in progress, and
        `epochs=N` ends with the N-th epoch counting that one; another loader begins a new
        epoch. Yields each step's loss (the mean of its microbatches' losses, each weighed by
        its share of the step's samples), the same on every rank (a replicated stage's ranks
        see only their share: one small all-reduce per step combines them). With
        `checkpoint_dir`, the pipeline drains and saves every `checkpoint_every` steps.
        SIGTERM stops every rank after the same step, a few steps later (see
        `pipedream_fast.stopping`): the pipeline is left as by a `break`, a checkpoint is
        saved if there is a `checkpoint_dir`, and `Stopped` (a `SystemExit` with code 143) is
        raised. Collective: every rank must iterate it."""
        if self._threads is not None:
            def start(rank: int, request: DeferredStop) -> Iterator[torch.Tensor | None]:
                self._ranks[rank]._run_loop.stop_request = request
                return self._ranks[rank].train(loader, steps, epochs=epochs)
            yield from self._threads.train(start)
            return
        if self._moving.broken is not None:
            raise RuntimeError(f"this Pipeline cannot train any more: {self._moving.broken}; "
                               f"load the last checkpoint (Pipeline.load) to go on")
        yield from self._run_loop.train(loader, steps, epochs)

    def step(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """One minibatch of a synchronous schedule (gpipe, 1f1b, data-parallel)."""
        if self.schedule_name not in SYNCHRONOUS:
            raise ValueError(f"step() trains one flushed minibatch and needs a synchronous "
                             f"schedule ({', '.join(SYNCHRONOUS)}); {self.schedule_name!r} "
                             f"streams microbatches: use train(loader, steps)")
        out = list(self.train([(inputs, targets)], steps=1))
        return out[-1]

    # --- evaluation and inference ---------------------------------------------------------------
    @_on_every_rank(_rank_0)
    def evaluate(self, loader: Iterable[Any] | None,
                 metrics: dict[str, Callable[[Any, Any], Any]] | None = None,
                 steps: int | None = None) -> dict[str, float]:
        """Forward passes only (eval mode, no gradients) over one pass of `loader` (or `steps`
        minibatches). Returns {"loss": ..., **metrics} on every rank: each the mean over the
        samples of `fn(outputs, targets)`, which returns a microbatch's mean (a tensor or a
        number), weighted by the microbatch's size. Collective."""
        metrics = dict(metrics or {})
        if "loss" in metrics:
            raise ValueError("'loss' is always reported (loss_fn); name the metric otherwise")
        steps, chunks, spec, batches = self._progress.open(loader, steps, None, evaluation=True)
        assert self.plan is not None
        schedule = forward_only([s.ranks for s in self.plan.stages], steps * chunks)
        inputs = None
        if batches is not None:
            feed = MicrobatchFeed(batches, chunks, feed_uses(schedule, [self.rank]))
            inputs = data_source(feed, schedule, self.rank, self._stages.flatten, self.device)
        sums: dict[str, float] = dict.fromkeys(["loss", *metrics], 0.0)
        count = [0]

        def sink(mb: int, out: Any, masked: Any) -> None:
            target, real = masked
            n = int(real.sum())
            if n == 0:
                return  # all padding
            if n < real.numel():  # the padded tail of a short last batch
                out, target = (pytree.tree_map(lambda t: t[real], v) for v in (out, target))
            sums["loss"] += float(self._ctx.loss_fn(out, target)) * n
            for name, fn in metrics.items():
                sums[name] += float(fn(out, target)) * n
            count[0] += n

        self._run_loop.forward_only(schedule, inputs, spec, sink,
                           key=(self._progress.agreed_batch, chunks, pytree.treespec_dumps(spec)))
        parts: list[Any] = []
        self._ctx.agree(lambda: parts.extend(self._ctx.control.all_gather_object((sums, count[0]))),
                    "gathering the metrics")
        total = sum(n for _, n in parts)
        return {name: sum(p[name] for p, _ in parts) / max(total, 1) for name in sums}

    @_on_every_rank(_first_given)
    def predict(self, inputs: Any, everywhere: bool = False) -> Any:
        """The model's outputs for one minibatch of `inputs` (eval mode, no gradients), on the
        ranks of the last stage (None elsewhere), or on every rank with `everywhere`. Every
        rank passes the same inputs (only the first stage's ranks read them). Collective."""
        self._stages.require_setup("predict()")
        assert self.plan is not None
        samples = batch_size(inputs)
        # As evenly as the samples split (10 into 4: 3, 3, 2, 2); fewer samples than chunks:
        # one microbatch each (this run's schedule is made for the call).
        chunks = min(self._ctx.chunks_for(inputs), samples)
        parts = split_microbatches(inputs, chunks)
        sizes = microbatch_sizes(samples, chunks)
        schedule = forward_only([s.ranks for s in self.plan.stages], chunks)
        spec = pytree.tree_flatten(())[1]  # no target: nothing travels with the inputs

        def source(mb: int) -> tuple[tuple[Any, ...], Any]:
            return self._stages.flatten(to_device(parts[mb], self.device)), ()

        outputs: dict[int, Any] = {}
        self._run_loop.forward_only(schedule, source if 0 in self.stage_indices else None, spec,
                           lambda mb, out, _: outputs.__setitem__(mb, pytree.tree_map(
                               lambda t: t.detach().cpu(), out)),
                           key=(samples, chunks, pytree.treespec_dumps(spec)))
        last = len(self.plan.stages) - 1
        if everywhere or len(self.plan.stages[last].ranks) > 1:
            gathered: list[Any] = []
            self._ctx.agree(lambda: gathered.extend(self._ctx.control.all_gather_object(outputs)),
                        "gathering the outputs")
            for part in gathered:
                outputs.update(part)
        if not everywhere and last not in self.stage_indices:
            return None
        ordered = [outputs[mb] for mb in range(chunks)]
        return (pytree.tree_map(functools.partial(_join_microbatches, sizes), *ordered)
                if chunks > 1 else ordered[0])

    # --- state ------------------------------------------------------------------------------
    @_on_every_rank(_rank_0)
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state under its `state_dict()` keys, on rank 0 (None elsewhere):
        a tied weight under each of its keys as one tensor, no non-persistent buffers, so a
        fresh model loads it with `strict=True`. Collective: every rank must call it."""
        self._stages.require_setup("state_dict()")
        assert self.plan is not None
        mine = named_state([m for i, m in self._stages.modules.items()
                            if self.plan.stages[i].ranks[0] == self.rank], self._stages.names)
        box: list[Any] = [None]
        self._ctx.agree(lambda: box.__setitem__(0, self._ctx.control.gather_object(mine, dst=0)),
                    "gathering the model")
        gathered = box[0]
        if gathered is None:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return ckpt.share_aliases(full, self._stages.aliases())

    @_on_every_rank(_rank_0)
    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a checkpoint directory (see `pipedream_fast.checkpoint`): each stage's first
        rank writes its stage durably, then rank 0 commits the set with the manifest. Saving
        over an existing checkpoint stages the new one and swaps it in; a file, or a folder
        holding anything but a checkpoint, is refused on every rank (a save never deletes
        other files). Collective."""
        self._checkpoints.save(path)

    @_on_every_rank(_rank_0)
    def move(self, plan: Plan) -> dict[str, Any]:
        """Moves the stages to `plan` between two `train` calls, without a restart: each
        stage's weights, optimizer, scheduler and staleness-correction state go to the ranks
        that hold its blocks under `plan` (same worker count and schedule; the first stage
        keeps its ranks, which read the loader). A synchronous schedule then trains exactly
        as it would have without the move. Returns the move's record (also appended to
        `moves`). `adapt=True` does this by itself when the measured speeds call for it; see
        `pipedream_fast.rank.moving` for the protocol. Collective."""
        return self._moving.move(plan, "requested")

    @classmethod
    def load(cls, path: str | os.PathLike[str], model: nn.Module | Callable[[], nn.Module],
             loss_fn: Callable[[Any, Any], torch.Tensor] | None, optimizer: OptimizerFactory,
             **kwargs: Any) -> Pipeline:
        """Rebuilds a Pipeline from a checkpoint written by `save` (or the newest complete one
        under a `checkpoint_dir`) and restores weights, optimizer and scheduler state, step
        and where the loader stood (epoch, batches of it trained on, `seed`: taken from the
        checkpoint, a different one refused mid-epoch). The files are verified against the
        manifest and read without running code. The next `train(loader)`, given the run's
        loader, reads on from the next batch of that epoch, so a synchronous schedule
        continues exactly as an uninterrupted run."""
        folder, manifest, notes, plan = _continuing(path, kwargs)
        with ckpt.resuming(manifest):  # the run goes on under its id, in its checkpoint_dir
            pipe = cls(model, loss_fn, optimizer, plan=plan, **kwargs)
        pipe._announce_resume(folder, manifest, notes, quiet=True)
        return pipe

    def _announce_resume(self, folder: Path, manifest: dict[str, Any], notes: list[str],
                         quiet: bool = False) -> None:
        """Restores every rank from the checkpoint `folder` and says so on rank 0 (the
        notes on what was skipped; with `resume=True` also where the run goes on)."""
        self._each_rank(lambda p: p._checkpoints.resume(folder, manifest))
        if self.rank == 0:
            for note in notes:
                print(f"pipedream_fast: {note}", flush=True)
            if not quiet:
                print(f"pipedream_fast: resume: continuing the run from {folder} (after step "
                      f"{self.steps_done})", flush=True)


    def close(self) -> None:
        """Stops this Pipeline's communication threads and removes its process groups (not the
        default group, which a script may still use; one the Pipeline started goes at exit).
        Also done when the Pipeline is garbage-collected, and at exit."""
        if self._threads is not None:
            for pipe in self._ranks:
                pipe.close()
            return
        self._run_loop.close()
        self._world.release()
        self._stages.drop_links()
        self._cpu_cache.release()
