"""Topology: parsing the CLI shorthand, group sizes, bandwidth between ranks, errors."""

from __future__ import annotations

import math

import pytest

from pipedream_fast.topology import Level, Topology, TopologyError


def test_parse_two_levels() -> None:
    topo = Topology.parse("4x12.5e9,4x1.25e9")
    assert topo.levels == (Level(4, 12.5e9), Level(4, 1.25e9))
    assert topo.workers == 16 and topo.group_size(0) == 4 and topo.group_size(1) == 16
    assert topo.memory_per_worker is None


def test_bandwidth_between_follows_contiguous_groups() -> None:
    topo = Topology.parse("4x12.5e9,4x1.25e9")
    assert topo.bandwidth_between(0, 3) == 12.5e9
    assert topo.bandwidth_between(3, 4) == 1.25e9
    assert topo.bandwidth_between(5, 5) == math.inf
    assert topo.slowest_bandwidth([4, 5, 6]) == 12.5e9
    assert topo.slowest_bandwidth([0, 15]) == 1.25e9
    assert topo.slowest_bandwidth([7]) == math.inf
    with pytest.raises(TopologyError, match="outside"):
        topo.bandwidth_between(0, 16)


def test_slowest_bandwidth_is_the_slowest_link_between_any_two_ranks() -> None:
    # An inner level slower than the outer one: ranks 1, 2, 3 cross 2-3 at 1 GB/s, though
    # rank 1 reaches both others at 4 GB/s.
    topo = Topology.parse("2x1e9,2x4e9")
    assert topo.slowest_bandwidth([1, 2, 3]) == 1e9
    assert topo.slowest_bandwidth([3, 1, 2]) == 1e9
    assert topo.slowest_bandwidth([1, 2]) == 4e9
    assert topo.slowest_bandwidth([0, 2]) == 4e9
    assert topo.slowest_bandwidth([2, 2]) == math.inf
    three = Topology.parse("2x1e9,2x2.5e10,2x4e9")
    assert three.slowest_bandwidth([1, 2, 5]) == 4e9   # 1-2 at level 1, 2-5 and 1-5 at 2
    assert three.slowest_bandwidth([1, 2, 4, 5]) == 1e9   # 4-5 share a pair of level 0
    for ranks in ([1, 2, 3], [0, 4, 5, 7], list(range(8))):
        assert three.slowest_bandwidth(ranks) == min(
            three.bandwidth_between(a, b) for a in ranks for b in ranks if a != b)
    with pytest.raises(TopologyError, match="outside"):
        three.slowest_bandwidth([0, 8])


def test_round_trip_and_str() -> None:
    topo = Topology.parse("2x1e10,3x1e9", memory_per_worker=8 * 2**30)
    assert Topology.from_dict(topo.to_dict()) == topo
    assert Topology.parse(str(topo), topo.memory_per_worker) == topo


@pytest.mark.parametrize("text, message", [
    ("4x0", "bandwidth must be a positive"),
    ("4x-1e9", "bandwidth must be a positive"),
    ("4xinf", "bandwidth must be a positive"),
    ("0x1e9", "worker count must be a positive"),
    ("4", "expected COUNTxBANDWIDTH"),
    ("ax1e9", "expected COUNTxBANDWIDTH"),
    ("4x1e9,", "expected COUNTxBANDWIDTH"),
])
def test_bad_shorthand(text: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology.parse(text)


def test_non_positive_memory() -> None:
    with pytest.raises(TopologyError, match="memory per worker"):
        Topology.parse("2x1e9", memory_per_worker=0)


def test_malformed_dict() -> None:
    with pytest.raises(TopologyError, match="malformed topology"):
        Topology.from_dict({"levels": [{"workers": 2}]})


def test_per_worker_speeds_and_memory() -> None:
    topo = Topology.parse("2x1e10,2x1e9@speeds=1,1,0.5,0.5@memory=8e9,8e9,4e9,4e9",
                          memory_per_worker=6 * 10**9)
    assert topo.speeds == (1.0, 1.0, 0.5, 0.5) and topo.memories == (8 * 10**9,) * 2 + (4 * 10**9,) * 2
    assert topo.heterogeneous and topo.speed_of(2) == 0.5
    assert [topo.memory_of(r) for r in range(4)] == [6 * 10**9] * 2 + [4 * 10**9] * 2
    assert Topology.from_dict(topo.to_dict()) == topo
    assert Topology.parse(str(topo), topo.memory_per_worker) == topo
    # Options absent, or all workers alike: what the topology was before.
    assert Topology.parse("4x1e9").to_dict() == {"levels": [{"workers": 4, "bandwidth": 1e9}]}
    assert not Topology.parse("2x1e9@speeds=1,1@memory=5,5").heterogeneous


@pytest.mark.parametrize("text, message", [
    ("2x1e9@speeds=1", r"topology speeds: expected one value per worker \(2\), got 1"),
    ("2x1e9@speeds=1,fast", r"cannot read value 'fast' \(rank 1\) of topology option 'speeds'"),
    ("2x1e9@speeds=1,0", "topology speeds: the value of rank 1 must be a positive"),
    ("2x1e9@speeds=1,nan", "topology speeds: the value of rank 1 must be a positive"),
    ("2x1e9@memory=8e9,-1", "topology memory: the value of rank 1 must be a positive"),
    ("2x1e9@memory=8e9,1.5", "whole bytes per worker"),
    ("2x1e9@speed=1,1", r"cannot read topology option 'speed=1,1'"),
    ("2x1e9@speeds", r"cannot read topology option 'speeds'"),
    ("2x1e9@speeds=1,1@speeds=1,1", "option 'speeds' is given twice"),
    ("2y1e9@speeds=1,1", r"cannot read topology level '2y1e9'"),
])
def test_bad_per_worker_options(text: str, message: str) -> None:
    with pytest.raises(TopologyError, match=message):
        Topology.parse(text)


def test_malformed_per_worker_dict() -> None:
    with pytest.raises(TopologyError, match="one value per worker"):
        Topology.from_dict({"levels": [{"workers": 2, "bandwidth": 1e9}], "speeds": [1.0]})
    with pytest.raises(TopologyError, match="malformed topology"):
        Topology.from_dict({"levels": [{"workers": 2, "bandwidth": 1e9}], "speeds": ["x", 1]})
