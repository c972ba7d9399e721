"""Cutting the model on a rank: capturing it (at the first minibatch, when torch.export needs
inputs), agreeing on a plan (the planner on rank 0), taking this rank's stages out of it
(materialised, copied where rank threads would share a tensor), their optimizers,
transport and the agreement across stages before updates (clipping, tied weights, fp16).
"""

from __future__ import annotations

import copy
import itertools
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torch.utils import _pytree as pytree

from pipedream_fast.formats import FormatError, Plan
from pipedream_fast.ir import Schedule
from pipedream_fast.runtime.stage import (StageRuntime)
from pipedream_fast.runtime.transport import Transport
from pipedream_fast.runtime.update_sync import GlobalUpdateSync, TiedWeight
from pipedream_fast.schedules import SYNCHRONOUS, kind
from pipedream_fast.tracing import LayerChain, TracingError, shared_parameters
from pipedream_fast.tracing import trace as trace_model
from pipedream_fast.training import (GLOBAL_STATE, build_schedule, check_plan_fits,
                                     check_runtime_fits, manual_plan, model_fingerprint,
                                     resolve_schedule, batch_size, stage_runtime)
from pipedream_fast.rank.checkpoints import Checkpointing


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


class Cutting(Checkpointing):
    """The model cut into this rank's stages (see the module's docstring)."""

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
        key = id(self._model)
        failure: Exception | None = None
        try:
            with GLOBAL_STATE:
                earlier = _FAILED_CAPTURES.get(key)
                if earlier is not None:  # a rank thread before this one failed on this model
                    raise _again(earlier)
                try:
                    self._chain = trace_model(self._model, inputs, self._leaf_modules,
                                              check=False)
                except Exception as err:
                    _FAILED_CAPTURES[key] = err
                    raise
        except Exception as err:  # noqa: BLE001 - agreed on below, then raised
            failure = err
        # Every rank hears of every rank's outcome: one that failed must not leave the others
        # waiting for it (or a rank thread starting a capture the first one knows fails).
        outcomes = self._control.all_gather_object(
            None if failure is None else f"{type(failure).__name__}: {failure}")
        _FAILED_CAPTURES.pop(key, None)
        if failure is not None:
            raise failure
        failed = [(rank, text) for rank, text in enumerate(outcomes) if text is not None]
        if failed:
            rank, text = failed[0]
            raise TracingError(f"rank {rank} could not capture the model: {text}")
        assert self._chain is not None
        self._check_ties_allowed(self._chain)

    def _plan_from(self, example_inputs: Any) -> Plan:
        """Rank 0 profiles `example_inputs` and plans; every rank gets the plan (or the error)."""
        payload: list[Any] = [None]
        failure: Exception | None = None
        if self.rank == 0:
            try:
                with GLOBAL_STATE:  # rank threads share the model; another may be capturing it
                    payload[0] = {"plan": self._make_plan(example_inputs).to_dict()}
            except Exception as err:  # every rank must hear of it, not wait for a plan
                failure = err
                payload[0] = {"error": f"{type(err).__name__}: {err}",
                              "traceback": "".join(traceback.format_exception(err))}
        planned = self._control.broadcast_object(payload[0], src=0)
        if "error" in planned:
            if failure is not None:  # rank 0 raises with the original error chained
                raise RuntimeError(f"planning on rank 0 failed: {planned['error']}") from failure
            raise RuntimeError(f"planning on rank 0 failed: {planned['error']}\n"
                               f"rank 0's traceback:\n{planned['traceback']}")
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
        if self._profile is None:  # what `adapt` re-plans from
            self._profile = profile
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
                if index in self._saved_staleness:
                    self._runtimes[index].restore_correction(self._saved_staleness.pop(index))
            check_runtime_fits(self._runtimes[index], schedule, self.rank)
        return self._runtimes
