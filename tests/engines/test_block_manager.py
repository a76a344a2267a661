"""BlockManager: "does not fit" as a value, copy-on-write forks, prefix sharing, LRU reuse."""

from __future__ import annotations

from mstar.engines import BlockManager, SamplingParams, Sequence
from tests.helpers import make_sequence


def test_append_allocates_whole_blocks_and_reports_when_full() -> None:
    bm = BlockManager(num_blocks=3, block_size=4)
    seq = make_sequence(list(range(10)))
    assert bm.blocks_needed(seq, 10) == 3
    assert bm.can_append(seq, 10) and bm.append(seq, 10) == []
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 0
    seq.num_computed_tokens = 10
    assert bm.can_append(seq, 2)  # slots 10, 11 are in the last block
    assert not bm.can_append(seq, 3)  # a fourth block does not exist: a value, no raise
    other = make_sequence([1])
    assert not bm.can_append(other, 1)
    bm.free(seq)
    assert bm.num_free_blocks == 3 and seq.block_table == [] and seq.num_computed_tokens == 0
    bm.check_invariants([])


def test_fork_shares_and_copies_the_partial_block_on_write() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    parent = make_sequence(list(range(6)))
    bm.append(parent, 6)
    parent.num_computed_tokens = 6
    child = make_sequence(list(range(6)), arrival=1)
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert bm.ref_counts[parent.block_table[0]] == 2
    bm.check_invariants([parent, child])
    shared_tail = parent.block_table[1]
    copies = bm.append(child, 1)  # the child writes slot 6 of the shared partial block
    assert copies == [(shared_tail, child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]  # full blocks stay shared
    assert bm.append(parent, 1) == []  # the parent now owns its tail alone
    bm.check_invariants([parent, child])
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == 8


def test_prefix_blocks_are_found_again_until_reused() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    first = make_sequence([1, 2, 3, 4, 5])
    bm.append(first, 5)
    first_blocks = list(first.block_table)
    bm.free(first)
    second = make_sequence([1, 2, 3, 4, 9], arrival=1)
    assert bm.allocate_cached_prefix(second) == 4  # two full blocks found
    assert second.block_table == first_blocks[:2]
    bm.append(second, 1)
    # The whole prompt cached: one token is still left to compute.
    third = make_sequence([1, 2, 3, 4], arrival=2)
    assert bm.allocate_cached_prefix(third) == 2
    bm.check_invariants([second, third])
    bm.free(second)
    bm.free(third)
    # Fill the cache with other tokens: the old prefix is evicted (least recently freed first).
    filler = make_sequence(list(range(100, 108)), arrival=3)
    bm.append(filler, 8)
    bm.free(filler)
    fourth = make_sequence([1, 2, 3, 4, 5], arrival=4)
    assert bm.allocate_cached_prefix(fourth) == 0
    bm.check_invariants([fourth])


def test_non_causal_sequences_do_not_share_by_hash() -> None:
    from mstar.engines import AttentionMask

    bm = BlockManager(num_blocks=8, block_size=2)
    a = Sequence("a", [1, 2, 3, 4, 5], SamplingParams(), arrival=0, mask=AttentionMask.full())
    bm.append(a, 5)
    b = Sequence("b", [1, 2, 3, 4, 5], SamplingParams(), arrival=1, mask=AttentionMask.full())
    assert bm.allocate_cached_prefix(b) == 0


def test_a_cached_prefix_is_not_revived_out_of_another_sequences_reservation() -> None:
    """A free block that still holds a cached prefix counts as free: taking it back for a new
    sequence must not eat into blocks held back for a reservation."""
    bm = BlockManager(num_blocks=3, block_size=2, enable_prefix_caching=True)
    done = make_sequence([1, 2, 3])
    bm.append(done, 3)
    done.num_computed_tokens = 3
    bm.free(done)  # its first block stays cached, free
    reserving = make_sequence([9], arrival=1)
    bm.append(reserving, 1)
    reserving.num_computed_tokens = 1
    assert bm.can_reserve(reserving, 5)
    bm.reserve(reserving, 5)  # the two free blocks are held back
    newcomer = make_sequence([1, 2, 7], arrival=2)
    assert bm.allocate_cached_prefix(newcomer) == 0  # the cached block is not taken
    assert bm.can_append(reserving, 4)
    bm.free(newcomer)
    bm.check_invariants([reserving])


def test_a_reservation_counts_the_copy_of_a_partial_block_the_cache_still_names() -> None:
    """A fork's child holding part of a full cached block: a newcomer may share that block
    before the child writes into it, and the write then copies it. The child's reservation
    holds that block back from the start."""
    bm = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=True)
    parent = make_sequence([1, 2, 3])
    bm.append(parent, 3)
    parent.num_computed_tokens = 3
    child = make_sequence([1], arrival=1)
    bm.fork(parent, child, 1)
    bm.free(parent)  # the child alone holds the first block, still cached as (1, 2)
    assert bm.can_reserve(child, 3)
    bm.reserve(child, 3)  # one block for token 3, one for the copy
    newcomer = make_sequence([1, 2, 5, 6, 7, 8, 9], arrival=2)
    assert bm.allocate_cached_prefix(newcomer) == 2  # shares the child's block
    assert not bm.can_append(newcomer, 5)  # three more blocks would leave the child short
    assert bm.can_append(child, 2)
    bm.free(newcomer)
    bm.check_invariants([child])
