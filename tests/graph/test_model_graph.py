"""ModelGraph construction, validation errors and the text IR."""

from __future__ import annotations

import pytest

from mstar.errors import GraphValidationError
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    Loop,
    ModelGraph,
    Parallel,
    Sequential,
    StreamingGraphEdge,
)
from mstar.streaming import FixedChunkPolicy, SlidingWindowChunkPolicy
from mstar.zoo.toy import make_toy_graph


def orpheus_like(**overrides: object) -> ModelGraph:
    llm = GraphNode(
        "LLM",
        {"tokens"},
        [GraphEdge("LLM", "tokens", persist=True), StreamingGraphEdge("snac", "codes")],
        signals={"eos"},
    )
    snac = GraphNode("snac", {"codes"}, [GraphEdge(EMIT, "audio", modality="audio")])
    kwargs: dict[str, object] = dict(
        walks={
            "prefill": llm,
            "decode": DynamicLoop(llm, max_iters=16, stop="eos"),
            "snac_chunk": snac,
        },
        partitions={"LLM": ["prefill", "decode"], "SNAC": ["snac_chunk"]},
        connections=[Connection("LLM", "SNAC", "codes", SlidingWindowChunkPolicy(28, 7))],
        inputs={"LLM": {"tokens"}},
        name="orpheus-like",
    )
    kwargs.update(overrides)
    return ModelGraph(**kwargs)  # type: ignore[arg-type]


def test_valid_graph_maps_nodes_and_walks_to_partitions() -> None:
    g = orpheus_like()
    assert g.node_partition == {"LLM": "LLM", "snac": "SNAC"}
    assert g.walk_partition == {"prefill": "LLM", "decode": "LLM", "snac_chunk": "SNAC"}
    assert g.stream_inputs("snac") == {"codes"}
    edge = g.nodes["LLM"].outputs[1]
    assert isinstance(edge, StreamingGraphEdge)
    assert g.connection_for("LLM", edge).policy == SlidingWindowChunkPolicy(28, 7)


def test_text_ir_is_readable() -> None:
    text = str(orpheus_like())
    assert text.splitlines() == [
        "model orpheus-like",
        "  inputs: LLM.tokens",
        "  node LLM(tokens) -> tokens -> LLM (persist), codes ~> snac (stream); signals: eos",
        "  node snac(codes) -> audio -> EMIT[audio]",
        "  partition LLM",
        "    walk prefill = LLM",
        "    walk decode =",
        "      DynamicLoop(max_iters=16, stop=eos)",
        "        LLM",
        "  partition SNAC",
        "    walk snac_chunk = snac",
        "  connection LLM -> SNAC: codes, SlidingWindowChunkPolicy(window=28, stride=7)",
    ]


def test_toy_graph_prints_every_primitive() -> None:
    text = str(make_toy_graph())
    for word in (
        "Sequential",
        "Parallel",
        "Loop(max_iters=6, accumulated_outputs=[norm])",
        "DynamicLoop",
    ):
        assert word in text


def test_walks_may_name_nodes_by_string() -> None:
    a = GraphNode("a", {"x"}, [GraphEdge("b", "y")])
    b = GraphNode("b", {"y"}, [GraphEdge(EMIT, "y", modality="latent")])
    g = ModelGraph({"w": Sequential(["a", "b"])}, {"P": ["w"]}, inputs={"a": {"x"}}, nodes=[a, b])
    assert g.walk_nodes("w") == [a, b]


def _node(
    name: str,
    inputs: set[str],
    *outs: GraphEdge | StreamingGraphEdge,
    signals: set[str] | None = None,
) -> GraphNode:
    return GraphNode(name, inputs, outs, signals=signals or set())


def _one_walk(
    section: object, inputs: dict[str, set[str]] | None = None, **kw: object
) -> ModelGraph:
    return ModelGraph({"w": section}, {"P": ["w"]}, inputs=inputs, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "message"),
    [
        # unknown and duplicate node names
        (lambda: _one_walk(Sequential(["missing"])), "walk 'w' refers to unknown node 'missing'"),
        (
            lambda: _one_walk(
                Sequential(
                    [_node("a", set(), GraphEdge(EMIT, "o", modality="text")), _node("a", set())]
                )
            ),
            "duplicate node name 'a'",
        ),
        # edges
        (
            lambda: _one_walk(_node("a", set(), GraphEdge("ghost", "x"))),
            "node 'a' has edge 'x' to unknown node 'ghost'",
        ),
        (
            lambda: _one_walk(
                Sequential([_node("a", set(), GraphEdge("b", "x")), _node("b", {"y"})]),
                {"b": {"y"}},
            ),
            "edge 'x' from 'a' to 'b': 'b' has no input 'x'",
        ),
        # inputs nothing provides
        (lambda: _one_walk(_node("a", {"x"})), "input 'x' of node 'a' is provided by nothing"),
        (
            lambda: _one_walk(
                Sequential([_node("b", {"x"}), _node("a", set(), GraphEdge("b", "x"))])
            ),
            "input 'x' of node 'b' is provided by nothing before the node runs",
        ),
        (
            lambda: _one_walk(_node("a", set()), {"a": {"nope"}}),
            r"request inputs \['nope'\] are not inputs of node 'a'",
        ),
        (
            lambda: _one_walk(_node("a", set()), {"zz": {"x"}}),
            "request inputs name unknown node 'zz'",
        ),
        # loops
        (lambda: Loop(_node("a", set()), 0), "Loop max_iters must be an integer >= 1, got 0"),
        (
            lambda: DynamicLoop(_node("a", set()), -3),
            "DynamicLoop max_iters must be an integer >= 1, got -3",
        ),
        (
            lambda: _one_walk(DynamicLoop(_node("a", set()), stop="done")),
            "walk 'w' can never terminate: DynamicLoop stop signal 'done' is raised by no "
            "node of its body",
        ),
        (
            lambda: _one_walk(DynamicLoop(_node("a", set()), max_iters=3, stop="done")),
            "walk 'w' never stops early",
        ),
        (
            lambda: _one_walk(Loop(_node("a", set()), 2, accumulated_outputs={"z"})),
            r"walk 'w': Loop accumulates \['z'\], which no node of its body outputs",
        ),
        # parallel branches
        (
            lambda: _one_walk(
                Sequential(
                    [
                        Parallel(
                            [
                                _node("a", set(), GraphEdge("c", "x")),
                                _node("b", set(), GraphEdge("c", "x")),
                            ]
                        ),
                        _node("c", {"x"}),
                    ]
                )
            ),
            "walk 'w': Parallel branches 0 and 1 both write input 'x' of 'c'",
        ),
        # edges to EMIT
        (lambda: GraphEdge(EMIT, "x"), "needs modality= one of"),
        (lambda: GraphEdge(EMIT, "x", modality="smell"), "needs modality= one of"),
        (lambda: GraphEdge("a", "x", modality="text"), "modality is only for edges to EMIT"),
    ],
)
def test_validation_errors_name_the_culprit(build: object, message: str) -> None:
    with pytest.raises(GraphValidationError, match=message):
        build()  # type: ignore[operator]


def test_streaming_edge_without_chunk_policy() -> None:
    with pytest.raises(
        GraphValidationError,
        match="streaming edge 'codes' from 'LLM' to 'snac' has no chunk policy",
    ):
        orpheus_like(connections=[])


def test_streaming_edge_inside_one_partition() -> None:
    with pytest.raises(GraphValidationError, match="stays inside partition 'ALL'"):
        orpheus_like(partitions={"ALL": ["prefill", "decode", "snac_chunk"]}, connections=[])


def test_plain_edge_across_partitions() -> None:
    a = _node("a", set(), GraphEdge("b", "x"))
    b = _node("b", {"x"})
    with pytest.raises(GraphValidationError, match="crosses partitions: use a StreamingGraphEdge"):
        ModelGraph({"wa": a, "wb": b}, {"A": ["wa"], "B": ["wb"]})


def test_connection_checks() -> None:
    policy = FixedChunkPolicy(1)
    with pytest.raises(GraphValidationError, match="names unknown partition 'Nope'"):
        orpheus_like(
            connections=[
                Connection("LLM", "SNAC", "codes", policy),
                Connection("LLM", "Nope", "codes", policy),
            ]
        )
    with pytest.raises(GraphValidationError, match="is declared twice"):
        orpheus_like(connections=[Connection("LLM", "SNAC", "codes", policy)] * 2)
    with pytest.raises(GraphValidationError, match="carries nothing"):
        orpheus_like(
            connections=[
                Connection("LLM", "SNAC", "codes", policy),
                Connection("SNAC", "LLM", "codes", policy),
            ]
        )
    with pytest.raises(GraphValidationError, match="policy must be a chunk policy"):
        Connection("LLM", "SNAC", "codes", 3)  # type: ignore[arg-type]


def test_partition_checks() -> None:
    with pytest.raises(GraphValidationError, match="partition 'SNAC' lists unknown walk 'nope'"):
        orpheus_like(partitions={"LLM": ["prefill", "decode"], "SNAC": ["snac_chunk", "nope"]})
    with pytest.raises(GraphValidationError, match="walk 'snac_chunk' is in no partition"):
        orpheus_like(partitions={"LLM": ["prefill", "decode"]})
    with pytest.raises(GraphValidationError, match="walk 'decode' is in two partitions"):
        orpheus_like(partitions={"LLM": ["prefill", "decode"], "SNAC": ["snac_chunk", "decode"]})
    with pytest.raises(
        GraphValidationError, match="node 'LLM' is used by partitions 'LLM' and 'SNAC'"
    ):
        orpheus_like(partitions={"LLM": ["prefill"], "SNAC": ["snac_chunk", "decode"]})


def test_node_definition_errors() -> None:
    with pytest.raises(GraphValidationError, match="'EMIT' is reserved"):
        GraphNode(EMIT)
    with pytest.raises(GraphValidationError, match="take a set of names, not a string"):
        GraphNode("a", "xy")
    with pytest.raises(GraphValidationError, match="two edges 'x' to 'b'"):
        GraphNode("a", outputs=[GraphEdge("b", "x"), GraphEdge("b", "x", persist=True)])
    with pytest.raises(GraphValidationError, match="both signals and edge names"):
        GraphNode("a", outputs=[GraphEdge("b", "x")], signals={"x"})
    with pytest.raises(GraphValidationError, match="node 'lonely' is in no walk"):
        orpheus_like(nodes=[GraphNode("lonely")])
