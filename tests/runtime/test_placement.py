"""Placement files: parsing, validation against a graph, clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from mstar.errors import PlacementError
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    ModelGraph,
    StreamingGraphEdge,
)
from mstar.runtime import Placement
from mstar.streaming import SlidingWindowChunkPolicy


@pytest.fixture
def graph() -> ModelGraph:
    llm = GraphNode(
        "LLM",
        {"tokens"},
        [GraphEdge("LLM", "tokens", persist=True), StreamingGraphEdge("snac_decoder", "tokens")],
        signals={"eos"},
    )
    snac = GraphNode("snac_decoder", {"tokens"}, [GraphEdge(EMIT, "audio", modality="audio")])
    return ModelGraph(
        {"prefill": llm, "decode": DynamicLoop(llm, 64, stop="eos"), "snac_chunk": snac},
        {"LLM": ["prefill", "decode"], "SNAC": ["snac_chunk"]},
        connections=[Connection("LLM", "SNAC", "tokens", SlidingWindowChunkPolicy(28, 7))],
        inputs={"LLM": {"tokens"}},
        name="orpheus",
    )


DISAGGREGATED = """
model: orpheus
node_groups:
  - {node_names: [LLM], ranks: [0], graph_walks: [prefill]}
  - {node_names: [LLM], ranks: [1], graph_walks: [decode]}
  - {node_names: [snac_decoder], ranks: [0, 2]}
"""


def test_prefill_decode_disaggregation(graph: ModelGraph, tmp_path: Path) -> None:
    path = tmp_path / "placement.yaml"
    path.write_text(DISAGGREGATED)
    placement = Placement.from_yaml(path)
    assert placement.ranks == (0, 1, 2)
    assert placement.resolve(graph, num_ranks=3) == {
        ("LLM", "prefill"): (0,),
        ("LLM", "decode"): (1,),
        ("snac_decoder", "snac_chunk"): (0, 2),
    }


def test_default_is_everything_on_rank_0(graph: ModelGraph) -> None:
    placement = Placement.colocated(graph)
    assert set(placement.resolve(graph, num_ranks=1).values()) == {(0,)}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "node_groups:\n  - {node_names: [GPU], ranks: [0]}\n",
            "node_groups\\[0\\]: unknown node 'GPU'",
        ),
        (
            "node_groups:\n  - {node_names: [LLM, snac_decoder], ranks: [5]}\n",
            "rank 5 is not available \\(ranks 0..1\\)",
        ),
        (
            "node_groups:\n  - {node_names: [LLM], ranks: [0]}\n",
            "node 'snac_decoder' in walk 'snac_chunk' has no placement",
        ),
        (
            "node_groups:\n  - {node_names: [LLM, snac_decoder], ranks: [0]}\n  - "
            "{node_names: [LLM], ranks: [1], graph_walks: [decode]}\n",
            "node_groups\\[1\\]: node 'LLM' in walk 'decode' is already placed",
        ),
        (
            "node_groups:\n  - {node_names: [LLM], ranks: [0], graph_walks: [typo]}\n",
            "unknown walk 'typo'",
        ),
        (
            "node_groups:\n  - {node_names: [snac_decoder], ranks: [0], graph_walks: [decode]}\n",
            "used by none of",
        ),
        ("node_groups:\n  - {node_names: [LLM], ranks: []}\n", "ranks is empty"),
        ("node_groups:\n  - {node_names: [LLM], ranks: [0, 0]}\n", "has duplicates"),
        (
            "node_groups:\n  - {node_names: [LLM], rank: [0]}\n",
            "Object contains unknown field `rank`",
        ),
        (
            "node_groups:\n  - {node_names: [LLM], ranks: [zero]}\n",
            "Expected `int`, got `str` - at `\\$.node_groups\\[0\\].ranks\\[0\\]`",
        ),
        ("model: bagel\nnode_groups: []\n", "placement is for model 'bagel', not 'orpheus'"),
        (
            "node_groups:\n  - {node_names: [LLM, snac_decoder], ranks: [0], tensor_parallel: 0}\n",
            "node_groups\\[0\\]: tensor_parallel must be >= 1, got 0",
        ),
        (
            "node_groups:\n  - {node_names: [LLM, snac_decoder], ranks: [0, 1], "
            "tensor_parallel: 4}\n",
            "node_groups\\[0\\]: tensor_parallel 4 needs a multiple of 4 ranks, got \\[0, 1\\]",
        ),
        (
            "node_groups:\n  - {node_names: [LLM], ranks: [0, 1], tensor_parallel: 2, "
            "graph_walks: [decode]}\n  - {node_names: [LLM, snac_decoder], ranks: [0], "
            "graph_walks: [prefill, snac_chunk]}\n",
            "serves its nodes in every walk",
        ),
        (
            "node_groups:\n  - {node_names: [LLM], ranks: [0, 1], tensor_parallel: 2}\n  - "
            "{node_names: [snac_decoder], ranks: [1, 0], tensor_parallel: 2}\n",
            "node_groups\\[1\\]: rank 1 is already in the tensor-parallel group of node_groups",
        ),
        ("node_groups: [\n", "not valid YAML"),
    ],
)
def test_bad_placements_say_what_is_wrong(graph: ModelGraph, text: str, message: str) -> None:
    with pytest.raises(PlacementError, match=message):
        Placement.from_yaml(text).resolve(graph, num_ranks=2)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PlacementError, match="does not exist"):
        Placement.from_yaml(tmp_path / "nope.yaml")


def test_kv_cache_shares_come_from_the_groups_on_a_rank() -> None:
    from mstar.runtime import EngineConfig

    placement = Placement.from_yaml(
        "node_groups:\n"
        "  - {node_names: [thinker], ranks: [0], kv_cache_share: 0.6}\n"
        "  - {node_names: [talker, code_predictor], ranks: [0, 1], kv_cache_share: 0.2}\n"
        "  - {node_names: [code2wav], ranks: [1]}\n"
    )
    assert placement.kv_cache_shares(0) == {"thinker": 0.6, "talker": 0.2, "code_predictor": 0.2}
    assert placement.kv_cache_shares(1) == {"talker": 0.2, "code_predictor": 0.2}
    config = EngineConfig(kv_cache_memory=1 << 20, kv_cache_shares={"talker": 0.3})
    worker = config.worker_config(0, 2, placement.kv_cache_shares(0))
    assert worker.kv_cache_memory == 1 << 20
    # the config wins
    assert worker.kv_cache_shares == {"thinker": 0.6, "talker": 0.3, "code_predictor": 0.2}
    bad = Placement.from_yaml(
        "node_groups:\n  - {node_names: [a], ranks: [0], kv_cache_share: 1.5}\n"
    )
    with pytest.raises(PlacementError, match=r"kv_cache_share must be in \(0, 1\]"):
        bad.kv_cache_shares(0)


def test_tensor_parallel_groups_shard_a_node_and_replicate_the_shards(graph: ModelGraph) -> None:
    text = (
        "node_groups:\n  - {node_names: [LLM], ranks: [0, 1, 2, 3], tensor_parallel: 2}\n"
        "  - {node_names: [snac_decoder], ranks: [1]}\n"
    )
    placement = Placement.from_yaml(text)
    # Walks go to each group's first rank (two replicas of a two-rank shard).
    assert placement.resolve(graph, num_ranks=4) == {
        ("LLM", "prefill"): (0, 2),
        ("LLM", "decode"): (0, 2),
        ("snac_decoder", "snac_chunk"): (1,),
    }
    assert placement.tensor_parallel_groups() == [(0, ("LLM",), (0, 1)), (0, ("LLM",), (2, 3))]
    assert placement.ranks == (0, 1, 2, 3)
    assert Placement.from_yaml(placement.to_yaml()) == placement
