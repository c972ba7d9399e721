"""The two lowering passes every schedule shares, as streams:

    compute program --add_retention--> + SNAPSHOT/RELEASE --add_communication--> + SEND/RECV

Both read a rank's compute program (forwards, backwards, updates) lazily and yield the full
program lazily, so a run of any length starts at once and holds memory bounded by the
schedule's period, never by its length. Where a decision needs the future (is this version
read again after the update that supersedes it?), `Lookahead` buffers just enough of the
program to answer it. The answers rest on one property every generator keeps, which the
pass relies on: on each (stage, weight copy), forwards read non-decreasing versions (they may
lag behind the newest version, as in 2BW and vertical sync, but never go back).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator

from pipedream_fast.ir import Action, ActionKind, ScheduleError
from pipedream_fast.schedules.layout import Layout

K = ActionKind
MAX_LOOKAHEAD = 1 << 20  # actions; a periodic schedule decides within a few periods


class Lookahead:
    """An iterator of actions that can look ahead: `pop` the next one, `ahead()` to scan the
    ones after it without consuming them (pulled from the source as the scan goes)."""

    def __init__(self, source: Iterable[Action]) -> None:
        self._source = iter(source)
        self._buffer: list[Action] = []
        self._head = 0

    def _pull(self) -> bool:
        item = next(self._source, None)
        if item is None:
            return False
        if len(self._buffer) - self._head >= MAX_LOOKAHEAD:
            raise ScheduleError(f"a lowering decision needed more than {MAX_LOOKAHEAD} actions "
                                f"of look-ahead: one optimizer step spans too many microbatches "
                                f"(give chunks) or the generator is not periodic")
        self._buffer.append(item)
        return True

    def pop(self) -> Action | None:
        buffer, head = self._buffer, self._head
        if head == len(buffer):  # nothing looked at ahead (the usual case): from the source
            if head:
                buffer.clear()
                self._head = 0
            return next(self._source, None)
        item = buffer[head]
        head += 1
        if head > 1024 and head * 2 > len(buffer):
            del buffer[:head]  # amortised O(1): drop what was consumed
            head = 0
        self._head = head
        return item

    def prefetch(self, count: int) -> bool:
        """Makes up to `count` actions ahead now (a rank that would wait anyway), so that
        `pop` later only hands them out; False once the source is spent."""
        while len(self._buffer) - self._head < count:
            if not self._pull():
                return False
        return True

    def ahead(self) -> Iterator[Action]:
        i = self._head
        while i < len(self._buffer) or self._pull():
            yield self._buffer[i]
            i += 1


class _Retention:
    """State of `add_retention` for one rank: versions per (stage, copy), in-flight forwards
    per version, retained versions."""

    def __init__(self, ahead: Lookahead) -> None:
        self.ahead = ahead
        self.newest: dict[tuple[int, int], int] = {}
        self.floor: dict[int, int] = defaultdict(int)  # stage -> version of its last AVERAGE
        self.copies: dict[int, set[int]] = defaultdict(set)
        self.inflight: dict[tuple[int, int, int], int] = {}
        self.retained: set[tuple[int, int, int]] = set()
        self.first_read: dict[tuple[int, int], int] = {}  # newest version already read

    def newest_of(self, stage: int, copy: int) -> int:
        return max(self.newest.get((stage, copy), 0), self.floor[stage])

    def read_after(self, stage: int, copy: int, version: int, inflight: int) -> bool:
        """Whether version is read after the current point: by the backward of one of its
        `inflight` forwards, or by a later forward (forwards read non-decreasing versions, so
        the next forward of this (stage, copy) decides)."""
        if inflight > 0:
            return True
        for b in self.ahead.ahead():
            if b.kind is K.FORWARD and (b.stage, b.copy) == (stage, copy):
                assert b.version is not None
                if b.version >= version:  # older reads may still lag behind; they don't decide
                    return b.version == version
        return False

    def read_after_update(self, stage: int, copy: int, version: int) -> bool:
        """At the first forward of the newest `version`: is it read after the update that
        supersedes it? Up to that update, counts the forwards still in flight there; past
        it, the next forward of this (stage, copy) decides (as in `read_after`)."""
        inflight = self.inflight.get((stage, copy, version), 0) + 1  # + the forward at hand
        superseded = False
        for b in self.ahead.ahead():
            if b.stage != stage:
                continue
            if not superseded:
                if b.kind is K.AVERAGE or (b.kind is K.OPTIMIZER_STEP and b.copy == copy):
                    if inflight > 0:
                        return True
                    superseded = True
                elif b.copy == copy and b.version == version:
                    inflight += (1 if b.kind is K.FORWARD else
                                 -1 if b.kind.spec.ends_microbatch else 0)
            elif b.kind is K.FORWARD and b.copy == copy and b.needs("version") >= version:
                return b.version == version
        return False  # never superseded, or never read again

    def lower(self, a: Action) -> Iterator[Action]:
        s, c, v = a.stage, a.copy, a.version
        if a.kind is K.FORWARD:
            assert v is not None
            self.copies[s].add(c)
            key = (s, c, v)
            if v == self.newest_of(s, c) and self.first_read.get((s, c)) != v:
                self.first_read[(s, c)] = v
                if key not in self.retained and self.read_after_update(s, c, v):
                    self.retained.add(key)
                    yield Action(K.SNAPSHOT, s, version=v, copy=c)
            self.inflight[key] = self.inflight.get(key, 0) + 1
            yield a
        elif a.kind.spec.ends_microbatch:  # a backward, or the weight part of a split one
            assert v is not None
            key = (s, c, v)
            self.inflight[key] = self.inflight.get(key, 0) - 1
            if not self.inflight[key]:
                del self.inflight[key]
            yield a
            if (key in self.retained and v < self.newest_of(s, c)
                    and not self.read_after(s, c, v, self.inflight.get(key, 0))):
                self.retained.discard(key)
                yield Action(K.RELEASE, s, version=v, copy=c)
        elif a.kind in (K.OPTIMIZER_STEP, K.AVERAGE):
            assert v is not None
            copies = [c] if a.kind is K.OPTIMIZER_STEP else sorted(self.copies[s])
            for copy in copies:
                old = self.newest_of(s, copy)
                key = (s, copy, old)
                if key not in self.retained and self.read_after(s, copy, old,
                                                                self.inflight.get(key, 0)):
                    self.retained.add(key)
                    yield Action(K.SNAPSHOT, s, version=old, copy=copy)
            yield a
            if a.kind is K.AVERAGE:
                self.floor[s] = v
                for copy in self.copies[s]:
                    self.newest[(s, copy)] = v
            else:
                self.newest[(s, c)] = v
        else:
            yield a


def add_retention(actions: Iterable[Action]) -> Iterator[Action]:
    """Adds SNAPSHOT and RELEASE to one rank's compute program, lazily.

    A version that is read after the update that supersedes it is retained: SNAPSHOT goes
    just before its first forward (so that forward already runs on the retained copy and the
    update may overwrite the live weights in place; the values are equal, as no update comes
    in between), or just before the update if no forward read it first. RELEASE goes right
    after its last read.
    """
    ahead = Lookahead(actions)
    state = _Retention(ahead)
    while (a := ahead.pop()) is not None:
        yield from state.lower(a)


def add_communication(rank: int, actions: Iterable[Action], layout: Layout,
                      gradients: bool = True, early_inputs: bool = False) -> Iterator[Action]:
    """Adds sends and receives to one rank's program, lazily; tensors between stages on the
    same rank move locally.

    A receive only posts a buffer (it never blocks), so receives go as early as their buffer
    can be known: a forward's activation receive right after the previous compute, a
    backward's gradient receive right after its own forward (NOAM buffers at most). Between
    two computes X and Y the gap is: receives, X's sends, then X's bookkeeping (SNAPSHOT,
    ALLREDUCE, OPTIMIZER_STEP, RELEASE, AVERAGE). Early posting is what keeps neighbours that
    send to each other in the same gap (1F1B), or a rank blocked in an all-reduce, from
    deadlocking under the blocking rule of `pipedream_fast.ir.validator`. Without `gradients`
    (forward-only programs) no gradient receive is posted. With `early_inputs` (breadth-first
    schedules, where a rank forwards a whole step on one stage before its next one) the input
    of a microbatch on the rank's next stage is posted right after its forward on this one,
    as a gradient receive is: the stage before may then send ahead while this rank still
    works on its earlier stage.
    """
    last = layout.num_stages - 1
    mine = layout.stages_of(rank)
    recvs: list[Action] = []
    sends: list[Action] = []
    held: list[Action] = []
    early: set[tuple[int, int]] = set()  # (stage, mb) inputs already posted
    for a in actions:
        if not a.kind.is_compute:
            held.append(a)
            continue
        s, mb = a.stage, a.microbatch
        assert mb is not None
        if a.kind is K.FORWARD and s > 0 and (src := layout.rank_of(s - 1, mb)) != rank \
                and (s, mb) not in early:
            recvs.append(Action(K.RECV_ACT, s, mb, peer=src))
        early.discard((s, mb))
        yield from recvs + sends + held
        yield a
        recvs, sends, held = [], [], []
        if a.kind is K.FORWARD and s < last and (peer := layout.rank_of(s + 1, mb)) != rank:
            if gradients:
                recvs.append(Action(K.RECV_GRAD, s, mb, peer=peer))
            sends.append(Action(K.SEND_ACT, s, mb, peer=peer))
        if a.kind is K.FORWARD and early_inputs:
            t = next((t for t in mine if t > s and layout.rank_of(t, mb) == rank), None)
            if t is not None and (src := layout.rank_of(t - 1, mb)) != rank:
                recvs.append(Action(K.RECV_ACT, t, mb, peer=src))
                early.add((t, mb))
        if a.kind.spec.makes_input_grad and s > 0 and (dst := layout.rank_of(s - 1, mb)) != rank:
            sends.append(Action(K.SEND_GRAD, s, mb, peer=dst))
    yield from recvs + sends + held


def lower(rank: int, compute: Iterable[Action], layout: Layout,
          gradients: bool = True, early_inputs: bool = False) -> Iterator[Action]:
    """A rank's full program from its compute program (`add_communication` for the options)."""
    return add_communication(rank, add_retention(compute), layout, gradients, early_inputs)
