"""mstar: serve composite multimodal models declared as a graph of components plus walks."""

from __future__ import annotations

from mstar.actors import Actor, ActorRef, ActorSystem, RestartPolicy, SystemConfig
from mstar.errors import GraphValidationError, MStarError, WalkDeadlockError, WalkExecutionError
from mstar.graph import (
    EMIT,
    MODALITIES,
    Connection,
    DynamicLoop,
    Emission,
    GraphEdge,
    GraphNode,
    Loop,
    ModelGraph,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    WalkStateMachine,
    run_reference,
)
from mstar.runtime import (
    AsyncEngine,
    EngineConfig,
    EngineType,
    Model,
    ModelSpec,
    Output,
    Placement,
    PreparedRequest,
    Request,
)
from mstar.streaming import (
    Chunk,
    ChunkPolicy,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
    StreamBuffer,
)

__version__ = "0.1.0"

__all__ = [
    "EMIT",
    "MODALITIES",
    "Actor",
    "ActorRef",
    "ActorSystem",
    "RestartPolicy",
    "SystemConfig",
    "AsyncEngine",
    "EngineConfig",
    "EngineType",
    "Model",
    "ModelSpec",
    "Output",
    "Placement",
    "PreparedRequest",
    "Request",
    "Chunk",
    "ChunkPolicy",
    "Connection",
    "DynamicLoop",
    "Emission",
    "FixedChunkPolicy",
    "GraphEdge",
    "GraphNode",
    "GraphValidationError",
    "LeftContextChunkPolicy",
    "Loop",
    "MStarError",
    "ModelGraph",
    "Parallel",
    "Sequential",
    "SlidingWindowChunkPolicy",
    "StreamBuffer",
    "StreamingGraphEdge",
    "WalkDeadlockError",
    "WalkExecutionError",
    "WalkStateMachine",
    "__version__",
    "run_reference",
]
