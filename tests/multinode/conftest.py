"""A local Ray cluster for the multi-node tests: three "nodes" (raylets) on this machine.

    head (the driver's node): {node_a: 4}    node b1: {node_b: 4}    node b2: {node_b: 4}

Everything binds and talks on loopback: Ray's nodes are told their address is 127.0.0.1 (and
Ray picks loopback by default, set before it is imported); mstar's rank hosts serve on their
node's address. Node failures are detected within a second (health checks every 200 ms).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # Ray's default address: loopback
ray = pytest.importorskip("ray")
cluster_utils = pytest.importorskip("ray.cluster_utils")
from ray._private import ray_constants  # noqa: E402

if ray_constants.ENABLE_RAY_CLUSTER:  # Ray was imported before the variable was set
    pytest.fail(
        "Ray would pick this machine's network address: set "
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 first"
    )

LOOPBACK = "127.0.0.1"
FAST_FAILURE_DETECTION = {
    "health_check_period_ms": 200,
    "health_check_timeout_ms": 500,
    "health_check_failure_threshold": 3,
}


@dataclass
class LocalCluster:
    """The running cluster and its nodes that host node_b."""

    cluster: Any
    b_nodes: list[Any]

    def add_b_node(self) -> Any:
        node = self.cluster.add_node(num_cpus=1, resources={"node_b": 4}, node_ip_address=LOOPBACK)
        self.b_nodes.append(node)
        return node


@pytest.fixture(scope="package")
def ray_cluster() -> Iterator[LocalCluster]:
    """Start the cluster once for the package's tests; stop it at the end."""
    cluster = cluster_utils.Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 2,
            "resources": {"node_a": 4},
            "node_ip_address": LOOPBACK,
            "include_dashboard": False,
            "_system_config": FAST_FAILURE_DETECTION,
        },
    )
    local = LocalCluster(cluster, [])
    try:
        local.add_b_node()
        local.add_b_node()
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        yield local
    finally:
        ray.shutdown()
        cluster.shutdown()
