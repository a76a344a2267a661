"""WalkRunner: a walk split over several ranks computes exactly what the reference does."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import pytest
import torch

from mstar.graph import (
    EMIT,
    DynamicLoop,
    Emission,
    GraphEdge,
    GraphNode,
    Loop,
    ModelGraph,
    NodeFn,
    Parallel,
    Sequential,
    StreamingGraphEdge,
    run_reference,
)
from mstar.runtime.walk_runner import ValueKey, WalkRunner
from mstar.zoo.toy import ToyConfig, ToyPlan, make_toy_graph, make_toy_inputs, make_toy_nodes

Slot = tuple[str, str]


class Cluster:
    """Runs the walks of one partition over several in-process ranks; delivers out of order."""

    def __init__(
        self, graph: ModelGraph, fns: Mapping[str, NodeFn], placement: Mapping[str, int], seed: int
    ) -> None:
        self.graph, self.fns, self.placement = graph, fns, placement
        self.rng = random.Random(seed)
        self.emitted: dict[tuple[str, str], list[Any]] = defaultdict(list)
        self.streamed: dict[Slot, list[Any]] = defaultdict(list)
        self.runners: dict[int, WalkRunner] = {}
        self.in_flight: list[tuple[int, ValueKey, Any]] = []

    def _flush(self) -> None:
        self.rng.shuffle(self.in_flight)
        batch, self.in_flight = self.in_flight, []
        for rank, key, value in batch:
            self.runners[rank].deliver(key, value)

    def ports(self, rank: int) -> Any:
        cluster = self

        class Ports:
            async def fire(self, node: str, inputs: Mapping[str, Any]) -> Mapping[str, Any]:
                await asyncio.sleep(0)  # let peers interleave, as engines do
                return cluster.fns[node](inputs)

            def send(self, to: int, items: list[tuple[ValueKey, Any]]) -> None:
                assert to != rank
                cluster.in_flight.extend((to, key, value) for key, value in items)
                asyncio.get_running_loop().call_soon(cluster._flush)

            def emit(self, node: str, name: str, modality: str, value: Any) -> None:
                cluster.emitted[(node, name)].append(value)

            def stream(self, node: str, edge: StreamingGraphEdge, value: Any) -> None:
                cluster.streamed[(edge.dst, edge.name)].append(value)

            def loop(
                self, node: str, inputs: Mapping[str, Any], max_iters: int | None, sink: Any
            ) -> None:
                return None  # these nodes have no native loop: fire per iteration

        return Ports()

    async def run_walk(self, walk: str, persistent: dict[Slot, Any]) -> None:
        nodes = self.graph.walk_nodes(walk)
        node_ranks = {n.name: self.placement[n.name] for n in nodes}
        self.runners = {
            r: WalkRunner(
                self.graph,
                walk,
                r,
                node_ranks,
                {s: v for s, v in persistent.items() if node_ranks.get(s[0]) == r},
                self.ports(r),
                "req",
            )
            for r in sorted(set(node_ranks.values()))
        }
        results = await asyncio.gather(*(runner.run() for runner in self.runners.values()))
        for persisted in results:
            persistent.update(persisted)


def by_output(emissions: list[Emission]) -> dict[tuple[str, str], list[Any]]:
    out: dict[tuple[str, str], list[Any]] = defaultdict(list)
    for e in emissions:
        out[(e.node, e.name)].append(e.value)
    return out


def assert_same(
    got: Mapping[tuple[str, str], list[Any]], want: Mapping[tuple[str, str], list[Any]]
) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert len(got[key]) == len(want[key]), key
        for a, b in zip(got[key], want[key], strict=True):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), key


@pytest.mark.parametrize("seed", range(6))
async def test_toy_image_walk_over_random_placements(seed: int) -> None:
    cfg = ToyConfig()
    graph, fns = make_toy_graph(cfg), make_toy_nodes(cfg, seed=seed)
    inputs = make_toy_inputs("a cat", cfg, seed=seed)
    rng = random.Random(seed)
    placement = {n: rng.randrange(3) for n in graph.nodes}
    want = by_output(run_reference(graph, fns, inputs, ToyPlan(), state="image"))
    cluster = Cluster(graph, fns, placement, seed)
    persistent = {(n, k): v for n, vals in inputs.items() for k, v in vals.items()}
    await cluster.run_walk("image_gen", persistent)
    assert_same(cluster.emitted, want)


@pytest.mark.parametrize("seed", range(4))
async def test_toy_lm_walks_persist_across_walks_and_stream(seed: int) -> None:
    cfg = ToyConfig()
    graph, fns = make_toy_graph(cfg), make_toy_nodes(cfg, seed=seed)
    inputs = make_toy_inputs("hello", cfg)
    placement = {n: random.Random(seed).randrange(2) for n in graph.nodes} | {"encoder": 1, "lm": 0}
    emissions = run_reference(graph, fns, inputs, ToyPlan(), state="speech")
    want = {k: v for k, v in by_output(emissions).items() if k[0] == "lm"}
    cluster = Cluster(graph, fns, placement, seed)
    persistent = {(n, k): v for n, vals in inputs.items() for k, v in vals.items()}
    for walk in ("prefill", "decode"):
        await cluster.run_walk(walk, persistent)
    assert_same(cluster.emitted, want)
    assert [int(t) for t in cluster.streamed[("vocoder", "token")]] == [
        int(t) for t in want[("lm", "token")]
    ]
    assert int(persistent[("lm", "token")]) == int(want[("lm", "token")][-1])


def remote_stop_graph() -> ModelGraph:
    # The stop signal comes from b; a (on another rank) must stop at the same iteration.
    a = GraphNode("a", {"x"}, [GraphEdge("b", "y"), GraphEdge(EMIT, "a_out", modality="latent")])
    b = GraphNode(
        "b",
        {"y", "limit"},
        [GraphEdge("a", "x"), GraphEdge("c", "x"), GraphEdge(EMIT, "b_out", modality="latent")],
        signals={"stop"},
    )
    c = GraphNode("c", {"x"}, [GraphEdge(EMIT, "final", modality="latent")])
    acc = GraphNode(
        "acc", {"x"}, [GraphEdge("acc", "x"), GraphEdge(EMIT, "hist", modality="latent")]
    )
    walk = Sequential(
        [
            DynamicLoop(Sequential([a, b]), max_iters=50, stop="stop"),
            Parallel([c, Loop(acc, 3, accumulated_outputs={"hist"})]),
        ]
    )
    return ModelGraph(
        {"w": walk},
        {"P": ["w"]},
        inputs={"a": {"x"}, "b": {"limit"}, "acc": {"x"}},
        nodes=[a, b, c, acc],
    )


@pytest.mark.parametrize(
    "placement",
    [dict(a=0, b=1, c=1, acc=0), dict(a=1, b=0, c=2, acc=2), dict(a=0, b=0, c=0, acc=0)],
)
@pytest.mark.parametrize("limit", [1, 4, 9])
async def test_remote_stop_signal_and_accumulation(placement: dict[str, int], limit: int) -> None:
    graph = remote_stop_graph()
    fns: dict[str, NodeFn] = {
        "a": lambda i: {"y": i["x"] * 2, "a_out": i["x"]},
        "b": lambda i: {"x": i["y"] + 1, "b_out": i["y"], "stop": bool(i["y"] > i["limit"])},
        "c": lambda i: {"final": i["x"] * 10},
        "acc": lambda i: {"x": i["x"] + 1, "hist": i["x"].reshape(1)},
    }
    inputs = {"a": {"x": torch.tensor(0.5)}, "b": {"limit": limit}, "acc": {"x": torch.tensor(0.0)}}

    class Once:
        def first_walk(self, partition: str, state: Any) -> str | None:
            return "w"

        def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
            return None

    want = by_output(run_reference(graph, fns, inputs, Once()))
    cluster = Cluster(graph, fns, placement, limit)
    await cluster.run_walk("w", {(n, k): v for n, vals in inputs.items() for k, v in vals.items()})
    assert_same(cluster.emitted, want)


async def test_a_failing_node_names_itself() -> None:
    graph = remote_stop_graph()

    def boom(i: Mapping[str, Any]) -> Mapping[str, Any]:
        raise RuntimeError("kaput")

    cluster = Cluster(
        graph, {"a": boom, "b": boom, "c": boom, "acc": boom}, dict(a=0, b=0, c=0, acc=0), 0
    )
    with pytest.raises(
        Exception, match=r"RuntimeError: kaput \(node 'a', walk 'w', request 'req'\)"
    ):
        await cluster.run_walk(
            "w", {("a", "x"): torch.tensor(0.0), ("b", "limit"): 1, ("acc", "x"): torch.tensor(0.0)}
        )
