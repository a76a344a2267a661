"""The walk-graph API: nodes, edges, walk primitives, `ModelGraph`, reference interpreter."""

from __future__ import annotations

from mstar.graph.interpreter import (
    Emission,
    NodeFn,
    WalkStateMachine,
    accumulated_edges,
    concat_values,
    run_reference,
)
from mstar.graph.model_graph import Connection, ModelGraph
from mstar.graph.nodes import EMIT, MODALITIES, Edge, GraphEdge, GraphNode, StreamingGraphEdge
from mstar.graph.walks import DynamicLoop, Loop, Parallel, Section, Sequential, iter_node_refs

__all__ = [
    "EMIT",
    "MODALITIES",
    "Connection",
    "DynamicLoop",
    "Edge",
    "Emission",
    "GraphEdge",
    "GraphNode",
    "Loop",
    "ModelGraph",
    "NodeFn",
    "Parallel",
    "Section",
    "Sequential",
    "StreamingGraphEdge",
    "WalkStateMachine",
    "accumulated_edges",
    "concat_values",
    "iter_node_refs",
    "run_reference",
]
