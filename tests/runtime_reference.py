"""Single-process references for the runtime tests.

`train_reference` is plain single-device training with gradient accumulation: what every
synchronous schedule must equal. `interpret_schedule` executes a schedule's IR in one process
with none of the runtime's machinery: every weight version is kept as a separate copy, every
microbatch's forward builds its own graph on the copy of the version the IR names, gradients
are accumulated per rank and summed across replicas at ALLREDUCE, and OPTIMIZER_STEP runs a
real torch optimizer on the newest weights. It is the step-by-step application of the version
rules (which version each forward and backward used, which update came when) that the
distributed runtime must reproduce.

With `staleness` it also applies a correction for stale weights, written out here from its
definition: a forward of microbatch m reading version k, whose gradient the stage applies on
top of version u (the OPTIMIZER_STEP listing m makes u + 1), has delay d = u - k; each stage
keeps v, the moving average (0.9) of the weight changes of its updates, bias-corrected;
predict reads w_k + d * v, nesterov w_k + (0.9 + ... + 0.9^d) * v, and lr-scale steps with
the learning rate over 1 + the mean delay of the update's microbatches on that rank.
"""

from __future__ import annotations

import copy
from typing import Any
from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipedream_fast.ir import ActionKind as K
from pipedream_fast.ir import Schedule


def train_reference(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                    chunks: int, loss_fn: Callable, make_optimizer: Callable) -> dict[str, torch.Tensor]:
    model = copy.deepcopy(model)
    optimizer = make_optimizer(list(model.parameters()))
    for x, y in batches:
        optimizer.zero_grad()
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            (loss_fn(model(xs), ys) / chunks).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class _RankStage:
    """One rank's copy of one stage: its newest weights, an optimizer, every version kept."""

    def __init__(self, module: nn.Module, make_optimizer: Callable) -> None:
        self.module = copy.deepcopy(module)
        self.names = [n for n, _ in self.module.named_parameters()]
        self.params = [p for _, p in self.module.named_parameters()]
        self.optimizer = make_optimizer(self.params)
        self.versions = {0: [p.detach().clone() for p in self.params]}
        self.newest = 0
        self.grads = [torch.zeros_like(p) for p in self.params]
        self.graphs: dict[int, tuple[int, list[torch.Tensor], list[torch.Tensor], Any]] = {}
        self.velocity = [torch.zeros_like(p) for p in self.params]
        self.updates = 0
        self.delays: dict[int, int] = {}


def _delay(actions: Sequence[Any], at: int) -> int:
    """u - k for the forward at `actions[at]` (see the module's docstring)."""
    f = actions[at]
    for b in actions[at + 1:]:
        if b.kind is K.OPTIMIZER_STEP and b.stage == f.stage and f.microbatch in b.microbatches:
            return b.version - 1 - f.version
    return 0


def _shifted(st: _RankStage, weights: list[torch.Tensor], delay: int,
             staleness: str | None) -> list[torch.Tensor]:
    beta = 0.9
    if staleness == "predict":
        steps = float(delay)
    elif staleness == "nesterov":
        steps = sum(beta ** i for i in range(1, delay + 1))
    else:
        steps = 0.0
    if steps == 0.0 or st.updates == 0:
        return weights
    scale = steps / (1 - beta ** st.updates)
    return [w + scale * v for w, v in zip(weights, st.velocity)]


def interpret_schedule(schedule: Schedule, stage_modules: Sequence[nn.Module],
                       microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       loss_fn: Callable, make_optimizer: Callable,
                       staleness: str | None = None) -> list[dict[str, torch.Tensor]]:
    """Runs the IR; returns each stage's final weights (checked equal across its replicas)."""
    last = schedule.num_stages - 1
    state = {(rank, s): _RankStage(stage_modules[s], make_optimizer)
             for s, ranks in enumerate(schedule.stage_ranks) for rank in ranks}
    mailbox: dict[tuple[str, int, int], list[torch.Tensor]] = {}
    position = [0] * schedule.num_ranks

    def step(rank: int) -> bool:
        """Performs rank's next action if its inputs are there; False if it must wait."""
        actions = schedule.actions[rank]
        if position[rank] >= len(actions):
            return False
        a = actions[position[rank]]
        st = state.get((rank, a.stage))
        if a.kind is K.FORWARD:
            if a.stage == 0:
                inputs = [microbatches[a.microbatch][0]]
            elif ("act", a.stage, a.microbatch) in mailbox:
                inputs = [t.detach().requires_grad_() for t in
                          mailbox.pop(("act", a.stage, a.microbatch))]
            else:
                return False
            assert a.version in st.versions, f"version {a.version} of stage {a.stage} not made"
            weights = [w.detach().clone().requires_grad_() for w in st.versions[a.version]]
            st.delays[a.microbatch] = _delay(actions, position[rank])
            read = _shifted(st, weights, st.delays[a.microbatch], staleness)
            out = torch.func.functional_call(st.module, dict(zip(st.names, read)), tuple(inputs))
            if a.stage == last:
                out = loss_fn(out, microbatches[a.microbatch][1])
            st.graphs[a.microbatch] = (a.version, inputs, weights, out)
        elif a.kind is K.BACKWARD:
            version, inputs, weights, out = st.graphs[a.microbatch]
            assert version == a.version, "a backward must use its forward's version"
            if a.stage == last:
                grad_out = None
            elif ("grad", a.stage, a.microbatch) in mailbox:
                grad_out = mailbox.pop(("grad", a.stage, a.microbatch))[0]
            else:
                return False
            wanted = weights + ([inputs[0]] if a.stage > 0 else [])
            grads = torch.autograd.grad(out, wanted, grad_out)
            for acc, g in zip(st.grads, grads[: len(weights)]):
                acc.add_(g)
            st.graphs[a.microbatch] = (version, [g for g in grads[len(weights):]], [], None)
        elif a.kind is K.SEND_ACT:
            _, _, _, out = st.graphs[a.microbatch]
            mailbox[("act", a.stage + 1, a.microbatch)] = [out.detach()]
        elif a.kind is K.SEND_GRAD:
            _, input_grads, _, _ = st.graphs.pop(a.microbatch)
            mailbox[("grad", a.stage - 1, a.microbatch)] = input_grads
        elif a.kind is K.ALLREDUCE:
            ranks = schedule.stage_ranks[a.stage]
            peers = [schedule.actions[r][position[r]] if position[r] < len(schedule.actions[r])
                     else None for r in ranks]
            if any(p != a for p in peers):
                return False  # a collective: every replica must be at this very action
            total = [sum(state[(r, a.stage)].grads[i] for r in ranks) for i in range(len(st.grads))]
            for r in ranks:
                state[(r, a.stage)].grads = [t.clone() for t in total]
                position[r] += 1
            return True
        elif a.kind is K.OPTIMIZER_STEP:
            for p, g in zip(st.params, st.grads):
                p.grad = g / len(a.microbatches)
            delays = [st.delays.pop(m) for m in a.microbatches if m in st.delays]
            factor = 1.0
            if staleness == "lr-scale" and delays:
                factor = 1.0 / (1.0 + sum(delays) / len(delays))
            rates = [g["lr"] for g in st.optimizer.param_groups]
            for g in st.optimizer.param_groups:
                g["lr"] *= factor
            before = [p.detach().clone() for p in st.params]
            st.optimizer.step()
            for g, lr in zip(st.optimizer.param_groups, rates):
                g["lr"] = lr
            st.velocity = [0.9 * v + 0.1 * (p.detach() - b)
                           for v, p, b in zip(st.velocity, st.params, before)]
            st.updates += 1
            st.newest = a.version
            st.versions[a.version] = [p.detach().clone() for p in st.params]
            st.grads = [torch.zeros_like(p) for p in st.params]
        elif a.kind in (K.RECV_ACT, K.RECV_GRAD, K.SNAPSHOT, K.RELEASE):
            pass  # every version is kept anyway; receives are the mailbox
        else:
            raise NotImplementedError(a.kind)
        if a.stage == 0 and a.kind is K.BACKWARD:
            st.graphs.pop(a.microbatch)
        position[rank] += 1
        return True

    while any(position[r] < len(schedule.actions[r]) for r in range(schedule.num_ranks)):
        if not any([step(r) for r in range(schedule.num_ranks)]):
            raise AssertionError(f"reference interpreter is stuck at positions {position}")
    finals = []
    for s, ranks in enumerate(schedule.stage_ranks):
        weights = state[(ranks[0], s)].module.state_dict()
        for r in ranks[1:]:
            other = state[(r, s)].module.state_dict()
            for k in weights:
                torch.testing.assert_close(other[k], weights[k], msg=f"replicas of stage {s} differ")
        finals.append({k: v.detach().clone() for k, v in weights.items()})
    return finals


def interpret_sequential(model: nn.Sequential, blocks: Sequence[tuple[int, int]],
                         schedule: Schedule,
                         microbatches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                         loss_fn: Callable, make_optimizer: Callable,
                         staleness: str | None = None) -> dict[str, torch.Tensor]:
    """`interpret_schedule` on an `nn.Sequential` cut into stages of children [a, b) (one per
    stage, in order); returns the final weights under the whole model's keys."""
    children = list(model.children())
    modules = [nn.Sequential(*children[a:b]) for a, b in blocks]
    finals = interpret_schedule(schedule, modules, microbatches, loss_fn, make_optimizer,
                                staleness)
    full = {}
    for (start, _), weights in zip(blocks, finals):
        for key, value in weights.items():
            index, rest = key.split(".", 1)
            full[f"{start + int(index)}.{rest}"] = value
    return full


def train_reference_with(model: nn.Module, batches: Any, chunks: int, loss_fn: Callable,
                         make_optimizer: Callable, *, autocast_dtype: torch.dtype | None = None,
                         clip_grad_norm: float | None = None,
                         make_scheduler: Callable | None = None,
                         norms: list[float] | None = None,
                         losses: list[float] | None = None) -> dict[str, torch.Tensor]:
    """`train_reference` with the Pipeline's training options, as one process does them: the
    forward and the loss under `torch.autocast("cpu", autocast_dtype)`, the accumulated
    gradients clipped to `clip_grad_norm` over all parameters before the update, and the LR
    scheduler stepped once after each update. `batches` may be any iterable (a DataLoader);
    `norms`, if given, receives each update's gradient norm before clipping; `losses` each
    step's mean microbatch loss (what `Pipeline.train` yields)."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    optimizer = make_optimizer(params)
    scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
    for x, y in batches:
        optimizer.zero_grad()
        step_losses = []
        for xs, ys in zip(x.chunk(chunks), y.chunk(chunks)):
            if autocast_dtype is None:
                loss = loss_fn(model(xs), ys)
            else:
                with torch.autocast("cpu", dtype=autocast_dtype):
                    loss = loss_fn(model(xs), ys)
            (loss / chunks).backward()
            step_losses.append(loss.detach())
        if losses is not None:
            losses.append(float(torch.stack(step_losses).mean()))
        if clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                         for p in params if p.grad is not None]))
        if norms is not None:
            norms.append(float(norm))
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
