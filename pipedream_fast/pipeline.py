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
`chunks` microbatches; microbatch ids run on across steps (step k holds k*chunks ...).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import itertools
import os
import time
import weakref
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence

import torch
from torch import nn

from torch.utils import _pytree as pytree

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.formats import FormatError, Plan
from pipedream_fast.launch import Stopped, signal_name
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.executor import Executor
from pipedream_fast.runtime.stage import (OptimizerFactory, SchedulerFactory,
                                          StageRuntime)
from pipedream_fast.runtime.transport import Transport
from pipedream_fast.runtime.update_sync import GlobalUpdateSync, LossScaler, TiedWeight
from pipedream_fast.schedules import SYNCHRONOUS, kind
from pipedream_fast.schedules.forward_only import forward_only
from pipedream_fast.stopping import DeferredStop, StopVote
from pipedream_fast.tracing import LayerChain, NeedsExampleInputs, shared_parameters
from pipedream_fast.tracing import trace as trace_model
from pipedream_fast.training import (GLOBAL_STATE, EpochBatches, MicrobatchFeed, StepTracker, build_schedule,
                                     check_backend, check_loader, check_plan_fits,
                                     check_runtime_fits, data_source,
                                     feed_uses, manual_plan, model_fingerprint, named_state,
                                     original_names, resolve_schedule, InputsOnly, model_loss,
                                     batch_size, fingerprint, pad_batch, split_microbatches,
                                     stage_runtime,
                                     steps_for, target_spec, to_device)
from pipedream_fast.tuning import Tuning
from pipedream_fast.options import OptionError, PipelineOptions
from pipedream_fast.rank_threads import RankThreads
from pipedream_fast.world import Group, ProcessWorld, ThreadWorld, World



@dataclass(frozen=True)
class _TensorShape:
    """A tensor of the first minibatch as every rank needs it to capture the model (a pytree
    leaf, unlike a NamedTuple)."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _ties_cross_stages(chain: LayerChain, plan: Plan) -> bool:
    stage_of_block = {b: i for i, s in enumerate(plan.stages) for b in range(s.start, s.stop)}
    return any(len({stage_of_block[b] for b in blocks}) > 1
               for blocks in shared_parameters(chain).values())


def _check_split_matches(plan: Plan, kwargs: dict[str, Any]) -> None:
    """`Pipeline.load` takes the checkpoint's plan; `stages=`, `balance=` or `split_points=`
    given as the run was built are accepted (and dropped) when they agree with it."""
    stages, balance = kwargs.pop("stages", None), kwargs.pop("balance", None)
    split_points = kwargs.pop("split_points", None)
    sizes = [s.stop - s.start for s in plan.stages]
    wrong = [(what, got) for what, got, ok in (
        ("stages", stages, stages is None or stages == len(sizes)),
        ("balance", balance, balance is None or list(balance) == sizes),
        ("split_points", split_points,
         split_points is None or len(split_points) + 1 == len(sizes))) if not ok]
    if wrong:
        what, got = wrong[0]
        raise ValueError(f"{what}={got!r} disagrees with the checkpoint's plan ({len(sizes)} "
                         f"stages of {sizes} blocks); leave it out to continue the checkpoint "
                         f"as it was cut")


def _join_microbatches(*parts: Any) -> Any:
    """One output leaf of a whole minibatch from its microbatches' (equal-sized) parts: a
    batch-major tensor concatenated, a 0-d tensor (a microbatch's mean loss) averaged."""
    if not isinstance(parts[0], torch.Tensor):
        return parts[0]
    if parts[0].dim() == 0:
        return torch.stack(parts).float().mean().to(parts[0].dtype)
    return torch.cat(parts)


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


class _StopAgreed(Exception):
    """Every rank read the same stop vote after the same step: leave the run there."""


class NonFiniteLoss(RuntimeError):
    """A microbatch's loss was NaN or infinite (on_nan='stop'); names step, microbatch, stage."""


class Pipeline:
    """Pipeline-parallel training of `model` on the ranks of the default process group.

    Steps and updates: a *step* is one minibatch of the loader, split into `chunks`
    microbatches. The synchronous schedules (gpipe, 1f1b, interleaved-1f1b, zb-h1,
    data-parallel) update every stage once per step with the gradients averaged over its
    microbatches: exactly minibatch SGD. 2bw also updates once per step, with gradients one
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
        self.options = opts
        self._threads: RankThreads | None = None
        self._run_id = ckpt.claim_run(opts.checkpoint_dir)  # refuses another run's folder
        if plan is not None and opts.stages is not None:
            raise ValueError("give one of plan, stages, balance and split_points, got plan "
                             "and stages")
        if plan is not None and (opts.balance is not None or opts.split_points is not None):
            raise ValueError(f"give one of plan, stages, balance and split_points, got plan "
                             f"and {'balance' if opts.balance is not None else 'split_points'}")
        if opts.ranks == "threads" and _world is None:
            self._start_threads(model, plan, dict(scheduler=scheduler,
                                                  example_inputs=example_inputs,
                                                  leaf_modules=leaf_modules, tuning=tuning,
                                                  loss_fn=loss_fn, optimizer=optimizer))
            return
        self._world: World = _world if _world is not None else ProcessWorld(opts.timeout)
        # A factory: every rank builds the model on the meta device and materialises only its
        # own stages (`_setup`). Where the planner cuts it, rank 0 profiles it, which needs
        # real weights: rank 0 builds it for real, and puts it back on meta once it is cut.
        self._factory_built = False
        if not isinstance(model, nn.Module) and callable(model):
            self._factory_built = (self._world.rank == 0 and self._world.size > 1
                                   and plan is None and opts.balance is None
                                   and opts.split_points is None)
            if self._factory_built:
                model = model()
            else:
                with torch.device("meta"):
                    model = model()
        self.rank = self._world.rank
        self.world_size = self._world.size
        self.device = (torch.device(opts.device) if opts.device is not None
                       else self._world.default_device())
        self.tuning = tuning or Tuning()
        self.tuning.check_device(self.device)
        self.schedule_name = opts.schedule
        self.microbatch_size = opts.microbatch_size
        self.chunks = opts.chunks
        self.loss_fn: Callable[[Any, Any], torch.Tensor] = loss_fn or model_loss
        self._inputs_only = loss_fn is None  # loader items are the model's inputs alone
        self.timeout = opts.timeout
        self.trace = opts.trace
        self.seed = opts.seed
        self.precision = opts.precision
        self.clip_grad_norm = opts.clip_grad_norm
        self.on_nan = opts.on_nan
        self.checkpoint_dir = opts.checkpoint_dir
        self.checkpoint_every = opts.checkpoint_every
        self.checkpoint_keep = opts.checkpoint_keep
        self._optimizer_factory = optimizer
        self._scheduler_factory = scheduler
        self._stages_wanted = opts.stages
        self._model: nn.Module | None = model  # until the stages are cut
        # Rank threads share the caller's model (copies only where a rank needs its own).
        self._shares_model = isinstance(self._world, ThreadWorld) and isinstance(model, nn.Module)
        self._copied: dict[int, Any] = {}  # id of a model tensor -> this rank's copy of it
        self._names = original_names(model)
        self._leaf_modules = tuple(leaf_modules)
        self._chain: LayerChain | None = None  # None: captured at the first minibatch
        try:
            with GLOBAL_STATE:
                self._chain = trace_model(model, example_inputs, leaf_modules, check=False)
        except NeedsExampleInputs:
            pass  # torch.export needs inputs: the model is cut at its first minibatch
        self.plan: Plan | None = None
        self.stage_indices: tuple[int, ...] = ()
        self._modules: dict[int, nn.Module] = {}  # the stages this rank holds
        self._optimizers: dict[int, torch.optim.Optimizer] = {}
        self._schedulers: dict[int, Any] = {}
        self._runtimes: dict[int, StageRuntime] = {}
        self._saved_copies: dict[int, list[dict[str, Any]]] = {}  # localsgd copies from `load`
        weakref.finalize(self, self._world.release)
        self._transport: Transport | None = None
        # Agreement between runs (data, metrics, plans) and before updates, on CPU tensors,
        # with the Pipeline's timeout: a dead or stuck rank fails the others within it.
        control = self._world.new_group(list(range(self.world_size)), backend="gloo")
        assert control is not None
        self._control: Group = control
        self._stop_request: DeferredStop | None = None  # the driving thread's, for threads
        self._executor: Executor | None = None  # the last run's (what a stuck rank was doing)
        # Forward-only traffic, one transport per (batch size, chunks, target structure):
        # every link keeps the shapes of its first message.
        self._inference_transports: dict[tuple[Any, ...], Transport] = {}
        self._sync: GlobalUpdateSync | None = None
        self._scaler = LossScaler() if opts.precision == "fp16" else None
        self._step = 0  # minibatches trained so far
        self._pending_restore: tuple[Path, dict[str, Any]] | None = None  # from `load`
        self._peeked: tuple[EpochBatches, Any] | None = None  # a batch read to plan with
        self._source: EpochBatches | None = None  # unused (training's are in `_reading`)
        # Where training reads the loader (first-stage ranks; saved in checkpoints): its epoch
        # (which seeds its order) and the batches of that epoch trained on; the loader of the
        # last run and its batches, where a run on the same loader goes on reading; the
        # batches of the run in progress and `_step` when it began.
        self._epoch, self._epoch_batches = 0, 0
        self._last_loader: Any = None
        self._live: EpochBatches | None = None
        self._reading: tuple[EpochBatches, int] | None = None
        self.last_stats: dict[str, Any] = {}
        self.last_events: list[Any] = []
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan must be None, a path or a Plan, got {type(plan).__name__}")
        self._split = (plan, opts.balance, opts.split_points)  # how to cut, once the chain is known
        if self._chain is not None:
            self._check_ties_allowed(self._chain)
            plan = self._fixed_plan()
            if plan is None and example_inputs is not None:
                plan = self._plan_from(example_inputs if self.rank == 0 else None)
            if plan is not None:
                self._setup(plan)

    def _start_threads(self, model: nn.Module | Callable[[], nn.Module], plan: Any,
                       objects: dict[str, Any]) -> None:
        """ranks='threads': `workers` rank threads, each a Pipeline rank of its own in a
        `ThreadWorld`; this object drives them (`rank_threads`). The ranks share
        the caller's model: each stage's first rank trains the user's own modules, a replica
        (or a weight tied across stages) gets a copy; a factory is called by every rank."""
        if isinstance(plan, (str, os.PathLike)):
            plan = Plan.load(plan)
        workers = self.options.workers
        if workers is None:
            if plan is None:
                raise OptionError("workers", "ranks='threads' needs workers=N, the number of "
                                             "rank threads (or a plan=, whose worker count is "
                                             "taken)")
            workers = plan.workers
        self.rank, self.world_size = 0, workers
        threads = RankThreads(workers, self.options.timeout, on_reset=self._after_abort,
                              describe=self._describe_rank)
        self._threads = threads
        self._ranks: list[Pipeline] = threads.call(
            lambda r: Pipeline(model, plan=plan, options=self.options, _world=threads.worlds[r],
                               **objects))

    def _describe_rank(self, rank: int) -> str:
        """What rank thread `rank` is doing, for a report that it is stuck."""
        ranks = self.__dict__.get("_ranks")
        executor = ranks[rank]._executor if ranks else None
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
            pipe._transport = None
            pipe._inference_transports.clear()
            for runtime in pipe._runtimes.values():
                runtime.abandon_run()

    def __getattr__(self, name: str) -> Any:
        """ranks='threads': what is the same on every rank (plan, schedule_name, device...)
        is rank 0's; `last_stats` is by rank, `last_events` every rank's."""
        ranks = self.__dict__.get("_ranks")
        if ranks is None or name.startswith("__"):
            raise AttributeError(name)
        if name == "last_stats":
            return {r: p.last_stats for r, p in enumerate(ranks)}
        if name == "last_events":
            return [e for p in ranks for e in p.last_events]
        return getattr(ranks[0], name)

    def _fixed_plan(self) -> Plan | None:
        """The plan given, or made from a manual split; None when the planner must decide."""
        assert self._chain is not None and self._model is not None
        plan, balance, split_points = self._split
        name = type(self._model).__name__
        if balance is not None or split_points is not None:
            return manual_plan(self._chain, self.world_size, self.schedule_name, balance,
                               split_points, model_name=name)
        if plan is None and self.world_size == 1:
            return manual_plan(self._chain, 1, self.schedule_name, balance=[len(self._chain)],
                               model_name=name)
        return plan

    def _check_ties_allowed(self, chain: LayerChain) -> None:
        """Weights tied across blocks (an embedding and the output head) have their gradients
        summed across stages before each update, which asynchronous schedules cannot do:
        refused here, before any work, naming the weights."""
        if self.schedule_name == "auto" or kind(self.schedule_name).synchronous:
            return
        tied = sorted(" = ".join(self._names.get(pid, ("?",))) for pid in shared_parameters(chain))
        plan = self._split[0]
        if tied and (plan is None or _ties_cross_stages(chain, plan)):
            raise ValueError(f"the model ties weights across blocks ({'; '.join(tied)}); on "
                             f"different stages a tied weight's gradients are summed before "
                             f"each update, which {self.schedule_name!r} cannot do (an "
                             f"asynchronous schedule updates its stages at different times). "
                             f"Use a synchronous schedule ({', '.join(SYNCHRONOUS)})")

    def _automatic_candidates(self) -> tuple[str, ...]:
        """schedule='auto' chooses among these: only synchronous ones for a model with tied
        weights, whose stages must agree before each update."""
        from pipedream_fast.planner.choose import AUTOMATIC
        assert self._chain is not None
        if shared_parameters(self._chain):
            return tuple(n for n in AUTOMATIC if kind(n).synchronous)
        return AUTOMATIC

    def _capture(self, example_inputs: Any) -> None:
        """Captures the model with torch.export on every rank from the structure of rank 0's
        first minibatch (zeros of its shapes and dtypes: values do not matter). Collective."""
        assert self._model is not None
        payload: list[Any] = [None]
        if self.rank == 0:
            payload[0] = pytree.tree_map(
                lambda t: _TensorShape(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                else t, example_inputs)
        structure = self._control.broadcast_object(payload[0], src=0)
        device = next(iter(self._model.parameters()), torch.empty(0)).device
        inputs = pytree.tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                                 if isinstance(t, _TensorShape) else t, structure)
        with GLOBAL_STATE:
            self._chain = trace_model(self._model, inputs, self._leaf_modules, check=False)
        self._check_ties_allowed(self._chain)

    # --- set-up ------------------------------------------------------------------------------
    @property
    def trace(self) -> bool:
        """Whether the next runs record a trace of their actions (`last_events`); may be
        switched between runs."""
        if self._threads is not None:
            return self._ranks[0].trace
        return self._trace

    @trace.setter
    def trace(self, value: bool) -> None:
        if self.__dict__.get("_threads") is not None:
            for pipe in self._ranks:
                pipe.trace = value
        else:
            self._trace = value

    @property
    def stage_modules(self) -> dict[int, nn.Module]:
        """The stages this rank holds (several in interleaved plans), by stage index; with
        ranks='threads', every stage (its first replica's)."""
        if self._threads is not None:
            return {i: m for p in reversed(self._ranks) for i, m in p.stage_modules.items()}
        return dict(self._modules)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers of this rank's stages, in stage order (one per stage with weights);
        with ranks='threads', every stage's (its first replica's)."""
        if self._threads is not None:
            found = {i: o for p in reversed(self._ranks) for i, o in p._optimizers.items()}
            self._ranks[0]._require_setup("optimizers")
            return [found[i] for i in sorted(found)]
        self._require_setup("optimizers")
        return [self._optimizers[i] for i in sorted(self._optimizers)]

    @property
    def schedulers(self) -> list[Any]:
        """The learning-rate schedulers of this rank's stages, in stage order (with
        ranks='threads', every stage's)."""
        if self._threads is not None:
            found = {i: s for p in reversed(self._ranks) for i, s in p._schedulers.items()}
            self._ranks[0]._require_setup("schedulers")
            return [found[i] for i in sorted(found)]
        self._require_setup("schedulers")
        return [self._schedulers[i] for i in sorted(self._schedulers)]

    def _require_setup(self, what: str) -> None:
        if self.plan is None:
            raise RuntimeError(f"{what} exist once the model is cut into stages: this Pipeline "
                               f"plans on its first minibatch (pass plan=, balance=, "
                               f"split_points= or example_inputs= to cut it at construction)")

    def _flatten(self, inputs: Any) -> tuple[Any, ...]:
        """A minibatch's (or microbatch's) inputs as the first stage's arguments."""
        assert self._chain is not None
        return self._chain.flatten_inputs(inputs)

    def _plan_from(self, example_inputs: Any) -> Plan:
        """Rank 0 profiles `example_inputs` and plans; every rank gets the plan (or the error)."""
        payload: list[Any] = [None]
        if self.rank == 0:
            try:
                payload[0] = {"plan": self._make_plan(example_inputs).to_dict()}
            except Exception as err:  # every rank must hear of it, not wait for a plan
                payload[0] = {"error": f"{type(err).__name__}: {err}"}
        planned = self._control.broadcast_object(payload[0], src=0)
        if "error" in planned:
            raise RuntimeError(f"planning on rank 0 failed: {planned['error']}")
        return Plan.from_dict(planned["plan"])

    def _make_plan(self, example_inputs: Any) -> Plan:
        from pipedream_fast.planner import make_plan
        from pipedream_fast.planner.choose import plan_for
        from pipedream_fast.profiler import profile_model  # planning is rank 0's job
        from pipedream_fast.topology import Topology

        assert self._model is not None and self._chain is not None
        args = self._chain.flatten_inputs(example_inputs)
        profile = profile_model(self._model, args, batch_size=batch_size(example_inputs),
                                progress=False, chain=self._chain)
        topology = Topology.parse(f"{self.world_size}x1e9")
        if self._stages_wanted is not None:
            if self._stages_wanted != self.world_size:
                raise ValueError(f"stages={self._stages_wanted} runs one stage per rank, but this "
                                 f"job has {self.world_size} ranks")
            name = "1f1b" if self.schedule_name == "auto" else self.schedule_name
            return make_plan(profile, topology, schedule=kind(name).plans_as or name,
                             strategy="time", straight=True)
        if self.schedule_name == "auto":
            return self._choose_runnable(profile, topology, self._chunks_for(example_inputs))
        return plan_for(self.schedule_name, profile, topology)

    def _choose_runnable(self, profile: Any, topology: Any, chunks: int) -> Plan:
        """schedule='auto': the fastest candidate whose options this Pipeline meets (2bw, for
        one, needs at least as many chunks as ranks); a candidate that cannot run with them
        is dropped and the choice made again."""
        from pipedream_fast.planner.choose import choose_schedule
        candidates = list(self._automatic_candidates())
        while True:
            plan = choose_schedule(profile, topology, candidates=tuple(candidates))
            try:
                build_schedule(plan, plan.schedule, self.world_size, chunks,
                               self.options.schedule_options)
                return plan
            except ValueError:
                candidates.remove(plan.schedule)
                if not candidates:
                    raise

    def _setup(self, plan: Plan) -> None:
        """Cuts this rank's stages out of the model and makes their optimizers, transport and
        agreement across stages. Collective: every rank calls it with the same plan."""
        if plan.workers != self.world_size:
            raise FormatError(f"the plan is for {plan.workers} workers but this job has "
                              f"{self.world_size} ranks; start {plan.workers} processes or make "
                              f"a plan for {self.world_size}")
        self.schedule_name = resolve_schedule(self.schedule_name, plan)
        self.options = self.options.replace(schedule=self.schedule_name)  # auto: now known
        assert self._chain is not None  # captured before any plan is set up
        check_plan_fits(plan, self._chain)
        self._check_same_model_everywhere(self._chain)
        self.plan = plan
        self.stage_indices = plan.stages_of_rank(self.rank)
        if self._factory_built:  # the real model rank 0 profiled: freed, cut as on every rank
            for block in self._chain.blocks:
                self._materialize(block.module, torch.device("meta"))
            self._factory_built = False
        for index in self.stage_indices:
            stage_plan = plan.stages[index]
            module = self._chain.stage_module(stage_plan.start, stage_plan.stop)
            if self._shares_model and self._needs_own_copy(plan, index):
                module = self._own_copy(module)
            self._materialize(module, self.device, index)
            self._modules[index] = module.to(self.device)
        for index, module in self._modules.items():
            params = list(module.parameters())
            if params:
                self._optimizers[index] = self._optimizer_factory(params)
                if self._scheduler_factory is not None:
                    self._schedulers[index] = self._scheduler_factory(self._optimizers[index])
        self._transport = self._new_transport()
        tied = self._tie_weights(plan)
        skip_nan = self.on_nan == "skip"
        if self.clip_grad_norm is not None or self._scaler is not None or tied or skip_nan:
            if not kind(self.schedule_name).synchronous:
                wants = [w for w, on in (("clip_grad_norm", self.clip_grad_norm is not None),
                                         ("precision='fp16'", self._scaler is not None),
                                         ("on_nan='skip'", skip_nan),
                                         ("tied weights across stages", bool(tied))) if on]
                raise ValueError(f"{' and '.join(wants)} need every stage to agree before "
                                 f"each update, which only synchronous schedules allow "
                                 f"({', '.join(SYNCHRONOUS)}); {self.schedule_name!r} updates "
                                 f"its stages at different times")
            self._sync = GlobalUpdateSync(
                self._control, {i: len(plan.stages[i].ranks) for i in self.stage_indices},
                self.clip_grad_norm, self._scaler, tied, skip_nonfinite=skip_nan)
        self._model = None  # only this rank's stages are kept
        self._restore_pending()

    def _new_transport(self, stage_groups: bool = True) -> Transport:
        """Point-to-point links of their own (a run left early abandons them with receives
        still posted, which must not disturb other traffic) and the replica all-reduce
        groups, released with the Pipeline. Collective."""
        assert self.plan is not None
        return self._world.transport([s.ranks for s in self.plan.stages] if stage_groups
                                     else [], self.device, self.tuning)

    def _tie_weights(self, plan: Plan) -> list[TiedWeight]:
        """The weights this rank shares with other ranks' stages: each gets a process group
        of the ranks holding it and starts from the first holder's values. Collective."""
        stage_of_block = {b: i for i, s in enumerate(plan.stages) for b in range(s.start, s.stop)}
        tied: list[TiedWeight] = []
        assert self._chain is not None
        blocks_by_param = shared_parameters(self._chain)
        params = {id(p): p for b in self._chain.blocks for p in b.module.parameters()}
        for pid, blocks in sorted(blocks_by_param.items(), key=lambda kv: kv[1]):
            holders = sorted({stage_of_block[b] for b in blocks})
            if len(holders) < 2:
                continue  # used twice within one stage: autograd sums it already
            ranks = sorted({r for s in holders for r in plan.stages[s].ranks})
            name = " = ".join(self._names.get(pid, ("a weight",)))
            mine = [s for s in holders if s in self.stage_indices]
            if len(mine) > 1:
                raise ValueError(f"{name} is used by stages {holders}, of which this rank holds "
                                 f"{mine}; tied weights need their stages on different ranks")
            group = self._world.new_group(ranks)  # collective: every rank, same order
            if mine:
                assert group is not None
                param = self._copied.get(pid, params[pid])
                src = plan.stages[holders[0]].ranks[0]
                with torch.no_grad():
                    group.broadcast(param.data, src=src)
                tied.append(TiedWeight(param, group, counts_in_norm=mine[0] == holders[0],
                                       replicas=len(plan.stages[mine[0]].ranks)))
        return tied

    def _needs_own_copy(self, plan: Plan, index: int) -> bool:
        """Rank threads share the caller's model: a stage's first rank trains the user's own
        modules; a replica, or a later stage holding a weight tied to an earlier one, needs
        tensors of its own (as a process has), made from the same values."""
        if plan.stages[index].ranks[0] != self.rank:
            return True
        assert self._chain is not None
        stage_of_block = {b: i for i, s in enumerate(plan.stages) for b in range(s.start, s.stop)}
        return any(index in holders and min(holders) < index
                   for holders in ({stage_of_block[b] for b in blocks}
                                   for blocks in shared_parameters(self._chain).values()))

    def _own_copy(self, module: nn.Module) -> nn.Module:
        """A deep copy of a stage for this rank alone; its tensors keep the model's names
        (`_names`), and `_copied` finds a copy from the original's id."""
        memo: dict[int, Any] = {}
        with GLOBAL_STATE:
            copied = copy.deepcopy(module, memo)
        for pid, keys in list(self._names.items()):
            if pid in memo and isinstance(memo[pid], torch.Tensor):
                self._names[id(memo[pid])] = keys
                self._copied[pid] = memo[pid]
        return copied

    def _check_same_model_everywhere(self, chain: Any) -> None:
        """Every rank must have built the same model; compared before any training."""
        prints = self._control.all_gather_object(model_fingerprint(chain))
        for rank, other in enumerate(prints):
            if other != prints[0]:
                differ = next(i for i, (a, b) in enumerate(zip(prints[0], other)) if a != b) \
                    if len(other) == len(prints[0]) else None
                where = (f"block {differ} ({prints[0][differ][0]})" if differ is not None
                         else f"{len(prints[0])} vs {len(other)} blocks")
                raise FormatError(f"rank {rank} built a different model than rank 0 ({where}); "
                                  f"every rank must construct the same model")

    def _materialize(self, module: nn.Module, device: torch.device, stage: int = 0) -> None:
        """The meta tensors of a stage get real memory on `device` (only this rank's stages are
        ever allocated), initialised by each layer's reset_parameters() under a seed of
        (`seed`, `stage`), so that the replicas of a stage start alike. With `device` meta,
        every tensor of `module` goes back to meta instead (the real model rank 0 built from
        a factory to profile it). Each tensor keeps its identity (`torch.utils.swap_tensors`,
        where `to_empty` would make new Parameters): weights tied within a stage or across
        stages stay tied, and `_names` (tensor -> state_dict keys) still names it."""
        to_meta = device.type == "meta"
        tensors = {id(t): t for t in itertools.chain(module.parameters(), module.buffers())
                   if t.is_meta != to_meta}
        if not tensors:
            return

        def empty(t: torch.Tensor) -> torch.Tensor:
            # NaN, so that a tensor no reset_parameters() sets is found below
            new = (torch.full_like(t, float("nan"), device=device) if t.is_floating_point()
                   and not to_meta else torch.zeros_like(t, device=device))
            return nn.Parameter(new, t.requires_grad) if isinstance(t, nn.Parameter) else new

        with torch.no_grad():
            for t in tensors.values():
                t.grad = None
                torch.utils.swap_tensors(t, empty(t))
        if to_meta:
            return
        with GLOBAL_STATE, torch.random.fork_rng(
                devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.seed * 1_000_003 + stage)
            for sub in module.modules():
                # nn.MultiheadAttention names its initialisation _reset_parameters
                reset = getattr(sub, "reset_parameters", getattr(sub, "_reset_parameters", None))
                if callable(reset):
                    reset()
        left = {self._names.get(id(t), (name,))[0]: t for name, t in itertools.chain(
            module.named_parameters(), module.named_buffers())
            if id(t) in tensors and t.is_floating_point() and bool(t.isnan().any())}
        if left:
            import warnings
            with torch.no_grad():
                for t in left.values():
                    t.masked_fill_(t.isnan(), 0.0)
            warnings.warn(f"rank {self.rank}: {', '.join(list(left)[:5])}"
                          f"{f' (and {len(left) - 5} more)' if len(left) > 5 else ''} of stage "
                          f"{stage} start at zero: the model was built on the meta device and "
                          f"no reset_parameters() of its modules sets them. Give their module a "
                          f"reset_parameters(), or pass a built model", stacklevel=3)

    def _runtimes_for(self, schedule: Schedule) -> dict[int, StageRuntime]:
        assert self.plan is not None
        for index, module in self._modules.items():
            if index not in self._runtimes:
                self._runtimes[index] = stage_runtime(
                    self.plan, index, self.rank, module, self._optimizers.get(index), schedule,
                    self.loss_fn, self._schedulers.get(index), self.precision, self.tuning,
                    optimizer_factory=self._optimizer_factory,
                    scheduler_factory=self._scheduler_factory)
                self._restore_copies(self._runtimes[index])
            check_runtime_fits(self._runtimes[index], schedule, self.rank)
        return self._runtimes

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

    # --- data ----------------------------------------------------------------------------------
    def _open_data(self, loader: Any, steps: int | None, epochs: int | None,
                   evaluation: bool = False
                   ) -> tuple[int, int, pytree.TreeSpec, Iterator[Any] | None]:
        """Agrees on a run's data: the first stage's first rank reads the first batch, checks
        the loader and tells every rank the steps, chunks, target structure and where the
        loader's reading begins. Returns those and, on first-stage ranks, the batches.
        Collective.

        Training goes on where the last run stopped (or the checkpoint `load` read): the same
        loader, or the first one after `load`, at the next batch of the epoch in progress;
        another loader at the start of a new epoch. `epochs=N` then trains to the end of the
        N-th epoch, counting the one in progress. Evaluation reads its loader from the start.

        `evaluation`: a short last batch is padded to the full size and each target gets a
        mask of the real samples, so that nothing is dropped and nothing counted twice (not
        for a model that computes its own loss: padding would enter its mean, so a short last
        batch is refused)."""
        user_loader = loader
        if self._inputs_only and loader is not None:
            loader = InputsOnly(loader)
        epoch, index = self._epoch, 0 if evaluation else self._epoch_batches
        if (not evaluation and index and self._last_loader is not None
                and user_loader is not self._last_loader):
            epoch, index = epoch + 1, 0  # another loader: a new epoch
        if self.plan is None:  # cut and plan on the first minibatch
            if self.rank == 0:
                self._peeked = self._peek(loader, self._open_batches(
                    user_loader, loader, epoch, index, evaluation))
            first = self._peeked[1][0] if self._peeked else None
            if self._chain is None:
                self._capture(first)
            self._setup(self._fixed_plan() or self._plan_from(first))
        assert self.plan is not None
        lead = self.plan.stages[0].ranks[0]
        payload: list[Any] = [None]
        batches: Iterator[Any] | None = None
        source: EpochBatches | None = None
        if self.rank == lead:
            try:
                peeked, self._peeked = self._peeked, None
                source, first = peeked if peeked is not None else self._peek(
                    loader, self._open_batches(user_loader, loader, epoch, index, evaluation))
                chunks = self._chunks_for(first[0])
                check_loader(loader, chunks, allow_short_last=evaluation and not self._inputs_only)
                size = batch_size(first[0])
                target = (first[1], torch.ones(size, dtype=torch.bool)) if evaluation else first[1]
                total = steps_for(loader, steps, epochs)
                if steps is None:  # epochs: the rest of the epoch in progress is the first
                    total -= index
                payload[0] = {"steps": total, "chunks": chunks,
                              "target": pytree.treespec_dumps(target_spec(target)),
                              "epoch": epoch, "index": index, "batch_size": size}
                batches = itertools.chain([first], source)
            except Exception as err:  # every rank must hear of it
                payload[0] = {"error": f"{type(err).__name__}: {err}"}
        self._agree(lambda: payload.__setitem__(0, self._control.broadcast_object(payload[0],
                                                                                  src=lead)),
                    f"the start of the run (rank {lead} reads the data)")
        if "error" in payload[0]:
            raise ValueError(f"the data loader on rank {lead} (first stage): "
                             f"{payload[0]['error']}")
        agreed = payload[0]
        self._agreed_batch = agreed["batch_size"]
        if 0 in self.stage_indices and batches is None:  # a replica of the first stage
            source = self._open_batches(user_loader, loader, agreed["epoch"], agreed["index"],
                                        evaluation)
            batches = source
        if not evaluation:
            self._epoch, self._epoch_batches = agreed["epoch"], agreed["index"]
            self._reading = (source, self._step) if source is not None else None
        if len(self.plan.stages[0].ranks) > 1:
            batches = self._check_replicas_read_alike(batches)
        if evaluation and batches is not None:
            batches = (pad_batch(b, agreed["batch_size"]) for b in batches)
        return agreed["steps"], agreed["chunks"], pytree.treespec_loads(agreed["target"]), batches

    def _open_batches(self, user_loader: Any, loader: Any, epoch: int, index: int,
                      evaluation: bool) -> EpochBatches:
        """The batches of `loader` from batch `index` of `epoch` on: the last run's, read on,
        when it stopped there on this loader, else read again from the epoch's start."""
        live = self._live
        if (not evaluation and live is not None and user_loader is self._last_loader
                and live.position(live.read) == (epoch, index)):
            return live.rest()
        return EpochBatches(loader, self.seed, epoch, index,
                            one_shot=isinstance(user_loader, Iterator))

    def _check_replicas_read_alike(self, batches: Iterator[Any] | None) -> Iterator[Any] | None:
        """The replicas of the first stage must read the same batches (each takes its share of
        every one). The seeded random state makes torch's, Python's and NumPy's shuffling
        agree; a loader drawing from a random state of its own would not, and is caught here
        on the run's first batch. Collective."""
        assert self.plan is not None
        first = next(batches, None) if batches is not None else None
        prints: list[Any] = []
        self._agree(lambda: prints.extend(self._control.all_gather_object(
            None if first is None else fingerprint(first))),
                    "comparing the first stage's first batches")
        seen = {prints[r] for r in self.plan.stages[0].ranks}
        if len(seen) > 1:
            raise ValueError(f"the replicas of the first stage (ranks {list(self.plan.stages[0].ranks)}) "
                             f"read different first batches: the loader's order depends on a "
                             f"random state other than torch's, Python's or NumPy's global one "
                             f"(a generator of its own?); seed it the same on every rank, or "
                             f"derive it from the epoch")
        if batches is None or first is None:
            return batches
        return itertools.chain([first], batches)

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

    def _peek(self, loader: Any, source: EpochBatches) -> tuple[EpochBatches, Any]:
        """Reads the first batch of `source` (the batches of `loader`), checked."""
        if loader is None:
            raise ValueError("the first stage's ranks need the loader; got None")
        first = next(source, None)
        if first is None:
            raise ValueError("the data loader is empty")
        if not isinstance(first, (tuple, list)) or len(first) != 2:
            raise TypeError(f"the loader must yield (inputs, targets) pairs, got "
                            f"{type(first).__name__}")
        return source, first

    # --- training -----------------------------------------------------------------------------
    def train(self, loader: Iterable[Any] | None, steps: int | None = None, *,
              epochs: int | None = None) -> Iterator[torch.Tensor | None]:
        """Trains `steps` minibatches, or `epochs` passes over the loader (default: one pass),
        from `loader` (pairs of inputs, targets; a re-iterable loader is read again for each
        epoch and left usable). Only first-stage ranks read it (others may pass None). A run
        goes on where the last one (or the checkpoint `load` read) stopped: the same loader,
        or the first one after `load`, at the next batch of the epoch in progress, and
        `epochs=N` ends with the N-th epoch counting that one; another loader begins a new
        epoch. Yields
        each step's mean microbatch loss, the same on every rank (a replicated stage's ranks
        see only their share: one small all-reduce per step combines them). With
        `checkpoint_dir`, the pipeline drains and saves every `checkpoint_every` steps.
        SIGTERM stops every rank after the same step, a few steps later (see
        `pipedream_fast.stopping`): the pipeline is left as by a `break`, a checkpoint is
        saved if there is a `checkpoint_dir`, and `Stopped` (a `SystemExit` with code 143) is
        raised. Collective: every rank must iterate it."""
        if self._threads is not None:
            def start(rank: int, request: DeferredStop) -> Iterator[torch.Tensor | None]:
                self._ranks[rank]._stop_request = request
                return self._ranks[rank].train(loader, steps, epochs=epochs)
            yield from self._threads.train(start)
            return
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
                    vote = StopVote(self._control, self.world_size, len(self.plan.stages) + 1,
                                    self._agree)
                    done += yield from self._run(run, chunks, spec, batches, request, vote)
                    if vote.signum:
                        self._stop(vote.signum)
                    if self.checkpoint_every and self._step % self.checkpoint_every == 0:
                        self._save_periodic()
        finally:
            if self._reading is not None:  # where the next run (or a checkpoint) goes on
                (source, began), self._reading = self._reading, None
                consumed = self._step - began  # the steps trained, not the batches read ahead
                self._epoch, self._epoch_batches = source.position(consumed)
                self._last_loader = loader
                self._live = source if source.read == consumed and self._epoch_batches else None

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
        executor = Executor(schedule, self.rank, runtimes, self._transport, inputs,
                            target_spec=spec, trace=self.trace, update_sync=self._sync)
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
        self.last_events = executor.events or []

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

    def step(self, inputs: Any, targets: Any) -> torch.Tensor | None:
        """One minibatch of a synchronous schedule (gpipe, 1f1b, data-parallel)."""
        if self.schedule_name not in SYNCHRONOUS:
            raise ValueError(f"step() trains one flushed minibatch and needs a synchronous "
                             f"schedule ({', '.join(SYNCHRONOUS)}); {self.schedule_name!r} "
                             f"streams microbatches: use train(loader, steps)")
        out = list(self.train([(inputs, targets)], steps=1))
        return out[-1]

    # --- evaluation and inference ---------------------------------------------------------------
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
        steps, chunks, spec, batches = self._open_data(loader, steps, None, evaluation=True)
        self._source = None  # evaluation does not count as an epoch of training
        assert self.plan is not None
        schedule = forward_only([s.ranks for s in self.plan.stages], steps * chunks)
        inputs = None
        if batches is not None:
            feed = MicrobatchFeed(batches, chunks, feed_uses(schedule, [self.rank]))
            inputs = data_source(feed, schedule, self.rank, self._flatten, self.device)
        sums: dict[str, float] = dict.fromkeys(["loss", *metrics], 0.0)
        count = [0]

        def sink(mb: int, out: Any, masked: Any) -> None:
            target, real = masked
            n = int(real.sum())
            if n == 0:
                return  # all padding
            if n < real.numel():  # the padded tail of a short last batch
                out, target = (pytree.tree_map(lambda t: t[real], v) for v in (out, target))
            sums["loss"] += float(self.loss_fn(out, target)) * n
            for name, fn in metrics.items():
                sums[name] += float(fn(out, target)) * n
            count[0] += n

        self._forward_only(schedule, inputs, spec, sink,
                           key=(self._agreed_batch, chunks, pytree.treespec_dumps(spec)))
        parts: list[Any] = []
        self._agree(lambda: parts.extend(self._control.all_gather_object((sums, count[0]))),
                    "gathering the metrics")
        total = sum(n for _, n in parts)
        return {name: sum(p[name] for p, _ in parts) / max(total, 1) for name in sums}

    @_on_every_rank(_first_given)
    def predict(self, inputs: Any, everywhere: bool = False) -> Any:
        """The model's outputs for one minibatch of `inputs` (eval mode, no gradients), on the
        ranks of the last stage (None elsewhere), or on every rank with `everywhere`. Every
        rank passes the same inputs (only the first stage's ranks read them). Collective."""
        self._require_setup("predict()")
        assert self.plan is not None
        chunks = self._chunks_for(inputs)
        parts = split_microbatches(inputs, chunks)
        schedule = forward_only([s.ranks for s in self.plan.stages], chunks)
        spec = pytree.tree_flatten(())[1]  # no target: nothing travels with the inputs

        def source(mb: int) -> tuple[tuple[Any, ...], Any]:
            return self._flatten(to_device(parts[mb], self.device)), ()

        outputs: dict[int, Any] = {}
        self._forward_only(schedule, source if 0 in self.stage_indices else None, spec,
                           lambda mb, out, _: outputs.__setitem__(mb, pytree.tree_map(
                               lambda t: t.detach().cpu(), out)),
                           key=(batch_size(inputs), chunks, pytree.treespec_dumps(spec)))
        last = len(self.plan.stages) - 1
        if everywhere or len(self.plan.stages[last].ranks) > 1:
            gathered: list[Any] = []
            self._agree(lambda: gathered.extend(self._control.all_gather_object(outputs)),
                        "gathering the outputs")
            for part in gathered:
                outputs.update(part)
        if not everywhere and last not in self.stage_indices:
            return None
        ordered = [outputs[mb] for mb in range(chunks)]
        return pytree.tree_map(_join_microbatches, *ordered) if chunks > 1 else ordered[0]

    # --- state ------------------------------------------------------------------------------
    @_on_every_rank(_rank_0)
    def state_dict(self) -> dict[str, torch.Tensor] | None:
        """The whole model's state under its `state_dict()` keys, on rank 0 (None elsewhere):
        a tied weight under each of its keys as one tensor, no non-persistent buffers, so a
        fresh model loads it with `strict=True`. Collective: every rank must call it."""
        self._require_setup("state_dict()")
        assert self.plan is not None
        mine = named_state([m for i, m in self._modules.items()
                            if self.plan.stages[i].ranks[0] == self.rank], self._names)
        box: list[Any] = [None]
        self._agree(lambda: box.__setitem__(0, self._control.gather_object(mine, dst=0)),
                    "gathering the model")
        gathered = box[0]
        if gathered is None:
            return None
        full: dict[str, torch.Tensor] = {}
        for part in gathered:
            full.update(part)
        return ckpt.share_aliases(full, self._aliases())

    def _aliases(self) -> list[tuple[str, ...]]:
        """The groups of keys that name one tensor of the model (tied weights)."""
        return [keys for keys in self._names.values() if len(keys) > 1]

    @_on_every_rank(_rank_0)
    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a checkpoint directory (see `pipedream_fast.checkpoint`): each stage's first
        rank writes its stage durably, then rank 0 commits the set with the manifest. Saving
        over an existing checkpoint stages the new one and swaps it in; a file, or a folder
        holding anything but a checkpoint, is refused on every rank (a save never deletes
        other files). Collective."""
        self._require_setup("save()")
        assert self.plan is not None
        final = Path(path)
        decided: list[Any] = [None]  # rank 0's: the folder to write, or why not
        if self.rank == 0:
            try:
                decided[0] = ckpt.prepare_save(final)
            except ckpt.CheckpointError as err:  # every rank must hear of it, not wait
                decided[0] = str(err)
        self._agree(lambda: decided.__setitem__(0, self._control.broadcast_object(decided[0],
                                                                                  src=0)),
                    "saving a checkpoint")
        if isinstance(decided[0], str):
            raise ckpt.CheckpointError(decided[0])
        folder: Path = decided[0]
        folder.mkdir(parents=True, exist_ok=True)
        entries = []
        for index, module in self._modules.items():
            if self.plan.stages[index].ranks[0] != self.rank:
                continue  # replicas hold the same weights: the first one writes them
            optimizer, scheduler = self._optimizers.get(index), self._schedulers.get(index)
            payload = {"model": named_state([module], self._names),
                       "optimizer": optimizer.state_dict() if optimizer else None,
                       "scheduler": scheduler.state_dict() if scheduler is not None else None}
            copies = self._copies_state(index)
            if copies is not None:
                payload["copies"] = copies
            entries.append((index, ckpt.write_stage(folder, index, payload)))
        # Where the loader stands, known to the first stage's ranks: during train() (a
        # periodic save, a stop) after the steps trained so far, whatever was read ahead.
        position = None
        if 0 in self.stage_indices:
            position = (self._reading[0].position(self._step - self._reading[1])
                        if self._reading is not None else (self._epoch, self._epoch_batches))
        gathered: list[Any] = []
        self._agree(lambda: gathered.extend(self._control.all_gather_object((entries, position))),
                    "saving a checkpoint")
        if self.rank == 0:
            epoch, index = next(p for _, p in gathered if p is not None)
            ckpt.write_manifest(folder, ckpt.manifest_for(
                self._step, epoch, self.schedule_name, self.plan.to_dict(),
                [e for part, _ in gathered for e in part], self._run_id, self._aliases(),
                epoch_batches=index, seed=self.seed))
            if folder != final:
                ckpt.swap_in(final)
        self._agree(self._control.barrier, "saving a checkpoint")

    def _copies_state(self, index: int) -> list[dict[str, Any]] | None:
        """localsgd: the weight copies of stage `index` beyond the module's own (copy 0), by
        the stage module's parameter names, with their optimizer and scheduler state."""
        runtime = self._runtimes.get(index)
        if runtime is None or len(runtime.copies) < 2:
            return self._saved_copies.get(index)  # loaded, not trained since: kept as read
        return [{"params": {n: p.detach().clone() for n, p in zip(runtime.param_names, c.params)},
                 "optimizer": c.optimizer.state_dict() if c.optimizer is not None else None,
                 "scheduler": c.scheduler.state_dict() if c.scheduler is not None else None}
                for c in runtime.copies[1:]]

    def _restore_copies(self, runtime: StageRuntime) -> None:
        """Puts the weight copies a checkpoint saved (`load`) into a new stage runtime."""
        saved = self._saved_copies.pop(runtime.stage, None)
        if saved is None:
            return
        if len(saved) != len(runtime.copies) - 1:
            raise ckpt.CheckpointError(f"the checkpoint holds {len(saved) + 1} weight copies of "
                                       f"stage {runtime.stage} (localsgd model_replicas) but this "
                                       f"run keeps {len(runtime.copies)}; use the same "
                                       f"model_replicas")
        for weights, state in zip(runtime.copies[1:], saved):
            with torch.no_grad():
                for name, p in zip(runtime.param_names, weights.params):
                    p.copy_(state["params"][name])
            if state["optimizer"] is not None and weights.optimizer is not None:
                weights.optimizer.load_state_dict(state["optimizer"])
            if state.get("scheduler") is not None and weights.scheduler is not None:
                weights.scheduler.load_state_dict(state["scheduler"])

    def _save_periodic(self) -> None:
        assert self.checkpoint_dir is not None
        root = Path(self.checkpoint_dir)
        self.save(root / f"step-{self._step}")
        if self.rank == 0:
            ckpt.prune(root, self.checkpoint_keep, self._run_id)

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
        folder, notes = ckpt.resolve(Path(path))
        manifest = ckpt.read_manifest(folder)
        plan = Plan.from_dict(manifest["plan"])
        _check_split_matches(plan, kwargs)  # the arguments the run was built with are fine
        index = manifest.get("epoch_batches", 0)
        if manifest.get("seed") is not None:  # it draws the order of the epoch in progress
            seed = kwargs.setdefault("seed", manifest["seed"])
            if seed != manifest["seed"] and index:
                raise ValueError(f"seed={seed!r} disagrees with the checkpoint's "
                                 f"({manifest['seed']}), saved after {index} batches of epoch "
                                 f"{manifest['epoch']}, whose order that seed drew; leave seed "
                                 f"out to continue the run")
        with ckpt.resuming(manifest):  # the run goes on under its id, in its checkpoint_dir
            pipe = cls(model, loss_fn, optimizer, plan=plan, **kwargs)
        if pipe.rank == 0:
            for note in notes:
                print(f"pipedream_fast: {note}", flush=True)
        pipe._resume(folder, manifest)
        return pipe

    @_on_every_rank(_rank_0)
    def _resume(self, folder: Path, manifest: dict[str, Any]) -> None:
        """Where `load` puts the checkpoint: weights and states now, or once the model is
        cut (a model captured at its first minibatch); the step and the loader's place."""
        self._pending_restore = (folder, manifest)
        if self.plan is not None:
            self._restore_pending()
        self._step = int(manifest["step"])
        self._epoch = int(manifest["epoch"])
        self._epoch_batches = int(manifest.get("epoch_batches", 0))

    def _restore_pending(self) -> None:
        """Puts a checkpoint's weights, optimizer and scheduler state into this rank's stages
        (`load`; deferred to the cut for a model captured at its first minibatch)."""
        if self._pending_restore is None:
            return
        (folder, manifest), self._pending_restore = self._pending_restore, None
        for index in self.stage_indices:
            saved = ckpt.load_stage(folder, manifest, index)
            ckpt.restore(self._modules[index], self._names, saved["model"],
                         str(folder / manifest["files"][str(index)]["file"]),
                         exact=manifest["format"] != ckpt.LEGACY)
            if saved["optimizer"] is not None and index in self._optimizers:
                self._optimizers[index].load_state_dict(saved["optimizer"])
            if saved.get("scheduler") is not None and index in self._schedulers:
                self._schedulers[index].load_state_dict(saved["scheduler"])
            if saved.get("copies") is not None:  # localsgd: restored into the first run's stage
                self._saved_copies[index] = saved["copies"]

    def close(self) -> None:
        """Stops this Pipeline's communication threads and removes its process groups (not the
        default group, which a script may still use; one the Pipeline started goes at exit).
        Also done when the Pipeline is garbage-collected, and at exit."""
        if self._threads is not None:
            for pipe in self._ranks:
                pipe.close()
            return
        self._world.release()
        self._transport = None
        self._inference_transports.clear()
