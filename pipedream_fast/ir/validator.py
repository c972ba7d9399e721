"""The symbolic validator: runs a schedule's programs without tensors and proves it sound.

It checks placement, peers and send/receive matching, then executes every rank's list under
the blocking rule below, tracking weight versions (the contract in
`pipedream_fast.ir.actions`), in-flight microbatches and messages; `validate` raises a
ScheduleError at the first violation.

Communication and the blocking rule the validator models
---------------------------------------------------------
SEND_ACT(stage s, microbatch m, peer) sends stage s's output of m to `peer`, where
RECV_ACT(stage s+1, m, peer=sender) receives it; SEND_GRAD(stage s, m, peer) sends the
gradient of stage s's input to `peer`, where RECV_GRAD(stage s-1, m, peer=sender) receives
it. A forward of stage s > 0 needs its input received (or produced on the same rank by
stage s-1); a backward of a non-last stage needs its output gradient likewise.

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
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from collections.abc import Callable

from pipedream_fast.ir.actions import K, Action, ActionKind, ScheduleError
from pipedream_fast.ir.schedule import Schedule


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
                key = _p2p_key(a.kind, a.stage, a.needs("microbatch"), rank, a.needs("peer"))
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
                mb = a.needs("microbatch")
                st.posted[(what, a.stage, mb)] = st.pc
                link = (what, a.stage, a.needs("peer"), st.rank)
                if self.in_transit.get(link) == self.partner[(st.rank, st.pc)]:
                    del self.in_transit[link]  # its sender moved on already: delivered now
                    st.have.add((what, a.stage, mb))
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
        self.ranks[prank].have.add((what, recv.stage, recv.needs("microbatch")))
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
        mb, version = a.needs("microbatch"), a.needs("version")
        key = (a.stage, mb)
        if key in self.forward_rank:
            raise self.fail(st, i, f"microbatch {mb} was already forwarded on stage "
                                   f"{a.stage} by rank {self.forward_rank[key]}")
        local = (a.stage - 1, mb) in st.forwarded
        if a.stage > 0 and ("act", *key) not in st.have and not local:
            raise self.fail(st, i, "forward before its input arrived: no earlier "
                                   f"RECV_ACT of microbatch {mb} on this rank")
        self.require_live(st, i, st.weights[(a.stage, a.copy)], version)
        self.forward_rank[key] = st.rank
        st.forwarded.add(key)
        st.in_flight[key] = (version, a.copy)
        st.peak_inflight = max(st.peak_inflight, len(st.in_flight))
        if len(st.in_flight) > self.s.max_inflight[st.rank]:
            raise self.fail(st, i, f"{len(st.in_flight)} microbatches in flight, more than "
                                   f"the declared max_inflight {self.s.max_inflight[st.rank]}")

    def exec_backward(self, st: _RankState, i: int, a: Action) -> None:
        self.exec_backward_input(st, i, a)
        self.exec_backward_weight(st, i, a)

    def check_in_flight(self, st: _RankState, i: int, a: Action) -> None:
        """A backward part needs its forward on this rank, on the same version and copy."""
        mb, version = a.needs("microbatch"), a.needs("version")
        key = (a.stage, mb)
        if key not in st.in_flight:
            where = self.forward_rank.get(key)
            raise self.fail(st, i, "backward before its forward" if where is None else
                            "backward repeated" if key in self.backward_rank else
                            f"backward on a rank other than its forward's (rank {where})")
        used, used_copy = st.in_flight[key]
        if (version, a.copy) != (used, used_copy):
            raise self.fail(st, i, f"backward uses weight version {version} (copy {a.copy}) "
                                   f"but its forward used version {used} (copy {used_copy})")
        self.require_live(st, i, st.weights[(a.stage, a.copy)], version)

    def exec_backward_input(self, st: _RankState, i: int, a: Action) -> None:
        mb = a.needs("microbatch")
        key = (a.stage, mb)
        self.check_in_flight(st, i, a)
        if key in st.backwarded:
            raise self.fail(st, i, "the input gradient of this microbatch was already made")
        local = (a.stage + 1, mb) in st.backwarded
        if a.stage < self.s.num_stages - 1 and ("grad", *key) not in st.have and not local:
            raise self.fail(st, i, "backward before its output gradient arrived: no earlier "
                                   f"RECV_GRAD of microbatch {mb} on this rank")
        st.backwarded.add(key)  # its input gradient exists: SEND_GRAD may follow

    def exec_backward_weight(self, st: _RankState, i: int, a: Action) -> None:
        mb = a.needs("microbatch")
        key = (a.stage, mb)
        self.check_in_flight(st, i, a)
        if key not in st.backwarded:
            raise self.fail(st, i, "weight gradient before the input gradient (I before W)")
        del st.in_flight[key]
        self.backward_rank[key] = st.rank
        st.weights[(a.stage, a.copy)].pending.add(mb)

    def exec_step(self, st: _RankState, i: int, a: Action) -> None:
        version = a.needs("version")
        w = st.weights[(a.stage, a.copy)]
        if version != w.newest + 1:
            raise self.fail(st, i, f"step must create version {w.newest + 1}, not {version}")
        missing = w.pending - set(a.microbatches)
        if missing:
            raise self.fail(st, i, f"step omits microbatches {sorted(missing)} whose "
                                   f"gradients are in the buffer")
        remote = set(a.microbatches) - w.pending
        if remote and w.reduced != version:
            raise self.fail(st, i, f"step applies microbatches {sorted(remote)} from other "
                                   f"replicas without an ALLREDUCE for version {version}")
        undone = [m for m in remote if (a.stage, m) not in self.backward_rank]
        if undone:
            raise self.fail(st, i, f"step applies microbatches {undone} that no replica "
                                   f"has backwarded yet")
        w.newest, w.reduced = version, None
        w.pending.clear()
        self.check_versions(st, i)

    def exec_snapshot(self, st: _RankState, i: int, a: Action) -> None:
        version = a.needs("version")
        w = st.weights[(a.stage, a.copy)]
        if version != w.newest or version in w.retained:
            raise self.fail(st, i, f"can only snapshot the newest version {w.newest} once")
        w.retained.add(version)

    def exec_release(self, st: _RankState, i: int, a: Action) -> None:
        version = a.needs("version")
        w = st.weights[(a.stage, a.copy)]
        if version not in w.retained:
            raise self.fail(st, i, f"releases version {version}, which is not retained")
        w.retained.discard(version)

    def exec_average(self, st: _RankState, i: int, a: Action) -> None:
        version = a.needs("version")
        copies = [v for (stage, _), v in st.weights.items() if stage == a.stage]
        want = max(c.newest for c in copies) + 1
        if version != want or any(c.pending for c in copies):
            raise self.fail(st, i, f"average must create version {want} from copies with "
                                   f"no pending gradients")
        for c in copies:
            c.newest = version
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
    """Check `schedule` by symbolic execution (rules in this module's docstring).

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
