"""One line for an error of the user's code (a loader, a dataset, a model factory), the whole
traceback in a log.

A data error deep in a training run reaches the top through the executor, the Pipeline and
torch, wrapped on the way (`RuntimeFailure` ... from the dataset's `ValueError`), and its peer
ranks then fail on the closed connection: two tracebacks, 70 to 90 lines, for one bad sample.
What the user needs is the rank, the batch, the exception and where in their code it was
raised: `describe` makes that line, `write_log` keeps the traceback.

The user's code is the innermost traceback frame outside this package, torch and Python's own
library (`user_frame`). Whatever knows the batch attaches it to the exception: the data feed
the loader's batch it was reading (`note_batch`), a rank's run the step it was running
(`note_step`); `batch_of` reads either. Batches, epochs and steps are counted from 1 in what
the user reads, as progress lines and checkpoints (`step-4` holds four steps) count them.
An error every rank raises alike from what one rank found (an empty loader, a step whose
data held a NaN) is said once, by that rank (`note_said_by`); the others only log it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
import tempfile
import traceback
from pathlib import Path
from collections.abc import Callable
from types import TracebackType

_BATCH = "pipedream_batch"  # the attribute `note_batch` sets: (epoch or None, index)
_STEP = "pipedream_step"  # the attribute `note_step` sets: the step, counted from 1
_SAID_BY = "pipedream_said_by"  # the attribute `note_said_by` sets: a rank

LOG_DIR_ENV = "PIPEDREAM_FAST_LOG_DIR"
"""Where a rank of `pipedream-fast run` writes the traceback of its failure (`rank<R>.log`);
the launcher sets it, one folder per job."""


def _library_roots() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(this package and torch, Python's own library)."""
    packages = {os.path.dirname(os.path.abspath(__file__))}
    torch_file = getattr(sys.modules.get("torch"), "__file__", None)
    if torch_file:
        packages.add(os.path.dirname(os.path.abspath(torch_file)))
    paths = sysconfig.get_paths()
    stdlib = {os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib") if paths.get(k)}
    return tuple(packages), tuple(stdlib)


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r + os.sep) for r in roots)


def _is_library(filename: str, roots: tuple[tuple[str, ...], tuple[str, ...]]) -> bool:
    if filename.startswith("<"):  # <string>, <frozen runpy>: not a file of the user's
        return True
    path = os.path.abspath(filename)
    packages, stdlib = roots
    if _inside(path, packages):
        return True
    # Python's library, but not the packages installed into it (the user's own may be)
    return _inside(path, stdlib) and not ({"site-packages", "dist-packages"}
                                           & set(path.split(os.sep)))


def _is_called_code(filename: str) -> bool:
    """A frame of code that is neither a file nor Python's own (a launcher's `-c` code)."""
    return filename.startswith("<") and not filename.startswith("<frozen")


def user_frame(tb: TracebackType | None) -> tuple[str, int] | None:
    """(file, line) of the innermost frame of `tb` in the user's code that the library (this
    package, torch, Python's own) called: the user's code raised it (a dataset, a factory, a
    loss). A script's own frames that merely called the library do not count."""
    roots = _library_roots()
    found = None
    called = False  # a library frame is on the way in
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not _is_called_code(filename):
            if _is_library(filename, roots):
                called = True
            elif called:
                found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from, outermost first (cycles cut)."""
    seen: list[BaseException] = []
    current: BaseException | None = err
    while current is not None and all(current is not s for s in seen) and len(seen) < 16:
        seen.append(current)
        current = current.__cause__ or (None if current.__suppress_context__
                                         else current.__context__)
    return seen


def _note(err: BaseException, attribute: str, value: object) -> None:
    """Sets `attribute` on `err` unless something nearer the cause set it first."""
    if getattr(err, attribute, None) is None:
        try:
            setattr(err, attribute, value)
        except (AttributeError, TypeError):  # an exception type that takes no attributes
            pass


def note_batch(err: BaseException, index: int, epoch: int | None = None) -> None:
    """Records on `err` that it was raised reading the loader's batch `index` of `epoch`
    (both counted from 0, as the loader is read). For the data feed."""
    _note(err, _BATCH, (epoch, index))


def note_step(err: BaseException, step: int) -> None:
    """Records on `err` that it was raised running step `step` (counted from 1)."""
    _note(err, _STEP, step)


def note_said_by(err: BaseException, rank: int) -> None:
    """Records that every rank raises `err` alike from what `rank` found: `rank` says it in
    one line, the others only log it."""
    _note(err, _SAID_BY, rank)


def said_by(err: BaseException) -> int | None:
    """The rank that says `err` for every rank (`note_said_by`), or None."""
    return next((getattr(e, _SAID_BY) for e in _chain(err)
                 if getattr(e, _SAID_BY, None) is not None), None)


def batch_of(err: BaseException) -> str | None:
    """Which batch `err` was raised on, in words counted from 1: 'batch 4' or 'batch 4 of
    epoch 2' (the loader's, as the data feed noted it, nearest the cause), else 'step 4' (a
    run's, as the rank noted it), else read from the traceback: the data feed reading a batch
    (`EpochBatches`) or the executor running a microbatch of a run (forward-only runs)."""
    chain = _chain(err)
    for e in chain:
        batch = getattr(e, _BATCH, None)
        if batch is not None:
            return _batch_words(*batch)
    for e in chain:
        step = getattr(e, _STEP, None)
        if step is not None:
            return f"step {step}"
    for e in reversed(chain):
        batch = _batch_from_frames(e.__traceback__)
        if batch is not None:
            return _batch_words(*batch)
    return None


def _batch_words(epoch: int | None, index: int) -> str:
    return f"batch {index + 1}" + (f" of epoch {epoch + 1}" if epoch else "")


def _batch_from_frames(tb: TracebackType | None) -> tuple[int | None, int] | None:
    here = os.path.dirname(os.path.abspath(__file__))
    microbatch = chunks = None
    while tb is not None:
        frame = tb.tb_frame
        if os.path.abspath(frame.f_code.co_filename).startswith(here + os.sep):
            local = frame.f_locals
            owner = local.get("self")
            if frame.f_code.co_name == "__next__" and type(owner).__name__ == "EpochBatches":
                return getattr(owner, "epoch", None), int(getattr(owner, "_index", 0))
            if isinstance(local.get("chunks"), int) and local["chunks"] > 0:
                chunks = local["chunks"]
            action = local.get("action")
            if type(owner).__name__ == "Executor" and isinstance(
                    getattr(action, "microbatch", None), int):
                microbatch = action.microbatch  # type: ignore[union-attr]
        tb = tb.tb_next
    if microbatch is not None and microbatch >= 0 and chunks:
        return None, microbatch // chunks
    return None


def cause(err: BaseException) -> tuple[BaseException, tuple[str, int] | None]:
    """The exception of the chain that the user's code raised, with where (the innermost
    with a frame in the user's code); else the innermost of the chain, and None."""
    chain = _chain(err)
    for e in reversed(chain):
        where = user_frame(e.__traceback__)
        if where is not None:
            return e, where
    return chain[-1], None


def describe(err: BaseException, rank: int | None = None, where_from: str | None = None,
             peer_symptom: Callable[[BaseException], bool] | None = None) -> str | None:
    """'rank 0, batch 4: ValueError: corrupt sample (at data.py:12)' for an error of the
    user's code, of the library on a batch (a shape that changed: 'rank 0, step 4: ...'),
    or of the data as every rank learnt it (`note_said_by`), but not one that
    `peer_symptom` says follows a peer's failure; None for any other. `where_from` names
    what raised it ('model factory mymodels:build')."""
    root, where = cause(err)
    batch = batch_of(err)
    if where is None and said_by(err) is None and (
            batch is None or peer_symptom is not None and peer_symptom(err)):
        return None  # the library's own error, or a consequence of a peer's failure
    parts = []
    if rank is not None:
        parts.append(f"rank {rank}")
    if where_from:
        parts.append(where_from)
    if batch is not None:
        parts.append(batch)
    # An error of the library's that names the cause and its remedy (a model that cannot be
    # captured) is the line to show, not the bare error it was raised from.
    explained = next((e for e in _chain(err) if getattr(e, "remedy_in_message", False)), root)
    message = str(explained).strip().splitlines()
    text = f"{type(explained).__name__}: {message[0]}" if message else type(explained).__name__
    at = f" (at {os.path.basename(where[0])}:{where[1]})" if where else ""
    if where and batch is None and where_from is None:
        at = f" (at {os.path.basename(where[0])}:{where[1]}, in {entered(root)})"
    return ", ".join(parts) + f": {text}{at}"


def entered(err: BaseException) -> str:
    """The user's function the library called into (a factory, a loss), by name."""
    roots = _library_roots()
    tb, name, library = err.__traceback__, "<module>", False
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not _is_called_code(filename):
            inside = _is_library(filename, roots)
            if library and not inside:
                name = tb.tb_frame.f_code.co_name
            library = inside
        tb = tb.tb_next
    return name


def format_traceback(err: BaseException) -> str:
    return "".join(traceback.format_exception(type(err), err, err.__traceback__))


def log_path(rank: int | None = None, folder: str | os.PathLike[str] | None = None) -> Path:
    """Where the traceback of a failure goes: `folder` (a run directory), else the job's log
    folder (`LOG_DIR_ENV`), else a new file in the temporary folder."""
    name = "error.log" if rank is None else f"rank{rank}.log"
    if folder is None:
        folder = os.environ.get(LOG_DIR_ENV) or None
    if folder is None:
        handle, path = tempfile.mkstemp(prefix="pipedream-fast-", suffix=f"-{name}")
        os.close(handle)
        return Path(path)
    return Path(folder) / name


def write_log(text: str, path: Path) -> Path:
    """Appends `text` to `path` (its folder made if needed); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text if text.endswith("\n") else text + "\n")
    return path
