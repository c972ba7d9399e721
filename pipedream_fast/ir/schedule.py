"""The schedule container: every rank's program, the stage placement and the bounds an
executor allocates for, as a lazy stream or explicit lists, and its JSON and text forms.

A schedule is data. For every rank it holds an ordered list of `Action`s; nothing else decides
what a rank does next. The executor (runtime) performs the list for real, the simulator in
virtual time, and the validator symbolically, so all three agree on one schedule.

Stages and chunks
-----------------
`stage` is the global index of a model partition. `Schedule.stage_ranks[s]` lists the ranks
that replicate stage s. A rank may appear under several stages (interleaved / zero-bubble
"chunks"): interpreters keep all per-stage state keyed by stage, and when the producer and
consumer of a tensor sit on the same rank no send/receive is emitted (the hand-off is local).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

from pipedream_fast.ir.actions import Action, ScheduleError
from pipedream_fast.ir.placement import Placement

SCHEDULE_FORMAT = "pipedream_fast.schedule/1"

ProgramStream = Callable[[int], Iterable[Action]]


class Schedule(Placement):
    """Per-rank programs plus the layout and the bounds an executor allocates for.

    A schedule is either a *stream* (`stream(rank)` yields rank's actions lazily, as the
    generators in `pipedream_fast.schedules` make them: start-up and memory do not depend on
    `num_microbatches`) or explicit per-rank `actions` (hand-written, parsed from JSON/text).
    `actions` materialises a stream on first use, for the finite windows the validator, the
    simulator and the JSON/text forms work on; the executor only ever walks `program(rank)`.
    `window(n)`, where the generator supplies one, is the same schedule on n microbatches.
    `stages_of` / `rank_of` answer placement questions (`pipedream_fast.ir.placement`).
    """

    def __init__(self, name: str, num_stages: int, num_microbatches: int,
                 stage_ranks: Sequence[Sequence[int]],
                 actions: Sequence[Sequence[Action]] | None,
                 max_versions: Sequence[int], max_inflight: Sequence[int],
                 params: dict[str, Any] | None = None, *,
                 stream: ProgramStream | None = None,
                 window: Callable[[int], Schedule] | None = None,
                 validation_microbatches: int | None = None) -> None:
        if (actions is None) == (stream is None):
            raise ScheduleError(f"schedule {name!r} needs exactly one of actions and stream")
        self.name = name
        self.num_stages = num_stages
        self.num_microbatches = num_microbatches
        super().__init__(stage_ranks)
        self._actions = None if actions is None else tuple(tuple(a) for a in actions)
        self.max_versions: tuple[int, ...] = tuple(max_versions)
        self.max_inflight: tuple[int, ...] = tuple(max_inflight)
        self.params: dict[str, Any] = dict(params or {})
        self._stream = stream
        self._window = window
        # A stream is proven on a window of this many microbatches: its warm-up, several
        # periods of its steady state and its drain (see `validate`).
        self.validation_microbatches = validation_microbatches
        # Microbatches after which a generated stream repeats itself, shifted (None: unknown).
        self.period: int | None = None
        n = len(self.max_versions) if self._actions is None else len(self._actions)
        if self.num_stages < 1 or self.num_microbatches < 1:
            raise ScheduleError(f"schedule {self.name!r} needs >= 1 stage and >= 1 microbatch, "
                                f"got {self.num_stages} and {self.num_microbatches}")
        if len(self.stage_ranks) != self.num_stages:
            raise ScheduleError(f"schedule {self.name!r} has {self.num_stages} stages but "
                                f"stage_ranks lists {len(self.stage_ranks)}")
        used: set[int] = set()
        for s, ranks in enumerate(self.stage_ranks):
            if not ranks or len(set(ranks)) != len(ranks):
                raise ScheduleError(f"stage {s} must list >= 1 distinct ranks, got {list(ranks)}")
            used.update(ranks)
        if used != set(range(n)):
            raise ScheduleError(f"schedule {self.name!r} has programs for {n} ranks but its "
                                f"stages use ranks {sorted(used)}; they must be 0..{n - 1}")
        if len(self.max_versions) != n or len(self.max_inflight) != n:
            raise ScheduleError(f"max_versions and max_inflight need one bound per rank ({n})")

    def program(self, rank: int) -> Iterator[Action]:
        """Rank's actions in order, produced lazily for a stream."""
        if self._actions is not None:
            return iter(self._actions[rank])
        assert self._stream is not None
        return iter(self._stream(rank))

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]:
        """Every rank's whole action list (materialised once; O(num_microbatches))."""
        if self._actions is None:
            self._actions = tuple(tuple(self.program(r)) for r in range(self.num_ranks))
        return self._actions

    def _key(self) -> tuple:
        return (self.name, self.num_stages, self.num_microbatches, self.stage_ranks,
                self.actions, self.max_versions, self.max_inflight, self.params)

    def __eq__(self, other: object) -> bool:
        """Same layout, bounds, parameters and actions (a stream is materialised to compare)."""
        return isinstance(other, Schedule) and self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclass it replaced

    def __repr__(self) -> str:
        kind = "stream" if self.is_stream else "actions"
        return (f"Schedule({self.name!r}, stages={self.num_stages}, "
                f"microbatches={self.num_microbatches}, ranks={self.num_ranks}, {kind})")

    @property
    def is_stream(self) -> bool:
        return self._stream is not None

    def attach_window(self, window: Callable[[int], Schedule], microbatches: int,
                      period: int | None = None) -> None:
        """How to make this schedule on fewer microbatches, how many prove it, and after
        how many its steady state repeats."""
        self._window = window
        self.validation_microbatches = microbatches
        self.period = period

    def window(self, num_microbatches: int) -> Schedule:
        """The same schedule on `num_microbatches` microbatches (itself if it cannot shrink)."""
        if self._window is None or num_microbatches >= self.num_microbatches:
            return self
        return self._window(num_microbatches)

    @property
    def num_ranks(self) -> int:
        """The ranks with a program (the constructor checks that the stages use them all)."""
        return len(self.max_versions)

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(len(r) for r in self.stage_ranks)

    # --- JSON -----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"format": SCHEDULE_FORMAT, "name": self.name, "num_stages": self.num_stages,
                "num_microbatches": self.num_microbatches,
                "stage_ranks": [list(r) for r in self.stage_ranks],
                "max_versions": list(self.max_versions), "max_inflight": list(self.max_inflight),
                "params": self.params,
                "actions": [[a.to_text() for a in acts] for acts in self.actions]}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Schedule:
        if not isinstance(data, Mapping) or data.get("format") != SCHEDULE_FORMAT:
            tag = data.get("format") if isinstance(data, Mapping) else type(data).__name__
            raise ScheduleError(f"schedule JSON has format {tag!r}, expected {SCHEDULE_FORMAT!r}")
        try:
            return cls(name=str(data["name"]), num_stages=int(data["num_stages"]),
                       num_microbatches=int(data["num_microbatches"]),
                       stage_ranks=[tuple(int(r) for r in rs) for rs in data["stage_ranks"]],
                       actions=[[Action.parse(t) for t in acts] for acts in data["actions"]],
                       max_versions=[int(v) for v in data["max_versions"]],
                       max_inflight=[int(v) for v in data["max_inflight"]],
                       params=dict(data.get("params", {})))
        except (KeyError, TypeError) as err:
            raise ScheduleError(f"schedule JSON is missing or mistypes a field: {err!r}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        return cls.from_dict(json.loads(text))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json() + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Schedule:
        return cls.from_json(Path(path).read_text())

    # --- compact text -----------------------------------------------------------------------
    def to_text(self) -> str:
        """Header lines `key value`, then `rank R: TOKEN TOKEN ...`; see `from_text`."""
        lines = [f"schedule {self.name}", f"stages {self.num_stages}",
                 f"microbatches {self.num_microbatches}",
                 "stage_ranks " + " | ".join(",".join(map(str, r)) for r in self.stage_ranks),
                 "max_versions " + " ".join(map(str, self.max_versions)),
                 "max_inflight " + " ".join(map(str, self.max_inflight)),
                 "params " + json.dumps(self.params, sort_keys=True)]
        lines += [f"rank {r}: " + " ".join(a.to_text() for a in acts)
                  for r, acts in enumerate(self.actions)]
        return "\n".join(lines) + "\n"

    @classmethod
    def from_text(cls, text: str) -> Schedule:
        header: dict[str, str] = {}
        ranks: dict[int, list[Action]] = {}
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            key, _, rest = line.partition(" ")
            if key == "rank":
                head, colon, body = rest.partition(":")
                if not colon or not head.strip().isdigit():
                    raise ScheduleError(f"schedule text line {lineno}: expected 'rank N: TOKENS'")
                ranks[int(head)] = [Action.parse(t) for t in body.split()]
            else:
                header[key] = rest.strip()
        missing = {"schedule", "stages", "microbatches", "stage_ranks", "max_versions",
                   "max_inflight"} - header.keys()
        if missing:
            raise ScheduleError(f"schedule text lacks the header lines {sorted(missing)}")
        if sorted(ranks) != list(range(len(ranks))):
            raise ScheduleError(f"schedule text has rank lines {sorted(ranks)}; need 0..N-1")
        return cls(name=header["schedule"], num_stages=int(header["stages"]),
                   num_microbatches=int(header["microbatches"]),
                   stage_ranks=[tuple(int(r) for r in part.split(","))
                                for part in header["stage_ranks"].split("|")],
                   actions=[ranks[r] for r in range(len(ranks))],
                   max_versions=[int(v) for v in header["max_versions"].split()],
                   max_inflight=[int(v) for v in header["max_inflight"].split()],
                   params=json.loads(header.get("params", "{}")))
