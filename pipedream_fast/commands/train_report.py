"""`pipedream-fast train`'s report: the run directory's files (plan, profile, traces, plots),
the summary table and summary.json.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any


from pipedream_fast.tuning import Tuning
from pipedream_fast.commands.train_settings import (RunSetup, Settings, _schedule_options,
                                                    tuning_flags)


def _write(run_dir: Path, args: argparse.Namespace, s: Settings, setups: list[RunSetup],
           histories: list[Any], outcomes: list[list[dict[str, Any]]],
           say: Callable[[str], None]) -> list[str]:
    from pipedream_fast import run_report as rr
    from pipedream_fast.sim import write_simulation_trace
    from pipedream_fast.trace import MemorySample, overlap_lines, write_chrome_trace

    files: list[str] = []
    main = setups[0]
    if main.profile is not None:
        main.profile.save(run_dir / "profile.json")
        files.append("profile.json")
    main.plan.save(run_dir / "plan.json")
    files.append("plan.json")
    for extra in setups[1:]:
        extra.plan.save(run_dir / f"plan-{extra.name}.json")
        files.append(f"plan-{extra.name}.json")
    events = [e for r in outcomes[0] for e in r.get("events", [])]
    memory = [m for r in outcomes[0] for m in r.get("memory_samples", [])]
    if events:
        origin = min(e.start_ms for e in events)
        events = [type(e)(e.rank, e.kind, e.start_ms - origin, e.duration_ms, e.stage,
                          e.microbatch, e.version, e.args) for e in events]
        memory = [MemorySample(m.rank, m.t_ms - origin, m.bytes) for m in memory]
        written = write_chrome_trace(events, run_dir / "run_trace.json",
                           process=f"pipedream-fast train {main.schedule} (first "
                                   f"{args.trace_steps} steps)",
                           rank_stages={r: main.plan.stages_of_rank(r)
                                        for r in range(main.plan.workers)}, memory=memory)
        files.append("run_trace.json")
        overlap = overlap_lines(written["otherData"].get("transfers", []))
        if overlap:
            say("transfers in the traced steps (run_trace.json):\n  " + "\n  ".join(overlap))
        if memory and rr.have_matplotlib():
            rr.plot_memory(run_dir / "memory.png", memory)
            files.append("memory.png")
        if args.trace:
            shutil.copyfile(run_dir / "run_trace.json", args.trace)
            say(f"wrote {args.trace}")
    elif args.trace_steps:
        say("note: the run recorded no trace events")
    if main.sim_window is not None:
        write_simulation_trace(main.sim_window, run_dir / "sim_trace.json")
        files.append("sim_trace.json")
    files.append("metrics.csv")  # written during the run
    if rr.have_matplotlib():
        if main.sim_window is not None:
            from pipedream_fast.timeline import draw_timeline
            draw_timeline(main.sim_window, run_dir / "timeline.png")
            files.append("timeline.png")
        rr.plot_curves(run_dir / "loss_accuracy.png", histories, _metric_label(s))
        files.append("loss_accuracy.png")
    else:
        say("note: matplotlib is not installed: no timeline.png or loss_accuracy.png "
            "(pip install matplotlib)")
    if (run_dir / "checkpoint").is_dir():
        files.append("checkpoint/")
    return files


def memory_by_rank(results: list[dict[str, Any]]) -> dict[int, Any] | None:
    """Each rank's measured memory (`Pipeline.memory`): one per rank process, or every rank
    thread's in the one result of a threads run; None when it was not measured."""
    found: dict[int, Any] = {}
    for r in results:
        memory = r.get("memory")
        if not memory:
            continue
        if "rank" in memory and "stages" in memory:  # a process's own
            found[r["rank"]] = memory
        else:  # rank threads: by rank
            found.update({int(rank): m for rank, m in memory.items()})
    return found or None


def _memory_text(results: list[dict[str, Any]]) -> str:
    by_rank = memory_by_rank(results)
    if not by_rank:
        return "-"
    mib = 1 << 20
    return "; ".join(f"rank {rank} {m['rank']['total_peak'] / mib:.1f} MiB "
                     f"(activations {m['rank']['activations_peak'] / mib:.1f})"
                     for rank, m in sorted(by_rank.items()))


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _metric_label(s: Settings) -> str:
    return "test accuracy per character" if s.data == "text" else "test accuracy"


def _summary(s: Settings, setups: list[RunSetup], histories: list[Any],
             outcomes: list[list[dict[str, Any]]], wall_s: float, run_dir: Path) -> Any:
    from pipedream_fast import run_report as rr

    columns = [h.name for h in histories]
    finals = [h.final or {} for h in histories]

    def per(fn: Callable[[RunSetup, Any, dict[str, Any]], Any]) -> list[Any]:
        return [fn(st, h, f) for st, h, f in zip(setups, histories, finals)]

    calibrated = [calibrated_prediction(st, s, h, results)
                  for st, h, results in zip(setups, histories, outcomes)]

    rows: list[tuple[str, list[Any]]] = [
        ("plan", per(lambda st, h, f: st.plan.describe(
             [b.name for b in st.profile.blocks] if st.profile else None))),
        ("workers", [f"{s.workers} {'threads' if s.threads else 'processes'}"] * len(setups)),
        ("minibatch", per(lambda st, h, f: f"{s.batch_size} = {st.chunks} x "
                                           f"{s.batch_size // st.chunks}")),
        ("trained", per(lambda st, h, f: f"{_plural(f.get('epoch', -1) + 1, 'epoch')}, "
                                         f"{f.get('step', 0)} steps, {h.samples:,} samples")),
        ("samples/s measured", per(lambda st, h, f: h.samples_per_s)),
        ("samples/s simulated, calibrated", [calibrated_text(c) for c in calibrated]),
        *calibration_rows(calibrated),
        ("samples/s simulated, profile", per(lambda st, h, f: _profile_text(
            st.simulated_samples_per_s))),
        (_metric_label(s), per(lambda st, h, f: f"{100 * f['accuracy']:.2f}%"
                               if f.get("accuracy") is not None else "-")),
        ("test loss", per(lambda st, h, f: f"{f['loss']:.4f}" if "loss" in f else "-")),
    ]
    if any(r.get("memory") for results in outcomes for r in results):
        rows.append(("peak memory (measured)", [_memory_text(results) for results in outcomes]))
    if any(r.get("adapt") for results in outcomes for r in results):
        rows.append(("stages moved (adapt)", [_moves_text(results) for results in outcomes]))
    if s.data == "text":
        rows.append(("bits per character", per(lambda st, h, f: f"{f['loss'] / math.log(2):.3f}"
                                                if "loss" in f else "-")))
    if s.target is not None:
        rows.append((f"time to {100 * s.target:.1f}%", per(
            lambda st, h, f: f"{h.target_reached_s:.1f} s (step {h.target_reached_step})"
            if h.target_reached_s is not None else "not reached")))
    rows.append(("training time", per(lambda st, h, f: f"{h.elapsed_s:.1f} s "
                                                      f"({h.train_s:.1f} s without evaluation)")))
    rows.append(("first step", per(lambda st, h, f: f"{h.first_step_s:.2f} s (start-up, "
                                                   f"not in samples/s)"
                                   if h.first_step_s is not None else "-")))
    delays = rr.traced_weight_delays(outcomes[0], setups[0].sim_window)  # the traced run
    if delays is not None:
        rows.append(("weight delay",
                     [rr.weight_delay_text(delays)] + ["-"] * (len(setups) - 1)))
    changed = _changed_knobs(s.tuning)
    if changed:
        rows.append(("tuning", [changed] * len(setups)))
    table = rr.summary_table(f"pipedream-fast train: {s.model} on {s.data}", columns, rows)
    table.caption = (f"wall time {wall_s:.1f} s (loading, profiling, planning, start-up, "
                     f"training, evaluation, writing); run directory {run_dir}")
    return table


def calibrated_prediction(st: RunSetup, s: Settings, h: Any, results: list[dict[str, Any]]
                          ) -> dict[str, Any] | None:
    """The simulator's samples/s for the epochs after the calibrating ones, from the speed
    every rank measured in those (`sim.MeasuredCosts`), next to the rate measured in them;
    and (`same_window_*`) from the speed measured in those epochs themselves. Each epoch is
    one `train()` call: a run of its steps through the schedule (fill and drain included)
    plus the call's own overhead. None when the run had no such epochs."""
    split = max((r.get("calibration_epochs", 0) for r in results), default=0)
    if any(r.get("adapt") for r in results):  # adapt resets the calibrations at its checks,
        return None  # and a move leaves figures of several plans
    snaps: dict[int, Any] = {}
    rest: dict[int, Any] = {}
    for r in results:
        snaps.update(r.get("calibration") or {})
        rest.update(r.get("calibration_rest") or {})
    if not split or not snaps or len(h.evals) <= split:
        return None
    at, end = h.evals[split - 1], h.evals[-1]
    samples, seconds = end["samples"] - at["samples"], end["train_s"] - at["train_s"]
    if samples <= 0 or seconds <= 0:
        return None
    counts = [b["step"] - a["step"] for a, b in zip(h.evals[split - 1:], h.evals[split:])]
    measured = samples / seconds
    predicted = samples / _epochs_ms(st, s, snaps, counts) * 1e3
    warm = max((r.get("calibration_warmup", 0) for r in results), default=0)
    out = {"warmup_epochs": warm, "calibrated_epochs": split - warm,
           "predicted_epochs": len(counts),
           "predicted_samples_per_s": predicted, "measured_samples_per_s": measured,
           "error_pct": (predicted / measured - 1) * 100}
    if rest:
        same = samples / _epochs_ms(st, s, rest, counts) * 1e3
        out.update(same_window_samples_per_s=same,
                   same_window_error_pct=(same / measured - 1) * 100)
    from pipedream_fast.runtime.calibration import summary
    out["costs"] = summary(snaps)
    return out


def _epochs_ms(st: RunSetup, s: Settings, snaps: dict[int, Any], counts: list[int]) -> float:
    """The simulated time of epochs of `counts` steps, each one `train()` call, with the
    costs of the ranks' snapshots."""
    from pipedream_fast.sim import MeasuredCosts, simulate
    from pipedream_fast.training import build_schedule

    costs = MeasuredCosts.from_calibration(snaps)
    # The rate is timed where the events come from: the reporting rank's process (the last
    # stage's first rank), or the caller's thread, which waits for every rank thread.
    reporter = None if s.threads else st.plan.stages[-1].ranks[0]
    run_ms: dict[int, float] = {}
    for count in set(counts):
        schedule = build_schedule(st.plan, st.schedule, count, st.chunks,
                                  _schedule_options(s, st.schedule))
        run_ms[count] = simulate(schedule, costs).makespan + costs.run_ms(reporter)
    return sum(run_ms[c] for c in counts)


def _epochs(first: int, n: int) -> str:
    return f"epoch {first}" if n == 1 else f"epochs {first}-{first + n - 1}"


def calibrated_text(c: dict[str, Any] | None) -> str:
    """One summary cell, short enough for one line: the prediction for the epochs after the
    calibrating ones, and the rate measured in them (`calibration_rows`: the rest)."""
    if c is None:
        return "- (needs 2 epochs or more)"
    then = _epochs(c["warmup_epochs"] + c["calibrated_epochs"] + 1, c["predicted_epochs"])
    return (f"{c['predicted_samples_per_s']:,.1f} for {then}; measured "
            f"{c['measured_samples_per_s']:,.1f} ({c['error_pct']:+.1f}%)")


def calibration_rows(calibrated: list[dict[str, Any] | None]) -> list[tuple[str, list[str]]]:
    """The rows under `calibrated_text`'s, when a run has its prediction: the epochs the
    ranks measured their speed in, and the prediction from the predicted epochs' own speed
    (which separates the simulator's error from the machine's changes)."""
    if not any(calibrated):
        return []

    def window(c: dict[str, Any] | None) -> str:
        if c is None:
            return "-"
        warm = c["warmup_epochs"]
        return (_epochs(warm + 1, c["calibrated_epochs"])
                + (f" ({_epochs(1, warm)} warm{'s' if warm == 1 else ''} up)" if warm else ""))

    rows = [("calibrated on", [window(c) for c in calibrated])]
    if any(c and "same_window_samples_per_s" in c for c in calibrated):
        rows.append(("samples/s simulated, own speed",
                     [f"{c['same_window_samples_per_s']:,.1f} ({c['same_window_error_pct']:+.1f}%)"
                      if c and "same_window_samples_per_s" in c else "-"
                      for c in calibrated]))
    return rows


def _moves_text(results: list[dict[str, Any]]) -> str:
    """The stage moves `--adapt` made in a run (every rank records the same ones)."""
    moves: list[dict[str, Any]] = next((r["moves"] for r in results if r.get("moves")), [])
    if not any(r.get("adapt") for r in results):
        return "-"
    if not moves:
        return "none (the measured speeds did not call for one)"
    return "; ".join(f"step {m['step']}: to {m['to']} in {m['seconds']:.2f} s" for m in moves)


def _profile_text(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.1f} (the up-front profile's, which the planner used)"


def _changed_knobs(tuning: Tuning) -> str:
    """The knobs set away from their defaults, as their flags: `--queue-depth 2, ...`."""
    return ", ".join(tuning_flags(tuning))


def _summary_json(s: Settings, setups: list[RunSetup], histories: list[Any],
                  outcomes: list[list[dict[str, Any]]], wall_s: float, run_dir: Path,
                  files: list[str]) -> dict[str, Any]:
    runs = []
    for st, h, results in zip(setups, histories, outcomes):
        final = h.final or {}
        runs.append({
            "name": st.name, "schedule": st.schedule, "chunks": st.chunks,
            **_schedule_options(s, st.schedule), "plan": st.plan.to_dict(),
            "steps": final.get("step", 0),
            "epochs": final.get("epoch", -1) + 1, "samples": h.samples,
            "train_s": h.train_s, "elapsed_s": h.elapsed_s, "first_step_s": h.first_step_s,
            "samples_per_s": h.samples_per_s,
            "simulated_samples_per_s": st.simulated_samples_per_s,
            "calibrated": calibrated_prediction(st, s, h, results),
            "test_loss": final.get("loss"), "test_accuracy": final.get("accuracy"),
            "time_to_target_s": h.target_reached_s, "target_step": h.target_reached_step,
            "moves": next((r["moves"] for r in results if r.get("moves")), []),
            "memory": memory_by_rank(results),
            "rank_stats": {r["rank"]: r.get("stats", {}) for r in results}})
    from pipedream_fast import run_report as rr
    runs[0]["weight_delays"] = rr.traced_weight_delays(outcomes[0], setups[0].sim_window)
    return {"model": s.model, "data": s.data, "batch_size": s.batch_size,
            "optimizer": s.optimizer, "lr": s.lr, "workers": s.workers,
            "ranks_as": "threads" if s.threads else "processes", "target_accuracy": s.target,
            "tuning": asdict(s.tuning),
            "wall_s": wall_s, "run_dir": os.fspath(run_dir), "files": files, "runs": runs}
