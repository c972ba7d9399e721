"""A stage's training state by the whole model's keys, so that it fits any other cut.

Weights and buffers by their `state_dict()` keys, each parameter's optimizer state by its
parameter's key, the hyperparameters of the optimizer's groups, the scheduler's state and
the staleness correction's velocity by key. Two users: a move of the stages between plans
(`rank/moving.py`: the ranks exchange these states and each keeps what its new stages hold)
and a checkpoint continued on another layout (`rank/checkpoints.py`: a stage file records
its parameters' keys, `state_from_file` turns it into this form). `put_state` then puts the
states of the old stages into this rank's new ones: a parameter's optimizer state follows
the parameter; a new stage takes its groups' hyperparameters, scheduler and step count from
the old stage that held its first block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from pipedream_fast import checkpoint as ckpt
from pipedream_fast.training import named_state

if TYPE_CHECKING:
    from pipedream_fast.rank.cutting import Stages


class Corrections(Protocol):
    """Where a stage's staleness correction state is read and put (`rank/checkpoints`)."""

    def correction_state(self, index: int) -> dict[str, Any] | None: ...

    def save_correction_for(self, stage: int, state: dict[str, Any] | None) -> None: ...


def param_key(stages: Stages, tensor: torch.Tensor) -> str:
    keys = stages.names.get(id(tensor), ())
    if not keys:
        raise ValueError("a parameter of a stage has no key in the model's state_dict(), "
                         "so its state cannot follow it to another cut")
    return keys[0]


def _velocity_names(stages: Stages, index: int) -> list[str]:
    """The stage module's parameter names in the order its correction's velocity lists them."""
    runtime = stages.runtimes.get(index)
    if runtime is not None:
        return list(runtime.param_names)
    return [n for n, _ in stages.modules[index].named_parameters()]


def file_keys(stages: Stages, index: int) -> dict[str, list[str]]:
    """What a stage file records so that it loads on another cut: the key of each parameter
    in its optimizer's order, and in its correction's velocity order."""
    optimizer = stages.optimizers.get(index)
    order = ([p for group in optimizer.param_groups for p in group["params"]]
             if optimizer is not None else [])
    params = dict(stages.modules[index].named_parameters())
    return {"optimizer": [param_key(stages, p) for p in order],
            "velocity": [param_key(stages, params[n]) for n in _velocity_names(stages, index)]}


def stage_state(stages: Stages, checkpoints: Corrections, index: int) -> dict[str, Any]:
    """What stage `index` hands to another cut, by the whole model's keys (copies)."""
    assert stages.plan is not None
    module = stages.modules[index]
    weights = named_state([module], stages.names)
    optimizer, scheduler = stages.optimizers.get(index), stages.schedulers.get(index)
    per_param: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    if optimizer is not None:
        saved = optimizer.state_dict()
        order = [p for group in optimizer.param_groups for p in group["params"]]
        for number, param in enumerate(order):
            if number in saved["state"]:
                per_param[param_key(stages, param)] = {
                    k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                    for k, v in saved["state"][number].items()}
        groups = [{k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]]
    correction = checkpoints.correction_state(index)
    velocity = None
    if correction is not None and correction.get("velocity") is not None:
        params = dict(module.named_parameters())
        velocity = {param_key(stages, params[n]): v
                    for n, v in zip(_velocity_names(stages, index), correction["velocity"])}
    stage = stages.plan.stages[index]
    return {"stage": index, "start": stage.start, "stop": stage.stop, "weights": weights,
            "optimizer": per_param, "groups": groups,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "correction": None if correction is None else {
                **{k: v for k, v in correction.items() if k != "velocity"},
                "velocity": velocity}}


def state_from_file(saved: dict[str, Any], start: int, stop: int, where: str
                    ) -> dict[str, Any]:
    """A stage file of blocks [start, stop) as `stage_state` gives it."""
    keys = saved.get("keys")
    if keys is None:
        raise ckpt.CheckpointError(f"{where} was written before checkpoints recorded their "
                                   f"parameters' keys: it loads only on the plan that wrote it")
    if saved.get("copies") is not None:
        raise ckpt.CheckpointError(f"{where} holds localsgd's weight copies, which load only on "
                                   f"the plan that wrote them")
    per_param: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    optimizer = saved.get("optimizer")
    if optimizer is not None:
        for number, key in enumerate(keys["optimizer"]):
            if number in optimizer["state"]:
                per_param[key] = optimizer["state"][number]
        groups = [{k: v for k, v in g.items() if k != "params"}
                  for g in optimizer["param_groups"]]
    correction = saved.get("staleness")
    if correction is not None:
        vector = correction.get("velocity")
        correction = {**{k: v for k, v in correction.items() if k != "velocity"},
                      "velocity": None if vector is None
                      else dict(zip(keys["velocity"], vector))}
    return {"stage": saved.get("stage"), "start": start, "stop": stop,
            "weights": saved["model"], "optimizer": per_param, "groups": groups,
            "scheduler": saved.get("scheduler"), "correction": correction}


def put_state(stages: Stages, checkpoints: Corrections, states: list[dict[str, Any]],
              where: str) -> None:
    """Copies the states of another cut's stages into this rank's stages (see the module's
    docstring); `where` names them in an error."""
    assert stages.plan is not None
    weights: dict[str, torch.Tensor] = {}
    per_param: dict[str, dict[str, Any]] = {}
    velocity: dict[str, torch.Tensor] = {}
    for state in states:
        weights.update(state["weights"])
        per_param.update(state["optimizer"])
        if state["correction"] is not None and state["correction"]["velocity"]:
            velocity.update(state["correction"]["velocity"])
    for index in stages.stage_indices:
        stage = stages.plan.stages[index]
        module = stages.modules[index]
        ckpt.restore(module, stages.names, weights, where, exact=False)
        source = _source_of(states, stage.start, stage.stop)
        optimizer = stages.optimizers.get(index)
        if optimizer is not None:
            saved = optimizer.state_dict()
            order = [p for group in optimizer.param_groups for p in group["params"]]
            for number, param in enumerate(order):
                key = param_key(stages, param)
                if key in per_param:  # its own tensors: under threads, replicas
                    saved["state"][number] = _cloned(per_param[key])  # get the same
            if source is not None and len(source["groups"]) == len(saved["param_groups"]):
                for group, hyper in zip(saved["param_groups"], source["groups"]):
                    group.update({k: v for k, v in hyper.items() if k != "params"})
            optimizer.load_state_dict(saved)
        scheduler = stages.schedulers.get(index)
        if scheduler is not None and source is not None and source["scheduler"]:
            scheduler.load_state_dict(source["scheduler"])
        if source is not None and source["correction"] is not None:
            vector = [_cloned(velocity.get(param_key(stages, p)))
                      for _, p in module.named_parameters()]
            correction = dict(source["correction"])
            correction["velocity"] = None if any(v is None for v in vector) else vector
            checkpoints.save_correction_for(index, correction)  # for its runtime


def _cloned(value: Any) -> Any:
    """Tensors in `value` copied (the gathered state is shared by rank threads)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _cloned(v) for k, v in value.items()}
    return value


def _source_of(states: list[dict[str, Any]], start: int, stop: int) -> dict[str, Any] | None:
    """The old stage state that held the first block of [start, stop) among those with an
    optimizer (a stage of parameter-free blocks has none); else the one holding `start`."""
    holding = [s for s in states if s["start"] < stop and start < s["stop"]]
    holding.sort(key=lambda s: s["start"])
    with_groups = [s for s in holding if s["groups"]]
    if with_groups:
        return with_groups[0]
    return holding[0] if holding else None
