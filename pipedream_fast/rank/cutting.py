"""A rank's stages (`Stages`): capturing the model (at the first minibatch, when torch.export
needs inputs), agreeing on a plan (the planner on rank 0), taking this rank's stages out of
it (materialised; copied where rank threads would share a tensor, or where two stages of
the rank tie one), their optimizers, stage runtimes, transports and the agreement across
stages before updates (clipping, tied weights, fp16).
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import traceback
import warnings
from dataclasses import dataclass
from typing import Any
from collections.abc import Callable

import torch
from torch import nn

from torch.utils import _pytree as pytree

from pipedream_fast.formats import FormatError, Plan
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.memory import MemoryMeter
from pipedream_fast.runtime.stage import (StageRuntime)
from pipedream_fast.runtime.transport import Transport
from pipedream_fast.runtime.update_sync import GlobalUpdateSync, LossScaler, TiedWeight
from pipedream_fast.schedules import SYNCHRONOUS, kind
from pipedream_fast.tracing import LayerChain, NeedsExampleInputs, TracingError, shared_parameters
from pipedream_fast.tracing import trace as trace_model
from pipedream_fast.training import (GLOBAL_STATE, build_schedule, check_plan_fits,
                                     check_runtime_fits, manual_plan, model_fingerprint,
                                     original_names, resolve_schedule, batch_size,
                                     stage_runtime)
from pipedream_fast.world import ThreadWorld
from pipedream_fast.formats import Profile
from pipedream_fast.options import planned_recompute, recompute_spec
from pipedream_fast.data_feed import sample_shapes, split_microbatches
from pipedream_fast.rank.state import RankContext


# Rank threads capture the one shared model in turns: a capture that failed on one is not
# tried again by the next (a minute of torch.export each), which fails the same way at once.
# Per model, for one capture call: emptied once every rank has heard the outcomes.
_FAILED_CAPTURES: dict[int, Exception] = {}


def _again(err: Exception) -> Exception:
    """The same failure, as a new exception object for another rank thread to raise."""
    try:
        copy = type(err)(*err.args)
    except Exception:  # noqa: BLE001 - an exception type that takes other arguments
        copy = TracingError(str(err))
    copy.__cause__ = err.__cause__
    return copy


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


class Stages:
    """The model and this rank's cut of it (see the module's docstring).

    Owns: `model` (until it is cut; None after), `chain` (the captured model; None until the
    first minibatch where torch.export needs one), `split` (how to cut: a plan, a balance or
    split points), `plan` and `stage_indices` (the stages of this rank), by stage index the
    stage `modules`, their `optimizers`, `schedulers` and `runtimes`, the training `transport`
    and the forward-only ones (`inference_transports`), `sync` (the agreement across stages
    before updates) and `scaler` (fp16), `names` (tensor id -> the model's state_dict keys),
    `copies` (by stage, a model tensor's id -> the stage's own copy, where it has one), and
    rank 0's per-block `profile`. Others read these; only this class changes them.

    Two hooks let the checkpoint part put saved state in as stages are made: `on_cut()` after
    `setup`, `on_runtime(runtime)` when a stage runtime is made.
    """

    def __init__(self, ctx: RankContext, model: nn.Module, *, leaf_modules: tuple[Any, ...],
                 split: tuple[Plan | None, tuple[int, ...] | None, tuple[str, ...] | None],
                 factory_built: bool, built_on_meta: bool, profile: Profile | None) -> None:
        self.ctx = ctx
        self.model: nn.Module | None = model
        self.leaf_modules = leaf_modules
        self.split = split
        # a factory's real model on rank 0 (to profile it): back to meta once cut
        self.factory_built = factory_built
        self.built_on_meta = built_on_meta  # the model was built on the meta device
        # Rank threads share the caller's model (copies only where a rank needs its own).
        self.shares_model = isinstance(ctx.world, ThreadWorld)
        self.copies: dict[int, dict[int, Any]] = {}
        self.names = original_names(model)
        self.chain: LayerChain | None = None
        self.plan: Plan | None = None
        self.stage_indices: tuple[int, ...] = ()
        self.modules: dict[int, nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}
        self.schedulers: dict[int, Any] = {}
        self.runtimes: dict[int, StageRuntime] = {}
        self.transport: Transport | None = None
        # Forward-only traffic, one transport per (batch size, chunks, target structure):
        # every link keeps the shapes of its first message.
        self.inference_transports: dict[tuple[Any, ...], Transport] = {}
        self.sync: GlobalUpdateSync | None = None
        self.scaler = LossScaler() if ctx.precision == "fp16" else None
        self.profile = profile if ctx.rank == 0 else None
        # measure_memory: what the microbatches in flight hold, over the stages' runtimes
        self.meter = MemoryMeter() if ctx.options.measure_memory else None
        self.on_cut: Callable[[], None] = lambda: None
        self.on_runtime: Callable[[StageRuntime], None] = lambda runtime: None

    def require_setup(self, what: str) -> None:
        if self.plan is None:
            raise RuntimeError(f"{what} exist once the model is cut into stages: this Pipeline "
                               f"plans on its first minibatch (pass plan=, balance=, "
                               f"split_points= or example_inputs= to cut it at construction)")

    def flatten(self, inputs: Any) -> tuple[Any, ...]:
        """A minibatch's (or microbatch's) inputs as the first stage's arguments."""
        assert self.chain is not None
        return self.chain.flatten_inputs(inputs)

    def aliases(self) -> list[tuple[str, ...]]:
        """The groups of keys that name one tensor of the model (tied weights); once each,
        though a stage's own copy of a tensor is named as the tensor is."""
        return list(dict.fromkeys(keys for keys in self.names.values() if len(keys) > 1))

    def try_capture(self, example_inputs: Any) -> None:
        """Captures the model now where torch.fx can (or `example_inputs` are given); else it
        is captured at the first minibatch (`capture`)."""
        assert self.model is not None
        try:
            with GLOBAL_STATE:
                self.chain = trace_model(self.model, example_inputs, self.leaf_modules,
                                         check=False)
        except NeedsExampleInputs:
            pass  # torch.export needs inputs: the model is cut at its first minibatch

    def fixed_plan(self) -> Plan | None:
        """The plan given, or made from a manual split; None when the planner must decide."""
        assert self.chain is not None and self.model is not None
        plan, balance, split_points = self.split
        name = type(self.model).__name__
        if balance is not None or split_points is not None:
            return manual_plan(self.chain, self.ctx.world_size, self.ctx.schedule_name, balance,
                               split_points, model_name=name)
        if plan is None and self.ctx.world_size == 1:
            return manual_plan(self.chain, 1, self.ctx.schedule_name, balance=[len(self.chain)],
                               model_name=name)
        return plan

    def check_ties_allowed(self, chain: LayerChain) -> None:
        """Weights tied across blocks (an embedding and the output head) have their gradients
        summed across stages before each update, which asynchronous schedules cannot do:
        refused here, before any work, naming the weights."""
        if self.ctx.schedule_name == "auto" or kind(self.ctx.schedule_name).synchronous:
            return
        tied = sorted(" = ".join(self.names.get(pid, ("?",))) for pid in shared_parameters(chain))
        plan = self.split[0]
        if tied and (plan is None or _ties_cross_stages(chain, plan)):
            raise ValueError(f"the model ties weights across blocks ({'; '.join(tied)}); on "
                             f"different stages a tied weight's gradients are summed before "
                             f"each update, which {self.ctx.schedule_name!r} cannot do (an "
                             f"asynchronous schedule updates its stages at different times). "
                             f"Use a synchronous schedule ({', '.join(SYNCHRONOUS)})")

    def automatic_candidates(self) -> tuple[str, ...]:
        """schedule='auto' chooses among these: only synchronous ones for a model with tied
        weights, whose stages must agree before each update."""
        from pipedream_fast.planner.choose import AUTOMATIC
        assert self.chain is not None
        if shared_parameters(self.chain):
            return tuple(n for n in AUTOMATIC if kind(n).synchronous)
        return AUTOMATIC

    def capture(self, example_inputs: Any) -> None:
        """Captures the model with torch.export on every rank from the structure of rank 0's
        first minibatch (zeros of its shapes and dtypes: values do not matter). Collective."""
        assert self.model is not None
        payload: list[Any] = [None]
        if self.ctx.rank == 0:
            payload[0] = pytree.tree_map(
                lambda t: _TensorShape(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor)
                else t, example_inputs)
        structure = self.ctx.control.broadcast_object(payload[0], src=0)
        device = next(iter(self.model.parameters()), torch.empty(0)).device
        inputs = pytree.tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
                                 if isinstance(t, _TensorShape) else t, structure)
        key = id(self.model)
        failure: Exception | None = None
        try:
            with GLOBAL_STATE:
                earlier = _FAILED_CAPTURES.get(key)
                if earlier is not None:  # a rank thread before this one failed on this model
                    raise _again(earlier)
                try:
                    self.chain = trace_model(self.model, inputs, self.leaf_modules,
                                              check=False)
                except Exception as err:
                    _FAILED_CAPTURES[key] = err
                    raise
        except Exception as err:  # noqa: BLE001 - agreed on below, then raised
            failure = err
        # Every rank hears of every rank's outcome: one that failed must not leave the others
        # waiting for it (or a rank thread starting a capture the first one knows fails).
        outcomes = self.ctx.control.all_gather_object(
            None if failure is None else f"{type(failure).__name__}: {failure}")
        _FAILED_CAPTURES.pop(key, None)
        if failure is not None:
            raise failure
        failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
        if failed:
            rank, text = failed[0]
            raise TracingError(f"rank {rank} could not capture the model: {text}")
        assert self.chain is not None
        self.check_ties_allowed(self.chain)

    def plan_from(self, example_inputs: Any) -> Plan:
        """Rank 0 profiles `example_inputs` and plans; every rank gets the plan (or the error)."""
        payload: list[Any] = [None]
        failure: Exception | None = None
        if self.ctx.rank == 0:
            try:
                with GLOBAL_STATE:  # rank threads share the model; another may be capturing it
                    payload[0] = {"plan": self._make_plan(example_inputs).to_dict()}
            except Exception as err:  # every rank must hear of it, not wait for a plan
                failure = err
                payload[0] = {"error": f"{type(err).__name__}: {err}",
                              "traceback": "".join(traceback.format_exception(err))}
        planned = self.ctx.control.broadcast_object(payload[0], src=0)
        if "error" in planned:
            if failure is not None:  # rank 0 raises with the original error chained
                raise RuntimeError(f"planning on rank 0 failed: {planned['error']}") from failure
            raise RuntimeError(f"planning on rank 0 failed: {planned['error']}\n"
                               f"rank 0's traceback:\n{planned['traceback']}")
        return Plan.from_dict(planned["plan"])

    def _make_plan(self, example_inputs: Any) -> Plan:
        from pipedream_fast.profiler import profile_model  # planning is rank 0's job

        assert self.model is not None and self.chain is not None
        # Profiled at the microbatch, what each stage runs (and holds per microbatch in
        # flight): a copy, so that its storage is the microbatch's, not the minibatch's.
        chunks = self.ctx.chunks_for(example_inputs)
        microbatch = pytree.tree_map(lambda v: v.clone() if isinstance(v, torch.Tensor) else v,
                                     split_microbatches(example_inputs, chunks)[0])
        args = self.chain.flatten_inputs(microbatch)
        profile = profile_model(self.model, args, batch_size=batch_size(microbatch),
                                progress=False, chain=self.chain,
                                cpu_cache_mb=self.ctx.tuning.cpu_cache_mb)
        if self.profile is None:  # what `adapt` re-plans from
            self.profile = profile
        plan = self._plan_profile(profile, chunks)
        # What the plan assumed of the data: a later, larger batch (a longer sequence) holds
        # more than its memory figures say (`DataAgreement` says so once, under a limit).
        plan.extra["planned_at"] = sample_shapes(example_inputs)
        return plan

    def _plan_profile(self, profile: Any, chunks: int) -> Plan:
        from pipedream_fast.planner import make_plan
        from pipedream_fast.planner.choose import plan_for
        from pipedream_fast.topology import Topology

        options = self.ctx.options
        topology = Topology.parse(f"{self.ctx.world_size}x1e9", options.memory_per_worker)
        recompute = planned_recompute(options.recompute)
        if options.stages is not None:
            if options.stages != self.ctx.world_size:
                raise ValueError(f"stages={options.stages} runs one stage per rank, but this "
                                 f"job has {self.ctx.world_size} ranks")
            name = "1f1b" if self.ctx.schedule_name == "auto" else self.ctx.schedule_name
            return make_plan(profile, topology, schedule=kind(name).plans_as or name,
                             strategy="time", straight=True, recompute=recompute,
                             chunks=chunks)
        if self.ctx.schedule_name == "auto":
            return self._choose_runnable(profile, topology, chunks, recompute)
        return plan_for(self.ctx.schedule_name, profile, topology, recompute=recompute,
                        chunks=chunks)

    def _choose_runnable(self, profile: Any, topology: Any, chunks: int,
                         recompute: str) -> Plan:
        """schedule='auto': the fastest candidate whose options this Pipeline meets (2bw, for
        one, needs at least as many chunks as ranks); a candidate that cannot run with them
        is dropped and the choice made again."""
        from pipedream_fast.planner.choose import choose_schedule
        candidates = list(self.automatic_candidates())
        while True:
            plan = choose_schedule(profile, topology, candidates=tuple(candidates),
                                   recompute=recompute)
            try:
                build_schedule(plan, plan.schedule, self.ctx.world_size, chunks,
                               self.ctx.options.schedule_options)
                return plan
            except ValueError:
                candidates.remove(plan.schedule)
                if not candidates:
                    raise

    def setup(self, plan: Plan) -> None:
        """Cuts this rank's stages out of the model and makes their optimizers, transport and
        agreement across stages. Collective: every rank calls it with the same plan."""
        if plan.workers != self.ctx.world_size:
            raise FormatError(f"the plan is for {plan.workers} workers but this job has "
                              f"{self.ctx.world_size} ranks; start {plan.workers} processes or make "
                              f"a plan for {self.ctx.world_size}")
        self.ctx.resolve_schedule(resolve_schedule(self.ctx.schedule_name, plan))  # auto: known
        assert self.chain is not None  # captured before any plan is set up
        check_plan_fits(plan, self.chain)
        self._check_same_model_everywhere(self.chain)
        if self.model is not None:  # the first cut, on every rank (collective)
            self._start_from_rank_0(self.chain)
        self.plan = plan
        self.stage_indices = plan.stages_of_rank(self.ctx.rank)
        if self.factory_built:  # the real model rank 0 profiled: freed, cut as on every rank
            for block in self.chain.blocks:
                self.materialize(block.module, torch.device("meta"))
            self.factory_built = False
        recompute = self.recomputed_blocks(plan)
        self.copies = {}
        for index in self.stage_indices:
            stage_plan = plan.stages[index]
            module = self.chain.stage_module(stage_plan.start, stage_plan.stop, recompute)
            if self._needs_own_copy(plan, index):
                module = self._own_copy(module, index)
            self.materialize(module, self.ctx.device, index)
            self.modules[index] = module.to(self.ctx.device)
        for index, module in self.modules.items():
            params = list(module.parameters())
            if params:
                self.optimizers[index] = self.ctx.optimizer_factory(params)
                if self.ctx.scheduler_factory is not None:
                    self.schedulers[index] = self.ctx.scheduler_factory(self.optimizers[index])
        self.transport = self.new_transport()
        tied = self._tie_weights(plan)
        skip_nan = self.ctx.options.on_nan == "skip"
        if self.ctx.options.clip_grad_norm is not None or self.scaler is not None or tied or skip_nan:
            if not kind(self.ctx.schedule_name).synchronous:
                wants = [w for w, on in (("clip_grad_norm", self.ctx.options.clip_grad_norm is not None),
                                         ("precision='fp16'", self.scaler is not None),
                                         ("on_nan='skip'", skip_nan),
                                         ("tied weights across stages", bool(tied))) if on]
                raise ValueError(f"{' and '.join(wants)} need every stage to agree before "
                                 f"each update, which only synchronous schedules allow "
                                 f"({', '.join(SYNCHRONOUS)}); {self.ctx.schedule_name!r} updates "
                                 f"its stages at different times")
            self.sync = GlobalUpdateSync(
                self.ctx.control, {i: len(plan.stages[i].ranks) for i in self.stage_indices},
                self.ctx.options.clip_grad_norm, self.scaler, tied, skip_nonfinite=skip_nan)
        self.model = None  # only this rank's stages are kept
        if self.ctx.rank == 0 and self.ctx.options.announce_plan:
            names = [block.name for block in self.chain.blocks]
            print(f"pipedream_fast: plan: {plan.describe(names)}; schedule "
                  f"{self.ctx.schedule_name}", flush=True)
        self.on_cut()

    def recomputed_blocks(self, plan: Plan) -> frozenset[int]:
        """The blocks whose activations are made again in the backward (`recompute`),
        checked against the model's blocks and the plan's stages."""
        assert self.chain is not None
        what, items = recompute_spec(self.ctx.options.recompute)
        if what == "none":
            return frozenset()
        if what == "auto":  # where the plan has a stage recompute (to fit a memory limit)
            return frozenset(b for s in plan.stages if s.extra.get("recompute")
                             for b in range(s.start, s.stop))
        if what == "all":
            return frozenset(range(len(self.chain)))
        if what == "stages":
            missing = [i for i in items if i >= len(plan.stages)]
            if missing:
                raise ValueError(f"recompute names stages {missing}, but the plan has stages "
                                 f"0..{len(plan.stages) - 1}")
            return frozenset(b for i in items
                             for b in range(plan.stages[i].start, plan.stages[i].stop))
        names = [b.name for b in self.chain.blocks]
        unknown = [n for n in items if n not in names]
        if unknown:
            raise ValueError(f"recompute names blocks {unknown} the model does not have; its "
                             f"blocks are {', '.join(names)}")
        return frozenset(names.index(n) for n in items)

    def new_transport(self, stage_groups: bool = True) -> Transport:
        """Point-to-point links of their own (a run left early abandons them with receives
        still posted, which must not disturb other traffic) and the replica all-reduce
        groups, released with the Pipeline. Collective."""
        assert self.plan is not None
        return self.ctx.world.transport([s.ranks for s in self.plan.stages] if stage_groups
                                     else [], self.ctx.device, self.ctx.tuning)

    def _tie_weights(self, plan: Plan) -> list[TiedWeight]:
        """The weights this rank shares with other ranks' stages: each gets a process group
        of the ranks holding it and starts from the first holder's values. Collective."""
        stage_of_block = {b: i for i, s in enumerate(plan.stages) for b in range(s.start, s.stop)}
        tied: list[TiedWeight] = []
        assert self.chain is not None
        blocks_by_param = shared_parameters(self.chain)
        params = {id(p): p for b in self.chain.blocks for p in b.module.parameters()}
        for pid, blocks in sorted(blocks_by_param.items(), key=lambda kv: kv[1]):
            holders = sorted({stage_of_block[b] for b in blocks})
            if len(holders) < 2:
                continue  # used twice within one stage: autograd sums it already
            ranks = sorted({r for s in holders for r in plan.stages[s].ranks})
            mine = [s for s in holders if s in self.stage_indices]
            group = self.ctx.world.new_group(ranks)  # collective: every rank, same order
            if mine:
                assert group is not None
                copies = tuple(self.copies.get(s, {}).get(pid, params[pid]) for s in mine)
                others = group if len(ranks) > 1 else None  # None: this rank holds them all
                with torch.no_grad():
                    if others is not None:
                        others.broadcast(copies[0].data, src=plan.stages[holders[0]].ranks[0])
                    for other in copies[1:]:
                        other.copy_(copies[0])
                tied.append(TiedWeight(copies, others,
                                       counts_in_norm=tuple(s == holders[0] for s in mine),
                                       replicas=tuple(len(plan.stages[s].ranks) for s in mine)))
        return tied

    def _needs_own_copy(self, plan: Plan, index: int) -> bool:
        """Whether stage `index` needs tensors of its own (made from the same values), where
        it would otherwise share one with another stage that updates it separately: under
        rank threads, which share the caller's model (a stage's first rank trains the user's
        own modules), a replica, or a later stage holding a weight tied to an earlier one; in
        a process, a later stage holding a weight tied to an earlier stage of this rank (a V
        puts the embedding and the head on one rank; each stage's optimizer steps its copy)."""
        if self.shares_model and plan.stages[index].ranks[0] != self.ctx.rank:
            return True
        assert self.chain is not None
        stage_of_block = {b: i for i, s in enumerate(plan.stages) for b in range(s.start, s.stop)}
        return any(index in holders and any(h < index and (self.shares_model
                                                           or h in self.stage_indices)
                                            for h in holders)
                   for holders in ({stage_of_block[b] for b in blocks}
                                   for blocks in shared_parameters(self.chain).values()))

    def _own_copy(self, module: nn.Module, index: int) -> nn.Module:
        """A deep copy of stage `index` for this rank alone; its tensors keep the model's
        names (`names`), and `copies[index]` finds a copy from the original's id."""
        memo: dict[int, Any] = {}
        with GLOBAL_STATE:
            copied = copy.deepcopy(module, memo)
        for pid, keys in list(self.names.items()):
            if pid in memo and isinstance(memo[pid], torch.Tensor):
                self.names[id(memo[pid])] = keys
                self.copies.setdefault(index, {})[pid] = memo[pid]
        return copied

    def _check_same_model_everywhere(self, chain: Any) -> None:
        """Every rank must have built the same model; compared before any training."""
        prints = self.ctx.control.all_gather_object(model_fingerprint(chain))
        for rank, other in enumerate(prints):
            if other != prints[0]:
                differ = next(i for i, (a, b) in enumerate(zip(prints[0], other)) if a != b) \
                    if len(other) == len(prints[0]) else None
                where = (f"block {differ} ({prints[0][differ][0]})" if differ is not None
                         else f"{len(prints[0])} vs {len(other)} blocks")
                raise FormatError(f"rank {rank} built a different model than rank 0 ({where}); "
                                  f"every rank must construct the same model")

    def _start_from_rank_0(self, chain: Any) -> None:
        """Every rank starts from rank 0's initial weights and buffers, as
        DistributedDataParallel's replicas do: ranks that built the model with another seed
        would otherwise train a model no single process ever held. Each rank fingerprints its
        tensors (two float64 sums each: cheap, and no copy of the model travels when they
        agree); only the tensors where some rank differs from rank 0 are broadcast, and rank
        0 says so once, naming the first. Collective; before the cut, while every rank holds
        the whole model (tensors on the meta device are initialised alike later, by seed)."""
        tensors = list({id(t): t for block in chain.blocks
                        for t in tensors_of(block.module)}.values())
        prints = self.ctx.control.all_gather_object([_fingerprint(t) for t in tensors])
        differ = [i for i, mine in enumerate(prints[0]) if mine is not None and any(
            other[i] is not None and not _alike(mine, other[i]) for other in prints[1:])]
        if not differ:
            return
        with torch.no_grad():
            for i in differ:
                values = tensors[i].detach().to("cpu", copy=True)
                self.ctx.control.broadcast(values, src=0)
                tensors[i].copy_(values)
        if self.ctx.rank == 0:
            ranks = sorted({r for r, other in enumerate(prints) for i in differ
                            if other[i] is not None and not _alike(prints[0][i], other[i])})
            first = self.names.get(id(tensors[differ[0]]), ("a tensor",))[0]
            warnings.warn(f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                          f"built the model with other initial values than rank 0 in "
                          f"{len(differ)} of its {len(tensors)} tensors (the first: {first!r}); "
                          f"every rank starts from rank 0's. Seed alike before building the "
                          f"model (torch.manual_seed) to start from the same weights anyway",
                          stacklevel=4)

    def materialize(self, module: nn.Module, device: torch.device, stage: int = 0) -> None:
        """`materialize` with this rank's seed and names."""
        materialize(module, device, stage, seed=self.ctx.seed, names=self.names,
                    rank=self.ctx.rank)

    def runtimes_for(self, schedule: Schedule) -> dict[int, StageRuntime]:
        assert self.plan is not None
        for index, module in self.modules.items():
            if index not in self.runtimes:
                self.runtimes[index] = stage_runtime(
                    self.plan, index, self.ctx.rank, module, self.optimizers.get(index), schedule,
                    self.ctx.loss_fn, self.schedulers.get(index), self.ctx.precision, self.ctx.tuning,
                    optimizer_factory=self.ctx.optimizer_factory,
                    scheduler_factory=self.ctx.scheduler_factory)
                if self.meter is not None:
                    self.runtimes[index].measure_with(self.meter)
                self.on_runtime(self.runtimes[index])
            check_runtime_fits(self.runtimes[index], schedule, self.ctx.rank)
        return self.runtimes


    def training_transport(self) -> Transport:
        """The links of training runs: made again (collectively) after a run left early."""
        if self.transport is None:
            self.transport = self.new_transport()
        return self.transport

    def inference_transport(self, key: tuple[Any, ...]) -> Transport:
        """The transport of forward-only runs of one shape (made collectively on first use:
        every rank knows the key from the same agreed values)."""
        if key not in self.inference_transports:
            assert self.plan is not None
            self.inference_transports[key] = self.new_transport(stage_groups=False)
        return self.inference_transports[key]

    def abandon_run(self) -> None:
        """A run was left early: the microbatches in flight are discarded, and the training
        transport, whose links may hold messages never to be received, is replaced at the
        next run (collectively)."""
        for runtime in self.runtimes.values():
            runtime.abandon_run()
        if self.transport is not None:
            self.transport.close()
            self.transport = None

    def drop_links(self) -> None:
        """The transports are dropped (closed by the world's release or an abort); new ones
        are made at the next run."""
        self.transport = None
        self.inference_transports.clear()

    def forget_links(self) -> None:
        """Under rank threads after an abort: the transports it closed are dropped and the
        runtimes' runs discarded."""
        self.drop_links()
        for runtime in self.runtimes.values():
            runtime.abandon_run()

    def release(self, new: Plan) -> None:
        """Drops this rank's stage objects before a move to `new`; the tensors of blocks it
        no longer holds go back to meta where the model was built there."""
        assert self.plan is not None
        old = self.plan
        if self.transport is not None:
            self.transport.close()
            self.transport = None
        for transport in self.inference_transports.values():
            transport.close()
        self.inference_transports.clear()
        self.modules.clear()
        self.optimizers.clear()
        self.schedulers.clear()
        self.runtimes.clear()
        self.sync = None
        kept_blocks = {b for i in new.stages_of_rank(self.ctx.rank)
                       for b in range(new.stages[i].start, new.stages[i].stop)}
        dropped = {b for i in self.stage_indices
                   for b in range(old.stages[i].start, old.stages[i].stop)} - kept_blocks
        if self.built_on_meta and dropped:
            assert self.chain is not None
            keep = {id(t) for b in kept_blocks for t in tensors_of(self.chain.blocks[b].module)}
            gone = {id(t): t for b in sorted(dropped)
                    for t in tensors_of(self.chain.blocks[b].module)
                    if id(t) not in keep and not t.is_meta}
            gc.collect()  # the optimizers and schedulers just dropped hold them in cycles
            with torch.no_grad():
                for t in gone.values():
                    t.grad = None
                    meta = torch.empty_like(t, device="meta")
                    try:
                        torch.utils.swap_tensors(t, nn.Parameter(meta, t.requires_grad)
                                                 if isinstance(t, nn.Parameter) else meta)
                    except RuntimeError:  # still referenced somewhere: kept, not freed
                        pass


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def _fingerprint(t: torch.Tensor) -> tuple[float, float] | None:
    """The sum and the norm of a tensor's values (None on the meta device)."""
    if t.is_meta:
        return None
    values = t.detach() if t.is_floating_point() else t.detach().double()
    return (float(torch.sum(values, dtype=torch.float64)),
            float(torch.linalg.vector_norm(values, dtype=torch.float64)))


def _alike(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Two fingerprints of the same values (sums may differ in the last bits between ranks
    with other thread counts or devices; NaN equals NaN)."""
    return all(x == y or (math.isnan(x) and math.isnan(y))
               or math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b))


def materialize(module: nn.Module, device: torch.device, stage: int = 0, *, seed: int,
                names: dict[int, tuple[str, ...]], rank: int) -> None:
    """The meta tensors of a stage get real memory on `device` (only this rank's stages are
    ever allocated), initialised by each layer's reset_parameters() under a seed of
    (`seed`, `stage`), so that the replicas of a stage start alike. With `device` meta,
    every tensor of `module` goes back to meta instead (the real model rank 0 built from
    a factory to profile it). Each tensor keeps its identity (`torch.utils.swap_tensors`,
    where `to_empty` would make new Parameters): weights tied within a stage or across
    stages stay tied, and `names` (tensor -> state_dict keys) still names it."""
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
        torch.manual_seed(seed * 1_000_003 + stage)
        for sub in module.modules():
            # nn.MultiheadAttention names its initialisation _reset_parameters
            reset = getattr(sub, "reset_parameters", getattr(sub, "_reset_parameters", None))
            if callable(reset):
                reset()
    left = {names.get(id(t), (name,))[0]: t for name, t in itertools.chain(
        module.named_parameters(), module.named_buffers())
        if id(t) in tensors and t.is_floating_point() and bool(t.isnan().any())}
    if left:
        import warnings
        with torch.no_grad():
            for t in left.values():
                t.masked_fill_(t.isnan(), 0.0)
        warnings.warn(f"rank {rank}: {', '.join(list(left)[:5])}"
                      f"{f' (and {len(left) - 5} more)' if len(left) > 5 else ''} of stage "
                      f"{stage} start at zero: the model was built on the meta device and "
                      f"no reset_parameters() of its modules sets them. Give their module a "
                      f"reset_parameters(), or pass a built model", stacklevel=3)
