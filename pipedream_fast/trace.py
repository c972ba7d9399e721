"""Chrome / Perfetto traces: one format for the simulator's prediction and the runtime's run.

A `TraceEvent` is one action on one rank with its start and duration in milliseconds. The
simulator converts its records with `sim.events_from_simulation`; the runtime appends a
`TraceEvent` per action it performs (with `time.perf_counter()` based times) and writes them
with the same `write_chrome_trace`, so a run and its prediction open side by side in
chrome://tracing or https://ui.perfetto.dev.

File layout (the Trace Event Format's JSON object form): one process per source (the
simulator, the runtime), one thread (track) per rank named "rank R (stage S)", one complete
("ph": "X") slice per action named like "F3 v1" (forward of microbatch 3 on version 1), with
category = the action kind and args = stage, microbatch, version, the IR token and any extra.
Timestamps and durations are in microseconds, as the format requires.

Each message between ranks is also drawn (`transfers`): an async slice from the send to the
moment the receiver had it, on a track of its own ("transfers"), with a flow arrow from the
send to the compute that took it, so communication is seen beside the compute it overlaps;
`overlap_summary` says per link how much of the transfers' time that compute hid.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipedream_fast.ir import KIND_SPECS, ActionKind

@dataclass(frozen=True)
class TraceEvent:
    rank: int
    kind: str  # an ActionKind value: "forward", "backward", "send_act", ...
    start_ms: float
    duration_ms: float
    stage: int | None = None
    microbatch: int | None = None
    version: int | None = None
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        kind = ActionKind(self.kind)
        short = kind.spec.trace
        if kind.is_compute:
            return f"{short}{self.microbatch} v{self.version}"
        if self.microbatch is not None:
            return f"{short} {self.microbatch}"
        return f"{short} v{self.version}" if self.version is not None else short


@dataclass(frozen=True)
class MemorySample:
    """The activation bytes a rank held from `t_ms` on (measure_memory, a traced run)."""

    rank: int
    t_ms: float
    bytes: int


def chrome_trace(events: Iterable[TraceEvent], *, process: str = "pipedream-fast",
                 rank_stages: Mapping[int, Iterable[int]] | None = None,
                 pid: int = 0, metadata: Mapping[str, Any] | None = None,
                 memory: Iterable[MemorySample] = ()) -> dict[str, Any]:
    """The trace as a JSON-ready dict; `rank_stages` names the tracks; `memory` becomes one
    counter track per rank ("rank R activations", in MiB)."""
    events = list(events)
    ranks = sorted({e.rank for e in events} | set(rank_stages or {}))
    out: list[dict[str, Any]] = [{"ph": "M", "pid": pid, "name": "process_name",
                                  "args": {"name": process}}]
    for r in ranks:
        stages = list((rank_stages or {}).get(r, []))
        label = f"rank {r}" + (f" (stage {','.join(map(str, stages))})" if stages else "")
        out.append({"ph": "M", "pid": pid, "tid": r, "name": "thread_name",
                    "args": {"name": label}})
        out.append({"ph": "M", "pid": pid, "tid": r, "name": "thread_sort_index",
                    "args": {"sort_index": r}})
    for e in events:
        args = {"stage": e.stage, "microbatch": e.microbatch, "version": e.version, **e.args}
        out.append({"ph": "X", "pid": pid, "tid": e.rank, "name": e.name, "cat": e.kind,
                    "ts": e.start_ms * 1e3, "dur": e.duration_ms * 1e3,
                    "args": {k: v for k, v in args.items() if v is not None}})
    for m in memory:
        out.append({"ph": "C", "pid": pid, "name": f"rank {m.rank} activations",
                    "ts": m.t_ms * 1e3, "args": {"MiB": m.bytes / (1 << 20)}})
    moved = transfers(events)
    for i, t in enumerate(moved):
        name = f"{t.tensor} {t.microbatch}: rank {t.src} > {t.dst}"
        args = {"stage": t.stage, "microbatch": t.microbatch, "hidden_ms": t.hidden_ms,
                "exposed_ms": t.exposed_ms}
        out += [{"ph": "b", "pid": pid, "tid": t.dst, "cat": "transfer", "id": i, "name": name,
                 "ts": t.sent_ms * 1e3, "args": args},
                {"ph": "e", "pid": pid, "tid": t.dst, "cat": "transfer", "id": i, "name": name,
                 "ts": t.taken_ms * 1e3},
                # An arrow from the send's slice to the slice of the compute that took it.
                {"ph": "s", "pid": pid, "tid": t.src, "cat": "message", "id": i, "name": name,
                 "ts": t.sent_ms * 1e3},
                {"ph": "f", "bp": "e", "pid": pid, "tid": t.dst, "cat": "message", "id": i,
                 "name": name, "ts": t.taken_ms * 1e3}]
    other = dict(metadata or {})
    if moved:
        other["transfers"] = overlap_summary(moved)
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": other}


@dataclass(frozen=True)
class Transfer:
    """One message between ranks, read off a trace: sent when the sender's send action
    started (`sent_ms`), had by the receiver at `taken_ms` (the start of the compute that took
    it, plus `waited_ms`, what that compute waited for it). The exposed part of its time in
    flight is the part of that wait after the send: the receiver idle for the transfer (a wait
    before it is a wait for the sender's compute, the pipeline's bubble); the rest of its time
    in flight is hidden, the receiver busy with other work. Times of ranks on different
    machines are not comparable: there only `waited_ms` holds."""

    tensor: str  # "act" or "grad"
    src: int
    dst: int
    stage: int  # the stage that takes it
    microbatch: int
    sent_ms: float
    taken_ms: float
    waited_ms: float

    @property
    def in_flight_ms(self) -> float:
        return max(0.0, self.taken_ms - self.sent_ms)

    @property
    def exposed_ms(self) -> float:
        return min(self.waited_ms, self.in_flight_ms)

    @property
    def hidden_ms(self) -> float:
        return self.in_flight_ms - self.exposed_ms


_TAKES = {"act": frozenset({ActionKind.FORWARD.value}),
          "grad": frozenset(k.value for k in ActionKind if KIND_SPECS[k].needs_output_grad)}


def transfers(events: Iterable[TraceEvent]) -> list[Transfer]:
    """Each send of a trace paired with the compute on another rank that took its message:
    the forward of the next stage (an activation), the backward (or backward-input) of the
    stage before (a gradient), same microbatch, first one at or after the send. Compute
    events must carry their wait (args "waited_ms", as the runtime's and the simulator's do;
    none counts as no wait). In time order of the sends."""
    takes: dict[tuple[str, int, int], list[TraceEvent]] = defaultdict(list)
    sends = []
    for e in events:
        if e.microbatch is None or e.stage is None:
            continue
        if e.kind in (ActionKind.SEND_ACT.value, ActionKind.SEND_GRAD.value):
            sends.append(e)
        for tensor, kinds in _TAKES.items():
            if e.kind in kinds:
                takes[(tensor, e.stage, e.microbatch)].append(e)
    out = []
    for send in sorted(sends, key=lambda e: e.start_ms):
        assert send.stage is not None and send.microbatch is not None
        tensor = "act" if send.kind == ActionKind.SEND_ACT.value else "grad"
        stage = send.stage + (1 if tensor == "act" else -1)
        took = min((e for e in takes.get((tensor, stage, send.microbatch), ())
                    if e.rank != send.rank and e.start_ms + e.duration_ms >= send.start_ms),
                   key=lambda e: e.start_ms, default=None)
        if took is None:
            continue  # taken after the trace's window
        waited = float(took.args.get("waited_ms", 0.0))
        out.append(Transfer(tensor, send.rank, took.rank, stage, send.microbatch,
                            send.start_ms, took.start_ms + waited, waited))
    return out


def overlap_summary(moved: Iterable[Transfer]) -> list[dict[str, Any]]:
    """Per link and tensor (rank src > dst, "act" or "grad"): how many messages, their mean
    time in flight and mean exposed time (ms), and the share of their time in flight that
    the receiver's other work hid."""
    links: dict[tuple[int, int, str], list[Transfer]] = defaultdict(list)
    for t in moved:
        links[(t.src, t.dst, t.tensor)].append(t)
    out = []
    for (src, dst, tensor), ts in sorted(links.items()):
        flight = sum(t.in_flight_ms for t in ts)
        out.append({"src": src, "dst": dst, "tensor": tensor, "messages": len(ts),
                    "in_flight_ms": flight / len(ts),
                    "exposed_ms": sum(t.exposed_ms for t in ts) / len(ts),
                    "hidden": sum(t.hidden_ms for t in ts) / flight if flight > 0 else 1.0})
    return out


def overlap_lines(summary: Iterable[Mapping[str, Any]]) -> list[str]:
    """`overlap_summary` in words, a line per link."""
    return [f"{row['tensor']} rank {row['src']} > {row['dst']}: {row['messages']} messages, "
            f"{row['in_flight_ms']:.2f} ms in flight, {row['exposed_ms']:.2f} ms exposed "
            f"(mean), {100 * row['hidden']:.0f}% hidden by compute" for row in summary]


def write_chrome_trace(events: Iterable[TraceEvent], path: str | os.PathLike[str],
                       **kwargs: Any) -> dict[str, Any]:
    """Write `events` as a Chrome/Perfetto JSON trace (see `chrome_trace` for the options);
    returns the trace written (its otherData holds the transfers' overlap summary)."""
    trace = chrome_trace(events, **kwargs)
    Path(path).write_text(json.dumps(trace) + "\n")
    return trace


def read_chrome_trace(path: str | os.PathLike[str]) -> list[TraceEvent]:
    """Read back the slices of a trace written by `write_chrome_trace`."""
    data = json.loads(Path(path).read_text())
    events = []
    for ev in data.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        args = dict(ev.get("args", {}))
        stage, mb, version = (args.pop(k, None) for k in ("stage", "microbatch", "version"))
        events.append(TraceEvent(ev["tid"], ev["cat"], ev["ts"] / 1e3, ev["dur"] / 1e3,
                                 stage, mb, version, args))
    return events
