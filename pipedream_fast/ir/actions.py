"""The action vocabulary: `Action`, its kinds (`KIND_SPECS`, declared once) and its text form.

A rank's program is an ordered list of `Action`s. What each kind means for the weight versions
is the contract below; how a schedule's actions meet across ranks (communication, the blocking
rule) is `pipedream_fast.ir.validator`'s.

Weight versions (the contract an executor with a ring of versions follows blindly)
------------------------------------------------------------------------------------
Each (stage, copy) on a rank owns a sequence of weight versions. Version 0 is the initial
weights; version v is the weights after v updates (OPTIMIZER_STEP or AVERAGE) of that copy.
`copy` is 0 except for localsgd, where a rank holds one independent copy of its stage per
model replica. At any moment the *newest* version exists; older versions exist only while
*retained*.

- FORWARD(stage, microbatch, version=v): run the stage on the microbatch's input (stage 0:
  that microbatch of the data loader) with version v, which must be the newest or a retained
  version. The activations stay stashed (in flight) until BACKWARD.
- BACKWARD(stage, microbatch, version=v): must name the same v as its FORWARD (weight
  stashing). The last stage starts from the microbatch's loss (targets from the same loader).
  Its weight gradient is *added* to the gradient buffer of (stage, copy).
- BACKWARD_INPUT then BACKWARD_WEIGHT(stage, microbatch, version=v): the same backward in two
  parts (zero-bubble schedules). The input part needs the output gradient and makes the input
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

Text form (one token per action; `Schedule.to_text` adds a header and one line per rank)
----------------------------------------------------------------------------------------
    token := STAGE CODE [MICROBATCH] [DIR PEER] ['@' VERSION] ['c' COPY] [':' MICROBATCHES]
    CODE  := the kind's `KindSpec.code` in KIND_SPECS (the parser is built from that table)
    DIR   := '>' (sends) | '<' (receives);  MICROBATCHES := ITEM (',' ITEM)*, ITEM := N | N '-' N

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

import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal
from collections.abc import Iterable


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

# The text form, read back by a parser built from KIND_SPECS: the codes (longest first, so
# that a two-letter code is never read as a one-letter one), then the optional parts, each
# captured under the name of the Action field it fills.
_KINDS: dict[str, ActionKind] = {spec.code: kind for kind, spec in KIND_SPECS.items()}
_CODES = "|".join(re.escape(code) for code in sorted(_KINDS, key=len, reverse=True))
_TOKEN = re.compile(rf"(?P<stage>\d+)(?P<code>{_CODES})(?P<microbatch>\d+)?"
                    r"(?:(?P<dir>[<>])(?P<peer>\d+))?(?:@(?P<version>\d+))?(?:c(?P<copy>\d+))?"
                    r"(?::(?P<microbatches>\d+(?:-\d+)?(?:,\d+(?:-\d+)?)*))?")
_NUMBERS = ("microbatch", "peer", "version", "copy")  # the optional int fields of a token


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
    """One step of a rank's program; see this module's docstring for each kind's meaning."""

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

    def needs(self, field: Literal["microbatch", "peer", "version"]) -> int:
        """`field` of this action as an int, for the fields its kind guarantees (KindSpec): a
        ScheduleError naming the action where it is missing."""
        value: int | None = getattr(self, field)
        if value is None:
            raise ScheduleError(f"{self.kind.value} action {self.to_text()} names no {field}")
        return value

    def shifted(self, microbatches: int, versions: int) -> Action:
        """This action `microbatches` microbatches and `versions` weight versions later (the
        same action one or more periods on, in a periodic program). Both shifts are >= 0, so
        the result keeps every rule `__post_init__` checks, and it is not checked again: a
        compiled program makes one per action it replays."""
        new = object.__new__(Action)
        fields = new.__dict__
        fields.update(self.__dict__)
        if self.microbatch is not None:
            fields["microbatch"] = self.microbatch + microbatches
        if self.version is not None:
            fields["version"] = self.version + versions
        if self.microbatches:
            fields["microbatches"] = tuple(m + microbatches for m in self.microbatches)
        return new

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
                                f"'1rB3<2', '0U@2:4-7' (see pipedream_fast.ir.actions for the "
                                f"grammar)")
        kind = _KINDS[m["code"]]
        if m["dir"] is not None:
            want = ">" if KIND_SPECS[kind].sends else "<"
            if not kind.is_p2p or m["dir"] != want:
                raise ScheduleError(f"action {token!r}: {kind.value} takes "
                                    f"{repr(want) + ' PEER' if kind.is_p2p else 'no peer'}")

        fields: dict[str, Any] = {name: int(m[name]) for name in _NUMBERS if m[name] is not None}
        if m["microbatches"]:
            fields["microbatches"] = parse_mb_list(m["microbatches"])
        try:
            return cls(kind, int(m["stage"]), **fields)
        except ScheduleError as err:
            raise ScheduleError(f"action {token!r}: {err}") from None


# Short constructors used by the schedule generators and tests.
def forward(stage: int, microbatch: int, version: int, copy: int = 0) -> Action:
    return Action(K.FORWARD, stage, microbatch, version=version, copy=copy)


def backward(stage: int, microbatch: int, version: int, copy: int = 0) -> Action:
    return Action(K.BACKWARD, stage, microbatch, version=version, copy=copy)


def optimizer_step(stage: int, version: int, microbatches: Iterable[int], copy: int = 0) -> Action:
    return Action(K.OPTIMIZER_STEP, stage, version=version, copy=copy,
                  microbatches=tuple(sorted(set(microbatches))))


def allreduce(stage: int, version: int, copy: int = 0) -> Action:
    return Action(K.ALLREDUCE, stage, version=version, copy=copy)
