"""The placement file's Ray fields: resources per node group and per rank."""

from __future__ import annotations

import pytest

from mstar.errors import PlacementError
from mstar.runtime import Placement

SPREAD = """
model: noop-loop
node_groups:
  - {node_names: [a, done], ranks: [0, 1], ray_resources: {node_a: 0.5}}
  - {node_names: [b], ranks: [2], ray_resources: {node_b: 1, gpu_box: 2}}
rank_resources: {1: {node_c: 1, node_a: 1}}
"""


def test_resources_per_group_and_per_rank() -> None:
    p = Placement.from_yaml(SPREAD)
    assert p.ray_resources(0) == {"node_a": 0.5}
    assert p.ray_resources(1) == {"node_a": 1.0, "node_c": 1.0}  # the larger amount wins
    assert p.ray_resources(2) == {"node_b": 1.0, "gpu_box": 2.0}
    assert p.ray_resources(7) == {}
    again = Placement.from_yaml(p.to_yaml())
    assert again == p


def test_bad_amounts_are_placement_errors() -> None:
    p = Placement.from_yaml("node_groups:\n  - {node_names: [a], ranks: [0], ray_resources: {x: 0}}\n")
    with pytest.raises(PlacementError, match=r"ray_resources\['x'\] must be > 0"):
        p.ray_resources(0)
    with pytest.raises(PlacementError):
        Placement.from_yaml("node_groups:\n  - {node_names: [a], ranks: [0]}\nrank_resources: {0: {x: nope}}\n")
