"""`Tuning`: every knob is validated, reaches the core, and changes speed, never results.

Threads (LocalPipeline) are checked in this process; processes (Pipeline over the CommEngine)
in one 2-rank launch that trains every configuration it needs.
"""

from __future__ import annotations

import dataclasses
import os
import json

from typing import Any

import pytest
import torch
from torch import nn

from pipedream_fast import LocalPipeline, Tuning, TuningError, _C
from pipedream_fast.cli import UsageError, build_parser, main
from pipedream_fast.commands.train import settings
from pipedream_fast.formats import Plan, StagePlan
from pipedream_fast.launch import launch
from pipedream_fast.pipeline import Pipeline
from pipedream_fast.runtime import transport
from pipedream_fast.runtime.buckets import DEFAULT_BUCKET_BYTES
from pipedream_fast.runtime.transport import ACTIVATION, ThreadHub
from pipedream_fast.training import build_schedule

STEPS, CHUNKS, BATCH = 4, 2, 8
OFFLOAD_MESSAGE = ("offload_stash moves stashed weight versions to pinned host memory; it needs "
                   "device='cuda'")


def mlp() -> nn.Sequential:
    """Seven blocks, about 38 KiB of weights: several 0.01 MiB buckets, one default one."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def plan_of(*stages: tuple[int, int, tuple[int, ...]]) -> Plan:
    workers = len({r for _, _, ranks in stages for r in ranks})
    return Plan("mlp", BATCH, workers, "1f1b",
                [StagePlan(a, b, len(ranks), ranks, 1.0) for a, b, ranks in stages], 1.0, 1.0)


TWO_STAGES = plan_of((0, 3, (0,)), (3, 7, (1,)))
FIRST_REPLICATED = plan_of((0, 3, (0, 1)), (3, 7, (2,)))
DATA_PARALLEL = plan_of((0, 7, (0, 1)))


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 16, generator=g), torch.randint(0, 5, (BATCH,), generator=g))
            for _ in range(STEPS)]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, target)


def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def slots_needed(plan: Plan, schedule: str) -> int:
    return max(build_schedule(plan, schedule, STEPS, CHUNKS).max_versions)


def every_knob(plan: Plan, schedule: str) -> Tuning:
    """Every knob away from its default (offload_stash needs a GPU)."""
    return Tuning(queue_depth=1, spin_us=50.0, bucket_mb=0.01,
                  weight_slots=slots_needed(plan, schedule) + 2, recv_pool=1, link_threads=True,
                  io_priority="idle", cpu_cache_mb=0.0)


def assert_same_run(got: tuple[list[float], dict], want: tuple[list[float], dict]) -> None:
    assert got[0] == want[0]
    assert set(got[1]) == set(want[1])
    for name, value in want[1].items():
        assert torch.equal(got[1][name], value), name


# --- validation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, words", [
    ("queue_depth", 0, "queue_depth must be an integer >= 1"),
    ("queue_depth", 2.5, "queue_depth must be an integer >= 1"),
    ("queue_depth", True, "queue_depth must be an integer >= 1"),
    ("spin_us", -1.0, "spin_us must be a finite number of microseconds >= 0"),
    ("spin_us", float("inf"), "spin_us must be a finite number of microseconds >= 0"),
    ("bucket_mb", 0.0, "bucket_mb must be a positive finite size in MiB"),
    ("bucket_mb", float("nan"), "bucket_mb must be a positive finite size in MiB"),
    ("weight_slots", 0, "weight_slots must be an integer >= 1, or None"),
    ("recv_pool", 0, "recv_pool must be an integer >= 1"),
    ("recv_pool", None, "recv_pool must be an integer >= 1"),
    ("offload_stash", "yes", "offload_stash must be True or False"),
    ("link_threads", 1, "link_threads must be True or False"),
    ("transfer_runs", "no", "transfer_runs must be True or False"),
    ("split_channels", "yes", "split_channels must be True or False"),
    ("io_priority", "high", "io_priority must be one of auto, normal, low, idle"),
    ("cpu_cache_mb", -1.0, "cpu_cache_mb must be a finite size in MiB >= 0"),
    ("cpu_cache_mb", float("inf"), "cpu_cache_mb must be a finite size in MiB >= 0"),
])
def test_a_bad_value_is_refused_naming_the_knob_and_the_value(field, value, words):
    with pytest.raises(TuningError) as info:
        Tuning(**{field: value})
    assert words in str(info.value) and f"got {value!r}" in str(info.value)
    assert info.value.field == field and isinstance(info.value, ValueError)


def test_the_defaults_are_what_the_runtime_does_without_tuning():
    tuning = Tuning()
    assert tuning.process_queue_depth == _C.CommEngine.DEFAULT_DEPTH == 8
    assert tuning.thread_queue_depth == transport.THREAD_QUEUE_DEPTH == 64
    assert (tuning.spin_us, tuning.weight_slots, tuning.offload_stash) == (0.0, None, False)
    assert tuning.link_threads is False
    assert tuning.io_priority == "auto"
    assert tuning.bucket_bytes == DEFAULT_BUCKET_BYTES
    assert tuning.recv_pool == _C.CommEngine.DEFAULT_RECV_POOL == 64
    assert Tuning(bucket_mb=0.5).bucket_bytes == 512 * 1024
    with pytest.raises(dataclasses.FrozenInstanceError):
        tuning.spin_us = 1.0  # type: ignore[misc]


def test_offload_stash_needs_weights_on_a_gpu():
    Tuning(offload_stash=True).check_device(torch.device("cuda", 0))
    with pytest.raises(TuningError, match=OFFLOAD_MESSAGE):
        LocalPipeline(mlp(), loss_fn, sgd, TWO_STAGES, tuning=Tuning(offload_stash=True))


# --- threads ------------------------------------------------------------------------------------

def test_thread_hub_queues_get_the_depth_and_the_spin(monkeypatch):
    made = []

    def recording_queue(capacity: int, name: str, spin_us: float = 0.0) -> _C.ActivationQueue:
        made.append((capacity, spin_us))
        return real_queue(capacity, name, spin_us)

    real_queue = _C.ActivationQueue
    monkeypatch.setattr(_C, "ActivationQueue", recording_queue)
    assert ThreadHub(2, 5.0, depth=2, spin_us=7.5).queue(0, 1, ACTIVATION, 1).capacity == 2
    assert ThreadHub(2, 5.0).queue(0, 1, ACTIVATION, 1).capacity == 64
    assert made == [(2, 7.5), (64, 0.0)]


def train_threads(plan: Plan, schedule: str, tuning: Tuning, monkeypatch: pytest.MonkeyPatch
                  ) -> tuple[tuple[list[float], dict], LocalPipeline, list[ThreadHub]]:
    hubs: list[ThreadHub] = []

    class RecordedHub(ThreadHub):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            hubs.append(self)

    monkeypatch.setattr("pipedream_fast.world.ThreadHub", RecordedHub)
    pipe = LocalPipeline(mlp(), loss_fn, sgd, plan, schedule=schedule, chunks=CHUNKS,
                         timeout=60, tuning=tuning)
    losses = [float(loss) for loss in pipe.train(batches(), STEPS)]
    return (losses, pipe.state_dict()), pipe, hubs


def thread_runtimes(pipe: LocalPipeline) -> dict[tuple[int, int], Any]:
    """Every rank thread's stage runtimes, by (stage, rank)."""
    return {(i, r): rt for r, p in enumerate(pipe._ranks) for i, rt in p._stages.runtimes.items()}


def test_every_knob_reaches_the_threads_and_none_changes_the_results(monkeypatch):
    tuned = every_knob(FIRST_REPLICATED, "pipedream")
    want, plain, _ = train_threads(FIRST_REPLICATED, "pipedream", Tuning(), monkeypatch)
    got, pipe, hubs = train_threads(FIRST_REPLICATED, "pipedream", tuned, monkeypatch)
    assert_same_run(got, want)
    assert (hubs[0].depth, hubs[0].spin_us) == (1, 50.0)
    rings = {key: rt.ring.capacity for key, rt in thread_runtimes(pipe).items()}
    assert set(rings.values()) == {tuned.weight_slots}
    buckets = {key: rt.buckets.num_buckets for key, rt in thread_runtimes(pipe).items()
               if rt.buckets}
    default_buckets = {key: rt.buckets.num_buckets
                       for key, rt in thread_runtimes(plain).items() if rt.buckets}
    assert set(buckets) == set(default_buckets) == {(0, 0), (0, 1)}  # stage 0's replicas
    assert set(default_buckets.values()) == {1} and min(buckets.values()) > 1


def test_fewer_weight_slots_than_the_schedule_keeps_are_refused():
    need = slots_needed(TWO_STAGES, "pipedream")
    assert need >= 2
    pipe = LocalPipeline(mlp(), loss_fn, sgd, TWO_STAGES, schedule="pipedream", chunks=CHUNKS,
                         tuning=Tuning(weight_slots=need - 1))
    with pytest.raises(ValueError, match=f"weight_slots={need - 1} is too few: schedule "
                                         f"'pipedream' keeps {need} weight versions"):
        next(pipe.train(batches(), STEPS))


# --- processes ----------------------------------------------------------------------------------

def io_policies() -> list[int]:
    """The scheduling policies of this process's gloo I/O threads."""
    found = set()
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == transport.GLOO_IO_THREAD:
                found.add(os.sched_getscheduler(int(tid)))
    return sorted(found)


def process_job(rank: int, world: int) -> dict:
    """Each plan with the default knobs and with every knob changed: the losses, the weights
    and what reached the core; then the refused offload."""
    out: dict = {}
    for plan, schedule in ((TWO_STAGES, "pipedream"), (DATA_PARALLEL, "data-parallel")):
        for label, tuning in (("default", Tuning()), ("tuned", every_knob(plan, schedule))):
            pipe = Pipeline(mlp(), loss_fn, sgd, plan=plan, schedule=schedule, chunks=CHUNKS,
                            timeout=60, tuning=tuning)
            losses = [float(loss) for loss in pipe.train(batches(), STEPS)]
            engine = pipe._stages.transport._engine
            out[(schedule, label)] = {
                "run": (losses, pipe.state_dict()),
                "engine": (engine.depth, engine.spin_us, engine.recv_pool, engine.background),
                "io": io_policies(), "threads": torch.get_num_threads(),
                "cpu_cache": _C.cpu_cache_stats()["installed"],
                "rings": {i: rt.ring.capacity for i, rt in pipe._stages.runtimes.items()},
                "buckets": {i: rt.buckets.num_buckets for i, rt in pipe._stages.runtimes.items()
                            if rt.buckets}}
            pipe.close()
    try:
        Pipeline(mlp(), loss_fn, sgd, plan=TWO_STAGES, device="cpu",
                 tuning=Tuning(offload_stash=True))
    except TuningError as err:
        out["offload"] = str(err)
    return out


@pytest.fixture(scope="module")
def process_runs() -> list[dict]:
    return launch(process_job, 2, timeout=120)


@pytest.mark.parametrize("plan, schedule", [(TWO_STAGES, "pipedream"),
                                            (DATA_PARALLEL, "data-parallel")])
def test_every_knob_changes_the_speed_of_processes_never_their_results(process_runs, plan,
                                                                        schedule):
    for rank_out in process_runs:
        default, tuned = rank_out[(schedule, "default")], rank_out[(schedule, "tuned")]
        if rank_out is process_runs[0]:  # the gathered state lives on rank 0
            assert_same_run(tuned["run"], default["run"])
        else:
            assert tuned["run"][0] == default["run"][0]


@pytest.mark.parametrize("plan, schedule", [(TWO_STAGES, "pipedream"),
                                            (DATA_PARALLEL, "data-parallel")])
def test_every_knob_reaches_the_comm_engine_rings_and_buckets(process_runs, plan, schedule):
    tuning = every_knob(plan, schedule)
    for rank_out in process_runs:
        default, tuned = rank_out[(schedule, "default")], rank_out[(schedule, "tuned")]
        assert default["engine"] == (8, 0.0, 64, False)
        assert tuned["engine"] == (tuning.queue_depth, tuning.spin_us, tuning.recv_pool, True)
        if schedule == "pipedream":  # the process's first run: no thread tuned before it
            # auto: idle for a rank of one compute thread
            assert default["io"] == [os.SCHED_IDLE if default["threads"] == 1
                                     else os.SCHED_OTHER]
        assert os.SCHED_IDLE in tuned["io"]  # the run's I/O threads, at least
        assert set(tuned["rings"].values()) == {tuning.weight_slots}
        assert default["cpu_cache"] and not tuned["cpu_cache"]  # cpu_cache_mb=0: off
        if schedule == "data-parallel":  # the replicated stage's buckets
            assert default["buckets"] == {0: 1} and tuned["buckets"][0] > 1


def test_a_pipeline_on_the_cpu_refuses_offload_stash(process_runs):
    assert all(OFFLOAD_MESSAGE in rank_out["offload"] for rank_out in process_runs)


# --- command line -------------------------------------------------------------------------------

def test_the_tuning_flags_parse_into_the_tuning():
    args = build_parser().parse_args(["train", "--queue-depth", "2", "--spin-us", "50",
                                      "--bucket-mb", "0.5", "--weight-slots", "3",
                                      "--recv-pool", "4", "--link-threads",
                                      "--io-priority", "idle", "--python-transfers",
                                      "--split-channels", "--cpu-cache-mb", "64"])
    assert settings(args).tuning == Tuning(queue_depth=2, spin_us=50.0, bucket_mb=0.5,
                                           weight_slots=3, recv_pool=4, link_threads=True,
                                           io_priority="idle", transfer_runs=False,
                                           split_channels=True, cpu_cache_mb=64.0)
    assert settings(build_parser().parse_args(["train"])).tuning == Tuning()


# One value away from the default for every field: the flags a report prints for it must
# parse back into it (a report once printed `--transfer-runs 0`, no flag of `train`, and
# crashed on `--io-priority idle`).
AWAY_FROM_DEFAULT = {"queue_depth": 2, "spin_us": 7.5, "bucket_mb": 0.5, "weight_slots": 3,
                     "recv_pool": 4, "offload_stash": True, "link_threads": True,
                     "io_priority": "idle", "transfer_runs": False, "split_channels": True,
                     "cpu_cache_mb": 64.0}


def test_the_flags_a_report_prints_parse_back_into_the_tuning():
    from pipedream_fast.commands.train_report import _changed_knobs
    from pipedream_fast.commands.train_settings import _tuning, tuning_flags

    assert set(AWAY_FROM_DEFAULT) == {f.name for f in dataclasses.fields(Tuning)}
    for name, value in AWAY_FROM_DEFAULT.items():
        tuning = Tuning(**{name: value})
        flags = tuning_flags(tuning)
        assert len(flags) == 1, (name, flags)
        args = build_parser().parse_args(["train", *flags[0].split()])
        assert _tuning(args, on_gpus=True) == tuning, (name, flags)
        assert _changed_knobs(tuning) == flags[0]
    everything = Tuning(**AWAY_FROM_DEFAULT)
    argv = [word for flag in tuning_flags(everything) for word in flag.split()]
    assert _tuning(build_parser().parse_args(["train", *argv]), on_gpus=True) == everything
    assert tuning_flags(Tuning()) == []


@pytest.mark.parametrize("flags, words", [
    (["--queue-depth", "0"], "--queue-depth: queue_depth must be an integer >= 1"),
    (["--bucket-mb", "-1"], "--bucket-mb: bucket_mb must be a positive finite size"),
    (["--recv-pool", "0"], "--recv-pool: recv_pool must be an integer >= 1"),
    (["--cpu-cache-mb", "-5"], "--cpu-cache-mb: cpu_cache_mb must be a finite size in MiB"),
    (["--threads", "2", "--offload-stash"], f"--offload-stash: {OFFLOAD_MESSAGE}"),
])
def test_a_bad_tuning_flag_is_reported_under_its_flag(flags, words):
    with pytest.raises(UsageError) as info:
        settings(build_parser().parse_args(["train", *flags]))
    assert words in str(info.value)


def test_a_train_run_records_its_tuning(tmp_path):
    out = tmp_path / "run"
    assert main(["train", "--model", "mlp", "--threads", "2", "--steps", "2", "--batch-size",
                 "8", "--trace-steps", "0", "--queue-depth", "2", "--spin-us", "5",
                 "--weight-slots", "4", "--out", str(out)]) == 0
    recorded = json.loads((out / "summary.json").read_text())["tuning"]
    assert Tuning(**recorded) == Tuning(queue_depth=2, spin_us=5.0, weight_slots=4)
    assert "--queue-depth 2, --spin-us 5, --weight-slots 4" in (out / "summary.txt").read_text()


def test_the_knobs_benchmark_sweeps_every_knob():
    # A knob added without a measurement leaves TUNING.md's advice unbacked.
    import re
    from pathlib import Path

    source = (Path(__file__).resolve().parent.parent / "bench" / "knobs.py").read_text()
    swept = set(re.findall(r'Knob\("(\w+)"', source))
    assert swept == {f.name for f in dataclasses.fields(Tuning)}, \
        "bench/knobs.py should sweep every Tuning field"
