"""StreamBuffer and chunk policies against the closed-form semantics of DESIGN.md §2.1."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mstar.streaming import (
    Chunk,
    FixedChunkPolicy,
    LeftContextChunkPolicy,
    SlidingWindowChunkPolicy,
    StreamBuffer,
)
from mstar.streaming.policies import ChunkPolicy


def expected_chunks(policy: ChunkPolicy, n: int) -> list[tuple[int, int, int, bool]]:
    """Return (start, end, context_len, is_last) per chunk, written from the spec table."""
    out: list[tuple[int, int, int, bool]] = []
    if isinstance(policy, FixedChunkPolicy):
        s = policy.size
        out = [(k * s, (k + 1) * s, 0, False) for k in range(n // s)]
        delivered = (n // s) * s
        final_start = delivered
    elif isinstance(policy, SlidingWindowChunkPolicy):
        w, st_ = policy.window, policy.stride
        k = 0
        while k * st_ + w <= n:
            out.append((k * st_, k * st_ + w, 0 if k == 0 else w - st_, False))
            k += 1
        delivered = 0 if k == 0 else (k - 1) * st_ + w
        final_start = n - min(w, n)
    else:
        c, lc = policy.chunk, policy.left_context
        for k in range(n // c):
            start = max(0, k * c - lc)
            out.append((start, (k + 1) * c, k * c - start, False))
        delivered = (n // c) * c
        final_start = max(0, delivered - lc)
    if delivered == n:
        out.append((n, n, 0, True))
    else:
        out.append((final_start, n, delivered - final_start, True))
    return out


def fire_count(policy: ChunkPolicy, n: int) -> int:
    """Return how many chunks are ready with n items buffered and the producer still running."""
    return len(expected_chunks(policy, n)) - 1


policies = st.one_of(
    st.builds(FixedChunkPolicy, st.integers(1, 9)),
    st.integers(1, 9).flatmap(
        lambda w: st.builds(SlidingWindowChunkPolicy, st.just(w), st.integers(1, w))
    ),
    st.builds(LeftContextChunkPolicy, st.integers(1, 9), st.integers(0, 12)),
)


@settings(max_examples=300, deadline=None)
@given(
    policy=policies,
    puts=st.lists(st.integers(0, 11), max_size=12),
    pop_between=st.lists(st.booleans(), max_size=12),
)
def test_chunks_match_spec_for_any_interleaving(
    policy: ChunkPolicy, puts: list[int], pop_between: list[bool]
) -> None:
    buf: StreamBuffer[int] = StreamBuffer(policy)
    got: list[Chunk[int]] = []
    n = 0
    for i, size in enumerate(puts):
        buf.put(list(range(n, n + size)))
        n += size
        if i < len(pop_between) and pop_between[i]:
            got.extend(buf.pop_ready())
            # Nothing fires before it is ready, and everything ready has fired.
            assert len(got) == fire_count(policy, n)
            assert not any(c.is_last for c in got)
    buf.close()
    assert not buf.is_drained
    got.extend(buf.pop_ready())
    assert buf.is_drained
    assert buf.pop_ready() == []

    want = expected_chunks(policy, n)
    assert [(c.start, c.end, c.context_len, c.is_last) for c in got] == want
    for c in got:
        assert c.items == tuple(range(c.start, c.end))  # items are the stream's, in order
    # Every item is delivered as new exactly once, in order.
    assert [x for c in got for x in c.new_items] == list(range(n))
    assert [c.is_last for c in got] == [False] * (len(got) - 1) + [True]


@given(policy=policies, n=st.integers(0, 2000))
@settings(max_examples=50, deadline=None)
def test_memory_is_bounded_by_the_window(policy: ChunkPolicy, n: int) -> None:
    buf: StreamBuffer[int] = StreamBuffer(policy)
    for i in range(n):
        buf.put([i])
        buf.pop_ready()
        assert len(buf._items) <= 9 + 12 + 256 + 1


def test_orpheus_window_28_stride_7() -> None:
    buf: StreamBuffer[int] = StreamBuffer(SlidingWindowChunkPolicy(28, 7))
    buf.put(list(range(27)))
    assert buf.pop_ready() == []
    buf.put([27])
    (first,) = buf.pop_ready()
    assert (first.start, len(first.items), first.context_len) == (0, 28, 0)
    buf.put(list(range(28, 40)))
    (second,) = buf.pop_ready()
    assert (second.start, len(second.items), second.context_len) == (7, 28, 21)
    buf.close()
    (last,) = buf.pop_ready()
    # 40 items: the final window is items 12..39; 35 were delivered, so 5 are new.
    assert (last.start, last.end, last.context_len, last.is_last) == (12, 40, 23, True)
    assert last.new_items == tuple(range(35, 40))


def test_close_on_empty_stream_gives_one_empty_last_chunk() -> None:
    for policy in (
        FixedChunkPolicy(3),
        SlidingWindowChunkPolicy(4, 2),
        LeftContextChunkPolicy(2, 5),
    ):
        buf: StreamBuffer[int] = StreamBuffer(policy)
        buf.close()
        assert buf.pop_ready() == [Chunk((), 0, 0, True)]


def test_put_after_close_is_an_error() -> None:
    buf: StreamBuffer[int] = StreamBuffer(FixedChunkPolicy(1))
    buf.close()
    with pytest.raises(RuntimeError, match="after close"):
        buf.put([1])


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: FixedChunkPolicy(0), "size must be >= 1"),
        (lambda: SlidingWindowChunkPolicy(0, 1), "window must be >= 1"),
        (lambda: SlidingWindowChunkPolicy(4, 0), r"stride must be in \[1, window=4\]"),
        (lambda: SlidingWindowChunkPolicy(4, 5), r"stride must be in \[1, window=4\]"),
        (lambda: LeftContextChunkPolicy(0, 1), "chunk must be >= 1"),
        (lambda: LeftContextChunkPolicy(3, -1), "left_context must be >= 0"),
    ],
)
def test_invalid_parameters_say_what_is_allowed(make: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()  # type: ignore[operator]
