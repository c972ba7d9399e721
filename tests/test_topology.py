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
