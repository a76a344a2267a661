"""Paged KV-cache blocks: allocation, ref counts, copy-on-write forks, prefix sharing.

The cache is split into `num_blocks` blocks of `block_size` token slots. A sequence's
block table lists its blocks in order; token position `p` lives in slot
`block_table[p // block_size] * block_size + p % block_size`.

```
 sequence A  [ 7 | 2 | 9 ]          blocks 7 and 2 are full and hashed;
 sequence B  [ 7 | 2 | 4 ]          B forked from A (or hit A's prefix): ref(7) = ref(2) = 2
                       ^ a shared partial block is copied before either writes into it
```

Full blocks of causal sequences are registered under a hash of (previous block's hash,
their tokens); a later sequence with the same prefix reuses them instead of recomputing.
A block whose ref count drops to zero returns to the free list but keeps its hash until
it is handed out again (so a preempted or finished prefix is still found).

A fork may be taken at any point of the parent (`fork(parent, child, num_tokens)`: the
child shares the blocks covering that many tokens), and a sequence may be truncated back
to a mark (`truncate`: the blocks past it are released; a kept partial block that others
share is copied before it is written again, one nobody shares loses its prefix hash).
Reservations (`reserve`) hold free blocks back for a sequence that must never stall half
way (a rollout admitted whole): other sequences cannot take them.

The manager is pure bookkeeping ("does not fit" is a `False` from a `can_*` check, never
an exception); the model runner performs the block copies it asks for.
"""

from __future__ import annotations

from mstar.engines.sequence import Sequence

__all__ = ["BlockManager"]

_BlockKey = tuple[int, tuple[int, ...]]


class BlockManager:
    """Own the free list, ref counts and prefix-hash index of a paged KV cache."""

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True
    ) -> None:
        """Create a manager for `num_blocks` blocks of `block_size` slots."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # Insertion-ordered: the oldest freed block is handed out first (LRU eviction of
        # cached prefixes).
        self._free: dict[int, None] = dict.fromkeys(range(num_blocks))
        self._block_key: list[_BlockKey | None] = [None] * num_blocks
        self._block_hash: list[int | None] = [None] * num_blocks
        self._hash_to_block: dict[int, int] = {}
        self.num_reserved_blocks = 0  # sum of the sequences' `reserved_blocks`
        # Prefix-cache lookups (cumulative): tokens of new sequences looked up, and found.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        """Count the blocks no sequence holds (some may still hold a cached prefix)."""
        return len(self._free)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Count the fresh blocks `append(seq, num_new_tokens)` would take."""
        target = seq.num_computed_tokens + num_new_tokens
        needed = -(-target // self.block_size) - len(seq.block_table)
        needed = max(needed, 0)
        if self._needs_copy_on_write(seq):
            needed += 1
        return needed

    def _available_to(self, seq: Sequence) -> int:
        """Free blocks `seq` may take: its own reservation, and none of the others'."""
        return len(self._free) - (self.num_reserved_blocks - seq.reserved_blocks)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the cache can take `num_new_tokens` more computed tokens of `seq`."""
        return self.blocks_needed(seq, num_new_tokens) <= self._available_to(seq)

    def can_reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether blocks for `seq` to reach `num_tokens` computed tokens can be held back now."""
        return self._reservation(seq, num_tokens) <= self._available_to(seq)

    def reserve(self, seq: Sequence, num_tokens: int) -> None:
        """Hold back the blocks `seq` needs to reach `num_tokens` tokens (after `can_reserve`).

        The reservation shrinks as `append` takes those blocks and ends with `free`.
        """
        blocks = self._reservation(seq, num_tokens)
        self.num_reserved_blocks += blocks - seq.reserved_blocks
        seq.reserved_blocks = blocks

    def _reservation(self, seq: Sequence, num_tokens: int) -> int:
        needed = -(-num_tokens // self.block_size) - len(seq.block_table)
        # A shared partial block is copied on its first write: one block more. So is one the
        # prefix cache still names (a fork's child holding part of a full block): a new
        # sequence may share it before that write.
        return max(needed, 0) + int(self._needs_copy_on_write(seq) or self._cached_partial(seq))

    def append(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]]:
        """Make room for the next `num_new_tokens` of `seq`; return block copies to do first.

        Copies are `(src, dst)` block ids: a partial block shared with a fork is copied to
        a private block before this sequence writes into it (copy-on-write). Call only
        after `can_append` returned True.
        """
        copies: list[tuple[int, int]] = []
        if self._needs_copy_on_write(seq):
            index = seq.num_computed_tokens // self.block_size
            src = seq.block_table[index]
            dst = self._take_free_block(seq)
            self._release(src)
            seq.block_table[index] = dst
            copies.append((src, dst))
        elif seq.num_computed_tokens % self.block_size:
            # A partial block held by this sequence alone may still carry the hash of what
            # it held when full (before a fork at a mark or a truncation, once the others
            # let go): its tail is written again now.
            self._forget_hash(seq.block_table[seq.num_computed_tokens // self.block_size])
        target = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < target:
            seq.block_table.append(self._take_free_block(seq))
        if self.enable_prefix_caching and seq.is_prefix_cacheable:
            self._register_full_blocks(seq, target)
        return copies

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its longest known prefix.

        At least one token is left uncomputed so the step produces logits, and none of a
        walk's inputs whose rows it returns. Returns the number of tokens found (now
        counted as computed).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        if not (self.enable_prefix_caching and seq.is_prefix_cacheable):
            return 0
        size = self.block_size
        max_blocks = (seq.num_tokens - 1) // size
        if seq.output_mode == "hidden":
            # The walk returns its inputs' rows: they are computed, never found.
            max_blocks = min(max_blocks, seq.inputs_start // size)
        parent: int | None = None
        for index in range(max_blocks):
            key = (hash(parent), tuple(seq.token_ids[index * size : (index + 1) * size]))
            block_hash = hash(key)
            block = self._hash_to_block.get(block_hash)
            if block is None or self._block_key[block] != key:
                break
            if self.ref_counts[block] == 0:
                if self._available_to(seq) <= 0:
                    break  # a free cached block, but held back for another sequence's reservation
                del self._free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            parent = block_hash
        seq.num_computed_tokens = len(seq.block_table) * size
        self.prefix_queried_tokens += seq.num_tokens
        self.prefix_hit_tokens += seq.num_computed_tokens
        return seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence, num_tokens: int | None = None) -> None:
        """Share `parent`'s blocks holding its first `num_tokens` computed tokens with `child`.

        Default: all its computed tokens. The child's first write into a shared partial
        block copies it first (copy-on-write); so does the parent's.
        """
        assert not child.block_table, child
        count = parent.num_computed_tokens if num_tokens is None else num_tokens
        assert 0 <= count <= parent.num_computed_tokens, (count, parent)
        shared = parent.block_table[: -(-count // self.block_size)]
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        child.num_computed_tokens = count

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Roll `seq`'s cache back to its first `num_tokens` computed tokens.

        Blocks past the mark are released. The kept partial block, when nobody else holds
        it, loses its prefix hash (its tail is written again); a shared one is copied on the
        next write. The token list is the caller's (`Sequence.truncate`).
        """
        assert 0 <= num_tokens <= seq.num_computed_tokens, (num_tokens, seq)
        keep = -(-num_tokens // self.block_size)
        for block in reversed(seq.block_table[keep:]):
            self._release(block)
        del seq.block_table[keep:]
        seq.num_computed_tokens = num_tokens
        if num_tokens % self.block_size and self.ref_counts[seq.block_table[-1]] == 1:
            self._forget_hash(seq.block_table[-1])
        if seq.reserved_blocks:
            self.reserve(seq, 0)  # a reservation was sized for the old length

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; the sequence must be recomputed to run again."""
        # Tail first, so a shared prefix stays cached longest.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.num_reserved_blocks -= seq.reserved_blocks
        seq.reserved_blocks = 0

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        if seq.num_computed_tokens % self.block_size == 0:
            return False
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def _cached_partial(self, seq: Sequence) -> bool:
        if seq.num_computed_tokens % self.block_size == 0:
            return False
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self._block_key[seq.block_table[index]] is not None

    def _take_free_block(self, seq: Sequence) -> int:
        block = next(iter(self._free))
        del self._free[block]
        self._forget_hash(block)  # the block's cached content is about to be overwritten
        self.ref_counts[block] = 1
        if seq.reserved_blocks:
            seq.reserved_blocks -= 1
            self.num_reserved_blocks -= 1
        return block

    def _forget_hash(self, block: int) -> None:
        old_hash = self._block_hash[block]
        if old_hash is not None:
            if self._hash_to_block.get(old_hash) == block:
                del self._hash_to_block[old_hash]
            self._block_hash[block] = None
            self._block_key[block] = None

    def _release(self, block: int) -> None:
        count = self.ref_counts[block]
        assert count > 0, f"double free of block {block}"
        self.ref_counts[block] = count - 1
        if count == 1:
            self._free[block] = None

    def _register_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Index the blocks of `seq` that `num_tokens` written tokens make full."""
        size = self.block_size
        first = seq.num_computed_tokens // size
        last = num_tokens // size  # exclusive: blocks [first, last) become (or are) full
        parent = self._block_hash[seq.block_table[first - 1]] if first > 0 else None
        for index in range(first, last):
            block = seq.block_table[index]
            key = (hash(parent), tuple(seq.token_ids[index * size : (index + 1) * size]))
            block_hash = hash(key)
            if self._block_hash[block] is None:
                self._block_hash[block] = block_hash
                self._block_key[block] = key
                self._hash_to_block.setdefault(block_hash, block)
            parent = self._block_hash[block]

    def check_invariants(self, sequences: list[Sequence]) -> None:
        """Assert that ref counts equal the holds of `sequences` and the free list is exact.

        For tests and debugging: O(total blocks).
        """
        expected = [0] * self.num_blocks
        for seq in sequences:
            for block in seq.block_table:
                expected[block] += 1
        assert expected == self.ref_counts, (expected, self.ref_counts)
        free = {b for b, count in enumerate(self.ref_counts) if count == 0}
        assert free == set(self._free), (free, set(self._free))
        reserved = sum(seq.reserved_blocks for seq in sequences)
        assert reserved == self.num_reserved_blocks, (reserved, self.num_reserved_blocks)
        assert reserved <= len(self._free), (reserved, len(self._free))
        for block_hash, block in self._hash_to_block.items():
            assert self._block_hash[block] == block_hash, (block, block_hash)
