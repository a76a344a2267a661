"""`ArenaAllocator`: aligned, non-overlapping slots, reused after free, coalesced."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mstar.transport.allocator import ArenaAllocator


def test_allocates_aligned_slots_until_full() -> None:
    alloc = ArenaAllocator(1024, alignment=64)
    offsets = [alloc.allocate(100) for _ in range(8)]
    assert offsets == [0, 128, 256, 384, 512, 640, 768, 896]
    assert alloc.allocate(1) is None
    assert not alloc.can_allocate(1)
    assert alloc.num_free_bytes == 0


def test_freed_slots_are_reused_and_coalesced() -> None:
    alloc = ArenaAllocator(1024, alignment=64)
    a, b, c = alloc.allocate(256), alloc.allocate(256), alloc.allocate(512)
    assert (a, b, c) == (0, 256, 512)
    alloc.free(a)
    alloc.free(b)
    # The two freed neighbours merged into one 512-byte block.
    assert alloc.allocate(512) == 0
    alloc.free(0)
    alloc.free(c)
    assert alloc.allocate(1024) == 0


def test_zero_byte_slots_get_distinct_offsets() -> None:
    alloc = ArenaAllocator(256, alignment=64)
    assert alloc.allocate(0) != alloc.allocate(0)


def test_double_free_and_foreign_offsets_raise() -> None:
    alloc = ArenaAllocator(256)
    offset = alloc.allocate(10)
    assert offset is not None
    alloc.free(offset)
    with pytest.raises(KeyError):
        alloc.free(offset)
    with pytest.raises(KeyError):
        alloc.free(3)


@pytest.mark.parametrize(("capacity", "alignment"), [(-1, 64), (64, 0), (64, 48)])
def test_invalid_parameters_raise(capacity: int, alignment: int) -> None:
    with pytest.raises(ValueError):
        ArenaAllocator(capacity, alignment)


class AllocatorModel(RuleBasedStateMachine):
    """Random allocate/free sequences against a model of live slots."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = ArenaAllocator(4096, alignment=64)
        self.live: dict[int, int] = {}

    @rule(nbytes=st.integers(0, 1500))
    def allocate(self, nbytes: int) -> None:
        could = self.alloc.can_allocate(nbytes)
        offset = self.alloc.allocate(nbytes)
        assert (offset is not None) == could
        if offset is not None:
            assert offset % 64 == 0 and offset not in self.live
            self.live[offset] = nbytes

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        offset = data.draw(st.sampled_from(sorted(self.live)))
        self.alloc.free(offset)
        del self.live[offset]

    @invariant()
    def slots_are_disjoint_and_inside(self) -> None:
        spans = sorted((o, o + max(64, -(-n // 64) * 64)) for o, n in self.live.items())
        for (_, end), (start, _) in itertools.pairwise(spans):
            assert end <= start
        assert all(end <= 4096 for _, end in spans)
        used = sum(end - start for start, end in spans)
        assert self.alloc.num_free_bytes == 4096 - used

    def teardown(self) -> None:
        for offset in list(self.live):
            self.alloc.free(offset)
        # Everything coalesced back into one block.
        assert self.alloc.allocate(4096) == 0


TestAllocatorModel = AllocatorModel.TestCase
TestAllocatorModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
