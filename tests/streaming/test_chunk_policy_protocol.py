"""`ChunkPolicy` is an open protocol: the buffer's contract holds for any policy, built in or not.

A policy written here, outside the runtime (fire after a separator item), and the assistant's
`SentenceChunkPolicy` run through the same `StreamBuffer`, the reference interpreter and the
conductor as the built-in ones; the properties below hold for every one of them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.errors import GraphValidationError
from mstar.graph import (
    EMIT,
    Connection,
    DynamicLoop,
    GraphEdge,
    GraphNode,
    ModelGraph,
    StreamingGraphEdge,
    run_reference,
)
from mstar.streaming import (
    Chunk,
    ChunkPolicy,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
    StreamBuffer,
)
from mstar.zoo.assistant.sentences import SentenceChunkPolicy

SEP = 0  # the separator item of `UntilSeparator`


@dataclass(frozen=True)
class UntilSeparator:
    """Fire when a separator item arrives (the chunk ends with it); no left context."""

    continue_after_done: ClassVar[bool] = False

    def next_window(
        self, items: Sequence[Any], num_delivered: int, num_chunks: int
    ) -> tuple[int, int] | None:
        for i in range(num_delivered, len(items)):
            if items[i] == SEP:
                return (num_delivered, i + 1)
        return None

    def final_start(self, num_items: int, num_delivered: int) -> int:
        return num_delivered

    def retained_from(self, num_delivered: int) -> int:
        return num_delivered


# Token classes of a made-up vocabulary: 1 ends a sentence, 2 a clause, ids >= 5 start words.
SENTENCES = SentenceChunkPolicy(
    frozenset({1}), frozenset({2}), frozenset(range(5, 10)), max_tokens=6
)

policies = st.one_of(
    st.builds(FixedChunkPolicy, st.integers(1, 6)),
    st.integers(1, 6).flatmap(
        lambda w: st.builds(SlidingWindowChunkPolicy, st.just(w), st.integers(1, w))
    ),
    st.builds(LeftContextChunkPolicy, st.integers(1, 6), st.integers(0, 8)),
    st.just(UntilSeparator()),
    st.builds(
        SentenceChunkPolicy,
        st.just(frozenset({1})),
        st.just(frozenset({2})),
        st.just(frozenset(range(5, 10))),
        st.integers(1, 8),
        st.just(1),
        st.booleans(),
    ),
)


def _drain(policy: ChunkPolicy, items: list[int], puts: list[int]) -> list[Chunk[int]]:
    buf: StreamBuffer[int] = StreamBuffer(policy)
    chunks: list[Chunk[int]] = []
    pos = 0
    for size in puts:
        buf.put(items[pos : pos + size])
        pos += size
        if (chunk := buf.next_chunk()) is not None:
            chunks.append(chunk)
    buf.put(items[pos:])
    buf.close()
    while (chunk := buf.next_chunk()) is not None:
        chunks.append(chunk)
    assert buf.is_over and buf.next_chunk() is None
    return chunks


@given(
    policy=policies,
    items=st.lists(st.integers(0, 9), max_size=40),
    puts=st.lists(st.integers(0, 5), max_size=10),
)
@settings(max_examples=300, deadline=None)
def test_every_item_is_delivered_as_new_once_in_order(
    policy: ChunkPolicy, items: list[int], puts: list[int]
) -> None:
    chunks = _drain(policy, items, puts)
    assert [c.is_last for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert [x for c in chunks for x in c.new_items] == items
    delivered = 0
    for c in chunks:
        assert c.items == tuple(items[c.start : c.end])  # consecutive stream items
        assert c.start + c.context_len == delivered  # left context is what was delivered
        delivered = c.end if c.items else delivered


@given(
    items=st.lists(st.integers(0, 9), max_size=60), puts=st.lists(st.integers(0, 7), max_size=12)
)
@settings(max_examples=300, deadline=None)
def test_sentence_chunks_end_at_boundaries_or_their_length(
    items: list[int], puts: list[int]
) -> None:
    policy = SENTENCES
    chunks = _drain(policy, items, puts)
    for c in chunks[:-1]:
        assert 1 <= len(c.items) <= policy.max_tokens
        # It ends before a word starts (at a sentence, a clause or a word), or it is full.
        assert items[c.end] in policy.word_starts or len(c.items) == policy.max_tokens
        # No sentence boundary inside a chunk: it would have fired there.
        for i in range(policy.min_tokens, len(c.items)):
            assert not (c.items[i - 1] in policy.sentence_ends and c.items[i] in policy.word_starts)


def test_sentence_waits_for_the_word_after_it() -> None:
    buf: StreamBuffer[int] = StreamBuffer(SENTENCES)
    buf.put([5, 6, 1])  # "word word ." : 3.14 or "e.g" would continue without a space
    assert buf.next_chunk() is None
    buf.put([3])  # not a word start: no boundary
    assert buf.next_chunk() is None
    buf.put([7, 1, 8])
    chunk = buf.next_chunk()
    assert chunk is not None and chunk.items == (5, 6, 1, 3, 7, 1)


def test_first_chunk_also_fires_on_a_clause() -> None:
    for first_clause, want in ((True, (5, 2)), (False, (5, 2, 6, 1))):
        policy = SentenceChunkPolicy(
            frozenset({1}), frozenset({2}), frozenset(range(5, 10)), 6, 1, first_clause
        )
        buf: StreamBuffer[int] = StreamBuffer(policy)
        buf.put([5, 2, 6, 1, 7, 2, 8])
        chunk = buf.next_chunk()
        assert chunk is not None and chunk.items == want


def test_a_policy_that_goes_back_or_skips_is_an_error() -> None:
    @dataclass(frozen=True)
    class Skipping(UntilSeparator):
        def next_window(
            self, items: Sequence[Any], num_delivered: int, num_chunks: int
        ) -> tuple[int, int] | None:
            return (
                (num_delivered + 1, num_delivered + 2) if len(items) >= num_delivered + 2 else None
            )

    buf: StreamBuffer[int] = StreamBuffer(Skipping())
    buf.put([1, 2, 3])
    with pytest.raises(ValueError, match="skip none"):
        buf.next_chunk()


def test_continue_after_done_is_the_buffer_s_decision() -> None:
    buf: StreamBuffer[int] = StreamBuffer(FixedChunkPolicy(2, continue_after_done=True))
    buf.put([1, 2, 3])
    buf.close()
    assert buf.next_chunk() == Chunk((1, 2), 0, 0, False)
    assert buf.next_chunk() == Chunk((3,), 2, 0, True)
    for _ in range(3):  # the consumer keeps firing; its state machine decides when to stop
        assert buf.next_chunk() == Chunk((), 3, 0, True)
    assert not buf.is_over


def test_a_connection_takes_any_policy_and_rejects_what_is_not_one() -> None:
    Connection("A", "B", "x", UntilSeparator())
    with pytest.raises(GraphValidationError, match="must be a chunk policy"):
        Connection("A", "B", "x", object())  # type: ignore[arg-type]


def test_reference_interpreter_runs_a_policy_defined_outside_the_runtime() -> None:
    producer = GraphNode(
        "producer",
        {"i"},
        [GraphEdge("producer", "i"), StreamingGraphEdge("consumer", "item")],
        signals={"done"},
    )
    consumer = GraphNode("consumer", {"item"}, [GraphEdge(EMIT, "group", modality="text")])
    graph = ModelGraph(
        name="separated",
        walks={"produce": DynamicLoop(producer, max_iters=100, stop="done"), "consume": consumer},
        partitions={"P": ["produce"], "C": ["consume"]},
        connections=[Connection("P", "C", "item", UntilSeparator())],
        inputs={"producer": {"i"}},
    )
    stream = [4, 5, SEP, 6, SEP, 7]

    class Plan:
        def first_walk(self, partition: str, state: Any) -> str:
            return "produce" if partition == "P" else "consume"

        def next_walk(self, partition: str, state: Any, finished: str) -> str | None:
            return None if partition == "P" else "consume"

    def produce(inputs: Mapping[str, Any]) -> dict[str, Any]:
        i = inputs["i"]
        return {"i": i + 1, "item": stream[i], "done": i + 1 == len(stream)}

    def consume(inputs: Mapping[str, Any]) -> dict[str, Any]:
        return {"group": list(inputs["item"].new_items)}

    emitted = run_reference(
        graph, {"producer": produce, "consumer": consume}, {"producer": {"i": 0}}, Plan()
    )
    assert [e.value for e in emitted] == [[4, 5, SEP], [6, SEP], [7]]


def test_a_list_marker_joins_its_sentence() -> None:
    buf: StreamBuffer[int] = StreamBuffer(SENTENCES)  # min_tokens 4
    buf.put([5, 1, 6, 7, 8, 1, 9])  # "1. Do this now. Then" : "1." alone is not a sentence
    chunk = buf.next_chunk()
    assert chunk is not None and chunk.items == (5, 1, 6, 7, 8, 1)
