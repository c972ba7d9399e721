"""A rank's part of checkpoints (`Checkpoints`): its stages written to a checkpoint folder
(the manifest committed by rank 0 once every stage file is on disk), and a checkpoint's state
restored into its stages (`load`). The files themselves are `pipedream_fast.checkpoint`'s.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch


from pipedream_fast import checkpoint as ckpt
from pipedream_fast.formats import Plan
from pipedream_fast.rank import keyed_state
from pipedream_fast.runtime.stage import (StageRuntime)
from pipedream_fast.training import (named_state)
from pipedream_fast.rank.cutting import Stages
from pipedream_fast.rank.data import Progress
from pipedream_fast.rank.state import RankContext


class Checkpoints:
    """Saving this rank's stages and restoring them (see the module's docstring).

    Owns what a checkpoint read by `load` still has to put into stages not made yet:
    `pending_restore` (the folder and manifest, until the model is cut), `saved_copies`
    (localsgd's weight copies, until the stage's runtime is made) and `saved_staleness`
    (the staleness corrections' velocities, likewise; a move parks its gathered ones here too).
    It restores through the stages' hooks (`Stages.on_cut`, `Stages.on_runtime`).
    """

    def __init__(self, ctx: RankContext, stages: Stages, progress: Progress) -> None:
        self.ctx = ctx
        self.stages = stages
        self.progress = progress
        self.pending_restore: tuple[Path, dict[str, Any]] | None = None
        self.saved_copies: dict[int, list[dict[str, Any]]] = {}
        self.saved_staleness: dict[int, dict[str, Any] | None] = {}
        stages.on_cut = self.restore_pending
        stages.on_runtime = self.restore_into

    def restore_into(self, runtime: StageRuntime) -> None:
        """A new stage runtime gets what `load` (or a move) saved for its stage."""
        self.restore_copies(runtime)
        if runtime.stage in self.saved_staleness:
            runtime.restore_correction(self.saved_staleness.pop(runtime.stage))

    def save_correction_for(self, stage: int, state: dict[str, Any] | None) -> None:
        """A staleness correction's state for stage `stage`, put into its runtime when that
        is made (a move's gathered velocity)."""
        self.saved_staleness[stage] = state

    def forget_saved_corrections(self) -> None:
        self.saved_staleness.clear()

    def save(self, path: str | os.PathLike[str]) -> None:
        """Writes a checkpoint directory (see `pipedream_fast.checkpoint`): each stage's first
        rank writes its stage durably, then rank 0 commits the set with the manifest. Saving
        over an existing checkpoint stages the new one and swaps it in; a file, or a folder
        holding anything but a checkpoint, is refused on every rank (a save never deletes
        other files). Collective."""
        self.stages.require_setup("save()")
        assert self.stages.plan is not None
        final = Path(path)
        decided: list[Any] = [None]  # rank 0's: the folder to write, or why not
        if self.ctx.rank == 0:
            try:
                decided[0] = ckpt.prepare_save(final)
            except ckpt.CheckpointError as err:  # every rank must hear of it, not wait
                decided[0] = str(err)
        self.ctx.agree(lambda: decided.__setitem__(0, self.ctx.control.broadcast_object(decided[0],
                                                                                  src=0)),
                    "saving a checkpoint")
        if isinstance(decided[0], str):
            raise ckpt.CheckpointError(decided[0])
        folder: Path = decided[0]
        entries: list[Any] = []
        failed: BaseException | None = None
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self._write_stages(folder, entries)
        except Exception as err:  # every rank must hear of it (a full disk), not wait
            failed = err
        # Where the loader stands, known to the first stage's ranks: during train() (a
        # periodic save, a stop) after the steps trained so far, whatever was read ahead.
        position = None
        if 0 in self.stages.stage_indices:
            position = self.progress.position()
        gathered: list[Any] = []
        self.ctx.agree(lambda: gathered.extend(self.ctx.control.all_gather_object(
            (entries, position, None if failed is None else str(failed)))),
            "saving a checkpoint")
        problem = next(((r, text) for r, (_, _, text) in enumerate(gathered) if text), None)
        if problem is None and self.ctx.rank == 0:
            try:
                epoch, index = next(p for _, p, _ in gathered if p is not None)
                ckpt.write_manifest(folder, ckpt.manifest_for(
                    self.progress.step, epoch, self.ctx.schedule_name,
                    self.stages.plan.to_dict(), [e for part, _, _ in gathered for e in part],
                    self.ctx.run_id, self.stages.aliases(), epoch_batches=index,
                    seed=self.ctx.seed))
                if folder != final:
                    ckpt.swap_in(final)
            except Exception as err:
                failed, problem = err, (0, str(err))
        outcome: list[Any] = [problem]
        self.ctx.agree(lambda: outcome.__setitem__(0, self.ctx.control.broadcast_object(
            outcome[0], src=0)), "saving a checkpoint")
        if outcome[0] is not None:
            rank, text = outcome[0]
            if self.ctx.rank == 0:  # a set without its manifest is no checkpoint: drop it
                shutil.rmtree(folder, ignore_errors=True)
            message = (text if rank == self.ctx.rank else
                       f"rank {rank} could not save its part of {final}: {text}")
            raise ckpt.CheckpointError(message) from failed

    def _write_stages(self, folder: Path, entries: list[Any]) -> None:
        """Writes the stage files this rank owns into `folder`, their entries into `entries`."""
        assert self.stages.plan is not None
        for index, module in self.stages.modules.items():
            if self.stages.plan.stages[index].ranks[0] != self.ctx.rank:
                continue  # replicas hold the same weights: the first one writes them
            optimizer, scheduler = self.stages.optimizers.get(index), self.stages.schedulers.get(index)
            payload = {"model": named_state([module], self.stages.names),
                       "optimizer": optimizer.state_dict() if optimizer else None,
                       "scheduler": scheduler.state_dict() if scheduler is not None else None,
                       # what lets the file load on another cut (keyed_state)
                       "keys": keyed_state.file_keys(self.stages, index)}
            copies = self.copies_state(index)
            if copies is not None:
                payload["copies"] = copies
            correction = self.correction_state(index)
            if correction is not None:
                payload["staleness"] = correction
            entries.append((index, ckpt.write_stage(folder, index, payload)))

    def copies_state(self, index: int) -> list[dict[str, Any]] | None:
        """localsgd: the weight copies of stage `index` beyond the module's own (copy 0), by
        the stage module's parameter names, with their optimizer and scheduler state."""
        runtime = self.stages.runtimes.get(index)
        if runtime is None or len(runtime.copies) < 2:
            return self.saved_copies.get(index)  # loaded, not trained since: kept as read
        return [{"params": {n: p.detach().clone() for n, p in zip(runtime.param_names, c.params)},
                 "optimizer": c.optimizer.state_dict() if c.optimizer is not None else None,
                 "scheduler": c.scheduler.state_dict() if c.scheduler is not None else None}
                for c in runtime.copies[1:]]

    def correction_state(self, index: int) -> dict[str, Any] | None:
        """The staleness correction's state of stage `index` (its velocity), if it has one."""
        runtime = self.stages.runtimes.get(index)
        if runtime is None:
            return self.saved_staleness.get(index)  # loaded, not trained since
        if runtime.correction is not None:
            return runtime.correction.state_dict()
        return runtime.pending_correction_state

    def restore_copies(self, runtime: StageRuntime) -> None:
        """Puts the weight copies a checkpoint saved (`load`) into a new stage runtime."""
        saved = self.saved_copies.pop(runtime.stage, None)
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

    def _restore_relayout(self, folder: Path, manifest: dict[str, Any], saved: Plan) -> None:
        """A checkpoint of another cut (other stages, replicas, world size): every stage file
        is read by its keys and this rank's stages take what they hold (`keyed_state`)."""
        assert self.stages.plan is not None
        states = []
        for index, stage in enumerate(saved.stages):
            where = str(folder / manifest["files"][str(index)]["file"])
            states.append(keyed_state.state_from_file(ckpt.load_stage(folder, manifest, index),
                                                      stage.start, stage.stop, where))
        keyed_state.put_state(self.stages, self, states,
                              f"{folder} (saved as {layout(saved)}, loaded as "
                              f"{layout(self.stages.plan)})")

    def save_periodic(self) -> None:
        assert self.ctx.options.checkpoint_dir is not None
        root = Path(self.ctx.options.checkpoint_dir)
        self.save(root / f"step-{self.progress.step}")
        if self.ctx.rank == 0:
            ckpt.prune(root, self.ctx.options.checkpoint_keep, self.ctx.run_id)

    def resume(self, folder: Path, manifest: dict[str, Any]) -> None:
        """Where `load` puts the checkpoint: weights and states now, or once the model is
        cut (a model captured at its first minibatch); the step and the loader's place."""
        self.pending_restore = (folder, manifest)
        if self.stages.plan is not None:
            self.restore_pending()
        self.progress.restore(int(manifest["step"]), int(manifest["epoch"]),
                              int(manifest.get("epoch_batches", 0)))

    def restore_pending(self) -> None:
        """Puts a checkpoint's weights, optimizer and scheduler state into this rank's stages
        (`load`; deferred to the cut for a model captured at its first minibatch)."""
        if self.pending_restore is None:
            return
        (folder, manifest), self.pending_restore = self.pending_restore, None
        assert self.stages.plan is not None
        saved_plan = Plan.from_dict(manifest["plan"])
        if layout(saved_plan) != layout(self.stages.plan):
            self._restore_relayout(folder, manifest, saved_plan)
            return
        for index in self.stages.stage_indices:
            saved = ckpt.load_stage(folder, manifest, index)
            ckpt.restore(self.stages.modules[index], self.stages.names, saved["model"],
                         str(folder / manifest["files"][str(index)]["file"]),
                         exact=manifest["format"] != ckpt.LEGACY)
            if saved["optimizer"] is not None and index in self.stages.optimizers:
                self.stages.optimizers[index].load_state_dict(saved["optimizer"])
            if saved.get("scheduler") is not None and index in self.stages.schedulers:
                self.stages.schedulers[index].load_state_dict(saved["scheduler"])
            if saved.get("copies") is not None:  # localsgd: restored into the first run's stage
                self.saved_copies[index] = saved["copies"]
            if index in self.stages.runtimes:
                self.stages.runtimes[index].restore_correction(saved.get("staleness"))
            else:  # restored into the stage when it is made
                self.saved_staleness[index] = saved.get("staleness")


def layout(plan: Plan) -> list[list[Any]]:
    """A plan's cut: [start, stop, [ranks]] per stage (what a checkpoint's files follow)."""
    return [[s.start, s.stop, list(s.ranks)] for s in plan.stages]
