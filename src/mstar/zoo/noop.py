"""`noop-loop`: a model that does no work, to measure the runtime's own overhead.

One walk, ``loop``: ``DynamicLoop(Sequential([a, b]), max_iters=steps, stop="stop")``; ``a``
passes a counter to ``b``, ``b`` increments it, hands it back to ``a`` and raises ``stop``
at ``steps``. Place ``a`` and ``b`` on different ranks to put a worker-to-worker round trip
in every step. ``delay_s`` makes each of ``b``'s steps take that long (requests then stay in
flight for ``steps * delay_s``, as failure tests need). ``payload_numel`` > 0 adds a float32
tensor of that many elements that ``a`` hands to ``b`` and ``b`` back to ``a`` every step
(tensor throughput between ranks).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mstar.graph import EMIT, DynamicLoop, GraphEdge, GraphNode, ModelGraph, Sequential
from mstar.runtime.model import EngineType, Model, PreparedRequest, Request

__all__ = ["NoopLoopModel"]


class NoopLoopModel(Model):
    """A ``steps``-iteration loop of no-op nodes; emits the step count at the end."""

    name = "noop-loop"

    def __init__(self, steps: int = 1000, delay_s: float = 0.0, payload_numel: int = 0) -> None:
        self.steps = steps
        self.delay_s = delay_s
        self.payload_numel = payload_numel
        p = {"p"} if payload_numel else set()
        a = GraphNode("a", {"i", *p}, [GraphEdge("b", "x"), *(GraphEdge("b", n) for n in p)])
        b_out = [GraphEdge("a", "i"), GraphEdge("done", "i"), *(GraphEdge("a", n) for n in p)]
        b = GraphNode("b", {"x", *p}, b_out, signals={"stop"})
        done = GraphNode("done", {"i"}, [GraphEdge(EMIT, "steps", modality="latent")])
        self._graph = ModelGraph(
            name=self.name,
            walks={
                "loop": Sequential(
                    [DynamicLoop(Sequential([a, b]), max_iters=steps, stop="stop"), done]
                )
            },
            partitions={"P": ["loop"]},
            inputs={"a": {"i", *p}},
        )

    def graph(self) -> ModelGraph:
        """Return the loop graph."""
        return self._graph

    def engine_types(self) -> dict[str, EngineType]:
        """Return STATELESS for every node."""
        return dict.fromkeys(self._graph.nodes, EngineType.STATELESS)

    def submodule(self, node: str, device: torch.device) -> Any:
        """Return the no-op batched callable of a node."""
        steps, delay_s = self.steps, self.delay_s

        def a(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            return [
                {"x": inputs["i"], **({"p": inputs["p"]} if "p" in inputs else {})}
                for inputs in batch
            ]

        def b(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            if delay_s:
                time.sleep(delay_s)
            return [
                {
                    "i": inputs["x"] + 1,
                    "stop": inputs["x"] + 1 >= steps,
                    **({"p": inputs["p"]} if "p" in inputs else {}),
                }
                for inputs in batch
            ]

        def done(batch: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
            return [{"steps": inputs["i"]} for inputs in batch]

        return {"a": a, "b": b, "done": done}[node]

    def tasks(self) -> tuple[str, ...]:
        """Return the one task."""
        return ("loop",)

    def preprocess(self, request: Request) -> PreparedRequest:
        """Start the counter at 0."""
        if self.payload_numel:
            return PreparedRequest({"a": {"i": 0, "p": torch.zeros(self.payload_numel)}})
        return PreparedRequest({"a": {"i": 0}})

    def first_walk(self, partition: str, state: Any) -> str | None:
        """Run the loop."""
        return "loop"

    def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
        """Then stop."""
        return None
