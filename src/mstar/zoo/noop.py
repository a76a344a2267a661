"""`noop-loop`: a model that does no work, to measure the runtime's own overhead.

One walk, ``loop``: ``DynamicLoop(Sequential([a, b]), max_iters=steps, stop="stop")``; ``a``
passes a counter to ``b``, ``b`` increments it, hands it back to ``a`` and raises ``stop``
at ``steps``. Place ``a`` and ``b`` on different ranks to put a worker-to-worker round trip
in every step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mstar.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, ModelGraph, Sequential
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request

__all__ = ["NoopLoopModel"]


class NoopLoopModel(Model):
    """A ``steps``-iteration loop of no-op nodes; emits the step count at the end."""

    name = "noop-loop"

    def __init__(self, steps: int = 1000) -> None:
        self.steps = steps
        a = GraphNode("a", {"i"}, [GraphEdge("b", "x")])
        b = GraphNode("b", {"x"}, [GraphEdge("a", "i"), GraphEdge("done", "i")], signals={"stop"})
        done = GraphNode("done", {"i"}, [GraphEdge(EMIT, "steps", modality="latent")])
        self._graph = ModelGraph(
            name=self.name,
            walks={"loop": Sequential([DynamicLoop(Sequential([a, b]), max_iters=steps, stop="stop"), done])},
            partitions={"P": ["loop"]},
            inputs={"a": {"i"}},
        )

    def graph(self) -> ModelGraph:
        """Return the loop graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return STATELESS for every node."""
        return dict.fromkeys(self._graph.nodes, EngineType.STATELESS)

    def submodule(self, node: str, device: torch.device) -> Any:
        """Return the no-op batched callable of a node."""
        steps = self.steps

        def a(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            return [{"x": inputs["i"]} for inputs in batch]

        def b(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            return [{"i": inputs["x"] + 1, "stop": inputs["x"] + 1 >= steps} for inputs in batch]

        def done(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            return [{"steps": inputs["i"]} for inputs in batch]

        return {"a": a, "b": b, "done": done}[node]

    def tasks(self) -> tuple[str, ...]:
        """Return the one task."""
        return ("loop",)

    def preprocess(self, request: Request) -> PreparedRequest:
        """Start the counter at 0."""
        return PreparedRequest({"a": {"i": 0}})

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Run the loop."""
        return "loop"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Then stop."""
        return None
