"""Between a checkpoint's keys and a model's tensors: a stage restored, tied keys shared.

A stage file holds each tensor under its keys in the original model's `state_dict()`;
`restore` copies them into a stage module by those keys, and `share_aliases` makes the keys
of one tied weight name one tensor again, as `state_dict()` does.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence

import torch
from torch import nn

from pipedream_fast.checkpoint.files import CheckpointError


def restore(module: nn.Module, names: Mapping[int, tuple[str, ...]],
            saved: dict[str, torch.Tensor], where: str, exact: bool = True) -> None:
    """Copies a stage file's tensors (`where`) into the stage `module`, each from one of its
    keys in the original model (`names`, from `training.original_names`). With `exact`, the
    file must hold exactly this stage's keys."""
    expected: set[str] = set()
    for name, t in itertools.chain(module.named_parameters(), module.named_buffers()):
        keys = names.get(id(t), ())
        if not keys:
            if isinstance(t, nn.Parameter):
                raise CheckpointError(f"parameter {name} of this stage has no key in the "
                                      f"model's state_dict(), so {where} cannot restore it")
            continue  # a non-persistent buffer: never saved, it keeps the model's value
        expected.update(keys)
        key = next((k for k in keys if k in saved), None)
        if key is None:
            raise CheckpointError(f"{where} lacks {keys[0]!r} of this stage: the checkpoint "
                                  f"of another model or another split")
        if saved[key].shape != t.shape:
            raise CheckpointError(f"{where} holds {key!r} of shape {tuple(saved[key].shape)}, "
                                  f"but the model's is {tuple(t.shape)}: another model")
        with torch.no_grad():
            t.copy_(saved[key])
    unexpected = sorted(set(saved) - expected)
    if exact and unexpected:
        raise CheckpointError(f"{where} holds {unexpected[0]!r} (and {len(unexpected) - 1} "
                              f"more keys) that this stage of the model does not have: "
                              f"another stage's file or another model's")


def share_aliases(state: dict[str, torch.Tensor],
                  groups: Iterable[Sequence[str]]) -> dict[str, torch.Tensor]:
    """`state` with each group of keys held (a tied weight) naming one tensor, as in
    `state_dict()`, so that it is saved once and stays tied."""
    for group in groups:
        held = [k for k in group if k in state]
        for key in held[1:]:
            state[key] = state[held[0]]
    return state
