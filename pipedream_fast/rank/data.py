"""A rank's progress through its data (`Progress`): the steps trained, where the loader
stands, and each run's data agreed by every rank: the first stage's first rank reads the
first batch and tells the others the steps, chunks, target structure and where the loader's
reading begins; replicas of the first stage check that they read alike.
"""

from __future__ import annotations

import itertools
from typing import Any
from collections.abc import Iterator

import torch

from torch.utils import _pytree as pytree

from pipedream_fast import user_errors
from pipedream_fast.data_feed import larger_than, sample_shapes
from pipedream_fast.training import (EpochBatches, check_loader, InputsOnly, batch_size,
                                     fingerprint, pad_batch, steps_for, target_spec)
from pipedream_fast.rank.cutting import Stages
from pipedream_fast.rank.state import RankContext


class Progress:
    """Steps trained and where the loader stands (see the module's docstring).

    Owns: `step` (minibatches trained so far), and where training reads the loader
    (first-stage ranks; saved in checkpoints): its `epoch` (which seeds its order) and the
    batches of that epoch trained on (`epoch_batches`); the loader of the last run
    (`last_loader`) and its batches (`live`), where a run on the same loader goes on reading;
    `reading`: the batches of the run in progress and `step` when it began; `agreed_batch`,
    the size of the last run's minibatches; `peeked`, a batch read to plan with;
    `told_larger`, whether a batch larger than the plan's was told of (once per Pipeline).
    """

    def __init__(self, ctx: RankContext, stages: Stages) -> None:
        self.ctx = ctx
        self.stages = stages
        self.step = 0
        self.epoch, self.epoch_batches = 0, 0
        self.last_loader: Any = None
        self.live: EpochBatches | None = None
        self.reading: tuple[EpochBatches, int] | None = None
        self.agreed_batch = 0
        self.told_larger = False
        self.peeked: tuple[EpochBatches, Any] | None = None

    def position(self) -> tuple[int, int]:
        """(epoch, batches of it trained): during train() (a periodic save, a stop) after the
        steps trained so far, whatever was read ahead."""
        if self.reading is not None:
            return self.reading[0].position(self.step - self.reading[1])
        return self.epoch, self.epoch_batches

    def advance(self, steps: int) -> None:
        """`steps` more minibatches trained."""
        self.step += steps

    def restore(self, step: int, epoch: int, epoch_batches: int) -> None:
        """Where a checkpoint left off (`load`)."""
        self.step, self.epoch, self.epoch_batches = step, epoch, epoch_batches

    def end_reading(self, loader: Any) -> None:
        """After a train() call: where the next run (or a checkpoint) goes on."""
        if self.reading is None:
            return
        (source, began), self.reading = self.reading, None
        consumed = self.step - began  # the steps trained, not the batches read ahead
        self.epoch, self.epoch_batches = source.position(consumed)
        self.last_loader = loader
        self.live = source if source.read == consumed and self.epoch_batches else None

    def open(self, loader: Any, steps: int | None, epochs: int | None,
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

        `evaluation`: each target gets a mask of the real samples, and a batch is padded to
        microbatches of equal size (`_padded`), so that nothing is dropped and nothing counted
        twice. Training: any batch size and a short last batch are fine (microbatches split
        as evenly as they can, each weighed by its samples: `MicrobatchFeed`)."""
        user_loader = loader
        if self.ctx.inputs_only and loader is not None:
            loader = InputsOnly(loader)
        epoch, index = self.epoch, 0 if evaluation else self.epoch_batches
        if (not evaluation and index and self.last_loader is not None
                and user_loader is not self.last_loader):
            epoch, index = epoch + 1, 0  # another loader: a new epoch
        if self.stages.plan is None:  # cut and plan on the first minibatch
            if self.ctx.rank == 0:
                self.peeked = self._peek(loader, self._open_batches(
                    user_loader, loader, epoch, index, evaluation))
            first = self.peeked[1][0] if self.peeked else None
            if self.stages.chain is None:
                self.stages.capture(first)
            self.stages.setup(self.stages.fixed_plan() or self.stages.plan_from(first))
        assert self.stages.plan is not None
        lead = self.stages.plan.stages[0].ranks[0]
        payload: list[Any] = [None]
        failure: Exception | None = None
        batches: Iterator[Any] | None = None
        source: EpochBatches | None = None
        if self.ctx.rank == lead:
            try:
                peeked, self.peeked = self.peeked, None
                source, first = peeked if peeked is not None else self._peek(
                    loader, self._open_batches(user_loader, loader, epoch, index, evaluation))
                chunks = self.ctx.chunks_for(first[0])
                check_loader(loader, chunks, training=not evaluation)
                size = batch_size(first[0])
                # What travels with each microbatch's target: evaluation's mask of the real
                # samples; training's sample counts (n, N, chunks: `MicrobatchFeed`).
                extra = (torch.ones(size, dtype=torch.bool) if evaluation
                         else torch.zeros(3, dtype=torch.int64))
                target = (first[1], extra)
                total = steps_for(loader, steps, epochs)
                if steps is None:  # epochs: the rest of the epoch in progress is the first
                    total -= index
                payload[0] = {"steps": total, "chunks": chunks,
                              "target": pytree.treespec_dumps(target_spec(target)),
                              "epoch": epoch, "index": index, "batch_size": size}
                batches = itertools.chain([first], source)
            except Exception as err:  # every rank must hear of it
                failure = err
                payload[0] = {"error": f"{type(err).__name__}: {err}"}
        self.ctx.agree(lambda: payload.__setitem__(0, self.ctx.control.broadcast_object(payload[0],
                                                                                  src=lead)),
                    f"the start of the run (rank {lead} reads the data)")
        if "error" in payload[0]:  # the reader raises its own error, the others name it
            told = failure if self.ctx.rank == lead and failure is not None else ValueError(
                f"the data loader on rank {lead} (first stage): {payload[0]['error']}")
            user_errors.note_said_by(told, lead)  # which says it, in one line under run
            raise told
        agreed = payload[0]
        self.agreed_batch = agreed["batch_size"]
        if 0 in self.stages.stage_indices and batches is None:  # a replica of the first stage
            source = self._open_batches(user_loader, loader, agreed["epoch"], agreed["index"],
                                        evaluation)
            batches = source
        if not evaluation:
            self.epoch, self.epoch_batches = agreed["epoch"], agreed["index"]
            self.reading = (source, self.step) if source is not None else None
        if len(self.stages.plan.stages[0].ranks) > 1:
            batches = self._check_replicas_read_alike(batches)
        planned = self.stages.plan.extra.get("planned_at")
        if (not evaluation and batches is not None and self.ctx.rank == lead and planned
                and self.ctx.options.memory_per_worker is not None and not self.told_larger):
            batches = self._watch_sizes(batches, planned, agreed["index"])
        if evaluation and batches is not None:
            batches = self._padded(batches, agreed["batch_size"], agreed["chunks"])
        return agreed["steps"], agreed["chunks"], pytree.treespec_loads(agreed["target"]), batches

    def _watch_sizes(self, batches: Iterator[Any], planned: list[list[int]],
                     index: int) -> Iterator[Any]:
        """The batches as they are; the first whose samples are larger than those the plan was
        made at (a longer sequence) is told of once: memory_per_worker was planned at the
        smaller, and the planner's figures no longer hold for it."""
        for number, batch in enumerate(batches, start=index + 1):
            if not self.told_larger and larger_than(sample_shapes(batch[0]), planned):
                self.told_larger = True
                shapes = sample_shapes(batch[0])
                print(f"pipedream_fast: batch {number} of the epoch has larger samples "
                      f"({', '.join(map(str, shapes))}) than the batch the plan was made at "
                      f"({', '.join(map(str, planned))}): memory_per_worker was planned at the "
                      f"smaller, so a stage may now hold more than it allows; pass your "
                      f"largest batch as example_inputs= to plan at it", flush=True)
            yield batch

    def _padded(self, batches: Iterator[Any], size: int, chunks: int) -> Iterator[Any]:
        """Evaluation's batches, each with a mask of its real samples (see `pad_batch`),
        padded so that its microbatches hold equal samples: to the first batch's size rounded
        up to a multiple of chunks (the links of a forward-only run keep their first shapes).
        Not for a model that computes its own loss: padding would enter its mean, so such a
        batch is split as it is (as evenly as it can), padded only where it holds fewer
        samples than chunks (the microbatches of padding alone are skipped)."""
        if self.ctx.inputs_only:
            return (pad_batch(b, chunks, most=size) for b in batches)
        even = -(-size // chunks) * chunks
        return (pad_batch(b, even, most=size) for b in batches)

    def _open_batches(self, user_loader: Any, loader: Any, epoch: int, index: int,
                      evaluation: bool) -> EpochBatches:
        """The batches of `loader` from batch `index` of `epoch` on: the last run's, read on,
        when it stopped there on this loader, else read again from the epoch's start."""
        live = self.live
        if (not evaluation and live is not None and user_loader is self.last_loader
                and live.position(live.read) == (epoch, index)):
            return live.rest()
        return EpochBatches(loader, self.ctx.seed, epoch, index,
                            one_shot=isinstance(user_loader, Iterator))

    def _check_replicas_read_alike(self, batches: Iterator[Any] | None) -> Iterator[Any] | None:
        """The replicas of the first stage must read the same batches (each takes its share of
        every one). The seeded random state makes torch's, Python's and NumPy's shuffling
        agree; a loader drawing from a random state of its own would not, and is caught here
        on the run's first batch. Collective."""
        assert self.stages.plan is not None
        first = next(batches, None) if batches is not None else None
        prints: list[Any] = []
        self.ctx.agree(lambda: prints.extend(self.ctx.control.all_gather_object(
            None if first is None else fingerprint(first))),
                    "comparing the first stage's first batches")
        seen = {prints[r] for r in self.stages.plan.stages[0].ranks}
        if len(seen) > 1:
            raise ValueError(f"the replicas of the first stage (ranks "
                             f"{list(self.stages.plan.stages[0].ranks)}) "
                             f"read different first batches: the loader's order depends on a "
                             f"random state other than torch's, Python's or NumPy's global one "
                             f"(a generator of its own?); seed it the same on every rank, or "
                             f"derive it from the epoch")
        if batches is None or first is None:
            return batches
        return itertools.chain([first], batches)

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
