"""The schedule IR: per-rank action lists that the executor and the simulator both walk.

A schedule is data. For every rank it holds an ordered list of `Action`s; nothing else decides
what a rank does next. The executor (runtime) performs the list for real, the simulator in
virtual time, and the validator symbolically, so all three agree on one schedule.

Stages and chunks
-----------------
`stage` is the global index of a model partition. `Schedule.stage_ranks[s]` lists the ranks
that replicate stage s. A rank may appear under several stages (interleaved / zero-bubble
"chunks"): interpreters keep all per-stage state keyed by stage, and when the producer and
consumer of a tensor sit on the same rank no send/receive is emitted (the hand-off is local).

Weight versions (the contract an executor with a ring of versions follows blindly)
------------------------------------------------------------------------------------
Each (stage, copy) on a rank owns a sequence of weight versions. Version 0 is the initial
weights; version v is the weights after v updates (OPTIMIZER_STEP or AVERAGE) of that copy.
`copy` is 0 except for localsgd, where a rank holds one independent copy of its stage per
model replica. At any moment the *newest* version exists; older versions exist only while
*retained*.

- FORWARD(stage, mb, version=v): run the stage on mb's input (stage 0: microbatch mb of the
  data loader) with version v, which must be the newest or a retained version. The
  activations stay stashed (in flight) until BACKWARD.
- BACKWARD(stage, mb, version=v): must name the same v as its FORWARD (weight stashing). The
  last stage starts from the loss of mb (targets from the same loader). Its weight gradient
  is *added* to the gradient buffer of (stage, copy).
- BACKWARD_INPUT then BACKWARD_WEIGHT(stage, mb, version=v): the same backward in two parts
  (zero-bubble schedules). The input part needs the output gradient and makes the input
  gradient (what SEND_GRAD sends); the weight part, after it, adds the weight gradient and
  ends the microbatch on the stage. A microbatch's backward is either one B or an I and a W.
- SNAPSHOT(version=v): v, the newest version, must survive the next update. (A ring buffer
  does this by writing the next version into a fresh slot; copying v aside also works.)
- RELEASE(version=v): a retained v is no longer needed; its slot may be reused.
- ALLREDUCE(version=v): sum the gradient buffers of all ranks of `stage_ranks[stage]`; a
  collective, matched by the ALLREDUCE with the same (stage, copy, version) on each of them.
  `version` names the version the following OPTIMIZER_STEP will create.
- OPTIMIZER_STEP(version=v, microbatches=(...)): apply (gradient buffer / len(microbatches))
  to the newest weights, producing version v = newest + 1; clear the buffer. `microbatches`
  lists every microbatch whose gradient is in the buffer, summed over replicas after an
  ALLREDUCE; dividing by its length averages the gradients (gpipe, 1f1b, 2bw, data-parallel).
- AVERAGE(version=v): localsgd model averaging; every copy of the stage on this rank becomes
  the mean of all copies' newest weights, as version v = 1 + the largest newest version.

Live versions of a rank = the distinct versions, over its (stage, copy) pairs, that are newest
or retained. In-flight microbatches of a rank = forwards whose backward has not run yet.

Communication and the blocking rule the validator models
---------------------------------------------------------
SEND_ACT(stage s, mb, peer) sends stage s's output of mb to `peer`, where RECV_ACT(stage s+1,
mb, peer=sender) receives it; SEND_GRAD(stage s, mb, peer) sends the gradient of stage s's
input to `peer`, where RECV_GRAD(stage s-1, mb, peer=sender) receives it. A forward of stage
s > 0 needs its input received (or produced on the same rank by stage s-1); a backward of a
non-last stage needs its output gradient likewise.

The validator executes the lists symbolically under these rules; an executor that walks its
list literally and blocks no more than this cannot deadlock on a schedule that passes:

1. RECV posts a receive buffer and never blocks; the rank moves on at once.
2. A link (sender, receiver, what, receiving stage) holds at most one message in transit.
   SEND delivers the tensor if the peer has *reached* (posted) the matching RECV; otherwise
   it leaves it in transit and the rank moves on if the link holds no other message, or it
   blocks until the link's earlier message has been delivered. A message in transit is
   delivered when the peer posts its RECV. (Both transports queue several messages per link
   before a sender blocks, so they never block more than this.)
3. FORWARD/BACKWARD block until the tensor of their earlier RECV has been delivered (a
   compute whose input was never received on this rank is an error, not a wait).
4. ALLREDUCE blocks until every rank of `stage_ranks[stage]` has reached its matching one.

A deadlock is a state where unfinished ranks all block. A schedule that passes also runs
under any more buffered engine (queued asynchronous sends, as the C++ engine has), and that
engine is what the simulator times: sends never stall the sender, a compute waits for the
arrival of its inputs, an all-reduce for all its ranks.

Text form (one token per action; `Schedule.to_text` adds a header and one line per rank)
----------------------------------------------------------------------------------------
    token := STAGE CODE [MB] [DIR PEER] ['@' VERSION] ['c' COPY] [':' MBLIST]
    CODE  := F | B | I | W | sF | rF | sB | rB | AR | U | S | X | AV
    DIR   := '>' (sends) | '<' (receives);  MBLIST := ITEM (',' ITEM)*, ITEM := N | N '-' N

    0F3@1      stage 0 forward of microbatch 3 on weight version 1
    0B3@1      stage 0 backward of microbatch 3 on version 1
    0I3@1 0W3@1  the same backward split: input gradient, then weight gradient
    0sF3>1     stage 0 sends mb 3's activation to rank 1;  1rF3<0  stage 1 receives it from rank 0
    1sB3>0     stage 1 sends mb 3's input gradient to rank 0;  0rB3<1  stage 0 receives it
    0AR@2      all-reduce stage 0's gradients among its replicas (for version 2)
    0U@2:4-7   optimizer step of stage 0 creating version 2 from microbatches 4..7
    0S@1 0X@1  snapshot (retain) / release version 1 of stage 0;  0AV@5  average copies
    0F3@1c2    the same forward on weight copy 2 (localsgd only; copy 0 is not written)
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

SCHEDULE_FORMAT = "pipedream_fast.schedule/1"


class ScheduleError(ValueError):
    """An invalid schedule; `rank`, `index` and `action` locate the offending action if any."""

    def __init__(self, message: str, rank: int | None = None, index: int | None = None,
                 action: Action | None = None) -> None:
        where = ""
        if rank is not None:
            where = f"rank {rank}"
            if index is not None:
                where += f", action {index}"
            if action is not None:
                where += f" ({action.to_text()})"
            where += ": "
        super().__init__(where + message)
        self.rank = rank
        self.index = index
        self.action = action


@dataclass(frozen=True)
class KindSpec:
    """What one action kind is, declared once; interpreters add one handler per kind.

    code: the text form's code; microbatch / version: whether the action names them (a peer
    is named exactly by communication); compute: forward/backward work that needs an input
    tensor; tensor: for communication, "act" or "grad"; sends: its direction; timing: how the
    simulator times it ("compute", "update" and "bookkeeping" run on the rank, "post" and
    "send" take no rank time, "collective" waits for its group).
    """

    code: str
    microbatch: bool
    version: bool
    trace: str  # the name of its slices in Chrome/Perfetto traces
    compute: bool = False
    tensor: str | None = None
    sends: bool = False
    timing: str = "bookkeeping"
    # Compute kinds: what part of a microbatch's work on a stage they do.
    needs_output_grad: bool = False  # a backward part that starts from the output gradient
    makes_input_grad: bool = False   # ... and produces the input gradient (sent upstream)
    ends_microbatch: bool = False    # adds the weight gradient and frees the stash


class ActionKind(str, Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"
    ALLREDUCE = "allreduce"
    OPTIMIZER_STEP = "optimizer_step"
    SNAPSHOT = "snapshot"
    RELEASE = "release"
    AVERAGE = "average"

    @property
    def spec(self) -> KindSpec:
        return KIND_SPECS[self]

    @property
    def is_compute(self) -> bool:
        return KIND_SPECS[self].compute

    @property
    def is_p2p(self) -> bool:
        return KIND_SPECS[self].tensor is not None


K = ActionKind
KIND_SPECS: dict[ActionKind, KindSpec] = {
    K.FORWARD: KindSpec("F", True, True, "F", compute=True, timing="compute"),
    K.BACKWARD: KindSpec("B", True, True, "B", compute=True, timing="compute",
                         needs_output_grad=True, makes_input_grad=True, ends_microbatch=True),
    # Zero-bubble schedules split a backward: I computes the input gradient (so the stage
    # before can go on), W the weight gradient, later, where the pipeline would idle.
    K.BACKWARD_INPUT: KindSpec("I", True, True, "I", compute=True, timing="compute",
                               needs_output_grad=True, makes_input_grad=True),
    K.BACKWARD_WEIGHT: KindSpec("W", True, True, "W", compute=True, timing="compute",
                                ends_microbatch=True),
    K.SEND_ACT: KindSpec("sF", True, False, "send act", tensor="act", sends=True,
                         timing="send"),
    K.RECV_ACT: KindSpec("rF", True, False, "recv act", tensor="act", timing="post"),
    K.SEND_GRAD: KindSpec("sB", True, False, "send grad", tensor="grad", sends=True,
                          timing="send"),
    K.RECV_GRAD: KindSpec("rB", True, False, "recv grad", tensor="grad", timing="post"),
    K.ALLREDUCE: KindSpec("AR", False, True, "allreduce", timing="collective"),
    K.OPTIMIZER_STEP: KindSpec("U", False, True, "step", timing="update"),
    K.SNAPSHOT: KindSpec("S", False, True, "snapshot"),
    K.RELEASE: KindSpec("X", False, True, "release"),
    K.AVERAGE: KindSpec("AV", False, True, "average", timing="update"),
}
_KINDS = {spec.code: kind for kind, spec in KIND_SPECS.items()}
_TOKEN = re.compile(r"(?P<stage>\d+)(?P<code>sF|rF|sB|rB|AR|AV|F|B|I|W|U|S|X)(?P<mb>\d+)?"
                    r"(?:(?P<dir>[<>])(?P<peer>\d+))?(?:@(?P<version>\d+))?(?:c(?P<copy>\d+))?"
                    r"(?::(?P<mbs>\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*))?")


def format_mb_list(mbs: Iterable[int]) -> str:
    """`0,1,2,3,7` -> `0-3,7`."""
    items = sorted(mbs)
    parts: list[str] = []
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        parts.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(parts)


def parse_mb_list(text: str) -> tuple[int, ...]:
    out: list[int] = []
    for item in text.split(","):
        lo, _, hi = item.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return tuple(out)


@dataclass(frozen=True)
class Action:
    """One step of a rank's program; see the module docstring for each kind's meaning."""

    kind: ActionKind
    stage: int
    microbatch: int | None = None
    peer: int | None = None
    version: int | None = None
    copy: int = 0
    microbatches: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        kind = self.kind
        if not isinstance(kind, ActionKind):
            raise ScheduleError(f"action kind must be an ActionKind, got {kind!r}")
        what = f"{kind.value} action"
        if self.stage < 0 or self.copy < 0:
            raise ScheduleError(f"{what}: stage and copy must be >= 0, got {self.stage}, "
                                f"{self.copy}")
        spec = KIND_SPECS[kind]
        if (self.microbatch is not None) != spec.microbatch:
            raise ScheduleError(f"{what} must {'' if spec.microbatch else 'not '}name a "
                                f"microbatch")
        if self.microbatch is not None and self.microbatch < 0:
            raise ScheduleError(f"{what}: microbatch must be >= 0, got {self.microbatch}")
        if (self.peer is not None) != kind.is_p2p:
            raise ScheduleError(f"{what} must {'' if kind.is_p2p else 'not '}name a peer rank")
        if (self.version is not None) != spec.version:
            raise ScheduleError(f"{what} must {'' if spec.version else 'not '}"
                                f"name a weight version")
        if self.version is not None and self.version < 0:
            raise ScheduleError(f"{what}: version must be >= 0, got {self.version}")
        if kind is K.OPTIMIZER_STEP:
            mbs = self.microbatches
            if not mbs or list(mbs) != sorted(set(mbs)) or mbs[0] < 0:
                raise ScheduleError(f"{what} needs a non-empty, sorted list of distinct "
                                    f"microbatches, got {list(mbs)}")
        elif self.microbatches:
            raise ScheduleError(f"only optimizer steps list microbatches, not a {what}")
        if kind.is_p2p and self.copy:
            raise ScheduleError(f"{what}: communication carries no weight copy")

    # Narrowing accessors: the fields an action's kind guarantees (see KindSpec), as ints.
    @property
    def mb(self) -> int:
        """The microbatch of a forward, backward or transfer."""
        if self.microbatch is None:
            raise ScheduleError(f"a {self.kind.value} action names no microbatch")
        return self.microbatch

    @property
    def ver(self) -> int:
        """The weight version of a compute, update, snapshot, release or all-reduce."""
        if self.version is None:
            raise ScheduleError(f"a {self.kind.value} action names no weight version")
        return self.version

    @property
    def peer_rank(self) -> int:
        """The other rank of a transfer."""
        if self.peer is None:
            raise ScheduleError(f"a {self.kind.value} action names no peer rank")
        return self.peer

    def to_text(self) -> str:
        out = f"{self.stage}{KIND_SPECS[self.kind].code}"
        if self.microbatch is not None:
            out += str(self.microbatch)
        if self.peer is not None:
            out += (">" if KIND_SPECS[self.kind].sends else "<") + str(self.peer)
        if self.version is not None:
            out += f"@{self.version}"
        if self.copy:
            out += f"c{self.copy}"
        if self.microbatches:
            out += ":" + format_mb_list(self.microbatches)
        return out

    __str__ = to_text

    @classmethod
    def parse(cls, token: str) -> Action:
        """Inverse of `to_text`; raises ScheduleError naming the token and the expected shape."""
        m = _TOKEN.fullmatch(token.strip())
        if m is None:
            raise ScheduleError(f"cannot read action {token!r}: expected e.g. '0F3@1', '0sF3>1', "
                                f"'1rB3<2', '0U@2:4-7' (see pipedream_fast.ir for the grammar)")
        kind = _KINDS[m["code"]]
        if m["dir"] is not None:
            want = ">" if KIND_SPECS[kind].sends else "<"
            if not kind.is_p2p or m["dir"] != want:
                raise ScheduleError(f"action {token!r}: {kind.value} takes "
                                    f"{repr(want) + ' PEER' if kind.is_p2p else 'no peer'}")

        def num(name: str) -> int | None:
            return None if m[name] is None else int(m[name])

        try:
            return cls(kind, int(m["stage"]), num("mb"), num("peer"), num("version"),
                       num("copy") or 0, parse_mb_list(m["mbs"]) if m["mbs"] else ())
        except ScheduleError as err:
            raise ScheduleError(f"action {token!r}: {err}") from None


# Short constructors used by the schedule generators and tests.
def forward(stage: int, mb: int, version: int, copy: int = 0) -> Action:
    return Action(K.FORWARD, stage, mb, version=version, copy=copy)


def backward(stage: int, mb: int, version: int, copy: int = 0) -> Action:
    return Action(K.BACKWARD, stage, mb, version=version, copy=copy)


def optimizer_step(stage: int, version: int, microbatches: Iterable[int], copy: int = 0) -> Action:
    return Action(K.OPTIMIZER_STEP, stage, version=version, copy=copy,
                  microbatches=tuple(sorted(set(microbatches))))


def allreduce(stage: int, version: int, copy: int = 0) -> Action:
    return Action(K.ALLREDUCE, stage, version=version, copy=copy)


ProgramStream = Callable[[int], Iterable[Action]]


class Schedule:
    """Per-rank programs plus the layout and the bounds an executor allocates for.

    A schedule is either a *stream* (`stream(rank)` yields rank's actions lazily, as the
    generators in `pipedream_fast.schedules` make them: start-up and memory do not depend on
    `num_microbatches`) or explicit per-rank `actions` (hand-written, parsed from JSON/text).
    `actions` materialises a stream on first use, for the finite windows the validator, the
    simulator and the JSON/text forms work on; the executor only ever walks `program(rank)`.
    `window(n)`, where the generator supplies one, is the same schedule on n microbatches.
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
        self.stage_ranks: tuple[tuple[int, ...], ...] = tuple(tuple(r) for r in stage_ranks)
        self._actions = None if actions is None else tuple(tuple(a) for a in actions)
        self.max_versions: tuple[int, ...] = tuple(max_versions)
        self.max_inflight: tuple[int, ...] = tuple(max_inflight)
        self.params: dict[str, Any] = dict(params or {})
        self._stream = stream
        self._window = window
        # A stream is proven on a window of this many microbatches: its warm-up, several
        # periods of its steady state and its drain (see `validate`).
        self.validation_microbatches = validation_microbatches
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

    def attach_window(self, window: Callable[[int], Schedule], microbatches: int) -> None:
        """How to make this schedule on fewer microbatches, and how many prove it."""
        self._window = window
        self.validation_microbatches = microbatches

    def window(self, num_microbatches: int) -> Schedule:
        """The same schedule on `num_microbatches` microbatches (itself if it cannot shrink)."""
        if self._window is None or num_microbatches >= self.num_microbatches:
            return self
        return self._window(num_microbatches)

    @property
    def num_ranks(self) -> int:
        return len(self.max_versions)

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

    def rank_of(self, stage: int, mb: int) -> int:
        """The rank that runs microbatch mb on stage (replicas take them round-robin)."""
        ranks = self.stage_ranks[stage]
        return ranks[mb % len(ranks)]

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


# --- validation -----------------------------------------------------------------------------

@dataclass(frozen=True)
class ValidationReport:
    """What the symbolic run measured, per rank; the declared bounds were not exceeded."""

    peak_versions: tuple[int, ...]
    peak_inflight: tuple[int, ...]


@dataclass
class _Weights:
    """Versions and gradient buffer of one (stage, copy) on one rank."""

    newest: int = 0
    retained: set[int] = field(default_factory=set)
    pending: set[int] = field(default_factory=set)  # microbatches backwarded since the last step
    reduced: int | None = None  # version of a completed ALLREDUCE awaiting its step


@dataclass
class _RankState:
    rank: int
    actions: tuple[Action, ...]
    weights: dict[tuple[int, int], _Weights]
    pc: int = 0
    in_flight: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    forwarded: set[tuple[int, int]] = field(default_factory=set)
    backwarded: set[tuple[int, int]] = field(default_factory=set)
    posted: dict[tuple[str, int, int], int] = field(default_factory=dict)  # recv key -> index
    have: set[tuple[str, int, int]] = field(default_factory=set)  # ("act"|"grad", stage, mb)
    peak_versions: int = 0
    peak_inflight: int = 0

    @property
    def done(self) -> bool:
        return self.pc >= len(self.actions)

    def live_versions(self) -> int:
        return sum(len(w.retained | {w.newest}) for w in self.weights.values())


def _p2p_key(kind: ActionKind, stage: int, mb: int, rank: int, peer: int) -> tuple:
    """Key shared by a send and its receive: (what, receiving stage, mb, sender, receiver)."""
    if kind is K.SEND_ACT:
        return ("act", stage + 1, mb, rank, peer)
    if kind is K.RECV_ACT:
        return ("act", stage, mb, peer, rank)
    if kind is K.SEND_GRAD:
        return ("grad", stage - 1, mb, rank, peer)
    return ("grad", stage, mb, peer, rank)


class _Validator:
    def __init__(self, schedule: Schedule) -> None:
        self.s = schedule
        self.partner: dict[tuple[int, int], tuple[int, int]] = {}
        self.forward_rank: dict[tuple[int, int], int] = {}
        self.backward_rank: dict[tuple[int, int], int] = {}
        self.ranks: list[_RankState] = []
        # link (what, receiving stage, sender, receiver) -> the send whose message is in transit
        self.in_transit: dict[tuple[str, int, int, int], tuple[int, int]] = {}

    def fail(self, st: _RankState | int, index: int, message: str) -> ScheduleError:
        rank = st if isinstance(st, int) else st.rank
        return ScheduleError(message, rank, index, self.s.actions[rank][index])

    # -- static checks: placement, peers, send/receive matching ----------------------------
    def check_static(self) -> None:
        s, last = self.s, self.s.num_stages - 1
        endpoints: dict[tuple, tuple[int, int]] = {}
        for rank, acts in enumerate(s.actions):
            for i, a in enumerate(acts):
                if a.stage > last or rank not in s.stage_ranks[a.stage]:
                    raise self.fail(rank, i, f"stage {a.stage} does not run on rank {rank} "
                                             f"(stage_ranks: {[list(r) for r in s.stage_ranks]})")
                if a.microbatch is not None and a.microbatch >= s.num_microbatches:
                    raise self.fail(rank, i, f"microbatch {a.microbatch} is out of range; the "
                                             f"schedule has {s.num_microbatches}")
                if a.microbatches and a.microbatches[-1] >= s.num_microbatches:
                    raise self.fail(rank, i, f"step lists microbatch {a.microbatches[-1]}, out of "
                                             f"range for {s.num_microbatches} microbatches")
                if not a.kind.is_p2p:
                    continue
                other = a.stage + (1 if a.kind in (K.SEND_ACT, K.RECV_GRAD) else -1)
                if not 0 <= other <= last or a.peer not in s.stage_ranks[other] or a.peer == rank:
                    raise self.fail(rank, i, f"peer rank {a.peer} must be another rank of "
                                             f"neighbouring stage {other}")
                key = _p2p_key(a.kind, a.stage, a.mb, rank, a.peer_rank)
                side = (key, a.kind in (K.SEND_ACT, K.SEND_GRAD))
                if side in endpoints:
                    raise self.fail(rank, i, f"duplicates action {endpoints[side][1]} of rank "
                                             f"{endpoints[side][0]}")
                endpoints[side] = (rank, i)
        for (key, is_send), (rank, i) in endpoints.items():
            match = endpoints.get((key, not is_send))
            if match is None:
                a = s.actions[rank][i]
                want = (Action(K.RECV_ACT if a.kind is K.SEND_ACT else K.RECV_GRAD, key[1],
                               a.microbatch, peer=rank) if is_send else
                        Action(K.SEND_ACT if a.kind is K.RECV_ACT else K.SEND_GRAD,
                               key[1] + (-1 if a.kind is K.RECV_ACT else 1), a.microbatch,
                               peer=rank))
                raise self.fail(rank, i, f"unmatched {a.kind.value}: rank {a.peer} has no "
                                         f"{want.to_text()}")
            self.partner[(rank, i)] = match
        self.check_link_order(endpoints)

    def check_link_order(self, endpoints: dict[tuple, tuple[int, int]]) -> None:
        """Transports keep one FIFO link per (sender, receiver, what, receiving stage): the
        sender's order of microbatches on a link must be the receiver's order of receives."""
        order: dict[tuple, list[tuple[int, int, int]]] = defaultdict(list)
        for ((what, stage, mb, src, dst), is_send), (rank, i) in endpoints.items():
            order[(what, stage, src, dst, is_send)].append((i, mb, rank))
        for (what, stage, src, dst, is_send), sends in order.items():
            if not is_send:
                continue
            recvs = sorted(order[(what, stage, src, dst, False)])
            for (i, mb, _), (j, want, _) in zip(sorted(sends), recvs):
                if mb != want:
                    raise self.fail(src, i, f"sends the {what} of microbatch {mb} to stage "
                                            f"{stage} on rank {dst}, which receives microbatch "
                                            f"{want} there next (action {j}); each link carries "
                                            f"its microbatches in one order on both ends")

    # -- symbolic execution ---------------------------------------------------------------
    def run(self) -> ValidationReport:
        self.check_static()
        s = self.s
        for rank, acts in enumerate(s.actions):
            pairs = {(a.stage, a.copy) for a in acts if not a.kind.is_p2p}
            st = _RankState(rank, acts, {p: _Weights() for p in sorted(pairs)})
            self.check_versions(st, 0 if acts else -1)
            self.ranks.append(st)
        while not all(st.done for st in self.ranks):
            if not any([self.advance(st) for st in self.ranks]):
                raise self.deadlock()
        self.check_end()
        return ValidationReport(tuple(st.peak_versions for st in self.ranks),
                                tuple(st.peak_inflight for st in self.ranks))

    def advance(self, st: _RankState) -> bool:
        moved = False
        while not st.done:
            a = st.actions[st.pc]
            if a.kind in (K.RECV_ACT, K.RECV_GRAD):
                what = "act" if a.kind is K.RECV_ACT else "grad"
                st.posted[(what, a.stage, a.mb)] = st.pc
                link = (what, a.stage, a.peer_rank, st.rank)
                if self.in_transit.get(link) == self.partner[(st.rank, st.pc)]:
                    del self.in_transit[link]  # its sender moved on already: delivered now
                    st.have.add((what, a.stage, a.mb))
            elif a.kind in (K.SEND_ACT, K.SEND_GRAD):
                if not self.send(st, a):
                    return moved
            elif a.kind is K.ALLREDUCE:
                if not self.allreduce(st, a):
                    return moved
                moved = True
                continue  # allreduce() moved every rank of the group past it
            elif a.kind.is_compute and self.input_pending(st, a) is not None:
                return moved
            else:
                self.execute(st, st.pc, a)
            st.pc += 1
            moved = True
        return moved

    @staticmethod
    def input_pending(st: _RankState, a: Action) -> tuple[str, int, int] | None:
        """The key of a posted receive this compute needs whose tensor has not arrived yet."""
        key = ("act" if a.kind is K.FORWARD else "grad", a.stage, a.microbatch)
        return key if key in st.posted and key not in st.have else None

    def send(self, st: _RankState, a: Action) -> bool:
        """Deliver if the peer has posted the matching receive, else leave the message in
        transit on a free link; False while blocked (see rule 2)."""
        i = st.pc
        if a.kind is K.SEND_ACT and (a.stage, a.microbatch) not in st.forwarded:
            raise self.fail(st, i, "sends an activation before the forward that makes it")
        if a.kind is K.SEND_GRAD and (a.stage, a.microbatch) not in st.backwarded:
            raise self.fail(st, i, "sends a gradient before the backward that makes it")
        prank, pi = self.partner[(st.rank, i)]
        recv = self.s.actions[prank][pi]
        what = "act" if recv.kind is K.RECV_ACT else "grad"
        if self.ranks[prank].pc <= pi:
            link = (what, recv.stage, st.rank, prank)
            if link in self.in_transit:
                return False
            self.in_transit[link] = (st.rank, i)
            return True
        self.ranks[prank].have.add((what, recv.stage, recv.mb))
        return True

    def allreduce(self, st: _RankState, a: Action) -> bool:
        group = [self.ranks[r] for r in self.s.stage_ranks[a.stage]]
        waiting = [g for g in group if not g.done and g.actions[g.pc].kind is K.ALLREDUCE
                   and g.actions[g.pc].stage == a.stage and g.actions[g.pc].copy == a.copy]
        if len(waiting) < len(group):
            return False
        for g in group:
            other = g.actions[g.pc]
            if other.version != a.version:
                raise self.fail(g, g.pc, f"all-reduce for version {other.version} meets rank "
                                         f"{st.rank}'s all-reduce for version {a.version}")
            w = g.weights[(a.stage, a.copy)]
            if a.version != w.newest + 1:
                raise self.fail(g, g.pc, f"all-reduce for version {a.version}, but the step after "
                                         f"it must create version {w.newest + 1}")
            w.reduced = a.version
            g.pc += 1
        return True

    def check_versions(self, st: _RankState, index: int) -> None:
        live = st.live_versions()
        st.peak_versions = max(st.peak_versions, live)
        bound = self.s.max_versions[st.rank]
        if live > bound:
            raise self.fail(st, index, f"{live} weight versions live, more than the declared "
                                       f"max_versions {bound}")

    def require_live(self, st: _RankState, i: int, w: _Weights, version: int) -> None:
        if version == w.newest or version in w.retained:
            return
        if version > w.newest:
            raise self.fail(st, i, f"uses weight version {version}, which does not exist yet "
                                   f"(newest is {w.newest})")
        raise self.fail(st, i, f"uses weight version {version}, which is gone: the newest is "
                               f"{w.newest} and {version} is not retained (missing SNAPSHOT, or "
                               f"already RELEASEd)")

    def execute(self, st: _RankState, i: int, a: Action) -> None:
        """Applies the rules of a's kind (one method per kind that changes rank state)."""
        rules: dict[ActionKind, Callable[[_RankState, int, Action], None]] = {
            K.FORWARD: self.exec_forward, K.BACKWARD: self.exec_backward,
            K.BACKWARD_INPUT: self.exec_backward_input, K.BACKWARD_WEIGHT: self.exec_backward_weight,
            K.OPTIMIZER_STEP: self.exec_step, K.SNAPSHOT: self.exec_snapshot,
            K.RELEASE: self.exec_release, K.AVERAGE: self.exec_average}
        rules[a.kind](st, i, a)

    def exec_forward(self, st: _RankState, i: int, a: Action) -> None:
        key = (a.stage, a.mb)
        if key in self.forward_rank:
            raise self.fail(st, i, f"microbatch {a.mb} was already forwarded on stage "
                                   f"{a.stage} by rank {self.forward_rank[key]}")
        local = (a.stage - 1, a.mb) in st.forwarded
        if a.stage > 0 and ("act", *key) not in st.have and not local:
            raise self.fail(st, i, "forward before its input arrived: no earlier "
                                   f"RECV_ACT of microbatch {a.mb} on this rank")
        self.require_live(st, i, st.weights[(a.stage, a.copy)], a.ver)
        self.forward_rank[key] = st.rank
        st.forwarded.add(key)
        st.in_flight[key] = (a.ver, a.copy)
        st.peak_inflight = max(st.peak_inflight, len(st.in_flight))
        if len(st.in_flight) > self.s.max_inflight[st.rank]:
            raise self.fail(st, i, f"{len(st.in_flight)} microbatches in flight, more than "
                                   f"the declared max_inflight {self.s.max_inflight[st.rank]}")

    def exec_backward(self, st: _RankState, i: int, a: Action) -> None:
        self.exec_backward_input(st, i, a)
        self.exec_backward_weight(st, i, a)

    def check_in_flight(self, st: _RankState, i: int, a: Action) -> None:
        """A backward part needs its forward on this rank, on the same version and copy."""
        key = (a.stage, a.mb)
        if key not in st.in_flight:
            where = self.forward_rank.get(key)
            raise self.fail(st, i, "backward before its forward" if where is None else
                            "backward repeated" if key in self.backward_rank else
                            f"backward on a rank other than its forward's (rank {where})")
        version, copy = st.in_flight[key]
        if (a.ver, a.copy) != (version, copy):
            raise self.fail(st, i, f"backward uses weight version {a.ver} (copy {a.copy}) "
                                   f"but its forward used version {version} (copy {copy})")
        self.require_live(st, i, st.weights[(a.stage, a.copy)], a.ver)

    def exec_backward_input(self, st: _RankState, i: int, a: Action) -> None:
        key = (a.stage, a.mb)
        self.check_in_flight(st, i, a)
        if key in st.backwarded:
            raise self.fail(st, i, "the input gradient of this microbatch was already made")
        local = (a.stage + 1, a.mb) in st.backwarded
        if a.stage < self.s.num_stages - 1 and ("grad", *key) not in st.have and not local:
            raise self.fail(st, i, "backward before its output gradient arrived: no earlier "
                                   f"RECV_GRAD of microbatch {a.mb} on this rank")
        st.backwarded.add(key)  # its input gradient exists: SEND_GRAD may follow

    def exec_backward_weight(self, st: _RankState, i: int, a: Action) -> None:
        key = (a.stage, a.mb)
        self.check_in_flight(st, i, a)
        if key not in st.backwarded:
            raise self.fail(st, i, "weight gradient before the input gradient (I before W)")
        del st.in_flight[key]
        self.backward_rank[key] = st.rank
        st.weights[(a.stage, a.copy)].pending.add(a.mb)

    def exec_step(self, st: _RankState, i: int, a: Action) -> None:
        w = st.weights[(a.stage, a.copy)]
        if a.ver != w.newest + 1:
            raise self.fail(st, i, f"step must create version {w.newest + 1}, not {a.ver}")
        missing = w.pending - set(a.microbatches)
        if missing:
            raise self.fail(st, i, f"step omits microbatches {sorted(missing)} whose "
                                   f"gradients are in the buffer")
        remote = set(a.microbatches) - w.pending
        if remote and w.reduced != a.ver:
            raise self.fail(st, i, f"step applies microbatches {sorted(remote)} from other "
                                   f"replicas without an ALLREDUCE for version {a.ver}")
        undone = [m for m in remote if (a.stage, m) not in self.backward_rank]
        if undone:
            raise self.fail(st, i, f"step applies microbatches {undone} that no replica "
                                   f"has backwarded yet")
        w.newest, w.reduced = a.ver, None
        w.pending.clear()
        self.check_versions(st, i)

    def exec_snapshot(self, st: _RankState, i: int, a: Action) -> None:
        w = st.weights[(a.stage, a.copy)]
        if a.ver != w.newest or a.ver in w.retained:
            raise self.fail(st, i, f"can only snapshot the newest version {w.newest} once")
        w.retained.add(a.ver)

    def exec_release(self, st: _RankState, i: int, a: Action) -> None:
        w = st.weights[(a.stage, a.copy)]
        if a.ver not in w.retained:
            raise self.fail(st, i, f"releases version {a.ver}, which is not retained")
        w.retained.discard(a.ver)

    def exec_average(self, st: _RankState, i: int, a: Action) -> None:
        copies = [v for (stage, _), v in st.weights.items() if stage == a.stage]
        want = max(c.newest for c in copies) + 1
        if a.ver != want or any(c.pending for c in copies):
            raise self.fail(st, i, f"average must create version {want} from copies with "
                                   f"no pending gradients")
        for c in copies:
            c.newest = a.ver
        self.check_versions(st, i)

    def deadlock(self) -> ScheduleError:
        waits = []
        for st in self.ranks:
            if st.done:
                continue
            a, i = st.actions[st.pc], st.pc
            head = f"rank {st.rank} waits at action {i} ({a.to_text()})"
            if a.kind is K.ALLREDUCE:
                waits.append(f"{head} for the ranks {list(self.s.stage_ranks[a.stage])} of "
                             f"stage {a.stage}")
                continue
            if a.kind.is_compute:
                head += " for its input"
                pending = self.input_pending(st, a)
                assert pending is not None  # why this compute blocks
                i = st.posted[pending]
            prank, pi = self.partner[(st.rank, i)]
            if a.kind.is_p2p:  # a blocked send waits for the delivery of its link's message
                recv = self.s.actions[prank][pi]
                what = "act" if recv.kind is K.RECV_ACT else "grad"
                prank, pi = self.partner[self.in_transit[(what, recv.stage, st.rank, prank)]]
                head += " behind the message in transit on its link"
            waits.append(f"{head} until rank {prank} reaches action {pi} "
                         f"({self.s.actions[prank][pi].to_text()})")
        first = next(st for st in self.ranks if not st.done)
        return self.fail(first, first.pc, "deadlock under the blocking rule: " + "; ".join(waits))

    def check_end(self) -> None:
        s = self.s
        training = not s.params.get("forward_only", False)  # evaluation: no backwards
        for st in self.ranks:
            end = len(st.actions) - 1
            for (stage, copy), w in st.weights.items():
                if w.retained:
                    raise self.fail(st, end, f"versions {sorted(w.retained)} of stage {stage} "
                                             f"(copy {copy}) are retained and never released")
                if w.pending:
                    raise self.fail(st, end, f"gradients of microbatches {sorted(w.pending)} on "
                                             f"stage {stage} are never applied by a step")
            if st.in_flight and training:
                raise self.fail(st, end, f"forwards {sorted(st.in_flight)} (stage, mb) are never "
                                         f"backwarded")
        checks = [("forwarded", self.forward_rank)]
        if training:
            checks.append(("backwarded", self.backward_rank))
        for stage in range(s.num_stages):
            for mb in range(s.num_microbatches):
                for what, seen in checks:
                    if (stage, mb) not in seen:
                        raise ScheduleError(f"microbatch {mb} is never {what} on stage {stage}")


def validate(schedule: Schedule) -> ValidationReport:
    """Check `schedule` by symbolic execution (rules in the module docstring).

    A generated stream longer than its `validation_microbatches` is proven on that window: the
    same generator with the same parameters on fewer microbatches, which holds the warm-up,
    at least three periods of the steady state (every dependency of a periodic action lies
    within them) and the drain. Generators are periodic by construction, so the actions of a
    longer run are those of the window's steady state shifted by whole periods.

    Raises ScheduleError naming the rank, the action index and the action for: a backward
    before its forward, a missing input, an unmatched send/receive, a deadlock under the
    blocking rule, more live versions or in-flight microbatches than declared, a weight
    version used after it is gone or a backward whose version differs from its forward's.
    """
    window = schedule.validation_microbatches
    if schedule.is_stream and window is not None and window < schedule.num_microbatches:
        schedule = schedule.window(window)
    return _Validator(schedule).run()
