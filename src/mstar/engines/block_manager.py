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
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
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

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether the cache can take `num_new_tokens` more computed tokens of `seq`."""
        return self.blocks_needed(seq, num_new_tokens) <= len(self._free)

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
            dst = self._take_free_block()
            self._release(src)
            seq.block_table[index] = dst
            copies.append((src, dst))
        target = seq.num_computed_tokens + num_new_tokens
        while len(seq.block_table) * self.block_size < target:
            seq.block_table.append(self._take_free_block())
        if self.enable_prefix_caching and seq.is_prefix_cacheable:
            self._register_full_blocks(seq, target)
        return copies

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Give a new sequence the cached blocks of its longest known prefix.

        At least one token is left uncomputed so the step produces logits. Returns the
        number of tokens found (now counted as computed).
        """
        assert not seq.block_table and seq.num_computed_tokens == 0, seq
        if not (self.enable_prefix_caching and seq.is_prefix_cacheable):
            return 0
        size = self.block_size
        max_blocks = (seq.num_tokens - 1) // size
        parent: int | None = None
        for index in range(max_blocks):
            key = (hash(parent), tuple(seq.token_ids[index * size : (index + 1) * size]))
            block_hash = hash(key)
            block = self._hash_to_block.get(block_hash)
            if block is None or self._block_key[block] != key:
                break
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            parent = block_hash
        seq.num_computed_tokens = len(seq.block_table) * size
        return seq.num_computed_tokens

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Share all of `parent`'s blocks with `child` (copy-on-write on the partial one)."""
        assert not child.block_table, child
        for block in parent.block_table:
            self.ref_counts[block] += 1
        child.block_table = list(parent.block_table)
        child.num_computed_tokens = parent.num_computed_tokens

    def free(self, seq: Sequence) -> None:
        """Drop `seq`'s hold on its blocks; the sequence must be recomputed to run again."""
        # Tail first, so a shared prefix stays cached longest.
        for block in reversed(seq.block_table):
            self._release(block)
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _needs_copy_on_write(self, seq: Sequence) -> bool:
        if seq.num_computed_tokens % self.block_size == 0:
            return False
        index = seq.num_computed_tokens // self.block_size
        return index < len(seq.block_table) and self.ref_counts[seq.block_table[index]] > 1

    def _take_free_block(self) -> int:
        block = next(iter(self._free))
        del self._free[block]
        old_hash = self._block_hash[block]
        if old_hash is not None:
            # The block's cached content is about to be overwritten.
            if self._hash_to_block.get(old_hash) == block:
                del self._hash_to_block[old_hash]
            self._block_hash[block] = None
            self._block_key[block] = None
        self.ref_counts[block] = 1
        return block

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
        for block_hash, block in self._hash_to_block.items():
            assert self._block_hash[block] == block_hash, (block, block_hash)
