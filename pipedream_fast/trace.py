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
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipedream_fast.ir import ActionKind

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
    return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": dict(metadata or {})}


def write_chrome_trace(events: Iterable[TraceEvent], path: str | os.PathLike[str],
                       **kwargs: Any) -> None:
    """Write `events` as a Chrome/Perfetto JSON trace (see `chrome_trace` for the options)."""
    Path(path).write_text(json.dumps(chrome_trace(events, **kwargs)) + "\n")


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
