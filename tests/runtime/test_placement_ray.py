"""The placement file's Ray fields: resources per node group and per rank."""

from __future__ import annotations

from pathlib import Path

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
    p = Placement.from_yaml(
        "node_groups:\n  - {node_names: [a], ranks: [0], ray_resources: {x: 0}}\n"
    )
    with pytest.raises(PlacementError, match=r"ray_resources\['x'\] must be > 0"):
        p.ray_resources(0)
    with pytest.raises(PlacementError):
        Placement.from_yaml(
            "node_groups:\n  - {node_names: [a], ranks: [0]}\nrank_resources: {0: {x: nope}}\n"
        )


RAY_FILE = """
backend: ray
ray_address: ray://head:10001
node_groups:
  - {node_names: [a, b, done], ranks: [0]}
"""
RAY_FILE_NO_ADDRESS = "backend: ray\nnode_groups:\n  - {node_names: [a, b, done], ranks: [0]}\n"
LOCAL_FILE = "backend: local\nnode_groups:\n  - {node_names: [a, b, done], ranks: [0]}\n"
PLAIN_FILE = "node_groups:\n  - {node_names: [a, b, done], ranks: [0]}\n"


def test_backend_ray_names_the_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    p = Placement.from_yaml(RAY_FILE)
    assert (p.backend, p.ray_address) == ("ray", "ray://head:10001")
    assert p.cluster_address(None) == "ray://head:10001"
    # the same cluster twice is fine
    assert p.cluster_address("ray://head:10001") == "ray://head:10001"
    assert Placement.from_yaml(p.to_yaml()) == p
    bare = Placement.from_yaml(RAY_FILE_NO_ADDRESS)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert bare.cluster_address(None) == "auto"
    assert bare.cluster_address("10.0.0.1:6379") == "10.0.0.1:6379"  # the config names it
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert bare.cluster_address(None) == "10.0.0.2:6379"


def test_without_backend_the_config_decides() -> None:
    p = Placement.from_yaml(PLAIN_FILE)
    assert p.backend is None
    assert p.cluster_address(None) is None
    assert p.cluster_address("auto") == "auto"
    assert Placement.from_yaml(LOCAL_FILE).cluster_address(None) is None


def test_conflicting_settings_are_placement_errors() -> None:
    with pytest.raises(
        PlacementError,
        match=r"names the Ray cluster 'ray://head:10001' and the engine's config 'auto'",
    ):
        Placement.from_yaml(RAY_FILE).cluster_address("auto")
    with pytest.raises(PlacementError, match="backend: local"):
        Placement.from_yaml(LOCAL_FILE).cluster_address("auto")
    with pytest.raises(PlacementError, match="ray_address needs backend: ray"):
        Placement.from_yaml("ray_address: auto\n" + PLAIN_FILE)
    with pytest.raises(PlacementError, match="ray_address needs backend: ray"):
        Placement.from_yaml("backend: local\nray_address: auto\n" + PLAIN_FILE)
    with pytest.raises(PlacementError, match="backend"):
        Placement.from_yaml("backend: kubernetes\n" + PLAIN_FILE)


async def test_a_local_engine_refuses_a_ray_config_with_a_local_placement() -> None:
    from mstar.runtime import AsyncEngine, EngineConfig, ModelSpec

    spec = ModelSpec("mstar.zoo.noop:NoopLoopModel", {"steps": 2})
    with pytest.raises(PlacementError, match="backend: local"):
        await AsyncEngine.start(
            spec, Placement.from_yaml(LOCAL_FILE), EngineConfig(ray_address="auto")
        )


def test_cluster_endpoints_of_ray_addresses(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from mstar.runtime.ray_launcher import cluster_endpoint

    assert cluster_endpoint("127.0.0.1:6379") == ("127.0.0.1", 6379)
    assert cluster_endpoint("ray://head:10001") == ("head", 10001)
    assert cluster_endpoint("[::1]:6379") == ("::1", 6379)
    assert cluster_endpoint("head") is None  # left to Ray
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster_endpoint("auto") is None  # no cluster started here
    (tmp_path / "ray").mkdir()
    # what `ray start --head` leaves
    (tmp_path / "ray" / "ray_current_cluster").write_text("127.0.0.1:41234\n")
    assert cluster_endpoint("auto") == ("127.0.0.1", 41234)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    assert cluster_endpoint("auto") == ("10.0.0.2", 6379)
