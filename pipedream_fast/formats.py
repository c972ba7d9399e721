"""The two files the flow hands along: the Profile and the Plan.

    nn.Module --profile--> Profile (JSON) --plan--> Plan (JSON) --> schedule / runtime / simulator

Both are plain dataclasses with a versioned JSON form. Loading checks the format tag and every
fixed field, and fails with a `FormatError` that names the file, the field and the fix. Fields
not listed here are kept in `extra` and written back unchanged, so newer writers can add
information without breaking older readers.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Sequence
from typing import Any
from collections.abc import Mapping

PROFILE_FORMAT = "pipedream_fast.profile/1"
PLAN_FORMAT = "pipedream_fast.plan/1"


class FormatError(ValueError):
    """A Profile or Plan file (or object) is malformed, of another version, or inconsistent."""


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""


def _require(data: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str,
             source: str | None) -> Any:
    if key not in data:
        raise FormatError(f"{what}{_where(source)} is missing the field {key!r}")
    value = data[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int subclass; a true/false where a number belongs is a mistake, not a 1/0.
    if isinstance(value, bool) and bool not in kinds:
        raise FormatError(f"{what}{_where(source)}: field {key!r} must be "
                          f"{'/'.join(k.__name__ for k in kinds)}, got a boolean")
    if float in kinds and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kinds):
        raise FormatError(f"{what}{_where(source)}: field {key!r} must be "
                          f"{'/'.join(k.__name__ for k in kinds)}, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise FormatError(f"{what}{_where(source)}: field {key!r} must be finite, got {value}")
    return value


def _check_format(data: Any, expected: str, what: str, source: str | None) -> None:
    if not isinstance(data, dict):
        raise FormatError(f"{what}{_where(source)} must be a JSON object, got {type(data).__name__}")
    tag = data.get("format")
    if tag != expected:
        raise FormatError(
            f"{what}{_where(source)} has format {tag!r}, expected {expected!r}; "
            f"regenerate it with this version of pipedream-fast")


def _read_json(path: str | os.PathLike[str], what: str) -> Any:
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise FormatError(f"cannot read {what} file {os.fspath(path)!r}: {err.strerror}") from err
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise FormatError(f"{what} file {os.fspath(path)!r} is not valid JSON "
                          f"(line {err.lineno}, column {err.colno}: {err.msg})") from err


def _write_json(path: str | os.PathLike[str], data: dict[str, Any]) -> None:
    # Write to a temporary file and rename, so a crash never leaves half a file behind.
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, target)


@dataclass(frozen=True)
class BlockProfile:
    """Measured costs of one block of the layer chain (times per minibatch, in ms)."""

    name: str
    forward_ms: float
    backward_ms: float
    activation_bytes: int  # all tensors crossing the cut after this block, per minibatch
    parameter_bytes: int
    optimizer_state_bytes: int
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    _FIXED = ("name", "forward_ms", "backward_ms", "activation_bytes", "parameter_bytes",
              "optimizer_state_bytes")

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self._FIXED}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Any, index: int, source: str | None = None) -> BlockProfile:
        what = f"profile block {index}"
        if not isinstance(data, dict):
            raise FormatError(f"{what}{_where(source)} must be a JSON object")
        name = _require(data, "name", str, what, source)
        values: dict[str, Any] = {}
        for key in ("forward_ms", "backward_ms"):
            values[key] = _require(data, key, float, what, source)
        for key in ("activation_bytes", "parameter_bytes", "optimizer_state_bytes"):
            values[key] = _require(data, key, int, what, source)
        for key, value in values.items():
            if value < 0:
                raise FormatError(f"{what} ({name}){_where(source)}: {key} must be >= 0, got {value}")
        extra = {k: v for k, v in data.items() if k not in cls._FIXED}
        return cls(name=name, extra=extra, **values)


@dataclass
class Profile:
    """Per-block costs of a model at one batch size on one device."""

    model: str
    batch_size: int
    device: str
    blocks: list[BlockProfile]
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.blocks:
            raise FormatError(f"profile of {self.model!r} has no blocks")
        if self.batch_size <= 0:
            raise FormatError(f"profile of {self.model!r}: batch_size must be > 0, got {self.batch_size}")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"format": PROFILE_FORMAT, "model": self.model,
                               "batch_size": self.batch_size, "device": self.device,
                               "blocks": [b.to_dict() for b in self.blocks]}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> Profile:
        _check_format(data, PROFILE_FORMAT, "profile", source)
        model = _require(data, "model", str, "profile", source)
        batch_size = _require(data, "batch_size", int, "profile", source)
        device = _require(data, "device", str, "profile", source)
        raw_blocks = _require(data, "blocks", list, "profile", source)
        blocks = [BlockProfile.from_dict(b, i, source) for i, b in enumerate(raw_blocks)]
        fixed = {"format", "model", "batch_size", "device", "blocks"}
        extra = {k: v for k, v in data.items() if k not in fixed}
        return cls(model=model, batch_size=batch_size, device=device, blocks=blocks, extra=extra)

    def save(self, path: str | os.PathLike[str]) -> None:
        _write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Profile:
        return cls.from_dict(_read_json(path, "profile"), source=os.fspath(path))


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: the half-open block range [start, stop) and the ranks replicating it."""

    start: int
    stop: int
    replicas: int
    ranks: tuple[int, ...]
    predicted_ms: float
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    _FIXED = ("start", "stop", "replicas", "ranks", "predicted_ms")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"start": self.start, "stop": self.stop, "replicas": self.replicas,
                               "ranks": list(self.ranks), "predicted_ms": self.predicted_ms}
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Any, index: int, source: str | None = None) -> StagePlan:
        what = f"plan stage {index}"
        if not isinstance(data, dict):
            raise FormatError(f"{what}{_where(source)} must be a JSON object")
        ranks = _require(data, "ranks", list, what, source)
        if not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks):
            raise FormatError(f"{what}{_where(source)}: ranks must be a list of integers")
        extra = {k: v for k, v in data.items() if k not in cls._FIXED}
        return cls(start=_require(data, "start", int, what, source),
                   stop=_require(data, "stop", int, what, source),
                   replicas=_require(data, "replicas", int, what, source),
                   ranks=tuple(ranks),
                   predicted_ms=_require(data, "predicted_ms", float, what, source),
                   extra=extra)


@dataclass
class Plan:
    """Stages, replicas and ranks for one profile, schedule and worker count."""

    model: str
    batch_size: int
    workers: int
    schedule: str
    stages: list[StagePlan]
    bottleneck_ms: float
    data_parallel_ms: float
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def speedup_vs_data_parallel(self) -> float:
        return self.data_parallel_ms / self.bottleneck_ms if self.bottleneck_ms > 0 else math.inf

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def describe(self, names: Sequence[str] | None = None) -> str:
        """The plan in one line: '2 stages: conv1..pool on rank 0 | fc1..fc2 on rank 1', with
        the blocks' `names` where given (else 'blocks 0-2')."""
        def blocks(start: int, stop: int) -> str:
            if names and len(names) >= stop:
                return names[start] if stop - start == 1 else f"{names[start]}..{names[stop - 1]}"
            return f"blocks {start}-{stop - 1}"

        parts = [f"{blocks(st.start, st.stop)} on rank{'s' if len(st.ranks) > 1 else ''} "
                 f"{','.join(map(str, st.ranks))}"
                 + (" (recomputing)" if st.extra.get("recompute") else "") for st in self.stages]
        return f"{self.num_stages} stage{'s' if self.num_stages > 1 else ''}: " + " | ".join(parts)

    def stages_of_rank(self, rank: int) -> tuple[int, ...]:
        """The stages a rank holds (several in interleaved placements)."""
        stages = tuple(i for i, stage in enumerate(self.stages) if rank in stage.ranks)
        if not stages:
            raise FormatError(f"rank {rank} is in no stage of the plan (workers: {self.workers})")
        return stages

    def validate(self, source: str | None = None) -> None:
        """Stages tile the blocks from 0 without gaps; every rank 0..workers-1 holds at least
        one stage, and no stage lists a rank twice (a rank may hold several stages)."""
        if not self.stages:
            raise FormatError(f"plan{_where(source)} has no stages")
        expected_start = 0
        seen: set[int] = set()
        for index, stage in enumerate(self.stages):
            if stage.start != expected_start or stage.stop <= stage.start:
                raise FormatError(
                    f"plan stage {index}{_where(source)} covers blocks [{stage.start}, {stage.stop}) "
                    f"but must start at block {expected_start} and be non-empty")
            if stage.replicas < 1 or len(stage.ranks) != stage.replicas:
                raise FormatError(
                    f"plan stage {index}{_where(source)} has replicas={stage.replicas} "
                    f"but {len(stage.ranks)} ranks {list(stage.ranks)}")
            if len(set(stage.ranks)) != len(stage.ranks):
                raise FormatError(f"plan stage {index}{_where(source)} lists a rank twice: "
                                  f"{list(stage.ranks)}")
            seen.update(stage.ranks)
            expected_start = stage.stop
        if seen != set(range(self.workers)):
            raise FormatError(
                f"plan{_where(source)} declares workers={self.workers} but its stages use ranks "
                f"{sorted(seen)}; every rank 0..{self.workers - 1} must hold a stage")

    def check_matches(self, profile: Profile) -> None:
        """Raise unless this plan was made for `profile` (same model, batch size, block count)."""
        if (self.model, self.batch_size) != (profile.model, profile.batch_size):
            raise FormatError(
                f"plan was made for model {self.model!r} at batch size {self.batch_size}, "
                f"but the profile is of {profile.model!r} at batch size {profile.batch_size}; "
                f"re-run `pipedream-fast plan` on this profile")
        if self.stages[-1].stop != len(profile.blocks):
            raise FormatError(
                f"plan covers {self.stages[-1].stop} blocks but the profile of {profile.model!r} "
                f"has {len(profile.blocks)}; re-run `pipedream-fast plan` on this profile")

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PLAN_FORMAT,
            "profile": {"model": self.model, "batch_size": self.batch_size},
            "workers": self.workers, "schedule": self.schedule,
            "stages": [s.to_dict() for s in self.stages],
            "predicted": {"bottleneck_ms": self.bottleneck_ms,
                          "data_parallel_ms": self.data_parallel_ms,
                          "speedup_vs_data_parallel": self.speedup_vs_data_parallel},
        }
        out.update(self.extra)
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str | None = None) -> Plan:
        _check_format(data, PLAN_FORMAT, "plan", source)
        prof = _require(data, "profile", dict, "plan", source)
        predicted = _require(data, "predicted", dict, "plan", source)
        raw_stages = _require(data, "stages", list, "plan", source)
        fixed = {"format", "profile", "workers", "schedule", "stages", "predicted"}
        plan = cls.__new__(cls)
        plan.model = _require(prof, "model", str, "plan.profile", source)
        plan.batch_size = _require(prof, "batch_size", int, "plan.profile", source)
        plan.workers = _require(data, "workers", int, "plan", source)
        plan.schedule = _require(data, "schedule", str, "plan", source)
        plan.stages = [StagePlan.from_dict(s, i, source) for i, s in enumerate(raw_stages)]
        plan.bottleneck_ms = _require(predicted, "bottleneck_ms", float, "plan.predicted", source)
        plan.data_parallel_ms = _require(predicted, "data_parallel_ms", float, "plan.predicted", source)
        plan.extra = {k: v for k, v in data.items() if k not in fixed}
        plan.validate(source)
        return plan

    def save(self, path: str | os.PathLike[str]) -> None:
        _write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Plan:
        return cls.from_dict(_read_json(path, "plan"), source=os.fspath(path))
