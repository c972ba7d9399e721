"""A stop in progress, as the launcher sees it: a rank is not killed mid-checkpoint.

A stop (SIGTERM to the job) gives the ranks `grace` seconds before SIGKILL. A rank stopped
by SIGTERM first finishes the steps up to the one every rank agreed to stop at, then saves
its checkpoint; with a large model both take longer than the grace (1 GiB stages on 2
cores: 4 s a step, 18 s to the agreed step, 4.5 s to save). Killed then, the job loses the
very checkpoint the stop was for. So a rank tells its launcher, through files in a folder
the launcher made for the job (`STATUS_DIR_ENV`), that it is stopping (`note_stopping`,
after each step once a stop was asked for) and which file it is writing (`announce`, used
by the checkpoint writer). The launcher (`SaveWatch`) extends the grace while a rank's
stop progresses (a step, a file growing, its fsync) and kills it only once it has stalled
for `STALL_S`; it says how long the stop needed.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

STATUS_DIR_ENV = "PIPEDREAM_FAST_STATUS_DIR"
STALL_S = 10.0
"""A save whose file and status have not changed for this long is taken as stuck (an fsync of
a large file on a slow disk may take seconds without a visible change)."""


@contextmanager
def announce(path: Path, needed: int) -> Iterator[None]:
    """While a rank writes `path` (about `needed` bytes), its launcher knows (no-op without
    one): the file's growth is the save's progress."""
    folder, rank = os.environ.get(STATUS_DIR_ENV), os.environ.get("RANK")
    if not folder or rank is None or not Path(folder).is_dir():
        yield
        return
    status = Path(folder) / f"rank{rank}.saving"
    try:
        status.write_text(json.dumps({"path": str(path), "bytes": needed}))
    except OSError:  # best effort: a stop may kill this save, as without a launcher
        yield
        return
    try:
        yield
    finally:
        status.unlink(missing_ok=True)


def note_stopping(step: int) -> None:
    """A rank asked to stop has finished `step` and goes on to the agreed one (no-op
    without a launcher that watches)."""
    folder, rank = os.environ.get(STATUS_DIR_ENV), os.environ.get("RANK")
    if folder and rank is not None and Path(folder).is_dir():
        try:
            (Path(folder) / f"rank{rank}.stopping").write_text(json.dumps({"step": step}))
        except OSError:
            pass


def touch() -> None:
    """Marks progress without growth (a file written, now being fsynced)."""
    folder, rank = os.environ.get(STATUS_DIR_ENV), os.environ.get("RANK")
    if folder and rank is not None:
        status = Path(folder) / f"rank{rank}.saving"
        if status.exists():
            try:
                os.utime(status)
            except OSError:
                pass


@dataclass
class Saving:
    """What a rank is writing, as last seen."""

    path: str
    needed: int
    written: int
    changed_at: float  # monotonic: when its size or status last changed


class SaveWatch:
    """The launcher's side: a status folder for the job's ranks, and their saves in progress."""

    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="pipedream-fast-status-"))
        self._seen: dict[int, tuple[tuple[str, int, int], float]] = {}  # state, since
        self.extended = False  # a stop outlived its grace because a save progressed

    @property
    def env(self) -> dict[str, str]:
        return {STATUS_DIR_ENV: str(self.folder)}

    def saving(self, rank: int) -> Saving | None:
        """Rank `rank`'s save in progress, with when it last progressed; None if none."""
        status = self.folder / f"rank{rank}.saving"
        try:
            info = json.loads(status.read_text())
            stamp = status.stat().st_mtime_ns
        except (OSError, ValueError):
            self._seen.pop(rank, None)
            return None
        try:
            written = os.path.getsize(info["path"])
        except OSError:
            written = 0
        state = (str(info["path"]), written, stamp)  # changes as the file grows or is synced
        last = self._seen.get(rank)
        if last is None or last[0] != state:
            last = self._seen[rank] = (state, time.monotonic())
        return Saving(state[0], int(info["bytes"]), written, last[1])

    def progressing(self, rank: int) -> bool:
        """Whether rank `rank`'s stop progressed within `STALL_S`: a step, or its save."""
        found = self.saving(rank)
        if found is not None and time.monotonic() - found.changed_at < STALL_S:
            return True
        try:
            stamp = (self.folder / f"rank{rank}.stopping").stat().st_mtime
        except OSError:
            return False
        return time.time() - stamp < STALL_S

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
