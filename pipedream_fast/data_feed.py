"""A loader turned into microbatches on the ranks that read it: epochs under a seeded random
state (so replicas of the first stage read alike), the first stage's microbatch source (a
minibatch of any size split as evenly as it can, each microbatch's sample counts travelling
with its target so that its loss weighs by its samples), the targets' structure, padding of
an evaluation batch, and a model's own loss.
"""

from __future__ import annotations

import contextlib
import functools
import random
import threading
from typing import Any
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import DataLoader, DistributedSampler

from pipedream_fast import user_errors
from pipedream_fast.ir import Schedule


def split_microbatches(value: Any, chunks: int) -> list[Any]:
    """Splits a tensor, or a tuple/list/dict of tensors, into `chunks` along dimension 0 as
    evenly as possible, as `torch.tensor_split` does: of N samples, the first N % chunks
    microbatches get one more (10 into 4: 3, 3, 2, 2; fewer samples than chunks leave the last
    microbatches empty, see `MicrobatchFeed`). Non-tensor values, such as a flag or None, are
    the same in every microbatch."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return [value] * chunks
    if isinstance(value, torch.Tensor):
        return list(value.tensor_split(chunks))
    if isinstance(value, (tuple, list)):
        parts = [split_microbatches(v, chunks) for v in value]
        return [type(value)(p[i] for p in parts) for i in range(chunks)]
    if isinstance(value, dict):
        by_key = {k: split_microbatches(v, chunks) for k, v in value.items()}
        return [{k: p[i] for k, p in by_key.items()} for i in range(chunks)]
    raise TypeError(f"cannot split a {type(value).__name__} into microbatches: inputs and "
                    f"targets must be tensors, or tuples, lists or dicts of tensors")


def microbatch_sizes(samples: int, chunks: int) -> list[int]:
    """The real samples of each microbatch of a minibatch of `samples` (`split_microbatches`:
    the first samples % chunks get one more; 0 for a microbatch of padding)."""
    q, r = divmod(samples, chunks)
    return [q + 1] * r + [q] * (chunks - r)


def repeat_last(value: Any, size: int) -> Any:
    """`value` (a pytree of tensors) with every tensor that has a batch dimension extended to
    `size` samples by repeats of its last one (0-d tensors and non-tensors as they are)."""
    def pad(t: Any) -> Any:
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] >= size:
            return t
        return torch.cat([t, t[-1:].expand(size - t.shape[0], *t.shape[1:])])
    return pytree.tree_map(pad, value)


def model_loss(output: Any, _target: Any = None) -> torch.Tensor:
    """`loss_fn=None`: the model computes its own loss. It is the output itself when that is
    a 0-d tensor, the `"loss"` entry of a dict or Hugging Face `ModelOutput`, or the one 0-d
    floating tensor of a tuple such as nanoGPT's `(logits, loss)`."""
    if isinstance(output, torch.Tensor) and output.dim() == 0:
        return output
    if isinstance(output, Mapping) and output.get("loss") is not None:
        return output["loss"]
    if isinstance(output, (tuple, list)):
        scalars = [v for v in output if isinstance(v, torch.Tensor) and v.dim() == 0
                   and v.is_floating_point()]
        if len(scalars) == 1:
            return scalars[0]
    raise ValueError(f"loss_fn=None takes the loss from the model's output (a 0-d tensor, a "
                     f"dict or ModelOutput with 'loss', or a tuple holding one 0-d tensor), but "
                     f"the model returned {_describe_output(output)}: pass the targets among the "
                     f"inputs (labels=..., or (idx, targets)) so that the model computes its "
                     f"loss, or give a loss_fn")


def _describe_output(output: Any) -> str:
    if isinstance(output, torch.Tensor):
        return f"a tensor of shape {tuple(output.shape)}"
    if isinstance(output, Mapping):
        return f"a {type(output).__name__} with keys {list(output)}"
    if isinstance(output, (tuple, list)):
        return f"a {type(output).__name__} of {[_describe_output(v) for v in output]}"
    return repr(output)


class InputsOnly:
    """A loader whose items are the model's inputs alone (`loss_fn=None`: the targets are
    among the inputs), seen as (inputs, ()) pairs: no target travels. Everything else is the
    loader's."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def __iter__(self) -> Iterator[tuple[Any, tuple[()]]]:
        return ((item, ()) for item in self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.loader, name)


class MicrobatchFeed:
    """Microbatches of a loader, read lazily in order and kept until every user has taken them.

    `uses(mb)` says how many takes microbatch `mb` gets in this process (one per rank that
    feeds the first stage or the last stage with it); microbatches nobody uses are dropped, so
    the feed holds only the microbatches in flight, however long the run.

    A minibatch of N samples splits as evenly as it can (`split_microbatches`: 10 into 4 is
    3, 3, 2, 2). `counts` (training): each microbatch's target travels as (target, counts),
    counts an int64 tensor (n, N, chunks): its real samples, its step's, and the step's
    microbatches, so that the rank computing its loss, wherever that is, weighs it by
    chunks * n / N (`runtime.executor.sample_weight`): the step then equals the plain loop's
    on the whole batch.
    """

    def __init__(self, batches: Iterator[Any], chunks: int, uses: Callable[[int], int],
                 counts: bool = False, record_sizes: bool = False) -> None:
        self._batches = batches
        self._chunks = chunks
        self._uses = uses
        self._counts = counts
        self._cache: dict[int, tuple[Any, int]] = {}  # mb -> (value, takes left)
        # mb -> the bytes of its inputs, with `record_sizes` (a traced run: one entry per
        # microbatch would grow without bound over a long one): a run's real sizes, which the
        # simulator can replay (`sim.SizedCosts`) when shapes vary
        self.input_bytes: dict[int, int] | None = {} if record_sizes else None
        self._next_step = 0
        self._lock = threading.Lock()

    def take(self, mb: int) -> tuple[Any, Any]:
        with self._lock:
            while mb not in self._cache:
                if mb < self._next_step * self._chunks:
                    raise RuntimeError(f"microbatch {mb} was taken more often than declared")
                try:
                    batch = next(self._batches)
                except StopIteration:
                    raise RuntimeError(f"the data loader ran out at step {self._next_step}; a "
                                       f"one-shot iterator needs at least as many batches as "
                                       f"steps (a re-iterable loader is read again)") from None
                if not isinstance(batch, (tuple, list)) or len(batch) != 2:
                    raise TypeError(f"the loader must yield (inputs, targets) pairs, got "
                                    f"{type(batch).__name__}")
                base = self._next_step * self._chunks
                for i, part in enumerate(self._split(*batch)):
                    if self.input_bytes is not None:
                        self.input_bytes[base + i] = sum(
                            t.nbytes for t in pytree.tree_leaves(part[0])
                            if isinstance(t, torch.Tensor))
                    if uses := self._uses(base + i):
                        self._cache[base + i] = (part, uses)
                self._next_step += 1
            value, left = self._cache[mb]
            if left == 1:
                del self._cache[mb]
            else:
                self._cache[mb] = (value, left - 1)
            return value

    def _split(self, x: Any, y: Any) -> list[tuple[Any, Any]]:
        """A minibatch's `chunks` microbatches, as (inputs, target) pairs."""
        chunks = self._chunks
        if not self._counts:
            return list(zip(split_microbatches(x, chunks), split_microbatches(y, chunks)))
        samples = batch_size(x)
        if samples < chunks:
            # Fewer samples than microbatches: a short last batch (a DataLoader whose
            # batch_size is below chunks is refused up front, `check_loader`). The schedule
            # runs `chunks` microbatches a step whatever the batch holds, so the empty ones
            # get a repeat of the last sample that counts 0: its loss is weighed by 0, so it
            # adds nothing to the gradient nor to the step's loss. Refusing instead would fail
            # a run at its epoch's last batch, after the epoch trained, and the fix (drop the
            # tail) loses data a plain loop trains on.
            x, y = repeat_last((x, y), chunks)
        sizes = microbatch_sizes(samples, chunks)
        return [(px, (py, _counts(n, samples, chunks)))
                for px, py, n in zip(split_microbatches(x, chunks),
                                     split_microbatches(y, chunks), sizes)]


@functools.lru_cache(maxsize=256)
def _counts(samples: int, step_samples: int, chunks: int) -> torch.Tensor:
    """A microbatch's counts tensor, made once per value: a run has a handful of them, and a
    tensor made per microbatch costs microseconds. Shared, so never written: it travels
    (packed into a message) and is read (`sample_weight`)."""
    return torch.tensor([samples, step_samples, chunks])


class KeptInputs:
    """The microbatches a rank fed its first stage, kept (by reference: no copy) until their
    step ends, so that a step whose loss is not finite can be checked for non-finite data:
    a NaN in a batch is the data's fault, not the learning rate's. They are held by the
    stage's autograd graph until then anyway."""

    def __init__(self, chunks: int) -> None:
        self._chunks = chunks
        self._kept: dict[int, tuple[Any, Any]] = {}  # microbatch -> (inputs, target)

    def wrap(self, inputs: Callable[[int], tuple[tuple[Any, ...], Any]]
             ) -> Callable[[int], tuple[tuple[Any, ...], Any]]:
        def keeping(mb: int) -> tuple[tuple[Any, ...], Any]:
            value = inputs(mb)
            self._kept[mb] = value
            return value
        return keeping

    def nonfinite(self, step: int) -> list[int]:
        """[non-finite values, all values] of the floating inputs, then the same of the
        targets, of the microbatches of `step` (of the run, from 0) this rank fed."""
        counts = [0, 0, 0, 0]
        for mb in range(step * self._chunks, (step + 1) * self._chunks):
            for part, value in enumerate(self._kept.get(mb, ((), None))):
                for leaf in pytree.tree_leaves(value):
                    if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
                        counts[2 * part] += int((~torch.isfinite(leaf)).sum())
                        counts[2 * part + 1] += leaf.numel()
        return counts

    def forget_through(self, step: int) -> None:
        """Drops the microbatches of `step` and before (they are done)."""
        for mb in [mb for mb in self._kept if mb < (step + 1) * self._chunks]:
            del self._kept[mb]


def reads_data(schedule: Schedule, rank: int, mb: int) -> bool:
    """Whether rank reads microbatch mb from the loader: only the rank that feeds it to the
    first stage does (its target travels with the activations to the last stage)."""
    return schedule.rank_of(0, mb) == rank


def feed_uses(schedule: Schedule, ranks: Sequence[int]) -> Callable[[int], int]:
    """How many takes each microbatch gets from `ranks` (the ranks of this process)."""
    if len(ranks) == 1:  # a rank's own process: asked once per microbatch, so kept short
        only = ranks[0]
        return lambda mb: int(reads_data(schedule, only, mb))
    return lambda mb: sum(reads_data(schedule, rank, mb) for rank in ranks)


def to_device(value: Any, device: torch.device) -> Any:
    """Moves a tensor or a tuple/list/dict of tensors (asynchronously from pinned memory)."""
    if isinstance(value, torch.Tensor):  # already there: no call (a few us per tensor)
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, (tuple, list)):
        return type(value)(to_device(v, device) for v in value)
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    return value


CPU = torch.device("cpu")


def data_source(feed: MicrobatchFeed, schedule: Schedule, rank: int,
                flatten: Callable[[Any], tuple[Any, ...]], device: torch.device = CPU
                ) -> Callable[[int], tuple[tuple[Any, ...], Any]] | None:
    """The executor's input source for a rank that holds the first stage (None elsewhere):
    a microbatch's positional inputs and its target, on the rank's device."""
    if 0 not in schedule.stages_of(rank):
        return None

    move = device != CPU  # on the CPU the loader's tensors are there: nothing to walk

    def inputs(mb: int) -> tuple[tuple[Any, ...], Any]:
        x, y = feed.take(mb)
        if move:
            x, y = to_device(x, device), to_device(y, device)
        return flatten(x), y

    return inputs


def target_spec(target: Any) -> pytree.TreeSpec:
    """The structure of a target (tensors, or tuples/lists/dicts of them), checked."""
    leaves, spec = pytree.tree_flatten(target)
    bad = [type(v).__name__ for v in leaves if not isinstance(v, torch.Tensor)]
    if bad:
        raise TypeError(f"targets must be tensors, or tuples, lists or dicts of tensors (they "
                        f"travel with the activations to the last stage); found {bad[0]}")
    return spec


# ---- loaders ---------------------------------------------------------------------------------

def batch_size(inputs: Any) -> int:
    """The samples in a minibatch: dimension 0 of its first tensor."""
    leaves = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.dim()]
    if not leaves:
        raise TypeError("a minibatch's inputs must hold at least one tensor with a batch "
                        "dimension")
    return int(leaves[0].shape[0])


def sample_shapes(inputs: Any) -> list[list[int]]:
    """The shape of one sample of each tensor of a minibatch that has a batch dimension
    (dimension 0 dropped): what a plan made at this minibatch assumed of every later one."""
    return [list(t.shape[1:]) for t in pytree.tree_leaves(inputs)
            if isinstance(t, torch.Tensor) and t.dim()]


def larger_than(shapes: list[list[int]], planned: list[list[int]]) -> bool:
    """Whether a sample of `shapes` is larger than one of `planned` in some dimension (a
    longer sequence, a larger image); another structure is not compared (the transport
    refuses it)."""
    return len(shapes) == len(planned) and any(
        len(a) == len(b) and any(x > y for x, y in zip(a, b)) for a, b in zip(shapes, planned))


def pad_batch(batch: Any, size: int, most: int | None = None) -> tuple[Any, Any]:
    """An evaluation minibatch as (inputs, (targets, real)): a shorter one is padded to `size`
    samples by repeating its last, and `real` marks the samples that are not padding. One of
    more than `most` samples (default `size`: the run's first batch set it) is refused."""
    x, y = batch
    n = batch_size(x)
    if n > (size if most is None else most):
        raise ValueError(f"a minibatch of {n} samples follows one of "
                         f"{size if most is None else most}; evaluation batches may only get "
                         f"shorter at the end")
    real = torch.arange(max(n, size)) < n
    if n < size:
        x, y = repeat_last((x, y), size)
    return x, (y, real)


def check_loader(loader: Any, chunks: int, training: bool = True) -> None:
    """Refuses loaders that would train on the wrong data rather than fail: a
    DistributedSampler (this runtime shards data itself, and only the first stage reads).
    Training also refuses a DataLoader whose batch_size is below chunks: every step would
    pad microbatches with a sample that counts 0 (a short last batch is padded so; see
    `MicrobatchFeed`), which is a mistake in the settings, not in the data. Any batch size
    and a short last batch are fine otherwise: microbatches split as evenly as they can and
    each weighs by its samples."""
    loader = loader.loader if isinstance(loader, InputsOnly) else loader
    sampler = getattr(loader, "sampler", None)
    if isinstance(sampler, DistributedSampler):
        raise ValueError("the loader uses a DistributedSampler: a Pipeline shards the data "
                         "itself (only first-stage ranks read it, and replicas take their "
                         "microbatches of each batch); pass the DataLoader without the "
                         "sampler (shuffle=True shuffles the same way on every replica)")
    size = getattr(loader, "batch_size", None)
    if training and isinstance(loader, DataLoader) and size and size < chunks:
        raise ValueError(f"the loader's batch size {size} is smaller than chunks={chunks}: "
                         f"each step would run {chunks - size} of its {chunks} microbatches "
                         f"on padding; use chunks={size} or less, or a batch size of at "
                         f"least {chunks}")


def steps_for(loader: Any, steps: int | None, epochs: int | None) -> int:
    """Steps of a run: `steps`, or `epochs` passes over the loader (default one)."""
    if steps is not None and epochs is not None:
        raise ValueError("give steps or epochs, not both")
    if steps is not None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        return steps
    epochs = 1 if epochs is None else epochs
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    try:
        length = len(loader)
    except TypeError:
        raise ValueError(f"the loader ({type(loader).__name__}) has no length, so epochs "
                         f"cannot be counted: give steps=") from None
    if length < 1:
        raise ValueError("the data loader is empty")
    return epochs * length


# Rank threads of one process share torch's global random state, and torch.fx patches
# nn.Module while it traces: they take turns where the library seeds, reads data or traces.
GLOBAL_STATE = threading.RLock()


@contextlib.contextmanager
def seeded(seed: int, epoch: int, index: int) -> Iterator[None]:
    """The global random states of torch, Python's `random` and NumPy fixed by (seed, epoch,
    index) inside, restored after: a sampler or loader that draws from them (shuffle=True
    without a generator, worker seeds, random transforms in the main process) then draws the
    same on every replica and in every run, whatever else (dropout) drew in between."""
    value = (seed * 1_000_003 + epoch) * 1_000_003 + index + 1
    with GLOBAL_STATE:
        python_state, numpy_state = random.getstate(), np.random.get_state()
        try:
            with torch.random.fork_rng(devices=[]):
                # The CPU generator only (what fork_rng restores): torch.manual_seed would
                # also reseed CUDA's, and records a stack trace per call (about 1 ms).
                torch.default_generator.manual_seed(value)
                random.seed(value)
                np.random.seed(value % 2 ** 32)
                yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)


def fingerprint(batch: Any) -> tuple[float, ...]:
    """A cheap summary of a minibatch's tensors, to tell whether two ranks read the same."""
    return tuple(float(t.double().sum()) for t in pytree.tree_leaves(batch)
                 if isinstance(t, torch.Tensor))


class EpochBatches:
    """Minibatches of a loader, epoch after epoch: a re-iterable loader (a DataLoader, a list)
    is iterated again for each epoch and left usable; a one-shot iterator is read once.
    Every iteration and every batch is read under `seeded(seed, epoch, index)`, so an epoch's
    order (a shuffling sampler's permutation, worker seeds) depends on those alone.

    `start`: batches of `first_epoch` consumed before (a run resumed mid-epoch): a re-iterable
    loader is iterated again and read past them, each under its own seeded state, so the next
    batch is the one the uninterrupted run read there; a one-shot iterator (`one_shot`, else
    seen at the first `iter()`) is taken as standing there already. `position(n)` says where
    the reading stands after the first n batches yielded, however many were read ahead."""

    def __init__(self, loader: Any, seed: int, first_epoch: int, start: int = 0,
                 one_shot: bool | None = None) -> None:
        self._loader = loader
        self._seed = seed
        self.epoch = first_epoch  # the epoch being read
        self._iterator: Iterator[Any] | None = None
        self._index = 0  # batches of the epoch read so far (skipped ones included)
        self._skip = start  # batches of the first epoch to read past before yielding
        self._one_shot = one_shot
        self.read = 0  # batches yielded
        self._epochs = [(0, first_epoch, start)]  # (yielded before it, epoch, its first index)
        # Reading a plain list or tuple draws no random number: no state to fix (seeding
        # costs about 0.1 ms a batch, a tenth of a small pipeline's step).
        self._draws_nothing = type(loader) in (list, tuple)

    def _seeded(self, index: int) -> contextlib.AbstractContextManager[None]:
        if self._draws_nothing:
            return contextlib.nullcontext()
        return seeded(self._seed, self.epoch, index)

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        while True:
            if self._iterator is None:
                with self._seeded(-1):
                    self._iterator = iter(self._loader)
                if self._one_shot is None:
                    self._one_shot = self._iterator is self._loader
                self._index = 0
                if self._one_shot:  # it stands where its reader left it: nothing to read past
                    self._index, self._skip = self._skip, 0
            with self._seeded(self._index):
                try:
                    batch = next(self._iterator, _END)
                except Exception as err:  # the user's loader: name the batch it failed on
                    user_errors.note_batch(err, self._index, self.epoch)
                    raise
            if batch is not _END:
                self._index += 1
                if self._skip:  # consumed before the resume: read only to get past it
                    self._skip -= 1
                    continue
                self.read += 1
                return batch
            if self._index == 0 or self._one_shot:
                raise StopIteration  # empty, or a one-shot iterator that is used up
            self._iterator, self._index, self._skip = None, 0, 0
            self.epoch += 1
            self._epochs.append((self.read, self.epoch, 0))

    def position(self, consumed: int) -> tuple[int, int]:
        """(epoch, batches of it consumed) after the first `consumed` batches yielded: where
        a run that trained on those goes on. An epoch read to its end counts as the start of
        the next (a re-iterable loader with a length)."""
        begun, epoch, first = next(e for e in reversed(self._epochs) if e[0] <= consumed)
        index = first + consumed - begun
        if index and not self._one_shot:
            try:
                if index >= len(self._loader):
                    return epoch + 1, 0
            except (TypeError, NotImplementedError):
                pass  # no length: the end shows when it is read
        return epoch, index

    def rest(self) -> EpochBatches:
        """The batches after those yielded, from the same iterator, counted from 0: the next
        run on the same loader goes on where this one stopped (when it read nothing ahead)."""
        other = EpochBatches(self._loader, self._seed, self.epoch, self._index, self._one_shot)
        other._iterator, other._index, other._skip = self._iterator, self._index, 0
        return other

    def epochs_started(self) -> int:
        """Epochs begun so far, counted from the first: where the next run continues."""
        return self.epoch + (1 if self._iterator is not None else 0)


_END = object()
